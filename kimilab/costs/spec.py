"""Speculative-decoding rollback at real sizes: the bytes each strategy keeps, replay FLOPs, step time.

A verify pass pushes k+1 tokens (the last committed one and k drafts) through every
KDA state; rejecting drafts means going back. Three ways (chapters 7 and 8):

* ``"snapshot"`` -- a copy of every KDA + conv state after each of the k+1 verified
  positions (vLLM and SGLang keep one state per draft position); rollback selects one.
* ``"replay"``   -- keep the committed state untouched plus, per verified token, a
  *record* of the projected KDA inputs; rollback replays the accepted tokens.
* ``"ring"``     -- the replay records in a fixed ring of ``window`` >= k+1 positions,
  reused every step, with the raw conv inputs of ``kernel - 1`` earlier positions
  beside them so the conv state is a pointer into the ring.

What a record holds per token and KDA layer decides the saving (:data:`RECORD_KEEPS`):

* ``"post-conv"`` -- k, v, g (H*K each), beta (H) and the raw conv inputs q|k|v (3*H*K):
  what :mod:`kimilab.spec` stores, replayable without any weight;
* ``"raw"``       -- the raw conv inputs, g and beta: k and v are recomputed through
  the short conv (and SiLU, L2 norm) before the replay;
* ``"low-rank"``  -- the raw conv inputs, beta, and the gate's low-rank input f_a(x)
  (head_dim values) instead of g: the gate is recomputed too.

States are counted at ``cfg.state_bytes`` / ``cfg.conv_bytes`` per element, records at
``act_bytes`` (default ``cfg.conv_bytes``: the activation width, bf16 at 48B).
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.cache_bytes import checkpoint_bytes
from kimilab.costs.hardware import DEFAULT_DEPLOYMENT, Deployment
from kimilab.costs.parallel import state_rank_fraction
from kimilab.costs.flops import prefill_flops
from kimilab.costs.prefill import prefill_seconds
from kimilab.kda import recurrent_kda_flops
from kimilab.validate import check_choice, check_float, check_int

__all__ = ["ROLLBACK_STRATEGIES", "RECORD_KEEPS", "REPLAY_EFFICIENCY", "record_elems_per_layer",
           "record_bytes_per_token", "conv_row_bytes", "rollback_bytes", "replay_flops", "reverify_flops",
           "rollback_seconds", "expected_tokens_per_step", "spec_tokens_per_second"]

ROLLBACK_STRATEGIES = ("snapshot", "replay", "ring")
RECORD_KEEPS = ("post-conv", "raw", "low-rank")
# Fraction of peak FLOP/s the replay kernel (a short token-by-token recurrence with the
# state held on chip) reaches: an ASSUMPTION (ours), not a measurement.
REPLAY_EFFICIENCY = 0.05


def record_elems_per_layer(cfg: ModelConfig, keep: str = "post-conv") -> int:
    """Elements one token's record holds for one KDA layer (see :data:`RECORD_KEEPS`)."""
    check_config(cfg)
    check_choice("keep", keep, RECORD_KEEPS)
    H, K = cfg.n_heads, cfg.head_dim
    raw = cfg.conv_channels  # q | k | v before the conv: 3 * H * K
    if keep == "post-conv":
        return 3 * H * K + H + raw  # k, v, g, beta + raw conv inputs
    if keep == "raw":
        return raw + H * K + H  # raw conv inputs, g, beta
    return raw + K + H  # raw conv inputs, the gate's low-rank input, beta


def _act_bytes(cfg: ModelConfig, act_bytes) -> int:
    if act_bytes is None:
        return cfg.conv_bytes
    return check_choice("act_bytes", act_bytes, (1, 2, 4, 8))


def record_bytes_per_token(cfg: ModelConfig, keep: str = "post-conv", act_bytes: int | None = None) -> int:
    """Bytes of one token's record over every KDA layer."""
    return len(cfg.kda_layers) * record_elems_per_layer(cfg, keep) * _act_bytes(cfg, act_bytes)


def conv_row_bytes(cfg: ModelConfig, act_bytes: int | None = None) -> int:
    """Bytes of one position's raw conv inputs over every KDA layer (one row of a conv state)."""
    return len(check_config(cfg).kda_layers) * cfg.conv_channels * _act_bytes(cfg, act_bytes)


def rollback_bytes(cfg: ModelConfig, strategy: str, k: int, *, keep: str = "post-conv",
                   act_bytes: int | None = None, window: int | None = None) -> int:
    """Scratch bytes one request holds for one verify of ``k`` drafts (k+1 positions).

    snapshot: (k+1) checkpoints. replay: (k+1) records. ring: ``window`` records
    (default k+1) without their conv part, plus a conv ring of window + kernel - 1 rows.
    """
    check_choice("strategy", strategy, ROLLBACK_STRATEGIES)
    k = check_int("k", k, 0, unit="draft tokens")
    if strategy == "snapshot":
        return (k + 1) * checkpoint_bytes(cfg)
    record = record_bytes_per_token(cfg, keep, act_bytes)
    if strategy == "replay":
        return (k + 1) * record
    W = k + 1 if window is None else check_int("window", window, k + 1, unit="positions, at least k+1")
    conv = conv_row_bytes(cfg, act_bytes)
    return W * (record - conv) + (W + cfg.conv_kernel - 1) * conv


def replay_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """FLOPs to replay ``n_tokens`` recurrent KDA steps in every KDA layer (conv rebuild: a copy)."""
    check_config(cfg)
    n = check_int("n_tokens", n_tokens, 0, unit="tokens")
    return len(cfg.kda_layers) * recurrent_kda_flops(n, cfg.n_heads, cfg.head_dim, cfg.head_dim)


def reverify_flops(cfg: ModelConfig, n_tokens: int, context_len: int) -> int:
    """FLOPs of the alternative: push the ``n_tokens`` accepted tokens through the whole model again."""
    return prefill_flops(cfg, n_tokens, context_len)


def rollback_seconds(cfg: ModelConfig, strategy: str, k: int, kept: int, *,
                     deployment: Deployment = DEFAULT_DEPLOYMENT, keep: str = "post-conv",
                     act_bytes: int | None = None, efficiency: float = REPLAY_EFFICIENCY) -> float:
    """Roofline time of one request's rollback work per verify step, ``kept`` of k+1 positions kept.

    snapshot: write k+1 checkpoints, then copy the chosen one back (read + write).
    replay / ring: write k+1 records, read ``kept`` of them, read and write the state once,
    and run ``kept`` recurrent steps at ``efficiency`` of peak. States and records shard
    across tensor-parallel ranks by head; bytes over HBM bandwidth, FLOPs over peak.
    """
    check_choice("strategy", strategy, ROLLBACK_STRATEGIES)
    k = check_int("k", k, 0, unit="draft tokens")
    kept = check_int("kept", kept, 1, unit="positions")
    if kept > k + 1:
        raise ValueError(f"kept={kept}: expected at most k+1={k + 1} verified positions")
    eff = check_float("efficiency", efficiency, minimum=0.0)
    if not 0.0 < eff <= 1.0:
        raise ValueError(f"efficiency={efficiency!r}: expected a fraction of peak in (0, 1]")
    share = state_rank_fraction(cfg, deployment)
    dev = deployment.device
    ckpt = checkpoint_bytes(cfg)
    if strategy == "snapshot":
        return (k + 3) * ckpt * share / dev.hbm_bandwidth
    record = record_bytes_per_token(cfg, keep, act_bytes)
    moved = (k + 1 + kept) * record + 2 * ckpt
    flops = replay_flops(cfg, kept)
    return max(moved * share / dev.hbm_bandwidth, flops * share / (dev.peak_flops * eff))


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one verify step yields when each draft is accepted with probability ``alpha``
    independently: (1 - alpha^(k+1)) / (1 - alpha) (the accepted drafts plus the target's own)."""
    a = check_float("alpha", alpha, minimum=0.0)
    if a > 1.0:
        raise ValueError(f"alpha={alpha!r}: expected an acceptance probability in [0, 1]")
    k = check_int("k", k, 0, unit="draft tokens")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def spec_tokens_per_second(cfg: ModelConfig, context_len: int, k: int, alpha: float,
                           strategy: str = "replay", *, deployment: Deployment = DEFAULT_DEPLOYMENT,
                           keep: str = "post-conv", act_bytes: int | None = None,
                           efficiency: float = REPLAY_EFFICIENCY) -> float:
    """One request's expected tokens per second with speculative decoding (drafting taken as free).

    A step verifies k+1 tokens on top of ``context_len`` cached ones (the prefill roofline,
    :func:`~kimilab.costs.prefill_seconds`), then rolls back; it yields
    :func:`expected_tokens_per_step` tokens. ``k = 0`` is plain decoding.
    """
    k = check_int("k", k, 0, unit="draft tokens")
    tokens = expected_tokens_per_step(alpha, k)
    step = prefill_seconds(cfg, k + 1, context_len, deployment)
    if k:
        kept = max(1, min(k + 1, int(round(tokens))))
        step += rollback_seconds(cfg, strategy, k, kept, deployment=deployment, keep=keep,
                                 act_bytes=act_bytes, efficiency=efficiency)
    return tokens / step
