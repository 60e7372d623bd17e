"""A deterministic admission simulation: one mixed workload, several pool designs.

Requests (short chats and long documents, :func:`mixed_workload`) arrive over
simulated time. An engine loop (:func:`simulate`) admits them first come,
first served onto the pools a page-sizing policy builds
(:mod:`kimilab.pool`), makes one token per running request per step, grows
their KV block by block, and preempts the newest request when memory runs
out (it goes back to the head of the queue and is re-prefilled later, as
vLLM's recompute preemption does). A request that could not fit even in an
empty pool is refused.

Everything is accounting (``backed=False`` pools), so a 48B-scale budget
costs no RAM, and time is a step counter: every engine step is ``step_ms``
of simulated time whatever the batch. The results therefore compare how
many requests each memory layout can hold, not real latency.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kimilab.pool.pages import CacheShapes, PoolExhausted, RequestAllocator

__all__ = ["SimRequest", "SimResult", "mixed_workload", "simulate", "phase_means"]


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    kind: str  # "chat" or "document"
    arrival_ms: int
    prompt_tokens: int
    output_tokens: int


def mixed_workload(seed: int = 0, *, duration_ms: int = 60_000, chat_rate_per_s: float = 10.0,
                   chat_prompt_median: int = 700, chat_prompt_range: tuple[int, int] = (64, 4096),
                   chat_output_range: tuple[int, int] = (32, 512),
                   doc_window_ms: tuple[int, int] = (20_000, 40_000), doc_rate_per_s: float = 1.0,
                   doc_prompt_range: tuple[int, int] = (8192, 65536),
                   doc_output_range: tuple[int, int] = (64, 512)) -> list[SimRequest]:
    """Chats arrive all along (Poisson); documents arrive only inside ``doc_window_ms``.

    Chat prompts are log-normal around ``chat_prompt_median`` (clipped to the
    range), document prompts log-uniform over their range; outputs uniform.
    Same seed, same list, on every machine.
    """
    for name, value in (("duration_ms", duration_ms), ("chat_rate_per_s", chat_rate_per_s),
                        ("doc_rate_per_s", doc_rate_per_s)):
        if not value >= 0:
            raise ValueError(f"{name}={value!r}: expected a number >= 0")
    lo, hi = doc_window_ms
    if not 0 <= lo <= hi <= duration_ms:
        raise ValueError(f"doc_window_ms={doc_window_ms!r}: expected 0 <= start <= end <= duration_ms")
    rng = np.random.default_rng(seed)

    def arrivals(rate, start, end):
        n = rng.poisson(rate * (end - start) / 1000.0)
        return np.sort(rng.uniform(start, end, size=n)).astype(np.int64)

    chats_t = arrivals(chat_rate_per_s, 0, duration_ms)
    chat_prompt = np.clip(np.round(chat_prompt_median * np.exp(0.8 * rng.standard_normal(chats_t.size))),
                          *chat_prompt_range).astype(np.int64)
    chat_out = rng.integers(chat_output_range[0], chat_output_range[1] + 1, size=chats_t.size)
    docs_t = arrivals(doc_rate_per_s, lo, hi)
    doc_prompt = np.round(np.exp(rng.uniform(np.log(doc_prompt_range[0]), np.log(doc_prompt_range[1]),
                                             size=docs_t.size))).astype(np.int64)
    doc_out = rng.integers(doc_output_range[0], doc_output_range[1] + 1, size=docs_t.size)
    rows = [(int(t), 0, "chat", int(p), int(o)) for t, p, o in zip(chats_t, chat_prompt, chat_out)]
    rows += [(int(t), 1, "document", int(p), int(o)) for t, p, o in zip(docs_t, doc_prompt, doc_out)]
    rows.sort()
    return [SimRequest(i, kind, t, p, o) for i, (t, _, kind, p, o) in enumerate(rows)]


@dataclass(eq=False)
class _Live:
    """A request inside the engine. While running, its progress is implicit:
    at step s it holds ``tokens0 + (s - admitted_step)`` tokens."""

    req: SimRequest
    generated: int = 0  # tokens made before the current admission
    tokens: int = 0  # prompt + generated, at the current admission
    admitted_step: int = 0
    seq: int = 0  # admission order (larger = newer)
    epoch: int = 0  # bumps on preemption: stale events are skipped
    capacity_tokens: int = 0
    first_admit_ms: int | None = None
    preemptions: int = 0
    active: bool = False

    def tokens_at(self, step: int) -> int:
        return self.tokens + step - self.admitted_step


@dataclass
class SimResult:
    """What one policy did with the workload (timeline arrays are per engine step)."""

    policy: str
    label: str
    capacity_bytes: int
    time_ms: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    requested_bytes: np.ndarray  # bytes the running requests really hold
    reserved_bytes: np.ndarray  # pages held, padding included
    completed: int
    refused: int
    preemptions: int
    recomputed_tokens: int  # tokens re-prefilled after preemptions
    makespan_ms: int
    wait_ms: np.ndarray  # arrival -> first admission, per finished request
    refused_ids: list = field(default_factory=list)

    @property
    def padding_bytes(self) -> np.ndarray:
        return self.reserved_bytes - self.requested_bytes

    @property
    def utilisation(self) -> np.ndarray:
        """Fraction of the budget holding real cache bytes."""
        return self.requested_bytes / self.capacity_bytes

    def summary(self) -> dict:
        busy = self.running > 0
        return {
            "policy": self.label,
            "completed": self.completed,
            "refused": self.refused,
            "preemptions": self.preemptions,
            "peak_running": int(self.running.max(initial=0)),
            "mean_running": float(self.running[busy].mean()) if busy.any() else 0.0,
            "mean_utilisation": float(self.utilisation[busy].mean()) if busy.any() else 0.0,
            "mean_padding_MiB": float(self.padding_bytes[busy].mean() / 2**20) if busy.any() else 0.0,
            "makespan_s": self.makespan_ms / 1000.0,
            "mean_wait_s": float(self.wait_ms.mean() / 1000.0) if self.wait_ms.size else 0.0,
        }


def simulate(requests: list[SimRequest], policy, shapes: CacheShapes, budget_bytes: int, *,
             step_ms: int = 20, label: str | None = None, max_steps: int = 1_000_000) -> SimResult:
    """Serve ``requests`` on the pools ``policy`` builds from ``budget_bytes``; see module doc.

    One engine step (``step_ms`` of simulated time): arrivals join the queue;
    queued requests are admitted first come, first served while their
    prompt (plus any tokens made before a preemption) fits; then every running
    request makes one token. Requests that need a new KV block get it oldest
    first; if the pools are full the newest running request is preempted
    (released and put back at the head of the queue) until the block fits.
    The loop is event driven (a heap of "needs a block" / "finishes" steps per
    request), so its cost grows with blocks, not tokens.
    """
    if not isinstance(shapes, CacheShapes):
        raise ValueError(f"shapes: expected a kimilab.pool.CacheShapes, got {type(shapes).__name__}")
    if isinstance(step_ms, bool) or not isinstance(step_ms, int) or step_ms < 1:
        raise ValueError(f"step_ms={step_ms!r}: expected an int >= 1 (simulated ms per engine step)")
    alloc = RequestAllocator(policy, shapes, budget_bytes)
    empty = RequestAllocator(policy, shapes, budget_bytes)  # never used: "would it fit alone?"
    block = policy.block_tokens(shapes)
    pending = deque(sorted(requests, key=lambda r: (r.arrival_ms, r.request_id)))
    waiting: deque[_Live] = deque()
    running: list[_Live] = []  # in admission order: the newest is last
    events: list[tuple] = []  # (step, seq, kind 0=grow 1=finish, epoch, live)
    fixed, per_token = shapes.fixed_bytes, shapes.kv_bytes_per_token
    held_tokens = 0
    seqs = itertools.count()
    times, n_run, n_wait, req_b, res_b = [], [], [], [], []
    completed = preemptions = recomputed = 0
    refused_ids, waits = [], []
    last_finish = 0

    def capacity(tokens: int) -> int:
        return -(-tokens // block) * block

    def push(live: _Live) -> None:
        grow_at = live.admitted_step + live.capacity_tokens - live.tokens
        finish_at = live.admitted_step + live.req.output_tokens - live.generated - 1
        if grow_at <= finish_at:
            heapq.heappush(events, (grow_at, live.seq, 0, live.epoch, live))
        heapq.heappush(events, (finish_at, live.seq, 1, live.epoch, live))

    def leave(live: _Live, step: int) -> int:
        """Release a running request at ``step`` (before its token); returns tokens held."""
        alloc.release(live.req.request_id)
        running.remove(live)
        live.active = False
        live.epoch += 1
        return live.tokens_at(step)

    step = 0
    for _ in range(max_steps):
        t = step * step_ms
        while pending and pending[0].arrival_ms <= t:
            r = pending.popleft()
            if empty.fits(r.prompt_tokens + r.output_tokens):
                waiting.append(_Live(r, tokens=r.prompt_tokens))
            else:
                refused_ids.append(r.request_id)
        while waiting:  # first come, first served; the head blocks the queue
            live = waiting[0]
            if not alloc.fits(live.tokens):
                break
            alloc.admit(live.req.request_id, live.tokens)
            waiting.popleft()
            live.capacity_tokens = capacity(live.tokens)
            live.admitted_step, live.seq, live.active = step, next(seqs), True
            if live.first_admit_ms is None:
                live.first_admit_ms = t
            running.append(live)
            held_tokens += live.tokens
            push(live)
        held_tokens += len(running)  # every running request makes one token this step
        while events and events[0][0] == step:
            _, _, kind, epoch, live = heapq.heappop(events)
            if epoch != live.epoch:
                continue
            before = live.tokens_at(step)
            if kind == 1:  # its last token: done
                held_tokens -= leave(live, step) + 1
                completed += 1
                waits.append(live.first_admit_ms - live.req.arrival_ms)
                last_finish = t + step_ms
                continue
            while live.active:  # needs one more block
                try:
                    alloc.grow(live.req.request_id, before + 1)
                except PoolExhausted:
                    victim = running[-1]  # the newest request goes back to the queue
                    victim_tokens = leave(victim, step)
                    held_tokens -= victim_tokens + 1
                    victim.generated += victim_tokens - victim.tokens
                    victim.tokens = victim_tokens
                    victim.preemptions += 1
                    preemptions += 1
                    recomputed += victim_tokens
                    waiting.appendleft(victim)
                    continue
                live.capacity_tokens = capacity(before + 1)
                grow_at = live.admitted_step + live.capacity_tokens - live.tokens
                if grow_at <= live.admitted_step + live.req.output_tokens - live.generated - 1:
                    heapq.heappush(events, (grow_at, live.seq, 0, live.epoch, live))
                break
        step += 1
        times.append(step * step_ms)
        n_run.append(len(running))
        n_wait.append(len(waiting))
        req_b.append(len(running) * fixed + held_tokens * per_token)
        res_b.append(alloc.reserved_bytes)
        if not running and not waiting:
            if not pending:
                break
            step = max(step, -(-pending[0].arrival_ms // step_ms))  # idle: jump to the next arrival
    else:
        raise RuntimeError(f"simulate: not finished after max_steps={max_steps} steps")
    return SimResult(
        policy=policy.key, label=label or policy.key, capacity_bytes=alloc.capacity_bytes,
        time_ms=np.asarray(times, dtype=np.int64), running=np.asarray(n_run, dtype=np.int64),
        waiting=np.asarray(n_wait, dtype=np.int64), requested_bytes=np.asarray(req_b, dtype=np.int64),
        reserved_bytes=np.asarray(res_b, dtype=np.int64), completed=completed,
        refused=len(refused_ids), preemptions=preemptions, recomputed_tokens=recomputed,
        makespan_ms=last_finish, wait_ms=np.asarray(waits, dtype=np.int64), refused_ids=refused_ids,
    )


def phase_means(result: SimResult, windows: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Mean number of running requests inside each named time window [start, end) ms."""
    out = {}
    for name, (lo, hi) in windows.items():
        mask = (result.time_ms > lo) & (result.time_ms <= hi)
        out[name] = float(result.running[mask].mean()) if mask.any() else 0.0
    return out
