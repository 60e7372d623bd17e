"""Every number the cost model rests on, marked sourced, fitted or assumed (what a verdict stands on).

Chapter 12's verdicts print this table beside them: a crossover that moves when an
*assumed* input moves is only as good as that assumption, and says so.
"""

from __future__ import annotations

import dataclasses
import math

from kimilab.costs.deployment import Deployment

__all__ = ["STATUSES", "FIT_LOG_ERROR", "inputs", "calibration_variants"]

STATUSES = ("sourced", "fitted", "assumed")
# the rms log error of the fit to the Kimi Linear report's Figure 7 (chapter 3 prints it)
FIT_LOG_ERROR = 0.155
_FITTED = ("gemm", "attention", "kda", "bandwidth", "layer_overhead_s")


def inputs(deployment: Deployment) -> list[dict]:
    """One row per input of ``deployment``'s numbers: name, value, unit, status, source."""
    dev, k, link = deployment.device, deployment.kernels, deployment.link
    fit = f"fitted to the Kimi Linear report's Figure 7 (chapter 3; rms log error {FIT_LOG_ERROR})"
    rows = [
        ("devices", deployment.n_devices, "", "sourced", deployment.source or "the deployment's definition"),
        ("attention split", deployment.attention, "", "sourced", deployment.source or "the deployment's definition"),
        ("HBM per device", dev.hbm_bytes / 1e9, "GB", "sourced", dev.source),
        ("HBM bandwidth per device", dev.hbm_bandwidth / 1e12, "TB/s", "sourced", dev.source),
        ("peak dense bf16 per device", dev.peak_flops / 1e12, "TFLOP/s", "sourced", dev.source),
        ("GEMM efficiency", k.gemm, "of peak", "fitted", fit),
        ("attention efficiency", k.attention, "of peak", "fitted", fit),
        ("KDA efficiency", k.kda, "of peak", "fitted", fit),
        ("bandwidth efficiency", k.bandwidth, "of peak", "fitted", fit),
        ("overhead per layer per step", k.layer_overhead_s * 1e6, "us", "fitted", fit),
        ("replay efficiency", k.replay, "of peak", "assumed", "no published measurement of a state replay kernel"),
        ("link bandwidth", link.bandwidth / 1e9, "GB/s", "fitted" if "fit" in link.source else "assumed",
         link.source),
        ("link latency", link.latency * 1e6, "us", "fitted" if "fit" in link.source else "assumed", link.source),
        ("memory share for the engine", deployment.memory_utilization, "", "sourced",
         "vLLM's default --gpu-memory-utilization"),
        ("activation reserve per device", deployment.activation_reserve_bytes / 1e9, "GB", "assumed",
         "a round figure for one step's activations"),
        ("tokens per step", deployment.max_batched_tokens, "tokens", "sourced",
         "vLLM's default --max-num-batched-tokens for online serving"),
        ("expert routing", "uniform", "", "assumed", "each token picks its experts independently and uniformly"),
    ]
    return [{"name": n, "value": v, "unit": u, "status": s, "source": src} for n, v, u, s, src in rows]


def calibration_variants(deployment: Deployment, log_error: float = FIT_LOG_ERROR) -> list[Deployment]:
    """``deployment`` with each fitted kernel number moved by one rms log error, up and down (one at a
    time; an efficiency is capped at the peak): the inputs a verdict's band is taken over."""
    if not 0.0 <= log_error < 5.0:
        raise ValueError(f"log_error={log_error!r}: expected a log-scale error in [0, 5)")
    out = []
    for name in _FITTED:
        for sign in (+1, -1):
            value = getattr(deployment.kernels, name) * math.exp(sign * log_error)
            value = value if name == "layer_overhead_s" else min(value, 1.0)
            kernels = dataclasses.replace(deployment.kernels, **{name: value})
            out.append(deployment.with_(name=f"{deployment.name} ({name} x e^{sign * log_error:+g})", kernels=kernels))
    return out
