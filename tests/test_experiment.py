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
    strip = {"prefill_seconds": 0, "decode_seconds": 0}
    assert out_a == out_b and a.as_dict() | strip == b.as_dict() | strip
    with pytest.raises(ValueError, match="config"):
        second_request(model, "prefix:magic", work)
