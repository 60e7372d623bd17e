"""The rollback cost model (kimilab.costs.spec): bytes per device held and moved by each of the five
strategies at 48B, replay FLOPs, acceptance notions, and a verify step of a batch as one forward pass."""

import pytest

from kimilab import costs
from kimilab.config import kimi_linear_48b as BIG, tiny
from kimilab.costs import spec as sc

ONE, TP4, DP4 = costs.ONE_H200, costs.VLLM_TP4_H200, costs.DP4_EP4_H200
S_TP4 = costs.checkpoint_bytes(BIG, TP4)


def test_record_sizes_from_shapes_and_per_device():
    H, K, C = BIG.n_heads, BIG.head_dim, BIG.conv_channels
    assert sc.record_elems_per_layer(BIG, "post-conv") == 3 * H * K + H + C
    assert sc.record_elems_per_layer(BIG, "raw") == C + H * K + H
    assert sc.record_elems_per_layer(BIG, "low-rank") == C + K + H
    assert sc.record_bytes_per_token(BIG, ONE) == 20 * (3 * H * K + H + C) * 2  # bf16 activations by default
    assert sc.record_bytes_per_token(BIG, TP4) == sc.record_bytes_per_token(BIG, ONE) // 4  # shards by head
    assert sc.conv_row_bytes(tiny, costs.LOCAL) == len(tiny.kda_layers) * tiny.conv_channels * 8
    assert sc.lazy_entry_bytes(BIG, ONE) == 20 * H * K * (2 + 2 + 4)  # d, k in bf16, g in fp32


def test_held_bytes_per_strategy_and_device():
    for dep in (ONE, TP4):
        S = costs.checkpoint_bytes(BIG, dep)
        assert sc.rollback_bytes(BIG, dep, "snapshot", 8) == 9 * S
        assert sc.rollback_bytes(BIG, dep, "slot", 8) == 8 * S  # the request's own state is slot 0
        for strategy in ("replay", "ring"):
            assert 9 * S / sc.rollback_bytes(BIG, dep, strategy, 8, act_bytes=2) >= 20
        assert sc.rollback_bytes(BIG, dep, "lazy-ring", 8, ring_len=32) > sc.rollback_bytes(BIG, dep, "lazy-ring", 8)
    assert sc.rollback_bytes(BIG, ONE, "ring", 8, window=12) > sc.rollback_bytes(BIG, ONE, "ring", 8)
    assert sc.rollback_bytes(BIG, TP4, "snapshot", 8) == sc.rollback_bytes(BIG, ONE, "snapshot", 8) // 4
    # trees: snapshots grow with the nodes, replay's records too, the lazy ring only by its conv rows
    assert sc.rollback_bytes(BIG, TP4, "snapshot", 3, nodes=15) == 15 * S_TP4


def test_moved_bytes_rank_the_strategies():
    """At k = 1 slot selection moves less than replay (3 states vs 3 states + records); from k = 2 on,
    replay moves less; the lazy ring moves about one state, less than plain decoding's two."""
    moved = {s: sc.moved_bytes(BIG, TP4, s, 1, 2) for s in ("snapshot", "slot", "replay", "ring")}
    assert moved["snapshot"] == 5 * S_TP4 and moved["slot"] == 3 * S_TP4
    assert moved["slot"] < moved["ring"] < moved["replay"] < moved["snapshot"]
    assert sc.moved_bytes(BIG, TP4, "replay", 2, 3) < sc.moved_bytes(BIG, TP4, "slot", 2, 3)
    lazy = sc.moved_bytes(BIG, TP4, "lazy-ring", 4, 3, history=6)
    assert S_TP4 < lazy < 2 * S_TP4
    flushed = sc.moved_bytes(BIG, TP4, "lazy-ring", 4, 3, history=6, flush=True)
    assert flushed - lazy == costs.kda_state_bytes(BIG, TP4)


def test_replay_flops_skip_the_output_read():
    """73.6 MFLOP per token with the output read; a replay updates the state only: 52.6."""
    assert sc.replay_flops(BIG, 0) == 0 and sc.replay_flops(BIG, 9) == 9 * sc.replay_flops(BIG, 1)
    K = BIG.head_dim
    assert sc.replay_flops(BIG, 1) == 20 * 32 * (5 * K * K + K + K)
    assert sc.replay_flops(BIG, 1) / 1e6 == pytest.approx(52.59, abs=0.01)
    assert sc.replay_flops(BIG, 9) < 0.02 * sc.reverify_flops(BIG, 9, 4096)


def test_acceptance_notions_and_their_conversion():
    assert sc.expected_tokens_per_step(0.0, 4) == 1.0
    assert sc.expected_tokens_per_step(1.0, 4) == 5.0
    assert sc.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert sc.accepted_fraction(0.5, 2) == pytest.approx((0.5 + 0.25) / 2)
    for a in (0.1, 0.6, 0.95):
        assert sc.alpha_from_accepted_fraction(sc.accepted_fraction(a, 4), 4) == pytest.approx(a, abs=1e-9)
    # a tree: a node of w children continues with 1 - (1 - a)^w; a chain is widths (1, ...)
    assert sc.expected_tokens_per_step_tree(0.6, (1, 1, 1)) == pytest.approx(sc.expected_tokens_per_step(0.6, 3))
    assert sc.expected_tokens_per_step_tree(0.5, (2,)) == pytest.approx(1.75)
    assert sc.expected_tokens_per_step_tree([0.8, 0.4], (1, 1)) == pytest.approx(1 + 0.8 + 0.32)


def test_lazy_cycle():
    assert sc.lazy_cycle(5, 5, 2.0) == (2.0, 1.0)  # the shortest ring writes back every step
    h, rate = sc.lazy_cycle(5, 16, 2.0)  # cursor 2, 4, ..., 12: flush when it passes 11
    assert rate == pytest.approx(1 / 6) and h == pytest.approx(7.0)


def test_a_verify_step_is_one_forward_pass_of_the_whole_batch():
    B, k, L = 64, 4, 4096
    step = sc.verify_step_seconds(BIG, TP4, L, k, batch=B, strategy="replay")
    fwd = costs.step_seconds(BIG, TP4, chunks=[(k + 1, L)] * B)
    assert step == pytest.approx(fwd + sc.rollback_seconds(BIG, TP4, "replay", k, k + 1, batch=B))
    assert sc.rollback_seconds(BIG, TP4, "snapshot", k, 3, batch=B) == pytest.approx(
        B * sc.rollback_seconds(BIG, TP4, "snapshot", k, 3))
    assert sc.rollback_seconds(BIG, DP4, "snapshot", k, 3, batch=B) == pytest.approx(  # 16 per device
        16 * sc.rollback_seconds(BIG, DP4, "snapshot", k, 3))
    assert sc.rollback_seconds(BIG, TP4, "lazy-ring", k, 3, batch=B) < 0  # it writes the state rarely
    tree = sc.verify_step_seconds(BIG, TP4, L, 2, batch=B, strategy="slot", widths=(2, 2))
    assert tree > sc.verify_step_seconds(BIG, TP4, L, 2, batch=B, strategy="slot")


def test_break_even_acceptance_over_batch():
    """Low at batch 1 (the step is mostly fixed overhead), higher at 16 (the verify's tokens touch many
    more experts than the decode's), lower again at 64 (both steps read nearly every expert), rising
    from 256 on (the GEMMs become compute-bound): not monotone in batch."""
    be = {B: sc.break_even_acceptance(BIG, TP4, 4096, 4, "replay", batch=B) for B in (1, 16, 64, 256, 512)}
    assert all(0.0 < b < 1.0 for b in be.values())
    assert be[64] < be[16] and be[1] < be[16] and be[64] < be[256] < be[512]
    for B in (1, 64):
        order = [sc.break_even_acceptance(BIG, TP4, 4096, 4, s, batch=B) for s in ("lazy-ring", "replay", "snapshot")]
        assert order == sorted(order)


def test_rollback_seconds_shapes():
    snap = [sc.rollback_seconds(BIG, TP4, "snapshot", 8, j) for j in range(1, 10)]
    assert len(set(snap)) == 1  # a copy whatever is kept
    slow = TP4.with_(name="slow replay", kernels=TP4.kernels.__class__(
        **{**TP4.kernels.__dict__, "replay": 0.002}))
    replay = [sc.rollback_seconds(BIG, slow, "replay", 8, j) for j in range(1, 10)]
    assert replay == sorted(replay) and replay[-1] > snap[0] > replay[0]


@pytest.mark.parametrize("call, match", [
    (lambda: sc.rollback_bytes(BIG, TP4, "undo", 4), "strategy='undo'"),
    (lambda: sc.rollback_bytes(BIG, TP4, "ring", 4, window=3), "window=3"),
    (lambda: sc.rollback_bytes(BIG, TP4, "lazy-ring", 4, ring_len=3), "ring_len=3"),
    (lambda: sc.record_bytes_per_token(BIG, TP4, "all"), "keep='all'"),
    (lambda: sc.record_bytes_per_token(BIG, TP4, act_bytes=3), "act_bytes=3"),
    (lambda: sc.rollback_seconds(BIG, TP4, "replay", 4, 6), "kept=6"),
    (lambda: sc.rollback_seconds(BIG, TP4, "replay", 4, 2, batch=0), "batch"),
    (lambda: sc.moved_bytes(BIG, TP4, "slot", 2, 1, nodes=2), "nodes=2"),
    (lambda: sc.expected_tokens_per_step(1.5, 2), "alpha=1.5"),
    (lambda: sc.expected_tokens_per_step_tree([0.5], (1, 1)), "alphas"),
    (lambda: sc.verify_step_seconds(BIG, TP4, 4096, 3, widths=(2, 2)), "widths"),
    (lambda: sc.replay_flops("big", 2), "cfg"),
    (lambda: sc.record_bytes_per_token(BIG, None), "deployment"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
