"""Part A of the book's experiment: what a second request saves, on the reduced model, for real.

A *session* is two requests: turn 1, then turn 2, whose prompt re-sends turn 1's
prompt, turn 1's reply (the tokens the model actually generated) and something new --
a tool result in an agent loop, a user message in a chat. Each configuration serves the
sessions one request at a time, starting from a plain baseline (contiguous caches, no
prefix reuse, no speculation) and toggling ONE component:

* ``unified-pool``       the request's cache on pool pages (chapter 4);
* ``prefix:no-states``   a prefix cache that keeps KV but no states (chapter 5's lesson);
* ``prefix:every-block`` / ``prefix:dual`` KV + state checkpoints (chapter 6);
* ``spec:snapshot`` / ``spec:replay`` / ``spec:ring`` speculative decoding with a controlled
  drafter (chapters 7-8; the untrained model's own drafts are never accepted).

For turn 2 it records the prefill tokens computed, their FLOPs (``costs``), the CPU
seconds of the prefill and of the decode (wall clock, the best of ``repeats``), the
model passes the decode took, and what the component holds (checkpoint and scratch
bytes); and it checks that every configuration's tokens equal the baseline's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from kimilab.costs import prefill_flops
from kimilab.model import HybridCache, Model
from kimilab.pool import PagedHybridCache, PagePool
from kimilab.prefix import ModelPrefixCache, NoStates
from kimilab.speculative import ControlledDrafter, speculative_generate
from kimilab.validate import check_int

__all__ = ["CONFIGS", "Session", "TurnCost", "sessions", "second_request"]

CONFIGS = ("baseline", "unified-pool", "prefix:no-states", "prefix:every-block", "prefix:dual",
           "spec:snapshot", "spec:replay", "spec:ring")
BLOCK = 16  # tokens per cached block and per pool page (the reduced model's scale)


@dataclass(frozen=True)
class Session:
    """Turn 1's prompt, and the new tokens turn 2 adds after turn 1's reply."""

    first: tuple
    added: tuple


@dataclass(frozen=True)
class TurnCost:
    """What serving turn 2 cost under one configuration (the sum over the sessions)."""

    config: str
    prompt_tokens: int
    prefill_tokens: int  # computed; the rest came from cache
    prefill_flops: int
    prefill_wall_s: float  # wall clock (seconds), best of the repeats
    decode_passes: int  # forward passes of the target model while decoding
    decode_wall_s: float  # wall clock (seconds), best of the repeats
    held_bytes: int  # checkpoints (prefix) or scratch (spec) the component holds at its peak
    same_tokens: bool  # turn 2's output equals the baseline's

    def as_dict(self) -> dict:
        return asdict(self)


def sessions(kind: str, n: int, seed: int, vocab: int) -> list[Session]:
    """Agent loops (a long shared tool prompt, a task; turn 2 adds a tool result) or chats
    (a short shared system prompt, a message; turn 2 adds the next message)."""
    rng = np.random.default_rng(seed)
    shared_len, own_len, added_len = {"agent": (384, 64, 96), "chat": (64, 160, 64)}[kind]
    shared = rng.integers(0, vocab, shared_len)
    return [Session(tuple(int(t) for t in np.concatenate([shared, rng.integers(0, vocab, own_len)])),
                    tuple(int(t) for t in rng.integers(0, vocab, added_len))) for _ in range(n)]


def _greedy_after(model: Model, logits_last: np.ndarray, cache, n: int) -> list[int]:
    out = [int(np.argmax(logits_last))]
    while len(out) < n:
        out.append(int(np.argmax(model.decode(out[-1], cache))))  # decode returns one token's logits [vocab]
    return out


def _serve(model: Model, config: str, prompt, n_out: int, store, pool):
    """One request: (tokens, prefill tokens computed, prefill s, decode s, decode passes, held bytes)."""
    held = 0
    if config.startswith("spec:"):  # speculation leaves the prefill alone: time a cold one for the record
        t0 = time.perf_counter()
        model.prefill(prompt, HybridCache(model.config))
        prefill_s = time.perf_counter() - t0
        drafter = ControlledDrafter(model, prompt, n_out + 8, corruption=0.2, seed=0)
        t0 = time.perf_counter()
        result = speculative_generate(model, prompt, n_out, drafter, k=4, rollback=config[5:])
        total = time.perf_counter() - t0
        held = max((s.rollback_bytes for s in result.steps), default=0)
        return result.tokens, len(prompt), prefill_s, max(total - prefill_s, 0.0), len(result.steps), held
    t0 = time.perf_counter()
    if config.startswith("prefix:"):
        logits, cache, outcome = store.prefill(prompt)
        usable = outcome.usable_hit
        held = store.cache.checkpoint_pages_used * store.pool.page_bytes
    else:
        cache = PagedHybridCache(model.config, pool, block_tokens=BLOCK) if config == "unified-pool" else HybridCache(
            model.config)
        usable = 0
        logits = model.prefill(prompt, cache)
    t1 = time.perf_counter()
    tokens, passes = _greedy_after(model, logits[-1], cache, n_out), n_out - 1
    t2 = time.perf_counter()
    cache.free()
    return tokens, len(prompt) - usable, t1 - t0, t2 - t1, passes, held


def _run_once(model: Model, config: str, work: list[Session], n_out: int, capacity_blocks: int):
    store = pool = None
    if config.startswith("prefix:"):
        policy = {"prefix:no-states": NoStates(), "prefix:every-block": "every-block",
                  "prefix:dual": "dual"}[config]
        store = ModelPrefixCache(model, policy, block_size=BLOCK, capacity_tokens=BLOCK * capacity_blocks)
    elif config == "unified-pool":
        pool = PagePool(capacity_blocks * 16, 4096, name="experiment")  # chapter 4's tiny arena pages
    rows = []
    for s in work:
        first, *_ = _serve(model, config, s.first, n_out, store, pool)
        second_prompt = list(s.first) + first + list(s.added)
        rows.append((second_prompt, _serve(model, config, second_prompt, n_out, store, pool)))
    return rows


def second_request(model: Model, config: str, work: list[Session], *, n_out: int = 12, repeats: int = 2,
                   capacity_blocks: int = 256, reference: list | None = None) -> tuple[TurnCost, list]:
    """Serve every session under ``config``; returns turn 2's cost and its output tokens."""
    if config not in CONFIGS:
        raise ValueError(f"config={config!r}: expected one of {CONFIGS}")
    n_out = check_int("n_out", n_out, 1, unit="tokens per request")
    repeats = check_int("repeats", repeats, 1)
    best = None
    for _ in range(repeats):
        rows = _run_once(model, config, work, n_out, capacity_blocks)
        pre = sum(r[1][2] for r in rows)
        dec = sum(r[1][3] for r in rows)
        best = (rows, pre, dec) if best is None else (rows, min(best[1], pre), min(best[2], dec))
    rows, pre_s, dec_s = best
    outputs = [r[1][0] for r in rows]
    computed = sum(r[1][1] for r in rows)
    flops = sum(prefill_flops(model.config, r[1][1], len(r[0]) - r[1][1]) for r in rows)
    cost = TurnCost(config, sum(len(r[0]) for r in rows), computed, int(flops), pre_s,
                    sum(r[1][4] for r in rows), dec_s, max(r[1][5] for r in rows),
                    reference is None or outputs == reference)
    return cost, outputs
