"""kimilab.cp under real MPI: ``mpiexec -n 2 python -m kimilab cp`` (separate processes), and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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
    for args in (["--tokens", "0"], ["--tokens", "64", "--layout", "zigzag"], ["--tokens", "64", "--inputs", "x"],
                 ["--tokens", "64", "--method", "two"]):
        done = subprocess.run([sys.executable, "-m", "kimilab", "cp", *args], capture_output=True,
                              text=True, timeout=TIMEOUT)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)


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


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_whole_model_prefill_with_large_ring_messages(ranks, layout):
    """`cp --model tiny` (the path chapter 9's mpiexec section points to): every global layer's ring attention sends a
    key/value block of >= 64 KB, past MPICH's eager limit, in a ring where every rank sends before
    it receives; every KDA layer passes its state; with --layout zigzag every global layer also
    re-deals its input and output (two all-to-alls). Same logits as one rank, no hang."""
    from kimilab.config import tiny
    from kimilab.cp import split_bounds
    from kimilab.cp.zigzag import causal_work, zigzag_layout

    exe = _mpiexec_or_skip()
    T = 200
    per_token = 2 * tiny.attn_kv_heads * tiny.attn_head_dim * 8  # k and v, float64
    assert min(b - a for a, b in zip(split_bounds(T, ranks), split_bounds(T, ranks)[1:])) * per_token >= 64 * 1024
    done = _cp(exe, ranks, "--model", "tiny", "--tokens", T, "--timeout", 30, "--layout", layout)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["ranks"] == ranks and out["max_abs_error"] <= 1e-10 and out["layout"] == layout
    assert min(out["bytes_sent_per_rank"]) >= 2 * 64 * 1024  # two global layers, each >= 64 KB a step
    assert all(w >= b for w, b in zip(out["wire_bytes_sent_per_rank"], out["bytes_sent_per_rank"]))
    if layout == "zigzag":
        assert out["score_entries_per_rank"] == [len(tiny.attn_layers) * w for w in causal_work(zigzag_layout(T, ranks))]


# Per message, what a pickled buffer adds to its arrays (headers, dtypes, shapes, tuple framing).
PICKLE_OVERHEAD = 512


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_kda_schemes_with_large_messages_send_what_the_formulas_count(ranks):
    """Every message holds at least one state, 4 heads x 64 x 64 float32 = 64 KB (past MPICH's eager
    limit): every scheme and method finishes, exact to fp32 rounding, and the bytes MPI carried --
    counted in MPIComm at the pickled-buffer level, not by a formula -- are cp.scheme_costs' payload
    for the busiest rank plus at most a few hundred bytes of framing per message (the collective
    shape check's included). 12,288 tokens in slices of >= 3,072: in the flushed regime M is 0, and
    "needed" sends one state to the neighbour; in the living regime it sends what the formula
    counts with every M alive."""
    from kimilab.cp import scheme_costs

    exe = _mpiexec_or_skip()
    script = os.path.join(os.path.dirname(__file__), "mpi_wire_bytes.py")
    done = subprocess.run([exe, "-n", str(ranks), sys.executable, script, "12288"], capture_output=True, text=True,
                          timeout=4 * TIMEOUT, env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, done.stderr
    for run in json.loads(done.stdout):
        counted = scheme_costs(ranks, 4, 64, 64, flushed=run["regime"] == "flushed")[run["scheme"]]
        wire = max(run["wire"])
        messages = counted["messages"] + ranks  # the scheme's, and the shape check's all-gather
        assert run["max_abs_error"] <= 1e-4, run
        assert counted["bytes"] >= 64 * 1024
        assert counted["bytes"] < wire <= counted["bytes"] + PICKLE_OVERHEAD * messages, (run, counted)
        assert all(w > p for w, p in zip(run["wire"], run["payload"]) if p)


@pytest.mark.parametrize("mode", ["recv", "send", "barrier"])
def test_a_peer_that_never_answers_is_a_one_line_error_within_the_timeout(mode):
    exe = _mpiexec_or_skip()
    script = os.path.join(os.path.dirname(__file__), "mpi_silent_peer.py")
    t0 = time.monotonic()
    done = subprocess.run([exe, "-n", "2", sys.executable, script, mode, "2"], capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, **ONE_THREAD})
    elapsed = time.monotonic() - t0
    assert done.returncode != 0 and elapsed < 15, (done.returncode, elapsed)  # rank 1 would sleep 40 s
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "within 2.0 s" in lines[0] and "rank 0" in lines[0], done.stderr
