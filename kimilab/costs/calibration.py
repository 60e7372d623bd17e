"""Published GPU measurements beside the cost model, and the fit of the kernel efficiencies.

Nothing here was measured on a GPU by us. The rows (``data/calibration/``):

- **fit**: the Kimi Linear report's Figure 7 (arXiv 2510.26692, p. 13), digitised from the
  PDF's vector paths: (a) prefill latency and (b) TPOT at batch 1, for Kimi Linear and the
  all-MLA baseline at 48B, 4K to 1M tokens. The report names no hardware or parallelism;
  we model the rows on :data:`~kimilab.costs.deployment.REPORT_TP8_H800` (an assumption)
  and fit the five free numbers of :class:`~kimilab.costs.deployment.Kernels` to them:
  the GEMM, attention, KDA and bandwidth efficiencies and the per-layer overhead.
- **check**: rows the fit never saw. SGLang's serving benchmarks of Qwen3-Next-80B-A3B
  (the closest public peer: a 3:1 linear-attention hybrid MoE with 3B active parameters)
  on H200 at TP2/4/8 and H20 at TP4/8 (PRs #10404 and #10467: output tokens per second
  at a fixed concurrency), and the report's Figure 1(b) at 1M tokens, whose batch it does
  not state (shown, not scored).

:func:`table` lists every row with its measured value, the model's value and the error;
:func:`fit_kernels` reproduces :data:`~kimilab.costs.deployment.CALIBRATED` (a test checks),
and :func:`fit_link` the NVLink numbers from Vidur's measured all-reduces.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kimilab.config import ModelConfig, all_mla_27, kimi_linear_48b, qwen3_next_80b
from kimilab.costs.deployment import CALIBRATED, REPORT_TP8_H800, Deployment, Kernels
from kimilab.costs.hardware import H20, H200
from kimilab.costs.steptime import StepWork, prefill_chunks, step_work

__all__ = ["DATA", "Row", "rows", "modelled", "table", "fit_kernels", "fit_link"]

DATA = Path(__file__).resolve().parents[2] / "data" / "calibration"
_MODELS = {"Kimi Linear": kimi_linear_48b, "MLA": all_mla_27}
_GPUS = {"H200": H200, "H20": H20}


@dataclass(frozen=True)
class Row:
    """One published measurement and how to model it."""

    source: str
    what: str  # "prefill s", "TPOT s" or "output tokens/s"
    model: ModelConfig
    deployment: Deployment
    tokens: int  # prompt or context length
    measured: float
    fitted: bool  # used by the fit, or a check it never saw
    batch: int = 1  # concurrency (throughput rows)
    output_len: int = 0


def rows() -> list[Row]:
    """Every row, fitted ones first (the figures' order), read from ``data/calibration/``."""
    out = []
    with open(DATA / "kimi_linear_speed.csv", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if r["series"] not in _MODELS:
                continue
            fig, tokens, value = r["figure"], int(r["tokens"]), float(r["value"])
            scale = 1.0 if r["unit"] == "s" else 1e-3
            what = "prefill s" if fig.startswith("7a") else "TPOT s"
            if fig.startswith("1b") and tokens != 2 ** 20:
                continue  # Figure 1(b): only its labelled 1M points (1.84 vs 11.48 ms) are read
            source = f"Kimi Linear report, Figure {fig.split()[0]}" + (" (batch not stated)" if fig.startswith("1b") else "")
            out.append(Row(source, what, _MODELS[r["series"]], REPORT_TP8_H800, tokens, value * scale,
                           fitted=not fig.startswith("1b")))
    with open(DATA / "sglang_qwen3_next.csv", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            tp = int(r["tp"])
            dep = Deployment(f"sglang-tp{tp}-{r['gpu'].lower()}", _GPUS[r["gpu"]], tp, source=r["source"])
            out.append(Row(r["source"], "output tokens/s", qwen3_next_80b, dep, int(r["input_len"]),
                           float(r["output_tokens_per_s"]), fitted=False, batch=int(r["concurrency"]),
                           output_len=int(r["output_len"])))
    return out


def _works(row: Row) -> tuple[list[StepWork], list[float]]:
    """The steps a row's measurement is made of, with the weight each counts with."""
    cfg, dep = row.model, row.deployment
    if row.what == "prefill s":
        return [step_work(cfg, dep, chunks=[c]) for c in prefill_chunks(dep, row.tokens)], None
    if row.what == "TPOT s":
        return [step_work(cfg, dep, decode=(1, row.tokens))], None
    # Closed-loop serving at concurrency C: each request prefills its prompt in one step beside
    # C - 1 decodes, then decodes output_len tokens at a mean context of prompt + output/2.
    C, n_in, n_out = row.batch, row.tokens, row.output_len
    ctx = n_in + n_out // 2
    return ([step_work(cfg, dep, decode=(C, C * ctx)),
             step_work(cfg, dep, decode=(C - 1, (C - 1) * ctx), chunks=[(n_in, 0)]),
             step_work(cfg, dep, decode=(C - 1, (C - 1) * ctx))], [C, n_in, n_out])


def modelled(row: Row, kernels: Kernels | None = None) -> float:
    """The model's value for a row (its deployment's kernels, or ``kernels`` for the fit)."""
    works, extra = _works(row)
    if extra is None:
        return sum(w.seconds(kernels) for w in works)
    decode, mixed, rest = (w.seconds(kernels) for w in works)
    C, _, n_out = extra
    return C * n_out / (n_out * decode + C * (mixed - rest))


def table(kernels: Kernels = CALIBRATED) -> list[dict]:
    """Every row: source, what, model, deployment, tokens, measured, modelled, error (model / measured - 1)."""
    out = []
    for r in rows():
        m = modelled(r, replace(kernels))
        out.append({"source": r.source, "what": r.what, "model": r.model.name, "deployment": r.deployment.name,
                    "tokens": r.tokens, "batch": r.batch, "measured": r.measured, "modelled": m,
                    "error": m / r.measured - 1.0, "fitted": r.fitted})
    return out


_FREE = {"gemm": (0.05, 1.0), "attention": (0.05, 1.0), "kda": (0.01, 1.0), "bandwidth": (0.3, 1.0),
         "layer_overhead_s": (1e-6, 1e-3)}


def _stack(fit_rows: list[Row]) -> dict:
    """The fitted rows' step work as arrays, so one evaluation of the fit is a few numpy operations."""
    cols = {k: [] for k in ("row", "layers", "wb", "wf", "cb", "af", "kf", "comm", "bw", "peak")}
    for i, r in enumerate(fit_rows):
        works, _ = _works(r)
        for w in works:
            dev = w.deployment.device
            for key, value in (("row", i), ("layers", w.layers), ("wb", w.weight_bytes), ("wf", w.weight_flops),
                               ("cb", w.cache_bytes), ("af", w.attention_flops), ("kf", w.kda_flops),
                               ("comm", w.comm_seconds),
                               ("bw", dev.hbm_bandwidth), ("peak", dev.peak_flops)):
                cols[key].append(value)
    return {k: np.asarray(v, dtype=float) for k, v in cols.items()} | {"n": len(fit_rows)}


def _loss(stack: dict, measured: np.ndarray, p: dict) -> float:
    bw = stack["bw"] * p["bandwidth"]
    steps = (stack["layers"] * p["layer_overhead_s"] + stack["comm"]
             + np.maximum(stack["wb"] / bw, stack["wf"] / (stack["peak"] * p["gemm"]))
             + np.maximum(stack["cb"] / bw, (stack["af"] / p["attention"] + stack["kf"] / p["kda"]) / stack["peak"]))
    model = np.bincount(stack["row"].astype(int), weights=steps, minlength=stack["n"])
    return float(np.sum(np.log(model / measured) ** 2))


def fit_kernels(start: Kernels = CALIBRATED, rounds: int = 12, grid: int = 81) -> tuple[Kernels, float]:
    """Fit gemm, attention, kda, bandwidth and layer_overhead_s to the fitted rows, minimising the
    squared log error: coordinate search on log grids that narrow each round (deterministic).
    Returns the kernels (replay kept from ``start``) and the root-mean-square log error."""
    fit_rows = [r for r in rows() if r.fitted]
    stack, measured = _stack(fit_rows), np.array([r.measured for r in fit_rows])
    p = {k: getattr(start, k) for k in _FREE}
    width = {k: math.log(hi / lo) for k, (lo, hi) in _FREE.items()}
    for _ in range(rounds):
        for k, (lo, hi) in _FREE.items():
            centre = math.log(p[k])
            values = np.exp(np.linspace(centre - width[k] / 2, centre + width[k] / 2, grid)).clip(lo, hi)
            losses = [_loss(stack, measured, p | {k: v}) for v in values]
            p[k] = float(values[int(np.argmin(losses))])
            width[k] *= 0.5
    rms = math.sqrt(_loss(stack, measured, p) / len(fit_rows))
    return replace(start, **p), rms


def fit_link(n_devices: int = 8) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the all-reduce model fitted to Vidur's H100 DGX medians
    at ``n_devices`` (least squares in relative error, every message size)."""
    size, t = [], []
    with open(DATA / "vidur_h100_all_reduce.csv", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if int(r["num_workers"]) == n_devices:
                size.append(float(r["size_bytes"]))
                t.append(float(r["median_ms"]) * 1e-3)
    size, t = np.asarray(size), np.asarray(t)
    x = 2.0 * (n_devices - 1) / n_devices * size
    A = np.vstack([np.ones_like(x), x]).T / t[:, None]
    (latency, inv_bw), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return float(1.0 / inv_bw), float(latency)
