"""Decode as a roofline: how many requests fit, and how long one decode step takes.

A decode step reads the weights it uses once (shared by the whole batch) plus every
request's cache, and takes max(bytes / bandwidth, FLOPs / peak) on a
:class:`~kimilab.costs.hardware.Deployment`. Writes and kernel efficiency are left
out, so these are ideal bounds under the assumed hardware, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs.cache_bytes import checkpoint_bytes, kv_bytes_per_token, request_total_bytes
from kimilab.costs.flops import decode_flops_per_token
from kimilab.costs.hardware import DEFAULT_DEPLOYMENT, Deployment, WeightModel, weight_bytes, weight_bytes_read
from kimilab.validate import check_int

__all__ = [
    "decode_step_bytes", "decode_bytes_per_token", "decode_step_seconds", "max_batch",
    "DecodePoint", "decode_point", "summary",
]


def decode_step_bytes(cfg: ModelConfig, context_len: int, batch: int = 1,
                      weights: WeightModel | None = None) -> int:
    """Bytes one decode step reads: the weights it touches once, plus each request's cache.

    Writes (one new KV entry, the updated states) are left out; they are small beside the
    reads at long context.
    """
    batch = check_int("batch", batch, 1)
    return weight_bytes_read(cfg, batch, weights) + batch * request_total_bytes(cfg, context_len)


def decode_bytes_per_token(cfg: ModelConfig, context_len: int, batch: int = 1,
                           weights: WeightModel | None = None) -> float:
    """Bytes read per decoded token: a step's bytes shared by the ``batch`` tokens it makes."""
    return decode_step_bytes(cfg, context_len, batch, weights) / batch


def decode_step_seconds(cfg: ModelConfig, context_len: int, batch: int = 1,
                        deployment: Deployment = DEFAULT_DEPLOYMENT,
                        weights: WeightModel | None = None) -> float:
    """Roofline time of one decode step = each request's TPOT: max(bytes/BW, FLOPs/peak)."""
    step_bytes = decode_step_bytes(cfg, context_len, batch, weights)
    step_flops = batch * decode_flops_per_token(cfg, context_len)
    return max(step_bytes / deployment.bandwidth, step_flops / deployment.peak_flops)


def max_batch(cfg: ModelConfig, context_len: int, deployment: Deployment = DEFAULT_DEPLOYMENT,
              weights: WeightModel | None = None) -> int:
    """Requests of ``context_len`` tokens whose caches fit beside the weights (0 if none)."""
    free = deployment.hbm_bytes - weight_bytes(cfg, weights)
    per_request = request_total_bytes(cfg, context_len)
    if free <= 0 or per_request <= 0:
        return 0
    return int(free // per_request)


@dataclass(frozen=True)
class DecodePoint:
    """One decode operating point of the roofline model."""

    batch: int
    step_bytes: int
    step_seconds: float  # = TPOT seen by each request

    @property
    def seconds_per_token(self) -> float:
        """Step time shared by the batch's tokens (inverse throughput)."""
        return self.step_seconds / self.batch

    @property
    def tokens_per_second(self) -> float:
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
                f"{deployment.hbm_bytes / 1e9:.0f} GB beside the weights; pass a larger deployment")
    return DecodePoint(batch, decode_step_bytes(cfg, context_len, batch, weights),
                       decode_step_seconds(cfg, context_len, batch, deployment, weights))


def summary(cfg: ModelConfig, baseline: ModelConfig, deployment: Deployment = DEFAULT_DEPLOYMENT,
            contexts=(131072, 1048576)) -> list[str]:
    """Lines of a table comparing ``cfg`` with ``baseline``: cache bytes, batch that fits, decode time.

    The last column is baseline / cfg. Time per token is the step time at the largest
    batch that fits, shared by its tokens ("-" when not one request fits).
    """
    dev = deployment.device

    def per_token_ms(c, L):
        b = max_batch(c, L, deployment)
        return decode_point(c, L, b, deployment).seconds_per_token * 1e3 if b else None

    rows = [("KV bytes per token", lambda c: kv_bytes_per_token(c), "{:,d}"),
            ("fixed state bytes per request", lambda c: checkpoint_bytes(c), "{:,d}")]
    for L in contexts:
        rows += [(f"@{L:>9,d}: cache per request GB", lambda c, L=L: request_total_bytes(c, L) / 1e9, "{:.2f}"),
                 (f"@{L:>9,d}: largest batch", lambda c, L=L: max_batch(c, L, deployment), "{:,d}"),
                 (f"@{L:>9,d}: TPOT at batch 1 ms", lambda c, L=L: decode_step_seconds(c, L, 1, deployment) * 1e3,
                  "{:.3f}"),
                 (f"@{L:>9,d}: time per token ms", lambda c, L=L: per_token_ms(c, L), "{:.3f}")]
    lines = [f"deployment: {deployment.n_devices} x {dev.name}: {dev.hbm_bytes / 1e9:.0f} GB at "
             f"{dev.hbm_bandwidth / 1e12:.2f} TB/s each",
             f"{'':36s}{cfg.name:>18s}{baseline.name:>18s}{'base/cfg':>10s}"]
    for label, value, fmt in rows:
        a, b = value(cfg), value(baseline)
        ratio = f"{b / a:.2f}x" if a and b is not None else "-"
        cells = [fmt.format(v) if v is not None else "-" for v in (a, b)]
        lines.append(f"{label:36s}{cells[0]:>18s}{cells[1]:>18s}{ratio:>10s}")
    return lines
