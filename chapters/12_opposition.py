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
# **What you'll build.** One crossover experiment per method of the book, each a
# sweep of the knob that decides it, a plot, and a verdict — "use it when / not
# when" — computed from the numbers the plot shows, never written by hand.
#
# **What you'll learn.**
# - Below which context length the hybrid model's fixed state costs more memory and
#   decode time than the KV it replaces, and how much of real traffic sits there.
# - When equal-size pages waste more than the state they hold.
# - Where prefix caching stops paying: blocks larger than the prompts, checkpoints
#   denser than the hits, traffic that does not repeat itself.
# - The acceptance rate below which speculative decoding slows decoding down, and the
#   state size below which replaying beats nothing.
# - The prompt length below which context parallelism loses, and how far float32 holds.
# - When prefix affinity's hot spots cost more than its hits, and what isolation costs.
# - Which numbers in this book transfer to a GPU and which do not.
#
# **What you'll need.** Chapters 1–10; every number here comes from their code
# (`kimilab.costs` at Kimi-Linear-48B sizes, the real Mooncake trace through
# `RunPrefixCache`, the context-parallel cost model and fold of chapter 9, the fleet
# simulator of chapter 10).

# %%
import shutil
import tempfile

import matplotlib.pyplot as plt
import numpy as np

import kimilab.traffic as wl
from kimilab import costs, cp, kda, plots
from kimilab.config import all_mla_27, kimi_linear_48b
from kimilab.costs import CacheShapes
from kimilab.costs import spec as spec_costs
from kimilab.exercises import verify
from kimilab.fleet.sweep import run_many
from kimilab.fleet.tenants import merge_tenants
from kimilab.kda.testing import random_inputs
from kimilab.pool import UnifiedPages, VllmPaddedPages
from kimilab.sim import Replay, replay_many
from kimilab.traffic import Request

plots.use_style()
CFG = kimi_linear_48b
REAL = f"../data/{wl.MOONCAKE_CONVERSATION}"
real = wl.load_trace(REAL, 512)
prompts = np.array([r.input_length for r in real])


def first_above(x, y, level=0.0):
    """The first x from which y stays above ``level`` to the end of the sweep, or None."""
    above = np.asarray(y) > level
    if not above[-1]:
        return None
    below = np.flatnonzero(~above)
    return x[below[-1] + 1] if below.size else x[0]


def inside(name, value, grid):
    """A crossover found on a sweep must lie inside it; None means "not in this range" (the verdict says so)."""
    if value is not None:
        assert grid[0] <= value <= grid[-1], f"{name}: crossover {value} outside the swept [{grid[0]}, {grid[-1]}]"


# %% [markdown]
# ## 1. The hybrid model: short contexts pay for a state they do not need
#
# A Kimi-Linear request holds 20 KDA states whatever its length (chapter 3); an
# all-MLA model of the same shape holds only KV, growing with the context. The hybrid
# saves memory only once the KV it does not keep outweighs the states it does, and its
# decode step reads the states every token. Sweep the context:

# %%
contexts = np.unique(np.geomspace(16, 2**20, 80).astype(int))
bf16 = CFG.with_(name="kimi_linear_48b (bf16 state)", state_bytes=2)
saved_mb = {cfg.name: np.array([costs.request_total_bytes(all_mla_27, int(n)) - costs.request_total_bytes(cfg, int(n))
                                for n in contexts]) / 1e6 for cfg in (CFG, bf16)}
step_ratio = np.array([costs.decode_step_seconds(all_mla_27, int(n)) / costs.decode_step_seconds(CFG, int(n))
                       for n in contexts])
cross = {cfg.name: costs.crossover_tokens(cfg, all_mla_27) for cfg in (CFG, bf16)}
faster = first_above(contexts, step_ratio, 1.1)  # 10% faster: below, the weights' bytes dominate both steps
for name, n in [*cross.items(), ("10% faster decode", faster)]:
    inside(name, n, contexts)
for name, n in cross.items():
    print(f"{name}: holds less cache than all-MLA from {n:,} tokens; "
          f"{np.mean(prompts < n):.0%} of the real trace's prompts are shorter")
print(f"decode step (batch 1, roofline): the hybrid's is {1 / step_ratio[0] - 1:.1%} slower than all-MLA's at "
      f"{contexts[0]} tokens; "
      f"10% faster from {faster:,} tokens of context; {np.mean(prompts < faster):.0%} of real prompts are shorter")
total = sum(costs.request_total_bytes(CFG, int(n)) for n in prompts) / sum(
    costs.request_total_bytes(all_mla_27, int(n)) for n in prompts)
print(f"over the whole real trace the hybrid holds {1 - total:.1%} less cache than all-MLA (prompts only)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.0))
for cfg, style in ((CFG, "-"), (bf16, ":")):
    ax1.semilogx(contexts, saved_mb[cfg.name], color=plots.color("hybrid"), linestyle=style,
                 label=f"hybrid, {'fp32' if cfg is CFG else 'bf16'} state")
ax1.axhline(0, color="black", linewidth=0.8)
ax1.set_ylim(-50, 200)
ax1.set_xlabel("context (tokens)")
ax1.set_ylabel("cache saved vs all-MLA per request (MB)")
ax1.set_title("Memory: the hybrid saves only past the crossover")
ax2.semilogx(contexts, step_ratio, color=plots.color("hybrid"), label="all-MLA step / hybrid step")
ax2.axhline(1, color="black", linewidth=0.8, label="break-even")
ax2.set_xlabel("context (tokens)")
ax2.set_ylabel("decode step time ratio (batch 1, roofline)")
ax2.set_title("Time: the hybrid's step is faster past the crossover")
for ax in (ax1, ax2):
    ax.axvspan(np.percentile(prompts, 5), np.percentile(prompts, 95), color="#999999", alpha=0.15,
               label="real prompts, 5th-95th percentile")
    ax.legend(fontsize=8, loc="upper left")
plots.save(fig, "ch12-hybrid-crossover")
plt.show()

# %% [markdown]
# Takeaway: below 1,885 tokens a Kimi-Linear request holds *more* cache than an
# all-MLA one — 22% of the real trace's prompts — yet over the whole trace the hybrid
# holds 62.5% less, because the long prompts own most of the bytes.
#
# At batch 1 the decode step is dominated by reading the weights, so the two models'
# steps are within a fraction of a percent for short contexts and the hybrid pulls ahead
# only as the MLA cache grows (10% faster from 3,818 tokens). A fleet serving only short chats would pay for states it
# does not need; a bf16 state halves that price (crossover at 975 tokens).

# %%
verdicts = {}
verdicts["hybrid model"] = (f"use it when contexts pass {cross[CFG.name]:,} tokens (memory; {cross[bf16.name]:,} with "
                            f"a bf16 state) and {faster:,} (10% faster decode steps); not for short chats alone. On "
                            f"the real trace it still holds {1 - total:.0%} less cache, because long prompts "
                            f"dominate the bytes.")
print(verdicts["hybrid model"])

# %% [markdown]
# ## 2. The unified page pool: when the state page outgrows the KV page
#
# Chapter 4's unified pool gives each object whole small pages; vLLM's layout gives
# every layer one page size, grown until a state fits, and pads the rest. Their waste
# depends on how big a state is next to a KV page. Sweep the state by the number of KDA
# heads (32 in the real model), for a 4,096-token request:

# %%
heads = np.array([2, 4, 8, 16, 32, 64, 128])
layouts = {"unified": UnifiedPages(), "vllm-padded": VllmPaddedPages()}
waste = {key: [] for key in layouts}
ratio = []
for h in heads:
    shapes = CacheShapes.from_config(CFG.with_(name=f"kimi-{h}-heads", n_heads=int(h)))
    ratio.append((shapes.state_bytes + shapes.conv_bytes) / (16 * shapes.kv_token_bytes))
    for key, layout in layouts.items():
        waste[key].append(layout.footprint(shapes, 4096).waste_fraction)
ratio = np.array(ratio)
print(f"{'KDA heads':>9} {'state / 16-token KV page':>24}" + "".join(f"{k:>14}" for k in layouts))
for i, h in enumerate(heads):
    print(f"{h:9d} {ratio[i]:24.0f}" + "".join(f"{waste[k][i]:14.1%}" for k in layouts))

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.0))
for key in layouts:
    ax.semilogx(ratio, 100 * np.array(waste[key]), marker="o", **plots.style_of(key))
ax.axvline(ratio[list(heads).index(CFG.n_heads)], color="black", linestyle=":", linewidth=1,
           label="Kimi-Linear-48B (32 heads)")
ax.set_xlabel("one KDA layer's state / one 16-token KV page (x)")
ax.set_ylabel("reserved but unused memory (% of a 4,096-token request)")
ax.set_title("Page-layout waste as the state grows")
ax.legend(fontsize=8)
plots.save(fig, "ch12-pool-crossover")
plt.show()

# %% [markdown]
# Takeaway: equal-size pages cost little only while a state is a few KV pages; at
# Kimi-Linear-48B's size (32 heads) vLLM's layout leaves a sixth of a 4k-token request's
# memory empty, and the unified pool under 1%.
#
# With 2 KDA heads (a state of 7 KV pages) equal pages waste less than the unified pool
# (1.1% vs 1.7%), because the unified pool rounds each of the many small objects up to
# a page. Past that, the padded state page grows with the state, and the waste with it
# (it dips at 128 heads, where the 4k-token request's KV happens to fill its large
# blocks better).

# %%
more = np.array(waste["vllm-padded"]) > np.array(waste["unified"])
from_heads = heads[np.argmax(more)] if more.any() else None
inside("unified page pool", from_heads, heads)
verdicts["unified page pool"] = (
    f"use it once a state is more than a few KV pages: equal pages waste more than the unified pool from "
    f"{from_heads} KDA heads on (a state of {ratio[np.argmax(more)]:.0f} KV pages), {max(waste['vllm-padded']):.0%} "
    f"of a 4k-token request at worst, against at most {max(waste['unified']):.1%}; with "
    f"{heads[0]} heads equal pages waste less ({waste['vllm-padded'][0]:.1%}), and are simpler.")
print(verdicts["unified page pool"])

# %% [markdown]
# ## 3. Prefix caching: three ways to stop paying
#
# On the real trace at 40 GB of 48B memory (chapter 6): (a) larger blocks, as vLLM's
# hybrid layout forces — a hit is rounded down to whole blocks and a prompt shorter than
# one block never hits; (b) denser checkpoints — `align` with a shorter interval keeps
# more states and less KV; (c) less reuse — the generated conversation-like traffic of
# chapter 5 with fewer turns per conversation, so less of each prompt was seen before.

# %%
BLOCKS = [512, 1024, 2048, 4096, 8192]
INTERVALS = [512, 2048, 8192, 32768]
TURNS = [1.0, 1.5, 3.0, 6.0]
jobs = {("block", b): Replay(REAL, "kv-only", 40, block_size=b) for b in BLOCKS}
jobs |= {("interval", i): Replay(REAL, "align", 40, options=(("interval", i),)) for i in INTERVALS}
jobs |= {("ends", 40): Replay(REAL, "ends", 40)}
generated, scratch = {}, tempfile.mkdtemp(prefix="kimilab-ch12-")
for turns in TURNS:
    records = wl.mooncake_conversation_like(seed=0, duration_s=900.0, n_sessions=1040, mean_turns=turns)
    path = f"{scratch}/turns-{turns}.jsonl"  # a replay job reads its trace from a file
    wl.write_trace(path, records)
    generated[turns] = records
    for policy in ("ends", "dual"):
        jobs[("turns", turns, policy)] = Replay(path, policy, 40)
runs = replay_many(jobs)
shutil.rmtree(scratch)  # the generated traces were only needed by the replays
for b in BLOCKS:
    r = runs["block", b]
    print(f"block {b:5,d}: attention hit {r.usable_hit_rate:.4f}, prefill saved {r.prefill_ms_saved_per_request:5.2f} ms; "
          f"{np.mean(prompts <= b):.0%} of prompts fit in one block")
for i in INTERVALS:
    r = runs["interval", i]
    share = r.checkpoint_bytes_mean / (r.checkpoint_bytes_mean + r.kv_bytes_mean)
    print(f"align every {i:6,d} tokens: usable hit {r.usable_hit_rate:.4f}, {share:.0%} of memory in checkpoints "
          f"(ends: {runs['ends', 40].usable_hit_rate:.4f})")
for turns in TURNS:
    e, d = runs["turns", turns, "ends"], runs["turns", turns, "dual"]
    print(f"{turns} turns per conversation: reuse ceiling {wl.reuse_upper_bound(generated[turns], 512):.3f}; at 40 GB "
          f"ends saves {e.prefill_ms_saved_per_request:5.2f} ms, dual {d.prefill_ms_saved_per_request:5.2f} ms of "
          f"{1e3 * e.prefill_seconds_cold / e.requests:.1f} ms cold prefill per request")

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3.9))
ax = axes[0]
ax.semilogx(BLOCKS, [runs["block", b].usable_hit_rate for b in BLOCKS], marker="o", base=2,
            **plots.style_of("kv-only"))
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("hit rate (token-weighted)")
ax.set_title("(a) larger blocks, real trace, 40 GB")
ax = axes[1]
ax.semilogx(INTERVALS, [runs["interval", i].usable_hit_rate for i in INTERVALS], marker="o", base=2,
            **plots.style_of("align"))
ax.axhline(runs["ends", 40].usable_hit_rate, **plots.style_of("ends"))
ax.set_xlabel("checkpoint interval (tokens)")
ax.set_ylabel("usable hit rate")
ax.set_title("(b) denser checkpoints, real trace, 40 GB")
ax = axes[2]
ceilings = [wl.reuse_upper_bound(generated[t], 512) for t in TURNS]
for policy in ("ends", "dual"):
    ax.plot(ceilings, [runs["turns", t, policy].prefill_ms_saved_per_request for t in TURNS], marker="o",
            **plots.style_of(policy))
for t, c in zip(TURNS, ceilings):
    ax.annotate(f"{t:g} turns", (c, runs["turns", t, "ends"].prefill_ms_saved_per_request), fontsize=8,
                textcoords="offset points", xytext=(4, -10))
ax.set_xlabel("reuse ceiling of the traffic (infinite-cache hit rate)")
ax.set_ylabel("prefill saved per request (ms)")
ax.set_title("(c) less reuse, generated chat, 40 GB")
for ax in axes:
    ax.legend(fontsize=7.5)
plots.save(fig, "ch12-prefix-crossover")
plt.show()

# %% [markdown]
# Takeaway: prefix caching stops paying in three ways, and only one of them is the
# traffic's fault.
#
# (a) Blocks: at 8,192-token blocks 55% of real prompts fit in one block and can never
# hit, and the attention-bound hit rate falls from 0.2168 to 0.1447. (b) Checkpoints:
# `align` every 512 tokens puts 92% of memory in states and serves 0.0444, against
# `ends`' 0.1456; it recovers only at an interval of 32,768 tokens, where it *is*
# `ends`. (c) Reuse: with one turn per conversation nothing repeats but the 1,000-token
# system prompt (a reuse ceiling of 0.048), `ends` saves nothing at all and `dual` — the
# only policy that checkpoints the branch point where conversations leave the system
# prompt — saves 0.69 ms of a 22.9 ms prefill.

# %%
best_interval = max(INTERVALS, key=lambda i: runs["interval", i].usable_hit_rate)
verdicts["prefix caching"] = (
    f"use it for multi-turn and shared-prompt traffic; keep blocks small (at {BLOCKS[-1]:,}-token blocks the real "
    f"trace's attention hit falls from {runs['block', 512].usable_hit_rate:.3f} to "
    f"{runs['block', BLOCKS[-1]].usable_hit_rate:.3f}) and checkpoints sparse (align is best at its longest "
    f"interval, {best_interval:,}, where it becomes ends); with one turn per conversation `ends` saves "
    f"{runs['turns', TURNS[0], 'ends'].prefill_ms_saved_per_request:.2f} ms per request and only `dual`'s branch "
    f"point at the shared system prompt saves anything "
    f"({runs['turns', TURNS[0], 'dual'].prefill_ms_saved_per_request:.2f} ms).")
print(verdicts["prefix caching"])

# %% [markdown]
# ## 4. Speculative decoding: acceptance, and the state size
#
# Chapter 8's cost model gives one request's expected tokens per second at 48B sizes: a
# verify of k + 1 tokens on the prefill roofline plus the rollback, yielding
# (1 − α^(k+1)) / (1 − α) tokens per step when each draft is accepted with
# probability α. Plain decoding is k = 0. Where does speculation start to pay — and,
# between rollback strategies, when does replaying (work per kept token) stop beating
# snapshots (bytes per draft position)? At 48B the bytes always favour replay (chapter
# 8); what can turn it around is a slow replay kernel, since a token-by-token
# recurrence is latency-bound. Sweep its assumed efficiency:

# %%
ALPHA = np.linspace(0.0, 1.0, 101)
CONTEXT = 4096
plain = spec_costs.spec_tokens_per_second(CFG, CONTEXT, 0, 0.0)
speedup = {k: np.array([spec_costs.spec_tokens_per_second(CFG, CONTEXT, k, a) for a in ALPHA]) / plain
           for k in (2, 4, 8)}
pays_from = {k: first_above(ALPHA, s, 1.0) for k, s in speedup.items()}
for k, a in pays_from.items():
    inside(f"speculation, k = {k}", a, ALPHA)
for k in speedup:
    print(f"k = {k}: faster than plain decoding from acceptance {pays_from[k]:.2f}; "
          f"{speedup[k][-1]:.2f}x at acceptance 1")
KEPT = np.arange(1, 10)  # positions kept of k + 1 = 9 (k = 8)
EFFICIENCIES = [0.05, 0.005, 0.002, 0.001, 0.0005]  # fraction of peak the replay kernel reaches
replay_over_snapshot = {eff: np.array([spec_costs.rollback_seconds(CFG, "replay", 8, int(j), efficiency=eff)
                                       / spec_costs.rollback_seconds(CFG, "snapshot", 8, int(j)) for j in KEPT])
                        for eff in EFFICIENCIES}
snapshot_from = {eff: first_above(KEPT, r, 1.0) for eff, r in replay_over_snapshot.items()}
for eff, j in snapshot_from.items():
    inside(f"snapshot over replay at {eff:.2%}", j, KEPT)
for eff, r in replay_over_snapshot.items():
    where = f"snapshot wins from {snapshot_from[eff]} kept positions" if snapshot_from[eff] else "replay wins at every j"
    print(f"replay kernel at {eff:.2%} of peak: replay / snapshot time {r[0]:.2f} (j = 1) to {r[-1]:.2f} (j = 9); {where}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.0))
for k, s in speedup.items():
    ax1.plot(ALPHA, s, **plots.style_of(f"spec-k{k}"))
ax1.axhline(1, linewidth=0.8, **plots.style_of("plain-decode"))
ax1.set_xlabel("acceptance rate per draft token")
ax1.set_ylabel(f"tokens per second / plain decoding ({CONTEXT:,}-token context)")
ax1.set_title("Speculation pays only above an acceptance rate")
for eff, r in replay_over_snapshot.items():
    ax2.semilogy(KEPT, r, marker="o", label=f"replay kernel at {eff:.2%} of peak")
ax2.axhline(1, color="black", linewidth=0.8, label="snapshot")
ax2.set_xlabel("positions kept after a verify of 9 (k = 8)")
ax2.set_ylabel("replay time / snapshot time (roofline, 48B)")
ax2.set_title("Replay vs snapshot: the kernel's efficiency decides")
for ax in (ax1, ax2):
    ax.legend(fontsize=8)
plots.save(fig, "ch12-spec-crossover")
plt.show()

# %% [markdown]
# Takeaway: speculation pays only above an acceptance rate that rises with k (0.57
# for k = 2, 0.80 for k = 8 at a 4,096-token context), because verifying k + 1 tokens
# costs several decode steps on the roofline. Replay beats snapshots at every kept length
# while its kernel reaches 0.5% of peak; at 0.2% a snapshot wins from 4 kept positions.

# %%
slow_enough = [eff for eff in EFFICIENCIES if snapshot_from[eff] is not None]
verdicts["speculative decoding"] = (
    f"use it when drafts are accepted often: at {CONTEXT:,} tokens of context it pays from acceptance "
    f"{pays_from[2]:.2f} (k = 2), {pays_from[4]:.2f} (k = 4) and {pays_from[8]:.2f} (k = 8); below that a verify "
    f"of k + 1 tokens costs more than the tokens it yields. Roll back by replay unless its kernel is slow: "
    + (f"at {max(slow_enough):.2%} of peak or less a snapshot wins from {snapshot_from[max(slow_enough)]} kept "
       f"positions." if slow_enough else "at every efficiency tried, replay wins."))
print(verdicts["speculative decoding"])

# %% [markdown]
# ## 5. Context parallelism: short prompts lose, and precision holds
#
# Chapter 9 splits one prompt over P ranks: each computes its slice's transition, the
# transitions are all-gathered and folded, each rank corrects its slice. Two things can
# make that lose. A short prompt: each rank's compute shrinks with T / P while the
# exchange does not (fixed bytes, fixed latency per message). And a long chain: the fold
# of P transitions is done in float32, and its rounding could grow with P. The first is
# a cost model on *assumed* hardware (`cp.predicted_speedup`: an H800-class device at
# 30% of peak, an NVLink-class link, one KDA layer of Kimi-Linear-48B's shape); the
# second is measured here, in numpy, against float64.

# %%
T_GRID = np.unique(np.geomspace(256, 2**20, 49).astype(int))
RANKS = (2, 4, 8, 16)
cp_speedup = {P: np.array([cp.predicted_speedup(P, int(T), CFG.n_heads, CFG.head_dim, CFG.head_dim)
                           for T in T_GRID]) for P in RANKS}
cp_from = {P: first_above(T_GRID, cp_speedup[P], 1.0) for P in RANKS}
for P in RANKS:
    inside(f"CP at P = {P}", cp_from[P], T_GRID)
    print(f"P = {P:2d}: splitting a prompt pays from {cp_from[P]:>6,} tokens (cost model); "
          f"{np.mean(prompts < cp_from[P]):.0%} of real prompts are shorter; {cp_speedup[P][-1]:.2f}x at 2^20 tokens")


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


T_CHAIN, CHAIN_P = 8192, 2 ** np.arange(1, 12)  # up to 2,048 ranks of 4 tokens each


def fold_errors(gate):
    """fp32 fold of P transitions vs float64, for each P; and one rank's fp32 kernel vs float64."""
    (q, k, v, g, beta), _ = random_inputs(T_CHAIN, 2, 32, 32, seed=4, gate=gate)
    _, S64 = kda.chunk_kda(q, k, v, g, beta)
    _, S32 = kda.chunk_kda(*(x.astype(np.float32) for x in (q, k, v, g, beta)))
    # the finest slices' transitions in one batched call, then neighbours composed level by level
    n = T_CHAIN // CHAIN_P[-1]  # tokens per finest slice, one chunk each
    M, C = kda.segment_transition(*(x.reshape(CHAIN_P[-1], n, *x.shape[1:]) for x in (k, v, g, beta)), chunk_size=n)
    levels = {len(M): (M, C)}
    while len(M) > 2:
        M, C = kda.compose_transitions((M[0::2], C[0::2]), (M[1::2], C[1::2]))
        levels[len(M)] = (M, C)
    errors = []
    for P in CHAIN_P:
        chain = list(zip(*levels[P]))
        exact = cp.fold_states(chain + [chain[-1]])[-1]  # the state after all P slices
        assert relative(exact, S64) < 1e-12  # the float64 fold is the single-rank state
        f32 = cp.fold_states([(M.astype(np.float32), C.astype(np.float32)) for M, C in chain + [chain[-1]]])[-1]
        errors.append(relative(f32, exact))
    return relative(S32, S64), np.array(errors)


chain = {gate: fold_errors(gate) for gate in ("zero", "kimi-init")}
fold_from = {gate: first_above(CHAIN_P, errs / one, 1.0) for gate, (one, errs) in chain.items()}
for gate, (one, errs) in chain.items():
    inside(f"fp32 fold, gate {gate}", fold_from[gate], CHAIN_P)
    print(f"gate {gate:>9}: one rank's fp32 kernel {one:.1e}; the fp32 fold {errs[0]:.1e} at P = 2, "
          f"{errs[list(CHAIN_P).index(64)]:.1e} at P = 64, {errs[-1]:.1e} at P = {CHAIN_P[-1]:,}; "
          f"it exceeds one rank's error from P = {fold_from[gate]:,}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.0))
for P, style in zip(RANKS, ("-", "--", "-.", ":")):
    ax1.semilogx(T_GRID, cp_speedup[P], color=plots.color("cp-allgather"), linestyle=style, label=f"P = {P}")
ax1.axhline(1, color="black", linewidth=0.8, label="break-even (one device)")
ax1.axvspan(np.percentile(prompts, 5), np.percentile(prompts, 95), color="#999999", alpha=0.15,
            label="real prompts, 5th-95th percentile")
ax1.set_xlabel("prompt length T (tokens)")
ax1.set_ylabel("predicted prefill speedup (x, one KDA layer)")
ax1.set_title("Cost model (assumed GPU): short prompts lose")
for gate, style in (("zero", "-"), ("kimi-init", "--")):
    one, errs = chain[gate]
    ax2.plot(CHAIN_P, errs, marker="o", color=plots.color("cp-allgather"), linestyle=style,
             label=f"fp32 fold, gate {gate}")
    ax2.axhline(one, color=plots.color("chunked"), linestyle=style, linewidth=1,
                label=f"one rank's fp32 kernel, gate {gate}")
ax2.set_xscale("log", base=2)
ax2.set_yscale("log")
ax2.set_xlabel(f"ranks P (T = {T_CHAIN:,} tokens)")
ax2.set_ylabel("relative error of the state vs float64")
ax2.set_title("Measured: the fp32 chain of M")
ax1.legend(fontsize=7.5, loc="upper left")
ax2.legend(fontsize=7.5, loc="lower right")
plots.save(fig, "ch12-cp-crossover")
plt.show()

# %% [markdown]
# Takeaway: on the assumed hardware splitting a prompt pays from 2,435 tokens at P = 2
# and from 11,585 at P = 16: more ranks need longer prompts, because each rank's share
# of the compute shrinks while the exchange does not. Half of the real chat prompts (50%)
# are too short for P = 8. Context parallelism is for the long tail (documents, long agent
# histories), not the median chat turn. The fp32 fold is no reason to stop: its error
# grows with the chain but stays below what one device's own fp32 kernel commits on the
# same state until P = 1,024 (no decay) or 2,048 (Kimi's gates), ranks of 8 and 4 tokens.

# %%
verdicts["context parallelism"] = (
    f"use it for long prompts: on the assumed GPU it pays from {cp_from[2]:,} tokens at P = 2 and "
    f"{cp_from[16]:,} at P = 16 ({np.mean(prompts < cp_from[2]):.0%} of real chat prompts are shorter than the "
    f"first); the fp32 fold of M adds less error than one device's fp32 kernel up to P = "
    f"{min(fold_from.values()) // 2:,} (measured, T = {T_CHAIN:,}).")
print(verdicts["context parallelism"])

# %% [markdown]
# ## 6. The fleet: hot prefixes, and isolation a tenant did not need
#
# Chapter 10's prefix affinity (the rule of SGLang's cache-aware router,
# [sglang-router](references.md#sglang-router)) sends a request to the instance that
# holds its prefix. That pays while the fleet's caches cannot all hold every popular prefix, and stops
# paying when popularity is so skewed that least-loaded routing caches the few hot
# prefixes everywhere anyway while affinity piles them onto a few instances. Generated
# traffic (`wl.zipf_prefixes`: 256 shared 16-block prefixes, Zipf popularity, 600
# requests, 1M tokens of memory per instance, 8 instances), because the real trace has
# no knob for skew. Then isolation: chapter 10's quotas and fair admission
# ([vtc](references.md#vtc)) rescue a chat tenant from a document flood. What do they cost when the neighbour is not flooding?
# The real trace's first 600 requests as the chat tenant, on one instance, next to
# fewer or more 48-block documents.

# %%
ZIPF = [0.0, 1.0, 1.5, 2.0, 2.5]
ZIPF_RATES = [60.0, 150.0]
ROUTERS = ("least-loaded", "prefix-affinity")
CHAT = real[:600]
SPAN_S = CHAT[-1].arrival_ms / 1000 / 4  # chapter 10's noisy neighbour runs at 4x the trace's rate
FLOODS = [100, 200, 400, 800]


def flood_tenant(n):
    span = CHAT[-1].arrival_ms
    docs = [Request(i, int(i * span / n), 48 * 512, 64, hash_ids=tuple(range(48 * i, 48 * i + 48))) for i in range(n)]
    return merge_tenants([("chat", CHAT), ("flood", docs)])


def steady_mean_ttft(res, warm=1 / 3):
    """Mean TTFT of the requests after the first third of arrivals (the caches' warm-up left out)."""
    keep = res.arrival_s >= np.quantile(res.arrival_s, warm)
    return float(np.mean(res.ttft_s[keep]))


jobs = [dict(instances=8, router=r, capacity_tokens=1_000_000, requests=wl.zipf_prefixes(600, exponent=e, rate_per_s=rate))
        for rate in ZIPF_RATES for e in ZIPF for r in ROUTERS]
jobs += [dict(instances=1, router="prefix-affinity", capacity_tokens=2_000_000, isolation=iso, rate_scale=4,
              requests=flood_tenant(n)) for n in FLOODS for iso in ("none", "quota")]
out = iter(run_many((), jobs))
zipf_runs = {(rate, e, r): next(out) for rate in ZIPF_RATES for e in ZIPF for r in ROUTERS}
iso_runs = {(n, iso): next(out) for n in FLOODS for iso in ("none", "quota")}

mean_ratio = {rate: np.array([steady_mean_ttft(zipf_runs[rate, e, "prefix-affinity"]) /
                              steady_mean_ttft(zipf_runs[rate, e, "least-loaded"]) for e in ZIPF]) for rate in ZIPF_RATES}
PAYS = 0.95  # affinity pays while its mean TTFT is at least 5% below least-loaded's
skew_from = {rate: next((e for e, x in zip(ZIPF, mean_ratio[rate]) if x >= PAYS), None) for rate in ZIPF_RATES}
for rate in ZIPF_RATES:
    inside(f"affinity at {rate:g} req/s", skew_from[rate], ZIPF)
    print(f"{rate:g} req/s: affinity's mean TTFT / least-loaded's (after warm-up) = " +
          " ".join(f"{x:.2f}" for x in mean_ratio[rate]) + f"; it stops paying at exponent {skew_from[rate]}")
for e in (ZIPF[0], ZIPF[-1]):
    ll, pa = zipf_runs[ZIPF_RATES[0], e, "least-loaded"], zipf_runs[ZIPF_RATES[0], e, "prefix-affinity"]
    print(f"exponent {e}: usable hit least-loaded {ll.usable_hit_rate():.3f}, affinity {pa.usable_hit_rate():.3f}; "
          f"busiest instance busy {ll.utilisation().mean(axis=1).max():.2f} vs {pa.utilisation().mean(axis=1).max():.2f}")

chat_p99 = {key: res.summary()["tenants"]["chat"]["ttft_p99_s"] for key, res in iso_runs.items()}
iso_gain = np.array([chat_p99[n, "none"] / chat_p99[n, "quota"] for n in FLOODS])
flood_rate = np.array(FLOODS) / SPAN_S
iso_from = first_above(flood_rate, iso_gain, 1.0)
inside("isolation", iso_from, flood_rate)
for n, rate, gain in zip(FLOODS, flood_rate, iso_gain):
    print(f"flood {rate:5.2f} documents/s: chat TTFT p99 {chat_p99[n, 'none']:7.3f} s shared, "
          f"{chat_p99[n, 'quota']:6.3f} s isolated ({gain:.2f}x)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.0))
for rate, style in zip(ZIPF_RATES, ("-", "--")):
    ax1.plot(ZIPF, mean_ratio[rate], marker="o", color=plots.color("prefix-affinity"), linestyle=style,
             label=f"affinity / least-loaded, {rate:g} req/s")
ax1.axhline(1, color="black", linewidth=0.8, label="break-even")
ax1.axhline(PAYS, color="black", linewidth=0.8, linestyle=":", label=f"pays: below {PAYS}")
ax1.set_xlabel("Zipf exponent of prefix popularity (0 = uniform)")
ax1.set_ylabel("mean TTFT ratio after warm-up (x, simulated)")
ax1.set_title("Generated traffic, 8 instances: skew ends affinity's gain")
ax2.semilogy(flood_rate, [chat_p99[n, "none"] for n in FLOODS], marker="o", **plots.style_of("isolation-none"))
ax2.semilogy(flood_rate, [chat_p99[n, "quota"] for n in FLOODS], marker="o", **plots.style_of("isolation-quota"))
ax2.set_xlabel("document flood next to the chat tenant (documents per simulated s)")
ax2.set_ylabel("chat tenant's TTFT p99 (simulated s, log)")
ax2.set_title("Real chat tenant, one instance: isolation pays under a flood")
for ax in (ax1, ax2):
    ax.legend(fontsize=7.5, loc="upper left")
plots.save(fig, "ch12-fleet-crossover")
plt.show()

# %% [markdown]
# Takeaway: while popularity is spread out, affinity cuts the mean TTFT by about a third
# (0.68x and 0.66x at exponent 0), because least-loaded routing would need every prefix
# on every instance. From exponent 1.5 that gain is gone at both loads: the hot prefixes
# end up cached everywhere anyway (least-loaded's usable hit rises from 0.011 to 0.685)
# while affinity concentrates the work (its busiest instance is busy 0.54 of the time,
# against 0.35). Past that point affinity loses at every exponent and both loads (its
# mean TTFT 1.05x to 1.42x least-loaded's), and least-loaded is the simpler router.
#
# Isolation is insurance with a premium. Fair admission serves first the tenant that has
# been served fewer tokens, which next to a light neighbour is the neighbour, and the
# chat tail gets worse (a p99 of 1.497 s isolated against 1.017 s shared at 1.99
# documents/s). It pays once the neighbour would saturate the instance, and then by far
# (8.409 s against 30.831 s at 15.92/s).

# %%
verdicts["fleet scheduling"] = (
    f"route by prefix affinity while popularity is spread out; from a Zipf exponent of {min(skew_from.values())} "
    f"(generated traffic, 8 instances) least-loaded is as good. Turn on quotas + fair admission when a neighbour "
    f"can saturate the instance: they pay from {iso_from:.1f} documents/s next to the real chat tenant, and next "
    f"to a lighter one they cost it up to {1 / iso_gain.min():.1f}x on its TTFT p99 "
    f"(at {flood_rate[np.argmin(iso_gain)]:.1f} documents/s).")
print(verdicts["fleet scheduling"])

# %% [markdown]
# ## 7. What a CPU replication cannot tell a GPU buyer
#
# Every number in this book is one of three kinds, and only the first transfers as it is:
#
# | kind | what | on a GPU |
# |---|---|---|
# | exact | kernel equivalences (checked against a slow twin); bytes and pages per request (chapters 1, 3, 4); hit rates of a cache replayed on a trace (5, 6, 10); outputs equal to the baseline's (11, Part A) | the same |
# | modelled | step times, TTFT, TPOT from the roofline on an *assumed* device and link (`kimilab.costs.hardware`, `cp.costs`); dollars per million tokens (11, Part B); every crossover in seconds in this chapter | the shape holds; the level moves with the real kernels' efficiency |
# | measured on this CPU | wall-clock seconds of numpy kernels (chapters 2, 7, 9, `bench/`); turn 2's CPU seconds (11, Part A) | no: launch overheads, memory bandwidth and fused kernels change the balance; only "which path does less work" carries over |
#
# The verdicts below therefore read: the *counts* are facts, the *thresholds in
# seconds* are a model's, and nothing here was timed on an accelerator.

# %% [markdown]
# ## The verdicts
#
# Every line below was computed from a plot above:

# %%
for method, verdict in verdicts.items():
    print(f"{method}:\n  {verdict}\n")

# %% [markdown]
# ## The table
#
# One row per method: what it saves, what it costs, where it stops paying (each entry
# from a sweep above), and the figure that shows it.

# %%
TABLE = [
    ("hybrid model (ch. 3)", "KV of 20 of 27 layers", "20 fixed states per request",
     f"contexts under {cross[CFG.name]:,} tokens", "ch12-hybrid-crossover"),
    ("unified page pool (ch. 4)", "padding of equal pages", "an allocator of many small objects",
     f"a state under {ratio[np.argmax(more)]:.0f} KV pages", "ch12-pool-crossover"),
    ("prefix caching (ch. 5-6)", "prefill of a seen prefix", "memory for KV + checkpoints",
     f"blocks over the prompt; checkpoints denser than every {best_interval:,}; one-turn traffic",
     "ch12-prefix-crossover"),
    ("speculative decoding (ch. 7-8)", "decode steps", "verify FLOPs + rollback",
     f"acceptance under {pays_from[2]:.2f}-{pays_from[8]:.2f} (k = 2-8)", "ch12-spec-crossover"),
    ("context parallelism (ch. 9)", "prefill latency of a long prompt", "P devices + an exchange per layer",
     f"prompts under {cp_from[2]:,} (P = 2) to {cp_from[16]:,} (P = 16) tokens", "ch12-cp-crossover"),
    ("prefix affinity (ch. 10)", "prefill cached on another instance", "load balance",
     f"Zipf exponent {min(skew_from.values())} and up", "ch12-fleet-crossover"),
    ("quotas + fair admission (ch. 10)", "a tenant's tail under a flood",
     f"up to {1 / iso_gain.min():.1f}x that tail next to a light neighbour",
     f"floods under {iso_from:.1f} documents/s", "ch12-fleet-crossover"),
]
widths = [max(len(row[i]) for row in TABLE + [("method", "saves", "costs", "stops paying when", "figure")])
          for i in range(5)]
for row in [("method", "saves", "costs", "stops paying when", "figure")] + TABLE:
    print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())

# %% [markdown]
# ## Summary
#
# - **The hybrid model** pays for its fixed state below 1,885 tokens of context (975 with
#   a bf16 state); on real chat traffic that is 22% of requests but a small share of
#   bytes, so it still holds 62.5% less cache than all-MLA.
# - **The unified pool** matters once a state is many KV pages: at Kimi-Linear-48B's size
#   equal pages waste a sixth of a 4k-token request; with tiny states they waste less.
# - **Prefix caching** stops paying with large blocks (55% of real prompts fit in one
#   8,192-token block), dense checkpoints (`align` every 512 tokens: 0.0444 vs `ends`'
#   0.1456) and traffic that does not repeat (one turn per conversation: nothing for
#   `ends`, the system prompt for `dual`).
# - **Speculative decoding** needs acceptance above 0.57–0.80 (k = 2–8) to beat plain
#   decoding; replay is the better rollback unless its kernel runs below 0.5% of peak.
# - **Context parallelism** loses on short prompts: it pays from 2,435 tokens at P = 2 and
#   11,585 at P = 16 on the assumed hardware; its fp32 fold of M stays more exact than one
#   device's fp32 kernel below P = 1,024.
# - **Prefix affinity** stops paying once popularity is skewed (Zipf exponent 1.5 on
#   generated traffic), and **isolation** is insurance: it costs a quiet tenant up to 1.9x
#   its tail next to a light neighbour and pays from 8.0 documents/s of flood.
# - Only counts and checked equivalences transfer to a GPU as they are; every time here is
#   a model's, on assumed hardware.
#
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **12.1 The memory crossover.** From how many tokens of context does a Kimi-Linear-48B
# request hold less cache than an all-MLA one? (`costs.crossover_tokens`.)

# %% tags=["solution"]
answer = costs.crossover_tokens(CFG, all_mla_27)

# %%
verify("12.1", answer)

# %% [markdown]
# **12.2 Speculation's threshold.** For k = 4 at a 4,096-token context, give the expected
# tokens per verify step at acceptance 0.69 — the rate where the cost model says
# speculation starts to pay. (`spec_costs.expected_tokens_per_step`.)

# %% tags=["solution"]
answer = spec_costs.expected_tokens_per_step(0.69, 4)

# %%
verify("12.2", answer)

# %% [markdown]
# **12.3 Too-large blocks.** What share of the real trace's prompts (fraction of
# requests) fits in one 8,192-token block, and so can never hit at that block size?

# %% tags=["solution"]
answer = float(np.mean(prompts <= 8192))

# %%
verify("12.3", answer)

# %% [markdown]
# **12.4 (open)** Redo section 4 at a 128k-token context. Does the acceptance threshold
# move up or down, and why (what dominates a verify step at long context)?
#
# **12.5 (open)** Section 1 counts prompts only. Add each request's output tokens to its
# context (the trace has `output_length`) and recompute the share of requests below the
# crossovers. Which conclusion changes?
#
# **12.6 (open) Seeds and loads.** Section 6 ran one seed at two loads. Re-run the skew
# sweep with `seed=1` and `seed=2` in `wl.zipf_prefixes` and a third load. Does the
# exponent where affinity stops paying move? How many seeds would you need before you
# print it with two digits?
#
# **12.7 (open) The fold in bf16.** Section 5's fold is float32. Round each transition to
# bf16 before the fold (zero the low 16 bits of its float32 bits) and find the P from
# which the fold's error passes one device's fp32 kernel. Compare with exercise 9.5.
