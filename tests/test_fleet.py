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


# ----- time between tokens and the steady-state window (issue 34) ---------------------------------

from fuzzing import examples  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402


class _Hand:
    """A hand-built result: requests' columns and a gap log, what window/meets read."""

    def __init__(self, arrival_s, ttft_s, tpot_s, output_tokens, gaps):
        from kimilab.engine.gaps import GapLog

        n = len(arrival_s)
        self.arrival_s, self.ttft_s = np.asarray(arrival_s, float), np.asarray(ttft_s, float)
        self.tpot_s, self.e2e_s = np.asarray(tpot_s, float), np.zeros(n)
        self.output_tokens = np.asarray(output_tokens, int)
        self.finished = self.requests = n
        self.aborted, self.busy_s = False, np.zeros((1, 1))
        self.n_instances = self.n_deployed = self.devices = 1
        self.tbt = GapLog(10.0)
        for t, gap, count in gaps:  # (token time, gap, how many)
            self.tbt.add(t, gap, count)


def test_one_long_gap_fails_tbt_p99_when_it_is_over_one_percent_of_gaps():
    """Mean TPOT 45 ms passes any 100 ms mean bound, yet one 300 ms gap among 51 (2%) puts the TBT p99
    over 100 ms; among 201 gaps (0.5%) it does not. The histogram agrees with numpy on the raw gaps."""
    from kimilab.fleet.goodput import MOONCAKE_SLO, MOONCAKE_SLO_200, SLO, meets, window

    mean_bound = SLO("mean", 30.0, 99, 0.100, 99, "test")
    for n_fast, fails in ((50, True), (200, False)):
        gaps = np.r_[np.full(n_fast, 0.040), 0.300]
        res = _Hand([0.0], [1.0], [gaps.mean()], [n_fast + 2], [(5.0, 0.040, n_fast), (5.0, 0.300, 1)])
        assert gaps.mean() < 0.1 and meets(res, mean_bound)
        got = window(res, MOONCAKE_SLO)
        assert got["tbt_gaps"] == n_fast + 1
        assert got["tbt_s"] == pytest.approx(np.percentile(gaps, 99), rel=0.005)
        assert meets(res, MOONCAKE_SLO) is not fails
        assert meets(res, MOONCAKE_SLO_200) is not (np.percentile(gaps, 99) > 0.2)
    assert MOONCAKE_SLO.tbt_s == 0.100 and MOONCAKE_SLO.tpot_s is None and MOONCAKE_SLO.ttft_s == 30.0
    assert MOONCAKE_SLO_200.tbt_s == 0.200 and "per token" in MOONCAKE_SLO.source
    assert "TBT p99 <= 100 ms" in MOONCAKE_SLO.describe()


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4000), sigma=st.floats(0.05, 3.0),
       median=st.floats(1e-4, 10.0))
def test_the_gap_histogram_reads_percentiles_within_half_a_percent(seed, n, sigma, median):
    from kimilab.engine.gaps import GapHistogram

    rng = np.random.default_rng(seed)
    gaps = np.clip(rng.lognormal(np.log(median), sigma, n), 2e-6, 900.0)
    h = GapHistogram.of(gaps)
    assert h.count == n
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert h.percentile(q) == pytest.approx(np.percentile(gaps, q), rel=0.005)
    assert h.mean() == pytest.approx(gaps.mean(), rel=0.005)
    half = n // 2
    np.testing.assert_array_equal((GapHistogram.of(gaps[:half]) + GapHistogram.of(gaps[half:])).counts, h.counts)


def test_gap_memory_does_not_grow_with_tokens():
    """The histogram is a fixed array; the log holds one entry per (time bucket, distinct step time):
    a hundred times the decoders per step (tokens) costs not one byte more."""
    from kimilab.engine.gaps import N_BINS, GapHistogram, GapLog

    rng = np.random.default_rng(0)
    dts = rng.choice(rng.uniform(0.01, 0.3, 40), 20_000)  # 40 distinct step times
    logs = {}
    for n in (2, 200):
        log, t = GapLog(10.0), 0.0
        for dt in dts:
            log.add_run(t, dt, 3, n)
            t += 3 * dt
        logs[n] = log
    assert logs[200].histogram().count == 100 * logs[2].histogram().count == 200 * 3 * len(dts)
    assert logs[200].nbytes == logs[2].nbytes <= (t // 10 + 1) * 40 * 20 + 4000
    h = GapHistogram.of(np.full(10**6, 0.05))
    assert h.nbytes == GapHistogram().nbytes == 8 * N_BINS


def test_the_steady_window_drops_the_warm_up_and_the_drain():
    """Requests arriving in the last cooldown_frac of the span (the backlog that drains at the end) and
    the gaps of that time are not judged; a warm-up is a fraction or seconds, whichever is later."""
    import math

    from kimilab.fleet.goodput import MOONCAKE_SLO, SLO, meets, steady_window, window

    arrivals = np.arange(100.0)
    assert steady_window(arrivals, SLO("plain", 30.0, 99, None, 99, "t")) == (-math.inf, math.inf)
    assert steady_window(arrivals, MOONCAKE_SLO) == pytest.approx((9.9, math.inf))  # warm-up, no cool-down
    steady = SLO("s", 30.0, 99, None, 99, "test", tbt_s=0.1, warmup_frac=0.1, cooldown_frac=0.2)
    assert steady_window(arrivals, steady) == pytest.approx((9.9, 79.2))
    assert steady_window(arrivals, SLO("w", 30.0, 99, None, 99, "t", warmup_s=30.0, warmup_frac=0.1))[0] == 30.0
    ttft = np.where(arrivals >= 90, 40.0, 1.0)  # the drain: the last tenth waits
    gaps = [(t + 5.0, 0.04, 100) for t in range(0, 80, 10)] + [(85.0, 0.5, 100), (95.0, 0.5, 100)]
    res = _Hand(arrivals, ttft, np.full(100, 0.04), np.full(100, 10), gaps)
    assert not meets(res, MOONCAKE_SLO)
    assert meets(res, steady)
    got = window(res, steady)
    assert got["requests"] == 70 and got["tbt_gaps"] == 700 and got["ttft_s"] == 1.0
    cool_only = SLO("c", 30.0, 99, None, 99, "t", tbt_s=0.1, cooldown_frac=0.05)  # the 90 s bucket stays in
    assert not meets(res, cool_only) and window(res, cool_only)["ttft_s"] == 40.0
    for bad in (dict(cooldown_frac=1.0), dict(warmup_frac=-0.1), dict(warmup_frac=0.5, cooldown_frac=0.5),
                dict(tbt_s=0.0), dict(tbt_q=0)):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            SLO("bad", 30.0, 99, None, 99, "t", **bad)
    with pytest.raises(ValueError, match="ttft_q"):
        SLO("bad", 30.0, 101, None, 99, "t")


def test_a_growing_queue_fails_the_steady_state_even_inside_the_percentiles():
    """An overloaded replay shorter than the time its queue takes to breach the TTFT limit passes the
    percentiles; the TTFT growth bound (30 s per hour of arrivals) fails it, and passes a steady queue
    whose TTFT only scatters. Growth is the last third's median less the first third's, over the time
    between them; too few requests are not judged."""
    from kimilab.fleet.goodput import MOONCAKE_SLO, SLO, meets, slo_ratio, ttft_growth, window

    rng = np.random.default_rng(0)
    arrivals = np.linspace(0.0, 300.0, 600)
    steady = 1.0 + rng.exponential(0.5, 600)  # no backlog: TTFT scatters around 1.5 s
    growing = 1.0 + 0.05 * arrivals  # 5% overload: 15 s of queue after 300 s, inside the 30 s limit
    for ttft, ok in ((steady, True), (growing, False)):
        res = _Hand(arrivals, ttft, np.full(600, 0.04), np.full(600, 2), [(t, 0.04, 1) for t in range(0, 300, 10)])
        no_growth = SLO("p", 30.0, 99, None, 99, "t", tbt_s=0.1, warmup_frac=0.1)
        assert meets(res, no_growth)  # the percentiles alone pass both
        assert meets(res, MOONCAKE_SLO) is ok
        g = window(res, MOONCAKE_SLO)["ttft_growth"]
        assert (abs(g) < MOONCAKE_SLO.max_ttft_growth) if ok else g == pytest.approx(0.05, rel=1e-9)
        assert (slo_ratio(res, MOONCAKE_SLO) <= 1.0) is ok
    assert ttft_growth(np.arange(59.0), np.arange(59.0)) is None  # 19 a third: not judged
    assert ttft_growth(np.arange(60.0), 2 * np.arange(60.0)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="arrival_s and ttft_s"):
        ttft_growth(np.arange(3.0), np.arange(4.0))
    with pytest.raises(ValueError, match="max_ttft_growth"):
        SLO("bad", 30.0, 99, None, 99, "t", max_ttft_growth=-1.0)


def test_the_guard_judges_the_window_and_tbt_only_when_certain():
    """A windowed SLO with a TBT bound: the guarded run passes exactly when the full one does, and
    stops only runs that fail; a TBT bound alone can stop a run (once its closed buckets hold enough
    slow gaps). A windowed SLO needs the replay's rate scale."""
    from kimilab.config import kimi_linear_48b
    from kimilab.fleet import run_fleet
    from kimilab.fleet.goodput import SLO, SloGuard, meets

    reqs = _chain_trace(80, gap_ms=5)
    steady = SLO("t", 0.4, 90, None, 90, "test", tbt_s=0.05, tbt_q=90, warmup_frac=0.1, cooldown_frac=0.2)
    with pytest.raises(ValueError, match="rate_scale"):
        SloGuard(steady, reqs)
    tbt_only = SLO("tbt", 1e6, 99, None, 99, "test", tbt_s=1e-4)  # every gap misses
    stopped = 0
    for slo in (steady, tbt_only):
        for scale in (0.05, 0.3, 1.0, 8.0):
            kw = dict(deployment=ONE_H200, instances=2, router="least-work", capacity_tokens=None,
                      rate_scale=scale, bucket_s=0.02)
            full = run_fleet(reqs, kimi_linear_48b, **kw)
            guarded = run_fleet(reqs, kimi_linear_48b, guard=SloGuard(slo, reqs, rate_scale=scale), **kw)
            assert meets(guarded, slo) == meets(full, slo)
            assert not guarded.aborted or not meets(full, slo)
            stopped += guarded.aborted and slo is tbt_only
    assert stopped >= 1


def test_replay_convergence_rows():
    from kimilab.config import kimi_linear_48b
    from kimilab.fleet import run_fleet
    from kimilab.fleet.goodput import MOONCAKE_SLO, replay_convergence, slo_ratio

    rows = replay_convergence(lambda n: 5.0 + 10.0 / n, [10, 100, 1000, 10_000], MOONCAKE_SLO)
    assert [r["n"] for r in rows] == [10, 100, 1000, 10_000]
    assert [r["settled"] for r in rows] == [False, True, True, True]
    assert rows[0]["change"] is None and rows[1]["change"] == pytest.approx(5.1 / 6.0 - 1)
    reqs = _chain_trace(60, gap_ms=20)

    def run(n):
        return run_fleet(reqs[:n], kimi_linear_48b, deployment=ONE_H200, instances=1, router="least-work",
                         capacity_tokens=None)

    rows = replay_convergence(run, [20, 60], MOONCAKE_SLO, rel_tol=10.0)
    assert all("meets" in r and r["settled"] for r in rows)
    assert rows[-1]["value"] == pytest.approx(slo_ratio(run(60), MOONCAKE_SLO))
    for bad in ([], [10, 10], [0, 5]):
        with pytest.raises(ValueError, match="lengths"):
            replay_convergence(run, bad, MOONCAKE_SLO)
