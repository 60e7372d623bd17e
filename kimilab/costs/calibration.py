"""Published end-to-end GPU measurements beside the cost model, and the fit of what is left.

Nothing here was measured on a GPU by us. The GEMM curve, the KDA efficiency and the kernel
floor come first, from operator measurements (:mod:`kimilab.costs.operators`); only the rest
is fitted here. The rows (``data/calibration/``):

- **fit**: the Kimi Linear report's Figure 7 (arXiv 2510.26692, p. 13), digitised from the
  PDF's vector paths: (a) prefill latency and (b) TPOT at batch 1, for Kimi Linear and the
  all-MLA baseline at 48B, 4K to 1M tokens. The report names no hardware or parallelism:
  :func:`fit_report` tries each of :data:`HARDWARE` and fits the attention efficiency (within
  the published FlashAttention range), the bandwidth efficiency, a constant per prefill and,
  for eager execution, the per-layer overhead. Four H800s at TP4
  (:data:`~kimilab.costs.deployment.REPORT_TP4_H800`) fit best, eight close behind.
- **check**: rows the fit never saw. SGLang's serving benchmarks of Qwen3-Next-80B-A3B
  (the closest public peer: a 3:1 linear-attention hybrid MoE with 3B active parameters)
  on H200 at TP2/4/8 and H20 at TP4/8 (PRs #10404 and #10467: output tokens per second
  at a fixed concurrency), and the report's Figure 1(b) at 1M tokens, whose batch it does
  not state (shown, not scored).

:func:`table` lists every row with its measured value, the model's value and the error;
:func:`fit_report` reproduces the fitted numbers of :data:`~kimilab.costs.deployment.CALIBRATED`
(a test checks), and :func:`fit_link` the NVLink numbers from Vidur's measured all-reduces.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kimilab.config import ModelConfig, all_mla_27, kimi_linear_48b, qwen3_next_80b
from kimilab.costs import operators
from kimilab.costs.deployment import CALIBRATED, REPORT_KERNELS, REPORT_TP4_H800, Deployment, Kernels
from kimilab.costs.hardware import H20, H200
from kimilab.costs.steptime import StepWork, prefill_chunks, step_work

__all__ = ["DATA", "Row", "rows", "modelled", "table", "fit_kernels", "fit_link", "HARDWARE", "ReportFit",
           "operator_kernels", "fit_report", "report_fits"]

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


def rows(report: Deployment = REPORT_TP4_H800) -> list[Row]:
    """Every row, fitted ones first (the figures' order), read from ``data/calibration/``; the report's
    rows are modelled on ``report`` (its hardware is not stated, so this is an assumption)."""
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
            out.append(Row(source, what, _MODELS[r["series"]], report, tokens, value * scale,
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


def table(kernels: Kernels = REPORT_KERNELS, report: Deployment = REPORT_TP4_H800) -> list[dict]:
    """Every row: source, what, model, deployment, tokens, measured, modelled, error (model / measured - 1)."""
    out = []
    for r in rows(report):
        m = modelled(r, replace(kernels))
        out.append({"source": r.source, "what": r.what, "model": r.model.name, "deployment": r.deployment.name,
                    "tokens": r.tokens, "batch": r.batch, "measured": r.measured, "modelled": m,
                    "error": m / r.measured - 1.0, "fitted": r.fitted})
    return out


_BOUNDS = {"gemm": (0.05, 1.0), "attention": (0.05, 1.0), "kda": (0.01, 1.0), "bandwidth": (0.3, 1.0),
           "layer_overhead_s": (1e-6, 1e-3), "prefill_fixed_s": (1e-4, 0.5)}
_ALL_FREE = ("gemm", "attention", "kda", "bandwidth", "layer_overhead_s")


def _stack(fit_rows: list[Row]) -> dict:
    """The fitted rows' step work as arrays, so one evaluation of the fit is a few numpy operations."""
    keys = ("row", "first", "layers", "wb", "wf", "ef", "md", "me", "cb", "af", "kf", "comm", "bw", "peak")
    cols = {k: [] for k in keys}
    for i, r in enumerate(fit_rows):
        works, _ = _works(r)
        for j, w in enumerate(works):
            dev = w.deployment.device
            for key, value in zip(keys, (i, float(r.what == "prefill s" and j == 0), w.layers, w.weight_bytes, w.weight_flops, w.expert_flops,
                                         max(w.gemm_tokens, 1.0), max(w.expert_tokens, 1.0), w.cache_bytes,
                                         w.attention_flops, w.kda_flops, w.comm_seconds, dev.hbm_bandwidth,
                                         dev.peak_flops)):
                cols[key].append(value)
    return {k: np.asarray(v, dtype=float) for k, v in cols.items()} | {"n": len(fit_rows)}


def _model(stack: dict, p: dict) -> np.ndarray:
    """Every fitted row's modelled value under parameters ``p`` (the fields of Kernels)."""
    bw = stack["bw"] * p["bandwidth"]
    half = p.get("gemm_half_ridge", 0.0) * stack["peak"] / stack["bw"]
    eff = lambda m: p["gemm"] * m / (m + half)  # noqa: E731
    gemm = ((stack["wf"] - stack["ef"]) / eff(stack["md"]) + stack["ef"] / eff(stack["me"])) / stack["peak"]
    steps = (stack["layers"] * p["layer_overhead_s"] + stack["comm"] + np.maximum(stack["wb"] / bw, gemm)
             + np.maximum(stack["cb"] / bw, (stack["af"] / p["attention"] + stack["kf"] / p["kda"]) / stack["peak"]))
    steps = steps + p.get("prefill_fixed_s", 0.0) * stack["first"]
    return np.bincount(stack["row"].astype(int), weights=steps, minlength=stack["n"])


def _loss(stack: dict, measured: np.ndarray, p: dict) -> float:
    return float(np.sum(np.log(_model(stack, p) / measured) ** 2))


def fit_kernels(start: Kernels = REPORT_KERNELS, rounds: int = 12, grid: int = 81, *,
                report: Deployment = REPORT_TP4_H800, free: tuple[str, ...] = _ALL_FREE,
                bounds: dict | None = None, prefill_fixed_s: float = 0.0,
                details: bool = False):
    """Fit the ``free`` fields of :class:`Kernels` to the report's rows modelled on ``report``,
    minimising the squared log error: coordinate search on log grids that narrow each round
    (deterministic). The other fields stay as in ``start``; ``bounds`` narrows a field's range
    (e.g. attention within the published FlashAttention figures). Returns the kernels and the
    root-mean-square log error."""
    unknown = set(free) - set(_BOUNDS)
    if unknown or not free:
        raise ValueError(f"free={free!r}: expected a non-empty subset of {tuple(_BOUNDS)}")
    box = _BOUNDS | (bounds or {})
    fit_rows = [r for r in rows(report) if r.fitted]
    stack, measured = _stack(fit_rows), np.array([r.measured for r in fit_rows])
    p = {k: getattr(start, k) for k in _ALL_FREE} | {"gemm_half_ridge": start.gemm_half_ridge,
                                                      "prefill_fixed_s": prefill_fixed_s}
    for k in free:
        p[k] = min(max(p[k], box[k][0]), box[k][1])
    width = {k: math.log(box[k][1] / box[k][0]) for k in free}
    for _ in range(rounds):
        for k in free:
            lo, hi = box[k]
            centre = math.log(p[k])
            values = np.exp(np.linspace(centre - width[k] / 2, centre + width[k] / 2, grid)).clip(lo, hi)
            losses = [_loss(stack, measured, p | {k: v}) for v in values]
            p[k] = float(values[int(np.argmin(losses))])
            width[k] *= 0.5
    rms = math.sqrt(_loss(stack, measured, p) / len(fit_rows))
    kernels = replace(start, **{k: p[k] for k in free if k in _ALL_FREE})
    return (kernels, rms, p["prefill_fixed_s"]) if details else (kernels, rms)


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


# The report's hardware is not stated: the alternatives the fit tries (name -> deployment).
HARDWARE: dict[str, Deployment] = {
    "4 x H800, TP4": REPORT_TP4_H800,
    "8 x H800, TP8": REPORT_TP4_H800.with_(name="report-tp8-h800 (assumed)", n_devices=8),
    "2 x H800, TP2": REPORT_TP4_H800.with_(name="report-tp2-h800 (assumed)", n_devices=2),
    "8 x H20, TP8": REPORT_TP4_H800.with_(name="report-tp8-h20 (assumed)", device=H20, n_devices=8),
    "4 x H20, TP4": REPORT_TP4_H800.with_(name="report-tp4-h20 (assumed)", device=H20, n_devices=4),
}
OVERHEADS = ("eager", "graph")


def operator_kernels() -> Kernels:
    """The kernels the operator measurements give before the report is consulted: GEMM curve from
    Vidur's H100 rows, KDA from FlashKDA carried to an H100 (central), CUDA-graph overhead."""
    g = operators.fit_gemm("H100")
    return replace(CALIBRATED, gemm=g.peak_fraction, gemm_half_ridge=g.half_ridge, bandwidth=g.bandwidth,
                   kda=operators.KDA_ON_H100["central"], layer_overhead_s=operators.graph_layer_overhead_s())


@dataclass(frozen=True)
class ReportFit:
    """What is left fitted to the report under one hardware assumption and one overhead model."""

    hardware: str
    overhead: str  # "eager": per-layer overhead fitted; "graph": fixed at the CUDA-graph floor
    kernels: Kernels
    prefill_fixed_s: float  # a constant per prefill in the report's timings that no kernel explains
    rms: float  # root-mean-square log error over the fitted rows
    fit_errors: tuple[float, ...]  # model / measured - 1 on each fitted row
    held_out: tuple[tuple[str, float], ...]  # (deployment, error) of each SGLang row, CUDA-graph overhead


def fit_report(hardware: str = "4 x H800, TP4", overhead: str = "eager", rounds: int = 12,
               grid: int = 41) -> ReportFit:
    """Fit attention (within FlashAttention-2..3), bandwidth, a per-prefill constant and, when
    ``overhead`` is "eager", the per-layer overhead to the report's rows on ``HARDWARE[hardware]``;
    the GEMM and KDA numbers stay as the operator measurements give them. The held-out SGLang rows
    are modelled with the fitted efficiencies and CUDA-graph overhead (SGLang captures its decode
    steps in CUDA graphs)."""
    if hardware not in HARDWARE:
        raise ValueError(f"hardware={hardware!r}: expected one of {list(HARDWARE)}")
    if overhead not in OVERHEADS:
        raise ValueError(f"overhead={overhead!r}: expected one of {OVERHEADS}")
    report = HARDWARE[hardware]
    start = replace(operator_kernels(), attention=0.6)
    free = ("attention", "bandwidth", "prefill_fixed_s") + (("layer_overhead_s",) if overhead == "eager" else ())
    kernels, rms, fixed = fit_kernels(start, rounds, grid, report=report, free=free, prefill_fixed_s=0.02,
                                      bounds={"attention": (operators.FLASH_ATTENTION_2, operators.FLASH_ATTENTION_3)},
                                      details=True)
    fit_errors, held = [], []
    graph = replace(kernels, layer_overhead_s=operators.graph_layer_overhead_s())
    for r in rows(report):
        if r.fitted:
            extra = fixed if r.what == "prefill s" else 0.0
            fit_errors.append((modelled(r, kernels) + extra) / r.measured - 1.0)
        elif r.what == "output tokens/s":
            held.append((r.deployment.name, modelled(r, graph) / r.measured - 1.0))
    return ReportFit(hardware, overhead, kernels, fixed, rms, tuple(fit_errors), tuple(held))


def report_fits(rounds: int = 12, grid: int = 41) -> list[ReportFit]:
    """:func:`fit_report` under every hardware assumption and both overhead models, best fit first."""
    fits = [fit_report(h, o, rounds, grid) for h in HARDWARE for o in OVERHEADS]
    return sorted(fits, key=lambda f: f.rms)
