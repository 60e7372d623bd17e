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
# # 4. The unified page pool
#
# **What you'll build.** One preallocated memory arena cut into equal pages, from which
# every kind of per-request memory of a hybrid model is allocated: KV blocks of the
# global layers, KDA states, conv states (and, in later chapters, state checkpoints and
# speculative scratch). You will run the chapter-3 model on it, with KV in paged blocks
# and states in pool pages, and check that it computes exactly what the contiguous cache
# computes. Then you will serve one deterministic mixed workload on five memory layouts,
# with the memory one device of a real deployment has for its caches.
#
# **What you'll learn.**
# - Why a hybrid model makes paging awkward: its three kinds of memory differ in size
#   by orders of magnitude, and one of them grows while the others do not.
# - How the production systems cope ([references](references.md)): vLLM pads every page to one size in one
#   pool, SGLang keeps a separate state pool beside the KV pool, Jenga carves large pages
#   sized to the least common multiple of the page sizes.
# - What each choice costs at Kimi-Linear-48B scale, per device of vLLM's TP4 recipe (and
#   of TP8 and DP-attention): bytes lost to padding, memory stranded in the wrong pool,
#   and requests that could have run but did not.
#
# **What you'll need.** Chapter 3 (the hybrid model, its cache protocol, and the named
# deployments every byte is priced on). numpy and matplotlib; the chapter runs in about
# fifteen seconds.
#
# **Honest scope.** The model is the reduced, untrained `tiny` model; the pool mechanics
# are exact. The serving experiment is *accounting*: it runs the real allocators on the
# real 48B byte sizes of one device, with that device's real cache budget, but in
# simulated time (one engine step = one token for every running
# request = 20 ms, whatever the batch), so it measures how many requests each layout can
# hold, not latency. The one wall-clock number (paged vs contiguous decode) is a CPU number.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from kimilab import costs, plots
from kimilab.config import PAGE_KINDS, kimi_linear_48b, tiny
from kimilab.costs import CacheShapes
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import show_source
from kimilab.pool import (JengaPages, PagedHybridCache, PagePool, PoolExhausted, RequestAllocator, SplitPools,
                          UnifiedPages, VllmPaddedPages)
from kimilab.sim import simulate, simulate_many
from kimilab.timing import best_seconds
from kimilab.traffic import mixed_workload

plots.use_style()
MiB, GiB = 2**20, 2**30
DEP, DP = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200


def size(n):
    """Bytes, human-readable with fixed precision."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,d} B"


# %% [markdown]
# ## Three kinds of memory, three very different sizes
#
# A request of a hybrid model holds, per layer (chapter 3):
#
# - **KV** for each global layer: a fixed number of bytes *per token*, growing as the
#   request reads and writes tokens;
# - a **KDA state** (H x K x V) for each KDA layer: fixed size, overwritten by every token;
# - a **conv state** (the last kernel - 1 inputs of the short convolution) per KDA layer:
#   fixed size, rolling.
#
# `CacheShapes` reads these sizes off a config *on one device of a deployment*: tensor
# parallelism splits the KDA heads (so the states) over the devices, but MLA has one latent
# head, which every device holds whole. For Kimi-Linear-48B (bf16 KV, fp32 state), on one
# device of the TP4 recipe and of DP-attention (whole requests, the model's own sizes):

# %%
shapes = {"tiny": CacheShapes.from_config(tiny, costs.LOCAL),
          "48B, TP4 device": CacheShapes.from_config(kimi_linear_48b, DEP),
          "48B, DP device": CacheShapes.from_config(kimi_linear_48b, DP)}
print(f"{'':28s}" + "".join(f"{name:>17s}" for name in shapes))
rows = [("KV per token, one layer", lambda s: s.kv_token_bytes),
        ("global layers", lambda s: s.n_attn_layers),
        ("KDA state, one layer", lambda s: s.state_bytes),
        ("conv state, one layer", lambda s: s.conv_bytes),
        ("KDA layers", lambda s: s.n_kda_layers),
        ("fixed states per request", lambda s: s.fixed_bytes),
        ("KV per token, all layers", lambda s: s.kv_bytes_per_token)]
for title, get in rows:
    fmt = (lambda n: f"{n:d}") if title.endswith("layers") else size
    print(f"{title:28s}" + "".join(f"{fmt(get(sh)):>17s}" for sh in shapes.values()))
s48 = shapes["48B, TP4 device"]
for name in ("48B, TP4 device", "48B, DP device"):
    sh = shapes[name]
    print(f"{name}: one KDA state = {sh.state_bytes // sh.kv_token_bytes:,d} tokens of one MLA layer's KV; "
          f"a request's fixed states = {sh.fixed_bytes // sh.kv_bytes_per_token:,d} tokens of all its KV")

# %% [markdown]
# On one TP4 device one KDA state is as large as the KV of 455 tokens of one MLA layer,
# and a request's states together weigh as much as 1,346 tokens of KV; under
# DP-attention, 1,820 and 5,384. A paged KV cache wants small pages (a 16-token block of
# one MLA layer is 18 KiB); a state wants half a megabyte to 2 MiB in one place. Any
# single page size is wrong for one of them.
#
# ## The pool
#
# `PagePool` is one numpy byte array (the *arena*) cut into `n_pages` pages of
# `page_bytes`. An **allocation** is a set of pages of one *kind* with a **reference
# count**: `share` adds a handle to the same pages (prefix sharing in chapter 5 builds on
# it), `free` drops one, and the pages go back when the last handle is freed. Free pages
# sit on a stack, so taking n pages costs O(n), never a scan of the pool:

# %%
show_source(PagePool._take_pages)

# %% [markdown]
# `allocate` checks its arguments, takes the pages and wraps them in a handle:

# %%
show_source(PagePool.allocate)

# %%
pool = PagePool(16, 4096, name="demo")
a = pool.allocate("kv", 3)
b = pool.allocate_bytes("kda_state", 9000)  # 3 pages, 3,288 bytes of them unused
c = pool.share(a)  # a second handle to a's pages
print(a, "\n", b, sep="")
s = pool.stats()
print(f"free {s.n_free}/{s.n_pages}, pages by kind {s.pages_by_kind}, waste {s.waste_bytes} B")
pool.free(a)
print("after freeing one of two handles, a's pages are still held:", pool.n_free, "free")
try:
    pool.allocate("scratch", 11)
except PoolExhausted as err:
    print("PoolExhausted:", err)
print("unchanged after the failed call:", pool.n_free, "free")
try:
    pool.free(a)
except ValueError as err:
    print(type(err).__name__ + ":", err)
pool.free(c), pool.free(b)
pool.check_invariants()
print("all freed:", pool.n_free == pool.n_pages)

# %% [markdown]
# Exhaustion says what was asked, what is free and who holds the rest, and changes
# nothing; a second `free` of the same handle is refused. `tests/test_pool.py` drives a
# hypothesis state machine through random allocate / share / free / exhaust sequences
# and checks after every step that no page leaked or is owned twice, reference counts
# stay positive, free + used = total and the statistics match a recount; when every
# handle is freed the pool is exactly as it started.
#
# ## The model on pool pages
#
# `PagedHybridCache` implements the chapter-3 cache protocol on a pool. Each global
# layer keeps a **block table**: a list of allocations of `block_tokens` tokens each;
# token t lives in block t // block_tokens. Each KDA layer's state and conv state are
# allocations of their own. Writes go straight into the arena; `kv(i)` gathers the
# layer's blocks in order (the CPU stand-in for a paged-attention kernel that reads
# through the block table).

# %%
show_source(PagedHybridCache.append_kv)

# %%
model = Model(tiny, seed=0)
rng = np.random.default_rng(4)
prompt = rng.integers(0, 256, size=90).tolist()
arena = PagePool(512, 4096, name="tiny-arena")
contiguous, paged = HybridCache(tiny), PagedHybridCache(tiny, arena, block_tokens=16)
diffs = [np.abs(model.prefill(prompt, contiguous) - model.prefill(prompt, paged)).max()]
for t in rng.integers(0, 256, size=10):
    diffs.append(np.abs(model.decode(int(t), contiguous) - model.decode(int(t), paged)).max())
print("paged logits == contiguous logits (prefill + 10 decode steps):", max(diffs) == 0.0)
print("bytes held, by kind, equal:", paged.nbytes_by_kind() == contiguous.nbytes_by_kind())
print(paged)
reserved = paged.reserved_bytes_by_kind()
print("pages reserved by kind:", {k: v // arena.page_bytes for k, v in reserved.items()})
paged.free()
print("after free():", arena.n_free, "of", arena.n_pages, "pages free")

# %% [markdown]
# Identical to the last bit: the paged cache is a storage layout, not an approximation.
# (With 4 KiB pages a `tiny` KV row of one layer is 2 KiB, so a 16-token block is 8
# pages; a 32 KiB KDA state is 8 pages; a 9 KiB conv state takes 3 pages and wastes 3 KiB.)
#
# ## Watching the pool as requests come and go
#
# Five requests arrive, decode and leave on one 512-page arena. After each event we
# take the pool's page map (the kind of every page).

# %%
arena = PagePool(512, 4096, name="tiny-arena")
live, snapshots = {}, []


def snap(title):
    snapshots.append((title, arena.page_map()))


def arrive(name, n_tokens, seed):
    toks = np.random.default_rng(seed).integers(0, 256, size=n_tokens).tolist()
    live[name] = PagedHybridCache(tiny, arena, block_tokens=16)
    model.prefill(toks, live[name])


def decode(names, steps):
    for _ in range(steps):
        for name in names:
            model.decode(7, live[name])


arrive("A", 60, 1)
arrive("B", 130, 2)
snap("A (60 tokens) and B (130) arrive")
arrive("C", 40, 3)
decode(["A", "B", "C"], 8)
snap("C (40) arrives; A, B, C decode 8 tokens")
live.pop("A").free()
snap("A finishes: its pages go back")
arrive("D", 50, 4)
snap("D (50) arrives and reuses A's pages")
try:
    arrive("E", 400, 5)
except PoolExhausted as err:
    print("E (400 tokens) refused:", err)
snap("E (400) does not fit; the pool is unchanged")
for name, cache in live.items():
    print(f"{name}: {cache.seq_len:3d} tokens on {cache.n_pages:3d} pages")

# %%
codes = {kind: i for i, kind in enumerate(PAGE_KINDS)}
cmap = ListedColormap([plots.color("free")] + [plots.color(k) for k in PAGE_KINDS])
fig, axes = plt.subplots(len(snapshots), 1, figsize=(8.0, 6.4), sharex=True)
for ax, (title, page_map) in zip(axes, snapshots):
    ax.imshow((page_map + 1).reshape(8, 64), cmap=cmap, vmin=0, vmax=len(PAGE_KINDS),
              aspect="auto", interpolation="nearest")
    ax.set_title(f"{title}   ({np.sum(page_map < 0)} of {page_map.size} pages free)", fontsize=9, loc="left")
    ax.set_yticks([0, 7], ["0", "448"])
    ax.set_ylabel("page")
    ax.grid(False)
axes[-1].set_xlabel("page index within a row (8 rows x 64 pages of 4 KiB)")
handles = [Patch(color=plots.color(k), label=plots.label(k)) for k in ("kv", "kda_state", "conv_state", "free")]
fig.legend(handles=handles, loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.04))
fig.tight_layout(rect=(0, 0.03, 1, 1))
plots.save(fig, "ch04-pool-map")
plt.show()

# %% [markdown]
# Every kind shares one arena and freed pages of any kind serve the next request of any
# kind: D's KV and conv states land in A's old pages (KDA-state pages before), the rest
# in the free tail, interleaved with what B and C hold. E is refused before it computes
# anything: its KDA and conv states alone (taken together, all or nothing, when its cache
# is created) need more pages than are free, so it never gets to ask for KV, and the
# pool is exactly as it was.
#
# ## Four ways to size pages
#
# A *page layout* says which pools exist, how big their pages are, and how a request's
# objects map to pages. Four layouts, each a small object in `kimilab.pool.layouts`:
#
# - **unified** (`UnifiedPages`, this chapter): one pool of small pages (one 16-token KV
#   block of one layer); a state spans as many pages as it needs, scattered anywhere.
# - **vLLM-style padded** (`VllmPaddedPages`): vLLM keeps one pool of equal pages
#   ([vllm](references.md#vllm)); the layout is the one `costs.vllm_hybrid_pages` derives
#   (chapter 3), in two steps. *Per layer*, the attention block grows in multiples of 16
#   tokens until one MLA layer's page holds one KDA layer's state + conv state, and the
#   state page is padded up to it (`HybridAttentionMambaModelConfig.verify_and_update_config`
#   in `vllm/model_executor/models/config.py`). *Per group*, layers are grouped by type
#   into groups of one size, the last group of a type padded with empty layer slots, and
#   a block id names one page in every layer of its group
#   (`_get_kv_cache_groups_uniform_page_size` in `vllm/v1/core/kv_cache_utils.py`). So a
#   KV block costs a page in each of the 7 MLA layers, and a request's states cost one
#   block in each KDA group, padded slot included.
# - **Jenga-style LCM** (`JengaPages`): large pages of the least common multiple of the
#   KV page and the state page, each large page carved into small pages of one kind.
# - **split pools** (`SplitPools`, SGLang-style): a KV pool plus a separate state pool with
#   one slot per request; the state pool gets r / (1 + r) of the memory, r being SGLang's
#   `--mamba-full-memory-ratio` (default 0.9).

# %%
layouts = {"unified": UnifiedPages(), "vllm-padded": VllmPaddedPages(), "jenga": JengaPages(),
           "split": SplitPools(0.9)}
for name, s in shapes.items():
    print(name)
    for key, layout in layouts.items():
        print("  " + layout.describe(s))

# %% [markdown]
# vLLM's layout for the 48B model on one TP4 device, step by step (all from
# `VllmPaddedPages().pages`, which is `costs.vllm_hybrid_pages`):

# %%
vp = layouts["vllm-padded"].pages(s48)
print(f"per layer: {vp.block_tokens:,}-token blocks (a multiple of {vp.align_tokens}), page {vp.page_bytes:,} B; "
      f"a {vp.state_bytes:,} B state page padded by {vp.state_padding_bytes:,} B")
print(f"groups of {vp.group_size}: {vp.attn_groups} MLA group, {vp.kda_groups} KDA groups for {vp.n_kda_layers} "
      f"KDA layers ({vp.kda_padded_slots} padded slot); one block id = {vp.group_size} pages = {size(vp.block_bytes)}")
print(f"a request's states: {vp.checkpoint_blocks} blocks = {vp.checkpoint_blocks * vp.group_size} pages = "
      f"{size(vp.checkpoint_page_bytes)} for {size(vp.checkpoint_bytes)} of states: "
      f"{size(vp.checkpoint_padding_bytes)} padding, {size(vp.kda_padded_slots * vp.page_bytes)} of it the padded slot")
print(f"without layer groups it would be {vp.n_kda_layers} pages and "
      f"{size(vp.n_kda_layers * vp.state_padding_bytes)} of padding")
v64 = VllmPaddedPages(align_tokens=64).pages(s48)
print(f"with 64-token alignment instead of {vp.align_tokens}: {v64.block_tokens:,}-token blocks "
      f"({100 * (v64.block_tokens / vp.block_tokens - 1):.1f}% larger)")

# %% [markdown]
# On a TP4 device the state page is a quarter of the whole model's, so vLLM's block is
# 480 tokens, not 1,888. For the states the layer groups still cost more than the page
# size: 20 KDA layers fill three groups of 7, so every request's states reserve 21 pages,
# and the empty 21st page (540.00 KiB) is most of the 740.00 KiB of padding. This is the
# layout at the vLLM commit cited in [vllm](references.md#vllm), which aligns blocks to 16
# tokens. Versions that serve MLA hybrids align MLA blocks to 64 tokens (vLLM PR #24486;
# 128 on the CUTLASS MLA backend), which here gives 512-token blocks, 6.7% larger. The
# chapter keeps the cited 16-token layout.

# %%
contexts = [1, 100, 1000, 32768]
print(f"{'model':16s} {'layout':12s}" + "".join(f"{n:>18,d}" for n in contexts) + "   tokens")
for name, s in shapes.items():
    for key, layout in layouts.items():
        cells = []
        for n in contexts:
            fp = layout.footprint(s, n)
            cells.append(f"{size(fp.waste_bytes):>10s} {100 * fp.waste_fraction:4.1f}%")
        print(f"{name:16s} {key:12s}" + "".join(f"{c:>18s}" for c in cells))

# %% [markdown]
# That is *per-request* internal waste: bytes reserved minus bytes used (page rounding,
# the unfilled tail of the last KV block, state padding). Under DP-attention vLLM's
# padded layout needs 1,888-token attention blocks to match a 2.07 MiB state page, so a
# short chat reserves a whole 1,888-token block on every MLA layer and its states take 21
# pages for 20 layers: a 100-token request pads 15.90 MiB, 27.4% of what it reserves, and
# even a 32,768-token one pads 3.8%. On a TP4 device everything is a quarter the size:
# 480-token blocks, 3.65 MiB (24.7%) for a 100-token request and 1.3% at 32,768 tokens.
# The unified pool and Jenga waste well under 3% at 48B scale. (For `tiny` the default unified page, one 16-token block = 32 KiB, is
# larger than a 9 KiB conv state, so tiny's unified waste is high; the 4 KiB arena above
# avoids that — exercise 4.7 is about page size.) Split
# pools waste nothing per request — their cost is elsewhere: memory stranded in the
# pool that is not the bottleneck. Jenga's cost is elsewhere too: large pages half used
# by one kind are unusable by the other. Only serving a workload shows those.

# %%
ctx = np.unique(np.logspace(0, 17, 120, base=2).astype(int))
fig, ax = plt.subplots()
for key in ("vllm-padded", "unified", "split", "jenga"):  # Jenga last: it overlaps split exactly
    layout = layouts[key]
    waste = np.array([layout.footprint(s48, int(n)).waste_bytes / MiB for n in ctx])
    waste[waste == 0] = np.nan  # exactly zero at block multiples: a gap in the line, not a spike
    ax.plot(ctx, waste, **plots.style_of(key), **({"ls": "--"} if key == "jenga" else {}))
ax.axhline(vp.checkpoint_padding_bytes / MiB, color=plots.color("vllm-padded"), ls=":", lw=1,
           label="vLLM: the states' padding alone (21 pages for 20 layers)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_ylim(1e-3, 40)
ax.set_xlabel("tokens held by the request")
ax.set_ylabel("internal waste per request (MiB, log)")
ax.set_title("Kimi-Linear-48B on one TP4 device: padding per request by page layout")
ax.legend(fontsize=8, loc="lower left")
plots.save(fig, "ch04-waste-per-request")
plt.show()
wv = np.array([layouts["vllm-padded"].footprint(s48, int(n)).waste_bytes for n in ctx])
wu = np.array([layouts["unified"].footprint(s48, int(n)).waste_bytes for n in ctx])
print(f"one TP4 device: vLLM-style waste {size(int(wv.min()))} to {size(int(wv.max()))} per request "
      f"(the states' padding alone {size(vp.checkpoint_padding_bytes)}); unified at most {size(int(wu.max()))}")

# %% [markdown]
# On a TP4 device vLLM-style padding costs up to 4.41 MiB per request and never less than
# the states' 740.00 KiB (dotted): at a multiple of 480 tokens the KV blocks are full, but
# the states still pad, most of it the padded layer slot. The unified pool never wastes
# more than 318.12 KiB. Jenga (dashed) and split pools waste the same per request (the
# tail of the last 16-token block) and nothing at block boundaries.
#
# ## The experiment: one mixed workload, five layouts, one device's memory
#
# The budget is what one device of the TP4 recipe really has for its caches:
# `costs.cache_budget_bytes` -- 90% of its HBM, minus its quarter of the weights and a
# reserve for one step's activations. That is tens of gigabytes, and short chats do not
# fill it: a chat of a thousand tokens holds 19 MB on a device (its states and its
# KV), so a device would need thousands of them running at once. What fills a device is
# long context. `mixed_workload` draws a deterministic (seed 0) stream of requests over
# 60 s of simulated time: chats all along (60 per second, prompts log-normal around 8k
# tokens, like the Mooncake conversation trace's (chapter 5), clipped to 256-128k,
# 256-1,024 output tokens) and, between 20 s and 40 s only, long documents or agent
# contexts (4 per second, prompts 64k-512k tokens). So the first and last thirds are
# many moderate requests and the middle third is KV-heavy. The unified pool, Jenga and
# the split pools use 64-token KV blocks, the alignment vLLM's MLA kernels need; vLLM's
# own layout uses its 480-token blocks.

# %%
BUDGET = int(costs.cache_budget_bytes(kimi_linear_48b, DEP))
WORKLOAD = dict(chat_prompt_median=8192, chat_prompt_range=(256, 131072), chat_output_range=(256, 1024),
                doc_rate_per_s=4.0, doc_prompt_range=(65536, 524288), doc_output_range=(256, 1024))
requests = mixed_workload(0, chat_rate_per_s=60.0, **WORKLOAD)
chats = [r for r in requests if r.kind == "chat"]
docs = [r for r in requests if r.kind == "document"]
print(f"{len(requests)} requests: {len(chats)} chats, {len(docs)} documents; budget {BUDGET / 1e9:.1f} GB per device "
      f"of {DEP.name}")
print(f"chat prompt tokens: median {int(np.median([r.input_length for r in chats])):,d}, "
      f"documents: median {int(np.median([r.input_length for r in docs])):,d}, "
      f"max {max(r.input_length for r in docs):,d}")
print(f"one request on one device: a 1,000-token chat {size(s48.request_bytes(1000))}, "
      f"a 50,000-token document {size(s48.request_bytes(50_000))} "
      f"({size(50_000 * s48.kv_bytes_per_token)} of it KV)")

# %% [markdown]
# The simulation loop (`kimilab.sim.simulate`, given a `memory=` budget) serves it on
# one device's budget with the per-device shapes. Each step it admits queued requests
# first come, first served while their prompt fits, then every running request makes one
# token; a request that needs a new KV block and finds none preempts the newest running
# request, which goes back to the head of the queue and is recomputed later (vLLM's
# recompute preemption). A request that could not fit even in an empty pool is refused.
# The pools are the real `PagePool` allocators in accounting-only mode (`backed=False`):
# no 99 GB array.

# %%
show_source(RequestAllocator.admit)

# %%
SPLIT_RATIOS = (0.9, 0.2)
LAYOUTS = {"unified": UnifiedPages(block_tokens_=64), "vllm-padded": VllmPaddedPages(),
           "jenga": JengaPages(block_tokens_=64)}
LAYOUTS |= {f"split r={r}": SplitPools(r, 64) for r in SPLIT_RATIOS}
runs = {name: simulate(requests, memory=RequestAllocator(layout, s48, BUDGET), label=name)
        for name, layout in LAYOUTS.items()}
PHASES = {"chats 0-20 s": (0, 20_000), "docs 20-40 s": (20_000, 40_000), "chats 40-60 s": (40_000, 60_000)}

print(f"{'layout':14s} {'mean run':>8s} {'peak':>5s} {'util':>6s} {'padding':>10s} {'preempt':>7s} "
      f"{'refused':>7s} {'makespan':>9s} {'wait':>7s}")
for name, res in runs.items():
    s = res.summary()
    print(f"{name:14s} {s['mean_running']:8.1f} {s['peak_running']:5d} {100 * s['mean_utilisation']:5.1f}% "
          f"{s['mean_padding_MiB']:7.1f} MiB {s['preemptions']:7d} {s['refused']:7d} "
          f"{s['makespan_s']:8.1f}s {s['mean_wait_s']:6.1f}s")
print("\nmean requests running, by phase")
for name, res in runs.items():
    means = res.phase_means(PHASES)
    print(f"{name:14s} " + "  ".join(f"{k}: {v:5.1f}" for k, v in means.items()))
state_share = np.mean([s48.fixed_bytes / s48.request_bytes(r.input_length + r.output_length) for r in requests])
print(f"states' share of a request's bytes at full length, mean over requests: {state_share:.1%}; "
      f"SGLang's default split gives them {0.9 / 1.9:.1%} of the memory")

# %% [markdown]
# Columns: mean and peak number of requests running at once; mean utilisation (bytes
# that really hold cache over the budget, while anything runs); mean padding (bytes held
# but holding nothing); preemptions; refusals; the time the last request finished; the
# mean wait from arrival to first admission.

# %%
SPLIT_STYLES = {0.9: ("#E69F00", "-."), 0.2: ("#5C3D00", "--")}


def line_style(name):
    """The house colour per layout; the split ratios as shades of its orange, each with its own dash."""
    if name.startswith("split"):
        r = float(name.split("=")[1])
        colour, dash = SPLIT_STYLES[r]
        return {"color": colour, "ls": dash, "lw": 1.4, "label": f"{plots.label('split')}, state:KV = {r}"}
    return {"color": plots.color(name), "label": plots.label(name), "lw": 1.8}


fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8.0, 6.6), sharex=True)
for name, res in runs.items():
    t = res.time_ms / 1000
    k = 25  # 0.5 s moving average, for readability
    smooth = lambda y: np.convolve(y, np.ones(k) / k, mode="same")
    ax1.plot(t, smooth(res.running), **line_style(name))
    ax2.plot(t, 100 * smooth(res.utilisation), **line_style(name))
for ax in (ax1, ax2):
    ax.axvspan(20, 40, color="#DDDDDD", alpha=0.5, lw=0)
    ax.set_xlim(0, 150)
ax1.text(30, 40, "documents arrive", ha="center", fontsize=9)
ax1.set_ylabel("requests running at once")
ax2.set_ylabel("budget holding cache bytes (%)")
ax2.set_xlabel("simulated time (s)")
ax1.set_title(f"Kimi-Linear-48B on one {DEP.name} device, {BUDGET / 1e9:.1f} GB for caches, one mixed workload")
fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.07))
fig.tight_layout(rect=(0, 0.05, 1, 1))
plots.save(fig, "ch04-admission-timeline")
plt.show()

# %% [markdown]
# With a whole device's memory the layouts that share one pool -- unified, vLLM-style,
# Jenga -- run the same requests (506.7 on average, the unified pool's line hides under
# the others): at these sizes a request's states are a small share of its bytes (14.6% on
# average) and every layout's padding is a rounding error beside them. The split pools
# are the outlier. SGLang's default ratio gives the states 47.4% of the memory, and the
# long requests need KV: the budget never holds more than 58% of real cache bytes, the
# queue grows (a 29.7 s mean wait), and the workload finishes at 142.2 s instead of
# 93.7 s. A ratio that fits this traffic (0.2) comes close to one pool (476.1 running) --
# but it has to be chosen for the traffic in advance, and a 50,000-token document is
# 384.52 MiB of KV that only the KV pool can hold.

# %%
names = list(runs)
colors = [line_style(n)["color"] for n in names]
labels = [{"unified": "unified", "vllm-padded": "vLLM\npadded", "jenga": "Jenga"}.get(n, n.replace("split r=", "split\n"))
          for n in names]
fig, axes = plt.subplots(1, 3, figsize=(11.5, 4.0))
metrics = [("mean requests running", [runs[n].summary()["mean_running"] for n in names]),
           ("mean padding held (MiB)", [runs[n].summary()["mean_padding_MiB"] for n in names]),
           ("makespan (s)", [runs[n].makespan_ms / 1000 for n in names])]
for ax, (title, values) in zip(axes, metrics):
    ax.bar(range(len(names)), values, color=colors)
    ax.set_xticks(range(len(names)), labels, fontsize=9)
    ax.set_ylabel(title)
    ax.set_xlabel("layout")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}" if v >= 10 or float(v).is_integer() else f"{v:.1f}",
                ha="center", va="bottom", fontsize=9)
fig.legend(handles=[Patch(color=plots.color(k), label=plots.label(k))
                    for k in ("unified", "vllm-padded", "jenga", "split")],
           loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.06))
fig.suptitle(f"What each layout did with the same {len(requests):,} requests ({BUDGET / 1e9:.1f} GB, one TP4 device)",
             fontsize=11)
fig.tight_layout(rect=(0, 0.04, 1, 1))
plots.save(fig, "ch04-admission-summary")
plt.show()

# %% [markdown]
# Padding is where Jenga's large pages show (5092.8 MiB held but empty on average: large
# pages of one kind partly used), yet at this budget it costs no requests; makespan is
# where the split pools lose.

# %%
u = runs["unified"].summary()
for name in ("vllm-padded", "jenga", "split r=0.9", "split r=0.2"):
    s = runs[name].summary()
    print(f"unified vs {name:12s}: {u['mean_running'] / s['mean_running']:.3f}x the requests running, "
          f"utilisation {100 * u['mean_utilisation']:.1f}% vs {100 * s['mean_utilisation']:.1f}%, "
          f"makespan {u['makespan_s']:.1f} s vs {s['makespan_s']:.1f} s")

# %% [markdown]
# **Which wins where, on one TP4 device's cache budget.** One pool wins, whichever way
# its pages are cut: unified, vLLM-style and Jenga are within 0.1% of each other in
# requests running (1.000x and 0.999x). The fixed split is what loses: 1.517x more
# requests run on one pool than on SGLang's default split, and 1.064x more than on a
# split tuned to this workload (0.2). The chapter's first edition measured a unified
# pool's lead over vLLM-style padding at a 4 GiB budget; with a real device's memory and
# per-device sizes that lead is gone at TP4 -- padding only matters when states are a
# large share of what a request holds.
#
# ## One operating point proves nothing: the sweep
#
# Everything above is one point: one deployment, one load, one seed, and prefill that
# costs no time. Now the same comparison on every named deployment's device -- TP4 and
# TP8 (tensor parallelism shrinks the states per device, not the latent), and
# DP-attention (whole requests per device, states four times larger than at TP4) --
# each with its own budget, over three seeds, with prefill charged in time: a request
# admitted with T tokens, or re-admitted after a preemption to recompute them, holds its
# memory for ceil(T / 8,192) steps before its first token (the deployment's
# `max_batched_tokens`, as one chunk per step). To stay within the chapter's time the
# sweep's workload lasts 30 s, documents between 10 and 20 s, and the 20 simulations of
# each deployment run on the machine's cores (`sim.simulate_many`).

# %%
SWEEP_LAYOUTS = {"unified": UnifiedPages(block_tokens_=64), "vllm-padded": VllmPaddedPages(),
                 "jenga": JengaPages(block_tokens_=64), "split r=0.9": SplitPools(0.9, 64)}
SWEEP_DEPS, SEEDS = (DEP, costs.VLLM_TP8_H200, DP), (0, 1, 2)
jobs = {}
for dep in SWEEP_DEPS:
    shapes_dep, budget = CacheShapes.from_config(kimi_linear_48b, dep), costs.cache_budget_bytes(kimi_linear_48b, dep)
    for seed in SEEDS:
        reqs = mixed_workload(seed, duration_ms=30_000, doc_window_ms=(10_000, 20_000), chat_rate_per_s=60.0,
                              **WORKLOAD)
        for name, layout in SWEEP_LAYOUTS.items():
            jobs[dep.name, seed, name] = (reqs, layout, shapes_dep, budget, dep.max_batched_tokens)
sweep = simulate_many(jobs)


def over_seeds(dep, name, value):
    return np.array([value(sweep[dep.name, seed, name]) for seed in SEEDS])


print(f"{'deployment':<14s} {'budget':>8s} {'layout':<12s} {'mean running':>12s} {'makespan':>9s} "
      f"{'preempted':>9s} {'recomputed tokens':>17s}   (means over {len(SEEDS)} seeds)")
for dep in SWEEP_DEPS:
    for name in SWEEP_LAYOUTS:
        running = over_seeds(dep, name, lambda r: r.summary()["mean_running"])
        makespan = over_seeds(dep, name, lambda r: r.makespan_ms / 1000)
        preempted = over_seeds(dep, name, lambda r: r.preemptions)
        recomputed = over_seeds(dep, name, lambda r: r.preempted_tokens)
        print(f"{dep.name:<14s} {costs.cache_budget_bytes(kimi_linear_48b, dep) / 1e9:6.1f}GB {name:<12s} "
              f"{running.mean():12.1f} {makespan.mean():8.1f}s {preempted.mean():9.1f} {recomputed.mean():17,.0f}")

# %%
fig, ax = plt.subplots(figsize=(8.5, 4.2))
width = 0.2
for j, name in enumerate(SWEEP_LAYOUTS):
    vals = [over_seeds(dep, name, lambda r: r.summary()["mean_running"]) for dep in SWEEP_DEPS]
    mean = np.array([v.mean() for v in vals])
    spread = np.array([[v.mean() - v.min() for v in vals], [v.max() - v.mean() for v in vals]])
    style = line_style(name)
    ax.bar(np.arange(len(SWEEP_DEPS)) + (j - 1.5) * width, mean, width, yerr=spread, capsize=3,
           color=style["color"], label=style["label"])
ax.set_xticks(range(len(SWEEP_DEPS)), [f"{d.name}\n{costs.cache_budget_bytes(kimi_linear_48b, d) / 1e9:.1f} GB"
                                        for d in SWEEP_DEPS])
ax.set_xlabel("deployment (one device, its own cache budget)")
ax.set_ylabel("mean requests running at once")
ax.set_title(f"Four layouts on three deployments ({len(SEEDS)} seeds: mean, bars = min-max; prefill charged)")
ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, -0.42), ncol=2)
plots.save(fig, "ch04-layout-sweep")
plt.show()
for dep in SWEEP_DEPS:
    mean = {name: over_seeds(dep, name, lambda r: r.summary()["mean_running"]).mean() for name in SWEEP_LAYOUTS}
    best_other = max((n for n in mean if n != "unified"), key=mean.get)
    print(f"{dep.name:<14s}: unified / best other ({best_other}) = {mean['unified'] / mean[best_other]:.3f}; "
          f"unified / split r=0.9 = {mean['unified'] / mean['split r=0.9']:.3f}")

# %% [markdown]
# The verdict holds on every deployment: one pool, cut any of the three ways, runs the
# same number of requests within 3% (unified / best other: 0.994 at TP4, 0.998 at TP8,
# 0.999 under DP-attention, where vLLM's padding is four times larger and costs it 3%:
# 366.2 against 377.2), and 1.27-1.42 times as many as SGLang's default split. Charged
# for prefill, the split pools preempt most (28.0 per run at TP4 against 15.7) and
# recompute the most tokens. The first edition of this chapter found the unified pool
# 3.0-4.6% ahead of Jenga at a 2-8 GiB budget; at a real device's budget that lead is
# gone, and what remains is the cost of splitting memory by kind in advance.
#
# ## What the unified pool costs
#
# Indirection. A state scattered over many pages must be gathered before a kernel uses
# it, and `kv(i)` gathers blocks through the block table. On this CPU, a decode step
# of the tiny model through the paged cache against the contiguous one (wall clock,
# varies by machine; `bench/bench_pool.py` measures more contexts):

# %%
# NBVAL_IGNORE_OUTPUT
def per_step(cache, steps=4):
    return best_seconds(lambda: [model.decode(7, cache) for _ in range(steps)], repeats=2) / steps


bench_pool = PagePool(1024, 4096)
c_cache, p_cache = HybridCache(tiny), PagedHybridCache(tiny, bench_pool)
warm = np.random.default_rng(0).integers(0, 256, size=200).tolist()
model.prefill(warm, c_cache), model.prefill(warm, p_cache)
tc, tp = per_step(c_cache), per_step(p_cache)
print(f"decode step at {c_cache.seq_len} tokens: contiguous {tc * 1e3:.2f} ms, paged {tp * 1e3:.2f} ms, "
      f"ratio {tp / tc:.2f}x")
p_cache.free()

# %% [markdown]
# For the tiny model the gather is small beside the rest of a decode step: when this book
# was built, `bench/bench_pool.py` measured paged/contiguous between 1.0x and 1.6x at
# 64-2,048 tokens across runs (CPU wall clock on a shared 2-core machine, so noisy). On a GPU the same
# trade is made by the kernels (vLLM's paged attention reads through
# block tables; a state kernel would take a page list). The pool itself is cheap:
# allocation pops pages off a stack, tens of thousands of allocate + free pairs per
# second in plain Python, independent of the pool's size.
#
# ## Summary
#
# - A hybrid request holds KV that grows per token and states that are large and fixed;
#   on one TP4 device one KDA layer's state equals 455 tokens of one MLA layer's KV (1,820
#   under DP-attention), because tensor parallelism splits the states but not MLA's latent.
# - One arena of small fixed pages with typed, reference-counted allocations holds all of
#   it; the tiny model runs on it with bit-identical logits, and freeing returns every page.
# - Per request, vLLM-style padding wastes up to 4.41 MiB on a TP4 device (16.66 MiB under
#   DP-attention), most of its state padding in the 21st page of three groups of 7; the
#   unified pool and Jenga waste well under 3%; split pools waste nothing per request but
#   strand memory in whichever pool is not the bottleneck.
# - With one TP4 device's real cache budget (98.9 GB) and long-context traffic, the three
#   one-pool layouts run the same requests (506.7 on average) and SGLang's default split
#   runs 334.1: one pool runs 1.517x as many. Across TP4, TP8 and DP-attention and three
#   seeds with prefill charged in time, one pool leads the default split by 1.27-1.42x,
#   and the unified pool is within 3% of the best other layout everywhere.
# - The price is indirection: states and KV are gathered through page lists.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **4.1 Size a pool.** You serve `kimi_linear_48b` with vLLM's TP4 recipe. On one device,
# with that device's whole cache budget in a unified pool whose page is one 16-token MLA
# block of one layer (`UnifiedPages()`), how many requests of **4,096 tokens** each can
# be resident at once?

# %% tags=["solution"]
layout = UnifiedPages()
page_bytes = layout.page_bytes(s48)["main"]  # 16 x 1,152 B
per_request = layout.footprint(s48, 4096).reserved_bytes // page_bytes  # states (ceil per layer) + 7 x 256 KV
answer = (int(costs.cache_budget_bytes(kimi_linear_48b, DEP)) // page_bytes) // per_request

# %%
verify("4.1", answer)

# %% [markdown]
# **4.2 Half the devices.** Serve Kimi-Linear-48B with the TP4 recipe's settings on
# two devices instead of four (TP2). What block size (tokens) does vLLM's derivation
# give on one of those devices, at the default 16-token alignment?

# %% tags=["solution"]
tp2 = DEP.with_(name="vllm-tp2-h200", n_devices=2)  # every KDA head count per device doubles; MLA's latent does not split
answer = costs.vllm_hybrid_pages(kimi_linear_48b, tp2).block_tokens

# %%
verify("4.2", answer)

# %% [markdown]
# **4.3 The padding.** At the default alignment, on one device of the TP4 recipe, how
# many bytes of each KDA layer's state page does vLLM's layout leave empty?

# %% tags=["solution"]
v16 = costs.vllm_hybrid_pages(kimi_linear_48b, DEP)
answer = v16.page_bytes - v16.state_bytes

# %%
verify("4.3", answer)

# %% [markdown]
# **4.4 Short chats.** Give the same TP4 device's whole cache budget first to the unified
# pool and then to vLLM's padded layout (`VllmPaddedPages()`). How many more requests of
# **300 tokens** each can be resident at once in the unified pool?

# %% tags=["solution"]
fits = {}
for name, layout in (("unified", UnifiedPages()), ("vllm-padded", VllmPaddedPages())):
    page = layout.page_bytes(s48)["main"]
    fits[name] = (int(costs.cache_budget_bytes(kimi_linear_48b, DEP)) // page) // (layout.footprint(s48, 300).reserved_bytes // page)
answer = fits["unified"] - fits["vllm-padded"]  # a 300-token chat still takes a whole 480-token block per MLA layer

# %%
verify("4.4", answer)

# %% [markdown]
# **4.5 (open)** Find the split ratio r that maximises the mean number of running
# requests on this workload (try `np.linspace(0.05, 0.5, 7)`). Then make the workload
# short chats only (`chat_prompt_median=700`, `doc_rate_per_s=0`, and a rate that fills
# the device) and search again. How far apart are the two best
# ratios, and how close does each get to the unified pool?
#
# **4.6 (open)** Run `VllmPaddedPages(align_tokens=...)` with 1, 16 and 64 and compare
# the padding per 100-token request. Why can alignment not remove the padding, and which
# part of it does no alignment touch?
#
# **4.7 (open)** Give the unified pool larger pages (`UnifiedPages(page_bytes=...)`, e.g.
# one 2,174,976-byte vLLM page). Which kind of request loses, and by how much?
