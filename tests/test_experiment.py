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


# ----- Part B: goodput and dollars at the SLO, per variant, on real chat and agent traffic -----

from kimilab.experiment import BASELINE, VARIANT_NAMES, cost_per_m_output, run_part_b  # noqa: E402
from kimilab.experiment.tables import part_b_table  # noqa: E402

SMALL = dict(n_requests=300, instances=1, agent_instances=1, agent_duration_s=240.0, seeds=1, rel_tol=0.3,
             price_per_hour=3.0, start_scale=1.0, workers=1, confirm=1)  # seeds: the old name of orders
SOME = (BASELINE, "none + prefix-affinity", "ends + least-work", "kv-only + prefix-affinity", "all-MLA fp8 TP4")


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
    return out, run_part_b(out, variants=SOME, **SMALL)


def test_part_b_rows_are_goodput_with_ratios_to_the_baseline(part_b):
    _, result = part_b
    assert result["baseline"] == BASELINE and len(VARIANT_NAMES) == 16
    rows = {(r["workload"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {(w, v) for w in ("conversation", "agents") for v in SOME}
    for w in ("conversation", "agents"):
        base = rows[w, BASELINE]
        assert base["goodput"] > 0 and base["goodput_ratio"] == 1.0
        for v in SOME:
            r = rows[w, v]
            assert r["goodput_ratio"] == pytest.approx(r["goodput"] / base["goodput"], abs=1e-6)
            if r.get("usd_per_m_output"):
                assert r["cost_ratio"] == pytest.approx(r["usd_per_m_output"] / base["usd_per_m_output"], abs=1e-6)
                assert 0 < r["busy_fraction"] <= 1
        assert rows[w, "none + prefix-affinity"]["goodput"] <= base["goodput"]
    # one tensor-parallel instance: a router cannot differ, so its row is a copy of the policy's first
    assert rows["conversation", "ends + least-work"]["same_as"] == BASELINE or \
        rows["conversation", BASELINE].get("same_as") == "ends + least-work"
    c = rows["conversation", BASELINE]
    assert c["requests_per_s"] == pytest.approx(c["goodput"] * c["instances"], rel=1e-5)
    assert c["ttft_limit_pct_s"] <= 30.0 and c["tpot_limit_pct_s"] <= 0.2  # it met the SLO at its goodput
    assert cost_per_m_output(3600.0, 2.0, 1_000_000) == pytest.approx(2.0)


def test_part_b_files_and_rerun_agree_except_wall_clock(part_b, tmp_path):
    out, result = part_b
    saved = json.loads((out / "part_b.json").read_text())
    assert saved["kimilab"] and saved["config"]["accelerator"] and saved["config"]["conversation"]["slo_source"]
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    table = (out / "part_b.md").read_text()
    assert table.startswith("| variant |") and "x baseline" in table and "per accelerator-hour" in table
    assert table == part_b_table(result) + "\n"
    again = run_part_b(tmp_path, variants=SOME[:2], **SMALL)
    keep = {(r["workload"], r["variant"]) for r in again["rows"]}
    first = [r for r in result["rows"] if (r["workload"], r["variant"]) in keep]
    assert _strip_wall(again["rows"]) == _strip_wall(first)


def test_part_b_tunes_each_variant_then_measures_it_at_its_best():
    """With ``tune``, each variant's chat row is measured at the grid point where order 0 did best (the
    smaller budget on a tie), the grid is in the row, and the table names the setting; the deployment's
    own setting is recorded without it; an unknown scheduler field or a bad grid is named."""
    from kimilab.experiment.scale import conversation_goodput, tune_variant
    from kimilab.experiment.tables import part_b_cells, part_b_notes
    from kimilab.experiment.variants import variant

    grid = ((2048, 8192), (64, 1024))
    small = dict(SMALL, workloads=("conversation",))
    said = []
    got = run_part_b(variants=(BASELINE, "all-MLA fp8 TP4"), tune={"conversation": grid}, progress=said.append,
                     **small)
    assert len(said) == 2 and said[-1].startswith("[2/2] conversation: ") and "left)" in said[-1]
    for row in got["rows"]:
        pts = row["tuning"]
        assert [(p["max_batched_tokens"], p["max_num_seqs"]) for p in pts] == [(b, s) for b in grid[0] for s in grid[1]]
        best = max(p["value"] for p in pts)
        first = next(p for p in pts if p["value"] == best)
        assert row["scheduler"] == {"max_batched_tokens": first["max_batched_tokens"],
                                    "max_num_seqs": first["max_num_seqs"]}
        assert row["orders"][0]["goodput"] == pytest.approx(best, abs=1e-6)  # order 0 again, same number
    cells = part_b_cells(got)
    assert all(c[1].endswith(("/64", "/1024")) for c in cells)
    assert any("tuned per variant" in n for n in part_b_notes(got))
    plain = conversation_goodput(variant(BASELINE), n_requests=60, instances=1, orders=1, rel_tol=0.3, start=1.0)
    assert plain["scheduler"] == {"max_batched_tokens": 8192, "max_num_seqs": 1024} and "tuning" not in plain
    with pytest.raises(ValueError, match="scheduler"):
        conversation_goodput(variant(BASELINE), n_requests=60, orders=1, scheduler={"chunk": 2048})
    with pytest.raises(ValueError, match="max_num_seqs"):
        conversation_goodput(variant(BASELINE), n_requests=60, orders=1, scheduler={"max_num_seqs": 0})
    with pytest.raises(ValueError, match="tune"):
        run_part_b(variants=(BASELINE,), tune={"agents": grid}, **small)
    with pytest.raises(ValueError, match="budgets"):
        tune_variant(BASELINE, "conversation", dict(n_requests=60), budgets=())


def test_part_b_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="variants"):
        run_part_b(variants=(BASELINE, "prefix:magic"), **SMALL)
    with pytest.raises(ValueError, match="baseline"):
        run_part_b(variants=("none + prefix-affinity",), **SMALL)
    with pytest.raises(ValueError, match="instances"):
        run_part_b(**dict(SMALL, instances=0))
    with pytest.raises(ValueError, match="price_per_hour"):
        run_part_b(**dict(SMALL, price_per_hour=-1.0))
    with pytest.raises(ValueError, match="deployment"):
        run_part_b(deployment="tp3-h100", **SMALL)
    with pytest.raises(ValueError, match="workloads"):
        run_part_b(workloads=("chat",), **SMALL)


def test_experiment_cli_part_b(tmp_path, capsys):
    from kimilab.__main__ import main

    argv = ["experiment", "--part", "b", "--scale", "full", "--requests", "120", "--instances", "1",
            "--agent-instances", "1", "--agent-minutes", "3", "--seeds", "1", "--workers", "1",
            "--out", str(tmp_path)]
    from unittest import mock

    import kimilab.experiment.scale as scale

    few = (BASELINE, "all-MLA fp8 TP4")
    with mock.patch.object(scale, "VARIANT_NAMES", few):
        main(argv)
    assert (tmp_path / "part_b.json").is_file() and not (tmp_path / "part_a.json").exists()
    assert "| variant |" in capsys.readouterr().out
    for bad in (["--part", "c"], ["--instances", "0"], ["--price", "-2"], ["--requests", "x"], ["--seeds", "0"],
                ["--scale", "huge"], ["--host-ratio", "-1"], ["--store-ratio", "-1"],
                ["--host-ratio", "1", "--store-ratio", "2"], ["--overlap-loads"]):
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


# ----- tuning the baseline's step budget and batch cap (issue 34) ---------------------------------

def test_tune_finds_the_best_setting_on_a_synthetic_measure():
    import math

    from kimilab.costs import VLLM_TP4_H200
    from kimilab.experiment.tuning import BUDGETS, SEQS, tune

    seen = []

    def measure(changes):  # peaks at 4096 tokens, 256 sequences; builds the deployment as a caller would
        dep = VLLM_TP4_H200.with_(**changes)
        seen.append((dep.max_batched_tokens, dep.max_num_seqs))
        return -abs(math.log2(dep.max_batched_tokens / 4096)) - 0.1 * abs(math.log2(dep.max_num_seqs / 256))

    best = tune(measure)
    assert best.changes == {"max_batched_tokens": 4096, "max_num_seqs": 256} and best.value == 0.0
    assert len(best.rows) == len(BUDGETS) * len(SEQS) == len(seen)
    assert seen == [(b, s) for b in BUDGETS for s in SEQS]  # budgets, then seqs, in the order given
    assert best.table()[0] == [2048, 256, best.rows[0]["value"]]
    assert tune(measure) == best  # deterministic
    flat = tune(lambda c: 1.0, budgets=(8192, 2048), seqs=(512, 64))
    assert flat.changes == {"max_batched_tokens": 2048, "max_num_seqs": 64}  # a tie: the cheaper setting
    nan = tune(lambda c: math.nan if c["max_batched_tokens"] == 2048 else 1.0, budgets=(2048, 4096), seqs=(8,))
    assert nan.changes["max_batched_tokens"] == 4096
    for bad, name in ((dict(budgets=()), "budgets"), (dict(budgets=(0,)), "budgets"), (dict(seqs=(8, 8)), "seqs"),
                      (dict(seqs=(1.5,)), "seqs")):
        with pytest.raises(ValueError, match=name):
            tune(measure, **bad)
    with pytest.raises(ValueError, match="measure"):
        tune(lambda c: "fast", budgets=(2048,), seqs=(8,))
    with pytest.raises(ValueError, match="measure"):
        tune(None)


def test_the_experiments_sizes_are_the_chapters():
    """``make experiment``'s default Part B is the run chapter 11 stores (so its numbers are the book's);
    options change one size of a scale; an unknown scale names itself."""
    from kimilab.experiment.results import part_b_arguments

    book = part_b_arguments("book")
    assert (book["instances"], book["n_requests"], book["agent_duration_s"], book["orders"]) == (1, 2400, 240.0, 5)
    assert len(book["variants"]) == 5 and book["tune"] is not None
    assert part_b_arguments("full", instances=2)["instances"] == 2 and part_b_arguments("full")["variants"] is None
    with pytest.raises(ValueError, match="scale"):
        part_b_arguments("huge")


def test_part_b_tiers_are_sized_from_the_pools_and_checked():
    """``host_ratio`` sizes each instance's own tier from its HBM pool; ``store_ratio`` one shared store
    from all the instances' pools; both at once, or a negative ratio, is refused by name. A chat goodput
    with a shared store runs and counts its hits."""
    from kimilab import costs
    from kimilab.config import kimi_linear_48b
    from kimilab.experiment.scale import conversation_goodput
    from kimilab.experiment.tiers import tier_keywords, tier_note
    from kimilab.experiment.variants import BASELINE, variant

    dep = costs.DEFAULT_DEPLOYMENT
    pool = 1000 * costs.kv_bytes_per_token(kimi_linear_48b, dep)
    assert tier_keywords(kimi_linear_48b, dep, 1000, 4) == {} and tier_note(None, None) == {}
    assert tier_keywords(kimi_linear_48b, dep, 1000, 4, host_ratio=2) == {"host_bytes": 2 * pool}
    assert tier_keywords(kimi_linear_48b, dep, 1000, 4, store_ratio=2) == {"store_bytes": 8 * pool}
    assert "shared" in tier_note(None, 2.0)["shared_store"]
    with pytest.raises(ValueError, match="host_ratio, store_ratio"):
        tier_keywords(kimi_linear_48b, dep, 1000, 4, host_ratio=1, store_ratio=1)
    with pytest.raises(ValueError, match="store_ratio"):
        tier_keywords(kimi_linear_48b, dep, 1000, 4, store_ratio=-1)
    with pytest.raises(ValueError, match="overlap_loads"):
        tier_keywords(kimi_linear_48b, dep, 1000, 4, overlap_loads=True)
    assert tier_keywords(kimi_linear_48b, dep, 1000, 4, host_ratio=1, overlap_loads=True) == {
        "overlap_loads": True, "host_bytes": pool}
    assert "layer by layer" in tier_note(1.0, None, True)["host_tier"]
    row = conversation_goodput(variant(BASELINE), n_requests=120, instances=2, orders=1, store_ratio=2.0)
    assert row["goodput"] > 0 and row["usable_hit_rate"] > 0
