"""Speculative decoding inside the batched engine (kimilab.engine.speculation).

* Tensor mode: with every rollback strategy, at any acceptance, through prefix hits and preemption,
  each request's tokens equal Model.generate alone; a broken rollback (the plain trim) is caught.
* Accounting: the decode clock with variable tokens per step equals the slow twin, decision for
  decision, under quotas, failures and a host tier; nothing leaks.
* Costs: a verify step is the forward with the decoders as chunks of k+1; tokens per step follow
  the truncated geometric law; the drafter's KV and weights shrink the pool, the hybrid's more.
"""

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from fuzzing import examples

from kimilab import costs
from kimilab.config import all_mla_27, kimi_linear_48b, tiny
from kimilab.costs import ONE_H200, DP4_EP4_H200, StepTimer, step_seconds
from kimilab.costs.drafter import drafter_kv_bytes_per_token, mtp_config, spec_capacity_tokens
from kimilab.costs.spec_bytes import ROLLBACK_STRATEGIES
from kimilab.costs.spec_time import expected_tokens_per_step
from kimilab.engine import Engine, Speculation, TensorExecutor, tensor
from kimilab.engine.reference import ReferenceEngine
from kimilab.engine.speculation import SpecTimer, cheapest_rollback
from kimilab.engine.tensor import serve, submit
from kimilab.speculative import make_rollback
from kimilab.traffic import Request

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_engine import _assert_same, _fleet_ok, _trace, _twins  # noqa: E402

FEW = settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])


def _prompts(seed: int, n: int, block: int, max_out: int = 24, gap_ms: int = 3) -> list:
    """Prompts on one shared head (so later ones hit), arriving ``gap_ms`` apart."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, tiny.vocab_size, block + 3)
    out = []
    for i in range(n):
        p = np.concatenate([head, rng.integers(0, tiny.vocab_size, int(rng.integers(1, 3 * block)))])
        out.append(Request(i, gap_ms * i, p.size, int(rng.integers(0, max_out + 1)), tokens=p))
    return out


@FEW
@example(seed=0, k=3, alpha=0.6, rollback="lazy-ring", tight=True, block=8)
@example(seed=1, k=1, alpha=1.0, rollback="slot", tight=False, block=4)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 4), alpha=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
       rollback=st.sampled_from(ROLLBACK_STRATEGIES), tight=st.booleans(), block=st.sampled_from([4, 8]))
def test_speculative_engine_equals_greedy(tiny_model, seed, k, alpha, rollback, tight, block):
    """Real verify passes and rollbacks, k drafts a step, the engine's draws deciding what is kept:
    every request's tokens equal Model.generate alone, through prefix hits and (tight) preemption."""
    reqs = _prompts(seed, 6, block)
    probe = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=block)
    need = max(-(-(r.input_length + r.output_length + 1 + k) // block) for r in reqs) + 3 * probe.memory.state_pages
    spec = Speculation(k, alpha, rollback=rollback, seed=seed)
    e, out = serve(tiny_model, reqs, deployment=ONE_H200, block_size=block, policy="dual", token_budget=4 * block,
                   capacity_tokens=need * block if tight else None, speculation=spec)
    assert sorted(out) == [r.request_id for r in reqs]
    for r in reqs:
        np.testing.assert_array_equal(out[r.request_id], tiny_model.generate(r.tokens, r.output_length),
                                      err_msg=f"request {r.request_id}")
    e.check_no_leak()
    assert not e.executor._spec, "every strategy was closed"


@pytest.mark.parametrize("block", [4, 8])
def test_a_tight_pool_preempts_a_speculating_request_and_it_still_equals_greedy(tiny_model, block):
    """Short prompts, long outputs, a pool of about one request: decoders growing by up to k+1 tokens
    a step preempt each other, and the victims recompute what they streamed."""
    rng = np.random.default_rng(block)
    reqs = []
    for i in range(4):
        p = rng.integers(0, tiny.vocab_size, int(rng.integers(1, block)))
        reqs.append(Request(i, 0, p.size, int(rng.integers(2 * block + 2, 3 * block + 1)), tokens=p))
    probe = Engine(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=block)
    need = max(-(-(r.input_length + r.output_length + 4) // block) for r in reqs) + 3 * probe.memory.state_pages
    e, out = serve(tiny_model, reqs, deployment=ONE_H200, block_size=block, capacity_tokens=need * block,
                   token_budget=4 * block, speculation=Speculation(3, 0.7, rollback="replay"))
    assert e.preemptions > 0
    for r in reqs:
        np.testing.assert_array_equal(out[r.request_id], tiny_model.generate(r.tokens, r.output_length))


def test_a_broken_rollback_is_caught(tiny_model, monkeypatch):
    """The plain trim (chapter 7's broken rollback) leaves a wrong KDA state: the next verify keeps
    fewer drafts than the engine drew, and the executor says so."""
    monkeypatch.setattr(tensor, "make_rollback", lambda name, *a, **kw: make_rollback("none", *a, **kw))
    with pytest.raises(AssertionError, match="rollback left a wrong state"):
        serve(tiny_model, _prompts(1, 3, 8), deployment=ONE_H200, block_size=8, speculation=Speculation(3, 0.6))


def test_the_twin_drives_speculative_tensors_like_the_engine(tiny_model):
    out = []
    reqs = _prompts(5, 5, 4, max_out=20)
    for cls in (Engine, ReferenceEngine):
        ex = TensorExecutor(tiny_model)
        e = cls(tiny, deployment=ONE_H200, capacity_tokens=None, block_size=4, token_budget=12, executor=ex,
                speculation=Speculation(2, 0.5, rollback="snapshot", seed=4))
        submit(e, reqs)
        e.drain()
        out.append((e, ex.outputs()))
    (a, oa), (b, ob) = out
    assert a.finished == b.finished and oa == ob
    assert (a.n_steps, a.clock, a.busy) == (b.n_steps, b.clock, b.busy)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(seed=0, n_inst=2, quota=True, fail=True, capacity_blocks=50, budget=512, k=3, alpha=0.7, host=False)
@given(seed=st.integers(0, 10**6), n_inst=st.integers(1, 3), quota=st.booleans(), fail=st.booleans(),
       capacity_blocks=st.integers(40, 160), budget=st.sampled_from([300, 2048, 8192]), k=st.integers(1, 5),
       alpha=st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0]), host=st.booleans())
def test_speculating_engine_equals_its_slow_twin(seed, n_inst, quota, fail, capacity_blocks, budget, k, alpha, host):
    """Tokens per step vary (the same for every decoder of a step): the decode clock, its heaps and
    the fast-forward still make every decision the plain loop makes -- latencies, hits, steps, gaps,
    preemptions, refusals, busy seconds and what routers read -- and nothing leaks."""
    reqs = _trace(seed, 50, tenants=("a", "b") if quota else ("a",), gap_ms=15, max_out=1200)
    fails = [(0, 0.05)] if fail and n_inst > 1 else []
    tier = {"host_bytes": 20 * 512 * costs.kv_bytes_per_token(kimi_linear_48b, ONE_H200)} if host and not quota else {}
    fast, slow = _twins(reqs, n_inst=n_inst, router="prefix-affinity", quota=quota, fails=fails,
                        capacity_blocks=capacity_blocks, token_budget=budget, policy="dual",
                        speculation=Speculation(k, alpha, seed=seed), **tier)
    _assert_same(fast, slow)
    _fleet_ok(fast[0])
    _fleet_ok(slow[0])


def test_tokens_per_step_follow_the_truncated_geometric_law():
    for k, alpha in ((1, 0.5), (3, 0.7), (4, 0.9), (3, 0.0), (2, 1.0)):
        s = Speculation(k, alpha, seed=7)
        got = np.array(s.run_tokens(0, 20000))
        assert got.min() >= 1 and got.max() <= k + 1
        assert got.mean() == pytest.approx(expected_tokens_per_step(alpha, k), abs=0.03)
        for j in range(1, k + 1):  # P(at least j drafts accepted) = alpha^j
            assert np.mean(got >= j + 1) == pytest.approx(alpha ** j, abs=0.015)
    assert s.run_tokens(5, 3) == Speculation(2, 1.0, seed=7).run_tokens(5, 3) == [3, 3, 3]


def test_plain_and_speculative_runs_agree_where_they_must():
    """Counted in decoder-steps (a decoder taking part in one step): at alpha = 0 every one yields a
    token, as plain decoding; at alpha = 1 each yields k+1 until the request's last; alpha = 0 costs
    time (each verify reads k more positions), alpha = 1 saves it."""
    from kimilab.engine import Live

    reqs = _trace(2, 30, gap_ms=60, max_out=400)
    after_first = [max(r.output_length - 1, 0) for r in reqs]
    runs = {}
    for name, spec in (("plain", None), ("zero", Speculation(3, 0.0, drafter="ngram")),
                       ("all", Speculation(3, 1.0, drafter="ngram"))):
        e = Engine(kimi_linear_48b, deployment=ONE_H200, capacity_tokens=None, speculation=spec, keep_steps=True)
        for r in reqs:
            e.advance(r.arrival_ms / 1000)
            e.submit(Live(r, r.arrival_ms / 1000))
        e.drain()
        assert e.preemptions == 0 and len(e.finished) == len(reqs)
        runs[name] = (e, sum(k * n_dec for _, _, k, n_dec, _ in e.steps))
    assert runs["plain"][1] == runs["zero"][1] == sum(after_first)
    assert runs["all"][1] == sum(-(-n // 4) for n in after_first)
    assert runs["zero"][0].clock > runs["plain"][0].clock > runs["all"][0].clock


def test_a_verify_step_is_the_forward_with_decoders_as_chunks():
    rng = np.random.default_rng(0)
    for cfg in (kimi_linear_48b, all_mla_27):
        t = StepTimer(cfg, costs.DEFAULT_DEPLOYMENT)
        for _ in range(20):
            n, p = int(rng.integers(1, 40)), int(rng.integers(2, 9))
            ctx = rng.integers(0, 30000, n)
            chunks = [(int(rng.integers(1, 3000)), int(rng.integers(0, 9000)))] if rng.random() < 0.5 else []
            want = step_seconds(cfg, costs.DEFAULT_DEPLOYMENT, chunks=[(p, int(c)) for c in ctx] + chunks)
            assert t.step(n, int(ctx.sum()), chunks, positions=p) == pytest.approx(want, rel=1e-12)


def test_the_spec_timer_counts_rollback_and_drafter():
    dep = costs.DEFAULT_DEPLOYMENT
    plain = StepTimer(kimi_linear_48b, dep)
    mtp = SpecTimer(kimi_linear_48b, dep, Speculation(3, 0.7), plain)
    ngram = SpecTimer(kimi_linear_48b, dep, Speculation(3, 0.7, drafter="ngram", rollback="snapshot"), plain)
    n, ctx = 64, 64 * 8000
    forward = plain.step(n, ctx, (), positions=4)
    assert mtp.draft_seconds(n, ctx) > 0 and ngram.draft_seconds(n, ctx) == 0
    assert mtp.step(n, ctx, (), [2]) == pytest.approx(forward + mtp._rollback(2, n) + mtp.draft_seconds(n, ctx))
    assert ngram.step(n, ctx, (), [4]) > forward  # snapshots copy states back
    assert mtp.strategy == cheapest_rollback(kimi_linear_48b, dep, 3, 0.7) == "lazy-ring"  # chapter 8's finding
    assert cheapest_rollback(all_mla_27, dep, 3, 0.7) == ROLLBACK_STRATEGIES[0]  # no state: every one is free
    one = mtp_config(kimi_linear_48b)
    assert one.layer_pattern == "A" and one.weights.total_params < kimi_linear_48b.weights.total_params / 10


def test_the_drafter_shrinks_the_pool_and_the_hybrids_most():
    dep = costs.DEFAULT_DEPLOYMENT
    share = {}
    for cfg in (kimi_linear_48b, all_mla_27):
        full = costs.capacity_tokens(cfg, dep)
        assert spec_capacity_tokens(cfg, dep, "ngram") == full
        assert drafter_kv_bytes_per_token(cfg, dep) * len(cfg.attn_layers) == costs.kv_bytes_per_token(cfg, dep)
        share[cfg.name] = 1 - spec_capacity_tokens(cfg, dep) / full
    assert share["kimi_linear_48b"] > 1 / 8 - 0.01 and share["all_mla_27"] < 0.05  # 7 MLA layers against 27


def test_bad_speculation_is_refused_with_its_name():
    for kw, name in (({"k": 0}, "k="), ({"alpha": 1.5}, "alpha="), ({"rollback": "none"}, "rollback="),
                     ({"drafter": "eagle"}, "drafter="), ({"seed": -1}, "seed=")):
        with pytest.raises(ValueError, match=name):
            Speculation(**kw)
    with pytest.raises(ValueError, match="speculation: expected a kimilab.engine.Speculation"):
        Engine(kimi_linear_48b, deployment=ONE_H200, capacity_tokens=None, speculation={"k": 3})
    with pytest.raises(ValueError, match="DP-attention"):
        Engine(kimi_linear_48b, deployment=DP4_EP4_H200, capacity_tokens=None, dp_device=True,
               speculation=Speculation())


def test_part_b_takes_speculation_as_plain_fields():
    from kimilab.experiment.scale import conversation_goodput
    from kimilab.experiment.tiers import speculation_of
    from kimilab.experiment.variants import BASELINE, variant

    assert speculation_of({"k": 2, "alpha": 0.5}) == Speculation(2, 0.5)
    with pytest.raises(ValueError, match="unknown field"):
        speculation_of({"k": 2, "acceptance": 0.5})
    row = conversation_goodput(variant(BASELINE), n_requests=150, instances=1, orders=1, rel_tol=0.3, start=2.0,
                               speculation={"k": 3, "alpha": 0.9})
    assert row["speculation"] == {"k": 3, "alpha": 0.9} and row["goodput"] > 0
    assert row["tpot_p50_s"] < conversation_goodput(variant(BASELINE), n_requests=150, instances=1, orders=1,
                                                    rel_tol=0.3, start=2.0)["tpot_p50_s"]


def test_the_fleet_command_speculates(tmp_path, capsys):
    import json

    from kimilab.__main__ import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": 60,
                                         "hash_ids": [i % 3, 100 + i]}) + "\n" for i in range(12)))
    base = ["fleet", str(trace), "--instances", "2", "--router", "least-loaded", "--capacity-tokens", "inf"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--spec-k", "3", "--spec-alpha", "0.9"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tpot_p50_s"] < plain["tpot_p50_s"]
    for bad, says in ((["--spec-alpha", "0.5"], "--spec-alpha: expected --spec-k"),
                      (["--spec-k", "2", "--spec-alpha", "2"], "probability")):
        with pytest.raises(SystemExit) as err:
            main(base + bad)
        assert err.value.code == 2 and says in capsys.readouterr().err


class _ForgetsTheLookahead(Engine):
    """Mutant: decoders grow only for the token they make, not for the k drafts a verify writes."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._lookahead = 0


def test_the_twin_tells_a_wrong_speculating_engine_apart():
    reqs = _trace(3, 50, gap_ms=2, max_out=2000)
    kw = dict(capacity_blocks=60, token_budget=2048, speculation=Speculation(4, 0.6))
    fast, slow = _twins(reqs, **kw)
    _assert_same(fast, slow)
    assert slow[1].preemptions > 0
    for mutant in (_ForgetsTheLookahead,):
        (wrong,) = _twins(reqs, (mutant,), **kw)
        with pytest.raises(AssertionError):
            _assert_same(wrong, slow)


def test_the_experiment_command_checks_its_speculation_flags(tmp_path, capsys):
    from kimilab.__main__ import main

    for argv, says in ((["--scale", "full", "--spec-k", "3"], "not modelled under DP-attention"),
                       (["--spec-alpha", "0.5"], "--spec-alpha: expected --spec-k")):
        with pytest.raises(SystemExit) as err:
            main(["experiment", "--part", "b", "--out", str(tmp_path), *argv])
        assert err.value.code == 2 and says in capsys.readouterr().err
