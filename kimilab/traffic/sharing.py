"""Sharing structure: a few measured numbers that say how a trace's prompts reuse each other, and
a seeded family of generated traces with one knob for each.

Chapter 6 found that which checkpoint policy wins depends on *where* reuse ends. A hybrid
model resumes only where a KDA state was kept; a policy that keeps states at request ends
reaches a reused prefix only if it ends where an earlier prompt ended. :func:`sharing_stats`
measures that on any trace (in arrival order, as an infinite cache would see it):

* ``common``: share of requests that open with a common prefix: a first block that
  ``COMMON_BRANCHES`` or more different second blocks follow (a system prompt that many
  conversations go on from; one session's own turns and forks rarely branch right there);
* ``mid``: share of the reusable tokens that lie past the last earlier request end on the
  reused path, so only a state inside a prompt reaches them (``1 - mid`` of the reuse ends
  at request ends);
* ``turns``: requests per session, estimated (traces carry no session ids): a request
  continues the newest not yet continued request whose whole blocks it contains;
* ``prompt``: mean prompt tokens; ``reuse``: the infinite-cache hit rate (token-weighted);
* ``fresh_per_min``: prompt tokens that no earlier request holds, in a busy minute (the 90th
  percentile of the trace's minutes): how fast the cache must take in new prefixes. A cache
  of N tokens then *reaches* N / ``fresh_per_min`` minutes back.

:func:`sharing_traffic` generates conversation traffic whose ``common`` and ``mid`` are set by
two knobs: the chance that a session opens with the shared system prompt, and the chance
that a turn *forks*: it resumes from a random point inside the previous prompt (an edited
message, a retried tool call) instead of from its end. Every other shape (lengths, turns, think
time, rate) is the Mooncake-like generator's, calibrated to the Kimi conversation trace.
"""

from __future__ import annotations

import math

import numpy as np

from kimilab.traffic.request import DEFAULT_BLOCK_SIZE, Request
from kimilab.traffic.segments import Spec, Uids, draw_lengths, sorted_specs, specs_to_trace
from kimilab.validate import check_float, check_int

__all__ = ["sharing_stats", "sharing_traffic", "STAT_NAMES"]

STAT_NAMES = ("common", "mid", "turns", "prompt", "reuse", "fresh_per_min")
COMMON_BRANCHES = 8


def _whole_blocks(record: Request, block_size: int) -> int:
    return min(len(record.hash_ids), record.input_length // block_size)


def sharing_stats(records, block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """The sharing statistics of a trace in arrival order (see the module docstring)."""
    if not records:
        raise ValueError("records: expected a non-empty trace")
    check_int("block_size", block_size, 1)
    seen: set = set()
    ends: set = set()  # last whole block of every earlier prompt
    open_end: dict = {}  # ... of the prompts no later request has continued yet -> its index
    session: list[int] = []
    fresh_by_minute: dict = {}
    reuse = at_end = tokens = 0
    for i, r in enumerate(records):
        ids, lengths = r.hash_ids, r.block_lengths(block_size)
        matched = 0
        while matched < len(ids) and ids[matched] in seen:
            matched += 1
        end = next((j for j in range(matched, 0, -1) if ids[j - 1] in ends), 0)
        cont = next((j for j in range(matched, 0, -1) if ids[j - 1] in open_end), 0)
        session.append(session[open_end.pop(ids[cont - 1])] if cont else i)
        minute = (r.arrival_ms - records[0].arrival_ms) // 60_000
        fresh_by_minute[minute] = fresh_by_minute.get(minute, 0) + int(lengths[matched:].sum())
        reuse += int(lengths[:matched].sum())
        at_end += int(lengths[:end].sum())
        tokens += int(lengths.sum())
        seen.update(ids)
        whole = _whole_blocks(r, block_size)
        if whole:
            ends.add(ids[whole - 1])
            open_end[ids[whole - 1]] = i
    after: dict = {}  # first block -> the different second blocks that follow it
    for r in records:
        if r.hash_ids:
            after.setdefault(r.hash_ids[0], set()).update(r.hash_ids[1:2])
    popular = {h for h, seconds in after.items() if len(seconds) >= COMMON_BRANCHES}
    common = sum(bool(r.hash_ids) and r.hash_ids[0] in popular for r in records)
    per_minute = [fresh_by_minute.get(m, 0) for m in range(int(max(fresh_by_minute)) + 1)]
    return {
        "requests": len(records),
        "common": common / len(records),
        "mid": 1.0 - at_end / reuse if reuse else 0.0,
        "turns": len(records) / len(set(session)),
        "prompt": tokens / len(records),
        "reuse": reuse / tokens if tokens else 0.0,
        "fresh_per_min": float(np.percentile(per_minute, 90)),
    }


def _specs(seed: int, *, common: float, fork: float, fork_returns: bool, duration_s: float,
           requests_per_s: float, system_len: int, opening_median: float, opening_sigma: float,
           document_prob: float, document_median: float, mean_turns: float, user_len: float, reply_len: float,
           think_ms: float, max_input: int) -> list[Spec]:
    rng = np.random.default_rng(seed)
    uid = Uids()
    system = uid()
    duration_ms = duration_s * 1000.0
    n_sessions = int(rng.poisson(duration_s * requests_per_s / mean_turns))
    starts = np.sort(rng.uniform(0.0, duration_ms, n_sessions))  # Poisson given the count
    turns = rng.geometric(1.0 / mean_turns, n_sessions)
    shared = rng.random(n_sessions) < common
    openings = rng.lognormal(math.log(opening_median), opening_sigma, n_sessions)
    documents = rng.lognormal(math.log(document_median), 0.6, n_sessions)
    openings = np.rint(openings + np.where(rng.random(n_sessions) < document_prob, documents, 0.0))
    out: list[tuple[float, int, Spec]] = []
    for s in range(n_sessions):
        n = int(turns[s])
        users = draw_lengths(rng, user_len, n, sigma=1.0)
        replies = draw_lengths(rng, reply_len, n, sigma=0.8, hi=4096)
        gaps = rng.exponential(think_ms, n)
        forks, cuts = rng.random(n) < fork, rng.random(n)
        head = [(system, system_len)] if shared[s] else []
        history = head + [(uid(), int(max(1, openings[s])))]
        t = float(starts[s])
        for k in range(n):
            if k and forks[k]:  # resume inside the previous prompt: keep a random share of it
                branch = _cut(history[:-1], len(head), cuts[k]) + [(uid(), int(users[k]))]
                if fork_returns:  # a side request; the session carries on from its main line
                    if sum(length for _, length in branch) <= max_input and t < duration_ms:
                        out.append((t, len(out), Spec(0, tuple(branch), int(replies[k]), s)))
                    t += gaps[k] + 20.0 * replies[k]
                    continue
                history = branch
            elif k:
                history.append((uid(), int(users[k])))
            if sum(length for _, length in history) > max_input or t >= duration_ms:
                break  # the conversation outgrew the context window / the window ended
            out.append((t, len(out), Spec(0, tuple(history), int(replies[k]), s)))
            history.append((uid(), int(replies[k])))
            t += gaps[k] + 20.0 * replies[k]  # think time + time to stream the reply
    return sorted_specs(out)


def _cut(history: list, keep_from: int, share: float) -> list:
    """The first ``share`` of ``history``'s tokens after its first ``keep_from`` segments (kept whole)."""
    fixed = sum(length for _, length in history[:keep_from])
    budget = int(share * (sum(length for _, length in history) - fixed))
    out = list(history[:keep_from])
    for seg, length in history[keep_from:]:
        if budget <= 0:
            break
        out.append((seg, min(length, budget)))
        budget -= length
    return out


def sharing_traffic(seed: int = 0, *, common: float = 1.0, fork: float = 0.0, fork_returns: bool = False,
                    duration_s: float = 900.0,
                    requests_per_s: float = 3.34, system_len: int = 1000, opening_median: float = 4100.0,
                    opening_sigma: float = 0.9, document_prob: float = 0.08, document_median: float = 40_000.0,
                    mean_turns: float = 3.0, user_len: float = 250.0, reply_len: float = 340.0,
                    think_ms: float = 60_000.0, max_input: int = 131_072,
                    block_size: int = DEFAULT_BLOCK_SIZE) -> list[Request]:
    """Conversation traffic with a knob for each sharing statistic (generated, seeded).

    ``common``: the chance that a session opens with the shared ``system_len``-token system
    prompt (otherwise its first block is its own). ``fork``: the chance that a turn after
    the first resumes from a uniformly random point of the previous prompt past the system
    prompt (keeping that share of its tokens) instead of from its end, then adds its
    message; the session carries on from the fork (an edited chat message), or, with
    ``fork_returns``, from where it was (a side request: a retried tool call, a sub-agent).
    ``mean_turns`` sets turns per session. The defaults are
    :func:`~kimilab.traffic.mooncake_conversation_like`'s shapes (prompt lengths, turns,
    replies, think time) at the Kimi trace's 3.34 requests per second, for ``duration_s``.
    """
    for name, value, lo, hi in (("common", common, 0.0, 1.0), ("fork", fork, 0.0, 1.0),
                                ("duration_s", duration_s, 1.0, 86_400.0),
                                ("requests_per_s", requests_per_s, 1e-3, 1e3),
                                ("mean_turns", mean_turns, 1.0, 1e3)):
        if not lo <= check_float(name, value) <= hi:  # bounded: the trace's size follows from them
            raise ValueError(f"{name}={value!r}: expected a number in [{lo:g}, {hi:g}]")
    check_int("system_len", system_len, block_size, unit=f"tokens (>= block_size={block_size})")
    specs = _specs(seed, common=common, fork=fork, fork_returns=bool(fork_returns), duration_s=duration_s,
                   requests_per_s=requests_per_s, system_len=system_len, opening_median=opening_median,
                   opening_sigma=opening_sigma, document_prob=document_prob, document_median=document_median,
                   mean_turns=mean_turns,
                   user_len=user_len, reply_len=reply_len, think_ms=think_ms, max_input=max_input)
    return specs_to_trace(specs, block_size)
