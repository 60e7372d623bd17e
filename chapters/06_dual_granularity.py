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
# memory in one page pool: KV pages at *fine* granularity (one 512-token block per
# page, as in chapter 5) and KDA state *checkpoints* at *coarse* granularity, only
# where a policy admits them. Our own policies (`ends`, `ends+branch`, `dual`) stand
# beside the designs that ship, replayed as their engines store them: vLLM's `align`
# mode at vLLM's own block size, SGLang's `no_buffer` and `extra_buffer` strategies on
# its split pools, TensorRT-LLM's periodic snapshots, and Marconi's eviction as its
# authors published it. Beside them, a *clairvoyant* cache that knows every request
# still to come, so each curve reads against what could be reached at all.
#
# **What you'll learn.**
# - The *usable hit*: the deepest position where both the KV and a state checkpoint
#   exist. A hybrid model resumes there and recomputes only the rest.
# - Why the trade-off is memory, and why it depends on the deployment: on one device of
#   vLLM's TP4 recipe a checkpoint costs 2.6 KV pages of 512 tokens, under DP-attention 10.5.
# - Which policy wins where, on two real traces -- Kimi's conversation hour (Mooncake)
#   and 80 Claude Code agent sessions -- at 10 GB to a whole device's free memory per
#   device: usable hit rate and the prefill time it saves.
# - What int8 and bf16 checkpoints buy in hits and cost in quality.
# - That resuming from a checkpoint is *exact*: the same logits and final cache as a
#   cold prefill, on the tiny model.
#
# **What you'll need.** Chapter 5 (radix tree, traces, why a KV hit alone saves nothing
# for a hybrid model) and chapter 4 (the page pool). Bytes are per device of a named
# deployment and FLOPs and seconds come from the same one (`kimilab.costs`, chapter 3):
# vLLM's published Kimi-Linear recipe, four H200s at tensor parallelism 4, unless a cell
# says DP-attention. The exactness and quality checks run the reduced, untrained `tiny`
# model. Speeds are CPU speeds of a Python simulation. This chapter replays both real
# traces 119 times; it takes about 45 s on two idle cores.

# %%
import matplotlib.pyplot as plt
import numpy as np

import kimilab.prefix as prefix
import kimilab.traffic as wl
from kimilab import costs, plots
from kimilab.config import kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import show_source
from kimilab.prefix import fidelity, marconi, offload, precision
from kimilab.sim import SGLANG_RATIO, Replay, replay_many, simulate, vllm_align_interval

plots.use_style()
CFG = kimi_linear_48b
DEP, DP = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200
BLOCK = 512
print(DEP.describe())
print(DP.describe())

# %% [markdown]
# ## What a checkpoint costs, per device
#
# Chapter 5 ended with the problem: the KV of a shared prefix is worthless to a hybrid
# model unless it also has the KDA state at exactly the end of that prefix. A *state
# checkpoint* is a copy of every KDA state and every conv state of a request at one
# position (`HybridCache.checkpoint()`, chapter 3). Its size does not depend on the
# position -- but it does depend on how the model is split over devices. Under tensor
# parallelism each device holds a quarter of the KDA heads (so a quarter of every state)
# and the *whole* MLA latent of every token (MLA has one latent head). Under
# DP-attention a device holds whole requests. Next to one 512-token page of KV on the
# same device:

# %%
print(f"{'deployment':<16} {'KV/token':>9} {'page (512)':>11} {'checkpoint':>11} {'ckpt/page':>9} "
      f"{'pool pages':>10} {'KV tokens it displaces':>22}")
for dep in (DEP, costs.VLLM_TP8_H200, DP, costs.ONE_H200):
    kv, ck = costs.kv_bytes_per_token(CFG, dep), costs.checkpoint_bytes(CFG, dep)
    page = BLOCK * kv
    print(f"{dep.name:<16} {kv:>7,d} B {page / 2**20:>7.2f} MiB {ck / 2**20:>7.2f} MiB {ck / page:>9.2f} "
          f"{-(-ck // page):>10d} {ck // kv:>22,d}")
kv_per_token, ckpt_bytes = costs.kv_bytes_per_token(CFG, DEP), costs.checkpoint_bytes(CFG, DEP)
ckpt_pages = -(-ckpt_bytes // (BLOCK * kv_per_token))

# %% [markdown]
# On one device of the TP4 recipe a checkpoint (10.35 MiB) costs 2.63 pages, rounded
# up to 3 pool pages; under DP-attention, or with the whole model on one device, it
# costs 10.5 pages (11). The same policy therefore pays four times as much memory per
# state in one deployment as in the other, and a verdict about which policy wins can
# flip with the deployment: the chapter shows both where it does. Storing a state at
# every block boundary multiplies the memory per cached block by four at TP4 and by
# twelve under DP-attention. States buy usable hits, but they are paid for with KV.

# %% [markdown]
# ## The cache: KV blocks in a radix tree, checkpoints on its nodes
#
# `HybridPrefixCache` reuses chapter 5's `RadixTree` for the KV blocks and hangs at
# most one checkpoint on each node (SGLang's `MambaRadixCache` does the same with a
# per-token tree: KV per token, at most one state per node,
# [sglang](references.md#sglang)). A checkpoint on node *n* is the state after the last
# token of *n*'s block, so its whole prefix's KV is on the path above it, always.
# Serving one request:
#
# 1. match the prompt's blocks: the **KV hit** is the deepest cached block whose KV has
#    been computed;
# 2. the **usable hit** is the deepest node *on that path* with a *computed* checkpoint
#    (capped at prompt length − 1, since the last prompt token must be computed to get
#    the logits that start decoding). In a replay every request finishes before the next
#    begins, so every block and checkpoint is computed; chapter 10's engine runs requests
#    side by side and marks a block or checkpoint computed only once a prefill has passed it;
# 3. insert the missing blocks, evicting if the pool is full;
# 4. let the policy pick the positions, beyond the usable hit, where the prefill (which
#    passes through them anyway) should leave a checkpoint, and admit them.

# %%
show_source(prefix.HybridPrefixCache.begin)

# %% [markdown]
# When the pool is full, two kinds of things can go: an unpinned KV *leaf* (taking its
# checkpoint with it, since a state without the KV of its prefix is useless) or a
# checkpoint alone (its KV stays; it may still serve a deeper checkpoint). The
# cheapest of the two, by the policy's rank, goes first:

# %%
show_source(prefix.HybridPrefixCache.reclaim)

# %% [markdown]
# ## Where states go, and what is evicted first
#
# Each policy answers two questions: where to admit checkpoints, and how to rank what
# to evict. Ours, each one idea more than the one before:
#
# - **`kv-only`**: the pure-attention reference. States are free and everywhere, so
#   usable hit = KV hit at the same KV memory and eviction order: the *attention bound*.
# - **`every-block`**: a checkpoint at every 512-token block boundary the prefill passes.
#   (This is what TensorRT-LLM's `mamba_state_cache_interval` does at 512 tokens; it is
#   *not* vLLM's `all` mode, whose blocks are vLLM's own, below.)
# - **`align`**: checkpoints at the end of each prefill chunk of 2,048 tokens and at the
#   request end, on 512-token blocks.
# - **`ends`**: a checkpoint where each request's last whole block ends, plain LRU. The
#   next turn of a conversation re-sends the previous prompt and its reply, so it
#   resumes exactly there.
# - **`ends+branch`**: `ends` plus *branch points* discovered as traffic arrives -- a node
#   where a new prompt leaves an already cached path. Still LRU.
# - **`dual`**: `ends+branch` with a FLOP-aware rank. A unit (a leaf with its
#   checkpoint, or a checkpoint alone) ranks by
#
#   $$\text{rank} = t_\text{last} + \alpha\,\frac{F(e)}{F(512)},$$
#
#   where $t_\text{last}$ is its last use in *turnovers* (pages admitted / pool pages),
#   $F(e)$ the prefill FLOPs of its whole prefix of $e$ tokens, and $\alpha = 0.005$;
#   the lowest rank goes first, and the state of a live branch point is never evicted
#   alone. With $\alpha = 0$ it *is* `ends+branch` (a test holds them equal).
#
# And the designs that ship, each replayed as its engine stores states:
#
# - **Marconi** ([marconi](references.md#marconi)) admits what `ends+branch` admits and
#   evicts as its artifact's `evict_v2` does. Every node with at most one child is a
#   candidate -- a leaf with its segment, or an inner node's state alone. For a node whose
#   segment runs from its parent's end $p$ to its own end $e$, with state bytes $S$ and
#   KV bytes $k$ per token,
#
#   $$\text{eff} = \frac{F(e) - F(p)}{S + k\,e}, \qquad
#     \text{rec} = \frac{1}{t_\text{now} - t_\text{last}}, \qquad
#     \text{score} = \alpha\,\widehat{\text{eff}} + \widehat{\text{rec}},$$
#
#   where the hats are min-max normalised over all current candidates, and the lowest
#   score goes. The FLOPs are saved *relative to the parent* -- what this node adds --
#   per byte of one state plus its whole prefix's KV. $\alpha$ starts at 0 and is
#   tuned online: when the cache has seen five times as many requests as it had at its
#   first eviction, it replays all of them from an empty cache at each $\alpha$ in
#   0, 0.1, ..., 2.0 and keeps the one that saved the most prefill FLOPs over the
#   window's last 500 requests (`config_tuner.py`, [marconi-artifact](references.md#marconi-artifact)).
# - **vLLM `align`** ([vllm-prefix](references.md#vllm-prefix)) at vLLM's own block size for the
#   deployment, a state at each scheduled chunk's end (chunks are split on the block
#   grid) and at the request's last whole block, and at the *shared-prefix boundary*
#   where a prompt's KV hit outruns its state hit; one pool, LRU.
# - **SGLang `no_buffer` / `extra_buffer`** ([sglang-prefix](references.md#sglang-prefix)) on two
#   pools fixed in advance: states get 0.9 / 1.9 of the memory (its
#   `--mamba-full-memory-ratio`), KV the rest. `no_buffer` keeps a state at each
#   chunked-prefill chunk's end and at the request end; `extra_buffer` also at the
#   branching point where the KV hit outruns the state hit. When KV runs short the least
#   recently used leaf goes; when states run short, the least recently used state
#   anywhere (an inner one becomes a "tombstone": its KV stays).
#
# Marconi's and SGLang's trees keep a node per *segment* -- the KV between two places
# that matter -- so they run in `prefix.SegmentCache`, which a test holds equal to a
# block-by-block slow twin. Marconi's eviction, as code:

# %%
show_source(marconi.MarconiScorer.victim)
show_source(marconi.efficiency)

# %% [markdown]
# The two ranks differ in three ways. `dual` prices a checkpoint by the FLOPs of its
# *whole* prefix per checkpoint and holds its weight fixed; Marconi prices the FLOPs a
# node adds over its parent per byte of state *and* prefix KV, normalises both terms over
# the candidates at every eviction (so $\alpha$ means the same at any scale), and tunes
# $\alpha$ on the traffic it sees.
#
# A toy trace with 4-token blocks shows where states go. Prompts A and B share two
# blocks and then diverge; C shares the same two blocks. Under `dual`, A leaves a
# state at its end only. B's KV hit is 8 tokens, but no state exists at 8, so B
# recomputes from 0 -- and on the way leaves a checkpoint at 8, because 8 is now a
# branch point. C resumes there. `ends` (and `align` with a long chunk, which stores
# request ends only) never learns about the branch; `every-block` has it too, at the
# price of seven checkpoints against `dual`'s four.

# %%
def toy_records(paths):
    """Chained hash ids for little paths of choices (a block id names its whole prefix)."""
    table, out = {}, []
    for t, path in enumerate(paths):
        ids = [table.setdefault(tuple(path[: j + 1]), len(table)) for j in range(len(path))]
        out.append(wl.Request(t, t, 4 * len(path), 1, hash_ids=tuple(ids)))
    return out


toy = toy_records([[0, 0, 1, 1], [0, 0, 2], [0, 0, 3, 3]])
for name, kwargs in [("every-block", {}), ("align", {"interval": 64}), ("ends", {}), ("dual", {})]:
    cache = prefix.HybridPrefixCache.for_budget(CFG, prefix.make_policy(name, **kwargs), deployment=DEP,
                                                block_size=4, capacity_tokens=200_000)
    rows = [cache.serve(r.hash_ids, r.input_length) for r in toy]
    print(f"{name:<12} KV hit {[o.kv_hit for o in rows]}  usable {[o.usable_hit for o in rows]}  "
          f"checkpoints added {[list(o.checkpoint_positions) for o in rows]}")

# %% [markdown]
# ## Resuming from a checkpoint is exact
#
# The accounting above is only worth anything if resuming is exact. `ModelPrefixCache`
# is the same cache holding real tensors for the runnable `tiny` model, in the same page
# pool as the requests it serves (next section). To serve a prompt it gives the request
# a paged cache (chapter 4) that starts on the cached KV pages of the usable hit and on
# a copy of the checkpointed states, prefills only the rest — in pieces that end at the
# positions where new checkpoints are captured — and writes the new blocks' KV straight
# into pages the tree keeps. We compare each request with a cold prefill of the full
# prompt (a test, `tests/test_prefix.py`, does the same over random traces, with requests
# still running while the next one shares their pages):

# %%
model = Model(tiny, seed=0)
rng = np.random.default_rng(6)
system = rng.integers(0, 256, 40)
turn1 = np.concatenate([system, rng.integers(0, 256, 23)])
other = np.concatenate([system, rng.integers(0, 256, 30)])  # another user, same system prompt
later = np.concatenate([system, rng.integers(0, 256, 12)])  # a third, after the branch exists
reply = model.generate(turn1, 8)  # the model's answer to turn 1 (untrained: noise, but real tokens)
turn2 = np.concatenate([turn1, reply, rng.integers(0, 256, 9)])  # the next turn re-sends turn 1 AND the reply
store = prefix.ModelPrefixCache(model, "dual", block_size=16, capacity_tokens=16 * 64)
worst = 0.0
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
    print(f"{name:<7} {len(prompt):3d} tokens: KV hit {out.kv_hit:2d}, usable {out.usable_hit:2d}, "
          f"recomputed {out.recomputed:2d}, new checkpoints at {list(out.checkpoint_positions)}")
print(f"logits, KV, KDA and conv states equal a cold prefill: max |diff| < 1e-10: {worst < 1e-10}")

# %% [markdown]
# Turn 2 re-sends turn 1 and the model's 8-token reply to it, as a real next turn does.
# It resumes from turn 1's end (48 of its 80 tokens: the last full block, since the
# tail block was partial). The other user's prompt hits 32 tokens of KV (the system
# prompt's two full blocks) but no state there, recomputes everything, and leaves a
# checkpoint at the branch point 32, which the later user resumes from. Every result
# is the cold prefill's to float64 round-off.
#
# ## One pool: a finished request's pages become cached prefix
#
# Nothing above was copied into a cache on the side. The radix tree and the requests draw
# pages from one `PagePool`, in which a page holds one 16-token block of one global
# layer's KV (`tiny` has two global layers, so a block is two pages). When a prompt
# arrives, the cache registers its whole blocks in the tree, and the request's paged
# cache *adopts* those very pages (`PagedHybridCache.adopt`): a second reference to each
# page (`pool.share`), so its prefill writes KV straight into what will be cached. When
# the request ends and frees its cache, its references go, and the pages stay with their
# other owner, the tree — the way vLLM's block manager and SGLang's radix cache keep a
# finished request's blocks. Only states are copied, into checkpoint pages, because
# every token overwrites a state. The request's own state pages, and the partial last
# block it keeps writing into, go back to the pool. Watch the pool's page counts:

# %%
show_source(prefix.ModelPrefixCache.shared_blocks)

# %%
store = prefix.ModelPrefixCache(model, "dual", block_size=16, capacity_tokens=16 * 64)
pool, layer = store.pool, tiny.attn_layers[0]


def pages(moment):
    used = pool.stats().pages_by_kind
    print(f"{moment:<31} KV {used['kv']:3d}  KDA state {used['kda_state']:3d}  conv state "
          f"{used['conv_state']:3d}  checkpoint {used['checkpoint']:3d}  free {pool.n_free:3d} of {pool.n_pages}")


pages("empty pool")
_, first, out1 = store.prefill(turn1)
written = first.block_table(layer)
pages("request 1 prefilled (63 tokens)")
first.free()
pages("request 1 finished and freed")
print(f"  left behind: {store.cache.kv_pages} KV pages (3 blocks x 2 layers) and "
      f"{store.cache.n_checkpoints} checkpoint of {store.cache.checkpoint_pages} pages, at token {out1.checkpoint_positions[0]}")
logits2, second, out2 = store.prefill(turn2)
pages("request 2 prefilled (80 tokens)")
print(f"  request 2 resumes at token {out2.usable_hit}; its first blocks of layer {layer} are "
      f"{second.block_table(layer)[:3]}, request 1's were {written[:3]}: read in place")
cold = HybridCache(tiny)
print(f"  logits equal a cold prefill: {np.abs(logits2 - model.prefill(turn2, cold)[out2.usable_hit:]).max() < 1e-10}")
second.free()
pages("request 2 finished and freed")

# %% [markdown]
# Request 1 held 12 state pages while it ran (one page of KDA state and one of conv state
# per KDA layer, at 32 KiB a page); they came back the moment it finished, and so did
# the partial last block it wrote (2 pages). Its three whole prompt blocks (6 pages) and
# its checkpoint (8 pages) stayed. Request 2 started on exactly those pages — same
# allocation ids, no copy — and took from the free pages only its own states, its two
# new blocks and a checkpoint at its end, which stay cached after it. The pool holds
# both kinds of memory, so under pressure a running request comes first: when a request
# needs pages and none are free, the pool asks the prefix cache to evict unpinned blocks
# and checkpoints (`PagePool.reclaim`, wired to `HybridPrefixCache.make_room`).

# %% [markdown]
# ## Replaying an hour of traffic: runs of blocks
#
# The tree above makes one node per 512-token block. Replaying Moonshot's conversation
# trace (chapter 5; 12,031 requests, one hour of Kimi's traffic,
# [mooncake](references.md#mooncake)) through it creates and evicts one node per new
# block, and that Python bookkeeping -- not the cache's decisions -- is what a replay
# costs. Most of those blocks sit in chains that nobody branches from: the new suffix
# of one request, used once. `RunPrefixCache` keeps such a chain as **one** node, a
# *run* of blocks stamped and pinned together. It splits a run only where a later
# prompt stops or leaves it, and when it evicts, it trims a run's tail with the same
# ranks and the same tie-breaking as the block tree -- in one step while the order of
# what goes cannot change on the way.
#
# It is a twin, not a new design: the same policy objects, the same clock, the same
# checkpoint heap. `tests/test_runs.py` holds every request's outcome (KV hit, usable
# hit, checkpoints added and where) equal to the block tree's, on random branching
# traffic and on the real trace.

# %%
REAL = f"../data/{wl.MOONCAKE_CONVERSATION}"
real = wl.load_trace(REAL, BLOCK)


def replay(records, policy, gb, *, fast=True, keep=False):
    """One replay of a trace through a prefix cache of ``gb`` GB per device of the default deployment."""
    policy = prefix.make_policy(policy) if isinstance(policy, str) else policy
    capacity = int(gb * 1e9 // kv_per_token)
    kind = prefix.RunPrefixCache if fast else prefix.HybridPrefixCache.for_budget
    cache = kind(CFG, policy, deployment=DEP, block_size=BLOCK, capacity_tokens=capacity)
    return simulate(records, cache=cache, keep_per_request=keep)


first = real[:3000]
twins = {fast: replay(first, "dual", 40, fast=fast, keep=True) for fast in (False, True)}
print(f"first {len(first):,} requests of the real trace, dual at 40 GB: every outcome equal: "
      f"{twins[False].per_request == twins[True].per_request}; usable hit rate "
      f"{twins[True].usable_hit_rate:.4f} both ways")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"wall clock, same run: block tree {twins[False].wall_seconds:.2f} s, runs {twins[True].wall_seconds:.2f} s "
      f"({twins[False].wall_seconds / twins[True].wall_seconds:.1f}x)")

# %% [markdown]
# ## What the engines ship
#
# **vLLM.** For a hybrid model vLLM keeps one pool of equal pages: it raises the
# attention block until one MLA layer's page holds one KDA layer's state, per device
# ([vllm](references.md#vllm); `costs.vllm_hybrid_pages`, chapter 3). Its shipped
# prefix-caching mode for GDN/KDA models is `align` ([vllm-prefix](references.md#vllm-prefix), PR #30877): the scheduler cuts a
# prefill into chunks on the block grid and keeps the state at each chunk's end. Since
# then a state at the *shared-prefix boundary* -- where a prompt's KV hit runs past its
# state hit -- is kept too (PR #37898, extended to the retention intervals of PRs
# #43447 / #45845 by #47782); with the default retention every chunk end stays. The
# `all` mode, a state at every block, is still in open pull requests for these models.
# For Kimi-Linear in particular: `KimiLinearForCausalLM` declares no
# `SupportsMambaPrefixCaching`, and the published recipe pins vLLM 0.11.2, whose
# `MambaModelConfig` turns prefix caching *off* for such a model; later versions turn it
# on in `align` mode instead (and fall back from `all` to `align`). So what vLLM ships
# for this model today is `align` at the block sizes below, or nothing:

# %%
for dep in (DEP, costs.VLLM_TP8_H200, DP):
    v = costs.vllm_hybrid_pages(CFG, dep)
    print(f"{dep.name:<14} block {v.block_tokens:>5,d} tokens; a state = {v.checkpoint_blocks} blocks "
          f"= KV of {v.checkpoint_blocks * v.block_tokens:,d} tokens; align keeps a state every "
          f"{vllm_align_interval(dep, v.block_tokens):,d} tokens of prefill "
          f"(max_num_batched_tokens {dep.max_batched_tokens:,d})")
short = sum(r.input_length <= costs.vllm_hybrid_pages(CFG, DP).block_tokens for r in real)
print(f"prompts of at most one DP-attention block, which can never hit there: {short:,} of {len(real):,} "
      f"({short / len(real):.0%})")

# %% [markdown]
# At TP4 vLLM's block is 480 tokens -- *finer* than the trace's 512-token blocks -- and a
# state costs 3 of them. The replay keys a vLLM block by the trace block that holds its
# last token (`sim.rekey`), so it counts a hit only where the trace proves one; with a
# block finer than the trace that rounds vLLM's hits down by up to a block.
#
# **SGLang** keeps states in their own pool beside the KV pool, sized once at start;
# since 0.5.23 it can store the *cached* states int8 (`mamba_checkpoint_pool.py`, below).
# **TensorRT-LLM** ([trtllm-prefix](references.md#trtllm-prefix)) snapshots every `mamba_state_cache_interval` tokens from token 0 and at
# the prompt's end, in one pool with LRU block reuse; at 512 tokens that is `every-block`
# here (its example configuration uses 256, finer than the trace resolves).
#
# ## Two real traces
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
AGENT, RATE = f"../data/{wl.CLAUDE_CODE}", 0.05
agent = wl.agent_requests(wl.load_sessions(AGENT), RATE, seed=0)
TRACES = {"conversation": REAL, "agent": AGENT}
for name, records in (("conversation", real), ("agent", agent)):
    s = wl.trace_stats(records, BLOCK)
    cold = 1e3 * sum(costs.prefill_seconds(CFG, DEP, r.input_length) for r in records[:2000]) / 2000
    print(f"{name:<12} {s['requests']:>6,d} requests over {s['duration_s'] / 3600:5.1f} h, prompts {s['input_mean']:>8,.0f} "
          f"tokens on average (p99 {s['input_p99']:>8,.0f}); infinite-cache ceiling {s['reuse_upper_bound']:.3f}; "
          f"cold prefill {cold:,.0f} ms (first 2,000)")

# %% [markdown]
# The agent sessions are a different world: prompts ten times longer, and almost all of
# each one (0.959 at infinite cache) is the session's own previous request. A cold
# prefill of one takes seconds, so every hit is worth a great deal.
#
# ## The real traces, swept over memory
#
# Now every policy on both traces, by their own timestamps, at 10 and 40 GB and at the
# whole cache budget of one device of the TP4 recipe (`costs.cache_budget_bytes`: HBM
# share minus its quarter of the weights and an activation reserve), each with int8
# checkpoints beside the native fp32 ones where a cache can store them (vLLM sizes its
# pages to the state, so its int8 would be another layout). The figure adds 160 GB per
# device: more than one H200 has, what a DRAM tier behind the cache (below) could
# offer. Each replay also turns hits into time: the prefill seconds a request's usable
# hit saves (its TTFT, cold prefill minus prefill from the hit, the request alone on the
# deployment, `costs.prefill_seconds`). All the replays of the rest of the chapter are
# independent, so one call, `sim.replay_many`, runs them together on the machine's
# cores (which process ran which changes no number).

# %%
DEVICE_GB = round(costs.cache_budget_bytes(CFG, DEP) / 1e9, 1)
TABLE_GB = [10, 40, DEVICE_GB]
SIZES = TABLE_GB + [160]
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
runs = replay_many(jobs)
print(f"{len(jobs)} replays of two real traces, per device of {DEP.name}")


def table(t):
    """Usable hit (fp32 | int8) and prefill ms saved per request, per policy and budget."""
    head = "".join(f" | {gb:>5g} GB: hit  int8   ms saved" for gb in TABLE_GB)
    print(f"{t} trace{head}")
    for name in TABLE:
        cells = ""
        for gb in TABLE_GB:
            r, q = runs[t, name, "native", gb], runs.get((t, name, "int8", gb))
            int8 = f"{q.usable_hit_rate:.3f}" if q else "    -"
            cells += f" | {r.usable_hit_rate:11.3f} {int8} {r.prefill_ms_saved_per_request:8.1f}"
        print(f"{name:<19}{cells}")


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
for t in TRACES:
    for gb in TABLE_GB:
        for prec in ("native", "int8"):
            online = {n: runs[t, n, prec, gb] for n in ONLINE if (t, n, prec, gb) in runs}
            best = max(online, key=lambda n: online[n].usable_hit_rate)
            r, o = online[best].usable_hit_rate, runs[t, "oracle", prec, gb].usable_hit_rate
            print(f"{t:<12} {gb:>5g} GB {prec:<6}: best online {best:<19} {r:.3f} = {r / o:.2f} of the "
                  f"clairvoyant {o:.3f} (gap {o - r:.3f}); kv-only {runs[t, 'kv-only', 'native', gb].usable_hit_rate:.3f}")

# %%
for t in TRACES:
    for gb in TABLE_GB:
        for prec in ("native", "int8"):
            print(f"{t:<12} {gb:>5g} GB {prec:<6}: {runs[t, 'marconi', prec, gb].policy_detail}")

# %% [markdown]
# What the tables say, per device of the TP4 recipe:
#
# - **The simplest policies win.** On both traces and at every budget the best online
#   policy is `ends+branch` or, on the conversation trace at 10 GB only, `dual` (0.058
#   against 0.055); `ends` is never more than 0.006 behind the best. Branch points add
#   little: 0.184 against 0.182 at 40 GB on chat, 0.937 against 0.936 on agents.
# - **Marconi as published** ties `ends+branch` wherever its tuning kept alpha at 0
#   (chat at 40 GB and at the device budget, agents at 40 GB; on agents at the budget
#   the bootstrap window never closed), and loses where it chose more: alpha 1.2 on chat
#   at 10 GB gives 0.053 against 0.055, alpha 0.3 on agents at 10 GB gives 0.629 against
#   0.663. Its window is the first few hundred requests of the trace, which did not
#   predict the rest.
# - **`dual`'s fixed weight fails on agent traffic**: 0.442 against `ends`' 0.663 at
#   10 GB and 0.628 against 0.936 at 40 GB. Its rank grows with the FLOPs of the *whole*
#   prefix, and every agent prompt is long, so old sessions' contexts outlive the live
#   ones. On chat it loses at 40 GB (0.158 against 0.182) and wins a little at 10 GB.
# - **vLLM `align`**, at its own 480-token blocks, keeps 0.158 at 40 GB on chat (`ends`:
#   0.182) and 0.928 on agents (0.936): its states at every chunk end of a long prefill
#   cost memory that request ends alone would leave to KV.
# - **SGLang's split pools lose most**: 0.121 at 40 GB on chat, 0.510 at 10 GB on agents
#   (`ends`: 0.663). Its KV pool gets 1 / 1.9 of the memory whatever the traffic needs;
#   `extra_buffer`'s branch points add under 0.002, and int8 states change nothing,
#   because its KV pool, not its state pool, is what runs out (the memory split below).
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
# ## Where the memory goes
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
for n in names:
    r = runs["conversation", n, "native", split_gb]
    share = r.checkpoint_bytes_mean / (r.checkpoint_bytes_mean + r.kv_bytes_mean)
    print(f"{n:<20} KV {r.kv_bytes_mean / 1e9:5.1f} GB  checkpoints {r.checkpoint_bytes_mean / 1e9:5.1f} GB ({share:.0%})  "
          f"admitted {r.checkpoints_admitted:>7,d}  evicted {r.checkpoints_evicted:>7,d}")
sg = runs["conversation", "sglang-extra-buffer", "native", split_gb]
state_pool = split_gb * SGLANG_RATIO / (1 + SGLANG_RATIO)
print(f"SGLang's pools: states {state_pool:.1f} GB ({sg.checkpoint_bytes_mean / 1e9:.1f} GB in use on average), "
      f"KV {split_gb - state_pool:.1f} GB ({sg.kv_bytes_mean / 1e9:.1f} GB in use)")

# %% [markdown]
# Takeaway: the policies differ in *what* they keep. `every-block` holds 75% of its
# memory in checkpoints and `align` 43%; `ends`, `ends+branch` and Marconi 12%, `dual`
# 8%. SGLang's fixed split is the other way round: its state pool (18.9 GB) holds 4.8 GB
# of states on average while its KV pool (21.1 GB) is full -- memory stranded in the
# wrong pool, as chapter 4 measured for running requests, now costing hits.
#
# ## Cheaper checkpoints: bf16 and int8
#
# A cached state is read once, on a hit, and decoding then goes on at full precision;
# so a cache may keep its states at lower precision than the running request, and the
# only error is one rounding per stored state. SGLang's `MambaCheckpointPool`
# ([sglang-prefix](references.md#sglang-prefix)) stores each KDA state as int8 with one symmetric scale
# per (head, key channel) -- the largest |S| over the value axis over `QMAX = 127`, in the
# state's own dtype -- and the conv window at its native dtype
# (`prefix.precision.int8_quantize`). A bf16 store rounds each fp32 element to 16 bits.
# The bytes of one checkpoint on one device:

# %%
for dep in (DEP, DP):
    b = {p: precision.checkpoint_bytes(CFG, dep, p) for p in precision.PRECISIONS}
    page = BLOCK * costs.kv_bytes_per_token(CFG, dep)
    print(f"{dep.name:<14} " + "   ".join(f"{p} {b[p] / 2**20:6.2f} MiB = {b[p] / page:5.2f} pages"
                                         for p in precision.PRECISIONS)
          + f"   (int8 is {b['native'] / b['int8']:.2f}x smaller than fp32, {b['bf16'] / b['int8']:.2f}x than bf16)")

# %% [markdown]
# What does a hit from a rounded state cost in quality? On the reduced model
# (`prefix.fidelity`): a 96-token conversation in which request 1 prefills 24 tokens and
# leaves a checkpoint; each later request resumes from the previous request's *rounded*
# checkpoint and the KV it computed, prefills 24 more tokens and leaves its own rounded
# checkpoint -- so after c hits a state has been rounded c times, each rounding feeding
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
print(f"{'checkpoints':<11} {'hits':>4}  {'max logit error / logit std':>36}  {'greedy tokens agree':>28}")
for p in precision.PRECISIONS:
    for c in (1, 2, 3):
        sel = [r for r in rows if r["precision"] == p and r["hits"] == c]
        rel = np.array([r["max_rel"] for r in sel])
        agree = np.array([r["agree"] for r in sel])
        print(f"{p:<11} {c:>4}  {rel.mean():12.2e} (range {rel.min():.2e}-{rel.max():.2e})  "
              f"{agree.mean():10.3f} (range {agree.min():.3f}-{agree.max():.3f})")

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
print(f"{'trace':<12} {'GB':>5} {'policy':<12} {'fp32':>7} {'bf16':>7} {'int8':>7}   ms saved: {'fp32':>7} {'int8':>7} "
      f"{'gain':>6}")
for t in TRACES:
    for gb in SIZES:
        for name in ("ends", "ends+branch"):
            if (t, name, "int8", gb) not in runs:
                continue
            r, q = runs[t, name, "native", gb], runs[t, name, "int8", gb]
            b = runs.get((t, name, "bf16", gb))
            bf = f"{b.usable_hit_rate:7.3f}" if b else f"{'':>7}"
            print(f"{t:<12} {gb:>5g} {name:<12} {r.usable_hit_rate:7.3f} {bf} {q.usable_hit_rate:7.3f}   "
                  f"{r.prefill_ms_saved_per_request:17.1f} {q.prefill_ms_saved_per_request:7.1f} "
                  f"{q.prefill_ms_saved_per_request / r.prefill_ms_saved_per_request - 1:+6.1%}")

# %% [markdown]
# int8 checkpoints buy what their bytes buy: on chat `ends` saves 2.3% more prefill time
# at 10 GB, 6.1% at 40 GB, 3.4% at the device budget and 2.8% at 160 GB (usable hit
# 0.182 to 0.193 at 40 GB), with bf16 between; on agents under 1%. The gain is modest
# because a request-end policy keeps few states (12% of the memory at 40 GB): most of
# the distance to the attention bound is states that were never admitted or were
# evicted, not bytes per state. A cheaper state pays most for policies that keep many.
#
# ## The same policies under DP-attention, and vLLM on every deployment
#
# Under DP-attention each device holds whole requests, so a checkpoint costs 10.5 pages
# there instead of 2.6: four times more KV per state. Does the verdict between `ends`,
# `ends+branch` and `dual` move? And vLLM's `align`, replayed at each deployment's own
# block (480 tokens at TP4, 240 at TP8, 1,888 under DP-attention), with and without the
# shared-prefix boundary:

# %%
for gb in (10, 40):
    tp = {n: runs["conversation", n, "native", gb].usable_hit_rate for n in ("kv-only", "ends", "ends+branch", "dual")}
    dp = {n: runs["conversation", n, "dp", gb].usable_hit_rate for n in ("kv-only", "ends", "ends+branch", "dual")}
    for label, got in (("TP4", tp), ("DP4", dp)):
        print(f"conversation {gb:>3} GB {label}: " + "  ".join(f"{n} {v:.3f}" for n, v in got.items())
              + f"   dual / ends {got['dual'] / got['ends']:.3f}, ends / kv-only {got['ends'] / got['kv-only']:.3f}")
for gb in (10, 40):
    v = {k: runs["conversation", "vllm-align", k, gb] for k in ("native", "tp8", "dp", "no-shared-prefix")}
    print(f"vLLM align at {gb} GB on its own blocks: TP4 (480 tokens) {v['native'].usable_hit_rate:.3f}, "
          f"TP8 (240) {v['tp8'].usable_hit_rate:.3f}, DP-attention (1,888) {v['dp'].usable_hit_rate:.3f}; "
          f"TP4 without the shared-prefix boundary (PR #30877 alone) {v['no-shared-prefix'].usable_hit_rate:.3f}")

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
# ## A second tier: host DRAM or SSD
#
# Everything above keeps the cache in HBM. Mooncake, Kimi's own platform, keeps cached KV
# in the cluster's CPU DRAM and SSDs as well and moves it over RDMA
# ([mooncake](references.md#mooncake)); SGLang's hierarchical cache and vLLM's connectors
# do the same per node. For a hybrid model a hit loaded from such a tier moves the KV of
# its tokens *and* one checkpoint. When is loading faster than recomputing? Per device of
# each deployment (`prefix.offload`: a transfer at the tier's bandwidth plus a fixed
# latency, against `costs.prefill_seconds_saved`; link rates in [pcie](references.md#pcie)):

# %%
for dep in (DEP, DP):
    for tier in offload.TIERS:
        for n in (4096, 32768):
            hit = n // 2
            load, recompute = offload.load_seconds(CFG, dep, tier, hit), costs.prefill_seconds_saved(CFG, dep, n, hit)
            print(f"{dep.name:<14} {tier.name:<28} hit {hit:>6,d} of {n:>6,d}: load {1e3 * load:6.2f} ms, "
                  f"recompute {1e3 * recompute:8.2f} ms ({recompute / load:5.0f}x); break-even at "
                  f"{offload.break_even_tokens(CFG, dep, tier, n):,d} tokens")
state_ms = 1e3 * precision.checkpoint_bytes(CFG, DEP) / offload.HOST_DRAM.bandwidth
print(f"one checkpoint from host DRAM at TP4: {state_ms:.3f} ms (int8: "
      f"{1e3 * precision.checkpoint_bytes(CFG, DEP, 'int8') / offload.HOST_DRAM.bandwidth:.3f} ms)")

# %% [markdown]
# Loading wins from the first block on: a 16,384-token hit loads from host DRAM in
# 2.28 ms at TP4 against 354.95 ms of prefill (156x), and from one SSD in 10.31 ms
# (34x); a checkpoint alone takes 0.172 ms from DRAM. So a second tier turns this
# chapter's capacity question into a bandwidth one: the 160 GB column above is within
# what host DRAM per device can hold, and a state is cheap to move. What this
# arithmetic leaves out is contention -- the PCIe link also carries other requests'
# traffic -- and the HBM copy itself; Mooncake's design exists to schedule exactly that.
#
# ## How fast the simulation runs
#
# Wall-clock CPU time of the replays above (varies with the machine; a Python
# simulation's speed, not a serving speed; Marconi's includes its tuning replays):

# %%
# NBVAL_IGNORE_OUTPUT
for t in TRACES:
    print(f"{t}, {DEVICE_GB} GB: " + ", ".join(f"{n} {runs[t, n, 'native', DEVICE_GB].wall_seconds:.2f} s" for n in TABLE))
print(f"conversation, 40 GB: every-block {runs['conversation', 'every-block', 'native', 40].wall_seconds:.2f} s, "
      f"align {runs['conversation', 'align', 'native', 40].wall_seconds:.2f} s")
total = sum(r.wall_seconds for r in runs.values())
print(f"{len(runs)} replays: {total:.1f} s of wall clock summed over both workers")

# %% [markdown]
# ## Summary
#
# - A hybrid model resumes a cached prefix only where it has the KV **and** a state
#   checkpoint: the *usable hit*. How much a checkpoint costs depends on the deployment:
#   2.63 KV pages of 512 tokens per device under TP4, 10.52 under DP-attention.
# - `HybridPrefixCache` keeps KV per block in chapter 5's radix tree and at most one
#   checkpoint per node, in the same page pool as the requests; resuming is exact
#   (< 1e-10 on the tiny model). `RunPrefixCache` and `SegmentCache` are its fast twins,
#   held equal to slow ones by tests.
# - On real chat and real agent traffic the simplest policies win: `ends+branch` (or
#   `ends`) is the best online policy at every budget but one, where `dual` leads by
#   0.003. Marconi as published ties it where its online tuning keeps alpha at 0 and
#   loses where it does not; `dual`'s fixed weight collapses on agents (0.442 against
#   0.663 at 10 GB); vLLM `align` and, most of all, SGLang's split pools are below.
# - A clairvoyant cache shows how much room is left: on chat the best online policy
#   reaches 0.22 of it at 10 GB and 0.77 at a whole device's budget; on agents 0.84 and
#   1.00.
# - int8 checkpoints (3.53x smaller than fp32) add up to 6.1% of prefill time saved on
#   chat and under 1% on agents, for a logit error of about 0.8% of the logits' spread on
#   the reduced model; bf16 sits between.
# - Loading a hit from host DRAM is about a hundred times faster than recomputing it, so
#   a second tier makes the memory sizes beyond one device real.
# - Honest scope: requests are replayed one at a time with no queueing and whole
#   512-token blocks (a request's end is its last whole block); prefill time is the cost
#   model's (chapter 3); the agent sessions' start times are our Poisson choice; the
#   quality numbers are an untrained reduced model's.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **6.1 How many pages?** On one device of the TP4 recipe, with 256-token blocks instead
# of 512: how many pool pages does one checkpoint take? Round up as the pool does.

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
# **6.3 A budget the table skips.** What usable hit rate does `ends` reach on the whole
# conversation trace at 25 GB per device of the TP4 recipe, with fp32 checkpoints? The
# table stops at 10 and 40 GB; replay it yourself.

# %% tags=["solution"]
answer = replay_many({25: Replay(REAL, "ends", 25, DEP)})[25].usable_hit_rate

# %%
verify("6.3", answer)

# %% [markdown]
# **6.4 (open) Alpha at other budgets.** `dual`'s weight is fixed; Marconi tunes its own.
# With `Replay(REAL, "marconi", gb, DEP, options=(("alpha", a),))` sweep a fixed `a` over
# 0, 0.5, 1 and 2 at 10 and 40 GB. Was the online choice printed above the best fixed
# one in hindsight? Why might a window at the start of the hour mislead it?
#
# **6.5 (open) Branch points only.** Write a policy (subclass `prefix.Policy`) that
# admits only branch points, no request ends. Replay the conversation trace at 40 GB:
# how much does it lose against `ends`, and why?
#
# **6.6 (open) The arrival rate.** Replay the agent trace with `ends` at 10 GB for
# `sessions_per_s` 0.01, 0.05 and 0.2. How does the usable hit move as more sessions
# overlap, and what does that say about the rate we chose?
#
# **6.7 (open) Generated vs real.** Replay `../data/conversation_like.jsonl` (chapter 5's
# generated look-alike of the Mooncake trace) at 10 and 40 GB with `ends` and `dual`.
# How much bigger is `dual`'s lead there than on the real trace? Which property of the
# generated trace (chapter 5's reuse ceiling) flatters it?
#
# **6.8 (open) The checkpoint interval.** `align` stores a state every `interval` tokens
# of prefill. On the conversation trace at 40 GB, sweep
# `Replay(REAL, "align", 40, DEP, options=(("interval", i),))` for `i` in 512, 2,048,
# 8,192 and 32,768. What happens as the interval grows, and which policy does `align`
# turn into at the long end?
#
# **6.9 (open) What the oracle knows.** The clairvoyant cache admits a state only where a
# later request will resume. Give `ends` that one piece of foresight and nothing else
# (write the policy with `prefix.oracle.FutureIndex`), keep LRU eviction, and replay at
# 10 GB. How much of the gap to the oracle does admission alone close?
#
# **6.10 An int8 checkpoint.** How many bytes does one int8 checkpoint take on one device
# of the TP4 recipe (SGLang's layout: int8 states, one fp32 scale per head and key
# channel, bf16 conv windows)?

# %% tags=["solution"]
answer = precision.checkpoint_bytes(CFG, DEP, "int8")

# %%
verify("6.10", answer)
