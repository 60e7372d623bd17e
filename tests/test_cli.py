"""The one command line, ``python -m kimilab``: JSON out, one-line errors with exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimilab.__main__ import main
from kimilab.sim import CACHES
from kimilab.traffic import Request, load_trace, write_trace

KEYS = ["policy", "model", "deployment", "block_size", "capacity_tokens", "capacity_pages", "checkpoint_pages",
        "kv_bytes_per_token", "checkpoint_bytes_each", "requests", "prompt_tokens", "kv_hit_tokens",
        "usable_hit_tokens", "recomputed_tokens", "kv_hit_rate", "usable_hit_rate", "checkpoints_admitted",
        "checkpoints_evicted", "kv_bytes_peak", "checkpoint_bytes_peak", "kv_bytes_mean",
        "checkpoint_bytes_mean", "prefill_flops_cold", "prefill_flops_saved", "prefill_flops_saved_fraction",
        "prefill_ms_cold_per_request", "prefill_ms_saved_per_request",
        "run_wall_s", "policy_detail"]


@pytest.fixture()
def trace(tmp_path):
    """Four requests in 512-token blocks: two share a branch, one extends it, one has a partial block."""
    paths = [[0, 1, 2], [0, 1, 3, 4], [0, 5], [0, 1, 3, 4, 6]]
    shorts = [0, 100, 200, 300]
    recs = [Request(t, t, len(p) * 512 - short, 1,
                    hash_ids=tuple(hash((tuple(p[: j + 1]), short if j == len(p) - 1 else 0)) % 10**9
                                   for j in range(len(p))))
            for t, (p, short) in enumerate(zip(paths, shorts))]
    return write_trace(tmp_path / "t.jsonl", recs)


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_prefix_prints_one_json_object_with_the_documented_keys(trace, capsys):
    out = run_json(capsys, ["prefix", str(trace), "--capacity-tokens", "100000", "--policy", "dual"])
    assert list(out) == KEYS
    assert out["requests"] == 4 and out["policy"] == "dual" and out["model"] == "kimi_linear_48b"
    assert out["usable_hit_tokens"] <= out["kv_hit_tokens"]
    assert out["recomputed_tokens"] == out["prompt_tokens"] - out["usable_hit_tokens"]


@pytest.mark.parametrize("policy", ["ends", "ends+branch"])
def test_the_ends_policies_are_named_in_the_cli(trace, capsys, policy):
    out = run_json(capsys, ["prefix", str(trace), "--capacity-tokens", "100000", "--policy", policy])
    assert out["policy"] == out["policy_detail"] == policy
    assert out["checkpoints_admitted"] == {"ends": 4, "ends+branch": 5}[policy]  # one request end each (+ a branch)
    with pytest.raises(SystemExit) as exc:
        main(["prefix", str(trace), "--capacity-tokens", "100000", "--policy", policy, "--interval", "1024"])
    assert exc.value.code == 2 and "--interval" in capsys.readouterr().err


def test_unbounded_capacity_equals_a_huge_one_and_needs_no_huge_memory(capsys, data_dir):
    """`inf` and 10^13 tokens (which once tried to allocate 146 GiB of bookkeeping) give the same hits."""
    agent = str(data_dir / "agent.jsonl")
    inf = run_json(capsys, ["prefix", agent, "--capacity-tokens", "inf", "--policy", "every-block"])
    huge = run_json(capsys, ["prefix", agent, "--capacity-tokens", "10000000000000", "--policy", "every-block"])
    assert inf["capacity_tokens"] == "inf" and huge["capacity_tokens"] == 10**13
    for key in ("kv_hit_tokens", "usable_hit_tokens", "checkpoints_admitted", "kv_bytes_peak"):
        assert inf[key] == huge[key]
    assert inf["checkpoints_evicted"] == 0


def test_module_and_console_entry_points(trace):
    proc = subprocess.run([sys.executable, "-m", "kimilab", "prefix", str(trace), "--capacity-tokens",
                           "100000", "--policy", "kv-only"], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    assert out["checkpoint_bytes_peak"] == 0 and out["usable_hit_tokens"] == out["kv_hit_tokens"]
    script = Path(sys.executable).parent / "kimilab"
    if script.exists():  # installed by `pip install -e .` (make setup)
        again = subprocess.run([str(script), "prefix", str(trace), "--capacity-tokens", "100000",
                                "--policy", "kv-only"], capture_output=True, text=True, check=True)
        assert json.loads(again.stdout)["kv_hit_tokens"] == out["kv_hit_tokens"]


@pytest.mark.parametrize("argv, message", [
    (["--capacity-tokens", "1000", "--policy", "lru"], "--policy: invalid choice"),
    (["--capacity-tokens", "-5", "--policy", "dual"], "--capacity-tokens: -5 must be a positive int"),
    (["--capacity-tokens", "lots", "--policy", "dual"], "--capacity-tokens: 'lots' is not an int"),
    (["--capacity-tokens", "100", "--policy", "dual"], "at least one block"),
    (["--capacity-tokens", "10000", "--policy", "dual", "--model", "nope"], "--model: invalid choice"),
    (["--capacity-tokens", "10000", "--policy", "align", "--interval", "700"], "multiple of block_size"),
    (["--capacity-tokens", "10000", "--policy", "kv-only", "--interval", "1024"], "--interval"),
    (["--policy", "dual"], "--capacity-tokens"),
])
def test_bad_arguments_are_one_line_naming_the_argument(trace, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["prefix", str(trace)] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_bad_trace_line_is_named_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 1, "input_length": 10, "output_length": 1}\n')
    for argv in (["prefix", str(bad), "--capacity-tokens", "10000", "--policy", "dual"],
                 ["traces", "stats", str(bad)]):
        proc = subprocess.run([sys.executable, "-m", "kimilab", *argv], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert f"{bad}: line 2: field 'hash_ids' missing" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kimilab", "traces", "stats", str(tmp_path / "nope.jsonl")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr and proc.stderr.count("\n") == 1


def test_traces_stats_and_regenerate(tmp_path, capsys, data_dir):
    DATA = data_dir
    assert main(["traces", "stats", str(DATA / "agent.jsonl"), str(DATA / "chat.jsonl")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{DATA / 'agent.jsonl'}: requests=")
    assert main(["traces", "regenerate", str(tmp_path)]) == 0
    for name in ("agent.jsonl", "chat.jsonl", "document.jsonl", "conversation_like.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    assert len(load_trace(tmp_path / "agent.jsonl")) == len(load_trace(DATA / "agent.jsonl"))


def test_memory_prints_the_cost_summary(capsys):
    assert main(["memory"]) == 0
    out = capsys.readouterr().out
    assert "kimi_linear_48b" in out and "all_mla_27" in out
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--model", "nope"])
    assert exc.value.code == 2


def test_no_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "kimilab", *map(str, argv)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("argv, names", [
    (["cp", "--tokens", "10000000000"], "--tokens=10000000000"),  # once a MemoryError traceback
    (["cp", "--tokens", "1", "--heads", "1", "--dim", "20000"], "--dim=20000"),  # once a hang
    (["cp", "--tokens", "1", "--heads", "100000", "--dim", "1024"], "--heads=100000 x --dim=1024"),
    (["cp", "--tokens", "100", "--affine-cost", "inf"], "--affine-cost"),  # once "weights: expected ..."
    (["cp", "--tokens", "100", "--repeats", "0"], "--repeats"),
])
def test_issue_22_bad_cp_inputs_are_one_line_naming_the_flag(argv, names):
    proc = _run(*argv)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and names in proc.stderr and "Traceback" not in proc.stderr


def test_a_prompt_of_no_tokens_is_named_by_its_line(tmp_path):
    bad = tmp_path / "zero.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}\n'
                   '{"timestamp": 1, "input_length": 0, "output_length": 5, "hash_ids": []}\n')
    for argv in (["prefix", bad, "--capacity-tokens", "10000", "--policy", "ends"], ["traces", "stats", bad],
                 ["fleet", bad, "--instances", "1", "--router", "least-loaded", "--capacity-tokens", "10000"]):
        proc = _run(*argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"{bad}: line 2: field 'input_length'=0" in proc.stderr


@pytest.mark.parametrize("model", ["all_mla_27", "gqa_8b"])
def test_models_without_kda_layers_serve_in_the_fleet(model, data_dir):
    """Both are offered by --help; a transformer keeps KV only, so every cached token is usable."""
    proc = _run("fleet", data_dir / "chat.jsonl", "--instances", "2", "--router", "prefix-affinity",
                "--capacity-tokens", "200000", "--model", model)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finished"] == out["requests"] == 270 and out["usable_hit_rate"] == out["kv_hit_rate"] > 0


def test_a_run_where_nothing_finishes_has_null_percentiles_and_fails(data_dir):
    proc = _run("fleet", data_dir / "chat.jsonl", "--instances", "1", "--router", "least-loaded",
                "--capacity-tokens", "1024")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--capacity-tokens=1024" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["finished"] == 0 and out["refused"] == 270
    assert out["ttft_p50_s"] is None and out["ttft_p99_s"] is None and out["tpot_p99_s"] is None


def test_every_help_text_states_the_code_s_default():
    """argparse writes each default into its help, so help and code cannot disagree."""
    for command in ("prefix", "fleet", "cp", "experiment", "memory"):
        text = " ".join(_run(command, "--help").stdout.split())
        assert "(default" not in text.replace("(default: ", ""), command  # no hand-written defaults left
    text = " ".join(_run("experiment", "--help").stdout.split())
    assert "the fastest is kept (default: 1)" in text and "sessions per workload (default: 2)" in text


# ----- one error boundary: the same input, the same answer, exit 2 and one line -----


def _one_line_rc2(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def test_an_empty_or_deeply_nested_trace_gets_one_answer_from_every_command(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    for path, says in ((empty, "holds no requests"), (deep, "line 1: JSON nested too deeply")):
        for argv in (["traces", "stats", path], ["prefix", path, "--policy", "dual", "--capacity-tokens", "inf"],
                     ["fleet", path, "--instances", "1", "--router", "least-work", "--capacity-tokens", "inf"]):
            proc = _run(*argv)
            _one_line_rc2(proc, f"{path}: ", says)
            assert proc.stdout == ""


def test_fleet_sizes_and_times_have_limits_and_memory_follows_the_work(tmp_path, capsys):
    """A Unix-epoch timestamp (1.7e12 ms) once cost 820 MB of busy buckets from t = 0; now a handful.
    A clock a float cannot step, too many instances, and one instance failing twice are named."""
    from kimilab.config import kimi_linear_48b
    from kimilab.costs import DEFAULT_DEPLOYMENT
    from kimilab.fleet import run_fleet
    from kimilab.traffic import Request

    epoch = [Request(0, 1_700_000_000_000, 600, 3, hash_ids=(1, 2)),
             Request(1, 1_700_000_000_500, 600, 3, hash_ids=(1, 3))]
    res = run_fleet(epoch, kimi_linear_48b, deployment=DEFAULT_DEPLOYMENT, instances=2, router="least-work",
                    capacity_tokens=None)
    assert res.finished == 2 and res.busy_s.shape[1] <= 2 and res.busy_buckets[0] == 170_000_000
    assert 0 < res.summary()["instances"][0]["busy_fraction"] <= 1
    t = write_trace(tmp_path / "epoch.jsonl", epoch)
    for argv, says in (
            (["--rate-scale", "1e-300"], "rate_scale=1e-300"),
            (["--instances", "100000"], "instances=100000"),
            (["--fail", "0@1", "--fail", "0@2"], "at most once")):
        base = ["fleet", t, "--router", "least-work", "--capacity-tokens", "inf"]
        if "--instances" not in argv:
            base += ["--instances", "2"]
        _one_line_rc2(_run(*base, *argv), says)


def test_outputs_are_checked_before_any_work_and_book_names_a_missing_chapter(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    _one_line_rc2(_run("experiment", "--part", "a", "--out", afile / "sub"), "--out=", "writable directory")
    _one_line_rc2(_run("grade", tmp_path / "none.ipynb", "--out", tmp_path), "--out=", "is a directory")
    _one_line_rc2(_run("book", "--only", "99", "--no-html"), "--only: no chapter numbered ['99']")
    _one_line_rc2(_run("book", "--jobs", "0", "--no-html"), "--jobs")


def test_a_partial_block_id_with_two_lengths_is_named(tmp_path):
    t = tmp_path / "pb.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 1, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]}\n')
    _one_line_rc2(_run("prefix", t, "--policy", "dual", "--capacity-tokens", "inf", "--partial-blocks"),
                  f"{t}: ", "88 tokens, now 188", "same tokens throughout")


def test_every_command_refuses_an_unchained_trace_alike(tmp_path):
    """A duplicate id in a request, or an id under two parents: `traces stats` validates chains, and
    every command that reads a trace refuses it with the same line."""
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [5, 5]}\n')
    two = tmp_path / "two.jsonl"
    two.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [3, 2]}\n')
    for path, says in ((dup, "line 1: field 'hash_ids'[1]=5 repeats"), (two, "line 2: field 'hash_ids'[1]=2 is after 3")):
        for argv in (["traces", "stats", path], ["prefix", path, "--policy", "dual", "--capacity-tokens", "inf"],
                     ["fleet", path, "--instances", "1", "--router", "least-work", "--capacity-tokens", "inf"]):
            _one_line_rc2(_run(*argv), f"{path}: {says}")


def test_version_is_printed():
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("kimilab ") and proc.stderr == ""


# ----- issue 37: every cache chapter 6 compares, on either kind of trace, prints what replay gives -----


@pytest.fixture(scope="module")
def conversation(tmp_path_factory, data_dir):
    """The first 300 requests of the real Kimi chat hour: small, yet 1 GB per device evicts."""
    lines = (data_dir / "mooncake_conversation.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    path = tmp_path_factory.mktemp("conversation") / "conversation.jsonl"
    path.write_text("".join(lines[:300]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sessions(tmp_path_factory, data_dir):
    """Three of the converted Claude Code sessions, written as traces convert-claude-code writes them."""
    from kimilab.traffic import CLAUDE_CODE, load_sessions
    from kimilab.traffic.claude_code import write_sessions

    rows = load_sessions(data_dir / CLAUDE_CODE)
    keep = sorted({r.session for r in rows})[:3]
    return write_sessions([r for r in rows if r.session in keep], tmp_path_factory.mktemp("sessions") / "s.jsonl.gz")


def _as_replayed(job, out):
    """What ``replay(job)`` gives, in the command's JSON (its wall time and the cache's name aside)."""
    from kimilab.sim import replay

    res = replay(job)
    return res.as_dict() | {"policy": job.policy, "run_wall_s": out["run_wall_s"], "policy_detail": res.policy_detail}


@pytest.mark.parametrize("name", CACHES)
def test_prefix_runs_every_cache_and_prints_what_replay_gives(conversation, capsys, name):
    from kimilab.costs import DEFAULT_DEPLOYMENT
    from kimilab.sim import Replay

    job = Replay(str(conversation), name, 1, DEFAULT_DEPLOYMENT)
    out = run_json(capsys, ["prefix", str(conversation), "--policy", name,
                            "--capacity-tokens", str(job.capacity_tokens())])
    assert list(out) == KEYS and out["policy"] == name and out["requests"] == 300
    assert out == _as_replayed(job, out)
    assert out["checkpoints_evicted"] > 0 or name in ("kv-only", "no-states")  # the memory binds


@pytest.mark.parametrize("name, argv, options", [
    ("marconi", ["--alpha", "0.5"], (("alpha", 0.5),)),
    ("dual", ["--alpha", "0", "--interval", "4096"], (("interval", 4096), ("alpha", 0.0))),
    ("sglang-extra-buffer", ["--interval", "4096"], (("interval", 4096),)),
])
def test_prefix_options_reach_the_cache_as_replay_options(conversation, capsys, name, argv, options):
    from kimilab.costs import DEFAULT_DEPLOYMENT
    from kimilab.sim import Replay

    job = Replay(str(conversation), name, 1, DEFAULT_DEPLOYMENT, options=options)
    out = run_json(capsys, ["prefix", str(conversation), "--policy", name,
                            "--capacity-tokens", str(job.capacity_tokens()), *argv])
    assert out == _as_replayed(job, out)
    assert ("alpha=0.5" in out["policy_detail"]) == (name == "marconi")


@pytest.mark.parametrize("name, argv, rate, seed", [
    ("ends", [], 0.05, 0),  # chapter 6's rate and seed when not given
    ("vllm-align", ["--sessions-per-s", "0.2", "--seed", "3"], 0.2, 3),  # re-keyed to vLLM's 480-token block
    ("marconi", ["--seed", "1"], 0.05, 1),
])
def test_prefix_reads_claude_code_sessions_as_replay_does(sessions, capsys, name, argv, rate, seed):
    """Once a UTF-8 error: the .jsonl.gz sessions go on one Poisson timeline, as chapter 6 replays them."""
    from kimilab.costs import DEFAULT_DEPLOYMENT
    from kimilab.sim import Replay

    job = Replay(str(sessions), name, 1, DEFAULT_DEPLOYMENT, sessions_per_s=rate, seed=seed)
    out = run_json(capsys, ["prefix", str(sessions), "--policy", name,
                            "--capacity-tokens", str(job.capacity_tokens()), *argv])
    assert out == _as_replayed(job, out) and out["requests"] > 0
    assert out["block_size"] == (480 if name == "vllm-align" else 512)


@pytest.mark.parametrize("argv, message", [
    (["--policy", "ends", "--alpha", "0.1"], "--alpha: only dual, marconi take an alpha, not ends"),
    (["--policy", "dual", "--alpha", "nan"], "--alpha: nan must be a finite number >= 0"),
    (["--policy", "oracle", "--interval", "1024"], "--interval: only"),
    (["--policy", "marconi", "--partial-blocks"], "--partial-blocks: marconi caches whole blocks only"),
    (["--policy", "ends", "--seed", "1"], "--seed: only for converted Claude Code sessions"),
    (["--policy", "ends", "--sessions-per-s", "1"], "--sessions-per-s: only for converted Claude Code sessions"),
    (["--policy", "ends", "--seed", "-1"], "--seed: -1 must be an int >= 0"),
    (["--policy", "vllm-align", "--capacity-tokens", "400"], "at least one block (vLLM's 480-token block"),
])
def test_bad_prefix_options_are_one_line_naming_the_option(trace, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["prefix", str(trace), "--capacity-tokens", "10000"] + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_gzip_that_is_not_claude_code_sessions_is_one_line(tmp_path, capsys, sessions, data_dir):
    import gzip

    cases = {"truncated.jsonl.gz": (sessions.read_bytes()[:200], "not readable as gzip-compressed"),
             "bent.jsonl.gz": (b"\x1f\x8b garbage", "not readable as gzip-compressed"),
             "binary.jsonl.gz": (bytes(range(128, 256)), "not readable as gzip-compressed"),
             "mooncake.jsonl.gz": (gzip.compress((data_dir / "chat.jsonl").read_bytes()), "line 1: field 'session'"),
             "strings.jsonl.gz": (gzip.compress(b'{"session": 0, "agent": 0, "t_ms": 0, "api_ms": 0, "input_length":'
                                                b' 5, "output_length": 1, "hash_ids": ["a"]}\n'), "'hash_ids'[0]='a'"),
             "packed.jsonl": (gzip.compress((data_dir / "chat.jsonl").read_bytes()), "a gzip file; expected")}
    for name, (body, says) in cases.items():
        (tmp_path / name).write_bytes(body)
        with pytest.raises(SystemExit) as exc:
            main(["prefix", str(tmp_path / name), "--policy", "ends", "--capacity-tokens", "inf"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"{tmp_path / name}: " in err and says in err, (name, err)
        assert err.count("\n") == 1 and "Traceback" not in err


def test_prefix_auto_runs_the_policy_the_map_picks_and_says_why(conversation, capsys, monkeypatch):
    """``--policy auto``: the trace's sharing statistics, the map's choice, then that cache's replay.
    The map here is a small stand-in (the shipped one is ``data/results/ch6_policy_map.json``, checked
    by ``make results``), so the choice is known: ``vllm-align`` where reuse ends inside prompts."""
    import kimilab.sim.policy_map as pm

    def point(mid, winner):
        hits = {name: 0.1 for name in pm.ONLINE + (pm.CLAIRVOYANT,)} | {winner: 0.2}
        return {"shape": "chat", "stats": {"common": 1.0, "mid": mid, "turns": 1.8, "prompt": 12_000.0,
                                           "fresh_per_min": 1e6},
                "at": [{"reach": 1.0, "capacity_tokens": 10**6, "hits": hits}]}

    monkeypatch.setattr(pm, "shipped_map", lambda: [point(m, "ends") for m in (0.0, 0.05, 0.1, 0.15)]
                        + [point(m, "vllm-align") for m in (0.5, 0.6, 0.7, 0.8)])
    out = run_json(capsys, ["prefix", str(conversation), "--policy", "auto", "--capacity-tokens", "100000"])
    chosen = run_json(capsys, ["prefix", str(conversation), "--policy", "ends", "--capacity-tokens", "100000"])
    assert out["policy"] == out["auto"]["chose"] == "ends" and "mid" in out["auto"]["why"]
    assert {k: v for k, v in out.items() if k not in ("auto", "run_wall_s")} == \
        {k: v for k, v in chosen.items() if k != "run_wall_s"}
    for flag in (["--alpha", "0.5"], ["--partial-blocks"]):
        with pytest.raises(SystemExit) as exc:
            main(["prefix", str(conversation), "--policy", "auto", "--capacity-tokens", "100000", *flag])
        assert exc.value.code == 2 and flag[0] in capsys.readouterr().err


# ----- issue 38: a host-memory tier under the cache, from the command line -----


def test_prefix_host_gb_adds_a_tier_that_only_adds_hits(conversation, capsys):
    """1 GB per device of the 300 requests evicts; host DRAM under it gives back hits, and says what it moved.
    A zero-byte tier is the cache without one; a policy off the block tree is refused in one line."""
    base = ["prefix", str(conversation), "--policy", "ends", "--capacity-tokens", str(10**9 // 8064)]
    plain = run_json(capsys, base)
    empty = run_json(capsys, base + ["--host-gb", "0"])
    tier = run_json(capsys, base + ["--host-gb", "inf"])
    assert empty["usable_hit_tokens"] == plain["usable_hit_tokens"] and empty["host_tier"]["loads"] == 0
    assert tier["usable_hit_tokens"] > plain["usable_hit_tokens"] and tier["host_tier"]["loads"] > 0
    assert tier["host_tier"]["host_capacity_bytes"] is None and tier["host_tier"]["load_seconds"] > 0
    with pytest.raises(SystemExit) as exc:
        main(base[:3] + ["marconi"] + base[4:] + ["--host-gb", "10"])
    assert exc.value.code == 2 and "--host-gb" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(base + ["--host-gb", "-1"])
    assert exc.value.code == 2


def test_fleet_host_gb_serves_with_a_tier_and_refuses_it_with_quotas(data_dir):
    args = ("fleet", data_dir / "chat.jsonl", "--instances", "1", "--router", "least-loaded",
            "--capacity-tokens", "200000")
    plain, tier = _run(*args), _run(*args, "--host-gb", "160")
    assert plain.returncode == tier.returncode == 0, tier.stderr
    a, b = json.loads(plain.stdout), json.loads(tier.stdout)
    assert a["finished"] == b["finished"] == a["requests"] and b["usable_hit_rate"] >= a["usable_hit_rate"]
    _one_line_rc2(_run(*args, "--host-gb", "1", "--isolation", "quota"), "--host-gb", "--isolation")


def test_fleet_store_gb_shares_a_store_and_refuses_what_it_cannot_go_with(data_dir):
    """Two instances behind a load-only router share a store: more hits than alone, and the summary
    says what the store moved. Beside a host tier, under quotas, or --overlap-loads alone: exit 2."""
    args = ("fleet", data_dir / "chat.jsonl", "--instances", "2", "--router", "least-loaded",
            "--capacity-tokens", "200000")
    plain, store = _run(*args), _run(*args, "--store-gb", "inf", "--overlap-loads")
    assert plain.returncode == store.returncode == 0, store.stderr
    a, b = json.loads(plain.stdout), json.loads(store.stdout)
    assert a["finished"] == b["finished"] == a["requests"] and "store" not in a
    assert b["usable_hit_rate"] > a["usable_hit_rate"] and b["store"]["capacity_bytes"] is None
    assert b["store"]["written_bytes"] > 0 and b["store"]["loads"] > 0
    _one_line_rc2(_run(*args, "--store-gb", "1", "--host-gb", "1"), "--store-gb", "--host-gb")
    _one_line_rc2(_run(*args, "--store-gb", "1", "--isolation", "quota"), "--store-gb", "--isolation")
    _one_line_rc2(_run(*args, "--overlap-loads"), "--overlap-loads", "--store-gb")
