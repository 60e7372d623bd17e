"""The rollback cost model (kimilab.costs.spec): bytes per strategy at 48B, replay FLOPs, tokens/s."""

import pytest

from kimilab import costs
from kimilab.config import kimi_linear_48b as BIG, tiny
from kimilab.costs import spec as sc


def test_record_sizes_from_shapes():
    H, K, C = BIG.n_heads, BIG.head_dim, BIG.conv_channels
    assert sc.record_elems_per_layer(BIG, "post-conv") == 3 * H * K + H + C
    assert sc.record_elems_per_layer(BIG, "raw") == C + H * K + H
    assert sc.record_elems_per_layer(BIG, "low-rank") == C + K + H
    assert sc.record_bytes_per_token(BIG) == 20 * (3 * H * K + H + C) * 2  # bf16 activations by default
    assert sc.conv_row_bytes(tiny) == len(tiny.kda_layers) * tiny.conv_channels * 8


def test_replay_and_ring_keep_at_least_20x_less_than_snapshots_at_k8_bf16():
    snap = sc.rollback_bytes(BIG, "snapshot", 8)
    assert snap == 9 * costs.checkpoint_bytes(BIG)
    for strategy in ("replay", "ring"):
        assert snap / sc.rollback_bytes(BIG, strategy, 8, act_bytes=2) >= 20
    assert snap / sc.rollback_bytes(BIG, "replay", 8, act_bytes=4) >= 20  # fp32: borderline, still >= 20
    assert sc.rollback_bytes(BIG, "ring", 8, window=12) > sc.rollback_bytes(BIG, "ring", 8)


def test_replay_flops_are_a_sliver_of_a_reverify():
    assert sc.replay_flops(BIG, 0) == 0
    assert sc.replay_flops(BIG, 9) == 9 * sc.replay_flops(BIG, 1)
    assert sc.replay_flops(BIG, 9) < 0.02 * sc.reverify_flops(BIG, 9, 4096)


def test_expected_tokens_and_plain_decoding():
    assert sc.expected_tokens_per_step(0.0, 4) == 1.0
    assert sc.expected_tokens_per_step(1.0, 4) == 5.0
    assert sc.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    plain = sc.spec_tokens_per_second(BIG, 4096, 0, 0.7)
    assert plain == pytest.approx(1.0 / costs.prefill_seconds(BIG, 1, 4096))
    assert sc.spec_tokens_per_second(BIG, 4096, 4, 1.0) > plain > sc.spec_tokens_per_second(BIG, 4096, 4, 0.0)


def test_rollback_seconds_shapes():
    snap = [sc.rollback_seconds(BIG, "snapshot", 8, j) for j in range(1, 10)]
    assert len(set(snap)) == 1  # a copy whatever is kept
    replay = [sc.rollback_seconds(BIG, "replay", 8, j, efficiency=0.001) for j in range(1, 10)]
    assert replay == sorted(replay) and replay[-1] > snap[0] > replay[0]


@pytest.mark.parametrize("call, match", [
    (lambda: sc.rollback_bytes(BIG, "undo", 4), "strategy='undo'"),
    (lambda: sc.rollback_bytes(BIG, "ring", 4, window=3), "window=3"),
    (lambda: sc.record_bytes_per_token(BIG, "all"), "keep='all'"),
    (lambda: sc.record_bytes_per_token(BIG, act_bytes=3), "act_bytes=3"),
    (lambda: sc.rollback_seconds(BIG, "replay", 4, 6), "kept=6"),
    (lambda: sc.rollback_seconds(BIG, "replay", 4, 2, efficiency=0.0), "efficiency"),
    (lambda: sc.expected_tokens_per_step(1.5, 2), "alpha=1.5"),
    (lambda: sc.replay_flops("big", 2), "cfg"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
