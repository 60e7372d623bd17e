"""The one simulation loop: on a memory budget it conserves requests and its event-driven
engine equals an obvious token-by-token twin; with a prefix cache it adds up hits; with both it
measures each as if the other were not there (the cache model is serial, see kimilab.sim.loop)."""

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab import config
from kimilab.costs import ONE_H200, CacheShapes
from kimilab.pool import JengaPages, PagePool, PoolExhausted, RequestAllocator, SplitPools, UnifiedPages, VllmPaddedPages
from kimilab.prefix import HybridPrefixCache, RadixTree, make_policy
from kimilab.sim import simulate
from kimilab.traffic import Request, load_trace, mixed_workload

SHAPES = CacheShapes.from_config(config.kimi_linear_48b, ONE_H200)
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
            if empty.fits(r.input_length + r.output_length):
                state[r.request_id] = [0, r.input_length]
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
            if gen_tok[0] == r.output_length:
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


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.key}")
def test_event_loop_equals_token_by_token_twin(policy):
    reqs = _small_workload()
    budget = 2**29
    res = simulate(reqs, memory=RequestAllocator(policy, SHAPES, budget))
    trace, preemptions, completed = _reference(reqs, policy, SHAPES, budget)
    got = list(zip(res.time_ms.tolist(), res.running.tolist(), res.waiting.tolist(),
                   res.requested_bytes.tolist(), res.reserved_bytes.tolist()))
    assert got == trace
    assert (res.preemptions, res.completed) == (preemptions, completed)


def test_conservation_and_pressure():
    reqs = _small_workload()
    results = {p.key + str(i): simulate(reqs, memory=RequestAllocator(p, SHAPES, 2**29))
               for i, p in enumerate(POLICIES)}
    for res in results.values():
        assert res.completed + res.refused == len(reqs)
        assert np.all(res.reserved_bytes <= res.capacity_bytes)
        assert np.all(res.padding_bytes >= 0)
        assert res.summary()["peak_running"] == res.running.max()
    assert any(r.preemptions for r in results.values())  # the budget really binds


def test_refusal_and_phase_means():
    huge = [Request(0, 0, 10**7, 10, kind="document"), Request(1, 0, 100, 5, kind="chat")]
    res = simulate(huge, memory=RequestAllocator(UnifiedPages(), SHAPES, 2**30))
    assert res.refused == 1 and res.refused_ids == [0] and res.completed == 1
    means = res.phase_means({"all": (0, 10_000), "none": (50_000, 60_000)})
    assert means["all"] == pytest.approx(0.8) and means["none"] == 0.0
    with pytest.raises(ValueError, match="step_ms"):
        simulate(huge, memory=RequestAllocator(UnifiedPages(), SHAPES, 2**30), step_ms=0)
    with pytest.raises(ValueError, match="expected a prefix cache"):
        simulate(huge)


def _reference_replay(records, capacity_blocks, block_size=512):
    """The obvious twin of a cache-only run: a radix tree served one request at a time, in order."""
    tree = RadixTree(PagePool(capacity_blocks, 1, backed=False), block_size)
    hits = []
    for r in sorted(records, key=lambda r: (r.arrival_ms, r.request_id)):
        hits.append(tree.serve(r.hash_ids, r.input_length).hit_tokens)
    return hits


@pytest.mark.parametrize("capacity_blocks", [8, 64, 10**6])
def test_cache_only_run_equals_serving_the_tree_in_order(capacity_blocks, agent_trace):
    records = agent_trace
    res = simulate(records, cache=RadixTree(PagePool(capacity_blocks, 1, backed=False), 512),
                   keep_per_request=True)
    hits = _reference_replay(records, capacity_blocks)
    assert [m.hit_tokens for m in res.per_request] == hits
    assert res.kv_hit_tokens == res.usable_hit_tokens == sum(hits)
    assert res.prompt_tokens == sum(r.input_length for r in records) and res.requests == len(records)
    assert res.time_ms.size == 0 and res.completed == 0  # no memory budget: no engine timeline


def test_cache_and_memory_together_measure_each_as_alone(agent_trace):
    reqs = [Request(r.request_id, r.arrival_ms, r.input_length, min(r.output_length, 64), hash_ids=r.hash_ids)
            for r in agent_trace[:300]]
    cfg = config.kimi_linear_48b

    def cache():
        return HybridPrefixCache.for_budget(cfg, make_policy("dual"), deployment=ONE_H200, block_size=512,
                                            capacity_tokens=200_000)

    def memory():
        return RequestAllocator(UnifiedPages(), SHAPES, 2**31)

    both = simulate(reqs, cache=cache(), memory=memory())
    alone_cache, alone_memory = simulate(reqs, cache=cache()), simulate(reqs, memory=memory())
    assert both.as_dict() | {"run_wall_s": 0} == alone_cache.as_dict() | {"run_wall_s": 0}
    assert both.summary() == alone_memory.summary()
    assert np.array_equal(both.running, alone_memory.running)


def test_prefill_charged_in_time_delays_tokens_and_recompute():
    """With prefill_tokens_per_step, a 5,000-token prompt waits ceil(5000/2048) = 3 steps before
    its first token; with a tight budget, preemptions make recomputation cost steps too."""
    one = [Request(0, 0, 5000, 10, kind="document")]
    free = simulate(one, memory=RequestAllocator(UnifiedPages(), SHAPES, 2**30))
    charged = simulate(one, memory=RequestAllocator(UnifiedPages(), SHAPES, 2**30), prefill_tokens_per_step=2048)
    assert charged.makespan_ms - free.makespan_ms == 3 * 20
    assert charged.completed == free.completed == 1
    reqs = _small_workload()
    for layout in POLICIES:
        a = simulate(reqs, memory=RequestAllocator(layout, SHAPES, 2**29))
        b = simulate(reqs, memory=RequestAllocator(layout, SHAPES, 2**29), prefill_tokens_per_step=1024)
        assert b.completed + b.refused == len(reqs) and b.makespan_ms >= a.makespan_ms
        assert np.all(b.reserved_bytes <= b.capacity_bytes) and np.all(b.padding_bytes >= 0)
    with pytest.raises(ValueError, match="prefill_tokens_per_step"):
        simulate(one, memory=RequestAllocator(UnifiedPages(), SHAPES, 2**30), prefill_tokens_per_step=0)


def test_a_parallel_sweep_gives_the_serial_numbers(data_dir):
    """replay_many on two processes == one process == simulate by hand (only wall time differs)."""
    from kimilab.prefix import RunPrefixCache, make_policy
    from kimilab.sim import Replay, replay_many

    trace = str(data_dir / "agent.jsonl")
    jobs = {(name, gb): Replay(trace, name, gb, ONE_H200, options=opts)
            for name, opts in (("ends", ()), ("dual", (("alpha", 0.02),)))
            for gb in (1, 2)}
    jobs["vllm", 2] = Replay(trace, "every-block", 2, ONE_H200, block_size=1888)
    two, one = replay_many(jobs, workers=2), replay_many(jobs, workers=1)
    strip = {"run_wall_s": 0}
    assert {k: r.as_dict() | strip for k, r in two.items()} == {k: r.as_dict() | strip for k, r in one.items()}
    by_hand = simulate(load_trace(trace), cache=RunPrefixCache(
        config.kimi_linear_48b, make_policy("dual", alpha=0.02), deployment=ONE_H200, block_size=512,
        capacity_tokens=jobs["dual", 1].capacity_tokens()))
    assert two["dual", 1].as_dict() | strip == by_hand.as_dict() | strip
    with pytest.raises(ValueError, match="jobs"):
        replay_many({"x": "not a job"})


def test_every_cache_a_sweep_names_replays_and_the_shipped_ones_are_what_they_say(data_dir):
    """Each of CACHES runs; vllm-align is chunk-ends at vLLM's block; SGLang's are segment caches on split pools."""
    from kimilab.costs import VLLM_TP4_H200, vllm_hybrid_pages
    from kimilab.prefix import RunPrefixCache
    from kimilab.prefix.policies import ChunkEnds
    from kimilab.sim import CACHES, Replay, rekey, replay, vllm_align_interval

    trace = str(data_dir / "agent.jsonl")
    records = load_trace(trace)[:200]
    results = {}
    for name in CACHES:
        results[name] = replay(Replay(trace, name, 2, VLLM_TP4_H200))
        assert results[name].policy == name or name in ("kv-only", "no-states") or results[name].policy
        assert 0.0 <= results[name].usable_hit_rate <= results[name].kv_hit_rate + 1e-12 or name == "oracle"
    assert results["no-states"].usable_hit_rate == 0.0
    block = vllm_hybrid_pages(config.kimi_linear_48b, VLLM_TP4_H200).block_tokens
    assert block == 480 and vllm_align_interval(VLLM_TP4_H200, block) == 8160
    by_hand = simulate(rekey(load_trace(trace), 512, block), cache=RunPrefixCache(
        config.kimi_linear_48b, ChunkEnds(8160, kv_boundary=True), deployment=VLLM_TP4_H200, block_size=block,
        capacity_tokens=Replay(trace, "vllm-align", 2, VLLM_TP4_H200).capacity_tokens()))
    assert by_hand.usable_hit_rate == results["vllm-align"].usable_hit_rate
    assert "online alpha" in results["marconi"].policy_detail
    with pytest.raises(ValueError, match="policy"):
        replay(Replay(trace, "lfu", 2, VLLM_TP4_H200))
    assert len(records) == 200


def test_the_agent_sessions_replay_on_their_poisson_timeline(data_dir):
    from kimilab.costs import VLLM_TP4_H200
    from kimilab.sim import Replay
    from kimilab.sim.sweep import _records
    from kimilab.traffic import CLAUDE_CODE, agent_requests, load_sessions

    path = str(data_dir / CLAUDE_CODE)
    got = _records(Replay(path, "ends", 10, VLLM_TP4_H200, sessions_per_s=0.1, seed=3))
    want = agent_requests(load_sessions(path), 0.1, seed=3)
    assert [(r.arrival_ms, r.hash_ids) for r in got] == [(r.arrival_ms, r.hash_ids) for r in want]


@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6), st.integers(0, 511)),
                min_size=1, max_size=12), st.sampled_from([240, 480, 1024, 1888]))
@settings(max_examples=examples(60), deadline=None)
def test_rekeying_never_claims_a_hit_the_trace_does_not_prove(turns, new_block):
    """Engine blocks finer or coarser than the trace's: a hit is at most the prompts' proven common prefix."""
    from kimilab.sim import rekey

    table, recs = {}, []
    for t, (path, short) in enumerate(turns):
        ids = tuple(table.setdefault((tuple(path[: j + 1]), short if j == len(path) - 1 else 0), len(table))
                    for j in range(len(path)))
        recs.append(Request(t, t, len(path) * 512 - short, 1, hash_ids=ids))
    coarse = rekey(recs, 512, new_block)
    for a, b, ca, cb in zip(recs, recs[1:], coarse, coarse[1:]):
        proven = 0
        for x, y in zip(a.hash_ids, b.hash_ids):
            if x != y:
                break
            proven += 1
        shared = 0
        for x, y in zip(ca.hash_ids, cb.hash_ids):
            if x != y:
                break
            shared += 1
        assert len(cb.hash_ids) == -(-cb.input_length // new_block)
        whole = min(shared, ca.input_length // new_block, cb.input_length // new_block)
        assert whole * new_block <= proven * 512


def test_simulate_many_gives_the_serial_numbers():
    from kimilab.sim import simulate_many

    reqs = mixed_workload(1, duration_ms=3000, doc_window_ms=(1000, 2000), chat_rate_per_s=8.0)
    jobs = {name: (reqs, layout, SHAPES, 2**29, None if name == "unified" else 1024)
            for name, layout in (("unified", UnifiedPages()), ("split", SplitPools(0.5)))}
    two, one = simulate_many(jobs, workers=2), simulate_many(jobs, workers=1)
    for k in jobs:
        assert two[k].summary() == one[k].summary() == simulate(
            reqs, memory=RequestAllocator(jobs[k][1], SHAPES, 2**29), prefill_tokens_per_step=jobs[k][4]).summary()
    with pytest.raises(ValueError, match="jobs"):
        simulate_many({"x": (reqs,)})


def test_build_cache_refuses_an_option_the_cache_does_not_take():
    """Once SGLang's caches ignored any option but interval and ratio; now every cache names what it takes."""
    from kimilab.sim.sweep import build_cache, cache_options

    assert cache_options("sglang-no-buffer") == ("interval", "ratio") and cache_options("oracle") == ()
    assert "alpha" in cache_options("marconi") and "alpha" in cache_options("dual")
    for name, options in (("sglang-no-buffer", {"alpha": 1.0}), ("vllm-align", (("interval", 1024),)),
                          ("ends", {"interval": 1024})):
        with pytest.raises(ValueError, match=f"options: {name} takes"):
            build_cache(name, [], config.kimi_linear_48b, ONE_H200, block_size=512, capacity_tokens=None,
                        options=options)
