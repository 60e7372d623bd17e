"""The rollback cost model (kimilab.costs.spec): bytes per device and strategy at 48B, replay FLOPs,
and a verify step of a whole batch as one forward pass."""

import pytest

from kimilab import costs
from kimilab.config import kimi_linear_48b as BIG, tiny
from kimilab.costs import spec as sc

ONE, TP4, DP4 = costs.ONE_H200, costs.VLLM_TP4_H200, costs.DP4_EP4_H200


def test_record_sizes_from_shapes_and_per_device():
    H, K, C = BIG.n_heads, BIG.head_dim, BIG.conv_channels
    assert sc.record_elems_per_layer(BIG, "post-conv") == 3 * H * K + H + C
    assert sc.record_elems_per_layer(BIG, "raw") == C + H * K + H
    assert sc.record_elems_per_layer(BIG, "low-rank") == C + K + H
    assert sc.record_bytes_per_token(BIG, ONE) == 20 * (3 * H * K + H + C) * 2  # bf16 activations by default
    assert sc.record_bytes_per_token(BIG, TP4) == sc.record_bytes_per_token(BIG, ONE) // 4  # shards by head
    assert sc.conv_row_bytes(tiny, costs.LOCAL) == len(tiny.kda_layers) * tiny.conv_channels * 8


def test_replay_and_ring_keep_at_least_20x_less_than_snapshots_at_k8_bf16():
    for dep in (ONE, TP4):
        snap = sc.rollback_bytes(BIG, dep, "snapshot", 8)
        assert snap == 9 * costs.checkpoint_bytes(BIG, dep)
        for strategy in ("replay", "ring"):
            assert snap / sc.rollback_bytes(BIG, dep, strategy, 8, act_bytes=2) >= 20
    assert sc.rollback_bytes(BIG, ONE, "ring", 8, window=12) > sc.rollback_bytes(BIG, ONE, "ring", 8)
    assert sc.rollback_bytes(BIG, TP4, "snapshot", 8) == sc.rollback_bytes(BIG, ONE, "snapshot", 8) // 4


def test_replay_flops_skip_the_output_read():
    """73.6 MFLOP per token with the output read; a replay updates the state only: 52.6."""
    assert sc.replay_flops(BIG, 0) == 0 and sc.replay_flops(BIG, 9) == 9 * sc.replay_flops(BIG, 1)
    K = BIG.head_dim
    assert sc.replay_flops(BIG, 1) == 20 * 32 * (5 * K * K + K + K)
    assert sc.replay_flops(BIG, 1) / 1e6 == pytest.approx(52.59, abs=0.01)
    assert sc.replay_flops(BIG, 9) < 0.02 * sc.reverify_flops(BIG, 9, 4096)


def test_expected_tokens_and_plain_decoding():
    assert sc.expected_tokens_per_step(0.0, 4) == 1.0
    assert sc.expected_tokens_per_step(1.0, 4) == 5.0
    assert sc.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    plain = sc.spec_tokens_per_second(BIG, TP4, 4096, 0, 0.7)
    assert plain == pytest.approx(1.0 / costs.decode_step_seconds(BIG, TP4, 4096, 1))
    assert sc.spec_tokens_per_second(BIG, TP4, 4096, 4, 1.0) > plain > sc.spec_tokens_per_second(BIG, TP4, 4096, 4, 0.0)


def test_a_verify_step_is_one_forward_pass_of_the_whole_batch():
    B, k, L = 64, 4, 4096
    step = sc.verify_step_seconds(BIG, TP4, L, k, batch=B, strategy="replay")
    fwd = costs.step_seconds(BIG, TP4, chunks=[(k + 1, L)] * B)
    assert step == pytest.approx(fwd + sc.rollback_seconds(BIG, TP4, "replay", k, k + 1, batch=B))
    assert sc.rollback_seconds(BIG, TP4, "snapshot", k, 3, batch=B) == pytest.approx(
        B * sc.rollback_seconds(BIG, TP4, "snapshot", k, 3))
    assert sc.rollback_seconds(BIG, DP4, "snapshot", k, 3, batch=B) == pytest.approx(  # 16 per device
        16 * sc.rollback_seconds(BIG, DP4, "snapshot", k, 3))


def test_break_even_acceptance_falls_with_batch():
    """At batch 1 a verify of k+1 tokens costs little more than a decode (memory-bound), so even
    modest acceptance pays; at large batch the step is compute-bound and speculation needs more."""
    for strategy in ("snapshot", "replay"):
        be = [sc.break_even_acceptance(BIG, TP4, 4096, 4, strategy, batch=B) for B in (1, 16, 64, 256)]
        assert all(b is None or 0.0 < b < 1.0 for b in be)
        assert be[0] is not None and be[0] < 0.3
    assert sc.break_even_acceptance(BIG, TP4, 4096, 8, "replay", batch=1) < sc.break_even_acceptance(
        BIG, TP4, 4096, 8, "replay", batch=256)


def test_rollback_seconds_shapes():
    snap = [sc.rollback_seconds(BIG, TP4, "snapshot", 8, j) for j in range(1, 10)]
    assert len(set(snap)) == 1  # a copy whatever is kept
    slow = TP4.with_(name="slow replay", kernels=TP4.kernels.__class__(
        **{**TP4.kernels.__dict__, "replay": 0.001}))
    replay = [sc.rollback_seconds(BIG, slow, "replay", 8, j) for j in range(1, 10)]
    assert replay == sorted(replay) and replay[-1] > snap[0] > replay[0]


@pytest.mark.parametrize("call, match", [
    (lambda: sc.rollback_bytes(BIG, TP4, "undo", 4), "strategy='undo'"),
    (lambda: sc.rollback_bytes(BIG, TP4, "ring", 4, window=3), "window=3"),
    (lambda: sc.record_bytes_per_token(BIG, TP4, "all"), "keep='all'"),
    (lambda: sc.record_bytes_per_token(BIG, TP4, act_bytes=3), "act_bytes=3"),
    (lambda: sc.rollback_seconds(BIG, TP4, "replay", 4, 6), "kept=6"),
    (lambda: sc.rollback_seconds(BIG, TP4, "replay", 4, 2, batch=0), "batch"),
    (lambda: sc.expected_tokens_per_step(1.5, 2), "alpha=1.5"),
    (lambda: sc.replay_flops("big", 2), "cfg"),
    (lambda: sc.record_bytes_per_token(BIG, None), "deployment"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
