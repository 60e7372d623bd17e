"""Speculative-decoding rollback on one deployment: the bytes each strategy keeps per device, replay
FLOPs, and what a verify step costs a whole batch.

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
  what :mod:`kimilab.speculative` stores, replayable without any weight;
* ``"raw"``       -- the raw conv inputs, g and beta: k and v are recomputed through
  the short conv (and SiLU, L2 norm) before the replay;
* ``"low-rank"``  -- the raw conv inputs, beta, and the gate's low-rank input f_a(x)
  (head_dim values) instead of g: the gate is recomputed too.

States are counted at ``cfg.state_bytes`` / ``cfg.conv_bytes`` per element, records at
``act_bytes`` (default ``cfg.conv_bytes``: the activation width, bf16 at 48B). Everything is
per device of the deployment: states and records shard by KDA head under tensor
parallelism, like the states themselves. A verify step of B requests is ONE forward pass
(:func:`~kimilab.costs.steptime.step_seconds` with B chunks of k+1 tokens), whose weight
read -- the experts the B(k+1) tokens route to, uniform routing assumed
(:class:`~kimilab.config.WeightModel`) -- is shared; rollback work is per request.
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.cache_bytes import checkpoint_bytes
from kimilab.costs.deployment import Deployment
from kimilab.costs.flops import prefill_flops
from kimilab.costs.parallel import requests_on_busiest_device, state_heads_per_device
from kimilab.costs.steptime import decode_step_seconds, step_seconds
from kimilab.kda import recurrent_kda_flops
from kimilab.validate import check_choice, check_float, check_int

__all__ = ["ROLLBACK_STRATEGIES", "RECORD_KEEPS", "record_elems_per_layer", "record_bytes_per_token",
           "conv_row_bytes", "rollback_bytes", "replay_flops", "reverify_flops", "rollback_seconds",
           "expected_tokens_per_step", "verify_step_seconds", "spec_tokens_per_second", "break_even_acceptance"]

ROLLBACK_STRATEGIES = ("snapshot", "replay", "ring")
RECORD_KEEPS = ("post-conv", "raw", "low-rank")


def record_elems_per_layer(cfg: ModelConfig, keep: str = "post-conv") -> int:
    """Elements one token's record holds for one KDA layer, whole model (see :data:`RECORD_KEEPS`)."""
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


def _share(cfg: ModelConfig, deployment: Deployment) -> tuple[int, int]:
    return state_heads_per_device(cfg, deployment)


def record_bytes_per_token(cfg: ModelConfig, deployment: Deployment, keep: str = "post-conv",
                           act_bytes: int | None = None) -> int:
    """Bytes of one token's record over every KDA layer, on one device (its heads' share)."""
    mine, heads = _share(cfg, deployment)
    elems = len(cfg.kda_layers) * record_elems_per_layer(cfg, keep)
    return elems * mine // heads * _act_bytes(cfg, act_bytes)


def conv_row_bytes(cfg: ModelConfig, deployment: Deployment, act_bytes: int | None = None) -> int:
    """Bytes of one position's raw conv inputs over every KDA layer, on one device."""
    mine, heads = _share(cfg, deployment)
    return len(check_config(cfg).kda_layers) * cfg.conv_channels * mine // heads * _act_bytes(cfg, act_bytes)


def rollback_bytes(cfg: ModelConfig, deployment: Deployment, strategy: str, k: int, *, keep: str = "post-conv",
                   act_bytes: int | None = None, window: int | None = None) -> int:
    """Scratch bytes one request holds on one device for one verify of ``k`` drafts (k+1 positions).

    snapshot: (k+1) checkpoints. replay: (k+1) records. ring: ``window`` records
    (default k+1) without their conv part, plus a conv ring of window + kernel - 1 rows.
    """
    check_choice("strategy", strategy, ROLLBACK_STRATEGIES)
    k = check_int("k", k, 0, unit="draft tokens")
    if strategy == "snapshot":
        return (k + 1) * checkpoint_bytes(cfg, deployment)
    record = record_bytes_per_token(cfg, deployment, keep, act_bytes)
    if strategy == "replay":
        return (k + 1) * record
    W = k + 1 if window is None else check_int("window", window, k + 1, unit="positions, at least k+1")
    conv = conv_row_bytes(cfg, deployment, act_bytes)
    return W * (record - conv) + (W + cfg.conv_kernel - 1) * conv


def replay_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """FLOPs (whole model) to replay ``n_tokens`` recurrent KDA steps in every KDA layer.

    A replay updates the state only (the outputs were computed in the verify pass), so it
    counts the delta-rule update without the output read (S^T q and the scaling of q): per
    head and token the decay (K V), the read-back S^T k (2 K V), v - S^T k (V), beta k (K) and
    the rank-1 add (2 K V). The conv is rebuilt by a copy.
    """
    check_config(cfg)
    n = check_int("n_tokens", n_tokens, 0, unit="tokens")
    K = V = cfg.head_dim
    full = recurrent_kda_flops(n, cfg.n_heads, K, V)
    output_read = n * cfg.n_heads * (2 * K * V + K)
    return len(cfg.kda_layers) * (full - output_read)


def reverify_flops(cfg: ModelConfig, n_tokens: int, context_len: int) -> int:
    """FLOPs of the alternative: push the ``n_tokens`` accepted tokens through the whole model again."""
    return prefill_flops(cfg, n_tokens, context_len)


def rollback_seconds(cfg: ModelConfig, deployment: Deployment, strategy: str, k: int, kept: int, *,
                     batch: int = 1, keep: str = "post-conv", act_bytes: int | None = None) -> float:
    """Time of the rollback work of a verify step of ``batch`` requests, ``kept`` of k+1 positions kept.

    snapshot (SGLang's copy-back): write k+1 checkpoints, then copy the chosen one back
    (read + write). replay / ring: write k+1 records, read ``kept`` of them, read and write
    the state once, and run ``kept`` recurrent steps at the deployment's replay efficiency.
    Bytes over the busiest device's HBM bandwidth, FLOPs over its peak.
    """
    check_choice("strategy", strategy, ROLLBACK_STRATEGIES)
    k = check_int("k", k, 0, unit="draft tokens")
    kept = check_int("kept", kept, 1, unit="positions")
    if kept > k + 1:
        raise ValueError(f"kept={kept}: expected at most k+1={k + 1} verified positions")
    on_device = requests_on_busiest_device(check_int("batch", batch, 1), deployment)
    dev, kern = deployment.device, deployment.kernels
    bw = dev.hbm_bandwidth * kern.bandwidth
    ckpt = checkpoint_bytes(cfg, deployment)
    if strategy == "snapshot":
        return on_device * (k + 3) * ckpt / bw
    record = record_bytes_per_token(cfg, deployment, keep, act_bytes)
    moved = (k + 1 + kept) * record + 2 * ckpt
    mine, heads = _share(cfg, deployment)
    flops = replay_flops(cfg, kept) * mine / heads
    return on_device * max(moved / bw, flops / (dev.peak_flops * kern.replay))


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one verify step yields when each draft position is accepted with probability ``alpha``,
    independently, given all before it were: (1 - alpha^(k+1)) / (1 - alpha) (the accepted
    drafts plus the target's own token). ``alpha`` is the per-position acceptance probability;
    the accepted fraction of drafts is (that - 1) / k."""
    a = check_float("alpha", alpha, minimum=0.0)
    if a > 1.0:
        raise ValueError(f"alpha={alpha!r}: expected an acceptance probability in [0, 1]")
    k = check_int("k", k, 0, unit="draft tokens")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def verify_step_seconds(cfg: ModelConfig, deployment: Deployment, context_len: int, k: int, *,
                        batch: int = 1, strategy: str = "replay", kept: int | None = None,
                        keep: str = "post-conv", act_bytes: int | None = None) -> float:
    """One speculative step of ``batch`` requests: ONE forward pass over their k+1 tokens each,
    then each request's rollback (``kept`` positions, default all k+1). ``k = 0`` is a plain decode."""
    L = check_int("context_len", context_len, 0, unit="tokens")
    k = check_int("k", k, 0, unit="draft tokens")
    batch = check_int("batch", batch, 1)
    if k == 0:
        return decode_step_seconds(cfg, deployment, L, batch)
    step = step_seconds(cfg, deployment, chunks=[(k + 1, L)] * batch)
    return step + rollback_seconds(cfg, deployment, strategy, k, k + 1 if kept is None else kept, batch=batch,
                                   keep=keep, act_bytes=act_bytes)


def spec_tokens_per_second(cfg: ModelConfig, deployment: Deployment, context_len: int, k: int, alpha: float,
                           strategy: str = "replay", *, batch: int = 1, keep: str = "post-conv",
                           act_bytes: int | None = None) -> float:
    """One request's expected tokens per second with speculative decoding in a batch of ``batch``
    (drafting taken as free): :func:`expected_tokens_per_step` tokens per :func:`verify_step_seconds`."""
    tokens = expected_tokens_per_step(alpha, k)
    kept = max(1, min(k + 1, int(round(tokens))))
    return tokens / verify_step_seconds(cfg, deployment, context_len, k, batch=batch, strategy=strategy, kept=kept,
                                        keep=keep, act_bytes=act_bytes)


def break_even_acceptance(cfg: ModelConfig, deployment: Deployment, context_len: int, k: int,
                          strategy: str = "replay", *, batch: int = 1, keep: str = "post-conv",
                          act_bytes: int | None = None) -> float | None:
    """The per-position acceptance ``alpha`` above which speculation beats plain decoding at this
    batch (bisection, to 1e-4); None if even alpha = 1 does not pay."""
    plain = spec_tokens_per_second(cfg, deployment, context_len, 0, 0.0, batch=batch)
    kw = dict(strategy=strategy, batch=batch, keep=keep, act_bytes=act_bytes)
    if spec_tokens_per_second(cfg, deployment, context_len, k, 1.0, **kw) <= plain:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        if spec_tokens_per_second(cfg, deployment, context_len, k, mid, **kw) > plain:
            hi = mid
        else:
            lo = mid
    return hi
