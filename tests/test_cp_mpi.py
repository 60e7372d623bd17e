"""kimilab.cp under real MPI: ``mpiexec -n 2 python -m kimilab cp`` (separate processes), and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kimilab.cp.launch import ONE_THREAD, mpiexec_path

TIMEOUT = 60


def _mpiexec_or_skip() -> str:
    exe = mpiexec_path()
    if exe is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    try:
        probe = subprocess.run([exe, "-n", "2", sys.executable, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"],
                               capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"mpiexec cannot start two processes here: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"mpiexec cannot start two processes here: {probe.stderr.strip()[-200:]}")
    return exe


def _cp(exe, ranks, *args):
    cmd = [exe, "-n", str(ranks), sys.executable, "-m", "kimilab", "cp", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **ONE_THREAD})


def test_two_processes_equal_one_rank_in_float64():
    exe = _mpiexec_or_skip()
    done = _cp(exe, 2, "--tokens", 700, "--heads", 2, "--dim", 16, "--dtype", "float64")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON object, from rank 0 only
    out = json.loads(lines[0])
    assert out["ranks"] == 2 and out["tokens"] == 700 and out["max_abs_error"] <= 1e-10
    assert out["bounds"][0] == 0 and out["bounds"][-1] == 700
    assert len(set(out["bytes_sent_per_rank"])) == 1 and out["seconds_one_rank"] > 0
    for scheme in ("sequential", "tree"):
        done = _cp(exe, 2, "--tokens", 300, "--dim", 8, "--dtype", "float64", "--scheme", scheme)
        assert done.returncode == 0 and json.loads(done.stdout)["max_abs_error"] <= 1e-10, done.stderr


def test_more_ranks_than_tokens_is_an_error_on_every_rank():
    exe = _mpiexec_or_skip()
    done = _cp(exe, 2, "--tokens", 1)
    assert done.returncode == 2
    assert done.stderr.count("only T=1 tokens") == 2, done.stderr


def test_cli_arguments_are_checked_without_mpi():
    done = subprocess.run([sys.executable, "-m", "kimilab", "cp", "--tokens", "0"], capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_repeats_alternate_both_runs_and_report_medians():
    """--repeats 3: three timed runs of each after a warm-up; the speedup is the ratio of the medians;
    bytes are per run; a bad count is an error on every rank."""
    exe = _mpiexec_or_skip()
    done = _cp(exe, 2, "--tokens", 400, "--heads", 2, "--dim", 8, "--dtype", "float64", "--repeats", 3,
               "--affine-cost", 1.5)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    ones, walls = out["seconds_one_rank_each"], out["seconds_p_ranks_each"]
    assert out["repeats"] == 3 and len(ones) == len(walls) == 3 and out["max_abs_error"] <= 1e-10
    assert out["seconds_one_rank"] == sorted(ones)[1] and out["seconds_p_ranks"] == sorted(walls)[1]
    assert out["speedup"] == pytest.approx(sorted(ones)[1] / sorted(walls)[1])
    once = json.loads(_cp(exe, 2, "--tokens", 400, "--heads", 2, "--dim", 8, "--dtype", "float64",
                          "--affine-cost", 1.5).stdout)
    assert once["bytes_sent_per_rank"] == out["bytes_sent_per_rank"] and once["bounds"] == out["bounds"]
    bad = _cp(exe, 2, "--tokens", 400, "--repeats", 0)
    assert bad.returncode == 2 and bad.stderr.count("repeats") >= 2, bad.stderr
