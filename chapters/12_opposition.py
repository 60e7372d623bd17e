# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12. The opposition: where each method stops paying
#
# **What you'll build.** For every method of the book, the regime where it is a *net
# loss* -- worse than not using it at all -- found by root-finding, with a band, on a
# named deployment, batch and load. And the axis chapters 1-11 left out: what a
# fixed-size state forgets.
#
# **What you'll learn.**
# - How to read a verdict: a crossing or "pays everywhere / never in the sweep", which
#   inputs behind it are measured, fitted or assumed, and whether it holds across the
#   plausible kernel numbers.
# - How many key-value pairs a KDA state gives back, against a KV cache.
# - Where the hybrid, the page pool, prefix caching, speculation, context parallelism,
#   prefix affinity and tenant isolation each cost more than they save.
# - What the hybrid's machinery costs in code, and which numbers carry over to a GPU.
#
# **What you'll need.** Chapters 1-11: every number comes from their code. Times are
# the calibrated cost model's (chapter 3), not measurements on a GPU.
# Reference pages: [glossary](glossary.md), [notation](notation.md), [API](api.md).

# %% tags=["setup", "remove-cell"]
# Setup. On Colab this fetches the book and installs it; on your own machine it does nothing.
import os
import subprocess
import sys

if "google.colab" in sys.modules:
    BOOK = "/content/kimilab"
    if not os.path.isdir(BOOK):
        subprocess.run(["git", "clone", "-q", "--depth", "1", "-b", "main", "https://github.com/kimilab/kimilab", BOOK],
                       check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", BOOK], check=True)
    sys.path.insert(0, BOOK)
    os.chdir(os.path.join(BOOK, "chapters"))

# %%
import matplotlib.pyplot as plt
import numpy as np

import kimilab.traffic as wl
from kimilab import costs, cp, plots, recall
from kimilab.config import all_mla_27, kimi_linear_48b
from kimilab.costs import spec as spec_costs
from kimilab.exercises import verify
from kimilab.notebook import key_results, show_source, show_table
from kimilab.stored import stored
from kimilab.verdict import Crossover, band, crossover

plots.use_style()
CFG, BASE = kimi_linear_48b, all_mla_27
DEP = costs.DEFAULT_DEPLOYMENT  # vLLM's published recipe: TP4 on H200
CP_DEP = costs.VLLM_TP8_H200  # chapter 9's GPU numbers: eight H200 per node
DEPS = [DEP, costs.VLLM_TP8_H200, costs.DP4_EP4_H200, costs.ONE_H200]
REAL = wl.load_trace(f"../data/{wl.MOONCAKE_CONVERSATION}", 512)
chat_prompts = np.array([r.input_length for r in REAL])
MED = int(np.median(chat_prompts))  # a verdict in tokens is tested against the median real chat prompt
VARIANTS = costs.member_deployments(DEP)  # DEP under each plausible kernel set, the central one first
ROWS = {}  # the closing table: method -> (net loss where, band, verdict), filled in section by section
print(f"default deployment: {DEP.describe()}")
print(f"real traffic: {len(REAL):,} chat requests (Mooncake), median prompt {MED:,} tokens")
print(f"kernel band: {len(VARIANTS)} kernel sets = " + " x ".join(f"{len(o)} {a}" for a, o in costs.AXES))

# %%
# Key results (each number is computed here and derived step by step below)
SEEDS, GROUPS = list(range(8)), [[2 * g, 2 * g + 1] for g in range(4)]  # 8 seeds; 4 groups of two: the band
HALF = stored("ch12_recall_capacity", recall.half_capacities, memories=["linear", "delta", "kda"], groups=GROUPS)
capacity = {m: band(Crossover(**c) for c in HALF[m]) for m in ("linear", "delta", "kda")}  # pairs at half right
mem_cross = {d.name: costs.crossover_tokens(CFG, BASE, d) for d in DEPS}
dp = costs.DP4_EP4_H200.name


def be4(d, b):  # break-even acceptance per draft, k = 4 drafts, 4,096-token contexts
    return spec_costs.break_even_acceptance(CFG, d, 4096, 4, batch=b)


be1, be512 = (costs.band(lambda d, b=b: be4(d, b), DEP) for b in (1, 512))
spec_rise = costs.band(lambda d: be4(d, 512) / be4(d, 1), DEP, lambda r: r > 1)  # serving batch needs more?
cp8 = costs.band(lambda d: crossover(lambda T: cp.model_cp_prefill(CFG, int(T), 8, deployment=d, affine_cost=1.25,
                 layout="zigzag")["efficiency"] - 0.5, 256, 2**22, grid=13).x, CP_DEP, lambda x: x > MED)
key_results(
    f"A 128 x 128 KDA state reads back half of N random key-value pairs only up to {capacity['kda'][1]:,.0f} "
    f"pairs (band {capacity['kda'][0]:,.0f}-{capacity['kda'][2]:,.0f}); a KV cache gives back every one.",
    f"The hybrid holds more bytes per device than all-MLA below {mem_cross[DEP.name]:,} tokens on TP4 and "
    f"below {mem_cross[dp]:,} with whole requests per device, where "
    f"{np.mean(chat_prompts < mem_cross[dp]):.1%} of real chat prompts fall (bytes: no kernel number moves it).",
    f"Speculation with k = 4 drafts pays from an acceptance of {be1.central:.3f} per draft at batch 1 but needs "
    f"{be512.central:.3f} at batch 512 on TP4 ({be512.lo:.3f}-{be512.hi:.3f} over {len(VARIANTS)} kernel sets; "
    f"that batch 512 needs more {spec_rise.label}).",
    f"Context parallelism over 8 devices is worth half its devices only from {cp8.central:,.0f} tokens of prompt "
    f"(whole model; {cp8.lo:,.0f} to {cp8.hi:,.0f} over the kernel sets), so it wastes more than half of them on "
    f"the median chat prompt ({MED:,} tokens); that {cp8.label}.",
)

# %% [markdown]
# ## How to read a verdict
#
# <a id="term-net-loss"></a>A method *pays* where its gain over not using it is above
# zero; where the gain is below zero it is a **net loss**: worse than not using it at all.
#
# <a id="term-verdict"></a>A **verdict** names the point where the gain crosses zero and
# the side on which the method pays. `crossover` evaluates the gain on a grid, bisects
# the first sign change to a relative 0.1%, and says "pays everywhere in the sweep" or
# "never pays in the sweep" when there is none (a grid alone cannot tell a crossing from
# the sweep's edge):

# %%
show_source(crossover)

# %% [markdown]
# <a id="term-band"></a>A verdict's **band** is the range its crossing takes when the
# numbers under it move over their plausible values: seeds, trace windows, and for times
# the 36 kernel sets of `costs.members()`: the GEMM curve's measured spread, FlashKDA's
# H20 speed carried three ways to an H100, 4 or 8 H800s behind the Kimi Linear report,
# CUDA-graph or eager overhead. `costs.band` labels a verdict: it *holds across the band*,
# *flips under N of 36 sets*, or is *byte-driven*, when no kernel number moves it.
#
# ### Deep dive: the cost model's inputs, and the band's four axes
#
# Of the inputs, 7 are sourced from datasheets and recipes and 4 are kernel numbers
# measured (Vidur's GEMMs and kernel floors, FlashKDA). Another 4 are fitted: attention
# and bandwidth to the Kimi Linear report, the link to measured all-reduces. The last 3
# are assumed.

# %%
inputs = costs.inputs(DEP)
print({s: sum(r["status"] == s for r in inputs) for s in ("sourced", "measured", "fitted", "assumed")})
show_table([(r["status"], r["name"], f"{r['value']:,.4g}" if isinstance(r["value"], float) else str(r["value"]),
             r["unit"]) for r in inputs], ["status", "input", "value", "unit"],
           title=f"Inputs of {DEP.name}'s numbers")


# %%
def changes(ch):
    """What one choice changes in the central kernel set, in its units."""
    return ", ".join(f"{k} {v * 1e6:.0f} us" if k.endswith("_s") else f"{k} {v:.3g}" for k, v in ch.items()) or "-"


print(f"central: GEMM {costs.CALIBRATED.gemm:.3g} of peak (asymptote), attention {costs.CALIBRATED.attention:.3g}, "
      f"KDA {costs.CALIBRATED.kda:.3g}, bandwidth {costs.CALIBRATED.bandwidth:.3g}, "
      f"{costs.CALIBRATED.layer_overhead_s * 1e6:.0f} us per layer")
show_table([(axis, choice, changes(ch)) for axis, opts in costs.AXES for choice, ch in opts],
           ["axis", "choice", "changes to the central set"],
           title=f"The band: every combination of these choices, {len(costs.members())} kernel sets")

# %% [markdown]
# ## 1. What a state forgets: associative recall
#
# Every chapter so far priced the hybrid's cache; none asked what it costs in quality. A
# KDA layer keeps a fixed K x V matrix; a KV cache keeps every token.
#
# <a id="term-associative-recall"></a>**Associative recall** (MQAR) tests exactly that:
# write N (key, value) pairs into a memory, then ask for the value of each key. Zoology
# ([zoology](references.md#zoology)) found this one skill explains 82% of the perplexity
# gap between gated-convolution models and attention.
#
# `kimilab.recall` runs it on the book's kernels: random unit keys in K = 128 dimensions,
# values from a vocabulary of 2,048 random embeddings, a read-back right when its nearest
# vocabulary entry is the value stored; eight seeds. Four memories: a KV cache read by
# sharp softmax; plain linear attention (a state that only adds); the delta rule (KDA
# with its gate at zero); and KDA with Kimi's initial forget gate.
#
# <a id="term-recall-capacity"></a>A memory's **recall capacity** is the number of pairs
# at which it falls below half right, bisected once per group of two seeds (the band;
# the Key results cell computed it):

# %%
PAIRS = np.unique(np.geomspace(16, 4096, 17).astype(int))
acc = {m: np.array(v) for m, v in stored("ch12_recall_sweep", recall.recall_sweep, memories=list(recall.MEMORIES),
                                         pairs=PAIRS.tolist(), seeds=SEEDS).items()}  # [pairs, (mean, std)]
for m, (lo, mid, hi, _) in capacity.items():
    print(f"{m:<7}: right on half the pairs up to {mid:,.0f} pairs (band over seed groups {lo:,.0f}-{hi:,.0f})")
print(f"softmax: lowest accuracy over the sweep {acc['softmax'][:, 0].min():.3f} "
      f"(16-{PAIRS[-1]:,} pairs): it never falls below half")
state_bytes, kv_pair_bytes = 128 * 128 * 4, (128 + 128) * 2  # one fp32 KDA head state; one bf16 K + V
same_bytes = state_bytes // kv_pair_bytes
kda_there = recall.recall("kda", same_bytes, seeds=SEEDS)
print(f"one head's KV cache holds as many bytes as one KDA state at {same_bytes} pairs; "
      f"there KDA gives back {kda_there.mean:.3f}")

# %%
MEMORY_STYLE = {"softmax": "softmax-recall", "linear": "linear-attention", "delta": "delta-rule", "kda": "kda-state"}
fig, ax = plt.subplots(figsize=(7.5, 4.2))
for m in recall.MEMORIES:
    mean, std = acc[m].T
    ax.plot(PAIRS, mean, marker="o", ms=3, **plots.style_of(MEMORY_STYLE[m]))
    ax.fill_between(PAIRS, mean - std, mean + std, color=plots.color(MEMORY_STYLE[m]), alpha=0.2)
ax.axhline(0.5, color="black", lw=0.8, ls=":", label="half right (capacity)")
ax.axvline(same_bytes, color="#999999", lw=0.8, ls="--", label=f"KV of one head = one state's bytes ({same_bytes})")
ax.set_xscale("log", base=2)
ax.set(xlabel="pairs written (N)", ylabel="fraction read back right",
       title="Recall against N (K = V = 128; 8 seeds, band = 1 std)")
ax.legend(fontsize=7.5, loc="lower left")
plots.save(fig, "ch12-recall")
plt.show()

# %% [markdown]
# Takeaway: softmax over a KV cache gives back every pair up to 4,096; a 128 x 128
# state gives back half only up to a few hundred -- 194 pairs for KDA (band 190-197), 320
# for the delta rule. Linear attention holds more (1,246) because it only adds. At 128
# pairs one head's KV cache costs as many bytes as one fp32 state, which still gives back
# 0.766: below that the state is the cheaper memory, above it only the cache keeps all.
#
# For the hybrid, anything older than its states hold must come from its 7 MLA layers:
# the 3 : 1 ratio bets one global layer in four is enough. This untrained, random-key
# experiment cannot settle that bet.
#
# The deep dives find that KDA forgets its oldest pairs first, that linear attention
# cannot rebind a key (0.500 read the new value), that the Kimi Linear report beats MLA
# on 5 of 8 long-context tasks, and that training MQAR models here would take about 256
# hours.
#
# ### Deep dive: the recall table, what is forgotten first, and rebinding

# %%
lo_k, mid_k, hi_k, _ = capacity["kda"]
ROWS["KDA state (recall)"] = (f"past {mid_k:,.0f} pairs (under half right)", f"{lo_k:,.0f}-{hi_k:,.0f}", "no kernel time")
show_table([[n] + [f"{acc[m][i, 0]:.3f}+-{acc[m][i, 1]:.3f}" for m in recall.MEMORIES]
            for i, n in enumerate(PAIRS)], ["pairs"] + list(recall.MEMORIES),
           title="Fraction read back right, mean +- std over 8 seeds")

# %%
N_AGE = 256
age = {m: recall.recall(m, N_AGE, seeds=SEEDS).by_distance for m in ("linear", "delta", "kda")}
rebind = {m: recall.rebinding(m, 64, seeds=SEEDS) for m in recall.MEMORIES}
fig, ax = plt.subplots(figsize=(7.0, 4.0))
window = 16  # a running mean over 16 neighbouring distances
for m in ("linear", "delta", "kda"):
    smooth = np.convolve(age[m], np.ones(window) / window, mode="valid")
    ax.plot(np.arange(len(smooth)) + window // 2, smooth, **plots.style_of(MEMORY_STYLE[m]))
ax.axhline(1.0, **plots.style_of("softmax-recall"))
ax.set(xlabel=f"distance: pairs written after this one (of N = {N_AGE})", ylabel="fraction read back right",
       title="What is forgotten first (running mean of 16)")
ax.legend(fontsize=7.5, loc="lower left")
plots.save(fig, "ch12-recall-age")
plt.show()
for m in recall.MEMORIES:
    print(f"rebinding 64 keys to new values, {m:<7}: {rebind[m][0]:.3f} +- {rebind[m][1]:.3f} read the NEW value")
small = crossover(lambda n: recall.recall("delta", int(n), d_k=16, d_v=16, seeds=SEEDS).mean - 0.5, 2, 512,
                  integer=True, grid=9)
print(f"delta rule in a 16 x 16 state (chapter 2's): right on half the pairs up to {small.x:,.0f} pairs")

# %% [markdown]
# Both state memories lose their oldest pairs first, and KDA's gate reaches them sooner
# than the delta rule's overwrites do. Plain linear attention holds the most pairs but
# cannot *change* a value: rebinding a key leaves the
# old and new value mixed (0.500 read the new one), where the delta rule gets 1.000 and
# KDA 0.994. That is why the delta rule exists, and its price is that each write erases
# part of the older pairs. (Softmax over identical keys mixes too, 0.463: a real
# attention layer tells the two writes apart by position, which this test leaves out.)
# Chapter 2's read-back curve is the same effect in a 16 x 16 state: half right up to 14
# pairs. The literature agrees: Jelassi et al. ([jelassi](references.md#jelassi)) prove
# that a model with a fixed-size state cannot copy a string longer than the state can
# hold, and Park et al. ([mambaformer](references.md#mambaformer)) find Mamba falling
# short on retrieval where a hybrid with attention blocks does well.
#
# ### Deep dive: what the Kimi Linear report measures, and why we train nothing here
#
# The report's long-context table ([kimi-report](references.md#kimi-report), Table 5:
# 128k context, every model trained on 1.4T tokens with the same recipe) is the
# published evidence:

# %%
import csv
import json
from pathlib import Path

lines = [ln for ln in Path("../data/kimi_linear_long_context.csv").read_text().splitlines() if not ln.startswith("#")]
table5 = list(csv.reader(lines))
names = table5[0][1:]
rows = {r[0]: np.array(r[1:], dtype=float) for r in table5[1:]}
gap = rows["Kimi Linear"] - rows["MLA"]
tasks = gap[:-1]
print(f"Kimi Linear ahead on {np.sum(tasks > 0)} of {len(tasks)} tasks, behind on {np.sum(tasks < 0)}; "
      f"the differences range from {tasks.min():+.1f} to {tasks.max():+.1f} points")
show_table(list(zip(names, rows["MLA"], rows["Kimi Linear"], [f"{d:+.1f}" for d in gap])),
           ["benchmark", "MLA", "Kimi Linear", "difference"], formats={"MLA": ".1f", "Kimi Linear": ".1f"},
           title="Kimi Linear report, Table 5 (128k context)")

# %% [markdown]
# So the report's "outperforms MLA" holds on average (+2.3 points) and on the
# recall-heavy tasks (RULER +3.0, MRCR +7.0, RepoQA +5.5), and fails on three of eight:
# LongBench v2 (-1.1) and Frames (-1.7), both multi-document reasoning, and Long Code
# Arena's commit task (-0.5; the report's text names only the first two). Its bounds are
# narrow: one model size (48B total, 3B active), one training budget, contexts up to
# 128k, one run per model with no spread reported; its synthetic MQAR test (section 5.1)
# uses two-layer models up to 2,048 tokens. The claim is "no worse at this scale on these
# tasks", not "a state recalls like a cache": our curve says it does not.
#
# **Could we train the models here?** `bench/mqar_training.py` measured what tiny
# attention, KDA and hybrid models cost to train on MQAR on this machine (PyTorch's CPU
# build; its results are stored in `data/`):

# %%
mqar = json.loads(Path("../data/mqar_training.json").read_text())
print(f"measured {mqar['measured']} on {mqar['machine']}, torch {mqar['torch']}, {mqar['threads']} thread")
# the report's protocol (section 5.1): up to 20,000 steps, 4 learning rates, lengths 256-2,048 tokens
per_token = max(r["seconds_per_step"] / r["tokens"] for r in mqar["rows"] if r["model"] == "kda")
hours = 20_000 * 4 * per_token * sum((256, 512, 1024, 2048)) / 3600
print(f"the report's grid for the KDA model alone, at the slowest measured seconds per token: {hours:,.0f} hours")
show_table([(r["model"], r["pairs"], r["tokens"], r["seconds_per_step"], r["steps"], r["accuracy"], r["chance"])
            for r in mqar["rows"]], ["model", "pairs", "tokens", "s/step", "steps", "accuracy", "chance"],
           formats={"s/step": ".4f", "accuracy": ".3f", "chance": ".4f"}, title="MQAR training on this CPU")

# %% [markdown]
# The token-by-token KDA layer costs a fixed time per token, so the report's protocol for
# the KDA model alone would take about 256 hours on this machine, before the attention
# and hybrid models. In 600 steps none of the three learns 32 pairs (all within 0.04 of
# chance), so a short run cannot say where each fails, and we report no trained
# capacity. The one hint the run gives -- at 8 pairs the hybrid reached 0.965 after 600
# steps, attention 0.539 and KDA 0.135 -- is one seed at one learning rate: a question
# for a GPU, not an answer.

# %% [markdown]
# ## 2. The hybrid model: short contexts pay for a state they do not need
#
# A hybrid request holds 20 KDA states whatever its length; all-MLA holds only KV. Under
# tensor parallelism a device holds a quarter (TP4) of every state but *all* of MLA's one
# latent KV head; under DP-attention it holds whole requests. A decode step reads the
# states of every request in the batch. Where does the hybrid stop losing?

# %%
BATCHES = [1, 4, 16, 64, 256, 512]
step_cross = {(d.name, b): costs.decode_crossover_tokens(CFG, BASE, d, b) for d in DEPS for b in BATCHES}
dp_band = {b: costs.band(lambda d: costs.decode_crossover_tokens(CFG, BASE, d, b), costs.DP4_EP4_H200,
                         lambda x: x > MED) for b in BATCHES}  # verdict: the median chat prompt loses
show_table([(d.name, mem_cross[d.name], step_cross[d.name, 1], step_cross[d.name, 512],
             np.mean(chat_prompts < mem_cross[d.name])) for d in DEPS],
           ["deployment", "memory", "step, B=1", "step, B=512", "chat prompts below memory"],
           formats={"chat prompts below memory": ".1%"}, title="Context (tokens) from which the hybrid stops losing")

# %%
fig, ax = plt.subplots(figsize=(7.8, 5.2))
for d, marker in zip(DEPS, "osD^"):
    ax.plot(BATCHES, [step_cross[d.name, b] for b in BATCHES], marker=marker, label=f"{d.name}: decode step")
    ax.axhline(mem_cross[d.name], color=ax.lines[-1].get_color(), ls=":", lw=1, label=f"{d.name}: memory")
ax.fill_between(BATCHES, [dp_band[b].lo for b in BATCHES], [dp_band[b].hi for b in BATCHES],
                color="#999999", alpha=0.3, label=f"dp4-ep4-h200 step: band over {len(VARIANTS)} kernel sets")
ax.axhspan(np.percentile(chat_prompts, 5), np.percentile(chat_prompts, 50), color=plots.color("mooncake"),
           alpha=0.08, label="real chat prompts, 5th-50th percentile")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set(xlabel="requests in the decode step (batch)", ylabel="context where the hybrid stops losing (tokens)",
       title="Hybrid vs all-MLA: below each line the hybrid is a net loss")
ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
plots.save(fig, "ch12-hybrid-surface")
plt.show()

# %% [markdown]
# Takeaway: on TP4 the hybrid holds less than all-MLA from 472 tokens and its step is no
# slower from 942 at any batch; with whole requests per device the memory crossover is
# 1,885 tokens and the step's 3,962 (batch 512) to 102,817 (batch 1, DP-attention). No
# chat prompt is under the TP4 crossover, but 22.1% are under the DP one: the net loss
# is a regime of short chats with whole requests per device.
#
# The deep dive finds the TP4 crossover byte-driven, DP-attention's at batch 64 between
# 3,768 and 5,316 tokens, no agent prompt short enough, and a TP4 step over 256-token
# contexts up to 20.1% slower than all-MLA's.
#
# ### Deep dive: every batch, the band, and the size of the loss

# %%
from IPython.display import display

AGENT = wl.load_sessions(f"../data/{wl.CLAUDE_CODE}")  # one row per agent request
agent_prompts = np.array([r.input_length for r in AGENT])
slow = {b: costs.decode_step_seconds(CFG, DEP, 256, b) / costs.decode_step_seconds(BASE, DEP, 256, b) - 1
        for b in BATCHES}
tp4_band = costs.band(lambda d: costs.decode_crossover_tokens(CFG, BASE, d, 512), DEP, lambda x: x > MED)
print(f"TP4 step crossover at batch 512: {tp4_band.describe('{:,.0f}', 'tokens')}")
print(f"DP-attention at batch 64: {dp_band[64].describe('{:,.0f}', 'tokens')}")


def fmt_band(lo, hi, f="{:,.0f}"):
    """'a' if the band is one value, else 'a-b'."""
    a, b = f.format(lo), f.format(hi)
    return a if a == b else f"{a}-{b}"


def short(b):
    """A band's label for a table cell: 'holds', 'flips n/36' or 'byte-driven'."""
    lab = b.label.split(":")[0].split(",")[0]
    return lab.replace("holds across the band", "holds").replace("flips under ", "flips ").replace(" of ", "/") \
        .replace(" sets", "")


ROWS["hybrid: memory"] = (f"contexts < {mem_cross[DEP.name]:,} (TP4), < {mem_cross[dp]:,} (DP)", "one value", "byte-driven")
ROWS["hybrid: DP step, B=64"] = (f"contexts < {step_cross[dp, 64]:,} tokens", fmt_band(dp_band[64].lo, dp_band[64].hi),
                                 short(dp_band[64]))


display(show_table([[b] + [step_cross[d.name, b] for d in DEPS] + [fmt_band(dp_band[b].lo, dp_band[b].hi),
                                                                   short(dp_band[b]), f"{slow[b]:+.1%}"]
                    for b in BATCHES],
                   ["batch"] + [d.name for d in DEPS] + ["dp4 band", "dp4 verdict", "TP4 at 256"],
                   title="Decode-step crossover (tokens); dp4 band: 36 kernel sets; TP4 at 256: hybrid step slower by"))
show_table([(d.name, mem_cross[d.name], np.mean(chat_prompts < mem_cross[d.name]),
             np.mean(agent_prompts < mem_cross[d.name])) for d in DEPS],
           ["deployment", "memory crossover", "chat below", "agent below"],
           formats={"chat below": ".1%", "agent below": ".1%"},
           title=f"Real prompts under the memory crossover ({len(REAL):,} chat, {len(AGENT):,} agent requests)")

# %% [markdown]
# ## 3. The unified page pool: barely ahead, and behind for small states
#
# In chapter 4 the unified pool ran within 3% of the best other layout. A layout wastes
# what it rounds up: the unified pool rounds many small objects up to a page each, vLLM
# pads every page to the largest state's size. With few KDA heads per device the states
# are small, and the unified pool's rounding costs more than vLLM's padding.
#
# The deep dive finds the unified pool the net loss below 3 heads per device, with
# little waste either way at Kimi-Linear-48B on TP4 (0.46% and 5.52% of a request). All
# of it is bytes, so no kernel number moves it.
#
# ### Deep dive: page waste against the state's size

# %%
from kimilab.costs import CacheShapes
from kimilab.pool import UnifiedPages, VllmPaddedPages

layouts = {"unified": UnifiedPages(), "vllm-padded": VllmPaddedPages()}


def waste_at(heads, key, tokens=4096):
    """Reserved-but-unused share of one request on one device of the default deployment."""
    cfg = CFG.with_(name=f"kimi-{heads}x4-heads", n_heads=int(heads) * DEP.tp)
    return layouts[key].footprint(CacheShapes.from_config(cfg, DEP), tokens).waste_fraction


pool_cross = crossover(lambda h: waste_at(h, "vllm-padded") - waste_at(h, "unified"), 1, 32, integer=True, grid=6)
kimi_heads = CFG.n_heads // DEP.tp
ROWS["unified page pool"] = (f"< {pool_cross.x:,.0f} KDA heads per device", "one value", "byte-driven")
print(f"vLLM's padding exceeds the unified pool's rounding: {pool_cross.describe('KDA heads per device')}")
print(f"Kimi-Linear-48B on TP4 ({kimi_heads} heads per device) wastes: unified {waste_at(kimi_heads, 'unified'):.2%}, "
      f"vLLM's pages {waste_at(kimi_heads, 'vllm-padded'):.2%}")

# %%
HEADS = np.array([1, 2, 4, 8, 16, 32])  # KDA heads per device (TP4: 8; one device: 32)
waste = {k: np.array([waste_at(h, k) for h in HEADS]) for k in layouts}
fig, ax = plt.subplots(figsize=(7.0, 3.8))
for k in layouts:
    ax.plot(HEADS, 100 * waste[k], marker="o", **plots.style_of(k))
ax.axvline(kimi_heads, color="black", ls=":", lw=1, label=f"Kimi-Linear-48B at TP4 ({kimi_heads} heads)")
ax.set_xscale("log", base=2)
ax.set(xlabel="KDA heads per device", ylabel="reserved but unused (% of a 4,096-token request)",
       title=f"Page waste on one {DEP.name} device")
ax.legend(fontsize=8)
plots.save(fig, "ch12-pool-waste")
plt.show()
show_table([[h] + [waste[k][i] for k in layouts] for i, h in enumerate(HEADS)], ["KDA heads per device"] + list(layouts),
           formats={k: ".2%" for k in layouts}, title="Reserved but unused, share of a 4,096-token request")

# %% [markdown]
# Takeaway: vLLM's equal pages waste more of a request the more KDA heads a device holds
# (16.31% at 32), while the unified pool's rounding stays below 2%; only at one or two heads
# per device is the padding the smaller waste.

# %% [markdown]
# ## 4. Prefix caching: a TTFT tail worse than no caching
#
# A state checkpoint costs pages that running requests could use. When memory is short
# and checkpoints dense, the cache can take more than its hits give back. Compare no
# caching with `ends` (chapter 6), chunk ends (vLLM's `align`) and a state at every
# 512-token block (TensorRT-LLM's interval), on one instance as the load rises.
#
# The deep dive runs 132 simulations over three windows of 2,000 real requests. On one
# H200 (a 3.3M-token pool against TP4's 12.3M) `every-block` makes the TTFT p99 worse
# than no caching from light load on (x0.2-0.4 of the trace's rate), and badly past it:
# 113.7 s against 5.2 s at x0.8. `ends` and chunk ends lose only at one H200's knee
# (x1.2), and on TP4 no policy loses.
#
# ### Deep dive: the TTFT sweep, window by window
#
# A TTFT is mostly prefill time, so the band reruns the first window under the two
# kernel sets that make an 8,192-token prefill fastest and slowest (33 and 51 ms against
# 38 ms). `every-block` still loses from x0.2 under both: the verdict holds.

# %%
from kimilab.experiment.runs import fleet_summaries, prefill_ends
from kimilab.stored import stored

POLICIES = {"none": "kv-only", "ends": "ends", "chunk-ends": "chunk-ends", "every-block": "every-block"}
WINDOWS = (0, 5000, 9000)
LOADS = {costs.ONE_H200.name: [0.2, 0.4, 0.6, 0.8, 1.0, 1.2], DEP.name: [2.0, 3.0, 4.0, 5.0, 6.0]}
runs, keys = [], []  # each run in JSON (kimilab.experiment.runs), so the sweep can be stored
for w in WINDOWS:
    for dep in (costs.ONE_H200, DEP):
        for scale in LOADS[dep.name]:
            for name, policy in POLICIES.items():  # "none": every block given an id nobody else uses
                window = {"trace": wl.MOONCAKE_CONVERSATION, "start": w, "n": 2000, "no_reuse": name == "none"}
                runs.append(dict(deployment=dep.name, instances=1, router="least-work", rate_scale=scale,
                                 policy=policy, requests=window))
                keys.append((w, dep.name, scale, name))
p99 = {k: r["ttft_p99_s"] for k, r in zip(keys, stored("ch12_prefix_sweep", fleet_summaries, runs=runs))}
print(f"{len(runs)} runs; pools: " + ", ".join(f"{d} {costs.capacity_tokens(CFG, costs.deployment(d)) / 1e6:.1f}M tokens"
                                               for d in LOADS))
for dep_name, scales in LOADS.items():
    cell = {(s, n): [p99[w, dep_name, s, n] for w in WINDOWS] for s in scales for n in POLICIES}
    display(show_table([[f"x{s:g}"] + [f"{np.mean(cell[s, n]):.1f} [{min(cell[s, n]):.1f}-{max(cell[s, n]):.1f}]"
                                        for n in POLICIES] for s in scales], ["load"] + list(POLICIES),
                       title=f"{dep_name}: TTFT p99 (s), mean [min-max] over {len(WINDOWS)} windows"))


# %%
def loss_band(dep_name, name):
    """Per window: the first load at which ``name``'s TTFT p99 exceeds no caching's, bracketed by the grid."""
    out = []
    for w in WINDOWS:
        worse = [s for s in LOADS[dep_name] if p99[w, dep_name, s, name] > p99[w, dep_name, s, "none"]]
        out.append(min(worse) if worse else None)
    return out


net_loss = {(d, n): loss_band(d, n) for d in LOADS for n in ("ends", "chunk-ends", "every-block")}
display(show_table([(d, n) + tuple("never" if x is None else f"from x{x:g}" for x in v) for (d, n), v in net_loss.items()],
           ["deployment", "policy"] + [f"window {w:,}" for w in WINDOWS],
           title="First load at which TTFT p99 is worse than no caching ('never': not in the sweep)"))

# The kernel band of a simulation: 36 fleet sweeps would take half an hour, and a TTFT is mostly prefill
# time, so each fleet verdict is rerun under the two kernel sets that make a prefill fastest and slowest.
pre = [costs.prefill_seconds(CFG, v, 8192) for v in VARIANTS]
END_SETS = prefill_ends()  # {"fastest": i, "slowest": j}: indices of the kernel sets
ENDS = {end: costs.members()[i] for end, i in END_SETS.items()}
print(f"an 8,192-token prefill on TP4: {pre[0] * 1e3:.0f} ms, band {min(pre) * 1e3:.0f}-{max(pre) * 1e3:.0f} ms")
for end, m in ENDS.items():
    print(f"  {end}: {m.differs()}")


def ends_label(holds):
    """'holds at both ends of the band', or which end flips it (``holds``: end -> does the verdict hold there)."""
    flips = [e for e, h in holds.items() if not h]
    return "holds at both ends of the band" if not flips else "flips under the " + " and ".join(flips) + " kernels"


def ends_short(holds):
    lab = ends_label(holds)
    return "holds" if lab.startswith("holds") else "flips (" + lab.removeprefix("flips under the ").removesuffix(" kernels") + ")"


def span(xs, f="{:g}", pre=""):
    """'lo-hi' (or one value) of the values found, 'never' if none was."""
    xs = [x for x in xs if x is not None]
    return "never" if not xs else fmt_band(min(xs), max(xs), pre + f)


def at_ends(name, runs):
    """Every run under each end of the band (stored as ``name``): end -> the runs' summaries."""
    got = stored(name, fleet_summaries, runs=[dict(r, kernels=i) for i in END_SETS.values() for r in runs])
    return {end: got[k * len(runs):(k + 1) * len(runs)] for k, end in enumerate(END_SETS)}


one = costs.ONE_H200.name
LIGHT = LOADS[one][:3]  # the first window, the lighter half of the loads
pairs = [(s, n) for s in LIGHT for n in ("none", "every-block")]
ends_p99 = at_ends("ch12_prefix_ends", [dict(deployment=one, instances=1, router="least-work", rate_scale=s,
                                             policy=POLICIES[n], requests={"trace": wl.MOONCAKE_CONVERSATION, "start": 0,
                                                                           "n": 2000, "no_reuse": n == "none"})
                                        for s, n in pairs])
eb_ends = {}
for end, res in ends_p99.items():
    v = {k: r["ttft_p99_s"] for k, r in zip(pairs, res)}
    eb_ends[end] = next((s for s in LIGHT if v[s, "every-block"] > v[s, "none"]), None)
    print(f"{end}: every-block worse than none from "
          + ("never in the sweep" if eb_ends[end] is None else f"x{eb_ends[end]:g}")
          + f"; TTFT p99 at x{LIGHT[-1]:g}: none {v[LIGHT[-1], 'none']:.1f} s, "
          f"every-block {v[LIGHT[-1], 'every-block']:.1f} s")
eb_one = [x for x in net_loss[one, "every-block"] if x is not None]
ROWS["prefix caching"] = (f"every-block on one H200, from x{span(eb_one)} load", span(eb_one + list(eb_ends.values()), pre="x"),
                          ends_short({e: (x is None) == (not eb_one) for e, x in eb_ends.items()}))

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.0))
for ax, (dep_name, scales) in zip(axes, LOADS.items()):
    for name in POLICIES:
        v = np.array([[p99[w, dep_name, s, name] for s in scales] for w in WINDOWS])
        ax.plot(scales, v.mean(axis=0), marker="o", **plots.style_of(name))
        ax.fill_between(scales, v.min(axis=0), v.max(axis=0), color=plots.color(name), alpha=0.15)
    ax.set_yscale("log")
    ax.set(xlabel="load (x the trace's own request rate)", ylabel="TTFT p99 (simulated s, log)",
           title=f"one instance, {dep_name}: {costs.capacity_tokens(CFG, costs.deployment(dep_name)) / 1e6:.1f}M-token pool")
axes[0].legend(fontsize=7.5, loc="upper left")
plots.save(fig, "ch12-prefix-net-loss")
plt.show()

# %% [markdown]
# On one H200 each fp32 checkpoint costs the KV of thousands of tokens (chapter 6), and
# `every-block` writes one per 512 tokens of prompt: the pool fills with states, fewer
# requests fit, and queues grow. `ends` and chunk ends (what vLLM keeps) are no worse
# than no caching below one H200's knee, and never on TP4.

# %% [markdown]
# Which states to keep at all is a question of the traffic's sharing structure (chapter
# 6's map of 100 generated traces at three cache reaches): states at request ends alone
# lose to a branch-point or chunk-boundary state where many prompts branch from a prefix
# no request ends at, or where reuse runs inside prompts.

# %%
from kimilab.sim import policy_map

cases = [(g, i) for g in policy_map.grid_cells(policy_map.shipped_map()).values() for i in range(len(policy_map.REACHES))]
lost = [policy_map.ends_gap(policy_map.mean_hits(g, i)) for g, i in cases if policy_map.regime(g, i) != "ends"]
print(f"ends loses in {len(lost)} of {len(cases)} mapped cases, by {min(lost):.3f} to {max(lost):.3f} of usable hit")
ROWS["states at request ends"] = ("shared prefix, reuse mid-prompt", span(lost, "{:.2f}") + " hit", "byte-driven")

# %% [markdown]
# ## 5. Speculative decoding: below break-even at serving batch
#
# Verifying k drafts costs a forward pass over k + 1 positions per request, plus the
# rollback (chapter 8). At batch 1 that pass is almost free -- the step reads the weights
# either way; at serving batch it is not, and the MoE layers read more experts for k + 1
# tokens than for one. `break_even_acceptance` bisects for the acceptance probability
# per draft above which speculation beats plain decoding:

# %%
KS = [1, 2, 4, 8]
SPEC_BATCHES = [1, 4, 16, 64, 128, 256, 512]
CONTEXT = 4096
be = {(d.name, k, b): spec_costs.break_even_acceptance(CFG, d, CONTEXT, k, batch=b)
      for d in (DEP, costs.DP4_EP4_H200) for k in KS for b in SPEC_BATCHES}


def be_table(d):
    return show_table([[k] + ["never" if be[d.name, k, b] is None else f"{be[d.name, k, b]:.3f}" for b in SPEC_BATCHES]
                       for k in KS], ["k"] + [f"B={b}" for b in SPEC_BATCHES],
                      title=f"{d.name}, {CONTEXT:,}-token contexts: break-even acceptance per draft")


be_table(DEP)

# %% [markdown]
# Takeaway: with k = 4, speculation pays from an acceptance of 0.188 per draft at batch
# 1, needs the most at batch 16 (0.379), dips to 0.089 at batch 128 and climbs back to
# 0.301 at batch 512 (k = 8: 0.442). Below its line a drafter makes every request in the
# batch slower. The dip is the MoE layers: the union of experts a step reads saturates
# at different batches for k + 1 tokens and for one.
#
# The deep dive gives the band (0.241-0.329 at batch 512) and DP-attention's table.
#
# ### Deep dive: the band, and DP-attention
#
# The band covers the 36 kernel sets and an assumed replay efficiency of 1-25% of peak.
# Set by set, batch 512 needs 1.38-2.46 times batch 1's acceptance, so "serving batch
# raises the bar" holds across the band.

# %%
import dataclasses


def be_at(d, b, k=4, context=4096):
    """Break-even acceptance per draft on deployment ``d`` at batch ``b`` (1.0: even perfect drafts lose)."""
    x = spec_costs.break_even_acceptance(CFG, d, context, k, batch=b)
    return 1.0 if x is None else x


replay_eff = (0.01, 0.25)  # the replay kernel's efficiency is assumed (0.05); its band
be_band = {}
for k in KS:
    for b in SPEC_BATCHES:
        vals = [be_at(v, b, k, CONTEXT) for v in VARIANTS]
        vals += [be_at(DEP.with_(name=f"replay {e}", kernels=dataclasses.replace(DEP.kernels, replay=e)), b, k, CONTEXT)
                 for e in replay_eff]
        be_band[k, b] = (min(vals), max(vals))
worst = max(SPEC_BATCHES, key=lambda b: be[DEP.name, 4, b] or 2)
print(f"TP4, k = 4: break-even {be[DEP.name, 4, 1]:.3f} at B=1, {be[DEP.name, 4, 512]:.3f} at B=512, "
      f"highest {be[DEP.name, 4, worst]:.3f} at B={worst}")
for b in sorted({512, worst}):
    print(f"band over the {len(VARIANTS)} kernel sets and replay efficiency at B={b}: "
          f"{be_band[4, b][0]:.3f}-{be_band[4, b][1]:.3f}")
print(f"B=512 over B=1, set by set: {spec_rise.describe('{:.2f}', 'times')}")
ROWS["speculation, k = 4"] = (f"acceptance < {be1.central:.2f} (B=1) to {be512.central:.2f} (B=512)",
                              f"{be512.lo:.2f}-{be512.hi:.2f}", short(spec_rise))
be_table(costs.DP4_EP4_H200)

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.0), sharey=True)
for ax, d in zip(axes, (DEP, costs.DP4_EP4_H200)):
    for k in KS:
        y = [1.0 if be[d.name, k, b] is None else be[d.name, k, b] for b in SPEC_BATCHES]
        ax.plot(SPEC_BATCHES, y, marker="o", **plots.style_of(f"spec-k{k}"))
        if d is DEP:
            ax.fill_between(SPEC_BATCHES, [min(be_band[k, b][0], 1) for b in SPEC_BATCHES],
                            [min(be_band[k, b][1], 1) for b in SPEC_BATCHES], color=plots.color(f"spec-k{k}"),
                            alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("requests per decode step (batch)")
    ax.set_title(f"{d.name}, {CONTEXT:,}-token contexts" + (" (band: 36 kernel sets, replay)" if d is DEP else ""))
axes[0].set_ylabel("break-even acceptance per draft (1 = never pays)")
axes[0].legend(fontsize=7.5, loc="upper left", title="below a line: a net loss", title_fontsize=7.5)
plots.save(fig, "ch12-spec-net-loss")
plt.show()

# %% [markdown]
# Takeaway: the break-even acceptance is not monotone in batch: it peaks near 16
# requests a step, dips near 128 and climbs past it, on both deployments; more drafts
# always need a higher acceptance.

# %% [markdown]
# ## 6. Context parallelism: below half the devices' worth
#
# Chapter 9 splits one prompt over P devices. A speedup above 1 is not the test: P
# devices at under half efficiency would serve more running two requests apart. The
# verdict is device efficiency (speedup / P) against 50%, for one KDA layer and for the
# whole 3 : 1 model, within a node (NVLink, P <= 8) and across nodes (InfiniBand).
#
# The whole model reaches half its devices' worth from 17,339 tokens on 8 devices (Key
# results); the deep dive finds one KDA layer alone needs 35,321 there and 540,748 at P =
# 16, where the whole model needs 64,830: the KDA state pass is the part that does not
# scale. Below each crossing, splitting a prompt is a net loss.
#
# ### Deep dive: every P, its band, and efficiency against prompt length
#
# The affine pass costs 1.25 times the plain one (chapter 9); its own range runs from 1.0
# (the transition has died out) to 1.68 (it lives). The kernel band reruns every
# crossing under all 36 sets; the verdict tested is that the median chat prompt is on the
# losing side.

# %%
END = 2**22  # the end of every context-parallel sweep (tokens)


def cp_half(d, P, a=1.25, layer=False):
    """The prompt length from which P devices of ``d`` reach 50% efficiency (whole model, zigzag; or one KDA layer)."""
    def eff(T):
        if layer:
            return cp.kda_layer_verdict(P, int(T), 32, 128, 128, deployment=d, affine_cost=a)["efficiency"]
        return cp.model_cp_prefill(CFG, int(T), P, deployment=d, affine_cost=a, layout="zigzag")["efficiency"]
    return crossover(lambda T: eff(T) - 0.5, max(2 * P, 256), END, grid=13)


def half_x(c):
    """A crossing's tokens; the sweep's start if it pays everywhere, its end (END) if never."""
    return c.x if c.x else (c.lo if c.kind.startswith("pays") else END)


be1 = costs.band(lambda d: be_at(d, 1), DEP)
be512 = costs.band(lambda d: be_at(d, 512), DEP)
spec_rise = costs.band(lambda d: be_at(d, 512) / be_at(d, 1), DEP, lambda r: r > 1)  # serving batch needs more
cp8 = costs.band(lambda d: half_x(cp_half(d, 8)), CP_DEP, lambda x: x > MED)  # median chat prompt loses


P_LAYER, P_MODEL = [2, 4, 8, 16, 32, 64], [2, 4, 8, 16]


def layer_eff(P, T, dep=CP_DEP, a=1.25):
    return cp.kda_layer_verdict(P, int(T), 32, 128, 128, deployment=dep, affine_cost=a)["efficiency"]


def model_eff(P, T, dep=CP_DEP, a=1.25):
    return cp.model_cp_prefill(CFG, int(T), P, deployment=dep, affine_cost=a, layout="zigzag")["efficiency"]


SCOPES = {"one KDA layer": P_LAYER, "whole model": P_MODEL}
half = {(s, P): cp_half(CP_DEP, P, layer=s == "one KDA layer") for s, Ps in SCOPES.items() for P in Ps}


def tokens(c):
    return f"{c.x:,.0f}" if c.x else c.kind


show_table([(P, cp.costs.cp_link(CP_DEP, P).name.split()[0], tokens(half["one KDA layer", P]),
             tokens(half["whole model", P]) if P in P_MODEL else "-") for P in P_LAYER],
           ["P", "link", "one KDA layer", "whole model"], title="Prompt tokens from which P devices reach 50%")

# %%
cp_band = {(s, P): cp8 if (s, P) == ("whole model", 8) else
           costs.band(lambda d, s=s, P=P: half_x(cp_half(d, P, layer=s == "one KDA layer")), CP_DEP, lambda x: x > MED)
           for s, P in half}
affine = {(s, P): [half_x(cp_half(CP_DEP, P, a, layer=s == "one KDA layer")) for a in (1.0, 1.68)] for s, P in half}


def tok(x):
    return "none" if x >= END else f"{x:,.0f}"


print(f"sweep end: {END:,} tokens ('none': no crossing); verdict: above the median chat prompt ({MED:,})")
display(show_table([(s, P, tokens(half[s, P]), f"{tok(cp_band[s, P].lo)}-{tok(cp_band[s, P].hi)}", short(cp_band[s, P]),
             f"{tok(min(affine[s, P]))}-{tok(max(affine[s, P]))}") for s, P in half],
           ["scope", "P", "crossing", f"{len(VARIANTS)} kernel sets", "verdict", "affine 1.0-1.68"],
           title="50% efficiency (tokens): band over the kernel sets, and over the affine pass's cost"))
ROWS["context parallelism"] = (f"prompts < {half['whole model', 8].x:,.0f} (P=8), < {half['whole model', 16].x:,.0f} (P=16)",
                               f"{cp8.lo:,.0f}-{cp8.hi:,.0f}", short(cp8))
b = cp_band["one KDA layer", 8]
print(f"one KDA layer, P = 8: lowest under {b.lo_member}, highest under {b.hi_member}")
for (s, P), b in cp_band.items():
    if b.label.startswith("flips"):
        print(f"{s}, P = {P}: {b.label}")

# %%
T_GRID = np.unique(np.geomspace(1024, 2**22, 40).astype(int))
fig, axes = plt.subplots(1, 2, figsize=(12, 4.0), sharey=True)
for P in P_LAYER:
    axes[0].plot(T_GRID, [layer_eff(P, T) for T in T_GRID], label=f"P = {P}" + (" (IB)" if P > 8 else ""))
for P in P_MODEL:
    axes[1].plot(T_GRID[T_GRID >= 2 * P], [model_eff(P, T) for T in T_GRID[T_GRID >= 2 * P]],
                 label=f"P = {P}" + (" (IB)" if P > 8 else ""))
for ax, title in zip(axes, ("one KDA layer (32 heads, K = V = 128)", "whole model (20 KDA : 7 MLA), zigzag")):
    ax.axhline(0.5, color="black", lw=0.8, ls=":", label="half the devices' worth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length T (tokens)")
    ax.set_title(title)
axes[0].set_ylabel("device efficiency (speedup / P)")
fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=7,
           fontsize=8)
plots.save(fig, "ch12-cp-efficiency")
plt.show()

# %% [markdown]
# The band for the whole model at P = 8 runs from 13,660 to 19,473 tokens, and the
# verdict holds across it. One KDA layer moves most, 9,642 to 129,178 tokens at P = 8, with
# the KDA kernel's speed on an H100: a slower kernel makes splitting pay sooner. At P = 2
# and 4 that flips the layer's verdict under 12 of the 36 sets.

# %% [markdown]
# ## 7. The fleet: affinity's hot spots, and isolation a tenant pays for
#
# Prefix affinity ([sglang-router](references.md#sglang-router)) sends a request where
# its prefix is cached. Under skewed popularity least-work routing caches the hot
# prefixes everywhere, while affinity piles their traffic onto a few instances. Tenant
# isolation (chapter 10, [vtc](references.md#vtc)) serves first the tenant served fewer
# tokens: next to a *light* neighbour, the chat tenant it protects pays.
#
# On four TP4 instances at 80 requests/s, affinity cuts the TTFT tail to 0.45 of
# least-work's under uniform popularity and loses from Zipf exponent 1.5; at 160
# requests/s from exponent 2. Isolation costs the chat tenant up to 1.75 times its tail
# and pays only from 7 documents/s, where the shared tail is already 17.9 s.
#
# ### Deep dive: affinity against popularity skew
#
# Each sweep is rerun once (seed 0, window 0) under the fastest and slowest prefill
# kernel sets of section 4, and both verdicts hold at both ends. Affinity loses from
# exponent 1-1.5 at 80 requests/s and 1.5-2 at 160; isolation pays from 5 and 8
# documents/s.
#
# The real trace has no knob for skew, so this is generated traffic (`wl.zipf_prefixes`):
# 2,048 shared 8,192-token prefixes -- more than one instance's pool, fewer than four --
# on four TP4 instances, three seeds, two loads.

# %%
ZIPF = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
RATES = [80.0, 160.0]
ZSEEDS = (0, 1, 2)
def zipf_traffic(rate, e, s):  # 2,000 generated requests over 2,048 shared prefixes, popularity Zipf(e)
    return {"zipf": dict(n_requests=2000, exponent=e, n_prefixes=2048, rate_per_s=rate, seed=s)}


runs, keys = [], []
for rate in RATES:
    for e in ZIPF:
        for s in ZSEEDS:
            for router in ("least-work", "prefix-affinity"):
                runs.append(dict(deployment=DEP.name, instances=4, router=router, requests=zipf_traffic(rate, e, s)))
                keys.append((rate, e, s, router))
zipf = dict(zip(keys, stored("ch12_zipf", fleet_summaries, runs=runs)))
ratio = {(rate, e): np.array([zipf[rate, e, s, "prefix-affinity"]["ttft_p99_s"] / zipf[rate, e, s, "least-work"]["ttft_p99_s"]
                              for s in ZSEEDS]) for rate in RATES for e in ZIPF}
skew_loss = {rate: next((e for e in ZIPF if ratio[rate, e].mean() > 1), None) for rate in RATES}
print("affinity's tail worse than least-work's from exponent: " +
      ", ".join(f"{r:g} req/s: {'never in the sweep' if e is None else e}" for r, e in skew_loss.items()))
display(show_table([[e] + [f"{ratio[r, e].mean():.2f} [{ratio[r, e].min():.2f}-{ratio[r, e].max():.2f}]" for r in RATES]
            for e in ZIPF], ["Zipf exponent"] + [f"{r:g} req/s" for r in RATES], formats={"Zipf exponent": "g"},
           title="TTFT p99, affinity / least-work: mean [min-max] over 3 seeds"))
zkeys = [(rate, e, router) for rate in RATES for e in ZIPF for router in ("least-work", "prefix-affinity")]
zends = at_ends("ch12_zipf_ends", [dict(deployment=DEP.name, instances=4, router=router,
                                        requests=zipf_traffic(rate, e, 0)) for rate, e, router in zkeys])
skew_ends = {}
for end, res in zends.items():
    z = {k: r["ttft_p99_s"] for k, r in zip(zkeys, res)}
    skew_ends[end] = {rate: next((e for e in ZIPF if z[rate, e, "prefix-affinity"] > z[rate, e, "least-work"]), None)
                      for rate in RATES}
    print(f"{end} kernels, seed 0: affinity worse from exponent " + ", ".join(
        f"{'never' if e is None else f'{e:g}'} ({r:g}/s)" for r, e in skew_ends[end].items()))
skew_holds = {e: all((v[r] is None) == (skew_loss[r] is None) for r in RATES) for e, v in skew_ends.items()}
ROWS["prefix affinity"] = ("Zipf exponent >= " + ", ".join(f"{span([e])} ({r:g}/s)" for r, e in skew_loss.items()),
                           span([e for r in RATES for e in [skew_loss[r]] + [v[r] for v in skew_ends.values()]]),
                           ends_short(skew_holds))

# %% [markdown]
# ### Deep dive: isolation against the neighbour's load
#
# One TP4 instance, three windows of 1,000 real chat requests, a neighbour sending
# 24,576-token documents at a rate swept through the knee:

# %%
FLOODS = [2.0, 4.0, 5.0, 6.0, 7.0, 8.0]
CHATS = (0, 4000, 8000)


def flooded(w, f):  # 1,000 chat requests from w, beside documents at f a second (kimilab.experiment.runs.with_flood)
    return {"trace": wl.MOONCAKE_CONVERSATION, "start": w, "n": 1000, "flood": f}


runs, keys = [], []
for w in CHATS:
    for f in FLOODS:
        for iso in ("none", "quota"):
            runs.append(dict(deployment=DEP.name, instances=1, router="least-work", isolation=iso, requests=flooded(w, f)))
            keys.append((w, f, iso))
iso = {k: r["tenants"]["chat"]["ttft_p99_s"] for k, r in zip(keys, stored("ch12_flood", fleet_summaries, runs=runs))}
gain = {w: np.array([iso[w, f, "none"] / iso[w, f, "quota"] for f in FLOODS]) for w in CHATS}
pays_from = [next((f for f, g in zip(FLOODS, gain[w]) if g > 1), None) for w in CHATS]
print(f"isolation first pays at (per window): {pays_from} documents/s")
print(f"lighter floods: the chat tail up to {1 / min(g.min() for g in gain.values()):.2f}x worse")
fkeys = [(f, i) for f in FLOODS for i in ("none", "quota")]
fends = at_ends("ch12_flood_ends", [dict(deployment=DEP.name, instances=1, router="least-work", isolation=i,
                                         requests=flooded(0, f)) for f, i in fkeys])
iso_ends = {}
for end, res in fends.items():
    v = {k: r["tenants"]["chat"]["ttft_p99_s"] for k, r in zip(fkeys, res)}
    iso_ends[end] = next((f for f in FLOODS if v[f, "none"] > v[f, "quota"]), None)
    print(f"{end} kernels, window 0: isolation first pays at "
          + ("never in the sweep" if iso_ends[end] is None else f"{iso_ends[end]:g} documents/s"))
found = [f for f in pays_from if f is not None]
ROWS["tenant isolation"] = (f"floods < {span(found)} docs/s", span(found + list(iso_ends.values())),
                            ends_short({e: (x is None) == (not found) for e, x in iso_ends.items()}))
display(show_table([(f, np.mean([iso[w, f, "none"] for w in CHATS]), gain_f.mean(), f"{gain_f.min():.2f}-{gain_f.max():.2f}")
            for f, gain_f in zip(FLOODS, np.array([gain[w] for w in CHATS]).T)],
           ["docs/s", "shared p99 (s)", "shared / isolated", "min-max"],
           formats={"docs/s": ".2f", "shared p99 (s)": ".1f", "shared / isolated": ".2f"},
           title="Chat TTFT p99 next to a document flood, mean over 3 windows"))

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.0))
for rate, ls in zip(RATES, ("-", "--")):
    m = np.array([ratio[rate, e].mean() for e in ZIPF])
    ax1.plot(ZIPF, m, marker="o", ls=ls, color=plots.color("prefix-affinity"), label=f"{rate:g} req/s (3 seeds)")
    ax1.fill_between(ZIPF, [ratio[rate, e].min() for e in ZIPF], [ratio[rate, e].max() for e in ZIPF],
                     color=plots.color("prefix-affinity"), alpha=0.15)
ax1.axhline(1, color="black", lw=0.8, label="break-even (above: a net loss)")
ax1.set_yscale("log")
ax1.set(xlabel="Zipf exponent of prefix popularity (0 = uniform)", ylabel="TTFT p99, affinity / least-work (log)",
        title="4 x TP4, generated prefixes: skew ends affinity's gain")
ax1.legend(fontsize=7.5)
g = np.array([gain[w] for w in CHATS])
ax2.plot(FLOODS, g.mean(axis=0), marker="o", color=plots.color("isolation-quota"), label="3 chat windows: mean")
ax2.fill_between(FLOODS, g.min(axis=0), g.max(axis=0), color=plots.color("isolation-quota"), alpha=0.2,
                 label="min-max over windows")
ax2.axhline(1, color="black", lw=0.8, label="break-even (below: a net loss)")
ax2.set_yscale("log")
ax2.set(xlabel="neighbour's documents per second (24,576 tokens each)", ylabel="chat TTFT p99, shared / isolated (log)",
        title="One TP4 instance, real chat: isolation pays only past the knee")
ax2.legend(fontsize=7.5)
plots.save(fig, "ch12-fleet-net-loss")
plt.show()

# %% [markdown]
# Takeaway: affinity's gain ends once prefix popularity is strongly skewed, and isolation
# pays only once the neighbour's document flood pushes the instance past its knee.

# %% [markdown]
# ### Deep dive: what production turns on around the cache
#
# Chapters 10 and 11 ran four things production deployments turn on: a host-memory tier
# under each instance's cache, a store the instances share, prefill/decode
# disaggregation, and speculative decoding with an MTP layer. Each against not using it, read from the results those chapters stored
# (`python -m kimilab results --check` recomputes them): where is it a net loss?

# %%
import json

from kimilab.experiment.spread import Spread, compare
from kimilab.stored import RESULTS, is_current


def result_of(name):  # (arguments, result) of a result chapter 10 or 11 stored, if the code still computes it
    assert is_current(name), f"{name} is stale: execute its chapter, or run python -m kimilab results --check"
    rec = json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))
    return rec["kwargs"], rec["result"]


no_tier = {(r["workload"], r["variant"]): r for r in result_of("ch11_part_b")[1]["rows"]}
BETTER = {"higher": "better", "tie": "tie", "lower": "worse"}  # goodput; for a latency, the reverse
tier_vs = {(loads, r["workload"], r["variant"]): BETTER[compare(r, no_tier[r["workload"], r["variant"]])]
           for name, loads in (("ch11_host_tier", "waited for"), ("ch11_host_tier_overlap", "overlapped"))
           for r in result_of(name)[1]["rows"]}
store_args, store_res = result_of("ch10_store")
p99 = {}
for run, res in zip(store_args["runs"], store_res):
    kind = "none" if "store_ratio" not in run else "slow" if "store_bandwidth" in run else "store"
    p99.setdefault((run["router"], run["rate_scale"], kind), []).append(res["ttft_p99_s"])
store_vs = {(r, s, kind): BETTER[compare(Spread.of(p99[r, s, "none"]), Spread.of(v))]
            for (r, s, kind), v in p99.items() if kind != "none"}
paired = [a < b for (r, s, kind), v in p99.items() if kind != "none" for a, b in zip(v, p99[r, s, "none"])]
splits = result_of("ch11_disagg")[1]
colocated = {(r["workload"], r["variant"]): r for r in splits if r["prefill"] is None}
best_split = {}
for r in splits:
    k = (r["workload"], r["variant"])
    if r["prefill"] is not None and (k not in best_split or r["goodput"] > best_split[k]["goodput"]):
        best_split[k] = r
pd_vs = {k: BETTER[compare(r, colocated[k])] for k, r in best_split.items()}
pd_corner = {}
for r in result_of("ch11_disagg_corners")[1]:
    pd_corner.setdefault((r["workload"], r["variant"], r["set"]), {})[r["prefill"] is not None] = r["goodput"]
pd_gain = [x[True] / x[False] for x in pd_corner.values()]
corners_of = lambda name: {(r["workload"], r["set"], r["variant"]): r["goodput"]  # noqa: E731
                           for r in result_of(name)[1]}
with_tier, without = corners_of("ch11_tier_corners"), corners_of("ch11_band_corners")
tier_gain = [with_tier[k] / without[k] for k in with_tier if k in without]
spec_vs = {(a, r["workload"], r["variant"]): BETTER[compare(r, no_tier[r["workload"], r["variant"]])]
           for a in (5, 7, 9) for r in result_of(f"ch11_spec_{a}")[1]["rows"]}
spec_corners = corners_of("ch11_spec_corners")
spec_gain = [x / without[k] for k, x in spec_corners.items() if k in without]


def tally(verdicts):
    return ", ".join(f"{sum(v == w for v in verdicts)} {w}" for w in ("better", "tie", "worse"))


display(show_table([("host tier (2x HBM, ch. 11)", "goodput", tally(tier_vs.values())),
                    ("shared store (2x HBM, ch. 10)", "TTFT p99", tally(store_vs.values())
                     + f"; lower in {sum(paired)} of {len(paired)} windows"),
                    ("disaggregation, best split (ch. 11)", "goodput", tally(pd_vs.values())),
                    ("speculation, k = 3 (ch. 11)", "goodput", tally(spec_vs.values()))],
                   ["option", "measure", "against without it (mean over orders or windows)"],
                   title="Each option against not using it; a gap inside the spread is a tie"))
print(f"at the kernel band's three sets (order 0):\n  the host tier over none {min(tier_gain):.2f}-"
      f"{max(tier_gain):.2f}x ({len(tier_gain)} runs)\n  disaggregation's best split over colocated "
      f"{min(pd_gain):.2f}-{max(pd_gain):.2f}x, above 1 in {sum(g > 1 for g in pd_gain)} of {len(pd_gain)}\n"
      f"  speculation at alpha 0.7 over none {min(spec_gain):.2f}-{max(spec_gain):.2f}x, above 1 in "
      f"{sum(g > 1 for g in spec_gain)} of {len(spec_gain)}")
loss_tier = [f"{w} {v} ({loads})" for (loads, w, v), c in tier_vs.items() if c == "worse"]
loss_store = [f"{r} at {s:g}x ({kind})" for (r, s, kind), c in store_vs.items() if c == "worse"]
loss_pd = [f"{w} {v.replace(' + prefix-affinity', '')}" for (w, v), c in pd_vs.items() if c == "worse"]
ROWS["host tier / store"] = ("; ".join(loss_tier + loss_store) or "none measured",
                             f"{min(tier_gain):.2f}-{max(tier_gain):.2f}x",
                             "never a loss" if min(tier_gain) >= 1 and not loss_tier + loss_store else "a loss")
ROWS["disaggregation"] = (f"{len(loss_pd)} of {len(pd_vs)} runs, 4 instances",
                          f"{min(pd_gain):.2f}-{max(pd_gain):.2f}x",
                          f"flips {sum(g > 1 for g in pd_gain)} of {len(pd_gain)}" if max(pd_gain) > 1 else "holds")
loss_spec = sum(c == "worse" for c in spec_vs.values())
ROWS["engine speculation"] = (f"{loss_spec} of {len(spec_vs)} runs, k = 3",
                                     f"{min(spec_gain):.2f}-{max(spec_gain):.2f}x",
                                     "holds" if max(spec_gain) <= 1 or min(spec_gain) >= 1
                                     else f"flips {sum(g > 1 for g in spec_gain)} of {len(spec_gain)}")

# %% [markdown]
# Takeaway: the memory below the cache is never a net loss in these runs. The host tier
# is better or a tie for every variant on both workloads, and at the band's corners it
# is never below 1.00x. The store ties by the spread rule everywhere, since windows
# differ more than routers do, and is lower window by window in most pairs, even at a
# tenth of the link's bandwidth. Disaggregation is the opposite on four instances: its
# best split loses to colocated serving for both models on both workloads, and it comes
# out ahead at one corner run in twelve (one order each). It pays only where the
# step-sharing it removes binds, and Part B's 100 ms TBT limit, held by a tuned chunk
# budget, does not (chapter 11). Speculation ties in 15 of 18 runs and is a net loss in
# two, the hybrid's agent runs, where the MTP layer's memory binds; at the band's
# corners it is 0.74-1.00x of not speculating.

# %% [markdown]
# ## 8. The bill
#
# A hybrid needs more serving machinery than a transformer: pages of two sizes, state
# checkpoints and a policy for them, a rollback that undoes a state, a state pass for
# context parallelism. The deep dive counts what this book wrote: close to two thousand
# lines more than a transformer's stack, paid once. They buy 3.83 times the requests per
# device at 131,072 tokens (bytes) and 3.51 times the decode tokens per second on TP4
# (3.50-3.52 over the band), and nothing for short chats with whole requests per device.
#
# ### Deep dive: lines of code per mechanism, and what they buy

# %%
import ast
from pathlib import Path

import kimilab

PKG = Path(kimilab.__file__).parent


def code_lines(*files):
    """Lines of code in ``files`` (under kimilab/): no blank, comment or docstring lines."""
    total = 0
    for f in files:
        text = (PKG / f).read_text()
        docs = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                    isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                docs.update(range(body[0].lineno, body[0].end_lineno + 1))
        total += sum(1 for i, line in enumerate(text.splitlines(), 1)
                     if line.strip() and not line.strip().startswith("#") and i not in docs)
    return total


BILL = [  # mechanism, what a transformer uses instead, the hybrid's extra modules, the transformer's
    ("KDA kernels and states (ch. 2-3)", "attention kernels", ["kda/gate.py", "kda/recurrent.py", "kda/chunk.py",
                                                              "ops/conv.py"], ["ops/attention.py"]),
    ("pages of two sizes (ch. 4)", "one page size", ["pool/layouts.py", "pool/jenga.py"], []),
    ("state checkpoints + policies (ch. 6)", "KV blocks only", ["prefix/hybrid.py", "prefix/policies.py",
                                                               "prefix/tensors.py"], []),
    ("state rollback (ch. 7-8)", "trim the KV", ["speculative/rollback.py", "speculative/replay.py",
                                               "speculative/slots.py", "speculative/scratch.py",
                                               "speculative/lazy.py"], []),
    ("state pass for CP (ch. 9)", "ring attention", ["kda/transition.py", "kda/affine.py", "kda/prepared.py",
                                                      "cp/kda_cp.py", "cp/passes.py"], ["cp/ring.py"]),
]
bill_rows = [(what, instead, round(code_lines(*hybrid), -1), round(code_lines(*plain), -1) if plain else 0)
             for what, instead, hybrid, plain in BILL]
extra = sum(h - t for _, _, h, t in bill_rows)
L = 131072
saved = {d.name: costs.max_batch(CFG, d, L) / max(costs.max_batch(BASE, d, L), 1) for d in (DEP, costs.DP4_EP4_H200)}
med = int(np.median(chat_prompts))
per_req = {d.name: (costs.request_total_bytes(BASE, d, med) - costs.request_total_bytes(CFG, d, med)) / 1e6
           for d in (DEP, costs.ONE_H200)}


def tput_ratio(d):
    """Hybrid over all-MLA decode tokens per second at L tokens, each at the largest batch that fits."""
    return costs.decode_point(CFG, d, L).tokens_per_second / costs.decode_point(BASE, d, L).tokens_per_second


tput = {d.name: costs.band(tput_ratio, d, lambda r: r > 1) for d in (DEP, costs.DP4_EP4_H200)}
print(f"the hybrid's extra serving code: about {extra:,} lines (rounded to tens per mechanism)")
print(f"what it buys at {L:,} tokens, in requests per device: " + ", ".join(f"{n} {r:.2f}x" for n, r in saved.items()))
print("  and in decode tokens per second, each model at its largest batch:")
for n, b in tput.items():
    print(f"  {n}: {b.describe('{:.2f}', 'times all-MLA')}")
print(f"at the real chat median ({med:,} tokens), saved per request per device:")
print("  " + ", ".join(f"{n} {v:+.1f} MB" for n, v in per_req.items()))
show_table(bill_rows, ["mechanism", "a transformer has", "hybrid (lines)", "transformer"],
           title="Serving code this book wrote (lines, rounded to tens)")

# %% [markdown]
# ## 9. What a CPU replication cannot tell a GPU buyer
#
# | kind | what | on a GPU |
# |---|---|---|
# | exact | kernel equivalences, bytes and pages, hit rates on a trace, recall of a random-key memory | the same |
# | modelled | step times, TTFT, goodput, dollars, every crossover in seconds | the shape holds; the level moves |
# | measured here | CPU wall-clock seconds, MQAR training time | only "which path does less work" |
#
# So the *counts* are facts; the *thresholds in seconds* are a calibrated model's, and
# the bands say how far they move.

# %% [markdown]
# ## The verdicts
#
# One row per method; "verdict" says whether it survives the band.

# %%
show_table([(m,) + row for m, row in ROWS.items()], ["method", "net loss where", "band", "verdict"],
           title="Where each method is a net loss")

# %%
HEADLINE = {f"hybrid / all-MLA decode tokens/s\n{L:,} tokens, largest batch, TP4": (tput[DEP.name], 1.0),
            "break-even acceptance, k = 4\nbatch 512 / batch 1, TP4": (spec_rise, 1.0),
            f"CP 50% threshold, whole model, P = 8\n/ median chat prompt ({MED:,} tokens)": (cp8, MED)}
fig, ax = plt.subplots(figsize=(8.0, 3.6))
for i, (name, (b, scale)) in enumerate(HEADLINE.items()):
    c, lo, hi = b.central / scale, b.lo / scale, b.hi / scale
    ax.errorbar([c], [i], xerr=[[c - lo], [hi - c]], fmt="o", color="black", ecolor=plots.color("kda-state"),
                elinewidth=6, label=f"band over {len(VARIANTS)} kernel sets (dot: central)" if i == 0 else None)
    print(f"{name.splitlines()[0]}: {c:.2f} [{lo:.2f}-{hi:.2f}], {b.label}")
ax.axvline(1.0, color="black", lw=0.8, ls=":", label="1.0: right of it, the verdict as stated")
ax.set(xscale="log", xlim=(0.5, 8), ylim=(len(HEADLINE) - 0.4, -0.6), xlabel="ratio (dimensionless, log scale)",
       title="Three headline ratios and their kernel bands")
ax.set_xticks([0.5, 1, 2, 4, 8], ["0.5", "1", "2", "4", "8"], minor=False)
ax.set_yticks(range(len(HEADLINE)), list(HEADLINE), fontsize=8)
ax.minorticks_off()
ax.legend(fontsize=7.5, loc="upper left")
plots.save(fig, "ch12-headline-bands")
plt.show()

# %% [markdown]
# *Takeaway:* all three stay right of 1.0 under every kernel set (the closest, CP's
# threshold, is 1.98 times the median chat prompt).

# %% [markdown]
# ### Deep dive: each verdict with its regime and band
#
# Each verdict in full, with the regime it was found in.

# %%
import textwrap

c8, c16 = half["whole model", 8].x, half["whole model", 16].x
verdicts = {
    "hybrid model": dict(
        regime=f"{DEP.name} and dp4-ep4-h200, batch 1-512, any load",
        pays=f"memory from {mem_cross[DEP.name]:,} tokens (TP4) / {mem_cross[dp]:,} (DP-attention); "
             f"decode step from {step_cross[DEP.name, 64]:,} (TP4, any batch)",
        loss=f"contexts below those; DP-attention steps below {step_cross[dp, 512]:,}-{step_cross[dp, 1]:,} "
             "tokens (batch 512 to 1)",
        band=f"memory: byte-driven; TP4 step: {tp4_band.label}; DP step at B=64: "
             f"{dp_band[64].describe('{:,.0f}', 'tokens')}"),
    "unified page pool": dict(
        regime=f"one {DEP.name} device, a 4,096-token request",
        pays=f"from {pool_cross.x:,.0f} KDA heads per device" if pool_cross.x else pool_cross.kind,
        loss="fewer heads per device (more rounding than padding); end to end within 3% of vLLM's pages (chapter 4)",
        band="byte-driven: no kernel number moves it"),
    "prefix caching": dict(
        regime="one instance, real chat trace (3 windows of 2,000 requests), load swept through the knee",
        pays=f"ends: everywhere in both sweeps; every-block: everywhere on {DEP.name}",
        loss=(f"every-block on one-h200 from x{span(eb_one)} of the trace's rate "
              f"({len(eb_one)} of {len(WINDOWS)} windows)" if eb_one else "none found in the sweep"),
        band="grid brackets over 3 windows; at the kernel band's ends (window 0): " + ", ".join(
            f"{e} {span([x], pre='from x')}" for e, x in eb_ends.items())
             + f"; {ends_label({e: (x is None) == (not eb_one) for e, x in eb_ends.items()})}"),
    "speculative decoding": dict(
        regime=f"{DEP.name}, {CONTEXT:,}-token contexts, batch 1-512, k = 1-8",
        pays=f"k = 4: acceptance above {be1.central:.2f} (B=1) to {be512.central:.2f} (B=512), "
             f"highest {be[DEP.name, 4, worst]:.2f} (B={worst})",
        loss=f"acceptance below the line; k = 8 at B=512: below {be[DEP.name, 8, 512]:.2f}",
        band=f"k = 4, B=512: {be_band[4, 512][0]:.2f}-{be_band[4, 512][1]:.2f} (36 kernel sets, replay 1-25% "
             f"of peak); B=512 over B=1: {spec_rise.describe('{:.2f}', 'times')}"),
    "context parallelism": dict(
        regime=f"{CP_DEP.name} devices, NVLink within 8, InfiniBand beyond; one prompt",
        pays=f"whole model at >=50% efficiency from {c8:,.0f} tokens (P=8), {c16:,.0f} (P=16, IB)",
        loss=f"shorter prompts; one KDA layer at P=64: {half['one KDA layer', 64].describe('tokens')}",
        band=f"P=8 whole model: {cp8.describe('{:,.0f}', 'tokens')}; affine cost 1.0-1.68: "
             f"{tok(min(affine['whole model', 8]))}-{tok(max(affine['whole model', 8]))}"),
    "prefix affinity": dict(
        regime="4 x TP4 instances, generated Zipf prefixes (2,048 x 8,192 tokens), "
               + " and ".join(f"{r:g}" for r in RATES) + " req/s, 3 seeds",
        pays=f"Zipf exponent below {min(e for e in skew_loss.values() if e is not None):g}"
        if any(e is not None for e in skew_loss.values()) else "everywhere in the sweep",
        loss="; ".join(f"{r:g} req/s: from exponent {e:g}" for r, e in skew_loss.items() if e is not None) or "none",
        band="grid of 0.5 in the exponent; seeds' min-max in the figure; at the kernel band's ends (seed 0): "
             + "; ".join(f"{end} " + ", ".join(f"{span([e])} ({r:g}/s)" for r, e in v.items())
                         for end, v in skew_ends.items()) + f"; {ends_label(skew_holds)}"),
    "tenant isolation": dict(
        regime="one TP4 instance, 1,000 real chat requests (3 windows) + a document flood",
        pays=f"floods from {span(found)} documents/s" if found else "never in the sweep",
        loss=f"lighter floods: the chat tail up to {1 / min(gm.min() for gm in gain.values()):.2f}x worse",
        band="grid of 1 document/s, 3 windows; at the kernel band's ends (window 0): " + ", ".join(
            f"{e} {span([x])}" for e, x in iso_ends.items())
             + f"; {ends_label({e: (x is None) == (not found) for e, x in iso_ends.items()})}"),
}
for method, v in verdicts.items():
    print(method)
    for field in ("regime", "pays", "loss", "band"):
        print(textwrap.fill(v[field], 98, initial_indent=f"  {field + ':':<8}", subsequent_indent=" " * 10))
print(f"quality\n  a {128} x {128} KDA state gives back half of N pairs up to {mid_k:,.0f} "
      f"(band {lo_k:,.0f}-{hi_k:,.0f} over seeds;\n  no kernel time in it); a KV cache, every pair tried ({PAIRS[-1]:,})")

# %% [markdown]
# ## Summary
#
# We put every method of the book against not using it, found where its gain crosses
# zero by root-finding, and gave each crossing a band; for times, over 36 kernel sets.
#
# - **Quality.** A 128 x 128 KDA state gives back half of N random pairs only up to 194
#   (band 190-197); a KV cache keeps everything, so the hybrid relies on its global
#   layers for the rest.
# - **The hybrid** is a net loss below 472 tokens (memory) and 942 (step) on TP4, and
#   below 1,885 and 3,962 to 102,817 with whole requests per device (memory: bytes).
# - **The unified pool** loses to vLLM's pages below 3 KDA heads per device (bytes).
# - **Prefix caching** at every block loses to no caching on a memory-short instance,
#   across the band; request-end checkpoints lose only at that instance's knee.
# - **Speculation** (k = 4) needs 0.188 acceptance at batch 1 and 0.301 at batch 512
#   (band 0.241-0.329).
# - **Context parallelism** wastes half its 8 devices below 17,339 tokens (band 13,660
#   to 19,473), the median chat prompt among them under every kernel set.
# - **Affinity** loses under skewed popularity; **isolation** costs the tenant it
#   protects until the neighbour would swamp it.
# - **The bill**: close to two thousand lines of serving code, for 3.83 times the
#   requests per device at 131,072 tokens.
#
# **The question to take away:** for your traffic -- its prompt lengths, batch, load and
# skew -- on which side of each crossing does your deployment sit?

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (empty in the student edition), and `verify("N.M", answer)`. Open exercises and
# projects follow.
#
# **12.1 A batch the table skips.** Under DP-attention with expert parallelism
# (`costs.DP4_EP4_H200`), from how many tokens of context is a decode step of 8
# Kimi-Linear-48B requests no slower than a step of 8 all-MLA requests?

# %% tags=["solution"]
answer = costs.decode_crossover_tokens(CFG, BASE, costs.DP4_EP4_H200, 8)

# %%
verify("12.1", answer)

# %% [markdown]
# **12.2 Predict, then run: a draft length the table skips.** On TP4 at 4,096-token
# contexts, with k = 3 drafts in a batch of 32: first write down where section 5's table
# says the break-even acceptance should fall (near batch 16's rise or batch 64's dip?),
# then compute it. What did your prediction miss?

# %% tags=["solution"]
answer = spec_costs.break_even_acceptance(CFG, DEP, 4096, 3, batch=32)

# %%
verify("12.2", answer)

# %% [markdown]
# **12.3 Predict, then run: recall at 96 pairs.** With section 1's settings (K = V =
# 128, a 2,048-entry vocabulary, seeds 0-7), what fraction of 96 pairs does the KDA
# memory read back right? Read a prediction off its figure first, then compute it.

# %% tags=["solution"]
answer = recall.recall("kda", 96, seeds=range(8)).mean

# %%
verify("12.3", answer)

# %% [markdown]
# **12.4 The whole model at 64k.** What device efficiency (speedup / P) does the whole
# model reach on 16 devices of the TP8 recipe (two nodes) for one 65,536-token prompt,
# with zigzag slices and the affine pass costing 1.25 times the plain one?

# %% tags=["solution"]
answer = cp.model_cp_prefill(CFG, 65536, 16, deployment=CP_DEP, affine_cost=1.25, layout="zigzag")["efficiency"]

# %%
verify("12.4", answer)

# %% [markdown]
# **12.5 (open, ~45 min) Recall under the gate.** Run `recall.recall("kda", n,
# gate_strength=g)` for g in 0.1, 0.3 and 3: how does the capacity move, and what does
# that say about a trained gate that decays slowly?
#
# **12.6 (project, ~6 h) Agents instead of chat.** Redo section 4's sweep with the Claude
# Code sessions (`wl.load_sessions(...)`) on one H200. Do the agents' long shared
# histories change which policy is a net loss, and at which load?
#
# **12.7 (open, ~45 min) Longer contexts.** Redo section 5's table at 32,768-token
# contexts. Does the break-even acceptance rise or fall, and why?
#
# **12.8 (project, ~8 h) A bill for your stack.** For a serving engine you know, count
# the code of each row of section 8's table the way `code_lines` counts `kimilab`'s
# modules. Where does your count differ from ours, and why?
