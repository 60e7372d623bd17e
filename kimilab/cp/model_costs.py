"""How long the whole hybrid model's context-parallel prefill takes: a cost model, by schedule.

P devices of a deployment's accelerator each hold the whole model and one CP rank's rows;
links and kernel efficiencies are the deployment's (calibrated, chapter 3). Per rank and
layer the model charges the weight matmuls (rows x active parameters, or reading the
layer's weights, whichever is longer), the KDA kernel (``kda.chunk_kda_flops``, times the
affine cost on ranks that start before they know their state), causal attention over the
rank's rows (tile by tile as :func:`~kimilab.cp.zigzag.causal_work` counts), a fixed
per-layer overhead, and the layer's messages (not overlapped with compute: an upper
bound). Three schedules (:data:`SCHEDULES`):

- ``exchange``: every layer runs on all ranks at once; KDA ranks exchange (M, C) by one
  all-gather (fp32), attention layers pass KV blocks around the ring. A layer ends when
  its slowest rank does.
- ``relay``: rtp-llm's (PR #1299, ``qwen3_next.py``'s ``_forward_linear_cp_relay``): the
  projections and MLPs run in parallel, but each KDA layer's kernel runs rank after rank
  (the fp32 state passed along), so it takes what it takes on one device.
- ``relay-pipelined``: the relay pipelined across layers (our model, not what #1299
  ships): rank r starts layer l + 1 as soon as it has finished layer l and received
  rank r - 1's state (or keys and values) of that layer -- a wavefront, no affine pass.
"""

from __future__ import annotations

import numpy as np

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, attention_prefill_flops, linear_seconds, weight_model
from kimilab.cp.costs import cp_link, scheme_costs
from kimilab.cp.split import balanced_weights, split_bounds
from kimilab.cp.zigzag import contiguous_layout, zigzag_layout
from kimilab.kda import chunk_kda_flops
from kimilab.validate import check_choice, check_int

__all__ = ["SCHEDULES", "CUTS", "model_cp_prefill", "one_device_parts"]

SCHEDULES = {
    "exchange": "all ranks run every layer at once: KDA by the affine pass + one all-gather of (M, C), "
                "attention by ring",
    "relay": "rtp-llm PR #1299: each KDA layer's kernel runs rank after rank; projections, MLPs, attention in parallel",
    "relay-pipelined": "the relay pipelined across layers: a wavefront, rank r one layer behind rank r - 1",
}
CUTS = ("even", "affine", "work")


def _work_bounds(cfg: ModelConfig, dep: Deployment, T: int, P: int) -> list[int]:
    """Cut points that give every rank the same whole-model compute (later tokens attend to more,
    so later ranks get fewer of them): equal quantiles of the cumulative per-token cost."""
    dev, k = dep.device, dep.kernels
    flat = (linear_seconds(cfg, dep, T) / T
            + len(cfg.kda_layers) * chunk_kda_flops(64, cfg.n_heads, cfg.head_dim, cfg.head_dim) / 64
            / (dev.peak_flops * k.kda))
    pair = attention_prefill_flops(cfg, 1, 1) - attention_prefill_flops(cfg, 1, 0)  # one more key, every layer
    t = np.arange(T, dtype=float)
    cum = np.cumsum(flat + (t + 1) * pair / (dev.peak_flops * k.attention))
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, P) / P)
    return split_bounds(T, P, np.diff(np.concatenate([[0], cuts, [T]])).clip(1))


def _layouts(cfg, dep, T: int, P: int, layout: str, cut: str, affine_cost: float):
    """(contiguous rows per rank, attention runs per rank)."""
    if cut == "work" and P > 1:
        bounds = _work_bounds(cfg, dep, T, P)
    else:
        bounds = split_bounds(T, P, balanced_weights(P, affine_cost) if cut == "affine" and P > 1 else None)
    home = contiguous_layout(bounds)
    return home, (home if layout == "contiguous" else zigzag_layout(T, P))


def _rank_seconds(cfg: ModelConfig, dep: Deployment, rows: int, runs, affine: float) -> dict:
    """One rank's seconds per KDA layer and per attention layer (compute and overhead, no messages)."""
    dev, k = dep.device, dep.kernels
    w = weight_model(cfg)
    layer_bytes = w.total_params * w.bytes_per_param / cfg.n_layers
    lin = max(layer_bytes / (dev.hbm_bandwidth * k.bandwidth),
              linear_seconds(cfg, dep, max(rows, 1)) / cfg.n_layers)
    H, K = cfg.n_heads, cfg.head_dim
    kda = (chunk_kda_flops(rows, H, K, K, chunk=cfg.chunk_size) + 2 * cfg.conv_kernel * cfg.conv_channels * rows)
    per_attn = max(1, len(cfg.attn_layers))
    attn = sum(attention_prefill_flops(cfg, b - a, a) for a, b in runs) / per_attn
    return {"kda_layer": k.layer_overhead_s + lin + affine * kda / (dev.peak_flops * k.kda),
            "attention_layer": k.layer_overhead_s + lin + attn / (dev.peak_flops * k.attention),
            "kda_kernel": affine * kda / (dev.peak_flops * k.kda)}


def one_device_parts(cfg: ModelConfig, T: int, *, deployment: Deployment) -> dict[str, float]:
    """Seconds of a T-token prefill on one device of ``deployment``, by part: the weight matmuls,
    the KDA kernels, global attention, and the per-layer overhead (what CP has to split)."""
    T = check_int("T", T, 1)
    dev, k = deployment.device, deployment.kernels
    per = _rank_seconds(cfg, deployment, T, [(0, T)], 1.0)
    kda = len(cfg.kda_layers) * per["kda_kernel"]
    overhead = cfg.n_layers * k.layer_overhead_s
    attention = len(cfg.attn_layers) * attention_prefill_flops(cfg, T, 0) / max(1, len(cfg.attn_layers)) / (
        dev.peak_flops * k.attention)
    total = len(cfg.kda_layers) * per["kda_layer"] + len(cfg.attn_layers) * per["attention_layer"]
    return {"weights": total - kda - attention - overhead, "kda": kda, "attention": attention, "overhead": overhead}


def _messages(cfg: ModelConfig, dep: Deployment, P: int, rows: int, layout: str) -> dict:
    """Seconds of one layer's messages on the busiest rank (``rows`` tokens)."""
    if P == 1:
        return {"kda_exchange": 0.0, "kda_state": 0.0, "attention": 0.0, "kv_block": 0.0}
    link = cp_link(dep, P)
    H, K = cfg.n_heads, cfg.head_dim
    c = scheme_costs(P, H, K, K, 4)["allgather"]  # (M, C) in fp32, as flash-linear-attention keeps the chain
    block = rows * cfg.kv_elems_per_token_layer * cfg.kv_bytes
    ring = (P - 1) * link.send_seconds(block)
    swap = 2 * link.all_to_all_seconds(rows * cfg.d_model * dep.act_bytes, P) if layout == "zigzag" else 0.0
    return {"kda_exchange": c["steps"] * link.latency + c["bytes"] / link.bandwidth,
            "kda_state": link.send_seconds(H * K * K * 4), "attention": ring + swap, "kv_block": link.send_seconds(block)}


def _makespan(cfg, dep, P, home, attn, schedule, affine, layout) -> float:
    kinds = cfg.layer_pattern
    per = [_rank_seconds(cfg, dep, b - a, runs, affine if (schedule == "exchange" and r > 0) else 1.0)
           for r, ([(a, b)], runs) in enumerate(zip(home, attn))]
    msg = _messages(cfg, dep, P, max(b - a for [(a, b)] in home), layout)
    if schedule == "exchange":
        kda = max(p["kda_layer"] for p in per) + msg["kda_exchange"]
        return kinds.count("K") * kda + kinds.count("A") * (max(p["attention_layer"] for p in per) + msg["attention"])
    if schedule == "relay":
        rest = max(p["kda_layer"] - p["kda_kernel"] for p in per)
        kda = rest + sum(p["kda_kernel"] for p in per) + (P - 1) * msg["kda_state"]
        return kinds.count("K") * kda + kinds.count("A") * (max(p["attention_layer"] for p in per) + msg["attention"])
    finish = np.zeros(P)  # relay-pipelined: the wavefront, layer by layer
    for kind in kinds:
        edge = msg["kda_state"] if kind == "K" else msg["kv_block"]
        for r in range(P):
            ready = max(finish[r], finish[r - 1] + edge) if r else finish[r]
            finish[r] = ready + per[r]["kda_layer" if kind == "K" else "attention_layer"]
    return float(finish.max())


def model_cp_prefill(cfg: ModelConfig, T: int, P: int, *, deployment: Deployment, schedule: str = "exchange",
                     layout: str = "contiguous", affine_cost: float = 1.25, cut: str = "even") -> dict:
    """Seconds of one T-token prefill of ``cfg`` over P devices of ``deployment``, against one device.

    ``cut`` (where the contiguous slices end): "even"; "affine" -- rank 0 takes
    ``affine_cost`` times the others' share (``cp.balanced_weights``: its KDA pass is the
    plain one); or "work" -- every rank gets the same whole-model compute (later ranks fewer
    tokens, since their tokens attend to more). Returns the regime named (scope,
    deployment, device, link, P, T, schedule, layout, cut, affine cost) with ``seconds``,
    ``one_device_seconds``, ``speedup`` and ``efficiency`` (speedup / P).
    """
    T, P = check_int("T", T, 1), check_int("P", P, 1)
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("layout", layout, ("contiguous", "zigzag"))
    check_choice("cut", cut, CUTS)
    if schedule == "relay-pipelined" and layout != "contiguous":
        raise ValueError("layout='zigzag': the pipelined relay needs each rank's rows in order (contiguous)")
    if not 1.0 <= affine_cost < float("inf"):
        raise ValueError(f"affine_cost={affine_cost!r}: expected a finite number >= 1")
    if P > T:
        raise ValueError(f"P={P} ranks but only T={T} tokens: every rank needs at least one token")
    one = _makespan(cfg, deployment, 1, [[(0, T)]], [[(0, T)]], "exchange", 1.0, "contiguous")
    home, attn_runs = _layouts(cfg, deployment, T, P, layout, cut, affine_cost)
    seconds = _makespan(cfg, deployment, P, home, attn_runs, schedule, affine_cost, layout)
    kda, attn = cfg.layer_pattern.count("K"), cfg.layer_pattern.count("A")
    return {"scope": f"whole model ({kda} KDA : {attn} {cfg.attn_kind.upper()} layers)", "model": cfg.name,
            "deployment": deployment.name, "device": deployment.device.name, "link": cp_link(deployment, P).name,
            "P": P, "T": T, "schedule": schedule, "layout": layout, "cut": cut, "affine_cost": affine_cost,
            "rank0_share": (home[0][0][1] - home[0][0][0]) / T, "seconds": seconds,
            "one_device_seconds": one, "speedup": one / seconds, "efficiency": one / seconds / P}
