"""A capacity search that can rank: scan then confirm, measured over orders, ties, the capacity command."""

import gzip
import json
from unittest import mock

import pytest

from kimilab.__main__ import main
from kimilab.experiment import BASELINE, Spread, arrival_order, compare
from kimilab.experiment.scale import _ratios
from kimilab.fleet.goodput import AGENT_SLO, rate_grid, scan_capacity, session_grid

JUDGE = dict(judge=lambda ok, slo: ok)  # the fake runs below return pass/fail itself


def _scan(profile, grid, **kw):
    return scan_capacity(lambda n: profile(n), AGENT_SLO, grid, **JUDGE, **kw)


def test_scan_finds_the_edge_of_a_monotone_load_exactly():
    s = _scan(lambda n: n <= 37, session_grid(16, 0.0, limit=200), start=16)
    assert s.capacity == 37 and s.monotone and s.lowest_fail == 38 and not s.at_ceiling
    assert [n for n, ok in s.tried if not ok][-2:] == [38, 39]  # confirmed: two loads above it fail
    assert s.tried[:3] == ((16, True), (32, True), (64, False))  # bracketed by doubling


def test_scan_steps_over_a_short_failure_and_reports_it():
    """16 fails, 20 passes (what one shuffle of the agent sessions gives): a bisection from 16 answers 15;
    the scan goes on to the edge and names 16 as non-monotone."""
    s = _scan(lambda n: n <= 20 and n != 16, session_grid(16, 0.1), start=16)
    assert s.capacity == 19 and s.non_monotone == (16,) and not s.monotone and s.lowest_fail == 16
    assert {21, 23} <= {n for n, ok in s.tried if not ok}


def test_scan_stops_at_confirm_failures_in_a_row():
    profile = lambda n: n <= 14 or 20 <= n <= 24  # noqa: E731 - a hole two grid loads wide
    assert _scan(profile, session_grid(16, 0.0, limit=64), start=8, confirm=2).capacity == 14
    deep = _scan(profile, session_grid(16, 0.0, limit=64), start=8, confirm=6)
    assert deep.capacity == 24 and deep.non_monotone == (15, 16, 17, 18, 19)


def test_scan_edges_nothing_passes_everything_passes_and_rates():
    none = _scan(lambda n: False, session_grid(16, 0.1), start=16)
    assert none.capacity == 0 and none.result is None and none.lowest_fail == 1
    top = _scan(lambda n: True, session_grid(16, 0.1, limit=100), start=16)
    assert top.capacity == 98 and top.at_ceiling
    rate = _scan(lambda x: x <= 13.7, rate_grid(1.0, 0.05), start=1.0)
    assert 13.7 / 1.05 <= rate.capacity <= 13.7 and len(rate.tried) < 20
    assert rate_grid(2.0, 1.0, floor=0.5, ceiling=16.0) == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert session_grid(10, 0.5, limit=30) == [1, 2, 3, 4, 7, 10, 15, 23]
    for bad, call in (("confirm", lambda: _scan(bool, [1, 2], confirm=0)), ("grid", lambda: _scan(bool, [])),
                      ("step", lambda: rate_grid(1.0, -0.1)), ("limit", lambda: session_grid(16, 0.1, limit=8))):
        with pytest.raises(ValueError, match=bad):
            call()


def test_spread_and_compare_call_a_gap_within_the_spread_a_tie():
    a, b = Spread.of([10, 12, 14]), Spread.of([13, 13.5, 14])
    assert (a.mean, a.min, a.max, a.spread) == (12.0, 10.0, 14.0, 2.0)
    assert compare(a, b) == "tie"  # gap 1.5 <= the larger spread, 2
    assert compare(Spread.of([10, 11]), Spread.of([13, 14])) == "lower"  # gap 3 > 0.5
    assert compare(Spread.of([20]), Spread.of([10])) == "higher" and compare(Spread.of([5]), Spread.of([5])) == "tie"
    row = {"goodput": 12.0, "goodput_min": 10.0, "goodput_max": 14.0}
    assert compare(row, {"goodput": 16.0, "goodput_min": 16.0, "goodput_max": 16.0}) == "lower"  # 4 > 2
    assert compare(row, {"goodput": 14.0, "goodput_min": 14.0, "goodput_max": 14.0}) == "tie"  # 2 <= 2
    with pytest.raises(ValueError, match="values"):
        Spread.of([])


def test_arrival_orders_keep_the_requests_their_sequence_and_span():
    from kimilab.experiment.scale import TRACE_PATH, _trace

    reqs = list(_trace(str(TRACE_PATH), 200))
    assert arrival_order(reqs, 0) == reqs
    one, two = arrival_order(reqs, 1), arrival_order(reqs, 2)
    for o in (one, two):
        t = [r.arrival_ms for r in o]
        assert t == sorted(t) and t[0] == reqs[0].arrival_ms and t[-1] == reqs[-1].arrival_ms
        assert [r.request_id for r in o] == [r.request_id for r in reqs]
    assert one != two and one == arrival_order(reqs, 1)  # distinct, and deterministic
    with pytest.raises(ValueError, match="order"):
        arrival_order(reqs, -1)


def _row(variant, goodputs, base=None):
    """A fake agent row with per-order goodputs, and its ratios to ``base`` (itself if None)."""
    s = Spread.of(goodputs)
    row = {"workload": "agents", "variant": variant, "family": "hybrid", "goodput": s.mean, "goodput_min": s.min,
           "goodput_max": s.max, "orders": [{"goodput": g} for g in goodputs], "non_monotone_orders": 0}
    _ratios(row, row if base is None else base)
    return row


def test_two_halves_agree_within_the_spread_and_name_a_conflict():
    from kimilab.experiment import capacity

    other = "all-MLA bf16 TP4"

    def fake(profiles):  # variant_rows as if each half's orders gave these goodputs
        def rows(variants, kw, workers=None):
            prof = profiles[kw["agents"]["part"][0]]
            base = _row(BASELINE, prof[BASELINE])
            return [base, _row(other, prof[other], base)]
        return rows

    agree = {0: {BASELINE: [20, 22, 24], other: [10, 11, 12]}, 1: {BASELINE: [30, 32, 34], other: [15, 16, 18]}}
    with mock.patch.object(capacity, "variant_rows", fake(agree)):
        out = capacity.two_halves(variants=(other,), orders=3)
    assert out["agree"] and out["ordering"]["even"] == [BASELINE, other] and not out["conflicts"]
    v = {e["variant"]: e for e in out["variants"]}[other]
    assert v["ratios_agree"] and v["vs_baseline"] == ["lower", "lower"]  # 0.50 and 0.51 (spread 0.015)
    flip = {0: agree[0], 1: {BASELINE: [10, 10, 10], other: [30, 31, 32]}}
    with mock.patch.object(capacity, "variant_rows", fake(flip)):
        out = capacity.two_halves(variants=(other,), orders=3)
    assert not out["agree"] and out["conflicts"] == [[BASELINE, other]] and not out["ratios_agree"]


def _sessions_slice(tmp_path, n=20):
    """The shipped sessions' first ``n`` as plain jsonl (the command reads .jsonl and .jsonl.gz)."""
    from kimilab.experiment.scale import SESSIONS_PATH

    with gzip.open(SESSIONS_PATH, "rt", encoding="utf-8") as f:
        keep = [line for line in f if json.loads(line)["session"] < n]
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(keep), encoding="utf-8")
    return path


def test_capacity_command_prints_the_variant_table_as_json(tmp_path, capsys, data_dir):
    """A tiny slice: 20 sessions in 150 s windows, two orders, one instance; then 40 chat requests."""
    path = _sessions_slice(tmp_path)
    other = "none + prefix-affinity"
    assert main(["capacity", "--sessions", str(path), "--variants", other, "--orders", "2",
                 "--duration-s", "150", "--step", "0.5", "--workers", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["baseline"] == BASELINE and out["orders"] == 2 and out["workloads"]["agents"]["sessions"] == 20
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == [BASELINE, other] and {r["workload"] for r in out["rows"]} == {"agents"}
    base, none = rows[BASELINE], rows[other]
    for r in (base, none):
        assert len(r["goodput_orders"]) == 2 and r["goodput_min"] <= r["goodput"] <= r["goodput_max"]
        assert r["goodput_spread"] == pytest.approx((r["goodput_max"] - r["goodput_min"]) / 2, abs=1e-6)
        assert r["unit"] == "concurrent sessions per instance" and "non_monotone_orders" in r
    assert base["goodput"] > 0 and base["usd_per_m_output"] > 0 and base["vs_baseline"] == "baseline"
    assert none["goodput"] < base["goodput"] and none["vs_baseline"] == "lower"  # no reuse: far fewer sessions
    assert none["goodput_ratio"] == pytest.approx(none["goodput"] / base["goodput"], abs=1e-6)
    assert main(["capacity", "--trace", str(data_dir / "mooncake_conversation.jsonl"), "--requests", "40",
                 "--orders", "1", "--variants", "all-MLA bf16 TP4", "--step", "1", "--workers", "1", "--band"]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert chat["workloads"]["conversation"]["requests"] == 40 and "corners" not in chat and "band" in chat
    for r in chat["rows"]:  # the kernel band's corners bracket the central goodput, with a label
        assert r["unit"] == "requests/s per instance" and r["goodput"] > 0
        assert r["goodput_band"][0] <= r["goodput"] <= r["goodput_band"][1]
        assert r["goodput_ratio_band"][0] <= r["goodput_ratio"] <= r["goodput_ratio_band"][1]
        assert r["band_label"] == "holds across the band" or r["band_label"].startswith("flips at ")


def test_capacity_tune_measures_each_variant_at_its_best_setting(capsys, data_dir):
    from kimilab.experiment.tuning import BUDGETS, SEQS

    assert main(["capacity", "--trace", str(data_dir / "mooncake_conversation.jsonl"), "--requests", "40",
                 "--orders", "1", "--variants", "all-MLA fp8 TP4", "--step", "1", "--workers", "1", "--tune"]) == 0
    for r in json.loads(capsys.readouterr().out)["rows"]:
        assert [(p["max_batched_tokens"], p["max_num_seqs"]) for p in r["tuning"]] == \
            [(b, s) for b in BUDGETS for s in SEQS]
        best = max(p["value"] for p in r["tuning"])
        assert r["goodput"] == pytest.approx(best, abs=1e-6)  # order 0 on one instance: the tuning's own run
        assert r["scheduler"] == next({k: p[k] for k in ("max_batched_tokens", "max_num_seqs")}
                                      for p in r["tuning"] if p["value"] == best)


@pytest.mark.parametrize("argv, names", [
    (["--sessions", "nope.jsonl.gz"], "--sessions=nope.jsonl.gz: no such file"),
    (["--trace", "nope.jsonl"], "--trace=nope.jsonl: no such file"),
    (["--sessions", "{data}/mooncake_conversation.jsonl"], "--sessions: "),  # a chat trace is not sessions
    (["--trace", "{data}/claude_code_sessions.jsonl.gz"], "a gzip file"),  # nor the reverse
    (["--sessions", "{data}/claude_code_sessions.jsonl.gz", "--orders", "-1"], "--orders"),
    (["--sessions", "{data}/claude_code_sessions.jsonl.gz", "--instances", "0"], "--instances"),
    (["--sessions", "{data}/claude_code_sessions.jsonl.gz", "--duration-s", "60"], "--duration-s=60"),
    (["--sessions", "{data}/claude_code_sessions.jsonl.gz", "--variants", "magic"], "--variants"),
    ([], "--sessions PATH and/or --trace PATH"),
])
def test_capacity_bad_input_is_one_line_naming_the_argument(argv, names, capsys, data_dir):
    with pytest.raises(SystemExit) as exc:
        main(["capacity", *(a.format(data=data_dir) for a in argv)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and names in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_sessions_file_with_a_missing_field_is_named_by_its_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": 0, "agent": 0, "t_ms": 0, "api_ms": 5, "input_length": 10, "output_length": 2, '
                   '"hash_ids": [1]}\n{"session": 0, "agent": 0}\n')
    with pytest.raises(SystemExit) as exc:
        main(["capacity", "--sessions", str(bad)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{bad}: line 2: field 't_ms' missing" in err and err.count("\n") == 1


def test_capacity_help_states_the_defaults_and_experiment_takes_orders(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["capacity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0 and "--sessions PATH" in text and "(default: 5)" in text and "(default: 0.1)" in text
    with pytest.raises(SystemExit) as exc:
        main(["experiment", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--orders ORDERS, --seeds ORDERS" in text and "mean, min and max (both scales: 5)" in text
    assert "--scale {book,full}" in text and "(default: book)" in text
