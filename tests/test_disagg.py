"""Prefill/decode disaggregation: exact with real tensors, equal to colocated serving where it must be.

* Tensor mode: a disaggregated fleet's tokens equal Model.generate alone, through prefix hits
  on the prefill side, the hand-over of KV and states, and preemption (recompute) on a tight
  decode side.
* Alone on a free link, a prefill-decode pair serves each request at exactly the times one
  colocated engine does: the same steps, only on two engines.
* Accounting: every request finishes once, the bytes that crossed are the formula's, nothing leaks.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from fuzzing import examples

from kimilab.config import kimi_linear_48b, all_mla_27, tiny
from kimilab.costs import DEFAULT_DEPLOYMENT, DP4_EP4_H200, ONE_H200
from kimilab.engine import Engine, Live, TensorExecutor
from kimilab.engine.disagg import transfer_bytes
from kimilab.engine.tensor import submit
from kimilab.fleet.disagg import DisaggregatedFleet
from kimilab.prefix.offload import CLUSTER_RDMA, Tier
from kimilab.traffic import Request

FREE = Tier("free", float("inf"), 0.0)
FEW = settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])


def _prompts(rng, n: int, block: int, max_out: int = 7) -> list:
    """Prompts on two shared heads (so the prefill side has hits), each with its own tail."""
    heads = [rng.integers(0, tiny.vocab_size, int(rng.integers(block + 1, 2 * block + 3))) for _ in range(2)]
    out = []
    for i in range(n):
        p = np.concatenate([heads[i % 2], rng.integers(0, tiny.vocab_size, int(rng.integers(1, 2 * block)))])
        t_ms = 0 if i < n // 2 else 10**6  # two waves: the first at once, the second on a warm cache
        out.append(Request(i, t_ms, p.size, int(rng.integers(0, max_out + 1)), tokens=p))
    return out


def _serve_exactly(model, seed: int, block: int, prefill: int, decode: int, tight: bool, budget: int, link):
    """Serve two waves of prompts on a disaggregated fleet in tensor mode; check every output against
    Model.generate alone and that nothing leaked. Returns the fleet."""
    reqs = _prompts(np.random.default_rng(seed), 8, block, max_out=30)
    probe = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=block)
    need = max(-(-(r.input_length + r.output_length + 1) // block) for r in reqs) + 3 * probe.memory.state_pages
    cap = need * block if tight else None  # tight: room for about one request, so decode sides preempt
    with DisaggregatedFleet(tiny, prefill, decode, "least-loaded", deployment=ONE_H200, capacity_tokens=cap,
                            block_size=block, token_budget=budget * block, policy="dual", link=link,
                            executor=lambda: TensorExecutor(model)) as fleet:
        res = fleet.run(reqs)
        outputs = {}
        for e in fleet.instances:
            outputs.update(e.executor.outputs())
            e.check_no_leak()
    assert res.refused == 0 and sorted(outputs) == [r.request_id for r in reqs], "each finishes once"
    for r in reqs:
        np.testing.assert_array_equal(outputs[r.request_id], model.generate(r.tokens, r.output_length),
                                      err_msg=f"request {r.request_id}")
    moved = [r for r in reqs if r.output_length > 1]
    assert res.transfer["requests"] == len(moved)
    decoded = {f.request_id for e in fleet.decode_instances for f in e.finished}
    assert decoded == {r.request_id for r in moved}, "more than one token: decoded on a decode instance"
    return fleet


@FEW
@given(seed=st.integers(0, 10**6), block=st.sampled_from([4, 8]), prefill=st.integers(1, 2),
       decode=st.integers(1, 2), tight=st.booleans(), budget=st.sampled_from([2, 8]),
       link=st.sampled_from([FREE, CLUSTER_RDMA]))
def test_a_disaggregated_fleet_serves_the_tokens_of_model_generate(tiny_model, seed, block, prefill, decode, tight,
                                                                    budget, link):
    _serve_exactly(tiny_model, seed, block, prefill, decode, tight, budget, link)


def test_a_request_preempted_on_a_decode_instance_is_recomputed_there_exactly(tiny_model):
    """Two prefill instances feed one tight decode instance: it preempts, and the victim prefills its
    prompt and streamed tokens there; the prefill side resumed from its cache on the second wave."""
    fleet = _serve_exactly(tiny_model, 5, 4, 2, 1, True, 8, FREE)
    assert sum(e.preemptions for e in fleet.decode_instances) > 0
    assert any(e.executor.chunk_log for e in fleet.decode_instances), "the victim prefilled on the decode side"
    assert any(f.usable_hit > 0 for e in fleet.decode_instances for f in e.finished)


def _sparse(n: int, gap_ms: int = 10**6) -> list:
    """Requests far apart, so each is served alone; hash ids shared so some hit the prefill cache."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        n_in = int(rng.integers(600, 5000))
        nb = -(-n_in // 512)
        shared = [7, 8][: min(2, nb - 1)]  # whole blocks only, so the last block is the request's own
        ids = tuple(shared + [1000 + 10 * i + j for j in range(nb - len(shared))])
        out.append(Request(i, gap_ms * i, n_in, int(rng.integers(0, 400)), hash_ids=ids))
    return out


@pytest.mark.parametrize("config", [kimi_linear_48b, all_mla_27], ids=lambda c: c.name)
def test_alone_on_a_free_link_a_pair_serves_at_the_colocated_times(config):
    reqs = _sparse(12)
    alone = Engine(config, deployment=ONE_H200, capacity_tokens=None)
    submit(alone, reqs)
    alone.drain()
    with DisaggregatedFleet(config, 1, 1, "least-loaded", deployment=ONE_H200, capacity_tokens=None,
                            link=FREE) as fleet:
        res = fleet.run(reqs)
    want = {f.request_id: f for f in alone.finished}
    got = {int(i): (a + t, a + e) for i, a, t, e in zip(res.request_ids, res.arrival_s, res.ttft_s, res.e2e_s)}
    assert sorted(got) == sorted(want)
    for i, (first, end) in got.items():
        assert first == want[i].first_token_s and end == want[i].finish_s, i
    assert res.usable_hit.tolist() == [want[i].usable_hit for i in sorted(want)]


def test_the_bytes_that_cross_are_each_prompts_kv_and_states():
    reqs = _sparse(10, gap_ms=50)
    link = Tier("slow", 1e9, 1e-3)
    with DisaggregatedFleet(kimi_linear_48b, 2, 3, "least-work", deployment=ONE_H200, capacity_tokens=None,
                            link=link) as fleet:
        res = fleet.run(reqs)
        for e in fleet.instances:
            e.check_no_leak()
    moved = [r for r in reqs if r.output_length > 1]
    want = sum(transfer_bytes(kimi_linear_48b, ONE_H200, r.input_length) for r in moved)
    t = res.transfer
    assert (t["requests"], t["bytes_per_device"], t["in_flight"]) == (len(moved), want, 0)
    assert t["link_seconds"] == pytest.approx(len(moved) * 1e-3 + want / 1e9)
    assert res.finished == len(reqs)
    # the hybrid sends its states once a request; a transformer sends none, but more KV a token
    assert transfer_bytes(kimi_linear_48b, ONE_H200, 0) > 0 == transfer_bytes(all_mla_27, ONE_H200, 0)


def test_errors():
    with pytest.raises(ValueError, match="fails="):
        DisaggregatedFleet(tiny, 1, 1, "least-loaded", deployment=ONE_H200, capacity_tokens=None).run(
            _sparse(2), fails=[(0, 1.0)])
    with pytest.raises(ValueError, match="DP-attention"):
        DisaggregatedFleet(kimi_linear_48b, 1, 1, "least-loaded", deployment=DP4_EP4_H200, capacity_tokens=None)
    for kw in ({"host_bytes": 1e9}, {"store_bytes": 1e9}, {"isolation": "quota"}):
        with pytest.raises(ValueError, match="not modelled"):
            DisaggregatedFleet(kimi_linear_48b, 1, 1, "least-loaded", deployment=ONE_H200, capacity_tokens=None, **kw)
    for p, d in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="prefill|decode"):
            DisaggregatedFleet(kimi_linear_48b, p, d, "least-loaded", deployment=ONE_H200, capacity_tokens=None)
    with pytest.raises(ValueError, match="link"):
        DisaggregatedFleet(kimi_linear_48b, 1, 1, "least-loaded", deployment=ONE_H200, capacity_tokens=None,
                           link="rdma")
    with pytest.raises(ValueError, match="n_tokens"):
        transfer_bytes(kimi_linear_48b, ONE_H200, -1)
    assert Live  # the public names the tests use stay importable


def test_closed_loop_sessions_run_on_a_disaggregated_fleet():
    """Agent sessions, closed loop: each follow-up is sent after its reply, which a decode instance
    streamed; a tight decode pool preempts; every request sent finishes and nothing leaks."""
    from agent_sessions import random_sessions
    from kimilab.fleet.closed import run_closed_loop

    sessions = random_sessions(1, block=512)
    with DisaggregatedFleet(kimi_linear_48b, 1, 2, "prefix-affinity", deployment=ONE_H200,
                            capacity_tokens=50 * 512, token_budget=2048, max_batch=4) as fleet:
        res = run_closed_loop(fleet, sessions, concurrency=6, duration_s=20.0, seed=0, start_spread_s=1.0)
        for e in fleet.instances:
            e.check_no_leak()
        preempted = sum(e.preemptions for e in fleet.decode_instances)
    assert res.finished == res.requests > 30 and res.usable_hit.sum() > 0
    assert preempted > 0, "the tight decode pool preempted, and recomputed"
    assert res.transfer["requests"] == int((res.output_tokens > 1).sum()) and res.transfer["in_flight"] == 0
    assert (res.ttft_s > 0).all() and set(res.instance.tolist()) <= {0, 1, 2}
    multi = res.output_tokens > 1
    assert set(res.instance[multi].tolist()) <= {1, 2}, "decoded on the decode instances"


def test_fleet_command_disaggregates(tmp_path, capsys):
    import json

    from kimilab.__main__ import main
    from kimilab.traffic import write_trace

    reqs = [Request(i, 40 * i, 3 * 512 - 7, 20, hash_ids=(0, 1 + i % 3, 10 + i)) for i in range(12)]
    path = write_trace(tmp_path / "chat.jsonl", reqs)
    assert main(["fleet", str(path), "--instances", "3", "--prefill", "1", "--router", "prefix-affinity",
                 "--capacity-tokens", "inf"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finished"] == 12 and out["transfer"]["requests"] == 12 and out["transfer"]["decode_instances"] == 2
    assert out["transfer"]["bytes_per_device"] == 12 * transfer_bytes(kimi_linear_48b, DEFAULT_DEPLOYMENT, 3 * 512 - 7)
    for extra in (["--prefill", "3"], ["--prefill", "1", "--fail", "0@1"], ["--prefill", "1", "--store-gb", "1"],
                  ["--prefill", "0"]):
        with pytest.raises(SystemExit) as err:
            main(["fleet", str(path), "--instances", "3", "--router", "least-loaded", "--capacity-tokens", "inf",
                  *extra])
        assert err.value.code == 2
        assert "--prefill" in capsys.readouterr().err


def test_part_b_refuses_a_split_it_has_no_instances_for():
    from kimilab.experiment.scale import run_part_b

    with pytest.raises(ValueError, match="prefill=1"):
        run_part_b(instances=1, agent_instances=2, prefill=1, variants=["ends + prefix-affinity"])
    with pytest.raises(ValueError, match="no host_ratio"):
        run_part_b(instances=4, agent_instances=4, prefill=1, host_ratio=2.0)


def test_handover_bytes_and_the_best_split():
    from kimilab.experiment.disagg import best_splits, handover_bytes, split_goodputs

    got = handover_bytes("kimi_linear_48b", [0, 5, 70_000])
    assert got.tolist() == [transfer_bytes(kimi_linear_48b, DEFAULT_DEPLOYMENT, n) for n in (0, 5, 70_000)]
    fp8, bf16 = handover_bytes("all_mla_27_fp8kv", [1000])[0], handover_bytes("all_mla_27", [1000])[0]
    assert fp8 * 2 == bf16 > 0 == handover_bytes("all_mla_27", [0])[0]
    rows = [{"workload": "chat", "variant": "v", "prefill": p, "goodput": g}
            for p, g in ((None, 5.0), (1, 4.0), (2, 6.0), (3, 5.5))]
    co, best = best_splits(rows)["chat", "v"]
    assert co["prefill"] is None and best["prefill"] == 2
    with pytest.raises(ValueError, match="instances"):
        split_goodputs({"chat": ["v"]}, {}, instances=1, n_requests=10, rel_tol=0.1, start=1.0,
                       agent_duration_s=60.0, orders=1)
    with pytest.raises(ValueError, match="workloads"):
        split_goodputs({"docs": ["v"]}, {}, n_requests=10, rel_tol=0.1, start=1.0, agent_duration_s=60.0, orders=1)
