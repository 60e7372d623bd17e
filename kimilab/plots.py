"""The book's house plot style: one colour and one name per method, everywhere.

Chapters call :func:`use_style` once, take colours and labels from
:func:`color` / :func:`label` (so "dual" is the same green in chapter 6 and
chapter 12), and save every figure with :func:`save`, which writes
``figures/chNN-<name>.png`` at the repository root.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import matplotlib.pyplot as plt

__all__ = ["METHODS", "use_style", "color", "label", "save", "figures_dir", "style_of"]

# key -> (label shown in legends, colour). Keys are lower-case, hyphenated.
# Colours come from a colour-blind-safe palette (Okabe-Ito + Tableau).
METHODS: dict[str, tuple[str, str]] = {
    # chapter 1-3: caches and models
    "no-cache": ("recompute (no cache)", "#999999"),
    "kv-cache": ("KV cache", "#0072B2"),
    "kda-state": ("KDA state", "#D55E00"),
    "conv-state": ("conv state", "#CC79A7"),
    "linear-attention": ("linear attention", "#56B4E9"),
    "delta-rule": ("delta rule", "#E69F00"),
    "gated-delta": ("gated delta rule", "#F0E442"),
    "recurrent": ("recurrent KDA", "#E69F00"),
    "chunked": ("chunked KDA", "#009E73"),
    "hybrid": ("hybrid 3 KDA : 1 MLA", "#009E73"),  # Kimi-Linear-48B: 20 KDA + 7 MLA layers
    "all-mla": ("all-MLA baseline", "#8C564B"),
    "gqa": ("GQA (8B-class)", "#CC79A7"),
    "weights": ("model weights", "#555555"),
    "measured": ("measured", "#000000"),
    "analytic": ("analytic", "#999999"),
    # chapter 4: pools and the kinds of pages they hold
    "unified": ("unified pool", "#009E73"),
    "split": ("split pools", "#E69F00"),
    "vllm-padded": ("vLLM-style padded", "#0072B2"),
    "jenga": ("Jenga-style LCM", "#CC79A7"),
    "kv": ("KV pages", "#0072B2"),
    "kda_state": ("KDA state", "#D55E00"),
    "conv_state": ("conv state", "#CC79A7"),
    "checkpoint": ("state checkpoint", "#E69F00"),
    "scratch": ("scratch", "#F0E442"),
    "free": ("free", "#EEEEEE"),
    # chapters 5-6: workloads and prefix-cache policies
    "chat": ("multi-turn chat", "#0072B2"),
    "agent": ("agent / tool loop", "#D55E00"),
    "document": ("shared-document Q&A", "#009E73"),
    "conversation": ("Mooncake-like conversation (generated)", "#CC79A7"),
    "mooncake": ("Mooncake conversation (real, Kimi)", "#000000"),
    "kv-only": ("kv-only (attention bound)", "#999999"),
    "every-block": ("every-block (a state per 512-token block)", "#0072B2"),
    "align": ("align (chunk ends, 512-token blocks)", "#E69F00"),
    "ends": ("ends (request ends, LRU)", "#D55E00"),
    "ends+branch": ("ends+branch (= dual, alpha 0)", "#CC79A7"),
    "dual": ("dual (branch points + ends)", "#009E73"),
    "marconi": ("Marconi (as published, online alpha)", "#8C564B"),
    "oracle": ("clairvoyant (knows the future)", "#000000"),
    "vllm-align": ("vLLM align (its own blocks)", "#56B4E9"),
    "sglang-no-buffer": ("SGLang no_buffer (split pools)", "#F0E442"),
    "sglang-extra-buffer": ("SGLang extra_buffer (split pools)", "#B8860B"),
    "lru": ("LRU", "#56B4E9"),
    # chapters 7-8: speculative decoding and rollback
    "snapshot": ("snapshots, copy-back (SGLang)", "#D55E00"),
    "slot": ("snapshot slots, selected (vLLM)", "#CC79A7"),
    "replay": ("projection replay", "#009E73"),
    "ring": ("ring buffer", "#0072B2"),
    "lazy-ring": ("lazy ring (ReplaySSM)", "#E69F00"),
    "trim-only": ("KV trim only (wrong)", "#999999"),
    "plain-decode": ("plain decoding", "#000000"),
    "spec-k1": ("k = 1 draft", "#009E73"),
    "spec-k2": ("k = 2 drafts", "#56B4E9"),
    "spec-k4": ("k = 4 drafts", "#E69F00"),
    "spec-k8": ("k = 8 drafts", "#CC79A7"),
    # chapter 10: routers and isolation
    "round-robin": ("round-robin", "#999999"),
    "least-loaded": ("least-loaded", "#0072B2"),
    "least-work": ("least-work (prompt tokens)", "#56B4E9"),
    "prefix-affinity": ("prefix affinity (KV hit, SGLang-style)", "#E69F00"),
    "cost": ("cost (predicted TTFT, Dynamo-style)", "#CC79A7"),
    "state-aware": ("state-aware (usable seconds saved)", "#009E73"),
    "approximate": ("prefix affinity, router's own tree", "#8C564B"),
    "isolation-none": ("no isolation (FIFO, shared cache)", "#D55E00"),
    "isolation-quota": ("quotas + fair admission (VTC)", "#009E73"),
    # chapter 9: context parallelism
    "cp-sequential": ("sequential state pass", "#E69F00"),
    "cp-allgather": ("all-gather + local fold (fla)", "#009E73"),
    "cp-tree": ("log-depth tree scan", "#0072B2"),
    "cp-wall": ("wall clock, this machine (2 cores)", "#000000"),
    "cp-predicted": ("cost model, GPU cluster (assumed)", "#999999"),
    "cp-needed": ("only what is needed (flags, then neighbours)", "#CC79A7"),
    "cp-relay": ("relay (each slice after the state arrives)", "#D55E00"),
    "cp-flushed": ("flushed: random keys, Kimi's gate", "#56B4E9"),
    "cp-living": ("living: keys in 16 of 64 dims, slow gate", "#8C564B"),
    "cp-contiguous": ("contiguous slices", "#E69F00"),
    "cp-zigzag": ("zigzag (2P chunks)", "#009E73"),
    "cp-relay-pipelined": ("relay pipelined across layers", "#CC79A7"),
    # chapter 11: the experiment, Part B (48B fleet on the real trace)
    "usable-hit": ("usable hit (KV + state)", "#009E73"),
    "kv-hit": ("KV hit (blocks found)", "#0072B2"),
    "ttft-p50": ("TTFT p50", "#56B4E9"),
    "ttft-p99": ("TTFT p99", "#D55E00"),
    "cost-fleet": ("fixed fleet, whole run (rent)", "#555555"),
    "cost-busy": ("busy accelerator time only", "#E69F00"),
    "none": ("no prefix reuse", "#999999"),
    "all-mla-fp8": ("all-MLA, fp8 KV", "#D55E00"),
    "tpot-p99": ("TPOT p99", "#0072B2"),
    # chapter 12: the opposition
    "chunk-ends": ("chunk ends (vLLM align)", "#56B4E9"),
    "softmax-recall": ("KV cache + softmax (a global layer)", "#0072B2"),
}

_FALLBACK = ["#000000", "#56B4E9", "#E69F00", "#009E73", "#0072B2", "#D55E00", "#CC79A7"]


def use_style() -> None:
    """Apply the house rcParams (sizes, grid, no top/right spines, fixed DPI)."""
    plt.rcParams.update(
        {
            "figure.figsize": (7.0, 4.2),
            "figure.dpi": 100,
            "savefig.dpi": 120,
            "savefig.bbox": "tight",
            "font.size": 10,
            "axes.titlesize": 11,
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "legend.frameon": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "lines.linewidth": 2.0,
            "lines.markersize": 5,
            "svg.hashsalt": "kimilab",
        }
    )


def _lookup(key: str) -> tuple[str, str]:
    try:
        return METHODS[key]
    except KeyError:
        raise ValueError(
            f"method key={key!r}: not in kimilab.plots.METHODS; known keys: {sorted(METHODS)}"
        ) from None


def color(key: str) -> str:
    """The fixed colour of a method or cache kind."""
    return _lookup(key)[1]


def label(key: str) -> str:
    """The fixed legend name of a method or cache kind."""
    return _lookup(key)[0]


def style_of(key: str) -> dict:
    """Keyword arguments for ``ax.plot``: ``ax.plot(x, y, **style_of("dual"))``."""
    name, colour = _lookup(key)
    return {"label": name, "color": colour}


def figures_dir() -> Path:
    """``$KIMILAB_FIGURES`` if set, else ``figures/`` beside the repository's chapters/."""
    env = os.environ.get("KIMILAB_FIGURES")
    if env:
        return Path(env)
    here = Path.cwd().resolve()
    for candidate in (here, *here.parents):
        if (candidate / "chapters").is_dir() and (candidate / "kimilab").is_dir():
            return candidate / "figures"
    return here / "figures"


_NAME = re.compile(r"^ch\d\d-[a-z0-9][a-z0-9-]*$")


def save(fig, name: str) -> Path:
    """Save ``fig`` as ``figures/<name>.png``; ``name`` must look like ``ch05-hit-rate``.

    PNG metadata is stripped so the bytes do not depend on the matplotlib version.
    """
    if not _NAME.match(name):
        raise ValueError(f"figure name={name!r}: expected 'chNN-<lowercase-words>', e.g. 'ch05-hit-rate'")
    out = figures_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, metadata={"Software": None})
    return path
