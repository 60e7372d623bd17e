"""Kernel speeds from measurements of single operators, before any end-to-end fit.

An end-to-end latency curve cannot tell a slow GEMM from a slow attention kernel: many
mixes of efficiencies give the same total. So each kernel class is pinned here on its own
measurements, and only what is left is fitted to the Kimi Linear report
(:mod:`kimilab.costs.calibration`):

- **Weight matmuls (GEMMs)**: Vidur's measured H100 and A100 operator medians
  (``data/calibration/vidur_layer_ops.csv``: the QKV, output, MLP-up and MLP-down
  projections of Llama-2-7B and 70B at 1-8 GPUs and 1-4,096 tokens). Each is modelled as
  ``max(floor, bytes / (bandwidth x b), FLOPs / (peak x e(m)))`` with the efficiency a
  function of the tokens ``m`` the GEMM sees, ``e(m) = e_max m / (m + m_half)``: few tokens
  leave the tensor cores idle. ``m_half`` is a multiple ``r`` of the GPU's ridge point
  (peak FLOP/s over HBM bytes/s: the tokens at which a GEMM stops being bandwidth bound), so
  one curve carries from an A100 to an H100 or an H20. :func:`fit_gemm` fits (floor, b,
  e_max, r) and reports the error on every row, and on rows it never saw.
- **Softmax attention**: capped by FlashAttention-3's best published H100 forward pass,
  740 TFLOP/s of 989, and floored by FlashAttention-2's 35% on the same GPU (Shah et al.,
  "FlashAttention-3", arXiv 2407.08608, section 1 and 4.1).
- **KDA**: MoonshotAI's FlashKDA benchmark of the KDA forward kernel on one H20
  (``data/calibration/flashkda_h20.csv``), for FlashKDA and for flash-linear-attention's
  Triton ``chunk_kda``. No published H100 number exists; :data:`KDA_ON_H100` carries the two
  ways of moving an H20 figure to an H100 as a band.
- **Kernel floors**: the median time of a norm, an add or an activation at a few tokens
  (:func:`kernel_floor_s`): what any kernel costs, however small.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimilab.costs.hardware import A100, H20, H800, Accelerator

__all__ = ["DATA", "GPUS", "GemmCurve", "gemm_rows", "fit_gemm", "gemm_log_errors", "gemm_spread",
           "kernel_floor_s", "FLASH_ATTENTION_3", "FLASH_ATTENTION_2", "kda_rows", "kda_h20_efficiency",
           "KDA_ON_H100", "KERNELS_PER_LAYER", "graph_layer_overhead_s"]

DATA = Path(__file__).resolve().parents[2] / "data" / "calibration"
# Vidur's H100 rows are an H100 SXM (the H800 entry has its HBM and FLOPs); A100 SXM 80 GB.
GPUS: dict[str, Accelerator] = {"H100": H800, "A100": A100}
_GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")

# FlashAttention-3 (arXiv 2407.08608): forward pass up to 740 TFLOP/s in FP16 on H100 SXM5 (75% of
# 989); FlashAttention-2 reaches 35% of the same peak. The plausible range of softmax attention.
FLASH_ATTENTION_3 = 0.75
FLASH_ATTENTION_2 = 0.35


@dataclass(frozen=True)
class GemmCurve:
    """A GEMM's time on one GPU: ``max(floor_s, bytes / (bw x bandwidth), FLOPs / (peak x e(m)))``,
    ``e(m) = peak_fraction x m / (m + half_ridge x ridge)`` for ``m`` tokens through the GEMM."""

    gpu: str
    peak_fraction: float
    half_ridge: float
    bandwidth: float
    floor_s: float
    rms_log_error: float = 0.0

    @property
    def half_tokens(self) -> float:
        """Tokens at which the GEMM reaches half its peak fraction on ``self.gpu``."""
        dev = GPUS[self.gpu]
        return self.half_ridge * dev.peak_flops / dev.hbm_bandwidth

    def efficiency(self, tokens) -> np.ndarray:
        m = np.asarray(tokens, dtype=float)
        return self.peak_fraction * m / (m + self.half_tokens)

    def seconds(self, tokens, k, n) -> np.ndarray:
        """Time of an (m x k) @ (k x n) bf16 GEMM on ``self.gpu``."""
        dev = GPUS[self.gpu]
        m, k, n = (np.asarray(x, dtype=float) for x in (tokens, k, n))
        flops, nbytes = 2.0 * m * k * n, 2.0 * (k * n + m * (k + n))
        return np.maximum(np.maximum(self.floor_s, nbytes / (dev.hbm_bandwidth * self.bandwidth)),
                          flops / (dev.peak_flops * self.efficiency(m)))


def _read(gpu: str | None = None, models: tuple[str, ...] | None = None, ops=_GEMMS) -> dict[str, np.ndarray]:
    if gpu is not None and gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r}: expected one of {sorted(GPUS)}")
    cols: dict[str, list] = {k: [] for k in ("gpu", "model", "op", "tp", "tokens", "k", "n", "seconds")}
    with open(DATA / "vidur_layer_ops.csv", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if (gpu and r["gpu"] != gpu) or (models and r["model"] not in models) or r["op"] not in ops:
                continue
            for key in ("gpu", "model", "op"):
                cols[key].append(r[key])
            cols["tp"].append(int(r["tp"]))
            cols["tokens"].append(int(r["tokens"]))
            cols["k"].append(float(r["k"] or 0))
            cols["n"].append(float(r["n"] or 0))
            cols["seconds"].append(float(r["median_ms"]) * 1e-3)
    if not cols["op"]:
        raise ValueError(f"no Vidur rows for gpu={gpu!r}, models={models!r}")
    return {k: np.asarray(v) for k, v in cols.items()}


def gemm_rows(gpu: str | None = None, models: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Vidur's GEMM rows as arrays: gpu, model, op, tp, tokens, k, n (per device) and seconds (median)."""
    return _read(gpu, models)


def gemm_log_errors(curve: GemmCurve, rows: dict[str, np.ndarray]) -> np.ndarray:
    """log(modelled / measured) of every row (rows of ``curve.gpu`` only)."""
    return np.log(curve.seconds(rows["tokens"], rows["k"], rows["n"]) / rows["seconds"])


_BOUNDS = {"peak_fraction": (0.2, 1.0), "half_ridge": (0.02, 20.0), "bandwidth": (0.3, 1.0),
           "floor_s": (1e-6, 3e-5)}


def fit_gemm(gpu: str = "H100", models: tuple[str, ...] | None = None, rounds: int = 10,
             grid: int = 41) -> GemmCurve:
    """Fit a :class:`GemmCurve` to Vidur's ``gpu`` rows (of ``models``, all if None), minimising the
    squared log error by coordinate search on narrowing log grids (deterministic)."""
    rows = gemm_rows(gpu, models)
    p = {"peak_fraction": 0.7, "half_ridge": 1.0, "bandwidth": 0.7, "floor_s": 5e-6}
    width = {k: math.log(hi / lo) for k, (lo, hi) in _BOUNDS.items()}

    def loss(q: dict) -> float:
        return float(np.mean(gemm_log_errors(GemmCurve(gpu, **q), rows) ** 2))

    for _ in range(rounds):
        for key, (lo, hi) in _BOUNDS.items():
            centre = math.log(p[key])
            values = np.exp(np.linspace(centre - width[key] / 2, centre + width[key] / 2, grid)).clip(lo, hi)
            p[key] = float(values[int(np.argmin([loss(p | {key: v}) for v in values]))])
            width[key] *= 0.5
    return GemmCurve(gpu, **p, rms_log_error=math.sqrt(loss(p)))


def gemm_spread(curve: GemmCurve, rows: dict[str, np.ndarray], min_tokens: int = 256,
                quantiles: tuple[float, float] = (10, 90)) -> tuple[float, float]:
    """How far measured GEMM efficiency strays from the curve where the GEMM is compute bound
    (``min_tokens`` or more): the (low, high) percentiles of predicted / measured time, i.e. the
    factors the curve's efficiency must be multiplied by to reach the slow and the fast rows."""
    keep = rows["tokens"] >= min_tokens
    sub = {k: v[keep] for k, v in rows.items()}
    ratio = np.exp(gemm_log_errors(curve, sub))  # > 1: the row ran faster than the curve says
    lo, hi = np.percentile(ratio, quantiles)
    return float(lo), float(hi)


def kernel_floor_s(gpu: str = "H100") -> float:
    """Median time of the small kernels (norms, activation, add, rope) at 1-16 tokens: a kernel's floor."""
    small = _read(gpu, ops=("input_layernorm", "post_attention_layernorm", "mlp_act", "add", "attn_rope"))
    return float(np.median(small["seconds"]))


# Small kernels a layer launches besides its GEMMs and its mixer kernel (two norms, the rotary
# embedding or short conv, a gate, the activation, router and top-k, residual adds, the output
# gate): our count of a Kimi Linear layer, an assumption that carries the per-kernel floor.
KERNELS_PER_LAYER = 12


def graph_layer_overhead_s(gpu: str = "H100") -> float:
    """Per-layer overhead under CUDA graphs: the host launches nothing, so each small kernel costs its
    floor on the GPU, :data:`KERNELS_PER_LAYER` of them."""
    return KERNELS_PER_LAYER * kernel_floor_s(gpu)


def kda_rows() -> list[dict]:
    """FlashKDA's H20 benchmark rows (kernel, case, tokens, heads, head_dim, mean_ms)."""
    with open(DATA / "flashkda_h20.csv", encoding="utf-8") as f:
        lines = [line for line in f if not line.startswith("#")]
    return [{**r, "tokens": int(r["tokens"]), "heads": int(r["heads"]), "head_dim": int(r["head_dim"]),
             "mean_ms": float(r["mean_ms"])} for r in csv.DictReader(lines)]


def kda_h20_efficiency(kernel: str = "fla_chunk_kda", chunk: int = 64) -> float:
    """Fraction of the H20's peak the KDA forward reaches: our chunked-KDA FLOP count of each row
    over its measured time, the median over rows of ``kernel``."""
    from kimilab.kda import chunk_kda_flops  # the FLOP count of the algorithm chapter 2 builds

    effs = [chunk_kda_flops(r["tokens"], r["heads"], r["head_dim"], r["head_dim"], chunk=chunk)
            / (r["mean_ms"] * 1e-3 * H20.peak_flops) for r in kda_rows() if r["kernel"] == kernel]
    if not effs:
        raise ValueError(f"kernel={kernel!r}: expected 'flash_kda' or 'fla_chunk_kda'")
    return float(np.median(effs))


def _kda_on_h100() -> dict[str, float]:
    """Two ways to carry an H20 measurement to an H100-class GPU, and their geometric middle:
    ``same_time`` (the kernel is no faster on the H100 than on the H20: the H20's fraction scaled by
    the ratio of peaks, a floor) and ``same_fraction`` (the same share of a 6.7x larger peak, the
    best case), each for the Triton kernel vLLM runs and for FlashKDA."""
    ratio = H20.peak_flops / H800.peak_flops
    fla, fast = kda_h20_efficiency("fla_chunk_kda"), kda_h20_efficiency("flash_kda")
    low, high = fla * ratio, fast
    return {"low": low, "central": math.sqrt(low * high), "high": high, "fla_same_fraction": fla}


KDA_ON_H100 = _kda_on_h100()
