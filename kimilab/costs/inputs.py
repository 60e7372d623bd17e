"""Every number the cost model rests on, marked sourced, fitted or assumed (what a verdict stands on).

Chapter 12's verdicts print this table beside them: a crossover that moves when an
*assumed* input moves is only as good as that assumption, and says so.
"""

from __future__ import annotations

from kimilab.costs.deployment import Deployment

__all__ = ["STATUSES", "inputs"]

STATUSES = ("sourced", "measured", "fitted", "assumed")


def inputs(deployment: Deployment) -> list[dict]:
    """One row per input of ``deployment``'s numbers: name, value, unit, status, source."""
    dev, k, link = deployment.device, deployment.kernels, deployment.link
    fit = "fitted to the Kimi Linear report's Figure 7 on an assumed 4 x H800 (chapter 3)"
    band = " (the ensemble's band covers it)"
    rows = [
        ("devices", deployment.n_devices, "", "sourced", deployment.source or "the deployment's definition"),
        ("attention split", deployment.attention, "", "sourced", deployment.source or "the deployment's definition"),
        ("HBM per device", dev.hbm_bytes / 1e9, "GB", "sourced", dev.source),
        ("HBM bandwidth per device", dev.hbm_bandwidth / 1e12, "TB/s", "sourced", dev.source),
        ("peak dense bf16 per device", dev.peak_flops / 1e12, "TFLOP/s", "sourced", dev.source),
        ("GEMM efficiency (asymptote)", k.gemm, "of peak", "measured", "Vidur's H100 GEMM profiles" + band),
        ("GEMM half-efficiency point", k.gemm_half_ridge, "x ridge", "measured", "Vidur's H100 GEMM profiles"),
        ("attention efficiency", k.attention, "of peak", "fitted", fit + ", within FlashAttention-2..3" + band),
        ("KDA efficiency", k.kda, "of peak", "measured", "FlashKDA's H20 benchmark carried to an H100" + band),
        ("bandwidth efficiency", k.bandwidth, "of peak", "fitted", fit + band),
        ("overhead per layer per step", k.layer_overhead_s * 1e6, "us", "measured",
         "12 small kernels at Vidur's 4 us floor (CUDA graphs)" + band),
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
