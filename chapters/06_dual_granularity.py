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
# # 6. Dual-granularity prefix caching
#
# **What you'll build.** A prefix cache for a hybrid model that keeps two kinds of
# memory in one page pool: KV pages at *fine* granularity (one 512-token block per page,
# as in chapter 5) and KDA state *checkpoints* at *coarse* granularity, only where a
# policy puts them. Then you replay an hour of Kimi's chat traffic through it to find
# how often a checkpoint is worth its memory.
#
# **What you'll learn.**
# - What a *usable hit* is: the deepest cached position where both the KV and a state
#   checkpoint exist. A hybrid model resumes there; a KV hit without a state saves nothing.
# - That resuming from a checkpoint is *exact*: the same logits and cache as a cold prefill.
# - Why the checkpoint interval is a memory trade-off: every state is paid for in KV pages.
# - Which interval wins on real traffic, and which policy wins for which traffic: a map.
# - In deep dives: the designs that ship (Marconi, vLLM, SGLang, TensorRT-LLM) beside a
#   clairvoyant cache, int8 checkpoints, DP-attention.
#
# **What you'll need.** Chapter 5 (radix tree, traces, why a KV hit alone saves nothing
# for a hybrid model) and chapter 4 (the page pool). Bytes, FLOPs and seconds are per
# device of vLLM's published Kimi-Linear recipe, four H200s at tensor parallelism 4,
# unless a cell says otherwise (`kimilab.costs`, chapter 3). The exactness check runs
# the reduced, untrained `tiny` model; speeds are CPU speeds of a Python simulation.
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
from IPython.display import display

import kimilab.prefix as prefix
import kimilab.traffic as wl
from kimilab import costs, plots
from kimilab.config import kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import key_results, show_source, show_table
from kimilab.prefix import fidelity, marconi, offload, precision
from kimilab.sim import SGLANG_RATIO, Replay, policy_map, replay_many, simulate, vllm_align_interval
from kimilab.sim.result import SimResult
from kimilab.sim.sweep import replay_records, replay_spec
from kimilab.stored import stored

plots.use_style()
CFG = kimi_linear_48b
DEP, DP = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200
BLOCK = 512
print(DEP.describe())
print(DP.describe())

# %%
# Key results (each number is computed here and derived step by step below)
page = {d: costs.checkpoint_bytes(CFG, d) / (BLOCK * costs.kv_bytes_per_token(CFG, d)) for d in (DEP, DP)}
REAL = f"../data/{wl.MOONCAKE_CONVERSATION}"  # one hour of Kimi's chat traffic (chapter 5)
DEVICE_GB = round(costs.cache_budget_bytes(CFG, DEP) / 1e9, 1)  # one TP4 device's whole cache budget
SIZES = [10, 40, DEVICE_GB, 160]  # GB of cache memory per device
SCHEMES = {"every 512": ("every-block", ()),  # a state every N tokens of the prompt, and at its end
           **{f"every {n:,}": ("periodic", (("interval", n),)) for n in (2048, 8192)},
           "request ends": ("ends", ()),  # N = infinity: only where a prompt ends
           "attention": ("kv-only", ())}  # states free and everywhere: the attention bound


def replays(name, jobs):  # replay_many, kept in data/results (kimilab.stored): {key: Replay} -> {key: result}
    got = stored(name, replay_records, jobs=[replay_spec(job) for job in jobs.values()])
    return {k: SimResult.from_record(r) for k, r in zip(jobs, got)}


sweep = replays("ch6_intervals", {(s, gb): Replay(REAL, p, gb, DEP, options=o) for s, (p, o) in SCHEMES.items()
                                  for gb in SIZES})
hit = {k: r.usable_hit_rate for k, r in sweep.items()}
state_share = {k: r.checkpoint_bytes_mean / (r.checkpoint_bytes_mean + r.kv_bytes_mean) for k, r in sweep.items()}
ends_gap = max(max(hit[s, gb] for s in SCHEMES if s != "attention") - hit["request ends", gb] for gb in SIZES)
h512, hends, hkv = hit["every 512", 40], hit["request ends", 40], hit["attention", 40]
cases = policy_map.cell_summary(policy_map.shipped_map())  # section "Which policy for which traffic"
held = stored("ch6_held_out", policy_map.held_out, n=16)
key_results(
    f"A hybrid model can resume a cached prefix only at a usable hit, where the KV and a KDA state checkpoint "
    f"both exist; a checkpoint costs {page[DEP]:.2f} KV pages of {BLOCK} tokens per TP4 device, "
    f"{page[DP]:.2f} under DP-attention.",
    f"On an hour of Kimi chat at 40 GB per device, a checkpoint every 512 tokens puts {state_share['every 512', 40]:.0%} "
    f"of the memory into states and leaves a usable hit rate of {h512:.3f}; request ends only: {hends:.3f}.",
    f"At every memory size from {SIZES[0]} to {SIZES[-1]} GB the usable hit rises with the checkpoint interval, "
    f"and request ends alone stay within {ends_gap:.3f} of the best interval.",
    f"That is {hends / hkv:.2f} of the {hkv:.3f} an attention model gets from the same 40 GB, and "
    f"{hit['request ends', DEVICE_GB] / hit['attention', DEVICE_GB]:.2f} at a device's whole {DEVICE_GB} GB budget.",
    f"That ranking belongs to chat's sharing structure: over generated traffic that spans it, request ends are enough "
    f"in {sum(c['regime'] == 'ends' for c in cases)} of {len(cases)} cases; a shared prefix nobody ends at makes a "
    f"branch-point state pay, reuse inside prompts a chunk-boundary state (vLLM align, SGLang), by up to "
    f"{max(c['ends_gap'] for c in cases):.2f}. `--policy auto` reads "
    f"the map and comes within {max(c['gap'] for c in held):.3f} of the best online policy on 16 held-out traces.",
)

# %% [markdown]
# ## The usable hit, and what a checkpoint costs
#
# <a id="term-usable-hit"></a>Chapter 5 ended with a problem: the KV of a shared prefix is
# worthless to a hybrid model on its own. A KDA layer carries its whole history in a
# fixed-size state, so to skip the first $p$ tokens of a prompt the model needs the KV of
# those $p$ tokens in every global layer *and* the state of every KDA layer right after
# token $p$. The **usable hit** of a request is the deepest position $p$ where the cache
# holds both; the model loads them and recomputes only the tokens after $p$. The *usable
# hit rate* of a replay is the share of all prompt tokens skipped this way.
#
# A **state checkpoint** is a copy of every KDA state and
# every conv state of a request at one position (`HybridCache.checkpoint()`, chapter 3).
# Its size does not depend on the position, but it does depend on how the model is split
# over devices. Under tensor parallelism each device holds a quarter of the KDA heads (a
# quarter of every state) and the *whole* MLA latent of every token (MLA has one latent
# head); under DP-attention a device holds whole requests. Next to one 512-token page of
# KV on the same device:

# %%
rows = []
for dep in (DEP, costs.VLLM_TP8_H200, DP, costs.ONE_H200):
    kv, ck = costs.kv_bytes_per_token(CFG, dep), costs.checkpoint_bytes(CFG, dep)
    rows.append((dep.name, kv, BLOCK * kv / 2**20, ck / 2**20, ck / (BLOCK * kv), -(-ck // (BLOCK * kv)), ck // kv))
kv_per_token = costs.kv_bytes_per_token(CFG, DEP)
show_table(rows, ["deployment", "KV B/token", "page MiB", "ckpt MiB", "ckpt/page", "pool pages", "KV tokens"],
           formats={"page MiB": ".2f", "ckpt MiB": ".2f", "ckpt/page": ".2f"},
           title="One checkpoint beside one 512-token KV page, per device (KV tokens: what it displaces)")

# %% [markdown]
# On one device of the TP4 recipe a checkpoint (10.35 MiB) costs 2.63 pages, 3 pool pages
# once rounded up; under DP-attention, or with the whole model on one device, it costs
# 10.52 pages (11). States buy usable hits, but they are paid for with KV: a cache that
# stores a state at every block boundary holds four times as much memory per cached block
# at TP4, and twelve times under DP-attention. That trade-off is the whole chapter.
#
# ## The cache: KV blocks in a radix tree, checkpoints on its nodes
#
# `HybridPrefixCache` reuses chapter 5's `RadixTree` for the KV blocks and hangs at
# most one checkpoint on each node (SGLang's `MambaRadixCache` does the same with a
# per-token tree, [sglang](references.md#sglang)). A checkpoint on node *n* is the state
# after the last token of *n*'s block, so its whole prefix's KV is on the path above it.
# Serving one request takes four steps:
#
# 1. match the prompt's blocks: the **KV hit** is the deepest cached block whose KV has
#    been computed;
# 2. the **usable hit** is the deepest node *on that path* with a *computed* checkpoint,
#    capped at prompt length − 1 (the last prompt token must be computed to get the
#    logits that start decoding);
# 3. insert the missing blocks, evicting if the pool is full;
# 4. let the policy pick the positions, beyond the usable hit, where the prefill (which
#    passes through them anyway) should leave a checkpoint, and admit them.
#
# Steps 1 and 2, which define the usable hit in code:

# %%
show_source(prefix.HybridPrefixCache.hits)

# %% [markdown]
# "Computed" matters once requests run side by side (chapter 10): a block or checkpoint
# holds its data only once the prefill that inserted it has passed it. In this chapter's
# replays every request finishes before the next begins. When the pool is full, an
# unpinned KV *leaf* can go (taking its checkpoint with it: a state without its prefix's
# KV is useless) or a checkpoint alone (its KV stays). Whichever the policy ranks lower
# goes first (`HybridPrefixCache.reclaim`).
#
# ### Deep dive: `begin`, the four steps in code

# %%
show_source(prefix.HybridPrefixCache.begin)

# %% [markdown]
# ## Where states go: checkpoint policies
#
# A *policy* says where to admit checkpoints and how to rank what to evict. Ours, from
# the most states to the fewest:
#
# - **`every-block`**: a checkpoint at every 512-token block boundary the prefill passes.
#   <a id="term-checkpoint-interval"></a>More generally, `periodic` with a *checkpoint
#   interval* of $N$ tokens keeps a state at every multiple of $N$ and at the request
#   end; `every-block` is $N = 512$.
# - **`align`**: a state at the end of each 2,048-token prefill chunk, counted from the
#   usable hit, and at the request end.
# - **`ends`**: a state where each request's last whole block ends, plain LRU. The next
#   turn of a conversation re-sends the previous prompt and its reply, so it resumes
#   exactly there. This is $N = \infty$.
# - <a id="term-branch-point"></a>**`ends+branch`**: `ends` plus *branch points*
#   discovered as traffic arrives: a node where a new prompt leaves an already cached
#   path. Still LRU.
# - <a id="term-turnover"></a>**`dual`**: `ends+branch` with a FLOP-aware rank. A unit (a
#   leaf with its checkpoint, or a checkpoint alone) ranks by
#   $\text{rank} = t_\text{last} + \alpha\,F(e)/F(512)$, where $t_\text{last}$ is its last
#   use counted in *turnovers* (pages admitted / pool pages), $F(e)$ the prefill FLOPs of
#   its whole prefix of $e$ tokens, and $\alpha = 0.005$; the lowest rank goes first.
#   With $\alpha = 0$ it *is* `ends+branch` (a test holds them equal).
# - **`kv-only`**, the reference: states are free and everywhere, so usable hit = KV hit
#   at the same KV memory: the *attention bound*.
#
# ### Deep dive: the policies on a toy trace
#
# A toy trace with 4-token blocks: prompts A, B and C share two blocks, then diverge.
# Under `dual`, B's KV hit is 8 tokens but no state exists there, so B recomputes from 0
# and on the way leaves a checkpoint at 8, now a branch point; C resumes there. `ends`
# (and `align` with a long chunk) never learns about the branch; `every-block` has it
# too, at the price of seven checkpoints against `dual`'s four.

# %%
def toy_records(paths):
    """Chained hash ids for little paths of choices (a block id names its whole prefix)."""
    table, out = {}, []
    for t, path in enumerate(paths):
        ids = [table.setdefault(tuple(path[: j + 1]), len(table)) for j in range(len(path))]
        out.append(wl.Request(t, t, 4 * len(path), 1, hash_ids=tuple(ids)))
    return out


toy, rows = toy_records([[0, 0, 1, 1], [0, 0, 2], [0, 0, 3, 3]]), []
for name, kwargs in [("every-block", {}), ("align", {"interval": 64}), ("ends", {}), ("dual", {})]:
    cache = prefix.HybridPrefixCache.for_budget(CFG, prefix.make_policy(name, **kwargs), deployment=DEP,
                                                block_size=4, capacity_tokens=200_000)
    got = [cache.serve(r.hash_ids, r.input_length) for r in toy]
    rows.append((name, str([o.kv_hit for o in got]), str([o.usable_hit for o in got]),
                 str([list(o.checkpoint_positions) for o in got])))
show_table(rows, ["policy", "KV hit (A, B, C)", "usable hit", "checkpoints added"])

# %% [markdown]
# ## Resuming from a checkpoint is exact
#
# The accounting above is only worth anything if resuming is exact. `ModelPrefixCache` is
# the same cache holding real tensors for the runnable `tiny` model. It gives a request a
# paged cache (chapter 4) that starts on the cached KV pages of the usable hit and on a
# copy of the checkpointed states, prefills only the rest, and writes the new blocks' KV
# straight into pages the tree keeps. We compare logits, every KV entry and every KDA and
# conv state with a cold prefill of the full prompt (`tests/test_prefix.py` does the same
# over random traces, with requests running side by side).

# %%
model = Model(tiny, seed=0)
rng = np.random.default_rng(6)
system = rng.integers(0, 256, 40)  # a system prompt every user shares
turn1 = np.concatenate([system, rng.integers(0, 256, 23)])
other = np.concatenate([system, rng.integers(0, 256, 30)])  # another user, same system prompt
later = np.concatenate([system, rng.integers(0, 256, 12)])  # a third, after the branch exists
reply = model.generate(turn1, 8)  # the model's answer to turn 1 (untrained: noise, but real tokens)
turn2 = np.concatenate([turn1, reply, rng.integers(0, 256, 9)])  # re-sends turn 1 AND the reply
store = prefix.ModelPrefixCache(model, "dual", block_size=16, capacity_tokens=16 * 64)
worst, rows = 0.0, []
for name, prompt in [("turn 1", turn1), ("turn 2", turn2), ("other", other), ("later", later)]:
    logits, cache, out = store.prefill(prompt)
    cold = HybridCache(tiny)
    cold_logits = model.prefill(prompt, cold)
    diffs = [np.abs(logits - cold_logits[out.usable_hit:]).max()]
    diffs += [np.abs(a - b).max() for i in tiny.attn_layers for a, b in zip(cache.kv(i), cold.kv(i))]
    diffs += [np.abs(cache.kda_state(i) - cold.kda_state(i)).max() for i in tiny.kda_layers]
    diffs += [np.abs(cache.conv_state(i) - cold.conv_state(i)).max() for i in tiny.kda_layers]
    worst = max(worst, max(diffs))
    cache.free()  # the request is done: its own pages go back, its prompt's blocks stay cached
    rows.append((name, len(prompt), out.kv_hit, out.usable_hit, out.recomputed, str(list(out.checkpoint_positions))))
print(f"logits, KV, KDA and conv states equal a cold prefill: max |diff| < 1e-10: {worst < 1e-10}")
show_table(rows, ["request", "tokens", "KV hit", "usable hit", "recomputed", "new checkpoints at"])

# %% [markdown]
# Turn 2 re-sends turn 1 and the model's 8-token reply to it, as a real next turn does.
# It resumes from turn 1's end (48 of its 80 tokens: the last full block, since the
# tail block was partial). The other user's prompt hits 32 tokens of KV (the system
# prompt's two full blocks) but no state there, recomputes everything, and leaves a
# checkpoint at the branch point 32, which the later user resumes from. Every result
# is the cold prefill's to float64 round-off.
#
# Nothing was copied into a cache on the side: the deep dive below follows the pool's
# pages and shows that request 2 reads the very pages request 1 wrote (the same
# allocation ids), while only states are copied into checkpoint pages.
#
# ### Deep dive: one pool, a finished request's pages become cached prefix
#
# The radix tree and the requests draw pages from one `PagePool`, in which a page holds
# one 16-token block of one global layer's KV (`tiny` has two global layers, so a block is
# two pages). When a prompt arrives, the cache registers its whole blocks in the tree, and
# the request's paged cache *adopts* those very pages (`PagedHybridCache.adopt`): a
# second reference to each page (`pool.share`), so its prefill writes KV straight into
# what will be cached. When the request ends and frees its cache, its references go, and
# the pages stay with their other owner, the tree, the way vLLM's block manager and
# SGLang's radix cache keep a finished request's blocks. Only states are copied, into
# checkpoint pages, because every token overwrites a state. The request's own state
# pages, and the partial last block it keeps writing into, go back to the pool. Which
# blocks a request shares with the tree, and the eviction step a full pool calls:

# %%
display(show_source(prefix.ModelPrefixCache.shared_blocks))
show_source(prefix.HybridPrefixCache.reclaim)

# %%
store = prefix.ModelPrefixCache(model, "dual", block_size=16, capacity_tokens=16 * 64)
pool, layer = store.pool, tiny.attn_layers[0]
moments = []


def pages(moment):
    used = pool.stats().pages_by_kind
    moments.append((moment, used["kv"], used["kda_state"], used["conv_state"], used["checkpoint"], pool.n_free))


pages("empty pool")
_, first, out1 = store.prefill(turn1)
written = first.block_table(layer)
pages("request 1 prefilled (63 tokens)")
first.free()
pages("request 1 finished and freed")
left = (store.cache.kv_pages, store.cache.n_checkpoints, store.cache.checkpoint_pages, out1.checkpoint_positions[0])
logits2, second, out2 = store.prefill(turn2)
pages("request 2 prefilled (80 tokens)")
exact = np.abs(logits2 - model.prefill(turn2, HybridCache(tiny))[out2.usable_hit:]).max() < 1e-10
reads = second.block_table(layer)[:3]
second.free()
pages("request 2 finished and freed")
print(f"request 1 left behind {left[0]} KV pages (3 blocks x 2 layers) and {left[1]} checkpoint "
      f"of {left[2]} pages, at token {left[3]}")
print(f"request 2 resumes at token {out2.usable_hit}; its first blocks of layer {layer}: {reads}")
print(f"request 1's first blocks: {written[:3]}, read in place; logits equal a cold prefill: {exact}")
show_table(moments, ["moment", "KV", "KDA state", "conv state", "checkpoint", "free"],
           title=f"Pool pages by kind (of {pool.n_pages})")

# %% [markdown]
# Request 1 held 12 state pages while it ran (one page of KDA state and one of conv state
# per KDA layer, at 32 KiB a page); they came back the moment it finished, and so did
# the partial last block it wrote (2 pages). Its three whole prompt blocks (6 pages) and
# its checkpoint (8 pages) stayed. Request 2 started on exactly those pages (same
# allocation ids, no copy) and took from the free pages only its own states, its two
# new blocks and a checkpoint at its end, which stay cached after it. The pool holds
# both kinds of memory, so under pressure a running request comes first: when a request
# needs pages and none are free, the pool asks the prefix cache to evict unpinned blocks
# and checkpoints (`PagePool.reclaim`, wired to `HybridPrefixCache.make_room`, which
# runs the `reclaim` above).

# %% [markdown]
# ## How often to checkpoint: an hour of Kimi's chat traffic
#
# Now the chapter's question. Moonshot's conversation trace (chapter 5; 12,031 requests,
# one hour of Kimi's traffic, [mooncake](references.md#mooncake)) is replayed through the
# cache by its own timestamps, one request at a time, at 10 and 40 GB per device, at one
# TP4 device's whole cache budget (`costs.cache_budget_bytes`) and at 160 GB, more than an
# H200 holds. The schemes differ only in the checkpoint interval, all with LRU eviction;
# `kv-only` gives the attention bound. The Key results cell ran these `Replay` jobs with
# `replay_many`, which spreads them over the cores; here we read its `sweep`:

# %%
real = wl.load_trace(REAL, BLOCK)
show_table([(s, *(hit[s, gb] for gb in SIZES), state_share[s, 40]) for s in SCHEMES],
           ["checkpoints", *(f"{gb:g} GB" for gb in SIZES), "states @40 GB"],
           formats={**{f"{gb:g} GB": ".3f" for gb in SIZES}, "states @40 GB": ".0%"},
           title=f"Usable hit rate on {len(real):,} requests (share of the memory in states at 40 GB)")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12.0, 4.4))
spaced, x = [s for s in SCHEMES if s != "attention"], [512, 2048, 8192, 32768]  # request ends at the right edge
for gb, c in zip(SIZES, plt.cm.viridis(np.linspace(0.0, 0.85, len(SIZES)))):
    axes[0].plot(x, [hit[s, gb] for s in spaced], marker="o", color=c, label=f"{gb:g} GB per device")
    axes[0].axhline(hit["attention", gb], color=c, linestyle="--", linewidth=1)
    axes[1].plot(x, [100 * state_share[s, gb] for s in spaced], marker="o", color=c)
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, ["512", "2,048", "8,192", "request\nends only"])
    ax.minorticks_off()
    ax.set_xlabel("checkpoint interval (tokens)")
axes[0].set(ylabel="usable hit rate (token-weighted)", title="Usable hits (dashed: attention bound, same memory)")
axes[1].set(ylabel="share of cache memory in checkpoints (%)", title="Where the memory goes", ylim=(0, 80))
axes[0].legend(fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 0.12))
plots.save(fig, "ch06-interval-sweep")
plt.show()

# %% [markdown]
# Takeaway: on chat traffic, sparser checkpoints win at every memory size. A state every
# 512 tokens puts 75% of 40 GB into states and leaves a usable hit rate of 0.061; every
# 2,048 tokens, 0.133; every 8,192, 0.176; request ends alone, 0.182, within 0.001 of the
# best interval at every size. A mid-prompt state pays only if a later request stops
# exactly there, and on chat the next turn resumes where the previous one *ended*; every
# other state just displaces KV. More memory narrows the gap (0.225 against 0.326 at
# 160 GB) but does not close it. Request ends keep 0.84 of the attention bound's hits at
# 40 GB and 0.89 at the device's whole budget.
#
# The replays run in `RunPrefixCache`, a fast twin of the block tree above that keeps a
# chain of blocks nobody branches from as one node; the deep dive shows every outcome of
# the twin equal to the block tree's.
#
# ### Deep dive: runs of blocks, a fast twin of the block tree
#
# The tree above makes one node per 512-token block. Replaying the trace through it
# creates and evicts one node per new block, and that Python bookkeeping, not the cache's
# decisions, is what a replay costs. Most of those blocks sit in chains that nobody
# branches from: the new suffix of one request, used once. `RunPrefixCache` keeps such a
# chain as **one** node, a *run* of blocks stamped and pinned together. It splits a run
# only where a later prompt stops or leaves it, and when it evicts, it trims a run's tail
# for as long as that tail stays first in the eviction order. That order is total: lowest
# rank, then the block or state whose last request came first, then the shallower. So the
# twin needs the same ranks, not the same queue. It is a twin, not a new design: the same
# policy objects and the same clock. `tests/test_runs.py` holds
# every request's outcome (KV hit, usable hit, checkpoints added and where) equal to the
# block tree's, on random branching traffic and on the real trace; here, the first 3,000
# requests:

# %%
def replay(records, policy, gb, *, fast=True, keep=False):
    """One replay of a trace through a prefix cache of ``gb`` GB per device of the default deployment."""
    policy = prefix.make_policy(policy) if isinstance(policy, str) else policy
    capacity = int(gb * 1e9 // kv_per_token)
    kind = prefix.RunPrefixCache if fast else prefix.HybridPrefixCache.for_budget
    cache = kind(CFG, policy, deployment=DEP, block_size=BLOCK, capacity_tokens=capacity)
    return simulate(records, cache=cache, keep_per_request=keep)


first = real[:3000]
twins = {fast: replay(first, "dual", 40, fast=fast, keep=True) for fast in (False, True)}
print(f"first {len(first):,} requests, dual at 40 GB: every outcome equal: "
      f"{twins[False].per_request == twins[True].per_request}")
print(f"usable hit rate {twins[True].usable_hit_rate:.4f} both ways")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"wall clock, same run: block tree {twins[False].wall_seconds:.2f} s, runs {twins[True].wall_seconds:.2f} s "
      f"({twins[False].wall_seconds / twins[True].wall_seconds:.1f}x)")

# %% [markdown]
# ## Which policy for which traffic: a map
#
# One trace is a case, not a law. `ends` resumes a reused prefix only where an earlier
# prompt ended, so what decides is *where reuse ends*. Four measured numbers describe a
# trace's **sharing structure** (`traffic.sharing_stats`; `traces stats` prints them):
# **common**, the share of requests behind a common prefix (a first block that many
# different second blocks follow: a system prompt); **mid**, the share of reused tokens
# past the last earlier request end on their path, which only a state inside a prompt
# reaches; **turns** per session; and **prompt** length. A cache's size enters as its
# **reach**: its tokens over the new prefix tokens of a busy minute (90th percentile).

# %%
AGENT, RATE = f"../data/{wl.CLAUDE_CODE}", 0.05  # sessions start at 0.05/s (a deep dive below says why)
agent = wl.agent_requests(wl.load_sessions(AGENT), RATE, seed=0)
shared = {"conversation": wl.sharing_stats(real, BLOCK), "agent": wl.sharing_stats(agent, BLOCK)}
show_table([(t, s["common"], s["mid"], s["turns"], s["prompt"],
             *(policy_map.reach_minutes(gb * 1e9 / kv_per_token, s) for gb in (10, 40))) for t, s in shared.items()],
           ["trace", "common", "mid", "turns", "prompt", "reach 10 GB", "reach 40 GB"],
           formats={"common": ".2f", "mid": ".3f", "turns": ".1f", "prompt": ",.0f", "reach 10 GB": ".1f",
                    "reach 40 GB": ".1f"}, title="Sharing structure of the two real traces (reach in minutes)")

# %% [markdown]
# Both real traces reuse almost only where an earlier request ended (mid 0.064 and
# 0.003). To see past them we *generate* traffic (`traffic.sharing_traffic`) with a knob
# for how many sessions open with a system prompt and how often a turn *forks* from
# inside the previous prompt, in a *chat* and an *agent* shape calibrated to the two
# traces, and replay every online cache and the clairvoyant one over a 5 x 5 grid of
# knobs, two seeds each, at a reach of 1, 3 and 9 minutes (`sim.policy_map`). A marker's
# colour is the best online policy; its shape, the *regime*: the kind of state needed to
# come within a tie (0.01 of usable hit, or the seeds' spread if larger) of the best.

# %%
points = policy_map.shipped_map()
cases = policy_map.cell_summary(points)  # per grid cell and reach, seeds averaged: winner, regime, gaps
print(f"{len(points)} traces x {len(policy_map.REACHES)} reaches x {len(policy_map.ONLINE) + 1} caches = "
      f"{len(points) * len(policy_map.REACHES) * (len(policy_map.ONLINE) + 1):,} replays")
MARK = {"ends": "o", "branch": "s", "boundary": "^"}
fig, axes = plt.subplots(2, 3, figsize=(12.5, 7.0), sharex=True, sharey=True)
for ax, (shape, reach) in zip(axes.flat, [(s, r) for s in policy_map.SHAPES for r in policy_map.REACHES]):
    for c in (c for c in cases if (c["shape"], c["reach"]) == (shape, reach)):
        ax.scatter(c["mid"], c["common"], s=80, marker=MARK[c["regime"]], color=plots.color(c["best"]),
                   edgecolor="black", linewidth=0.5)
    star = shared["conversation" if shape == "chat" else "agent"]
    ax.scatter(star["mid"], star["common"], marker="*", s=280, facecolor="none", edgecolor="black")
    ax.set(title=f"{shape} shape, reach {reach:g} min", ylim=(-0.12, 1.12))
fig.supxlabel("mid: share of reuse past the last request end (only a state inside a prompt reaches it)")
fig.supylabel("common: share of requests behind a system prompt")
handles = [plt.Line2D([], [], marker="o", ls="none", color=plots.color(n), label=plots.label(n))
           for n in policy_map.ONLINE] + [plt.Line2D([], [], marker=m, ls="none", mfc="white", mec="black",
                                                     label=f"regime: {k}") for k, m in MARK.items()]
fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, -0.13), ncol=4, fontsize=8)
fig.suptitle("Best online checkpoint policy over generated traffic (stars: the real traces)")
plots.save(fig, "ch06-policy-map")
plt.show()

# %% [markdown]
# Takeaway: three regimes, and the reach moves their borders. Where reuse ends at request
# ends (left) `ends` is enough (circles), unless many prompts branch from a prefix no
# request ends at (top): then a branch-point state pays (squares; `ends+branch`, `dual`).
# Where reuse runs inside prompts (right), only states at chunk boundaries reach it
# (triangles): vLLM `align` where memory is short, SGLang's `extra_buffer` at a reach of
# 9 minutes. On agent traffic at a reach of 1 minute `dual` wins wherever forks are rare:
# with that little memory, the long contexts that cost most to recompute are worth
# keeping, which is what `dual` ranks by. `prefix TRACE --policy auto` reads this map for
# any trace; the deep dive tests it on unseen traffic.

# %% [markdown]
# ### Deep dive: the map in numbers, and the rule `--policy auto`
#
# `policy_map.choose_policy` takes the four mapped traces nearest in all four numbers
# (each scaled by its spread over the map), interpolates their gaps to the best online
# policy between the two nearest reaches, and picks the smallest mean gap. We chose it by
# leaving each grid cell out in turn; here it meets 16 generated traces the map never saw,
# with every knob, the turns, the prompt length and the reach drawn at random, on new
# seeds. Then the regimes per panel, and how much the two seeds disagree:

# %%
checks = stored("ch6_held_out", policy_map.held_out, n=16)
worst = max(c["gap"] for c in checks)
print(f"--policy auto on 16 held-out traces: the best online policy at {sum(c['gap'] == 0 for c in checks)},\n"
      f"within 0.02 at {sum(c['gap'] <= 0.02 for c in checks)}; largest gap {worst:.3f}")
assert worst <= 0.02
# %%
spread = {shape: max(c["spread"] for c in cases if c["shape"] == shape) for shape in policy_map.SHAPES}
print("ends' gap to the best online policy differs between the two seeds by at most\n"
      + ", ".join(f"{v:.3f} ({s})" for s, v in spread.items()))
show_table([(shape, reach, *(sum(c["regime"] == r for c in cases if (c["shape"], c["reach"]) == (shape, reach))
                             for r in MARK)) for shape in policy_map.SHAPES for reach in policy_map.REACHES],
           ["shape", "reach", "ends enough", "branch pays", "boundary pays"], formats={"reach": "g"},
           title="Grid cells (of 25) by the states they need to come within a tie of the best")
show_table([(c["shape"], c["stats"]["common"], c["stats"]["mid"], c["reach"], c["chosen"], c["best"], c["gap"])
            for c in checks], ["shape", "common", "mid", "reach", "auto picks", "best online", "gap"],
           formats={"common": ".2f", "mid": ".2f", "reach": ".1f", "gap": ".3f"},
           title="The rule on held-out generated traffic (gap: best online minus the pick, usable hit)")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12.0, 4.3))
for shape, marker in zip(policy_map.SHAPES, ("o", "^")):
    for reach, color in zip(policy_map.REACHES, plt.cm.viridis(np.linspace(0, 0.85, 3))):
        mine = [c for c in cases if (c["shape"], c["reach"]) == (shape, reach)]
        style = dict(marker=marker, color=color, s=25)
        axes[0].scatter([c["mid"] for c in mine], [c["ends_gap"] for c in mine], label=f"{shape}, reach {reach:g} min",
                        **style)
        axes[1].scatter([c["mid"] for c in mine], [c["of_clairvoyant"] for c in mine], **style)
    mine = [c for c in cases if c["shape"] == shape]
    print(f"{shape}: ends loses at most {max(c['ends_gap'] for c in mine):.3f}; best online / clairvoyant\n  "
          + ", ".join(f"{min(v):.2f}-{max(v):.2f} at reach {r:g}" for r in policy_map.REACHES
                      for v in [[c["of_clairvoyant"] for c in mine if c["reach"] == r]]))
axes[0].axhline(policy_map.TIE, color="black", linestyle=":", linewidth=1)
axes[0].set(xlabel="mid", ylabel="best online - ends (usable hit)", title="What ends leaves on the table")
axes[1].axhline(1.0, color="black", linestyle=":", linewidth=1)
axes[1].set(xlabel="mid", ylabel="best online / clairvoyant", title="What knowing the future is worth")
axes[0].legend(fontsize=8, ncol=2)
plots.save(fig, "ch06-policy-gaps")
plt.show()

# %% [markdown]
# Takeaway: what `ends` leaves behind grows with mid, to 0.13 on chat and 0.25 on agent
# traffic when most turns fork; near mid 0 it is at most the branch state of a shared
# prefix. The clairvoyant cache stands far above every online policy only where memory
# is short (reach 1 minute); at 9 minutes the best online policy has nearly all of it, and
# on forking agent traffic SGLang's split pools pass it: the clairvoyant cache is a strong
# reference, not a bound (`prefix.oracle` says why).

# %% [markdown]
# ## Verdict, as regimes
#
# Which states to keep is a property of the traffic:
#
# - **Reuse ends where earlier prompts ended**: keep states at request ends only, spend
#   the rest on KV. Both real traces live here: on them `ends` stays within 0.006 of the
#   best online policy.
# - **Many prompts branch from a prefix no request ends at**: a branch-point state pays
#   (`ends+branch`, `dual`). The Kimi trace sits at such a point of the map, yet on the
#   trace `ends` loses only 0.002 at 40 GB: some of its requests end right at the system
#   prompt, so `ends` keeps that state too, a feature the four numbers do not see.
# - **Reuse inside prompts**: only chunk-boundary states reach it (vLLM `align`, SGLang
#   `extra_buffer`), by up to 0.13 over `ends` on chat traffic.
#
# The verdicts are byte-driven (bytes and the trace, not kernel times). The deep dives
# test both real traces against the designs that ship, a clairvoyant cache, int8
# checkpoints, DP-attention and a host-memory tier.
#
# ### Deep dive: the designs that ship, as their engines store states
#
# Each is replayed as its engine stores states:
#
# - **Marconi** ([marconi](references.md#marconi)) admits what `ends+branch` admits and
#   evicts as its artifact's `evict_v2` does. Every node with at most one child is a
#   candidate: a leaf with its segment, or an inner node's state alone. For a node whose
#   segment runs from its parent's end $p$ to its own end $e$, with state bytes $S$ and
#   KV bytes $k$ per token,
#
#   $$\text{eff} = \frac{F(e) - F(p)}{S + k\,e}, \qquad
#     \text{rec} = \frac{1}{t_\text{now} - t_\text{last}}, \qquad
#     \text{score} = \alpha\,\widehat{\text{eff}} + \widehat{\text{rec}},$$
#
#   where the hats are min-max normalised over all current candidates, and the lowest
#   score goes. The FLOPs are saved *relative to the parent* (what this node adds) per
#   byte of one state plus its whole prefix's KV. $\alpha$ starts at 0 and is tuned
#   online: when the cache has seen five times as many requests as it had at its first
#   eviction, it replays all of them from an empty cache at each $\alpha$ in 0, 0.1, ...,
#   2.0 and keeps the one that saved the most prefill FLOPs over the window's last 500
#   requests (`config_tuner.py`, [marconi-artifact](references.md#marconi-artifact)).
# - **vLLM `align`** ([vllm-prefix](references.md#vllm-prefix)) at vLLM's own block size for the
#   deployment, a state at each scheduled chunk's end (chunks are split on the block grid)
#   and at the request's last whole block, and at the *shared-prefix boundary* where a
#   prompt's KV hit outruns its state hit; one pool, LRU.
# - **SGLang `no_buffer` / `extra_buffer`** ([sglang-prefix](references.md#sglang-prefix)) on two
#   pools fixed in advance: states get 0.9 / 1.9 of the memory (its
#   `--mamba-full-memory-ratio`), KV the rest. `no_buffer` keeps a state at each
#   chunked-prefill chunk's end and at the request end; `extra_buffer` also at the
#   branching point where the KV hit outruns the state hit. When KV runs short the least
#   recently used leaf goes; when states run short, the least recently used state
#   anywhere (an inner one becomes a "tombstone": its KV stays).
# - **TensorRT-LLM** ([trtllm-prefix](references.md#trtllm-prefix)) snapshots every
#   `mamba_state_cache_interval` tokens from token 0 and at the prompt's end, in one pool
#   with LRU block reuse: that is `periodic`, the interval sweep above; at 512 tokens it
#   is `every-block` (its example configuration uses 256, finer than the trace resolves).
# - <a id="term-clairvoyant-cache"></a>The **clairvoyant cache** (`oracle`,
#   `prefix.oracle`) knows every request still to come. It admits a state only where a
#   later request will resume and evicts, Belady-style, what is worth least per byte per
#   request until its next use. Caching with sizes and values is NP-hard to do optimally,
#   so it is a strong reference, not a proven bound: each curve reads against what could
#   be reached at all.
#
# Marconi's and SGLang's trees keep a node per *segment* (the KV between two places
# that matter), so they run in `prefix.SegmentCache`, which a test holds equal to a
# block-by-block slow twin. Marconi's eviction, as code:

# %%
display(show_source(marconi.MarconiScorer.victim))
show_source(marconi.efficiency)

# %% [markdown]
# The two ranks differ in three ways. `dual` prices a checkpoint by the FLOPs of its
# *whole* prefix per checkpoint and holds its weight fixed; Marconi prices the FLOPs a
# node adds over its parent per byte of state *and* prefix KV, normalises both terms over
# the candidates at every eviction (so $\alpha$ means the same at any scale), and tunes
# $\alpha$ on the traffic it sees.
#
# **vLLM in detail.** For a hybrid model vLLM keeps one pool of equal pages: it raises the
# attention block until one MLA layer's page holds one KDA layer's state, per device
# ([vllm](references.md#vllm); `costs.vllm_hybrid_pages`, chapter 3). Its shipped
# prefix-caching mode for GDN/KDA models is `align` ([vllm-prefix](references.md#vllm-prefix), PR #30877): the scheduler cuts a
# prefill into chunks on the block grid and keeps the state at each chunk's end. Since
# then a state at the *shared-prefix boundary* is kept too (PR #37898, extended to the
# retention intervals of PRs #43447 / #45845 by #47782); with the default retention every
# chunk end stays. The `all` mode, a state at every block, is still in open pull requests
# for these models. For Kimi-Linear in particular: `KimiLinearForCausalLM` declares no
# `SupportsMambaPrefixCaching`, and the published recipe pins vLLM 0.11.2, whose
# `MambaModelConfig` turns prefix caching *off* for such a model; later versions turn it
# on in `align` mode instead (and fall back from `all` to `align`). So what vLLM ships
# for this model today is `align` at the block sizes below, or nothing:

# %%
rows = []
for dep in (DEP, costs.VLLM_TP8_H200, DP):
    v = costs.vllm_hybrid_pages(CFG, dep)
    rows.append((dep.name, v.block_tokens, v.checkpoint_blocks, v.checkpoint_blocks * v.block_tokens,
                 vllm_align_interval(dep, v.block_tokens), dep.max_batched_tokens))
short = sum(r.input_length <= costs.vllm_hybrid_pages(CFG, DP).block_tokens for r in real)
print(f"prompts of at most one DP-attention block, which can never hit there: {short:,} of {len(real):,} "
      f"({short / len(real):.0%})")
show_table(rows, ["deployment", "block", "state blocks", "state = KV of", "align every", "max batched"],
           title="vLLM's hybrid pages per device (tokens)")

# %% [markdown]
# At TP4 vLLM's block is 480 tokens, *finer* than the trace's 512-token blocks, and a
# state costs 3 of them. The replay keys a vLLM block by the trace block that holds its
# last token (`sim.rekey`), so it counts a hit only where the trace proves one; with a
# block finer than the trace that rounds vLLM's hits down by up to a block. SGLang keeps
# states in their own pool beside the KV pool, sized once at start; since 0.5.23 it can
# store the *cached* states int8 (`mamba_checkpoint_pool.py`, deep dive on int8 below).
#
# ### Deep dive: both real traces, every policy, and a clairvoyant cache
#
# The conversation trace is chat. For agents we replay real coding-agent traffic: 80
# Claude Code sessions (5,668 requests, prompts growing to hundreds of thousands of
# tokens as tool outputs pile up, sub-agents inside), converted to 512-token blocks
# (`data/README.md`). The sessions carry no start times, so the arrival process is ours
# and stated: sessions start as a Poisson process at 0.05 per second (one every 20 s on
# average, all 80 within half an hour) and each replays its requests at their recorded
# offsets. Mooncake's release also has a Kimi agent trace, `toolagent_trace.jsonl`
# ([claude-code](references.md#claude-code): 23,608 requests); the copy of the release this
# project could read has no such file, so the agent numbers rest on the Claude Code sessions.

# %%
TRACES = {"conversation": REAL, "agent": AGENT}
rows = []
for name, records in (("conversation", real), ("agent", agent)):
    s = wl.trace_stats(records, BLOCK)
    cold = 1e3 * sum(costs.prefill_seconds(CFG, DEP, r.input_length) for r in records[:2000]) / 2000
    rows.append((name, s["requests"], s["duration_s"] / 3600, s["input_mean"], s["input_p99"],
                 s["reuse_upper_bound"], cold))
show_table(rows, ["trace", "requests", "hours", "mean prompt", "p99 prompt", "ceiling", "cold ms"],
           formats={"hours": ".1f", "mean prompt": ",.0f", "p99 prompt": ",.0f", "ceiling": ".3f", "cold ms": ",.0f"},
           title="The two traces (ceiling: infinite-cache hit rate; cold ms: mean prefill, first 2,000 requests)")

# %% [markdown]
# The agent sessions are a different world: prompts ten times longer, and almost all of
# each one (0.959 at infinite cache) is the session's own previous request. A cold
# prefill of one takes 932 ms (mean of the first 2,000), against 77 ms for a chat
# request, so every hit is worth a great deal.
#
# Now every policy on both traces at 10 and 40 GB and at the device budget, each with int8
# checkpoints beside the native fp32 ones where a cache can store them (vLLM sizes its
# pages to the state, so its int8 would be another layout), and the curves at 160 GB on
# chat. Each replay also turns hits into time: the prefill seconds a request's usable
# hit saves (its TTFT, cold prefill minus prefill from the hit, the request alone on the
# deployment, `costs.prefill_seconds`). Replays the Key results cell already ran are
# reused, not run again.

# %%
TABLE_GB = [10, 40, DEVICE_GB]
INT8 = ["oracle", "ends", "ends+branch", "dual", "marconi", "sglang-extra-buffer"]  # int8 where a cache can store it
TABLE = ["kv-only", "oracle", "ends", "ends+branch", "dual", "marconi", "vllm-align", "sglang-no-buffer",
         "sglang-extra-buffer"]
ONLINE = [n for n in TABLE if n not in ("kv-only", "oracle")]
CURVES = ["kv-only", "oracle", "ends", "ends+branch", "dual", "vllm-align", "sglang-extra-buffer"]
jobs = {}
for t, path in TRACES.items():
    for gb in TABLE_GB + ([160] if t == "conversation" else []):
        for name in (TABLE if gb in TABLE_GB else CURVES):
            jobs[t, name, "native", gb] = Replay(path, name, gb, DEP, sessions_per_s=RATE)
        for name in (INT8 if gb in TABLE_GB else ["ends", "ends+branch"]):
            jobs[t, name, "int8", gb] = Replay(path, name, gb, DEP, precision="int8", sessions_per_s=RATE)
for gb in SIZES:
    jobs["conversation", "ends", "bf16", gb] = Replay(REAL, "ends", gb, DEP, precision="bf16")
for gb in (10, 40):
    for name in ("kv-only", "ends", "ends+branch", "dual", "vllm-align"):
        jobs["conversation", name, "dp", gb] = Replay(REAL, name, gb, DP)
    jobs["conversation", "vllm-align", "tp8", gb] = Replay(REAL, "vllm-align", gb, costs.VLLM_TP8_H200)
    jobs["conversation", "vllm-align", "no-shared-prefix", gb] = Replay(REAL, "vllm-align", gb, DEP,
                                                                         options=(("kv_boundary", False),))
jobs |= {("conversation", n, "native", 40): Replay(REAL, n, 40, DEP) for n in ("every-block", "align")}
done = {Replay(REAL, p, gb, DEP, options=o): sweep[s, gb] for s, (p, o) in SCHEMES.items() for gb in SIZES}
new = replays("ch6_policies", {k: job for k, job in jobs.items() if job not in done})
runs = {k: new[k] if k in new else done[job] for k, job in jobs.items()}
print(f"{len(jobs)} replays of two real traces per device of {DEP.name} "
      f"({len(jobs) - len(new)} reused from the interval sweep)")


def table(t):
    """Usable hit (fp32 | int8) and prefill ms saved per request, per policy and budget."""
    rows = []
    for name in TABLE:
        row = [name]
        for gb in TABLE_GB:
            r, q = runs[t, name, "native", gb], runs.get((t, name, "int8", gb))
            row += [r.usable_hit_rate, f"{q.usable_hit_rate:.3f}" if q else "-", r.prefill_ms_saved_per_request]
        rows.append(row)
    cols = ["policy"] + [f"{gb:g} {c}" for gb in TABLE_GB for c in ("hit", "i8", "ms")]
    return show_table(rows, cols, formats={c: (".3f" if c.endswith("hit") else ".1f") for c in cols
                                           if c.endswith(("hit", "ms"))},
                      title=f"{t} trace: usable hit (fp32, i8 = int8) and prefill ms saved per request, by GB")


table("conversation")

# %%
table("agent")

# %% [markdown]
# (`ms saved` is per request, fp32 checkpoints. Marconi's tuned weight is printed below.)
#
# Read each row against two references: `kv-only`, the hits an attention model of the
# same KV size would get, and `oracle`, the clairvoyant cache. How far is the best
# online policy from the clairvoyant one, at the same checkpoint precision?

# %%
rows = []
for t in TRACES:
    for gb in TABLE_GB:
        for prec in ("native", "int8"):
            online = {n: runs[t, n, prec, gb] for n in ONLINE if (t, n, prec, gb) in runs}
            best = max(online, key=lambda n: online[n].usable_hit_rate)
            r, o = online[best].usable_hit_rate, runs[t, "oracle", prec, gb].usable_hit_rate
            rows.append((t, gb, prec, best, r, r / o, o, o - r, runs[t, "kv-only", "native", gb].usable_hit_rate))
show_table(rows, ["trace", "GB", "ckpt", "best online", "hit", "/ oracle", "oracle", "gap", "kv-only"],
           formats={"GB": "g", "hit": ".3f", "/ oracle": ".2f", "oracle": ".3f", "gap": ".3f", "kv-only": ".3f"},
           title="The best online policy against the clairvoyant cache")

# %%
show_table([(t, gb, prec, runs[t, "marconi", prec, gb].policy_detail) for t in TRACES for gb in TABLE_GB
            for prec in ("native", "int8")], ["trace", "GB", "ckpt", "Marconi's tuned weight"],
           formats={"GB": "g"})

# %%
rows = []  # what --policy auto picks on the real traces, against their best online policy
for t in TRACES:
    for gb in TABLE_GB:
        pick = policy_map.choose_policy(shared[t], gb * 1e9 / kv_per_token, points)[0]
        hits = {n: runs[t, n, "native", gb].usable_hit_rate for n in ONLINE}
        best = max(hits, key=hits.get)
        rows.append((t, gb, pick, hits[pick], best, hits[best], hits[best] - hits[pick]))
show_table(rows, ["trace", "GB", "auto picks", "hit", "best online", "best hit", "gap"],
           formats={"GB": "g", "hit": ".3f", "best hit": ".3f", "gap": ".3f"},
           title="The map's rule on the two real traces (fp32 checkpoints)")

# %% [markdown]
# What the tables say, per device of the TP4 recipe:
#
# - **On these two traces the simplest policies win** (they sit where reuse ends at request
#   ends; the map shows where that stops). On both and at every budget the best online
#   policy is `ends+branch` or, on the conversation trace at 10 GB only, `dual` (0.058
#   against 0.055); `ends` is never more than 0.006 behind the best. Branch points add
#   little: 0.184 against 0.182 at 40 GB on chat, 0.937 against 0.936 on agents.
# - **Marconi as published** ties `ends+branch` wherever its tuning kept alpha at 0
#   (chat at 40 GB and at the device budget, agents at 40 GB; on agents at the budget
#   the bootstrap window never closed), and loses where it chose more: alpha 1.2 on chat
#   at 10 GB gives 0.053 against 0.055, alpha 0.3 on agents at 10 GB gives 0.629 against
#   0.664. Its window is the first few hundred requests of the trace, which did not
#   predict the rest.
# - **`dual`'s fixed weight fails on agent traffic**: 0.442 against `ends`' 0.664 at
#   10 GB and 0.628 against 0.936 at 40 GB. Its rank grows with the FLOPs of the *whole*
#   prefix, and every agent prompt is long, so old sessions' contexts outlive the live
#   ones. On chat it loses at 40 GB (0.158 against 0.182) and wins a little at 10 GB.
# - **vLLM `align`**, at its own 480-token blocks, keeps 0.158 at 40 GB on chat (`ends`:
#   0.182) and 0.928 on agents (0.936): its states at every chunk end of a long prefill
#   cost memory that request ends alone would leave to KV.
# - **SGLang's split pools lose most**: 0.121 at 40 GB on chat, 0.510 at 10 GB on agents
#   (`ends`: 0.664). Its KV pool gets 1 / 1.9 of the memory whatever the traffic needs;
#   `extra_buffer`'s branch points add under 0.002, and int8 states change nothing,
#   because its KV pool, not its state pool, is what runs out (next deep dive).
# - **The clairvoyant cache** is far above every online policy where memory is scarce and
#   most prefixes are never reused: on chat at 10 GB the best online policy reaches 0.22
#   of it, 0.50 at 40 GB and 0.77 at the whole device; on agents, whose sessions come
#   back to nearly everything, 0.84 at 10 GB, 0.98 at 40 GB, and all of it (1.00) at the
#   device budget. That gap is what knowing which prefix comes back is worth; no online
#   rank of recency and FLOPs closes much of it.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12.0, 4.6))
DODGE = {"kv-only": 0.94, "oracle": 0.96, "ends": 0.98, "ends+branch": 1.0, "dual": 1.02, "marconi": 1.04,
         "vllm-align": 1.06, "sglang-extra-buffer": 1.08}
MARKERS = {"kv-only": "s", "oracle": "*", "ends": "o", "ends+branch": "D", "dual": "^", "marconi": "P",
           "vllm-align": "v", "sglang-extra-buffer": "X"}
for ax, t in zip(axes, TRACES):
    for name in CURVES + ["marconi"]:
        sizes = [gb for gb in SIZES if (t, name, "native", gb) in runs]  # measured sizes only
        y = [runs[t, name, "native", gb].usable_hit_rate for gb in sizes]
        style = dict(color=plots.color(name), label=plots.label(name), marker=MARKERS[name], markersize=6)
        x = [gb * DODGE[name] for gb in sizes]
        if name == "marconi":  # measured at the table's three budgets only: markers, no line
            ax.plot(x, y, linestyle="none", **style)
        else:
            ax.plot(x, y, linewidth=1.2, **style)
    ax.axvline(DEVICE_GB, color="black", linestyle=":", linewidth=1)
    ax.text(DEVICE_GB * 1.02, 0.02, "one device's\ncache budget", fontsize=8, va="bottom")
    ax.set_xscale("log", base=2)
    measured = sorted({gb for (tt, _, _, gb) in runs if tt == t and gb in SIZES})
    ax.set_xticks(measured, [f"{g:g}" for g in measured])
    ax.minorticks_off()
    ax.set_ylim(0, 1.0 if t == "agent" else 0.42)
    ax.set_xlabel(f"cache memory per device (GB of KV + checkpoints, {DEP.name})")
    ax.set_ylabel("usable hit rate (token-weighted)")
axes[0].set_title("Kimi conversation hour (Mooncake)")
axes[1].set_title(f"Claude Code agent sessions ({RATE} sessions/s)")
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8)
plots.save(fig, "ch06-real-trace-sweep")
plt.show()

# %% [markdown]
# Takeaway: the online policies bunch together under the attention bound, led by
# `ends+branch`; `dual` falls away on agent traffic, SGLang's split pools sit lowest,
# and the clairvoyant cache stands far above them all only on chat with little memory.
# (Points are dodged sideways a little so the bunched ones stay visible; lines join
# measured sizes only, and Marconi, measured at the table's three budgets, is drawn as
# markers alone.)
#
# ### Deep dive: where the memory goes
#
# The same 40 GB per device on the conversation trace, split between KV pages and
# checkpoints (time average over the replay; the pool is full almost all the time):

# %%
split_gb = 40
names = ["kv-only", "every-block", "align", "ends", "ends+branch", "dual", "marconi", "vllm-align",
         "sglang-extra-buffer"]
kv_gb = np.array([runs["conversation", n, "native", split_gb].kv_bytes_mean / 1e9 for n in names])
ck_gb = np.array([runs["conversation", n, "native", split_gb].checkpoint_bytes_mean / 1e9 for n in names])
fig, ax = plt.subplots(figsize=(8.0, 4.2))
y = np.arange(len(names))
ax.barh(y, kv_gb, color=plots.color("kv"), label=plots.label("kv"))
ax.barh(y, ck_gb, left=kv_gb, color=plots.color("checkpoint"), label=plots.label("checkpoint"))
for i, n in enumerate(names):
    ax.text(kv_gb[i] + ck_gb[i] + 0.5, i, f"usable hit {runs['conversation', n, 'native', split_gb].usable_hit_rate:.3f}",
            va="center", fontsize=8)
ax.axvline(split_gb, color="black", linestyle=":", linewidth=1, label="budget")
ax.set_yticks(y, [plots.label(n) for n in names])
ax.invert_yaxis()
ax.set_xlim(0, split_gb * 1.45)
ax.set_xlabel(f"mean memory in use per device (GB, {DEP.name})")
ax.set_title(f"Memory split on the conversation trace, budget {split_gb} GB per device")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
plots.save(fig, "ch06-memory-split")
plt.show()
rows = []
for n in names:
    r = runs["conversation", n, "native", split_gb]
    share = r.checkpoint_bytes_mean / (r.checkpoint_bytes_mean + r.kv_bytes_mean)
    rows.append((n, r.kv_bytes_mean / 1e9, r.checkpoint_bytes_mean / 1e9, share, r.checkpoints_admitted,
                 r.checkpoints_evicted))
sg = runs["conversation", "sglang-extra-buffer", "native", split_gb]
state_pool = split_gb * SGLANG_RATIO / (1 + SGLANG_RATIO)
print(f"SGLang's pools: states {state_pool:.1f} GB ({sg.checkpoint_bytes_mean / 1e9:.1f} GB in use on average), "
      f"KV {split_gb - state_pool:.1f} GB ({sg.kv_bytes_mean / 1e9:.1f} GB in use)")
show_table(rows, ["policy", "KV GB", "ckpt GB", "ckpt share", "admitted", "evicted"],
           formats={"KV GB": ".1f", "ckpt GB": ".1f", "ckpt share": ".0%"},
           title=f"Mean memory per device at {split_gb} GB, and checkpoints admitted and evicted")

# %% [markdown]
# Takeaway: the policies differ in *what* they keep. `every-block` holds 75% of its
# memory in checkpoints and `align` 43%; `ends`, `ends+branch` and Marconi 12%, `dual`
# 8%. SGLang's fixed split is the other way round: its state pool (18.9 GB) holds 4.8 GB
# of states on average while its KV pool (21.1 GB) is full, memory stranded in the
# wrong pool, as chapter 4 measured for running requests, now costing hits.
#
# ### Deep dive: cheaper checkpoints, bf16 and int8
#
# A cached state is read once, on a hit, and decoding then goes on at full precision;
# so a cache may keep its states at lower precision than the running request, and the
# only error is one rounding per stored state. SGLang's `MambaCheckpointPool`
# ([sglang-prefix](references.md#sglang-prefix)) stores each KDA state as int8 with one symmetric scale
# per (head, key channel) (the largest |S| over the value axis over `QMAX = 127`, in the
# state's own dtype) and the conv window at its native dtype
# (`prefix.precision.int8_quantize`). A bf16 store rounds each fp32 element to 16 bits.
# The bytes of one checkpoint on one device:

# %%
rows = []
for dep in (DEP, DP):
    pg = BLOCK * costs.kv_bytes_per_token(CFG, dep)
    rows += [(dep.name, p, precision.checkpoint_bytes(CFG, dep, p) / 2**20, precision.checkpoint_bytes(CFG, dep, p) / pg)
             for p in precision.PRECISIONS]
b = {p: precision.checkpoint_bytes(CFG, DEP, p) for p in precision.PRECISIONS}
print(f"int8 is {b['native'] / b['int8']:.2f}x smaller than fp32 and {b['bf16'] / b['int8']:.2f}x smaller than bf16")
show_table(rows, ["deployment", "precision", "MiB", "KV pages"], formats={"MiB": ".2f", "KV pages": ".2f"},
           title="One checkpoint per device (KV pages of 512 tokens)")

# %% [markdown]
# What does a hit from a rounded state cost in quality? On the reduced model
# (`prefix.fidelity`): a 96-token conversation in which request 1 prefills 24 tokens and
# leaves a checkpoint; each later request resumes from the previous request's *rounded*
# checkpoint and the KV it computed, prefills 24 more tokens and leaves its own rounded
# checkpoint, so after c hits a state has been rounded c times, each rounding feeding
# the next. The last request finishes the prompt and decodes 8 tokens (teacher-forced on
# the exact greedy tokens). Against a cold prefill: the largest logit error, relative to
# the spread of the logits, and how often the greedy token agrees; means over 5 random
# prompts with their range. ("native" rounds to fp32: the 48B model's running states are
# fp32, so its native checkpoint is an exact copy; here it shows the float64 model's floor.)

# %%
model = Model(tiny, seed=0)
FIDELITY_SEEDS = range(5)
rows = [r for seed in FIDELITY_SEEDS
        for r in fidelity.hit_chain_errors(model, np.random.default_rng(seed).integers(0, 256, 96), [24, 48, 72],
                                           precision.PRECISIONS, decode=8)]
table_rows = []
for p in precision.PRECISIONS:
    for c in (1, 2, 3):
        sel = [r for r in rows if r["precision"] == p and r["hits"] == c]
        rel = np.array([r["max_rel"] for r in sel])
        agree = np.array([r["agree"] for r in sel])
        table_rows.append((p, c, rel.mean(), f"{rel.min():.2e}-{rel.max():.2e}", agree.mean(),
                           f"{agree.min():.3f}-{agree.max():.3f}"))
show_table(table_rows, ["checkpoints", "hits", "logit error", "range", "greedy agree", "range "],
           formats={"logit error": ".2e", "greedy agree": ".3f"},
           title="Max logit error / logit std, and greedy-token agreement, over 5 prompts")

# %% [markdown]
# One int8 rounding moves the logits by 7.8e-03 of their spread, three in a row by
# 8.2e-03; bf16 by 1.5e-03 to 1.9e-03; the fp32 floor is 2.3e-08. The error hardly grows
# along the chain: each rounding is relative to the state's own scale, and the decay of
# the tokens prefilled between two hits forgets part of the earlier error. The greedy
# token changed only in the int8 chains of two hits (agreement 0.993 on average, 0.982
# at worst). The model is untrained and its logits are nearly flat, so near-ties are
# common; what a 0.8% logit error does to a trained model's answers has to be measured
# on one.
#
# And what the smaller states buy, on both traces from 10 to 160 GB per device: the
# usable hit and the prefill time saved by `ends` and `ends+branch` with fp32, bf16 and
# int8 checkpoints.

# %%
rows = []
for t in TRACES:
    for gb in SIZES:
        for name in ("ends", "ends+branch"):
            if (t, name, "int8", gb) not in runs:
                continue
            r, q = runs[t, name, "native", gb], runs[t, name, "int8", gb]
            b = runs.get((t, name, "bf16", gb))
            rows.append((t, gb, name, r.usable_hit_rate, f"{b.usable_hit_rate:.3f}" if b else "", q.usable_hit_rate,
                         r.prefill_ms_saved_per_request, q.prefill_ms_saved_per_request,
                         f"{q.prefill_ms_saved_per_request / r.prefill_ms_saved_per_request - 1:+.1%}"))
show_table(rows, ["trace", "GB", "policy", "fp32", "bf16", "int8", "ms fp32", "ms int8", "gain"],
           formats={"GB": "g", "fp32": ".3f", "int8": ".3f", "ms fp32": ".1f", "ms int8": ".1f"},
           title="Usable hit by checkpoint precision, and prefill ms saved per request")

# %% [markdown]
# int8 checkpoints buy what their bytes buy: on chat `ends` saves 2.5% more prefill time
# at 10 GB, 6.4% at 40 GB, 3.6% at the device budget and 3.0% at 160 GB (usable hit
# 0.182 to 0.193 at 40 GB), with bf16 between; on agents under 1%. The gain is modest
# because a request-end policy keeps few states (12% of the memory at 40 GB): most of
# the distance to the attention bound is states that were never admitted or were
# evicted, not bytes per state. A cheaper state pays most for policies that keep many.
#
# ### Deep dive: DP-attention, and vLLM on every deployment
#
# Under DP-attention each device holds whole requests, so a checkpoint costs 10.5 pages
# there instead of 2.6: four times more KV per state. Does the verdict between `ends`,
# `ends+branch` and `dual` move? And vLLM's `align`, replayed at each deployment's own
# block (480 tokens at TP4, 240 at TP8, 1,888 under DP-attention), with and without the
# shared-prefix boundary:

# %%
rows = []
for gb in (10, 40):
    for label, prec in (("TP4", "native"), ("DP4", "dp")):
        got = {n: runs["conversation", n, prec, gb].usable_hit_rate for n in ("kv-only", "ends", "ends+branch", "dual")}
        rows.append((gb, label, *got.values(), got["dual"] / got["ends"], got["ends"] / got["kv-only"]))
display(show_table(rows, ["GB", "attention", "kv-only", "ends", "ends+branch", "dual", "dual/ends", "ends/kv-only"],
                   formats={c: ".3f" for c in ("kv-only", "ends", "ends+branch", "dual", "dual/ends", "ends/kv-only")},
                   title="Conversation trace, usable hit rate: TP4 against DP-attention"))
v = {(k, gb): runs["conversation", "vllm-align", k, gb].usable_hit_rate
     for k in ("native", "tp8", "dp", "no-shared-prefix") for gb in (10, 40)}
show_table([(gb, v["native", gb], v["tp8", gb], v["dp", gb], v["no-shared-prefix", gb]) for gb in (10, 40)],
           ["GB", "TP4 (480)", "TP8 (240)", "DP (1,888)", "TP4, no boundary"],
           formats={c: ".3f" for c in ("TP4 (480)", "TP8 (240)", "DP (1,888)", "TP4, no boundary")},
           title="vLLM align on its own blocks (tokens); no boundary: PR #30877 alone")

# %% [markdown]
# vLLM's own block is what decides its verdict: at TP4 and TP8 its blocks are finer than
# the trace's and `align` keeps 0.158 and 0.163 at 40 GB, close to `dual`; under
# DP-attention its 1,888-token blocks (a state costs 3 of them, the KV of 5,664 tokens)
# leave 0.074 at 40 GB and 0.004 at 10 GB, where 22% of the prompts fit in one block and
# can never hit. The shared-prefix boundary adds a little (0.154 to 0.158 at 40 GB).
#
# The ranking between the three does not move: `dual` is ahead of `ends` at 10 GB
# (1.059 under TP4, 1.010 under DP-attention) and behind at 40 GB (0.870 and 0.963).
# What moves is the price of every state: `ends` keeps 0.839 of the attention bound at
# 40 GB under TP4 but 0.672 under DP-attention, where each checkpoint displaces four
# times as much KV. A claim about how close a hybrid cache comes to an attention model
# must therefore name its deployment.
#
# ### Deep dive: a second tier, host DRAM or SSD
#
# Everything above keeps the cache in HBM. Mooncake, Kimi's own platform, keeps cached KV
# in the cluster's CPU DRAM and SSDs as well and moves it over RDMA
# ([mooncake](references.md#mooncake)); SGLang's hierarchical cache and vLLM's connectors
# do the same per node. For a hybrid model a hit loaded from such a tier moves the KV of
# its tokens *and* one checkpoint. When is loading faster than recomputing? Per device of
# each deployment (`prefix.offload`: a transfer at the tier's bandwidth plus a fixed
# latency, against `costs.prefill_seconds_saved`; link rates in [pcie](references.md#pcie)):

# %%
rows = []
for dep in (DEP, DP):
    for tier in offload.TIERS:
        for n in (4096, 32768):
            hit_tokens = n // 2
            load = offload.load_seconds(CFG, dep, tier, hit_tokens)
            recompute = costs.prefill_seconds_saved(CFG, dep, n, hit_tokens)
            rows.append((dep.name, tier.name, hit_tokens, n, 1e3 * load, 1e3 * recompute, recompute / load,
                         offload.break_even_tokens(CFG, dep, tier, n)))
state_ms = 1e3 * precision.checkpoint_bytes(CFG, DEP) / offload.HOST_DRAM.bandwidth
print(f"one checkpoint from host DRAM at TP4: {state_ms:.3f} ms (int8: "
      f"{1e3 * precision.checkpoint_bytes(CFG, DEP, 'int8') / offload.HOST_DRAM.bandwidth:.3f} ms)")
ratio = costs.band(lambda d: costs.prefill_seconds_saved(CFG, d, 32768, 16384)
                   / offload.load_seconds(CFG, d, offload.HOST_DRAM, 16384), DEP, lambda x: x > 1)
print(f"recompute / load, 16,384-token hit from host DRAM at TP4: {ratio.describe('{:.0f}', 'x')}")
show_table(rows, ["deployment", "tier", "hit", "of", "load ms", "recompute ms", "x", "break-even"],
           formats={"load ms": ".2f", "recompute ms": ".2f", "x": ".0f"},
           title="Load a hit from a second tier, or recompute it (half of each prompt hits)")

# %% [markdown]
# Loading wins from the first block on: a 16,384-token hit loads from host DRAM in
# 2.28 ms at TP4 against 78.26 ms of prefill (34x), and from one SSD in 10.31 ms
# (8x); a checkpoint alone takes 0.172 ms from DRAM. The second line is the DRAM ratio
# under each of chapter 3's 36 plausible kernel sets: the load is bytes over a link,
# the recompute moves with the kernels, and loading wins under every one. So a second
# tier turns this chapter's capacity question into a bandwidth one: the 160 GB column
# above is within what host DRAM per device can hold, and a state is cheap to move.
# What this arithmetic leaves out is contention (the PCIe link also carries other
# requests' traffic) and the HBM copy itself; Mooncake's design exists to schedule
# exactly that.
#
# That arithmetic prices one hit. A replay says how many hits a tier brings back.
# `prefix.host.TieredPrefixCache` is this chapter's block tree with host DRAM below
# it. What HBM evicts, blocks and checkpoints both, is copied to the host, which evicts
# least recently used first. At each arrival, every position where a state and all the
# KV before it are cached, in HBM or on the host, is priced: the prefill seconds it
# saves less the seconds to load what is only on the host. The best one is loaded back
# into HBM, and the request then finds it there. SGLang's HiCache sizes its host pool
# as a multiple of the GPU pool, 2 in its guide's example
# ([hicache](references.md#hicache)); 256 GB is a 2 TB host shared by eight devices.
# Request ends at 40 GB of HBM per device, on the whole hour:

# %%
from kimilab.prefix.host import TieredPrefixCache


def tiered(host_gb, gb=40):
    """The hour through `ends` at ``gb`` GB of HBM per device over a host tier of ``host_gb`` GB."""
    cache = TieredPrefixCache.for_budget(CFG, prefix.make_policy("ends"), deployment=DEP, block_size=BLOCK,
                                         capacity_tokens=int(gb * 1e9 // kv_per_token), host_bytes=host_gb * 1e9)
    return simulate(real, cache=cache), cache


rows = [("none", hit["request ends", 40], 0, 0.0, 0.0, 0.0)]
for host_gb in (80, 256, float("inf")):
    res, cache = tiered(host_gb)
    rows.append((f"{host_gb:g} GB" if host_gb < float("inf") else "unbounded", res.usable_hit_rate, cache.loads, cache.loaded_bytes / 1e9, cache.load_seconds,
                 cache.saved_seconds + cache.load_seconds))
print(f"usable hit x{rows[1][1] / rows[0][1]:.1f} with 80 GB of host DRAM, x{rows[2][1] / rows[0][1]:.1f} with 256 GB")
print(f"at 256 GB the loads take {rows[2][4] / rows[2][5]:.1%} of the prefill seconds they save")
show_table(rows, ["host DRAM", "usable hit", "loads", "GB loaded", "link s", "prefill s they save"],
           formats={"usable hit": ".3f", "GB loaded": ".0f", "link s": ".1f", "prefill s they save": ".0f"},
           title="Request ends, 40 GB of HBM per device, over a host tier (TP4, one device)")

# %% [markdown]
# The tier moves the answer more than any checkpoint policy did. At 40 GB of HBM, the
# usable hit of request ends rises by more than half with a host pool twice that size,
# and nearly doubles with 256 GB. The link time is a few percent of the prefill it
# replaces. Two checks hold
# the tier exact (`tests/test_host_tier.py`). A tier of zero bytes, or on a link too slow
# to pay, gives every request the same outcome as no tier. An unbounded tier on a free
# link gives every request the usable hit of an HBM cache with no limit. What this replay
# leaves out is time: its loads are free for the requests around them. The engine
# charges them (each step waits for the loads admitted before it), and chapter 11
# re-derives the agent and chat verdicts with the tier on.
#
# ### Deep dive: how fast the simulation runs
#
# Wall-clock CPU time of the replays above (varies with the machine; a Python
# simulation's speed, not a serving speed; Marconi's includes its tuning replays):

# %%
# NBVAL_IGNORE_OUTPUT
ran = list(sweep.values()) + list(new.values())
print(f"{len(ran)} replays: {sum(r.wall_seconds for r in ran):.1f} s of wall clock summed over both workers")
print(f"conversation, 40 GB: every-block {runs['conversation', 'every-block', 'native', 40].wall_seconds:.2f} s, "
      f"align {runs['conversation', 'align', 'native', 40].wall_seconds:.2f} s")
show_table([(n, *(runs[t, n, "native", DEVICE_GB].wall_seconds for t in TRACES)) for n in TABLE],
           ["policy", *(f"{t} s" for t in TRACES)], formats={f"{t} s": ".2f" for t in TRACES},
           title=f"Seconds per replay at {DEVICE_GB} GB (this machine)")

# %% [markdown]
# ## Summary
#
# - **Built.** `HybridPrefixCache`: KV per 512-token block in chapter 5's radix tree, at
#   most one state checkpoint per node, both in the requests' page pool. `hits` finds the
#   *usable hit* (the deepest node with the KV and a computed checkpoint), `begin` matches,
#   inserts and admits what the policy asks for, eviction weighs a KV leaf against a
#   checkpoint alone. Resuming is exact (< 1e-10 on the tiny model).
# - **Found.** A checkpoint costs 2.63 KV pages of 512 tokens per TP4 device (10.52 under
#   DP-attention). On an hour of Kimi chat, request ends alone beat every denser grid at
#   every size from 10 to 160 GB (0.182 at 40 GB, 0.84 of the attention bound). That is a
#   regime, not a law: on generated traffic, a prefix many prompts branch from makes
#   branch-point states pay, and reuse inside prompts chunk-boundary states (up to 0.13
#   on chat). `prefix --policy auto` picks from that map.
# - **Scope.** Requests replayed one at a time, whole 512-token blocks, prefill time from
#   the cost model (chapter 3), an untrained reduced model for exactness and quality.
#
# **Next chapter:** speculative decoding drafts tokens that may be rejected; how do you
# take a rejected draft back out of a KDA state that has already absorbed it?

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **6.1 How many pages? (predict, then run)** On one device of the TP4 recipe, with
# 256-token blocks instead of 512: how many pool pages does one checkpoint take, rounded
# up as the pool does? First write down your prediction from the cost table (is it just
# twice the 512-token answer?), then compute it.

# %% tags=["solution"]
answer = -(-costs.checkpoint_bytes(CFG, DEP) // (256 * costs.kv_bytes_per_token(CFG, DEP)))

# %%
verify("6.1", answer)

# %% [markdown]
# **6.2 A small pool.** How many whole fp32 checkpoints fit in 10 GB (10^10 bytes) of one
# TP4 device, with no KV at all?

# %% tags=["solution"]
answer = int(10e9 // costs.checkpoint_bytes(CFG, DEP))

# %%
verify("6.2", answer)

# %% [markdown]
# **6.3 A budget the sweep skips (predict, then run).** The headline table gives the
# usable hit rate of request-end checkpoints (`ends`) at 10 and 40 GB per device. Before
# replaying, write down what you expect at 25 GB: on the straight line between the two,
# above it or below it, and why. Then replay the whole conversation trace with `ends` at
# 25 GB per device of the TP4 recipe, fp32 checkpoints, and compare.

# %% tags=["solution"]
answer = replay_many({25: Replay(REAL, "ends", 25, DEP)})[25].usable_hit_rate

# %%
verify("6.3", answer)

# %% [markdown]
# **6.10 An int8 checkpoint.** How many bytes does one int8 checkpoint take on one device
# of the TP4 recipe (SGLang's layout: int8 states, one fp32 scale per head and key
# channel, bf16 conv windows)?

# %% tags=["solution"]
answer = precision.checkpoint_bytes(CFG, DEP, "int8")

# %%
verify("6.10", answer)

# %% [markdown]
# **6.8 (open, ~45 min) The interval under DP-attention.** There a checkpoint costs four
# times as much KV as at TP4. Predict first: does the best interval move, and does the
# distance between "every 512 tokens" and "request ends" grow or shrink? Then repeat the
# headline sweep at 10 and 40 GB per device of `DP` and explain what you see with the
# share of the memory the states hold.
#
# **6.9 (project, ~4 h) What the oracle knows.** The clairvoyant cache admits a state
# only where a later request will resume. Give `ends` that foresight and nothing else: a
# policy (subclass `prefix.Policy`, with `positions` and the `begin(index, keys)` hook
# that `prefix.SegmentCache` calls before each request) that asks a
# `prefix.oracle.FutureIndex` who comes back, run in a `prefix.SegmentCache` with
# `prefix.LRUScorer` eviction through `sim.simulate` on the conversation trace at 10 GB.
# How much of the gap between `ends` and the clairvoyant cache does admission alone
# close, and what is left for eviction?
