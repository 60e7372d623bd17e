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
