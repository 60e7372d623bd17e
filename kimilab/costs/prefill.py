"""Prefill time and checkpoint-copy time on the assumed accelerator: turning hits into seconds.

A prefill of ``n_new`` tokens on top of ``n_cached`` cached ones does
:func:`~kimilab.costs.flops.prefill_flops` of work and touches the weights plus the
request's cache. On the busiest rank of a :class:`~kimilab.costs.hardware.Deployment`
it takes max(FLOPs / (peak x efficiency), bytes / bandwidth). Peak FLOP/s are never
reached: :data:`PREFILL_EFFICIENCY` is OUR assumption (a round 50% of peak for large
prefill matmuls), not a measurement, and a parameter. Communication is left out.

A prefix-cache hit of h tokens turns a cold prefill of n into a prefill of n - h on
top of h cached tokens; :func:`prefill_seconds_saved` is the difference (TTFT saved).
Keeping a hybrid model's hit usable costs a state checkpoint: a copy of
:func:`~kimilab.costs.cache_bytes.checkpoint_bytes` (every byte read once and written
once), :func:`checkpoint_write_seconds`.
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs.cache_bytes import checkpoint_bytes
from kimilab.costs.flops import prefill_flops
from kimilab.costs.hardware import DEFAULT_DEPLOYMENT, Deployment, WeightModel
from kimilab.costs.cache_bytes import kv_bytes_per_token
from kimilab.costs.parallel import (kv_rank_fraction, rank_flops, rank_weight_bytes_read, request_rank_bytes,
                                    state_rank_fraction)
from kimilab.validate import check_float, check_int

__all__ = ["PREFILL_EFFICIENCY", "prefill_seconds", "prefill_seconds_saved", "checkpoint_write_seconds", "PrefillTimer"]

# Fraction of peak FLOP/s a prefill reaches: an ASSUMPTION (ours), not a measurement.
PREFILL_EFFICIENCY = 0.5


def prefill_seconds(cfg: ModelConfig, n_new: int, n_cached: int = 0,
                    deployment: Deployment = DEFAULT_DEPLOYMENT, *,
                    efficiency: float = PREFILL_EFFICIENCY, weights: WeightModel | None = None) -> float:
    """Roofline time to prefill ``n_new`` tokens on top of ``n_cached`` cached ones (one request).

    Busiest rank: max(FLOPs / (device peak x ``efficiency``), bytes / device bandwidth), with
    FLOPs from :func:`prefill_flops` split as :func:`~kimilab.costs.parallel.rank_flops`
    splits them (DP-attention keeps one request's mixers on one rank), and bytes = the
    rank's share of the weights the n_new tokens touch + the request's cache on that rank
    (cached KV read, new KV written, states). 0.0 when there is nothing to prefill.
    """
    n_new = check_int("n_new", n_new, 0, unit="tokens")
    n_cached = check_int("n_cached", n_cached, 0, unit="tokens")
    eff = check_float("efficiency", efficiency, minimum=0.0)
    if not 0.0 < eff <= 1.0:
        raise ValueError(f"efficiency={efficiency!r}: expected a fraction of peak in (0, 1]")
    if n_new == 0:
        return 0.0
    flops = rank_flops(cfg, prefill_flops(cfg, n_new, n_cached), n_new, n_new, deployment, weights)
    touched = (rank_weight_bytes_read(cfg, n_new, deployment, weights)
               + request_rank_bytes(cfg, n_cached + n_new, deployment))
    dev = deployment.device
    return max(flops / (dev.peak_flops * eff), touched / dev.hbm_bandwidth)


def prefill_seconds_saved(cfg: ModelConfig, n_tokens: int, hit: int,
                          deployment: Deployment = DEFAULT_DEPLOYMENT, *,
                          efficiency: float = PREFILL_EFFICIENCY, weights: WeightModel | None = None) -> float:
    """Prefill seconds a usable hit of ``hit`` tokens saves on an ``n_tokens`` prompt (TTFT saved)."""
    n_tokens = check_int("n_tokens", n_tokens, 0, unit="tokens")
    hit = check_int("hit", hit, 0, unit="tokens")
    if hit > n_tokens:
        raise ValueError(f"hit={hit}: expected at most n_tokens={n_tokens}")
    cold = prefill_seconds(cfg, n_tokens, 0, deployment, efficiency=efficiency, weights=weights)
    warm = prefill_seconds(cfg, n_tokens - hit, hit, deployment, efficiency=efficiency, weights=weights)
    return cold - warm


def checkpoint_write_seconds(cfg: ModelConfig, deployment: Deployment = DEFAULT_DEPLOYMENT) -> float:
    """Time to copy one state checkpoint in HBM: 2 x its bytes on the busiest rank / bandwidth.

    The copy reads and writes every byte of :func:`checkpoint_bytes` once. Under TP each rank
    copies its head shard in parallel; under DP-attention the request's rank copies it all.
    """
    per_rank = checkpoint_bytes(cfg) * state_rank_fraction(cfg, deployment)
    return 2.0 * per_rank / deployment.device.hbm_bandwidth


class PrefillTimer:
    """:func:`prefill_seconds` for many requests of one model: the same numbers, memoised.

    A trace replay asks for two prefill times per request (cold, and from its hit);
    the direct function re-derives the model's shapes on every call (~25 us). Here the
    parts that depend only on ``n_new`` (cold FLOPs, the busiest rank's share, weight
    bytes read) are computed once per ``n_new``; the cached prefix only adds attention
    pairs (``n_new * n_cached`` of them, linear in the FLOPs) and KV bytes. A test holds
    :meth:`seconds` equal to :func:`prefill_seconds`.
    """

    def __init__(self, cfg: ModelConfig, deployment: Deployment = DEFAULT_DEPLOYMENT, *,
                 efficiency: float = PREFILL_EFFICIENCY):
        eff = check_float("efficiency", efficiency, minimum=0.0)
        if not 0.0 < eff <= 1.0:
            raise ValueError(f"efficiency={efficiency!r}: expected a fraction of peak in (0, 1]")
        self.cfg, self.deployment = cfg, deployment
        self.flop_rate = deployment.device.peak_flops * eff
        self.bandwidth = deployment.device.hbm_bandwidth
        self.pair_flops = prefill_flops(cfg, 1, 1) - prefill_flops(cfg, 1, 0)  # per new x cached token
        self.kv_token_bytes = kv_bytes_per_token(cfg)
        self.kv_fraction = kv_rank_fraction(cfg, deployment)
        self.state_rank_bytes = checkpoint_bytes(cfg) * state_rank_fraction(cfg, deployment)
        self._per_new: dict = {}  # n_new -> (rank FLOPs cold, rank FLOPs per cached token, weight bytes)

    def _parts(self, n_new: int) -> tuple:
        parts = self._per_new.get(n_new)
        if parts is None:
            cfg, dep = self.cfg, self.deployment
            cold = prefill_flops(cfg, n_new, 0)
            rank_cold = rank_flops(cfg, cold, n_new, n_new, dep)
            # rank_flops is affine in the total: its slope is what one more FLOP adds on the busiest rank
            slope = rank_flops(cfg, cold + n_new * self.pair_flops, n_new, n_new, dep) - rank_cold
            parts = self._per_new[n_new] = (rank_cold, slope, rank_weight_bytes_read(cfg, n_new, dep))
        return parts

    def seconds(self, n_new: int, n_cached: int = 0) -> float:
        """:func:`prefill_seconds` (default efficiency and weights) of ``n_new`` tokens on ``n_cached``."""
        if n_new <= 0:
            if n_new == 0 and n_cached >= 0:
                return 0.0
            raise ValueError(f"n_new={n_new}, n_cached={n_cached}: expected non-negative token counts")
        rank_cold, slope, weight_bytes = self._parts(n_new)
        flops = rank_cold + slope * n_cached
        # request_rank_bytes, term for term
        touched = weight_bytes + int(round((n_cached + n_new) * self.kv_token_bytes * self.kv_fraction
                                           + self.state_rank_bytes))
        return max(flops / self.flop_rate, touched / self.bandwidth)

    def seconds_saved(self, n_tokens: int, hit: int) -> float:
        """:func:`prefill_seconds_saved`: cold prefill minus the prefill from a hit of ``hit`` tokens."""
        return self.seconds(n_tokens) - self.seconds(n_tokens - hit, hit) if hit else 0.0
