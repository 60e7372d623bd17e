"""The ``fleet`` command: one JSON object, deterministic, one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from kimilab.__main__ import main
from kimilab.traffic import Request, write_trace


@pytest.fixture()
def traces(tmp_path):
    a = [Request(i, 40 * i, 3 * 512 - 7, 20, hash_ids=(0, 1 + i % 3, 10 + i)) for i in range(12)]
    b = [Request(i, 55 * i, 2 * 512, 9, hash_ids=(0, 100 + i)) for i in range(9)]
    return write_trace(tmp_path / "chat.jsonl", a), write_trace(tmp_path / "docs.jsonl", b)


def _run(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_fleet_prints_one_deterministic_object(traces, capsys):
    argv = ["fleet", *map(str, traces), "--instances", "3", "--router", "state-aware", "--isolation", "quota",
            "--capacity-tokens", "200000", "--fail", "1@0.2"]
    a, b = _run(capsys, argv), _run(capsys, argv)
    for key in ("requests", "finished", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p99_s",
                "usable_hit_rate", "tenants", "instances", "run_wall_s"):
        assert key in a
    assert a["requests"] == a["finished"] == 21
    assert set(a["tenants"]) == {"chat", "docs"}
    a.pop("run_wall_s"), b.pop("run_wall_s")
    assert a == b


@pytest.mark.parametrize("extra", [["--router", "random"], ["--instances", "0"], ["--fail", "5@1"],
                                   ["--fail", "x"], ["--rate-scale", "-1"], ["--capacity-tokens", "10"]])
def test_fleet_bad_arguments_exit_2(traces, extra):
    base = {"--instances": "2", "--router": "least-loaded", "--capacity-tokens": "inf"}
    args = [a for pair in base.items() for a in pair]
    args += extra
    proc = subprocess.run([sys.executable, "-m", "kimilab", "fleet", str(traces[0]), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1


def test_fleet_bad_trace_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    proc = subprocess.run([sys.executable, "-m", "kimilab", "fleet", str(bad), "--instances", "1", "--router",
                           "round-robin", "--capacity-tokens", "inf"], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_fleet_steps_on_the_deployment_it_is_given(traces):
    """The instances' step times come from ``deployment=``, not from the default node."""
    from kimilab.config import kimi_linear_48b
    from kimilab.costs import H800, VLLM_TP4_H200
    from kimilab.fleet import run_fleet
    from kimilab.traffic import load_trace

    reqs = load_trace(traces[0])
    kw = dict(instances=2, router="round-robin", capacity_tokens=None)
    h200 = run_fleet(reqs, kimi_linear_48b, deployment=VLLM_TP4_H200, **kw)
    h800 = run_fleet(reqs, kimi_linear_48b, deployment=VLLM_TP4_H200.with_(name="tp4-h800", device=H800), **kw)
    assert h200.summary()["tpot_p50_s"] < h800.summary()["tpot_p50_s"]  # the slower HBM shows
    assert h200.summary()["deployment"] == "vllm-tp4-h200" and h800.summary()["deployment"] == "tp4-h800"


def test_run_many_job_may_carry_its_own_requests():
    """A job's own ``requests`` replace the shared ones, and results equal a plain run_fleet."""
    import numpy as np

    from kimilab.config import kimi_linear_48b
    from kimilab.fleet import run_fleet
    from kimilab.fleet.sweep import run_many

    shared = [Request(i, 100 * i, 1024, 8, hash_ids=(i % 3, 10 + i)) for i in range(12)]
    own = [Request(i, 50 * i, 1536, 4, hash_ids=(0, 1, 20 + i)) for i in range(9)]
    from kimilab.costs import DEFAULT_DEPLOYMENT

    job = dict(instances=2, router="prefix-affinity", capacity_tokens=200_000, deployment=DEFAULT_DEPLOYMENT)
    a, b = run_many(shared, [job, dict(job, requests=own)], workers=1)
    assert (a.requests, b.requests) == (12, 9)
    ref = run_fleet(own, kimi_linear_48b, **job)
    np.testing.assert_array_equal(b.ttft_s, ref.ttft_s)
    np.testing.assert_array_equal(b.usable_hit, ref.usable_hit)


# ----- routers, goodput and the closed loop ------------------------------------------------------

import numpy as np  # noqa: E402

from kimilab.costs import ONE_H200  # noqa: E402


def _chain_trace(n=60, gap_ms=40):
    """Conversations that grow: turn t of conversation c re-sends its turn t-1 and adds a block."""
    out, t = [], 0
    for i in range(n):
        c, turn = i % 6, i // 6
        ids = tuple(1000 * c + j for j in range(turn + 2))
        out.append(Request(i, t, len(ids) * 512 - 100, 30, hash_ids=ids))
        t += gap_ms
    return out


def test_least_work_counts_tokens_not_requests():
    from kimilab.config import kimi_linear_48b
    from kimilab.engine import Live
    from kimilab.fleet import Fleet

    fleet = Fleet(kimi_linear_48b, 2, "least-work", deployment=ONE_H200, capacity_tokens=None)
    a, b = fleet.instances
    a.submit(Live(Request(0, 0, 100 * 512, 5, hash_ids=tuple(range(100))), 0.0))  # one huge prompt
    for i in range(3):
        b.submit(Live(Request(1 + i, 0, 512, 5, hash_ids=(10**6 + i,)), 0.0))  # three small ones
    assert a.prefill_backlog == 100 * 512 and b.prefill_backlog == 3 * 512
    assert fleet.router.choose(Request(9, 0, 512, 5, hash_ids=(7,)), fleet.instances) is b  # least-loaded: a


def test_the_approximate_router_tree_never_sees_an_eviction():
    from kimilab.config import kimi_linear_48b
    from kimilab.fleet import ApproximateTree, Fleet, make_router

    reqs = _chain_trace()
    fleets = {approx: Fleet(kimi_linear_48b, 2, "prefix-affinity", deployment=ONE_H200, capacity_tokens=None,
                            router_options={"approximate": approx}) for approx in (False, True)}
    for fleet in fleets.values():
        fleet.run([reqs[6]])  # conversation 0, turn 1 lands on instance 0 (both trees empty: fewest pages)
        assert fleet.instances[0].finished
        for cache in fleet.instances[0].memory.all_caches():
            cache.evict_all()  # the instance evicts it ...
        from kimilab.engine import Live

        fleet.instances[0].submit(Live(Request(99, 0, 4 * 512, 2, hash_ids=(7, 8, 9, 10)), 1.0))
        fleet.instances[0].drain()  # ... and caches something else: it holds more pages than instance 1
    nxt = reqs[12]  # conversation 0, turn 2
    assert fleets[True].router.choose(nxt, fleets[True].instances).index == 0  # still believes it is there
    assert fleets[False].router.choose(nxt, fleets[False].instances).index == 1  # sees it gone: fewest pages
    tree = ApproximateTree(512)
    tree.record(reqs[6])  # whole blocks (0, 1), a state guessed at its end
    assert tree.view(nxt) == (2 * 512, 2 * 512, 0) and tree.n_pages == 2
    with pytest.raises(ValueError, match="hash ids"):
        tree.view(Request(0, 0, 10, 1, tokens=np.arange(10)))
    with pytest.raises(ValueError, match="router='least-work'"):
        make_router("least-work", approximate=True)


def test_state_aware_counts_the_checkpoint_it_leaves_behind():
    """KV cached without a state: route_view reports where the policy would checkpoint (the branch point
    under dual, nothing under kv-only) and the state-aware router stays with that KV."""
    from kimilab.config import kimi_linear_48b
    from kimilab.engine import Engine, Live

    e = Engine(kimi_linear_48b, deployment=ONE_H200, capacity_tokens=None, policy="dual")
    for i, ids in enumerate(((1, 2, 3, 4), (1, 2, 3, 5))):
        e.submit(Live(Request(i, 0, 4 * 512, 2, hash_ids=ids), 0.0))
        e.drain()
    # (1, 2, 3) is a branch point now, with its checkpoint: cached usable at 1,536
    assert e.route_view(Request(9, 0, 5 * 512, 2, hash_ids=(1, 2, 3, 6, 7)))[:2] == (3 * 512, 3 * 512)
    for node in e.memory.cache("default").tree.nodes():  # drop every state: KV alone is left
        if node.payload is not None:
            e.memory.cache("default")._drop_checkpoint(node)
    kv, usable, left = e.route_view(Request(9, 0, 5 * 512, 2, hash_ids=(1, 2, 3, 6, 7)))
    assert (kv, usable, left) == (3 * 512, 0, 3 * 512)  # dual would checkpoint the branch point again
    assert e.route_view(Request(9, 0, 4 * 512, 2, hash_ids=(1, 2, 3, 4)))[1:] == (0, 4 * 512)  # its own end


def test_slo_guard_stops_only_runs_that_fail():
    from kimilab.config import kimi_linear_48b
    from kimilab.fleet import run_fleet
    from kimilab.fleet.goodput import SLO, SloGuard, _certain, meets

    assert _certain(2, 100, 99) and not _certain(1, 100, 99)  # p99 of 100 values interpolates the two largest
    assert _certain(2, 101, 99) and not _certain(1, 101, 99)
    for q in (50, 95, 99):  # the rule agrees with numpy on every count of misses
        for n in (7, 60, 101):
            for bad in range(n + 1):
                x = np.r_[np.zeros(n - bad), np.ones(bad)]
                if _certain(bad, n, q):
                    assert np.percentile(x, q) > 0.5
    reqs = _chain_trace(80, gap_ms=5)
    slo = SLO("t", 0.4, 90, 0.05, 90, "test")
    for scale in (0.05, 1.0, 8.0):
        kw = dict(deployment=ONE_H200, instances=2, router="least-work", capacity_tokens=None, rate_scale=scale)
        full = run_fleet(reqs, kimi_linear_48b, **kw)
        guarded = run_fleet(reqs, kimi_linear_48b, guard=SloGuard(slo, reqs), **kw)
        assert meets(guarded, slo) == meets(full, slo)
        assert not guarded.aborted or not meets(full, slo)


def test_goodput_searches():
    from kimilab.fleet.goodput import max_rate_scale, max_sessions, min_instances

    class R:  # a fake result: passes while the load is at most the capacity
        def __init__(self, ok):
            self.aborted, self.finished, self.requests = not ok, 1, 1
            self.arrival_s = self.ttft_s = self.tpot_s = self.e2e_s = np.zeros(1)
            self.output_tokens, self.busy_s = np.ones(1, int), np.zeros((1, 1))
            self.n_instances = self.n_deployed = self.devices = 1

    from kimilab.fleet.goodput import MOONCAKE_SLO as slo

    scale, _, tried = max_rate_scale(lambda s: R(s <= 13.7), slo, start=1.0, rel_tol=0.01)
    assert 13.7 / 1.01 <= scale <= 13.7 and len(tried) < 20
    assert max_rate_scale(lambda s: R(False), slo)[0] == 0.0
    assert min_instances(lambda n: R(n >= 11), slo)[0] == 11
    assert max_sessions(lambda n: R(n <= 37), slo, start=8)[0] == 37
    assert 30 <= max_sessions(lambda n: R(n <= 37), slo, start=8, rel_tol=0.2)[0] <= 37


def test_priced_is_devices_times_hours_times_price():
    from kimilab.config import kimi_linear_48b
    from kimilab.costs import VLLM_TP4_H200
    from kimilab.fleet import run_fleet
    from kimilab.fleet.goodput import priced

    res = run_fleet(_chain_trace(), kimi_linear_48b, deployment=VLLM_TP4_H200, instances=3, router="least-work",
                    capacity_tokens=None)
    p = priced(res, span_s=100.0, price_per_hour=3.0)
    assert res.devices == 12 and p["instances"] == 3
    assert p["usd_per_m_output"] == pytest.approx(12 * 100 / 3600 * 3.0 / res.output_tokens.sum() * 1e6)
    assert p["requests_per_s_per_instance"] == pytest.approx(res.finished / 100 / 3)
    assert 0 < p["busy_fraction"] <= 1


def test_closed_loop_waits_for_the_reply_and_the_think_time():
    from kimilab.config import kimi_linear_48b
    from kimilab.fleet import Fleet
    from kimilab.fleet.closed import MAX_THINK_S, run_closed_loop, session_turns
    from kimilab.traffic import SessionRequest

    rows = [SessionRequest(0, 0, 0, 5000, 1024, 10, (1, 2)),
            SessionRequest(0, 0, 8000, 4000, 2048, 10, (1, 2, 3, 4)),  # sent 3 s after the first reply
            SessionRequest(0, 1, 8000, 1000, 600, 5, (50, 51)),  # a sub-agent sent with it
            SessionRequest(0, 0, 200_000, 1000, 2600, 10, (1, 2, 3, 4, 5, 6)),  # after the latest reply (12 s): capped at 60 s
            SessionRequest(1, 0, 0, 1000, 700, 3, (7, 8))]
    turns = session_turns(rows)
    assert [(t.after, t.think_s) for t in turns[0]] == [(-1, 0.0), (0, 3.0), (0, 3.0), (1, MAX_THINK_S)]
    fleet = Fleet(kimi_linear_48b, 2, "prefix-affinity", deployment=ONE_H200, capacity_tokens=None)
    res = run_closed_loop(fleet, turns, concurrency=2, duration_s=300.0, seed=0)
    assert res.finished == res.requests > len(rows)  # sessions recycled within the window
    done = {f.request_id: f for e in fleet.instances for f in e.finished}
    for e in fleet.instances:
        for f in e.finished:
            assert f.first_token_s >= f.arrival_s
    assert max(f.arrival_s for f in done.values()) < 300.0
    with pytest.raises(ValueError, match="concurrency"):
        run_closed_loop(fleet, turns, concurrency=0, duration_s=10.0)
