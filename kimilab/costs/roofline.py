"""Decode as a roofline: how many requests fit, and how long one decode step takes.

A decode step reads the weights it uses once (shared by the whole batch) plus every
request's cache. On a :class:`~kimilab.costs.hardware.Deployment` every rank works in
parallel, so the step takes the *busiest rank's* max(bytes / device bandwidth,
FLOPs / device peak); what each rank holds depends on TP vs DP-attention
(:mod:`~kimilab.costs.parallel`). Writes, communication and kernel efficiency are left
out, so these are ideal bounds under the assumed hardware, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs.cache_bytes import checkpoint_bytes, kv_bytes_per_token, request_total_bytes
from kimilab.costs.flops import decode_flops_per_token
from kimilab.costs.hardware import DEFAULT_DEPLOYMENT, Deployment, WeightModel, weight_bytes_read
from kimilab.costs.parallel import (
    rank_flops, rank_weight_bytes, rank_weight_bytes_read, request_rank_bytes, requests_on_busiest_rank,
)
from kimilab.validate import check_int

__all__ = [
    "decode_step_bytes", "decode_bytes_per_token", "decode_rank_bytes", "decode_step_seconds", "max_batch",
    "DecodePoint", "decode_point", "summary",
]


def decode_step_bytes(cfg: ModelConfig, context_len: int, batch: int = 1,
                      weights: WeightModel | None = None) -> int:
    """Bytes one decode step reads, counted once for the replica: weights touched once, plus
    each request's cache (what one copy of the model reads; see :func:`decode_rank_bytes`
    for what the busiest device reads, replicas included).

    Writes (one new KV entry, the updated states) are left out; they are small beside the
    reads at long context.
    """
    batch = check_int("batch", batch, 1)
    return weight_bytes_read(cfg, batch, weights) + batch * request_total_bytes(cfg, context_len)


def decode_bytes_per_token(cfg: ModelConfig, context_len: int, batch: int = 1,
                           weights: WeightModel | None = None) -> float:
    """Bytes read per decoded token: a step's bytes shared by the ``batch`` tokens it makes."""
    return decode_step_bytes(cfg, context_len, batch, weights) / batch


def decode_rank_bytes(cfg: ModelConfig, context_len: int, batch: int = 1,
                      deployment: Deployment = DEFAULT_DEPLOYMENT,
                      weights: WeightModel | None = None) -> float:
    """Bytes the busiest rank reads in one decode step: its weight share plus its requests' caches."""
    batch = check_int("batch", batch, 1)
    busiest = requests_on_busiest_rank(batch, deployment)
    return (rank_weight_bytes_read(cfg, batch, deployment, weights)
            + busiest * request_rank_bytes(cfg, context_len, deployment))


def decode_step_seconds(cfg: ModelConfig, context_len: int, batch: int = 1,
                        deployment: Deployment = DEFAULT_DEPLOYMENT,
                        weights: WeightModel | None = None) -> float:
    """Roofline time of one decode step = each request's TPOT: the busiest rank's
    max(bytes / device bandwidth, FLOPs / device peak)."""
    step_bytes = decode_rank_bytes(cfg, context_len, batch, deployment, weights)
    busiest = requests_on_busiest_rank(batch, deployment)
    flops = rank_flops(cfg, batch * decode_flops_per_token(cfg, context_len), batch, busiest, deployment, weights)
    dev = deployment.device
    return max(step_bytes / dev.hbm_bandwidth, flops / dev.peak_flops)


def max_batch(cfg: ModelConfig, context_len: int, deployment: Deployment = DEFAULT_DEPLOYMENT,
              weights: WeightModel | None = None) -> int:
    """Requests of ``context_len`` tokens whose caches fit beside the weights (0 if none).

    Per rank: (HBM - the rank's weights) // the request's bytes on that rank. Under TP
    that is the batch (every rank holds every request); under DP-attention each rank
    holds its own requests, so it is n times that.
    """
    free = deployment.device.hbm_bytes - rank_weight_bytes(cfg, deployment, weights)
    per_request = request_rank_bytes(cfg, context_len, deployment)
    if free <= 0 or per_request <= 0:
        return 0
    per_rank = int(free // per_request)
    return per_rank if deployment.attention == "tp" else per_rank * deployment.n_devices


@dataclass(frozen=True)
class DecodePoint:
    """One decode operating point of the roofline model."""

    batch: int
    step_bytes: int  # read by one copy of the model (decode_step_bytes)
    step_seconds: float  # = TPOT seen by each request
    rank_bytes: float = 0.0  # read by the busiest device (decode_rank_bytes)

    @property
    def seconds_per_token(self) -> float:
        """Step time shared by the batch's tokens (inverse throughput)."""
        return self.step_seconds / self.batch

    @property
    def tokens_per_second(self) -> float:
        """Throughput of the deployment: tokens generated per second by the whole batch."""
        return self.batch / self.step_seconds


def decode_point(cfg: ModelConfig, context_len: int, batch: int | None = None,
                 deployment: Deployment = DEFAULT_DEPLOYMENT,
                 weights: WeightModel | None = None) -> DecodePoint:
    """The roofline at ``batch`` (default: the largest batch that fits; ValueError if none)."""
    if batch is None:
        batch = max_batch(cfg, context_len, deployment, weights)
        if batch < 1:
            raise ValueError(
                f"context_len={context_len}: not one request of {cfg.name} fits in "
                f"{deployment.hbm_bytes / 1e9:.0f} GB beside the weights "
                f"({deployment.attention} attention); pass a larger deployment")
    return DecodePoint(batch, decode_step_bytes(cfg, context_len, batch, weights),
                       decode_step_seconds(cfg, context_len, batch, deployment, weights),
                       decode_rank_bytes(cfg, context_len, batch, deployment, weights))


def summary(cfg: ModelConfig, baseline: ModelConfig, deployment: Deployment = DEFAULT_DEPLOYMENT,
            contexts=(131072, 1048576)) -> list[str]:
    """Lines of a table comparing ``cfg`` with ``baseline``: cache bytes, batch that fits, decode time.

    The last column is baseline / cfg. Throughput is tokens per second of the deployment
    at the largest batch that fits ("-" when not one request fits); TPOT is each request's
    step time at that batch.
    """
    dev = deployment.device

    def at_max(c, L, what):
        b = max_batch(c, L, deployment)
        if not b:
            return None
        p = decode_point(c, L, b, deployment)
        return p.tokens_per_second if what == "tps" else p.step_seconds * 1e3

    rows = [("KV bytes per token", lambda c: kv_bytes_per_token(c), "{:,d}"),
            ("fixed state bytes per request", lambda c: checkpoint_bytes(c), "{:,d}")]
    for L in contexts:
        rows += [(f"@{L:>9,d}: cache per request GB", lambda c, L=L: request_total_bytes(c, L) / 1e9, "{:.2f}"),
                 (f"@{L:>9,d}: largest batch", lambda c, L=L: max_batch(c, L, deployment), "{:,d}"),
                 (f"@{L:>9,d}: TPOT at batch 1 ms", lambda c, L=L: decode_step_seconds(c, L, 1, deployment) * 1e3,
                  "{:.3f}"),
                 (f"@{L:>9,d}: TPOT at largest batch ms", lambda c, L=L: at_max(c, L, "tpot"), "{:.3f}"),
                 (f"@{L:>9,d}: throughput tokens/s", lambda c, L=L: at_max(c, L, "tps"), "{:,.0f}")]
    lines = [f"deployment: {deployment.n_devices} x {dev.name}: {dev.hbm_bytes / 1e9:.0f} GB at "
             f"{dev.hbm_bandwidth / 1e12:.2f} TB/s each, {deployment.attention} attention",
             f"{'':36s}{cfg.name:>18s}{baseline.name:>18s}{'base/cfg':>10s}"]
    for label, value, fmt in rows:
        a, b = value(cfg), value(baseline)
        ratio = f"{b / a:.2f}x" if a and b is not None else "-"
        cells = [fmt.format(v) if v is not None else "-" for v in (a, b)]
        lines.append(f"{label:36s}{cells[0]:>18s}{cells[1]:>18s}{ratio:>10s}")
    return lines
