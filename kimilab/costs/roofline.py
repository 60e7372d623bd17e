"""Decode operating points: the batch that fits, each request's TPOT, the instance's tokens per second.

Built from :mod:`~kimilab.costs.memory` (what fits) and :mod:`~kimilab.costs.steptime`
(one forward pass per step, with communication and the calibrated per-step costs), on
one deployment; :func:`summary` is ``python -m kimilab memory``'s table.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs.cache_bytes import checkpoint_bytes, kv_bytes_per_token, request_total_bytes
from kimilab.costs.deployment import Deployment
from kimilab.costs.memory import max_batch
from kimilab.costs.steptime import decode_step_seconds
from kimilab.validate import check_int

__all__ = ["DecodePoint", "decode_point", "decode_crossover_tokens", "summary"]


@dataclass(frozen=True)
class DecodePoint:
    """One decode operating point on one deployment."""

    batch: int
    step_seconds: float  # = TPOT seen by each request

    @property
    def tokens_per_second(self) -> float:
        """Throughput of the instance: tokens generated per second by the whole batch."""
        return self.batch / self.step_seconds


def decode_point(cfg: ModelConfig, deployment: Deployment, context_len: int, batch: int | None = None) -> DecodePoint:
    """The decode step at ``batch`` (default: the largest batch that fits; ValueError if none)."""
    if batch is None:
        batch = max_batch(cfg, deployment, context_len)
        if batch < 1:
            raise ValueError(f"context_len={context_len}: not one request of {cfg.name} fits beside the weights "
                             f"on {deployment.describe()}; pass a larger deployment")
    return DecodePoint(batch, decode_step_seconds(cfg, deployment, context_len, batch))


def decode_crossover_tokens(cfg: ModelConfig, baseline: ModelConfig, deployment: Deployment,
                            batch: int, max_tokens: int = 1 << 20) -> int | None:
    """Smallest context (0..``max_tokens``) at which a decode step of ``batch`` requests of ``cfg``
    takes no longer than one of ``baseline`` on ``deployment`` (None if it never does there).

    The time's counterpart of :func:`~kimilab.costs.crossover_tokens`. Found by bisection:
    it assumes the two steps' difference changes sign at most once in context, which holds
    when both are bound by bytes (the hybrid's fixed state against the baseline's larger KV
    per token); a test holds it equal to a scan.
    """
    batch = check_int("batch", batch, 1)
    hi = check_int("max_tokens", max_tokens, 0, unit="tokens")

    def no_slower(L: int) -> bool:
        mine = decode_step_seconds(cfg, deployment, L, batch)
        return mine <= decode_step_seconds(baseline, deployment, L, batch)

    if not no_slower(hi):
        return None
    lo = 0
    if no_slower(lo):
        return 0
    while hi - lo > 1:  # no_slower(hi) and not no_slower(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if no_slower(mid) else (mid, hi)
    return hi


def summary(cfg: ModelConfig, baseline: ModelConfig, deployment: Deployment,
            contexts=(131072, 1048576)) -> list[str]:
    """Lines of a table comparing ``cfg`` with ``baseline`` on one deployment: bytes per device,
    the batch that fits, TPOT and throughput. The last column is baseline / cfg."""

    def at_max(c, L, what):
        b = max_batch(c, deployment, L)
        if not b:
            return None
        p = decode_point(c, deployment, L, b)
        return p.tokens_per_second if what == "tps" else p.step_seconds * 1e3

    rows = [("KV bytes per token per device", lambda c: kv_bytes_per_token(c, deployment), "{:,d}"),
            ("state bytes per request per device", lambda c: checkpoint_bytes(c, deployment), "{:,d}")]
    for L in contexts:
        rows += [(f"@{L:>9,d}: cache per request GB", lambda c, L=L: request_total_bytes(c, deployment, L) / 1e9,
                  "{:.2f}"),
                 (f"@{L:>9,d}: largest batch", lambda c, L=L: max_batch(c, deployment, L), "{:,d}"),
                 (f"@{L:>9,d}: TPOT at batch 1 ms", lambda c, L=L: decode_step_seconds(c, deployment, L, 1) * 1e3,
                  "{:.2f}"),
                 (f"@{L:>9,d}: TPOT at largest batch ms", lambda c, L=L: at_max(c, L, "tpot"), "{:.2f}"),
                 (f"@{L:>9,d}: throughput tokens/s", lambda c, L=L: at_max(c, L, "tps"), "{:,.0f}")]
    lines = [f"deployment: {deployment.describe()}",
             f"{'':38s}{cfg.name:>18s}{baseline.name:>18s}{'base/cfg':>10s}"]
    for label, value, fmt in rows:
        a, b = value(cfg), value(baseline)
        ratio = f"{b / a:.2f}x" if a and b is not None else "-"
        cells = [fmt.format(v) if v is not None else "-" for v in (a, b)]
        lines.append(f"{label:38s}{cells[0]:>18s}{cells[1]:>18s}{ratio:>10s}")
    return lines
