"""Speculative-decoding rollback bytes per device: what each strategy holds, what it moves per step,
and the arithmetic of a replay (the five strategies and the accounting: :mod:`kimilab.costs.spec`)."""

from __future__ import annotations

import math

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.cache_bytes import checkpoint_bytes, kda_state_bytes
from kimilab.costs.deployment import Deployment
from kimilab.costs.flops import prefill_flops
from kimilab.costs.parallel import state_heads_per_device
from kimilab.kda import recurrent_kda_flops
from kimilab.validate import check_choice, check_float, check_int

__all__ = ["ROLLBACK_STRATEGIES", "RECORD_KEEPS", "DEFAULT_RING", "record_elems_per_layer",
           "record_bytes_per_token", "conv_row_bytes", "lazy_entry_bytes", "rollback_bytes", "moved_bytes",
           "lazy_cycle", "lazy_steps", "mean_moved_bytes", "replay_flops", "lazy_flops", "reverify_flops"]

ROLLBACK_STRATEGIES = ("snapshot", "slot", "replay", "ring", "lazy-ring")
RECORD_KEEPS = ("post-conv", "raw", "low-rank")
DEFAULT_RING = 16  # vLLM's and SGLang's default ReplaySSM buffer length


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


def _per_device(cfg: ModelConfig, deployment: Deployment, elems_per_layer: int, width: int) -> int:
    mine, heads = state_heads_per_device(cfg, deployment)
    return len(cfg.kda_layers) * elems_per_layer * mine // heads * width


def record_bytes_per_token(cfg: ModelConfig, deployment: Deployment, keep: str = "post-conv",
                           act_bytes: int | None = None) -> int:
    """Bytes of one token's record over every KDA layer, on one device (its heads' share)."""
    return _per_device(cfg, deployment, record_elems_per_layer(cfg, keep), _act_bytes(cfg, act_bytes))


def conv_row_bytes(cfg: ModelConfig, deployment: Deployment, act_bytes: int | None = None) -> int:
    """Bytes of one position's raw conv inputs over every KDA layer, on one device."""
    return _per_device(check_config(cfg), deployment, cfg.conv_channels, _act_bytes(cfg, act_bytes))


def lazy_entry_bytes(cfg: ModelConfig, deployment: Deployment, act_bytes: int | None = None) -> int:
    """Bytes of one lazy-ring entry over every KDA layer, on one device: the update vector d
    (H x V) and key k (H x K) at ``act_bytes``, the gate g (H x K) at ``cfg.state_bytes``."""
    HK = check_config(cfg).n_heads * cfg.head_dim
    return (_per_device(cfg, deployment, 2 * HK, _act_bytes(cfg, act_bytes))
            + _per_device(cfg, deployment, HK, cfg.state_bytes))


def _nodes(k: int, nodes) -> int:
    return k + 1 if nodes is None else check_int("nodes", nodes, k + 1, unit="verified positions, at least k+1")


def rollback_bytes(cfg: ModelConfig, deployment: Deployment, strategy: str, k: int, *, keep: str = "post-conv",
                   act_bytes: int | None = None, window: int | None = None, ring_len: int = DEFAULT_RING,
                   nodes: int | None = None) -> int:
    """Scratch bytes one request holds on one device beyond its own state, for verifies of ``k``
    drafts (``nodes`` positions: default k+1; a tree's node count).

    snapshot: a state per position. slot: one fewer (the request's own state is slot 0).
    replay: a record per position. ring: ``window`` records (default ``nodes``) without their
    conv part, plus a conv ring of window + kernel - 1 rows. lazy-ring: ``ring_len`` entries
    plus a conv ring of nodes + kernel - 1 rows.
    """
    check_choice("strategy", strategy, ROLLBACK_STRATEGIES)
    k = check_int("k", k, 0, unit="draft tokens")
    n = _nodes(k, nodes)
    history = cfg.conv_kernel - 1
    if strategy in ("snapshot", "slot"):
        return (n if strategy == "snapshot" else n - 1) * checkpoint_bytes(cfg, deployment)
    conv = conv_row_bytes(cfg, deployment, act_bytes)
    if strategy == "lazy-ring":
        L = check_int("ring_len", ring_len, n, unit="entries, at least the verified positions")
        return L * lazy_entry_bytes(cfg, deployment, act_bytes) + (n + history) * conv
    record = record_bytes_per_token(cfg, deployment, keep, act_bytes)
    if strategy == "replay":
        return n * record
    W = n if window is None else check_int("window", window, n, unit="positions, at least k+1")
    return W * (record - conv) + (W + history) * conv


def moved_bytes(cfg: ModelConfig, deployment: Deployment, strategy: str, k: int, kept: int, *,
                nodes: int | None = None, history: int = 0, flush: bool = False, gathered: bool = False,
                keep: str = "post-conv", act_bytes: int | None = None) -> int:
    """Bytes one request reads and writes on one device in one verify step, the verify's read of
    the committed state included (plain decoding: 2 states).

    ``nodes`` positions verified (default k+1), ``kept`` of them accepted (the root included).
    Lazy ring: ``history`` committed entries read before the verify, ``flush`` if the state is
    written back this step. ``gathered``: the accepted path is not the window's first positions
    (a tree), so ring and lazy ring move its rows together first.

    snapshot: (n + 3) states. slot: n + 1 states. replay: 3 states + (n + kept) records.
    ring: 3 states + n (record - conv row + conv row) + kept (record - conv row).
    lazy-ring: 1 state + history entries + n (entry + conv row) + a state's KDA part per flush;
    a gathered path reads and writes its entries and conv rows once more.
    """
    check_choice("strategy", strategy, ROLLBACK_STRATEGIES)
    k = check_int("k", k, 0, unit="draft tokens")
    n = _nodes(k, nodes)
    kept = check_int("kept", kept, 1, unit="positions")
    if kept > n:
        raise ValueError(f"kept={kept}: expected at most {n} verified positions")
    S = checkpoint_bytes(cfg, deployment)
    if strategy == "snapshot":
        return (n + 3) * S
    if strategy == "slot":
        return (n + 1) * S
    conv = conv_row_bytes(cfg, deployment, act_bytes)
    if strategy == "lazy-ring":
        entry = lazy_entry_bytes(cfg, deployment, act_bytes)
        h = check_int("history", history, 0, unit="entries")
        return (S + h * entry + n * (entry + conv) + (kda_state_bytes(cfg, deployment) if flush else 0)
                + (2 * kept * (entry + conv) if gathered else 0))
    record = record_bytes_per_token(cfg, deployment, keep, act_bytes)
    if strategy == "replay":
        return 3 * S + (n + kept) * record
    return 3 * S + n * record + kept * (record - conv) + (2 * kept * conv if gathered else 0)


def lazy_cycle(nodes: int, ring_len: int, tokens_per_step: float) -> tuple[float, float]:
    """(mean history entries read per step, write-backs per step) of a lazy ring of ``ring_len``
    entries under verifies of ``nodes`` positions yielding ``tokens_per_step`` each, in steady state.

    A step folds its history h and, when h + nodes > ring_len, writes the state back and empties
    the ring; the ring then regrows by tokens_per_step a step. So the cursor runs tau, 2 tau,
    ..., m tau with m = floor((ring_len - nodes) / tau) + 1 steps per write-back, and the mean
    history is tau (m + 1) / 2. (The fluid limit of the random cursor the tests measure.)
    """
    n = check_int("nodes", nodes, 1)
    L = check_int("ring_len", ring_len, n, unit="entries, at least the verified positions")
    tau = check_float("tokens_per_step", tokens_per_step, minimum=1.0)
    m = math.floor((L - n) / tau) + 1
    return tau * (m + 1) / 2, 1.0 / m


def lazy_steps(emitted, nodes: int, ring_len: int) -> list[tuple[int, bool]]:
    """(history read, written back?) of each step of a lazy ring whose steps emitted these token
    counts: the discrete walk of the cursor that :func:`lazy_cycle` averages (before a verify of
    ``nodes`` positions the ring writes back when cursor + nodes > ring_len)."""
    n = check_int("nodes", nodes, 1)
    L = check_int("ring_len", ring_len, n, unit="entries, at least the verified positions")
    cursor, out = 0, []
    for i, e in enumerate(emitted):
        flush = cursor + n > L
        out.append((cursor, flush))
        cursor = (0 if flush else cursor) + check_int(f"emitted[{i}]", e, 1, unit="tokens")
    return out


def mean_moved_bytes(cfg: ModelConfig, deployment: Deployment, strategy: str, k: int, kept: int, *,
                     nodes: int | None = None, ring_len: int = DEFAULT_RING, tokens_per_step: float | None = None,
                     gathered: bool = False, keep: str = "post-conv", act_bytes: int | None = None) -> float:
    """:func:`moved_bytes` per step in steady state: for the lazy ring, with the mean history and the
    write-backs per step of :func:`lazy_cycle` at ``tokens_per_step`` (default ``kept``)."""
    n = _nodes(check_int("k", k, 0, unit="draft tokens"), nodes)
    if strategy != "lazy-ring":
        return float(moved_bytes(cfg, deployment, strategy, k, kept, nodes=n, gathered=gathered, keep=keep,
                                 act_bytes=act_bytes))
    h, rate = lazy_cycle(n, ring_len, float(kept if tokens_per_step is None else tokens_per_step))
    base = moved_bytes(cfg, deployment, strategy, k, kept, nodes=n, gathered=gathered, act_bytes=act_bytes)
    return base + h * lazy_entry_bytes(cfg, deployment, act_bytes) + rate * kda_state_bytes(cfg, deployment)


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


def lazy_flops(cfg: ModelConfig, nodes: int, history: int, flush: bool = False) -> int:
    """FLOPs (whole model) a lazy ring adds to a verify of ``nodes`` positions over ``history``
    entries: each position reads the history with its query and key, 2 (K + V) multiply-adds
    per entry each, without building the state; a flush folds the history, 2 K V per entry."""
    check_config(cfg)
    n = check_int("nodes", nodes, 1)
    h = check_int("history", history, 0, unit="entries")
    K = V = cfg.head_dim
    per_head = 2 * 2 * n * h * (K + V) + (2 * h * K * V if flush else 0)
    return len(cfg.kda_layers) * cfg.n_heads * per_head


def reverify_flops(cfg: ModelConfig, n_tokens: int, context_len: int) -> int:
    """FLOPs of the alternative: push the ``n_tokens`` accepted tokens through the whole model again."""
    return prefill_flops(cfg, n_tokens, context_len)

