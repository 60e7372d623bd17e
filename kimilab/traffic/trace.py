"""Traffic for prefix-caching experiments: seeded workloads and Mooncake traces.

Every generator here is seeded with ``numpy.random.default_rng`` and returns the
same requests on every machine. A workload is built in two steps:

1. A *spec* per request: arrival time (simulated ms), output length, and the
   prompt as a list of *segments* ``(uid, length)``. A segment is a piece of
   text with its own identity (the shared system prompt, one user message,
   one reply, one tool output ...). Two prompts share a prefix exactly when
   their segment lists agree up to that point.
2. Either the tokens are materialised (segment ``uid`` -> seeded token ids)
   into :class:`Request` objects, or, for traces too large to hold as tokens,
   the Mooncake block ids are computed straight from the segments.

The Mooncake trace format (one JSON object a line) is what Moonshot published
for Kimi's serving platform (FAST'25)::

    {"timestamp": 0, "input_length": 1203, "output_length": 52, "hash_ids": [0, 1, 2]}

``hash_ids[j]`` names the whole prompt prefix up to and including block ``j``
(blocks of ``block_size`` tokens, the last one may be partial); ids are
assigned 0, 1, 2, ... in order of first appearance, so two requests share
``hash_ids[j]`` exactly when their first ``j + 1`` blocks are identical.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "Request",
    "TraceRecord",
    "chat_sessions",
    "agent_loops",
    "document_qa",
    "mooncake_conversation_like",
    "to_trace",
    "write_trace",
    "load_trace",
    "parse_line",
    "generate_trace",
    "trace_to_jsonl",
    "check_chain",
    "record_tokens",
    "records_to_requests",
    "trace_stats",
    "reuse_upper_bound",
    "DATASETS",
    "regenerate",
]

DEFAULT_BLOCK_SIZE = 512
DEFAULT_VOCAB = 50_000
_TOKEN_SALT = 0x6B696D69  # "kimi": separates segment-content streams from other seeds
_BLOCK_SALT = 0x6C616221  # separates trace-block token streams


# --------------------------------------------------------------------------- data types


def _check_int(value, name: str, *, minimum: int = 0) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return int(value)


@dataclass(frozen=True, eq=False)
class Request:
    """One prompt arriving at a server: token ids plus how many tokens it will generate."""

    request_id: int
    arrival_ms: int  # simulated time, integer milliseconds
    tokens: np.ndarray  # int32 [input_length]
    output_length: int
    session: int  # which conversation / task / document-reader it belongs to

    def __post_init__(self) -> None:
        _check_int(self.request_id, "Request.request_id")
        _check_int(self.arrival_ms, "Request.arrival_ms")
        _check_int(self.output_length, "Request.output_length")
        _check_int(self.session, "Request.session")
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"Request.tokens: expected a 1-D integer array, got dtype={tokens.dtype} "
                f"shape={tokens.shape}"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
            raise ValueError("Request.tokens: expected ids in [0, 2**31 - 1]")
        tokens = tokens.astype(np.int32, copy=True)
        tokens.setflags(write=False)
        object.__setattr__(self, "tokens", tokens)

    @property
    def input_length(self) -> int:
        return int(self.tokens.size)


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake trace: when, how long in and out, and the prompt's block ids."""

    timestamp: int  # ms
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        _check_int(self.timestamp, "TraceRecord.timestamp")
        _check_int(self.input_length, "TraceRecord.input_length")
        _check_int(self.output_length, "TraceRecord.output_length")
        ids = tuple(int(_check_int(h, "TraceRecord.hash_ids[]")) for h in self.hash_ids)
        object.__setattr__(self, "hash_ids", ids)

    def n_blocks(self, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
        return -(-self.input_length // block_size)

    def block_lengths(self, block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
        """Tokens in each block (all ``block_size`` except possibly the last)."""
        n = self.n_blocks(block_size)
        lengths = np.full(n, block_size, dtype=np.int64)
        if n:
            lengths[-1] = self.input_length - (n - 1) * block_size
        return lengths

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


# --------------------------------------------------------------------------- segment model


@dataclass(frozen=True)
class _Spec:
    """A request before tokens exist: its prompt as (segment uid, length) pairs."""

    arrival_ms: int
    segments: tuple[tuple[int, int], ...]
    output_length: int
    session: int

    @property
    def input_length(self) -> int:
        return sum(length for _, length in self.segments)


class _Uids:
    """Hands out fresh segment identities 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> int:
        uid = self.next
        self.next += 1
        return uid


def _lengths(rng: np.random.Generator, mean: float, size, *, sigma: float = 0.6,
             lo: int = 1, hi: int | None = None) -> np.ndarray:
    """Log-normal integer lengths with the given mean (before clipping to [lo, hi])."""
    if mean <= 0:
        raise ValueError(f"mean length={mean!r}: expected > 0")
    mu = math.log(mean) - 0.5 * sigma * sigma
    x = np.rint(rng.lognormal(mu, sigma, size)).astype(np.int64)
    return np.clip(x, lo, hi if hi is not None else np.iinfo(np.int64).max)


def _poisson_times_ms(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    """Arrival times (float ms) of a Poisson process with ``rate_per_s`` events per second."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s={rate_per_s!r}: expected > 0")
    gaps = rng.exponential(1000.0 / rate_per_s, n)
    return np.cumsum(gaps) - gaps[0]  # first arrival at t = 0


def _sorted_specs(specs: list[tuple[float, int, _Spec]]) -> list[_Spec]:
    """Order by (arrival, creation order) and round arrivals to whole ms."""
    specs.sort(key=lambda item: (item[0], item[1]))
    out = []
    for t, _, spec in specs:
        out.append(_Spec(int(t), spec.segments, spec.output_length, spec.session))
    return out


def _segment_tokens(uid: int, length: int, seed: int, vocab_size: int) -> np.ndarray:
    rng = np.random.default_rng([_TOKEN_SALT, seed, uid])
    return rng.integers(0, vocab_size, length, dtype=np.int32)


def _materialise(specs: Sequence[_Spec], seed: int, vocab_size: int) -> list[Request]:
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size!r}: expected >= 2")
    store: dict[int, np.ndarray] = {}
    requests = []
    for i, spec in enumerate(specs):
        parts = []
        for uid, length in spec.segments:
            seg = store.get(uid)
            if seg is None or seg.size < length:
                seg = store[uid] = _segment_tokens(uid, length, seed, vocab_size)
            parts.append(seg[:length])
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        requests.append(Request(i, spec.arrival_ms, tokens, spec.output_length, spec.session))
    return requests


def _specs_to_trace(specs: Sequence[_Spec], block_size: int) -> list[TraceRecord]:
    """Chained block ids straight from segments (no tokens): same answer as ``to_trace``."""
    block_size = _check_int(block_size, "block_size", minimum=1)
    table: dict[tuple, int] = {}
    records = []
    for spec in specs:
        ids: list[int] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        fill = 0
        for uid, length in spec.segments:
            offset = 0
            while offset < length:
                take = min(length - offset, block_size - fill)
                pieces.append((uid, offset, offset + take))
                offset += take
                fill += take
                if fill == block_size:
                    parent = table.setdefault((parent, tuple(pieces)), len(table))
                    ids.append(parent)
                    pieces, fill = [], 0
        if pieces:
            ids.append(table.setdefault((parent, tuple(pieces)), len(table)))
        records.append(TraceRecord(spec.arrival_ms, spec.input_length, spec.output_length, tuple(ids)))
    return records


# --------------------------------------------------------------------------- generators


def _chat_specs(n_sessions: int, seed: int, *, mean_turns: float, max_turns: int,
                system_len: int, user_len: float, reply_len: float, session_rate_per_s: float,
                think_ms: float) -> list[_Spec]:
    _check_int(n_sessions, "n_sessions", minimum=1)
    _check_int(max_turns, "max_turns", minimum=1)
    _check_int(system_len, "system_len", minimum=0)
    if mean_turns < 1:
        raise ValueError(f"mean_turns={mean_turns!r}: expected >= 1")
    rng = np.random.default_rng(seed)
    uid = _Uids()
    system = uid()
    starts = _poisson_times_ms(rng, n_sessions, session_rate_per_s)
    turns = np.minimum(1 + rng.poisson(mean_turns - 1, n_sessions), max_turns)
    out: list[tuple[float, int, _Spec]] = []
    for s in range(n_sessions):
        n = int(turns[s])
        users = _lengths(rng, user_len, n)
        replies = _lengths(rng, reply_len, n)
        gaps = rng.exponential(think_ms, n)
        history: list[tuple[int, int]] = [(system, system_len)] if system_len else []
        t = float(starts[s])
        for k in range(n):
            history.append((uid(), int(users[k])))
            out.append((t, len(out), _Spec(0, tuple(history), int(replies[k]), s)))
            history.append((uid(), int(replies[k])))  # the reply is re-sent next turn
            t += gaps[k]
    return _sorted_specs(out)


def chat_sessions(n_sessions: int = 60, *, seed: int = 0, mean_turns: float = 5.0,
                  max_turns: int = 16, system_len: int = 1200, user_len: float = 250.0,
                  reply_len: float = 350.0, session_rate_per_s: float = 0.5,
                  think_ms: float = 20_000.0, vocab_size: int = DEFAULT_VOCAB) -> list[Request]:
    """Multi-turn chat: every turn re-sends system prompt + whole history + a new message.

    Sessions start as a Poisson process (``session_rate_per_s``); turns within a
    session are ``think_ms`` apart on average (exponential); turns per session
    are ``1 + Poisson(mean_turns - 1)`` capped at ``max_turns``. The previous
    turn's reply (``output_length`` tokens) is part of the next prompt.
    """
    specs = _chat_specs(n_sessions, seed, mean_turns=mean_turns, max_turns=max_turns,
                        system_len=system_len, user_len=user_len, reply_len=reply_len,
                        session_rate_per_s=session_rate_per_s, think_ms=think_ms)
    return _materialise(specs, seed, vocab_size)


def _agent_specs(n_tasks: int, seed: int, *, tool_prompt_len: int, task_len: float,
                 mean_steps: float, action_len: float, tool_output_len: float,
                 branch_prob: float, n_branches: int, sub_steps: int,
                 task_rate_per_s: float, step_ms: float) -> list[_Spec]:
    _check_int(n_tasks, "n_tasks", minimum=1)
    _check_int(tool_prompt_len, "tool_prompt_len", minimum=0)
    _check_int(n_branches, "n_branches", minimum=1)
    _check_int(sub_steps, "sub_steps", minimum=1)
    if not 0.0 <= branch_prob <= 1.0:
        raise ValueError(f"branch_prob={branch_prob!r}: expected a probability in [0, 1]")
    if mean_steps < 1:
        raise ValueError(f"mean_steps={mean_steps!r}: expected >= 1")
    rng = np.random.default_rng(seed)
    uid = _Uids()
    tools = uid()
    starts = _poisson_times_ms(rng, n_tasks, task_rate_per_s)
    steps = 1 + rng.poisson(mean_steps - 1, n_tasks)
    out: list[tuple[float, int, _Spec]] = []

    def run(context: list, n_steps: int, t: float, session: int) -> tuple[list, float]:
        """One agent loop: call the model, get an action, append action + tool output."""
        actions = _lengths(rng, action_len, n_steps)
        outputs = _lengths(rng, tool_output_len, n_steps, sigma=0.9)
        gaps = rng.exponential(step_ms, n_steps)
        for k in range(n_steps):
            out.append((t, len(out), _Spec(0, tuple(context), int(actions[k]), session)))
            context = context + [(uid(), int(actions[k])), (uid(), int(outputs[k]))]
            t += gaps[k]
        return context, t

    for task in range(n_tasks):
        context = [(tools, tool_prompt_len)] if tool_prompt_len else []
        context.append((uid(), int(_lengths(rng, task_len, 1)[0])))
        t = float(starts[task])
        for step in range(int(steps[task])):
            context, t = run(context, 1, t, task)
            if step + 1 < steps[task] and rng.random() < branch_prob:
                # Sub-tasks fork from this exact context, run in parallel, then the
                # main loop resumes with a summary of their results appended.
                ends = []
                for _ in range(n_branches):
                    instruction = [(uid(), int(_lengths(rng, task_len, 1)[0]))]
                    _, t_end = run(context + instruction, sub_steps, t, task)
                    ends.append(t_end)
                context = context + [(uid(), int(_lengths(rng, tool_output_len, 1)[0]))]
                t = max(ends)
    return _sorted_specs(out)


def agent_loops(n_tasks: int = 16, *, seed: int = 0, tool_prompt_len: int = 6000,
                task_len: float = 300.0, mean_steps: float = 8.0, action_len: float = 120.0,
                tool_output_len: float = 500.0, branch_prob: float = 0.25, n_branches: int = 3,
                sub_steps: int = 3, task_rate_per_s: float = 0.2, step_ms: float = 3_000.0,
                vocab_size: int = DEFAULT_VOCAB) -> list[Request]:
    """Agent / tool loops: a long shared tool prompt, tool outputs appended step by step.

    Each task: tool prompt (shared by all tasks) + task text, then ``1 +
    Poisson(mean_steps - 1)`` steps; each step's prompt is the previous one plus
    the model's action (its ``output_length``) and the tool's output. After a
    step, with probability ``branch_prob``, ``n_branches`` sub-tasks fork from
    that same context (each adds its own instruction and runs ``sub_steps``
    steps); the main loop then resumes with their summary appended.
    """
    specs = _agent_specs(n_tasks, seed, tool_prompt_len=tool_prompt_len, task_len=task_len,
                         mean_steps=mean_steps, action_len=action_len,
                         tool_output_len=tool_output_len, branch_prob=branch_prob,
                         n_branches=n_branches, sub_steps=sub_steps,
                         task_rate_per_s=task_rate_per_s, step_ms=step_ms)
    return _materialise(specs, seed, vocab_size)


def _document_specs(n_questions: int, seed: int, *, n_documents: int, system_len: int,
                    doc_len: float, question_len: float, answer_len: float, zipf_a: float,
                    followup_prob: float, rate_per_s: float) -> list[_Spec]:
    _check_int(n_questions, "n_questions", minimum=1)
    _check_int(n_documents, "n_documents", minimum=1)
    _check_int(system_len, "system_len", minimum=0)
    if not 0.0 <= followup_prob < 1.0:
        raise ValueError(f"followup_prob={followup_prob!r}: expected a probability in [0, 1)")
    rng = np.random.default_rng(seed)
    uid = _Uids()
    system = uid()
    docs = [(uid(), int(n)) for n in _lengths(rng, doc_len, n_documents, sigma=0.5)]
    popularity = 1.0 / np.arange(1, n_documents + 1) ** zipf_a
    popularity /= popularity.sum()
    times = _poisson_times_ms(rng, n_questions, rate_per_s)
    picks = rng.choice(n_documents, n_questions, p=popularity)
    out: list[tuple[float, int, _Spec]] = []
    produced = 0
    reader = 0
    while produced < n_questions:
        base = [(system, system_len)] if system_len else []
        context = base + [docs[int(picks[reader])]]
        t = float(times[reader])
        # A reader asks one question, then follow-ups with probability followup_prob.
        while produced < n_questions:
            context = context + [(uid(), int(_lengths(rng, question_len, 1)[0]))]
            answer = int(_lengths(rng, answer_len, 1)[0])
            out.append((t, len(out), _Spec(0, tuple(context), answer, reader)))
            produced += 1
            context = context + [(uid(), answer)]
            t += rng.exponential(15_000.0)
            if rng.random() >= followup_prob:
                break
        reader += 1
    return _sorted_specs(out)


def document_qa(n_questions: int = 300, *, seed: int = 0, n_documents: int = 12,
                system_len: int = 400, doc_len: float = 8000.0, question_len: float = 60.0,
                answer_len: float = 200.0, zipf_a: float = 1.1, followup_prob: float = 0.3,
                rate_per_s: float = 1.0, vocab_size: int = DEFAULT_VOCAB) -> list[Request]:
    """Shared-document Q&A: many readers ask about a few popular documents.

    Prompt = system prompt + document + question (+ earlier Q&A of the same
    reader for follow-ups). Readers arrive as a Poisson process; each picks a
    document with Zipf(``zipf_a``) popularity and asks follow-ups with
    probability ``followup_prob``.
    """
    specs = _document_specs(n_questions, seed, n_documents=n_documents, system_len=system_len,
                            doc_len=doc_len, question_len=question_len, answer_len=answer_len,
                            zipf_a=zipf_a, followup_prob=followup_prob, rate_per_s=rate_per_s)
    return _materialise(specs, seed, vocab_size)


def _conversation_specs(seed: int, *, duration_s: float, n_sessions: int, system_len: int,
                        opening_median: float, opening_sigma: float, document_prob: float,
                        document_median: float, document_sigma: float, mean_turns: float,
                        user_len: float, reply_len: float, think_ms: float,
                        max_input: int) -> list[_Spec]:
    rng = np.random.default_rng(seed)
    uid = _Uids()
    system = uid()
    duration_ms = duration_s * 1000.0
    starts = np.sort(rng.uniform(0.0, duration_ms, n_sessions))  # Poisson given the count
    turns = rng.geometric(1.0 / mean_turns, n_sessions)
    openings = rng.lognormal(math.log(opening_median), opening_sigma, n_sessions)
    documents = rng.lognormal(math.log(document_median), document_sigma, n_sessions)
    openings = np.rint(openings + np.where(rng.random(n_sessions) < document_prob, documents, 0.0))
    out: list[tuple[float, int, _Spec]] = []
    for s in range(n_sessions):
        n = int(turns[s])
        users = _lengths(rng, user_len, n, sigma=1.0)
        replies = _lengths(rng, reply_len, n, sigma=0.8, hi=4096)
        gaps = rng.exponential(think_ms, n)
        history = [(system, system_len), (uid(), int(max(1, openings[s])))]
        length = system_len + int(max(1, openings[s]))
        t = float(starts[s])
        for k in range(n):
            if k:
                history.append((uid(), int(users[k])))
                length += int(users[k])
            if length > max_input or t >= duration_ms:
                break  # the conversation outgrew the context window / the hour ended
            out.append((t, len(out), _Spec(0, tuple(history), int(replies[k]), s)))
            history.append((uid(), int(replies[k])))
            length += int(replies[k])
            t += gaps[k] + 20.0 * replies[k]  # think time + time to stream the reply
    return _sorted_specs(out)


def mooncake_conversation_like(seed: int = 0, *, duration_s: float = 3600.0,
                               n_sessions: int = 4150, system_len: int = 1000,
                               opening_median: float = 4100.0, opening_sigma: float = 0.9,
                               document_prob: float = 0.08, document_median: float = 40_000.0,
                               document_sigma: float = 0.6,
                               mean_turns: float = 3.0, user_len: float = 250.0,
                               reply_len: float = 340.0, think_ms: float = 60_000.0,
                               max_input: int = 131_072,
                               block_size: int = DEFAULT_BLOCK_SIZE) -> list[TraceRecord]:
    """A trace shaped like Mooncake's published conversation trace, as TraceRecords.

    Targets (Mooncake FAST'25 conversation trace): ~12,000 requests in an hour,
    input mean ~12k / p50 ~7k / p99 ~85k tokens, output mean ~340, one common
    first block. Structure: ``n_sessions`` conversations start uniformly in the
    hour; each opens with a log-normal "opening" (context + question; with
    probability ``document_prob`` plus a long pasted document, which makes the
    heavy p99 tail) after a shared ``system_len``-token system prompt, then runs a geometric
    number of turns (mean ``mean_turns``), each re-sending the history plus the
    previous reply and a new message. Turns beyond the hour or beyond
    ``max_input`` tokens are dropped. Records are produced straight from the
    segment structure (no tokens; the full trace would be ~150M tokens).
    """
    if system_len < block_size:
        raise ValueError(
            f"system_len={system_len!r}: expected >= block_size={block_size} so that every "
            "request shares its first block"
        )
    specs = _conversation_specs(seed, duration_s=duration_s, n_sessions=n_sessions,
                                system_len=system_len, opening_median=opening_median,
                                opening_sigma=opening_sigma, document_prob=document_prob,
                                document_median=document_median,
                                document_sigma=document_sigma, mean_turns=mean_turns,
                                user_len=user_len, reply_len=reply_len, think_ms=think_ms,
                                max_input=max_input)
    return _specs_to_trace(specs, block_size)


_SPEC_BUILDERS = {
    "chat": (lambda: chat_sessions, lambda n, seed, **kw: _chat_specs(n, seed, **kw)),
    "agent": (lambda: agent_loops, lambda n, seed, **kw: _agent_specs(n, seed, **kw)),
    "document": (lambda: document_qa, lambda n, seed, **kw: _document_specs(n, seed, **kw)),
}


def generate_trace(kind: str, n: int, *, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                   **params) -> list[TraceRecord]:
    """Records of a chat / agent / document workload without materialising tokens.

    Same parameters and defaults as :func:`chat_sessions`, :func:`agent_loops`,
    :func:`document_qa` (``n`` is their first argument; ``vocab_size`` is not
    needed). Equal to ``to_trace(<generator>(n, seed=seed, **params), block_size)``
    but cheap for traces of millions of tokens.
    """
    import inspect

    if kind not in _SPEC_BUILDERS:
        raise ValueError(f"kind={kind!r}: expected one of {sorted(_SPEC_BUILDERS)} "
                         "(for the Mooncake-like trace call mooncake_conversation_like)")
    public, build = _SPEC_BUILDERS[kind]
    defaults = {name: p.default for name, p in inspect.signature(public()).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("seed", "vocab_size")}
    unknown = set(params) - set(defaults)
    if unknown:
        raise ValueError(f"params {sorted(unknown)}: not parameters of {public().__name__}; "
                         f"expected some of {sorted(defaults)}")
    specs = build(n, seed, **{**defaults, **params})
    return _specs_to_trace(specs, block_size)


# --------------------------------------------------------------------------- trace export


def to_trace(requests: Iterable[Request], block_size: int = DEFAULT_BLOCK_SIZE) -> list[TraceRecord]:
    """Mooncake records for token-level requests (chained ids, order of first appearance).

    Block ``j``'s id is looked up by (id of block ``j - 1``, the block's exact
    tokens), so equal ids mean equal prefixes with no hash collisions possible.
    Requests must come in non-decreasing arrival order.
    """
    block_size = _check_int(block_size, "block_size", minimum=1)
    table: dict[tuple[int, bytes], int] = {}
    records = []
    last = 0
    for i, req in enumerate(requests):
        if req.arrival_ms < last:
            raise ValueError(
                f"requests[{i}].arrival_ms={req.arrival_ms} < previous {last}: expected "
                "requests in non-decreasing arrival order"
            )
        last = req.arrival_ms
        tokens = req.tokens
        parent = -1
        ids = []
        for start in range(0, tokens.size, block_size):
            key = (parent, tokens[start:start + block_size].tobytes())
            parent = table.setdefault(key, len(table))
            ids.append(parent)
        records.append(TraceRecord(req.arrival_ms, req.input_length, req.output_length, tuple(ids)))
    return records


def trace_to_jsonl(records: Iterable[TraceRecord]) -> str:
    """The exact text ``write_trace`` writes (one JSON object a line, '\\n' endings)."""
    return "".join(r.to_json() + "\n" for r in records)


def write_trace(path, records: Iterable[TraceRecord]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(trace_to_jsonl(records))
    return path


_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def parse_line(text: str, lineno: int = 1, block_size: int = DEFAULT_BLOCK_SIZE) -> TraceRecord:
    """One validated trace line; ValueError messages start with ``line {lineno}:``."""
    where = f"line {lineno}"
    if not text.strip():
        raise ValueError(f"{where}: empty line; expected one JSON object per line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in _FIELDS:
        if name not in obj:
            raise ValueError(f"{where}: field '{name}' missing; required fields are {list(_FIELDS)}")
    values = {}
    for name in _FIELDS[:3]:
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: field '{name}'={v!r}: expected a non-negative int")
        if v < 0:
            raise ValueError(f"{where}: field '{name}'={v!r}: expected a non-negative int")
        values[name] = v
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"{where}: field 'hash_ids'={ids!r}: expected a list of non-negative ints")
    for j, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(
                f"{where}: field 'hash_ids'[{j}]={h!r}: expected a non-negative int"
            )
    expected = -(-values["input_length"] // block_size)
    if len(ids) != expected:
        raise ValueError(
            f"{where}: field 'hash_ids' has {len(ids)} ids; expected ceil(input_length="
            f"{values['input_length']} / block_size={block_size}) = {expected}"
        )
    return TraceRecord(values["timestamp"], values["input_length"], values["output_length"],
                       tuple(ids))


def load_trace(path, block_size: int = DEFAULT_BLOCK_SIZE, *, require_sorted: bool = True,
               chained: bool = False) -> list[TraceRecord]:
    """Read and validate a Mooncake jsonl trace; any bad line raises ValueError naming it.

    Checks per line: valid JSON object, the four fields present, non-negative
    ints, ``len(hash_ids) == ceil(input_length / block_size)``, and (with
    ``require_sorted``) timestamps non-decreasing. Extra fields are ignored.
    With ``chained=True`` also :func:`check_chain`. Nothing is returned unless
    every line passed.
    """
    block_size = _check_int(block_size, "block_size", minimum=1)
    records = []
    last = None
    with open(path, "r", encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            record = parse_line(text, lineno, block_size)
            if require_sorted and last is not None and record.timestamp < last:
                raise ValueError(
                    f"line {lineno}: field 'timestamp'={record.timestamp} < {last} on the "
                    "previous line; expected non-decreasing timestamps (require_sorted=False "
                    "to allow)"
                )
            last = record.timestamp
            records.append(record)
    if chained:
        check_chain(records)
    return records


def check_chain(records: Sequence[TraceRecord]) -> None:
    """Raise ValueError (naming the line) if an id ever has two different parents.

    In a chained trace an id stands for one whole prefix, so it always sits at
    the same block position behind the same parent id.
    """
    parent_of: dict[int, int] = {}
    for lineno, record in enumerate(records, start=1):
        parent = -1
        for j, h in enumerate(record.hash_ids):
            seen = parent_of.setdefault(h, parent)
            if seen != parent:
                raise ValueError(
                    f"line {lineno}: field 'hash_ids'[{j}]={h} follows {parent}, but an earlier "
                    f"line has it after {seen}; expected chained prefix ids"
                )
            parent = h
    return None


# --------------------------------------------------------------------------- trace -> tokens


def _block_tokens(h: int, block_size: int, vocab_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([_BLOCK_SALT, seed, h])
    return rng.integers(0, vocab_size, block_size, dtype=np.int32)


def record_tokens(record: TraceRecord, block_size: int = DEFAULT_BLOCK_SIZE, *,
                  vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> np.ndarray:
    """Deterministic token ids for a record: block ``h``'s tokens are a function of ``h``.

    A partial last block takes the first tokens of its id's stream, so equal
    ids always give equal tokens and (with overwhelming probability for
    realistic block sizes and vocabularies) different ids give different tokens.
    """
    lengths = record.block_lengths(block_size)
    if len(record.hash_ids) != lengths.size:
        raise ValueError(
            f"record.hash_ids has {len(record.hash_ids)} ids; expected ceil(input_length="
            f"{record.input_length} / block_size={block_size}) = {lengths.size}"
        )
    parts = [_block_tokens(h, block_size, vocab_size, seed)[:n]
             for h, n in zip(record.hash_ids, lengths)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def records_to_requests(records: Sequence[TraceRecord], block_size: int = DEFAULT_BLOCK_SIZE, *,
                        vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> list[Request]:
    """Token-level requests for a (small) trace; ``to_trace`` of them gives the ids back."""
    return [
        Request(i, r.timestamp, record_tokens(r, block_size, vocab_size=vocab_size, seed=seed),
                r.output_length, 0)
        for i, r in enumerate(records)
    ]


# --------------------------------------------------------------------------- statistics


def reuse_upper_bound(records: Sequence[TraceRecord], block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Token-weighted hit rate of an infinite block cache (a workload property, not a cache).

    A block hits if its id appeared in any earlier request. Because ids are
    chained, a hit block's whole prefix hits too, so this is a prefix match.
    """
    seen: set[int] = set()
    hit = total = 0
    for r in records:
        for h, n in zip(r.hash_ids, r.block_lengths(block_size)):
            if h in seen:
                hit += int(n)
            total += int(n)
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def trace_stats(records: Sequence[TraceRecord], block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """Summary numbers of a trace: counts, length percentiles, shared first block, reuse bound."""
    if not records:
        raise ValueError("records: expected a non-empty trace")
    inp = np.array([r.input_length for r in records], dtype=np.float64)
    out = np.array([r.output_length for r in records], dtype=np.float64)
    firsts = [r.hash_ids[0] for r in records if r.hash_ids]
    common = max(set(firsts), key=firsts.count) if firsts else None
    return {
        "requests": len(records),
        "duration_s": (records[-1].timestamp - records[0].timestamp) / 1000.0,
        "input_mean": float(inp.mean()),
        "input_p50": float(np.percentile(inp, 50)),
        "input_p99": float(np.percentile(inp, 99)),
        "input_max": int(inp.max()),
        "output_mean": float(out.mean()),
        "prompt_tokens": int(inp.sum()),
        "distinct_blocks": len({h for r in records for h in r.hash_ids}),
        "share_first_block": firsts.count(common) / len(records) if firsts else 0.0,
        "reuse_upper_bound": reuse_upper_bound(records, block_size),
    }


# --------------------------------------------------------------------------- committed data


# file name -> (how it is made, as text for data/README.md; the builder)
DATASETS: dict[str, tuple[str, object]] = {
    "chat.jsonl": (
        "to_trace(chat_sessions(60, seed=1), block_size=512)",
        lambda: to_trace(chat_sessions(60, seed=1), 512),
    ),
    "agent.jsonl": (
        "to_trace(agent_loops(16, seed=2), block_size=512)",
        lambda: to_trace(agent_loops(16, seed=2), 512),
    ),
    "document.jsonl": (
        "to_trace(document_qa(300, seed=3), block_size=512)",
        lambda: to_trace(document_qa(300, seed=3), 512),
    ),
    "conversation_like.jsonl": (
        "mooncake_conversation_like(seed=0, block_size=512)",
        lambda: mooncake_conversation_like(seed=0, block_size=512),
    ),
}


def regenerate(directory, names: Sequence[str] | None = None) -> list[Path]:
    """Write the committed traces into ``directory`` (byte-identical on every machine)."""
    names = list(DATASETS) if names is None else list(names)
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise ValueError(f"names={unknown!r}: expected some of {sorted(DATASETS)}")
    return [write_trace(Path(directory) / name, DATASETS[name][1]()) for name in names]


def _format_stats(name: str, s: dict) -> str:
    return (
        f"{name}: requests={s['requests']} duration_s={s['duration_s']:.1f} "
        f"input mean={s['input_mean']:.0f} p50={s['input_p50']:.0f} p99={s['input_p99']:.0f} "
        f"max={s['input_max']} output mean={s['output_mean']:.1f} "
        f"prompt_tokens={s['prompt_tokens']} distinct_blocks={s['distinct_blocks']} "
        f"share_first_block={s['share_first_block']:.3f} "
        f"reuse_upper_bound={s['reuse_upper_bound']:.3f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimilab.workloads", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    reg = sub.add_parser("regenerate", help="write the committed traces into DIR")
    reg.add_argument("directory")
    st = sub.add_parser("stats", help="validate traces and print their statistics")
    st.add_argument("traces", nargs="+")
    st.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    args = parser.parse_args(argv)
    if args.command == "regenerate":
        for path in regenerate(args.directory):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
    else:
        for path in args.traces:
            records = load_trace(path, args.block_size)
            print(_format_stats(path, trace_stats(records, args.block_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
