# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
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
#
# **What you'll need.** Chapters 1–8; every number here comes from their code
# (`kimilab.costs` at Kimi-Linear-48B sizes, the real Mooncake trace through
# `RunPrefixCache`). Context parallelism (chapter 9) and scheduling (chapter 10) get
# their crossovers in this chapter when those chapters land.

# %%
import shutil
import tempfile

import matplotlib.pyplot as plt
import numpy as np

import kimilab.traffic as wl
from kimilab import costs, plots
from kimilab.config import all_mla_27, kimi_linear_48b
from kimilab.costs import CacheShapes
from kimilab.costs import spec as spec_costs
from kimilab.exercises import verify
from kimilab.pool import UnifiedPages, VllmPaddedPages
from kimilab.sim import Replay, replay_many

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
for k in speedup:
    print(f"k = {k}: faster than plain decoding from acceptance {pays_from[k]:.2f}; "
          f"{speedup[k][-1]:.2f}x at acceptance 1")
KEPT = np.arange(1, 10)  # positions kept of k + 1 = 9 (k = 8)
EFFICIENCIES = [0.05, 0.005, 0.002, 0.001, 0.0005]  # fraction of peak the replay kernel reaches
replay_over_snapshot = {eff: np.array([spec_costs.rollback_seconds(CFG, "replay", 8, int(j), efficiency=eff)
                                       / spec_costs.rollback_seconds(CFG, "snapshot", 8, int(j)) for j in KEPT])
                        for eff in EFFICIENCIES}
snapshot_from = {eff: first_above(KEPT, r, 1.0) for eff, r in replay_over_snapshot.items()}
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
# ## The verdicts
#
# Every line below was computed from a plot above:

# %%
for method, verdict in verdicts.items():
    print(f"{method}:\n  {verdict}\n")

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
# - Still to come here: context parallelism (where splitting a prompt loses, and the fp32
#   error of the M chain) and scheduling (where affinity stops paying), with chapters 9
#   and 10.
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
