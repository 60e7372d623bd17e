"""The engine's tensor mode: the same scheduling loop on the reduced model equals Model.generate alone.

Each workload is built so the mechanism it tests must happen (asserted, not hoped
for): prefix hits served from real snapshots, prompts split over several steps,
preemption with recompute of already-streamed tokens. The decisions (Finished
records) must equal the accounting engine's on the same requests.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from fuzzing import examples

from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import ONE_H200
from kimilab.engine import Engine, Executor, Live, TensorExecutor, serve
from kimilab.engine.tensor import submit
from kimilab.model import Model
from kimilab.prefix import HybridPrefixCache
from kimilab.prefix.offload import Tier
from kimilab.traffic import Request

FEW = settings(max_examples=examples(5), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])
_REF: dict = {}


def _alone(model: Model, req) -> list[int]:
    """Model.generate on the request's prompt, on a fresh cache (memoised per prompt and length)."""
    key = (req.tokens.tobytes(), req.output_length)
    if key not in _REF:
        _REF[key] = model.generate(req.tokens, req.output_length)
    return _REF[key]


def _check_exact(model: Model, engine: Engine, outputs: dict, requests) -> None:
    refused = [live.req.request_id for live in engine.refused]
    assert sorted(list(outputs) + refused) == sorted(r.request_id for r in requests), "each finishes once"
    for r in requests:
        if r.request_id in outputs:
            np.testing.assert_array_equal(outputs[r.request_id], _alone(model, r), err_msg=f"request {r.request_id}")
    engine.check_no_leak()


def _shared(rng, n: int, block: int, t_ms: int = 0, max_out: int = 6, first_id: int = 0) -> list:
    """Prompts on two shared system prompts (1-2 blocks plus a bit), each with its own tail."""
    heads = [rng.integers(0, tiny.vocab_size, int(rng.integers(block + 1, 2 * block + 3))) for _ in range(2)]
    out = []
    for i in range(n):
        p = np.concatenate([heads[i % 2], rng.integers(0, tiny.vocab_size, int(rng.integers(1, 2 * block)))])
        out.append(Request(first_id + i, t_ms, p.size, int(rng.integers(0, max_out + 1)), tokens=p))
    return out


def _turn_two(rng, first: list, outputs: dict, t_ms: int) -> list:
    """Each request's next turn: its prompt, the reply it got, and something new."""
    out = []
    for i, r in enumerate(first):
        reply = np.asarray(outputs[r.request_id], dtype=np.int64)
        p = np.concatenate([r.tokens, reply, rng.integers(0, tiny.vocab_size, int(rng.integers(1, 6)))])
        out.append(Request(len(first) + i, t_ms, p.size, int(rng.integers(1, 5)), tokens=p))
    return out


def _accounting(requests, **kw) -> Engine:
    """The same requests on the accounting engine (no executor: fast-forwarded decode)."""
    e = Engine(tiny, deployment=ONE_H200, **kw)
    submit(e, requests)
    e.drain()
    return e


def _same_decisions(a: Engine, b: Engine) -> None:
    """The same decisions at the same simulated times: Finished records equal field for field."""
    assert a.finished == b.finished
    assert [live.req.request_id for live in a.refused] == [live.req.request_id for live in b.refused]
    assert (a.preemptions, a.n_steps, a.clock, a.busy) == (b.preemptions, b.n_steps, b.clock, b.busy)


@FEW
@given(seed=st.integers(0, 10**6), block=st.sampled_from([4, 8]), budget=st.integers(2, 5))
def test_prefix_hits_and_chunked_prefill_are_exact(tiny_model, seed, block, budget):
    """Two turns of shared-prefix traffic, a budget smaller than every prompt, no memory limit."""
    rng = np.random.default_rng(seed)
    kw = dict(block_size=block, token_budget=budget)
    first = _shared(rng, 5, block)
    assert min(r.input_length for r in first) > budget
    ex = TensorExecutor(tiny_model)
    engine = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, executor=ex, **kw)
    submit(engine, first)
    engine.drain()
    second = _turn_two(rng, first, ex.outputs(), t_ms=10**6)  # after the first turn has drained
    submit(engine, second)
    engine.drain()
    _check_exact(tiny_model, engine, ex.outputs(), first + second)
    hits = {f.request_id: f.usable_hit for f in engine.finished}
    assert all(hits[r.request_id] >= block for r in second), "a second turn resumes from its first turn's end"
    assert ex.store_hit_tokens > 0, "hits resumed from real stored KV + states"
    log = ex.chunk_log  # (request id, start, n): a continuation starts where the last chunk ended
    assert any(a[0] == b[0] and b[1] == a[1] + a[2] for i, a in enumerate(log) for b in log[i + 1:]), \
        "a prompt was split over several steps"
    _same_decisions(engine, _accounting(first + second, capacity_tokens=None, **kw))


@FEW
@given(seed=st.integers(0, 10**6), block=st.sampled_from([4, 8]), n=st.integers(3, 4))
def test_preemption_recomputes_streamed_tokens_exactly(tiny_model, seed, block, n):
    """Short prompts, long replies, a pool that fits one request alone (the engine's rule) but not
    three grown ones: three start together, all grow, the newest is preempted and recomputes
    its prompt plus the tokens it already streamed."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        p = rng.integers(0, tiny.vocab_size, int(rng.integers(1, block)))
        reqs.append(Request(i, 0, p.size, int(rng.integers(2 * block + 2, 3 * block + 1)), tokens=p))
    probe = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=block)
    need = max(-(-(r.input_length + r.output_length + 1) // block) for r in reqs) + 3 * probe.memory.state_pages
    kw = dict(capacity_tokens=need * block, block_size=block, token_budget=4 * block)
    engine, outputs = serve(tiny_model, reqs, deployment=ONE_H200, **kw)
    assert not engine.refused
    _check_exact(tiny_model, engine, outputs, reqs)
    assert engine.preemptions > 0
    again = [f for f in engine.finished if f.preemptions > 0]
    assert any(f.contexts > f.input_length for f in again), "a re-admission prefilled streamed tokens"
    _same_decisions(engine, _accounting(reqs, **kw))


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), block=st.sampled_from([4, 8]), budget=st.integers(4, 40),
       spare=st.integers(0, 2), policy=st.sampled_from(["dual", "every-block", "ends"]))
def test_mixed_workloads_are_exact(tiny_model, seed, block, budget, spare, policy):
    """Everything at once: shared prefixes, staggered arrivals, chunking, a tight pool (spare room
    in checkpoints' worth of pages)."""
    rng = np.random.default_rng(seed)
    reqs = [Request(r.request_id, int(rng.integers(0, 3)), r.input_length, r.output_length, tokens=r.tokens)
            for r in _shared(rng, 7, block, max_out=2 * block)]
    probe = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=block)
    need = max(-(-(r.input_length + r.output_length + 1) // block) for r in reqs) + 3 * probe.memory.state_pages
    spare += policy == "every-block"  # a checkpoint per block: room for one more
    kw = dict(capacity_tokens=(need + spare * probe.memory.state_pages) * block, block_size=block,
              token_budget=budget, policy=policy)
    engine, outputs = serve(tiny_model, reqs, deployment=ONE_H200, **kw)
    _check_exact(tiny_model, engine, outputs, reqs)
    assert len(outputs) >= 2
    _same_decisions(engine, _accounting(reqs, **kw))


def test_a_refused_admission_leaves_no_checkpoint_behind(tiny_model):
    """The cache admits a request's blocks and checkpoints in ``begin``, before the engine's memory
    check; when that check refuses the admission they leave again (``abandon``), so the retry
    finds nothing of its own to hit (the executor would raise on a hit with no snapshot)."""
    rng = np.random.default_rng(0)
    reqs = [Request(0, 0, 15, 30, tokens=rng.integers(0, tiny.vocab_size, 15)),  # holds the pool while decoding
            Request(1, 0, 20, 2, tokens=rng.integers(0, tiny.vocab_size, 20))]  # does not fit next to it at first
    kw = dict(capacity_tokens=34 * 8, block_size=8)
    engine, outputs = serve(tiny_model, reqs, deployment=ONE_H200, **kw)
    _check_exact(tiny_model, engine, outputs, reqs)
    assert {f.request_id: f.usable_hit for f in engine.finished} == {0: 0, 1: 0}
    assert engine.finished[-1].first_token_s > engine.finished[0].arrival_s, "request 1 waited"
    assert engine.executor.store_hit_tokens == 0
    _same_decisions(engine, _accounting(reqs, **kw))


def test_two_requests_leave_a_shared_in_flight_prefix_uncomputed(tiny_model, monkeypatch):
    """Four decoders fill the pool while A and B, sharing a 16-token prefix, prefill it in small
    chunks. B begins on A's in-flight blocks; when the decoders grow, both are preempted before
    the last shared block is computed (B first, then A, its last holder). The block must leave the
    cache with A (no unpinned, uncomputed block; no leaked page), and every output stays exact."""
    left = []  # (node, holders before this abandon) for every uncomputed block an abandon leaves
    abandon = HybridPrefixCache.abandon

    def spy(cache, path, computed, start=0):
        left.extend((node, node.refcount) for node in path if not node.computed and node.end > computed)
        return abandon(cache, path, computed, start)

    monkeypatch.setattr(HybridPrefixCache, "abandon", spy)
    rng = np.random.default_rng(0)
    head = rng.integers(0, tiny.vocab_size, 16)
    reqs = [Request(i, 0, 1, 60, tokens=rng.integers(0, tiny.vocab_size, 1)) for i in range(4)]
    reqs += [Request(4, 0, 17, 3, tokens=np.concatenate([head, [1]])),
             Request(5, 0, 18, 3, tokens=np.concatenate([head, [2, 3]]))]
    probe = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=4)
    need = max(-(-(r.input_length + r.output_length + 1) // 4) for r in reqs) + 3 * probe.memory.state_pages
    kw = dict(capacity_tokens=need * 4, block_size=4, token_budget=7)
    engine, outputs = serve(tiny_model, reqs, deployment=ONE_H200, **kw)
    shared_then_last = [node for j, (node, holders) in enumerate(left) if holders > 1
                        and any(n is node and h == 1 for n, h in left[j + 1:])]
    assert shared_then_last, "B left A's in-flight block, then A left it uncomputed as its last holder"
    assert engine.preemptions >= 2 and not engine.refused
    _check_exact(tiny_model, engine, outputs, reqs)  # includes check_no_leak
    _same_decisions(engine, _accounting(reqs, **kw))


def test_hooks_keep_accounting_results():
    """An engine with the do-nothing Executor is the accounting engine: a long run with preemption."""
    rng = np.random.default_rng(3)
    reqs, t, fresh = [], 0, iter(range(1, 10**9))
    paths = [[] for _ in range(4)]  # sessions growing chained block ids: later turns hit earlier ones
    for i in range(60):
        path = paths[int(rng.integers(4))]
        if len(path) > 6 or rng.random() < 0.2:
            path.clear()
        path.extend(next(fresh) for _ in range(int(rng.integers(1, 3))))
        ids = tuple(path) + (next(fresh),)
        reqs.append(Request(i, t, (len(ids) - 1) * 512 + int(rng.integers(1, 513)), int(rng.integers(0, 2000)),
                            hash_ids=ids))
        t += int(rng.integers(0, 2))
    kw = dict(capacity_tokens=80 * 512, token_budget=1024)
    plain = Engine(kimi_linear_48b, deployment=ONE_H200, **kw)
    submit(plain, reqs)
    plain.drain()
    hooked = Engine(kimi_linear_48b, deployment=ONE_H200, executor=Executor(), **kw)
    submit(hooked, reqs)
    hooked.drain()
    assert plain.preemptions > 0 and sum(f.usable_hit for f in plain.finished) > 0
    _same_decisions(plain, hooked)


def test_errors(tiny_model):
    e = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, executor=TensorExecutor(tiny_model))
    with pytest.raises(ValueError, match="req.tokens"):
        e.submit(Live(Request(0, 0, 10, 2, hash_ids=(1,)), 0.0))
    with pytest.raises(ValueError, match="req.tokens"):
        e.submit(Live(Request(1, 0, 2, 2, tokens=np.array([1, tiny.vocab_size])), 0.0))
    e.submit(Live(Request(2, 0, 2, 2, tokens=np.array([1, 2])), 0.0))
    with pytest.raises(ValueError, match="request_id"):
        e.submit(Live(Request(2, 0, 2, 2, tokens=np.array([1, 2])), 0.0))
    with pytest.raises(ValueError, match="config"):
        Engine(kimi_linear_48b, deployment=ONE_H200, capacity_tokens=None, executor=TensorExecutor(tiny_model))
    with pytest.raises(ValueError, match="policy"):
        Engine(tiny, deployment=ONE_H200, capacity_tokens=None, policy="kv-only", executor=TensorExecutor(tiny_model))
    with pytest.raises(ValueError, match="executor"):
        Engine(tiny, deployment=ONE_H200, capacity_tokens=None, executor=e.executor)
    with pytest.raises(ValueError, match="model"):
        TensorExecutor(tiny)


# ----- a host tier and a shared store under tensor mode: snapshots travel with the copies -----

def _two_turns(model, engine, first, seed):
    submit(engine, first)
    engine.drain()
    second = _turn_two(np.random.default_rng(seed + 1), first, engine.executor.outputs(), t_ms=10**6)
    submit(engine, second)
    engine.drain()
    return second


@FEW
@given(seed=st.integers(0, 10**6), block=st.sampled_from([4, 8]), policy=st.sampled_from(["ends", "dual"]))
def test_a_host_tier_serves_evicted_prefixes_exactly(tiny_model, seed, block, policy):
    """A pool with room for about one request: the first turns push each other's checkpoints out, and
    the second turns come back for them. With host DRAM under the cache they are loaded back, snapshot
    and all: every output equals Model.generate alone, more of the prompts resume from stored snapshots
    than without the tier, and every decision equals the accounting engine's with the same tier."""
    rng = np.random.default_rng(seed)
    first = _shared(rng, 6, block)
    probe = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=block)
    need = max(-(-(r.input_length + r.output_length + 20) // block) for r in first) + 3 * probe.memory.state_pages
    kw = dict(capacity_tokens=need * block, block_size=block, token_budget=4 * block, policy=policy)
    runs = {}
    free = Tier("free", float("inf"), 0.0)  # the reduced model's prefill is microseconds: only a free load pays
    for name, tier in (("plain", {}), ("host", {"host_bytes": float("inf"), "host_link": free})):
        engine = Engine(tiny, deployment=ONE_H200, executor=TensorExecutor(tiny_model), **kw, **tier)
        second = _two_turns(tiny_model, engine, first, seed)
        _check_exact(tiny_model, engine, engine.executor.outputs(), first + second)
        _same_decisions(engine, _accounting(first + second, **kw, **tier))
        runs[name] = engine
    cache = runs["host"].memory.cache("default")
    assert cache.loaded_checkpoints > 0, "a checkpoint came back from the host"
    assert runs["host"].executor.store_hit_tokens > runs["plain"].executor.store_hit_tokens


def test_a_shared_store_moves_snapshots_between_engines_exactly(tiny_model):
    """Engine 0 serves the first turns; engine 1, which has seen nothing, serves the second turns from
    the store they share: it loads their checkpoints, resumes from the snapshots engine 0 computed,
    and every output equals Model.generate alone."""
    from kimilab.prefix.host import HostTier

    store = HostTier(float("inf"), Tier("free", float("inf"), 0.0))  # the reduced model's prefill is microseconds
    engines = [Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=4, store=store,
                      executor=TensorExecutor(tiny_model)) for _ in range(2)]
    first = _shared(np.random.default_rng(5), 4, 4)
    submit(engines[0], first)
    engines[0].drain()
    second = _turn_two(np.random.default_rng(6), first, engines[0].executor.outputs(), t_ms=10**6)
    submit(engines[1], second)
    engines[1].drain()
    for engine, reqs in zip(engines, (first, second)):
        _check_exact(tiny_model, engine, engine.executor.outputs(), reqs)
    assert store.loads >= len(second) - 1 and engines[1].executor.store_hit_tokens > 0
    assert all(f.usable_hit >= 4 for f in engines[1].finished), "each second turn resumed past a block"
