"""Every number the cost model rests on, marked sourced, fitted or assumed (what a verdict stands on).

Chapter 12's verdicts print this table beside them: a crossover that moves when an
*assumed* input moves is only as good as that assumption, and says so.
"""

from __future__ import annotations

from kimilab.costs.deployment import Deployment

__all__ = ["STATUSES", "inputs"]

STATUSES = ("sourced", "fitted", "assumed")


def inputs(deployment: Deployment) -> list[dict]:
    """One row per input of ``deployment``'s numbers: name, value, unit, status, source."""
    dev, k, link = deployment.device, deployment.kernels, deployment.link
    fit = "fitted to the Kimi Linear report's Figure 7 (chapter 3; rms log error 0.155)"
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
