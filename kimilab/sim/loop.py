"""The one simulation loop: requests arrive on simulated time, meet a prefix cache, run on a budget.

:func:`simulate` serves requests in arrival order and can measure two things,
alone or together:

* ``cache`` — a prefix cache (:class:`~kimilab.prefix.radix.RadixTree` for an
  attention model, :class:`~kimilab.prefix.hybrid.HybridPrefixCache` for the
  hybrid). Each request looks its prompt up when it arrives and leaves its blocks
  (and the checkpoints the policy admits) behind: token hit rates, the prefill
  FLOPs a hit saves, the memory the cache holds (chapters 5 and 6).
* ``memory`` — a :class:`~kimilab.pool.requests.RequestAllocator` on a byte budget.
  Requests are admitted first come, first served while they fit; every running
  request makes one token per engine step of ``step_ms`` (after its prefill, which
  is free or costs steps: ``prefill_tokens_per_step``); a request that needs a
  new KV block gets it oldest first, and when the pools are full the newest
  running request is preempted (released and re-queued at the head, recomputed
  later, as vLLM's recompute preemption). A request that could not fit even in an
  empty pool is refused (chapter 4).

Without ``memory`` service is instantaneous: each request is done when it arrives,
so the cache sees requests one at a time, in order. Time is a step counter, not a
latency model (chapter 10 grows this loop into a serving engine with a step-time
model). The loop is event driven: idle stretches are skipped, and running
requests cost work only when they need a block or finish.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kimilab.costs import CacheCosts, StepTimer
from kimilab.pool.handles import PoolExhausted
from kimilab.pool.pages import UNBOUNDED_PAGES
from kimilab.sim.result import SimResult
from kimilab.validate import check_int

__all__ = ["simulate"]


@dataclass(eq=False)
class _Live:
    """A request inside the engine. While running, its progress is implicit: it prefills
    from ``admitted_step`` and decodes from ``start``, so at step s it holds
    ``tokens + max(0, s - start)`` tokens."""

    req: object
    generated: int = 0  # tokens made before the current admission
    tokens: int = 0  # prompt + generated, at the current admission
    admitted_step: int = 0
    seq: int = 0  # admission order (larger = newer)
    epoch: int = 0  # bumps on preemption: stale events are skipped
    capacity_tokens: int = 0
    first_admit_ms: int | None = None
    active: bool = False
    start: int = 0  # first step at which it makes a token (after its prefill)
    decoding: bool = False

    def tokens_at(self, step: int) -> int:
        return self.tokens + max(0, step - self.start)


_TIMERS: dict = {}  # (config, deployment) -> StepTimer, shared by every replay (a sweep repeats prompt lengths)
_PREFILL: dict = {}  # (config, deployment) -> {(n_new, n_cached): prefill seconds}


class _CacheMeter:
    """Looks every arriving request up in the prefix cache and adds up what it measured."""

    def __init__(self, cache, res: SimResult, keep_per_request: bool):
        self.cache, self.res, self.keep = cache, res, keep_per_request
        self.costs: CacheCosts | None = getattr(cache, "costs", None)
        self.page_bytes = cache.pool.page_bytes
        self.kv_sum = self.ck_sum = 0
        self.hits: list = []  # (prompt tokens, usable hit) per request: timed once, at close()
        res.block_size = cache.block_size
        res.capacity_pages = None if cache.pool.n_pages >= UNBOUNDED_PAGES else cache.pool.n_pages
        res.capacity_tokens = getattr(cache, "capacity_tokens",
                                      None if res.capacity_pages is None else res.capacity_pages * cache.block_size)
        if self.costs is not None:
            res.policy = getattr(cache, "policy_name", cache.policy.name)
            res.model = self.costs.config.name
            res.deployment = self.costs.deployment.name
            res.checkpoint_pages = cache.checkpoint_pages
            res.kv_bytes_per_token = self.costs.kv_bytes_per_token
            res.checkpoint_bytes_each = getattr(cache, "checkpoint_bytes", self.costs.checkpoint_bytes)
            key = (self.costs.config, self.costs.deployment)
            self.timer = _TIMERS.get(key) or _TIMERS.setdefault(key, StepTimer(*key))
            self.prefill = _PREFILL.setdefault(key, {})
        self.exact_bytes = hasattr(type(cache), "checkpoint_bytes_used")  # a state pool counts bytes, not pages

    def arrive(self, index: int, req) -> None:
        n = req.input_length
        if n == 0:
            raise ValueError(f"requests[{index}].input_length=0: expected prompts of at least one token")
        if req.tokens is not None:
            out = self.cache.serve(tokens=req.tokens)
        else:
            out = self.cache.serve(req.hash_ids, n)
        res = self.res
        res.requests += 1
        res.prompt_tokens += n
        res.kv_hit_tokens += out.kv_hit
        res.usable_hit_tokens += out.usable_hit
        if self.costs is not None:
            self.hits.append((n, out.usable_hit))
        cache = self.cache
        kv = cache.kv_pages
        ck = cache.checkpoint_bytes_used if self.exact_bytes else cache.checkpoint_pages_used * self.page_bytes
        self.kv_sum += kv
        self.ck_sum += ck
        if kv > res.kv_bytes_peak:
            res.kv_bytes_peak = kv
        if ck > res.checkpoint_bytes_peak:
            res.checkpoint_bytes_peak = ck
        if self.keep:
            res.per_request.append(out)

    def _seconds(self, n_new: int, n_cached: int) -> float:
        """:meth:`StepTimer.prefill`, memoised per process: every replay of a trace asks the same lengths."""
        key = (n_new, n_cached)
        t = self.prefill.get(key)
        if t is None:
            t = self.prefill[key] = self.timer.prefill(n_new, n_cached)
        return t

    def close(self) -> None:
        res, pb = self.res, self.page_bytes
        flops = self.costs.prefill_flops if self.costs is not None else None
        for n, hit in self.hits:
            res.prefill_flops_cold += flops(n)
            res.prefill_flops += flops(n - hit, hit)
            cold = self._seconds(n, 0)
            res.prefill_seconds_cold += cold
            res.prefill_seconds += self._seconds(n - hit, hit) if hit else cold
        res.kv_bytes_peak *= pb
        if res.requests:
            res.kv_bytes_mean = self.kv_sum * pb / res.requests
            res.checkpoint_bytes_mean = self.ck_sum / res.requests
        describe = getattr(self.cache, "describe", None) or getattr(getattr(self.cache, "policy", None), "describe", None)
        res.policy_detail = describe() if describe else ""
        res.checkpoints_admitted = getattr(self.cache, "checkpoints_admitted", 0)
        res.checkpoints_evicted = getattr(self.cache, "checkpoints_evicted", 0)


class _Engine:
    """First come, first served admission onto a RequestAllocator; one token per running request per step."""

    def __init__(self, memory, empty, res: SimResult, prefill_tokens_per_step: int | None):
        self.alloc, self.empty, self.res = memory, empty, res
        self.chunk = prefill_tokens_per_step
        self.decoding = 0  # running requests past their prefill: each makes a token per step
        self.starts: dict[int, list] = {}  # step -> [(live, epoch)] that finish prefilling then
        self.block = memory.layout.block_tokens(memory.shapes)
        self.fixed, self.per_token = memory.shapes.fixed_bytes, memory.shapes.kv_bytes_per_token
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []  # in admission order: the newest is last
        self.events: list[tuple] = []  # (step, seq, kind 0=grow 1=finish, epoch, live)
        self.held_tokens = 0
        self.seqs = itertools.count()
        self.timeline: list[tuple] = []
        self.waits: list[int] = []
        self.last_finish = 0

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def arrive(self, req) -> None:
        if self.empty.fits(req.input_length + req.output_length):
            self.waiting.append(_Live(req, tokens=req.input_length))
        else:
            self.res.refused_ids.append(req.request_id)

    def _capacity(self, tokens: int) -> int:
        return -(-tokens // self.block) * self.block

    def _push(self, live: _Live) -> None:
        grow_at = live.start + live.capacity_tokens - live.tokens
        finish_at = live.start + live.req.output_length - live.generated - 1
        if grow_at <= finish_at:
            heapq.heappush(self.events, (grow_at, live.seq, 0, live.epoch, live))
        heapq.heappush(self.events, (finish_at, live.seq, 1, live.epoch, live))

    def _leave(self, live: _Live, step: int) -> int:
        """Release a running request at ``step`` (before its token); returns tokens held."""
        self.alloc.release(live.req.request_id)
        self.running.remove(live)
        if live.decoding:
            self.decoding -= 1
            live.decoding = False
        live.active = False
        live.epoch += 1
        return live.tokens_at(step)

    def step(self, step: int, t: int, step_ms: int) -> None:
        """Admit what fits, make one token for every running request, handle its events."""
        res, alloc = self.res, self.alloc
        while self.waiting:  # first come, first served; the head blocks the queue
            live = self.waiting[0]
            if not alloc.fits(live.tokens):
                break
            alloc.admit(live.req.request_id, live.tokens)
            self.waiting.popleft()
            live.capacity_tokens = self._capacity(live.tokens)
            live.admitted_step, live.seq, live.active = step, next(self.seqs), True
            prefill_steps = 0 if self.chunk is None else -(-live.tokens // self.chunk)
            live.start = step + prefill_steps
            if prefill_steps:
                self.starts.setdefault(live.start, []).append((live, live.epoch))
            else:
                live.decoding = True
                self.decoding += 1
            if live.first_admit_ms is None:
                live.first_admit_ms = t
            self.running.append(live)
            self.held_tokens += live.tokens
            self._push(live)
        for live, epoch in self.starts.pop(step, ()):  # prefill done: it decodes from this step
            if live.epoch == epoch:
                live.decoding = True
                self.decoding += 1
        self.held_tokens += self.decoding  # every decoding request makes one token this step
        events = self.events
        while events and events[0][0] == step:
            _, _, kind, epoch, live = heapq.heappop(events)
            if epoch != live.epoch:
                continue
            before = live.tokens_at(step)
            if kind == 1:  # its last token: done
                self.held_tokens -= self._leave(live, step) + 1
                res.completed += 1
                self.waits.append(live.first_admit_ms - live.req.arrival_ms)
                self.last_finish = t + step_ms
                continue
            while live.active:  # needs one more block
                try:
                    alloc.grow(live.req.request_id, before + 1)
                except PoolExhausted:
                    self._preempt(step)
                    continue
                live.capacity_tokens = self._capacity(before + 1)
                self._push_grow(live)
                break

    def _preempt(self, step: int) -> None:
        """The newest running request goes back to the head of the queue (recomputed later)."""
        res = self.res
        victim = self.running[-1]
        made_token = victim.decoding
        victim_tokens = self._leave(victim, step)
        self.held_tokens -= victim_tokens + made_token
        victim.generated += victim_tokens - victim.tokens
        victim.tokens = victim_tokens
        res.preemptions += 1
        res.preempted_tokens += victim_tokens
        self.waiting.appendleft(victim)

    def _push_grow(self, live: _Live) -> None:
        grow_at = live.start + live.capacity_tokens - live.tokens
        if grow_at <= live.start + live.req.output_length - live.generated - 1:
            heapq.heappush(self.events, (grow_at, live.seq, 0, live.epoch, live))

    def record(self, t: int) -> None:
        self.timeline.append((t, len(self.running), len(self.waiting),
                              len(self.running) * self.fixed + self.held_tokens * self.per_token,
                              self.alloc.reserved_bytes))

    def close(self) -> None:
        res = self.res
        cols = np.asarray(self.timeline, dtype=np.int64).reshape(-1, 5)
        res.time_ms, res.running, res.waiting, res.requested_bytes, res.reserved_bytes = cols.T.copy()
        res.refused = len(res.refused_ids)
        res.makespan_ms = self.last_finish
        res.wait_ms = np.asarray(self.waits, dtype=np.int64)
        res.capacity_bytes = self.alloc.capacity_bytes
        res.layout = self.alloc.layout.key


def simulate(requests: Sequence, *, cache=None, memory=None, step_ms: int = 20, label: str | None = None,
             prefill_tokens_per_step: int | None = None,
             keep_per_request: bool = False, max_steps: int = 1_000_000) -> SimResult:
    """Serve ``requests`` (kimilab.traffic.Request) in arrival order; see the module docstring.

    ``cache``: a prefix cache with ``serve``; ``memory``: a fresh RequestAllocator (its
    layout and budget are what the requests run on). One step is ``step_ms`` of
    simulated time. ``prefill_tokens_per_step`` charges prefill in time: a request
    admitted (or re-admitted after a preemption, to recompute) with T tokens holds its
    memory for ceil(T / prefill_tokens_per_step) steps before it makes its first token
    (None: prefill is free, as in chapter 4's first experiment). ``keep_per_request``
    keeps each request's cache outcome.
    """
    step_ms = check_int("step_ms", step_ms, 1, unit="simulated ms per engine step")
    if prefill_tokens_per_step is not None:
        check_int("prefill_tokens_per_step", prefill_tokens_per_step, 1, unit="tokens per request per step")
    if cache is None and memory is None:
        raise ValueError("simulate: expected a prefix cache (cache=...), a memory budget (memory=...) or both")
    start = time.perf_counter()
    default = memory.layout.key if memory is not None else getattr(getattr(cache, "policy", None), "name", "lru")
    res = SimResult(label=label or default)
    meter = _CacheMeter(cache, res, keep_per_request) if cache is not None else None
    engine = None
    if memory is not None:
        empty = type(memory)(memory.layout, memory.shapes, memory.budget_bytes)  # "would it fit alone?"
        engine = _Engine(memory, empty, res, prefill_tokens_per_step)
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_ms, i))
    pending = deque(order)
    step = 0
    for _ in range(max_steps):
        t = step * step_ms
        while pending and requests[pending[0]].arrival_ms <= t:
            i = pending.popleft()
            if meter is not None:
                meter.arrive(i, requests[i])
            if engine is not None:
                engine.arrive(requests[i])
        if engine is not None:
            engine.step(step, t, step_ms)
        step += 1
        if engine is not None:
            engine.record(step * step_ms)
        if engine is None or not engine.busy:
            if not pending:
                break
            step = max(step, -(-requests[pending[0]].arrival_ms // step_ms))  # idle: jump to the next arrival
    else:
        raise RuntimeError(f"simulate: not finished after max_steps={max_steps} steps")
    if meter is not None:
        meter.close()
    if engine is not None:
        engine.close()
    res.wall_seconds = time.perf_counter() - start
    return res
