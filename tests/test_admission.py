"""The admission simulation: deterministic, conserves requests, and its event-driven loop
equals an obvious token-by-token twin."""

from collections import deque

import numpy as np
import pytest

from kimilab import config
from kimilab.sim.admission import SimRequest, mixed_workload, phase_means, simulate
from kimilab.pool.pages import (CacheShapes, JengaPages, PoolExhausted, RequestAllocator, SplitPools,
                          UnifiedPages, VllmPaddedPages)

SHAPES = CacheShapes.from_config(config.kimi_linear_48b)
POLICIES = [UnifiedPages(), VllmPaddedPages(), JengaPages(), SplitPools(0.9), SplitPools(4.0)]


def _small_workload():
    return mixed_workload(3, duration_ms=4_000, chat_rate_per_s=20.0, doc_window_ms=(1_000, 3_000),
                          doc_rate_per_s=1.5, chat_output_range=(64, 300), doc_output_range=(64, 300),
                          doc_prompt_range=(4096, 30000))


def _reference(requests, policy, shapes, budget, step_ms=20):
    """The obvious loop: every step, every running request (oldest first) grows if it must
    (preempting the newest on failure), makes its token, and leaves when done."""
    alloc, empty = RequestAllocator(policy, shapes, budget), RequestAllocator(policy, shapes, budget)
    pending, waiting, running = deque(requests), deque(), []
    state = {}  # id -> [generated, tokens]
    t, trace, preemptions, completed = 0, [], 0, 0
    while pending or waiting or running:
        while pending and pending[0].arrival_ms <= t:
            r = pending.popleft()
            if empty.fits(r.prompt_tokens + r.output_tokens):
                state[r.request_id] = [0, r.prompt_tokens]
                waiting.append(r)
        while waiting and alloc.fits(state[waiting[0].request_id][1]):
            r = waiting.popleft()
            alloc.admit(r.request_id, state[r.request_id][1])
            running.append(r)
        for r in list(running):
            if r not in running:
                continue
            gen_tok = state[r.request_id]
            while r in running:
                try:
                    alloc.grow(r.request_id, gen_tok[1] + 1)
                    break
                except PoolExhausted:
                    victim = running.pop()
                    alloc.release(victim.request_id)
                    waiting.appendleft(victim)
                    preemptions += 1
            if r not in running:
                continue
            gen_tok[0] += 1
            gen_tok[1] += 1
            if gen_tok[0] == r.output_tokens:
                alloc.release(r.request_id)
                running.remove(r)
                completed += 1
        t += step_ms
        held = sum(state[r.request_id][1] for r in running)
        trace.append((t, len(running), len(waiting),
                      len(running) * shapes.fixed_bytes + held * shapes.kv_bytes_per_token,
                      alloc.reserved_bytes))
        if not running and not waiting and pending:
            t = max(t, -(-pending[0].arrival_ms // step_ms) * step_ms)
    return trace, preemptions, completed


def test_workload_is_deterministic_and_sane():
    a, b = mixed_workload(0), mixed_workload(0)
    assert a == b and a != mixed_workload(1)
    assert [r.request_id for r in a] == list(range(len(a)))
    assert all(x.arrival_ms <= y.arrival_ms for x, y in zip(a, a[1:]))
    docs = [r for r in a if r.kind == "document"]
    assert docs and all(20_000 <= r.arrival_ms <= 40_000 and r.prompt_tokens >= 8192 for r in docs)
    with pytest.raises(ValueError, match="doc_window_ms"):
        mixed_workload(0, doc_window_ms=(5, 1))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.key}")
def test_event_loop_equals_token_by_token_twin(policy):
    reqs = _small_workload()
    budget = 2**29
    res = simulate(reqs, policy, SHAPES, budget)
    trace, preemptions, completed = _reference(reqs, policy, SHAPES, budget)
    got = list(zip(res.time_ms.tolist(), res.running.tolist(), res.waiting.tolist(),
                   res.requested_bytes.tolist(), res.reserved_bytes.tolist()))
    assert got == trace
    assert (res.preemptions, res.completed) == (preemptions, completed)


def test_conservation_and_pressure():
    reqs = _small_workload()
    results = {p.key + str(i): simulate(reqs, p, SHAPES, 2**29) for i, p in enumerate(POLICIES)}
    for res in results.values():
        assert res.completed + res.refused == len(reqs)
        assert np.all(res.reserved_bytes <= res.capacity_bytes)
        assert np.all(res.padding_bytes >= 0)
        assert res.summary()["peak_running"] == res.running.max()
    assert any(r.preemptions for r in results.values())  # the budget really binds


def test_refusal_and_phase_means():
    huge = [SimRequest(0, "document", 0, 10**7, 10), SimRequest(1, "chat", 0, 100, 5)]
    res = simulate(huge, UnifiedPages(), SHAPES, 2**30)
    assert res.refused == 1 and res.refused_ids == [0] and res.completed == 1
    means = phase_means(res, {"all": (0, 10_000), "none": (50_000, 60_000)})
    assert means["all"] == pytest.approx(0.8) and means["none"] == 0.0
    with pytest.raises(ValueError, match="step_ms"):
        simulate(huge, UnifiedPages(), SHAPES, 2**30, step_ms=0)
