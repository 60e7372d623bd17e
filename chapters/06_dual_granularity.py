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
# where a policy admits them. Six policies, each a small object: `kv-only` (the
# attention bound), `every-block` and `align` (vLLM's two modes), `ends` (the simplest
# thing that works), `ends+branch` and `dual` (Marconi's). And a replay fast enough to
# sweep them over a whole hour of Kimi's real traffic.
#
# **What you'll learn.**
# - The *usable hit*: the deepest position where both the KV and a state checkpoint
#   exist. A hybrid model resumes there and recomputes only the rest.
# - Why the trade-off is memory: at Kimi-Linear-48B scale one checkpoint weighs as
#   much as ten KV pages of 512 tokens, so every state you keep evicts the KV of about
#   5,384 tokens.
# - Which policy wins where, measured on Moonshot's real conversation trace at the
#   same memory from 10 to 160 GB: usable hit rate, and the prefill time it saves per
#   request; what branch points and the FLOP-aware weight `alpha` add over `ends`; what
#   vLLM's 1,888-token blocks cost on real prompts.
# - That resuming from a checkpoint is *exact*: the same logits and final cache as a
#   cold prefill, on the tiny model.
#
# **What you'll need.** Chapter 5 (radix tree, traces, why a KV hit alone saves nothing
# for a hybrid model) and chapter 4 (the page pool). Byte and FLOP counts are analytic
# for the real 48B shapes (`kimilab.costs`); the exactness check runs the reduced,
# untrained `tiny` model. Speeds are CPU speeds of a Python simulation.

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
from kimilab.sim import Replay, replay_many, simulate

plots.use_style()
CFG = kimi_linear_48b
BLOCK = 512
POLICIES = ["kv-only", "every-block", "align", "ends", "ends+branch", "dual"]

# %% [markdown]
# ## What a checkpoint costs
#
# Chapter 5 ended with the problem: the KV of a shared prefix is worthless to a hybrid
# model unless it also has the KDA state at exactly the end of that prefix. A *state
# checkpoint* is a copy of every KDA state and every conv state of a request at one
# position (`HybridCache.checkpoint()`, chapter 3). Its size does not depend on the
# position. At 48B scale, next to one 512-token page of KV:

# %%
kv_per_token = costs.kv_bytes_per_token(CFG)
page_bytes = BLOCK * kv_per_token
ckpt_bytes = costs.checkpoint_bytes(CFG)
ckpt_pages = -(-ckpt_bytes // page_bytes)
print(f"KV per token (7 MLA layers):        {kv_per_token:>12,d} B")
print(f"one KV page = {BLOCK} tokens:           {page_bytes:>12,d} B  ({page_bytes / 2**20:.2f} MiB)")
print(f"one checkpoint (20 KDA + conv):     {ckpt_bytes:>12,d} B  ({ckpt_bytes / 2**20:.2f} MiB)")
print(f"checkpoint / page:                  {ckpt_bytes / page_bytes:>12.2f}  -> {ckpt_pages} pool pages")
print(f"KV tokens one checkpoint displaces: {ckpt_bytes // kv_per_token:>12,d}")

# %% [markdown]
# So a pool page holds one block of KV, and a checkpoint takes 11 pages (10.5 rounded
# up; the half page is internal waste that the pool's statistics report). Storing a
# state at every block boundary would multiply the cache's memory per cached block by
# twelve. That is the whole trade-off of this chapter: states buy usable hits, but
# they are paid for with KV.

# %% [markdown]
# ## The cache: KV blocks in a radix tree, checkpoints on its nodes
#
# `HybridPrefixCache` reuses chapter 5's `RadixTree` for the KV blocks and hangs at
# most one checkpoint on each node (SGLang's `MambaRadixCache` does the same with a
# per-token tree: KV per token, at most one state per node). A checkpoint on node *n* is the state after the last token
# of *n*'s block, so its whole prefix's KV is on the path above it, always. Serving one
# request:
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
# ## Six policies
#
# Each policy answers two questions: where to admit checkpoints, and how to rank what
# to evict.
#
# - **`kv-only`**: the pure-attention reference. States are free and everywhere, so
#   usable hit = KV hit. No hybrid model can do better at the same KV memory and the
#   same eviction order; it is the upper bound the others chase.
# - **`every-block`**: a checkpoint at every block boundary the prefill passes
#   (vLLM's `all` mode). Usable hit = KV hit as long as the states survive, but each
#   block costs 12 pages.
# - **`align`**: checkpoints at the end of each prefill chunk (every `interval` tokens
#   from where the prefill started) and at the request end (vLLM's `align` mode;
#   SGLang's periodic tracking). Default `interval=2048` tokens.
# - **`ends`**: a checkpoint where each request's last whole block ends, and nothing
#   else; plain LRU. The simplest thing that works: the next turn of a conversation
#   re-sends the previous prompt and its reply, so it resumes exactly there.
# - **`ends+branch`**: `ends` plus *branch points* discovered as traffic arrives — a
#   node where a new prompt leaves an already cached path — as Marconi admits them.
# - **`dual`**: `ends+branch` with Marconi's FLOP-aware eviction (below); optionally
#   also coarse checkpoints every `interval` tokens.
#
# Each is the one before plus one idea, so the differences measure the ideas:
# `ends+branch` − `ends` is what branch points add, `dual` − `ends+branch` what `alpha`
# adds (`dual` with `alpha = 0` *is* `ends+branch`; a test holds them equal).
#
# All but `dual` rank what to evict by last use (LRU). `dual` ranks a unit by last
# use plus `alpha` times the FLOPs its checkpoint saves per byte, with time counted in
# cache *turnovers* (pages admitted / pool pages) so that the weight means the same at
# any traffic rate and memory size; and it never evicts the checkpoint of a live
# branch point (two or more children) on its own, as Marconi does.

# %%
show_source(prefix.Dual.positions)

# %% [markdown]
# A toy trace with 4-token blocks shows the difference. Prompts A and B share two
# blocks and then diverge; C shares the same two blocks. Under `dual`, A leaves a
# state at its end only. B's KV hit is 8 tokens, but no state exists at 8, so B
# recomputes from 0 — and on the way leaves a checkpoint at 8, because 8 is now a
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
    cache = prefix.HybridPrefixCache.for_budget(CFG, prefix.make_policy(name, **kwargs),
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
# block, and that Python bookkeeping — not the cache's decisions — is what a replay
# costs. Most of those blocks sit in chains that nobody branches from: the new suffix
# of one request, used once. `RunPrefixCache` keeps such a chain as **one** node, a
# *run* of blocks stamped and pinned together. It splits a run only where a later
# prompt stops or leaves it, and when it evicts, it trims a run's tail with the same
# ranks and the same tie-breaking as the block tree — in one step down to the next
# checkpoint when the rank cannot change on the way.
#
# It is a twin, not a new design: the same policy objects, the same clock, the same
# checkpoint heap. `tests/test_runs.py` holds every request's outcome (KV hit, usable
# hit, checkpoints added and where) equal to the block tree's, on random branching
# traffic and on the real trace. Its scope is what a replay needs: whole blocks keyed
# by hash ids, accounting only (no tensors), one request at a time.

# %%
real = wl.load_trace(f"../data/{wl.MOONCAKE_CONVERSATION}", BLOCK)
kv_per_gb = 1e9 / kv_per_token  # tokens of 48B KV per GB


def replay(records, policy, gb, *, block=BLOCK, fast=True, keep=False):
    """One replay of a trace through a prefix cache of ``gb`` GB of 48B memory (KV + checkpoints)."""
    policy = prefix.make_policy(policy) if isinstance(policy, str) else policy
    capacity = int(gb * kv_per_gb)
    if fast:
        cache = prefix.RunPrefixCache(CFG, policy, block_size=block, capacity_tokens=capacity)
    else:
        cache = prefix.HybridPrefixCache.for_budget(CFG, policy, block_size=block, capacity_tokens=capacity)
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
# ## The real trace, swept over memory
#
# Now the whole hour, by its own timestamps, at five memory sizes from 10 to 160 GB of
# 48B KV memory (8,064 B per token), shared by KV pages and checkpoints. Even the
# smallest holds a couple of hundred checkpoints, so no policy is judged on a
# degenerate pool. The four policies that matter most run at every size; `every-block`
# and `align`, which spend memory badly, at three (they are the slowest to replay). Each replay also turns hits into
# time: the prefill seconds a request's usable hit saves (its TTFT, cold prefill minus
# prefill from the hit) on the roofline of chapter 3 — 8 H800-class devices,
# tensor-parallel attention, half of peak FLOP/s for prefill (`costs.PrefillTimer`).
# All the replays of the rest of this chapter are independent, so one call,
# `sim.replay_many`, runs them together on the machine's cores (each a `RunPrefixCache`
# replay; which process ran which changes no number).

# %%
GB = [10, 20, 40, 80, 160]
THREE = [10, 40, 160]
MAIN = ["kv-only", "ends", "ends+branch", "dual"]
ALPHAS = [0.0, 0.001, 0.005, 0.02, 0.1]
AGENT_GB = [1, 2, 4]
v = costs.vllm_hybrid_pages(CFG)
REAL, AGENT = f"../data/{wl.MOONCAKE_CONVERSATION}", "../data/agent.jsonl"
jobs = {(name, gb): Replay(REAL, name, gb) for name in MAIN for gb in GB}
jobs |= {(name, gb): Replay(REAL, name, gb) for name in ("every-block", "align") for gb in THREE}
jobs |= {("vllm-all", gb): Replay(REAL, "every-block", gb, block_size=v.block_tokens) for gb in THREE}
jobs |= {("vllm-attention", gb): Replay(REAL, "kv-only", gb, block_size=v.block_tokens) for gb in THREE}
jobs |= {("alpha", a, gb): Replay(REAL, "dual", gb, options=(("alpha", a),))
         for a in ALPHAS if a not in (0.0, 0.005) for gb in (10, 160)}
jobs |= {("agent", name, gb): Replay(AGENT, name, gb) for name in MAIN for gb in AGENT_GB}
runs = replay_many(jobs)  # independent replays, spread over the machine's cores (up to 2)
print(f"{len(jobs)} replays; {sum(1 for j in jobs.values() if j.trace == REAL)} of the whole real hour")
print(f"{'GB':>4} {'checkpoints fit':>15}" + "".join(f"{name:>13}" for name in POLICIES))
for gb in GB:
    cells = "".join(f"{runs[n, gb].usable_hit_rate:13.4f}" if (n, gb) in runs else f"{'':>13}" for n in POLICIES)
    print(f"{gb:4d} {int(gb * 1e9 // ckpt_bytes):15,d}{cells}")
print(f"mean cold prefill: {1e3 * runs['kv-only', 10].prefill_seconds_cold / len(real):.1f} ms per request")

# %% [markdown]
# vLLM pays for states differently. It does not keep 512-token blocks: it grows its
# attention block until one MLA layer's page holds one KDA layer's state, and groups
# layers so that a block id names a page in each of 7 layers
# ([vllm](references.md#vllm); `costs.vllm_hybrid_pages` derives it as chapter 4 did):

# %%
print(f"vLLM's block: {v.block_tokens:,} tokens; layer groups of {v.group_size}: {v.attn_groups} MLA group, "
      f"{v.kda_groups} KDA groups ({v.padded_layers} padded slot)")
print(f"one checkpoint = {v.checkpoint_blocks} blocks of {v.block_tokens:,} tokens "
      f"(here: {ckpt_bytes / (BLOCK * kv_per_token):.1f} blocks of {BLOCK})")
short = sum(r.input_length <= v.block_tokens for r in real)
print(f"prompts of at most one vLLM block, which can never hit: {short:,} of {len(real):,} ({short / len(real):.0%})")
for name in ("vllm-all", "vllm-attention"):
    print(f"{name:<15}" + "".join(f"  {gb} GB: {runs[name, gb].usable_hit_rate:.4f}" for gb in THREE))

# %% [markdown]
# The coarse replay keys a 1,888-token block by the trace's 512-token block that holds
# its last token, so it counts a hit only where the trace proves one
# (`traffic.coarser_blocks`); a prompt shorter than a block never hits. The two
# figures below are one experiment read twice: usable hit rate, and the prefill time
# it saves.

# %%
LINES = [(n, GB if n in MAIN else THREE) for n in POLICIES] + [("vllm-all", THREE), ("vllm-attention", THREE)]
VLLM_STYLE = {"vllm-all": dict(color=plots.color("every-block"), linestyle="--", label="vLLM all, 1,888-token blocks"),
              "vllm-attention": dict(color=plots.color("kv-only"), linestyle="--",
                                     label="attention bound, 1,888-token blocks")}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.4))
for name, sizes in LINES:
    style = VLLM_STYLE.get(name) or plots.style_of(name)
    ax1.plot(sizes, [runs[name, gb].usable_hit_rate for gb in sizes], marker="o", **style)
    ax2.plot(sizes, [runs[name, gb].prefill_ms_saved_per_request for gb in sizes], marker="o", **style)
ax1.axhline(wl.reuse_upper_bound(real, BLOCK), color="black", linestyle=":", linewidth=1,
            label="infinite cache (reuse ceiling)")
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xticks(GB, [str(g) for g in GB])
    ax.minorticks_off()
    ax.set_xlabel("cache memory (GB of 48B memory: KV + checkpoints)")
ax1.set_ylim(0, 0.4)
ax1.set_ylabel("usable hit rate (token-weighted)")
ax1.set_title("Real Kimi conversation trace: usable hit")
ax2.set_ylabel("prefill saved per request (ms, roofline)")
ax2.set_title("... and the prefill time it saves (TTFT)")
handles, labels = ax1.get_legend_handles_labels()
fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8)
plots.save(fig, "ch06-real-trace-sweep")
plt.show()

# %% [markdown]
# Takeaway: on real traffic the simplest policy, `ends`, is within a few hundredths of
# `dual` at every size, and the vLLM modes at our block size are far below both.
#
# At 40 GB `every-block` serves 0.0444 of prompt tokens from cache and `ends` 0.1456:
# one state per 512-token block starves the KV. vLLM's own 1,888-token blocks make a
# state cheaper (3 blocks), so its `all` mode beats our `every-block` at 160 GB (0.1737
# vs 0.0749) — but large blocks cost even an attention model: the dashed grey bound is
# 0.3017 at 160 GB against 0.3585 with 512-token blocks, and at 10 GB vLLM `all` almost
# never hits (0.0007), since 22% of the prompts fit in one block and cannot hit at all.
# Read in time (right), the ranking is the same; `dual` pulls ahead of `ends` a little
# more in milliseconds than in hits, because its eviction keeps long prefixes.

# %%
write_ms = 1e3 * costs.checkpoint_write_seconds(CFG)
print(f"{'GB':>4} {'policy':<12} {'usable hit':>10} {'x kv-only':>9} {'prefill saved':>14} "
      f"{'ckpts/request':>13} {'copying them':>13} {'evicted':>8}")
for gb in THREE:
    bound = runs["kv-only", gb].usable_hit_rate
    for name in ["kv-only", "ends", "ends+branch", "dual", "align", "every-block", "vllm-all"]:
        r = runs[name, gb]
        per_request = r.checkpoints_admitted / r.requests
        evicted = r.checkpoints_evicted / r.checkpoints_admitted if r.checkpoints_admitted else 0.0
        print(f"{gb:4d} {name:<12} {r.usable_hit_rate:10.4f} {r.usable_hit_rate / bound:9.3f} "
              f"{r.prefill_ms_saved_per_request:11.2f} ms {per_request:13.2f} {write_ms * per_request:10.4f} ms "
              f"{evicted:8.0%}")

# %% [markdown]
# Writing checkpoints is cheap next to what they save. `ends` and `dual` write under one
# checkpoint per request (0.88 at 10 GB); copying one in HBM costs 0.0029 ms per request
# against 0.74–0.84 ms of prefill saved. The churn is what stands out: at 10 GB `ends`
# evicts 99% of the checkpoints it writes before anyone resumes from them, and
# `every-block` writes 21.84 per request.
#
# ## What branch points and `alpha` add
#
# `dual` = `ends` + branch points + `alpha`. Its default `alpha` (0.005) was tuned on
# generated traffic; here is the sweep on the real trace at the smallest and the
# largest memory, from `alpha = 0` (which is `ends+branch`) up:

# %%
by_alpha = {}
for gb in (10, 160):
    for a in ALPHAS:
        # alpha 0 is ends+branch and 0.005 is dual's default: those replays ran already
        same = {0.0: "ends+branch", 0.005: "dual"}
        by_alpha[gb, a] = runs[same[a], gb] if a in same else runs["alpha", a, gb]
for gb in (10, 160):
    ends, bound = runs["ends", gb], runs["kv-only", gb]
    print(f"{gb} GB  (ends {ends.usable_hit_rate:.4f} / {ends.prefill_ms_saved_per_request:.2f} ms; "
          f"kv-only {bound.usable_hit_rate:.4f} / {bound.prefill_ms_saved_per_request:.2f} ms)")
    for a in ALPHAS:
        r = by_alpha[gb, a]
        print(f"   alpha {a:<6g} usable hit {r.usable_hit_rate:.4f}  prefill saved {r.prefill_ms_saved_per_request:5.2f} ms"
              f"  ({r.prefill_ms_saved_per_request / ends.prefill_ms_saved_per_request:.2f}x ends)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.0))
x = np.arange(len(ALPHAS))
for gb, marker in ((10, "o"), (160, "s")):
    for ax, metric in ((ax1, "usable_hit_rate"), (ax2, "prefill_ms_saved_per_request")):
        base = getattr(runs["ends", gb], metric)
        ax.plot(x, [getattr(by_alpha[gb, a], metric) / base for a in ALPHAS], marker=marker,
                color=plots.color("dual"), linestyle="-" if gb == 10 else "--", label=f"dual, {gb} GB")
        ax.plot(x, [getattr(runs["kv-only", gb], metric) / base] * len(x), color=plots.color("kv-only"),
                linestyle="-" if gb == 10 else "--", linewidth=1, label=f"kv-only, {gb} GB")
for ax in (ax1, ax2):
    ax.axhline(1.0, color="black", linewidth=0.8, label="ends (= 1)")
    ax.set_xticks(x, [f"{a:g}" for a in ALPHAS])
    ax.set_xlabel("alpha (0 = ends+branch; 0.005 = dual's default)")
ax1.set_ylabel("usable hit rate / ends'")
ax2.set_ylabel("prefill time saved / ends'")
ax1.set_title("Real trace: usable hit vs alpha")
ax2.set_title("... and prefill time saved vs alpha")
ax1.legend(fontsize=8)
plots.save(fig, "ch06-alpha")
plt.show()

# %% [markdown]
# Takeaway: branch points add almost nothing on chat traffic (`alpha = 0` is 1.01x
# `ends` at 10 GB, 1.02x at 160 GB); `alpha` is the part of `dual` that pays, only when
# memory is scarce, and its best value moves with the budget.
#
# At 10 GB, `alpha = 0.02` saves 1.74x the prefill time of `ends` and even beats
# `kv-only` on usable hit (0.0608 vs 0.0605): `kv-only` is an upper bound only for the
# same (LRU) eviction order, and keeping long, expensive prefixes longer is a better
# order when little fits. At 160 GB the same weight loses (0.90x `ends`), and the
# default 0.005 gains 1.07x. So `alpha` must be tuned per deployment — Marconi tunes
# its weight per workload too — and a fixed default is worth about what `ends` plus
# a few percent is.
#
# ## Where the memory goes
#
# The same 40 GB, split between KV pages and checkpoints (time average over the
# replay; the pool is full almost all the time):

# %%
split_gb = 40
names = ["kv-only", "every-block", "align", "ends", "ends+branch", "dual"]
kv_gb = np.array([runs[n, split_gb].kv_bytes_mean / 1e9 for n in names])
ck_gb = np.array([runs[n, split_gb].checkpoint_bytes_mean / 1e9 for n in names])
fig, ax = plt.subplots(figsize=(7.5, 3.8))
y = np.arange(len(names))
ax.barh(y, kv_gb, color=plots.color("kv"), label=plots.label("kv"))
ax.barh(y, ck_gb, left=kv_gb, color=plots.color("checkpoint"), label=plots.label("checkpoint"))
for i, n in enumerate(names):
    ax.text(kv_gb[i] + ck_gb[i] + 0.5, i, f"usable hit {runs[n, split_gb].usable_hit_rate:.3f}", va="center",
            fontsize=8)
ax.axvline(split_gb, color="black", linestyle=":", linewidth=1, label="budget")
ax.set_yticks(y, [plots.label(n) for n in names])
ax.invert_yaxis()
ax.set_xlim(0, split_gb * 1.4)
ax.set_xlabel("mean memory in use (GB, 48B byte sizes)")
ax.set_title(f"Memory split on the real trace, budget {split_gb} GB")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
plots.save(fig, "ch06-memory-split")
plt.show()
for n in names:
    r = runs[n, split_gb]
    share = r.checkpoint_bytes_mean / (r.checkpoint_bytes_mean + r.kv_bytes_mean)
    print(f"{n:<12} KV {r.kv_bytes_mean / 1e9:5.1f} GB  checkpoints {r.checkpoint_bytes_mean / 1e9:5.1f} GB ({share:.0%})  "
          f"admitted {r.checkpoints_admitted:>7,d}  evicted {r.checkpoints_evicted:>7,d}")

# %% [markdown]
# Takeaway: the policies differ in *what* they keep. At 40 GB `every-block` holds 92% of
# its memory in checkpoints (36.6 GB) and 3.3 GB of KV; `align` 74%; `ends` 33%; and
# `dual` 24%, because its FLOP-aware eviction drops the states of short prefixes first.
# Almost every checkpoint written is evicted again (`ends`: 9,814 of 10,111).
#
# ## What real traces lack: agent loops
#
# The Mooncake trace is chat. Agents re-send a long shared tool prompt and branch
# sub-tasks from the same point, which is exactly where branch points should pay. No
# public Kimi agent trace exists, so this part uses the *generated* agent trace of
# chapter 5 (`data/agent.jsonl`), in full, at smaller memories: its working set is small.

# %%
agent = wl.load_trace(AGENT, BLOCK)
print(f"agent trace (generated): {len(agent)} requests, {sum(r.input_length for r in agent):,} prompt tokens, "
      f"reuse ceiling {wl.reuse_upper_bound(agent, BLOCK):.3f}")
print(f"{'GB':>4} {'checkpoints fit':>15}" + "".join(f"{n:>13}" for n in MAIN))
for gb in AGENT_GB:
    print(f"{gb:4d} {int(gb * 1e9 // ckpt_bytes):15,d}" + "".join(f"{runs['agent', n, gb].usable_hit_rate:13.3f}"
                                                               for n in MAIN))

# %% [markdown]
# Takeaway: on tool loops that branch from a shared prompt, branch points are worth a
# little more than on chat — 0.839 vs 0.822 for `ends` at 1 GB, 0.900 vs 0.886 at 2 GB —
# and `alpha` adds nothing. A generated trace says what kind of traffic would make the
# machinery pay; only a real agent trace could say how much. (These pools hold only
# 23–92 checkpoints: the trace's working set is small.)
#
# ## Against vLLM, SGLang and Marconi
#
# - **vLLM `all`** keeps a state at every block boundary — our `every-block` — and
#   **vLLM `align`** at the end of each scheduled prefill chunk — our `align`
#   ([vllm](references.md#vllm)). With vLLM's own 1,888-token blocks a state costs 3
#   blocks instead of 11 pages, so `all` wastes less memory on states than our
#   512-token `every-block`; but every hit is rounded down to a whole large block and
#   short prompts never hit, which costs the attention bound itself (the dashed grey
#   line above).
# - **SGLang**'s `MambaRadixCache` keeps at most one state per tree node and recomputes
#   from the deepest node with a state, as ours does ([sglang](references.md#sglang));
#   it keeps states in a separate pool, so the KV/state split is fixed in advance,
#   where one pool lets each policy choose (chapter 4).
# - **Marconi** admits states only at branch points and sequence ends and evicts by
#   recency plus FLOPs saved per byte — our `dual` ([marconi](references.md#marconi)).
#   It reports up to 34.4x the token hit rate of extended vLLM/SGLang baselines. Against
#   baselines that spend memory on states nobody resumes from, we see large factors too
#   (table above); against `ends`, the simplest baseline that works, the gain on real
#   chat traffic is what the alpha sweep shows, no more.
#
# Where our `dual` is simpler than Marconi: states sit on 512-token block boundaries
# (Marconi's tree is per token); the "sequence end" is the end of the prompt's last
# full block, because a Mooncake trace carries output lengths but not output tokens;
# and the eviction rank is computed once per use rather than normalised over all
# candidates at each eviction, so that eviction stays O(log n).

# %% [markdown]
# ## How fast the simulation runs
#
# Wall-clock CPU time of the replays above (varies with the machine; a Python
# simulation's speed, not a serving speed):

# %%
# NBVAL_IGNORE_OUTPUT
for gb in (10, 160):
    print(f"{gb} GB: " + ", ".join(f"{n} {runs[n, gb].wall_seconds:.2f} s" for n in POLICIES if (n, gb) in runs))
total = sum(r.wall_seconds for r in runs.values())
print(f"{len(runs)} replays: {total:.1f} s of CPU in all")

# %% [markdown]
# ## Summary
#
# - A hybrid model can resume a cached prefix only where it has the KV **and** a state
#   checkpoint: the *usable hit*. At 48B scale a checkpoint (41 MiB) costs as much
#   memory as 10.5 KV pages of 512 tokens, so every state admitted evicts KV.
# - `HybridPrefixCache` keeps KV per block in chapter 5's radix tree and at most one
#   checkpoint per node, in the same page pool as the requests; resuming from a
#   checkpoint is exact (logits and final cache equal a cold prefill to < 1e-10 on the
#   tiny model). `RunPrefixCache` is its twin over runs of blocks, equal request by
#   request and fast enough to sweep a whole hour of real traffic.
# - On Moonshot's real conversation trace, the simplest policy that works — a state at
#   each request's end, LRU (`ends`) — keeps 0.830 of the attention bound's usable hit
#   at 10 GB, 0.672 at 40 GB and 0.832 at 160 GB. `dual` is within a few hundredths;
#   vLLM's modes at our block size are far below (`every-block` 0.209 of the bound at
#   160 GB).
# - `alpha` (FLOPs per byte in the eviction rank) is the only part of `dual` that pays
#   on chat: 1.74x `ends`' prefill time saved at 10 GB with `alpha = 0.02`, a loss at
#   160 GB with the same weight. Branch points pay a little on branching agent traffic.
# - vLLM's 1,888-token blocks make states cheaper but cost hits: prompts of one block
#   never hit, and the attention bound itself drops from 0.3585 to 0.3017 at 160 GB.
# - Honest scope: chat traffic only for the real part (the agent trace is generated),
#   requests replayed one at a time with no queueing, prefill time from a roofline with
#   an assumed efficiency; the mechanism is exact, the numbers are this simulation's.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **6.1 How many pages?** Kimi-Linear-48B with 256-token blocks instead of 512: how
# many pool pages does one checkpoint take? Use `costs.checkpoint_bytes` and
# `costs.kv_bytes_per_token`, and round up as the pool does.

# %% tags=["solution"]
answer = -(-costs.checkpoint_bytes(CFG) // (256 * costs.kv_bytes_per_token(CFG)))  # 21.03, rounded up

# %%
verify("6.1", answer)

# %% [markdown]
# **6.2 A small pool.** How many whole checkpoints fit in 10 GB (1e9 bytes), with no KV
# at all?

# %% tags=["solution"]
answer = int(10e9 // costs.checkpoint_bytes(CFG))

# %%
verify("6.2", answer)

# %% [markdown]
# **6.3 One more replay.** What usable hit rate does `ends` reach on the whole real
# trace at 20 GB? (`Replay` and `replay_many` above, or `sim.replay(Replay(...))`.)

# %% tags=["solution"]
answer = runs["ends", 20].usable_hit_rate

# %%
verify("6.3", answer)

# %% [markdown]
# **6.4 (open) Alpha at other budgets.** With `Replay(REAL, "dual", gb, options=(("alpha", a),))`,
# sweep `a` over 0, 0.005, 0.02 and 0.05 at 20 and 40 GB. Where does the best `alpha`
# sit between the 10 GB and 160 GB answers above? Would you ship one value?
#
# **6.5 (open) Branch points only.** Write a policy (subclass `prefix.Policy`) that
# admits only branch points, no request ends. Replay the real trace at 40 GB: how much
# does it lose against `ends`, and why?
#
# **6.6 (open) Partial blocks.** Replay `agent` through
# `prefix.HybridPrefixCache.for_budget(CFG, prefix.make_policy("ends"), block_size=BLOCK,
# capacity_tokens=..., partial_blocks=True)` (the trailing partial block is cached too).
# Does the usable hit rate change? Why can a token-exact match inside a block never be
# *usable* for a hybrid model?
#
# **6.7 (open) Generated vs real.** Replay `../data/conversation_like.jsonl` (chapter 5's
# generated look-alike of the Mooncake trace) at 10, 40 and 160 GB with `ends` and
# `dual`. How much bigger is `dual`'s lead there than on the real trace? Which property
# of the generated trace (chapter 5's reuse ceiling) flatters it?
#
# **6.8 (open) The checkpoint interval.** `align` stores a state every `interval` tokens
# of prefill. On the real trace at 40 GB, sweep `prefix.make_policy("align", interval=i)`
# for `i` in 512, 2,048, 8,192 and 32,768. What happens as the interval grows, and which
# policy does `align` turn into at the long end?
#
# **6.9 (open) Cheaper checkpoints.** Most of the gap to `kv-only` at 160 GB is memory
# the checkpoints take from KV. Store them in bf16 instead of fp32
# (`CFG.with_(name="bf16 checkpoints", state_bytes=2)` for the replay's byte counts) and
# replay `kv-only`, `ends` and `dual` (try `alpha=0.001`) at 160 GB with
# `prefix.RunPrefixCache`. Does any policy keep 0.90 of the attention bound's usable hit?
# What does a bf16 checkpoint cost that this replay cannot see (think of chapter 2's
# error measurements, and of resuming from a rounded state)?
