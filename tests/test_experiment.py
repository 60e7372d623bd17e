"""The book's experiment, Part A: every component keeps the baseline's tokens, and the numbers hold."""

import json

import pytest

from kimilab.config import tiny
from kimilab.experiment import CONFIGS, second_request, sessions
from kimilab.experiment.results import part_a_table, run_part_a
from kimilab.model import Model


@pytest.fixture(scope="module")
def part_a(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    return out, run_part_a(out, n_sessions=1, n_out=6)


def test_every_component_gives_the_baselines_tokens(part_a):
    _, result = part_a
    assert {(r["workload"], r["config"]) for r in result["rows"]} == {(w, c) for w in ("agent", "chat") for c in CONFIGS}
    assert all(r["same_tokens"] for r in result["rows"])


def test_what_each_component_saves_on_the_second_request(part_a):
    _, result = part_a
    rows = {(r["workload"], r["config"]): r for r in result["rows"]}
    for w in ("agent", "chat"):
        base = rows[w, "baseline"]
        assert base["prefill_tokens"] == base["prompt_tokens"]
        for c in ("unified-pool", "prefix:no-states"):  # a KV hit without a state saves a hybrid nothing
            assert rows[w, c]["prefill_tokens"] == base["prefill_tokens"]
        for c in ("prefix:every-block", "prefix:dual"):
            assert rows[w, c]["prefill_tokens"] < base["prefill_tokens"] and rows[w, c]["held_bytes"] > 0
            assert rows[w, c]["prefill_flops"] < base["prefill_flops"]
        for c in ("spec:snapshot", "spec:replay", "spec:ring"):
            assert rows[w, c]["decode_passes"] < base["decode_passes"]
        assert rows[w, "spec:replay"]["held_bytes"] < rows[w, "spec:snapshot"]["held_bytes"]


def test_the_files_carry_the_config_and_the_table(part_a):
    out, result = part_a
    saved = json.loads((out / "part_a.json").read_text())
    assert saved["config"]["model"] == "tiny" and saved["kimilab"] and saved["rows"] == json.loads(json.dumps(result["rows"]))
    table = (out / "part_a.md").read_text()
    assert table.startswith("| workload | component |") and table.count("\n") == len(result["rows"]) + 2
    assert "NO" not in part_a_table(result)


def test_reruns_agree_except_wall_clock():
    model = Model(tiny, seed=0)
    work = sessions("chat", 1, 3, tiny.vocab_size)
    a, out_a = second_request(model, "prefix:dual", work, n_out=4)
    b, out_b = second_request(model, "prefix:dual", work, n_out=4)
    strip = {"prefill_wall_s": 0, "decode_wall_s": 0}
    assert out_a == out_b and a.as_dict() | strip == b.as_dict() | strip
    with pytest.raises(ValueError, match="config"):
        second_request(model, "prefix:magic", work)


# ----- Part B: the same ablation at 48B sizes through the fleet simulator on the real trace -----

from kimilab.experiment import VARIANT_NAMES, cost_per_m_output, run_part_b  # noqa: E402
from kimilab.experiment.scale import part_b_table  # noqa: E402
from kimilab.costs import DEFAULT_DEPLOYMENT  # noqa: E402

N_B = 300  # the real trace's first requests: a few seconds for every variant


def _strip_wall(obj):
    """The result without its wall-clock fields (their names end in _wall_s)."""
    if isinstance(obj, dict):
        return {k: _strip_wall(v) for k, v in obj.items() if not k.endswith("_wall_s")}
    if isinstance(obj, list):
        return [_strip_wall(v) for v in obj]
    return obj


@pytest.fixture(scope="module")
def part_b(tmp_path_factory):
    out = tmp_path_factory.mktemp("results_b")
    return out, run_part_b(out, deployment=DEFAULT_DEPLOYMENT, n_requests=N_B, instances=4, price_per_hour=3.0)


def test_part_b_every_request_finishes_and_rates_are_rates(part_b):
    _, result = part_b
    assert [r["variant"] for r in result["rows"]] == list(VARIANT_NAMES)
    for r in result["rows"]:
        assert r["requests"] == r["finished"] == N_B and r["refused"] == 0, r["variant"]
        assert 0.0 <= r["usable_hit_rate"] <= r["kv_hit_rate"] + 1e-9 <= 1.0 + 1e-9
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["tpot_p50_s"] <= r["tpot_p99_s"]
        assert 0 < r["busy_accelerator_seconds"] <= r["accelerator_seconds"]
        hit_tokens = r["usable_hit_rate"] * r["prompt_tokens"]
        assert r["usable_hit_tokens"] == pytest.approx(hit_tokens, abs=r["prompt_tokens"] * 1e-6)
        if r["preemptions"] == 0:  # without recompute, a prompt's tokens are either a usable hit or computed
            assert r["prefill_tokens_computed"] == r["prompt_tokens"] - r["usable_hit_tokens"]


def test_part_b_prefix_caches_never_lose_hits(part_b):
    _, result = part_b
    rows = {r["variant"]: r for r in result["rows"]}
    base = rows["baseline"]
    assert base["usable_hit_rate"] == base["kv_hit_rate"] == 0.0
    assert rows["prefix:no-states"]["usable_hit_rate"] == 0.0 < rows["prefix:no-states"]["kv_hit_rate"]
    for v in ("prefix:every-block", "prefix:dual", "router:state-aware"):
        assert rows[v]["usable_hit_rate"] >= base["usable_hit_rate"]
        assert rows[v]["prefill_tokens_computed"] <= base["prefill_tokens_computed"]
    assert rows["router:state-aware"]["usable_hit_rate"] >= rows["prefix:dual"]["usable_hit_rate"]
    assert result["reuse_upper_bound"] >= max(r["usable_hit_rate"] for r in result["rows"])


def test_part_b_cost_is_accelerator_seconds_times_price(part_b):
    _, result = part_b
    price, c = result["config"]["price_usd_per_accelerator_hour"], result["config"]
    assert price == 3.0 and c["instances"] == 4 and c["requests"] == N_B
    for r in result["rows"]:
        assert r["accelerator_seconds"] == pytest.approx(
            c["instances"] * c["accelerators_per_instance"] * r["makespan_s"], rel=1e-6)
        for accel, cost in (("accelerator_seconds", "cost_per_m_output_usd"),
                            ("busy_accelerator_seconds", "busy_cost_per_m_output_usd")):
            assert r[cost] == pytest.approx(r[accel] / 3600 * price / r["output_tokens"] * 1e6, rel=1e-5)
    assert cost_per_m_output(3600.0, 2.0, 1_000_000) == pytest.approx(2.0)


def test_part_b_files_and_rerun_agree_except_wall_clock(part_b, tmp_path):
    out, result = part_b
    saved = json.loads((out / "part_b.json").read_text())
    assert saved["kimilab"] and saved["config"]["accelerator"]
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    table = (out / "part_b.md").read_text()
    assert table.startswith("| variant |") and "Assumptions:" in table and "per accelerator-hour" in table
    assert table == part_b_table(result) + "\n"
    again = run_part_b(tmp_path, deployment=DEFAULT_DEPLOYMENT, n_requests=N_B, instances=4, price_per_hour=3.0)
    assert _strip_wall(json.loads((tmp_path / "part_b.json").read_text())) == _strip_wall(saved)
    assert _strip_wall(again) == _strip_wall(result)


def test_part_b_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="variants"):
        run_part_b(deployment=DEFAULT_DEPLOYMENT, n_requests=10, variants=("baseline", "prefix:magic"))
    with pytest.raises(ValueError, match="instances"):
        run_part_b(deployment=DEFAULT_DEPLOYMENT, n_requests=10, instances=0)
    with pytest.raises(ValueError, match="price_per_hour"):
        run_part_b(deployment=DEFAULT_DEPLOYMENT, n_requests=10, price_per_hour=-1.0)
    with pytest.raises(FileNotFoundError, match="trace"):
        run_part_b(deployment=DEFAULT_DEPLOYMENT, n_requests=10, trace=tmp_path / "missing.jsonl")


def test_experiment_cli_part_b(tmp_path, capsys):
    from kimilab.__main__ import main

    assert main(["experiment", "--part", "b", "--requests", "60", "--instances", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "part_b.json").is_file() and not (tmp_path / "part_a.json").exists()
    assert "| variant |" in capsys.readouterr().out
    for bad in (["--part", "c"], ["--instances", "0"], ["--price", "-2"], ["--requests", "x"]):
        with pytest.raises(SystemExit) as exc:
            main(["experiment", *bad, "--out", str(tmp_path)])
        assert exc.value.code == 2


def test_part_a_twice_agrees_except_the_wall_clock_fields(part_a, tmp_path):
    """Issue 22: every field not named ``*_wall_s`` is the same in a second run of Part A."""
    _, first = part_a
    second = run_part_a(tmp_path, n_sessions=1, n_out=6)
    walls = {k for r in first["rows"] for k in r if k.endswith("_wall_s")}
    assert walls == {"prefill_wall_s", "decode_wall_s"}
    strip = lambda res: [{k: v for k, v in r.items() if k not in walls} for r in res["rows"]]  # noqa: E731
    assert strip(first) == strip(second)
    assert {k: v for k, v in first.items() if k != "rows"} == {k: v for k, v in second.items() if k != "rows"}
