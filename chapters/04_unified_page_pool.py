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
# every kind of per-request memory of a hybrid model is allocated: KV blocks, KDA states,
# conv states. You will run the chapter-3 model on it, check that it computes exactly what
# the contiguous cache computes, and serve one mixed workload on five memory layouts with
# the cache memory of one device of a real deployment.
#
# **What you'll learn.**
# - Why a hybrid model makes paging awkward: its three kinds of memory differ in size
#   by orders of magnitude, and only one of them grows.
# - How production systems cope ([references](references.md)): vLLM pads every page to
#   one size, SGLang keeps a separate state pool beside the KV pool, Jenga carves large
#   pages sized to the least common multiple of the page sizes.
# - What each choice costs at Kimi-Linear-48B scale on one device: padding, memory
#   stranded in the wrong pool, requests that could have run but did not.
#
# **What you'll need.** Chapter 3 (the hybrid model, its cache protocol, and the named
# deployments every byte is priced on); numpy and matplotlib. Reference pages:
# [glossary](glossary.md), [notation](notation.md), [API](api.md).
#
# **Honest scope.** The model is the reduced, untrained `tiny` model; the pool mechanics
# are exact. The serving experiment is *accounting*: the real allocators on the real 48B
# byte sizes of one device and its cache budget, in simulated time (one engine step = one
# token for every running request = 20 ms). It measures how many requests each layout
# holds, not latency.

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
import textwrap

import matplotlib.pyplot as plt
import numpy as np

from kimilab import costs, plots
from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import CacheShapes
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import key_results, show_source, show_table
from kimilab.pool import (JengaPages, PagedHybridCache, PagePool, PoolExhausted, RequestAllocator, SplitPools,
                          UnifiedPages, VllmPaddedPages)
from kimilab.sim import simulate
from kimilab.traffic import mixed_workload

plots.use_style()
MiB, GiB = 2**20, 2**30
DEP, DP = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200


def size(n):  # bytes, human-readable with fixed precision
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,d} B"


def wrap(text):  # a long message folded to the page's width
    return textwrap.fill(str(text), 100, subsequent_indent="    ")


# %%
# Key results (each number is computed here and derived step by step below)
s48 = CacheShapes.from_config(kimi_linear_48b, DEP)  # one device of vLLM's TP4 recipe
BUDGET, vp = int(costs.cache_budget_bytes(kimi_linear_48b, DEP)), VllmPaddedPages().pages(s48)
ctx = np.unique(np.logspace(0, 17, 120, base=2).astype(int))  # request lengths, 1 to 131,072 tokens
unified_worst = max(UnifiedPages().footprint(s48, int(n)).waste_bytes for n in ctx)
WORKLOAD = dict(chat_prompt_median=8192, chat_prompt_range=(256, 131072), chat_output_range=(256, 1024),
                doc_rate_per_s=4.0, doc_prompt_range=(65536, 524288), doc_output_range=(256, 1024))
requests = mixed_workload(0, chat_rate_per_s=60.0, **WORKLOAD)
LAYOUTS = {"unified": UnifiedPages(block_tokens_=64), "vllm-padded": VllmPaddedPages(),
           "jenga": JengaPages(block_tokens_=64), "split r=0.9": SplitPools(0.9, 64), "split r=0.2": SplitPools(0.2, 64)}
runs = {name: simulate(requests, memory=RequestAllocator(layout, s48, BUDGET), label=name)
        for name, layout in LAYOUTS.items()}  # the experiment below, run once here
running = {name: res.summary()["mean_running"] for name, res in runs.items()}
key_results(
    f"On one TP4 device of Kimi-Linear-48B, one KDA layer's state weighs as much as "
    f"{s48.state_bytes // s48.kv_token_bytes:,} tokens of one MLA layer's KV: no one page size suits both.",
    f"vLLM's equal pages give every request at least {size(vp.checkpoint_padding_bytes)} of padding "
    f"({vp.checkpoint_blocks * vp.group_size} state pages for {vp.n_kda_layers} layers); "
    f"the unified pool wastes at most {size(unified_worst)}.",
    f"On that device's {BUDGET / 1e9:.1f} GB cache budget, one pool runs {running['unified']:.1f} mixed requests "
    f"at once, SGLang-style split pools {running['split r=0.9']:.1f}: "
    f"{running['unified'] / running['split r=0.9']:.3f}x as many.",
    f"A split tuned to this traffic (state:KV = 0.2) comes within "
    f"{running['unified'] / running['split r=0.2']:.3f}x of one pool, but its ratio must be chosen in advance.",
)

# %% [markdown]
# ## Three kinds of memory, three very different sizes
#
# A request of a hybrid model holds (chapter 3) **KV** for each global layer, a fixed
# number of bytes *per token* that grows with the request; a **KDA state** (H x K x V) per
# KDA layer, fixed size, overwritten by every token; and a **conv state** (the last
# kernel - 1 inputs of the short convolution) per KDA layer, fixed size, rolling.
#
# `CacheShapes` reads these sizes off a config *on one device of a deployment*. Tensor
# parallelism splits the KDA heads (so the states) over the devices, but MLA's one latent
# head is held whole by every device. On one device of the TP4 recipe and of DP-attention:

# %%
shapes = {"tiny": CacheShapes.from_config(tiny, costs.LOCAL), "48B, TP4 device": s48,
          "48B, DP device": CacheShapes.from_config(kimi_linear_48b, DP)}
quantities = {"KV per token, one layer": "kv_token_bytes", "KDA state, one layer": "state_bytes",
              "conv state, one layer": "conv_bytes", "fixed states per request": "fixed_bytes",
              "KV per token, all layers": "kv_bytes_per_token"}
rows = [[q] + [size(getattr(s, attr)) for s in shapes.values()] for q, attr in quantities.items()]
rows += [["global / KDA layers"] + [f"{s.n_attn_layers} / {s.n_kda_layers}" for s in shapes.values()],
         ["1 KDA state = tokens of 1 layer's KV"] + [f"{s.state_bytes // s.kv_token_bytes:,}" for s in shapes.values()],
         ["all states = tokens of all KV"] + [f"{s.fixed_bytes // s.kv_bytes_per_token:,}" for s in shapes.values()]]
show_table(rows, ["per device", *shapes], title="One request's memory, by kind")

# %% [markdown]
# On one TP4 device one KDA state is as large as the KV of 455 tokens of one MLA layer,
# and a request's states weigh as much as 1,346 tokens of all its KV (under DP-attention
# 1,820 and 5,384). A paged KV cache wants small pages (a 16-token block of one MLA layer
# is 18 KiB); a state wants half a megabyte to 2 MiB. One page size is wrong for one of them.
#
# ## The pool
#
# <a id="term-page"></a>`PagePool` is one numpy byte array (the *arena*) cut into `n_pages`
# **pages** of `page_bytes` each. An **allocation** is a set of pages of one *kind*.
#
# <a id="term-reference-count"></a>Each allocation carries a **reference count**: `share`
# adds a handle to the same pages (prefix sharing in chapter 5 builds on it), `free` drops
# one, and the pages go back when the last handle is freed. A small pool of 16 pages:

# %%
pool = PagePool(16, 4096, name="demo")
a = pool.allocate("kv", 3)
b = pool.allocate_bytes("kda_state", 9000)  # 3 pages, 3,288 bytes of them unused
c = pool.share(a)  # a second handle to a's pages
print(a, "\n", b, sep="")
s = pool.stats()
print(wrap(f"free {s.n_free}/{s.n_pages}, pages by kind {s.pages_by_kind}, waste {s.waste_bytes} B"))
pool.free(a)
print("after freeing one of two handles, a's pages are still held:", pool.n_free, "free")
try:
    pool.allocate("scratch", 11)
except PoolExhausted as err:
    print(wrap(f"PoolExhausted: {err}"))
print("unchanged after the failed call:", pool.n_free, "free")
try:
    pool.free(a)
except ValueError as err:
    print(wrap(f"{type(err).__name__}: {err}"))
pool.free(c), pool.free(b)
pool.check_invariants()
print("all freed:", pool.n_free == pool.n_pages)

# %% [markdown]
# Exhaustion says what was asked, what is free and who holds the rest, and changes
# nothing; a second `free` is refused. `tests/test_pool.py` drives random allocate /
# share / free / exhaust sequences and checks after every step that no page leaked or is
# owned twice. The deep dive lists `allocate` and the free-page stack behind it, which
# makes taking n pages cost O(n), never a scan of the pool.
#
# ### Deep dive: `allocate` and the free-page stack
#
# `allocate` checks its arguments, takes the pages and wraps them in a handle:

# %%
show_source(PagePool.allocate)

# %% [markdown]
# Free pages sit on a stack; taking n of them pops n entries:

# %%
show_source(PagePool._take_pages)

# %% [markdown]
# ## The model on pool pages
#
# <a id="term-block-table"></a>`PagedHybridCache` implements the chapter-3 cache protocol
# on a pool. Each global layer keeps a **block table**: a list of allocations of
# `block_tokens` tokens each; token t lives in block t // block_tokens. Each KDA layer's
# state and conv state are allocations of their own. Writes go straight into the arena;
# `kv(i)` gathers the layer's blocks in order, as a paged-attention kernel reads through
# the block table.

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
print(wrap(paged))
reserved = paged.reserved_bytes_by_kind()
print("pages reserved by kind:", {k: v // arena.page_bytes for k, v in reserved.items()})
paged.free()
print("after free():", arena.n_free, "of", arena.n_pages, "pages free")

# %% [markdown]
# Identical to the last bit: the paged cache is a storage layout, not an approximation.
# (With 4 KiB pages a 16-token `tiny` KV block is 8 pages, a 32 KiB KDA state 8 pages,
# and a 9 KiB conv state 3 pages, wasting 3 KiB.) In the deep dive five requests come and
# go on one arena: freed pages of any kind serve the next request of any kind, and a
# request that does not fit is refused before it computes anything.
#
# ### Deep dive: watching the pool as requests come and go
#
# Five requests arrive, decode and leave on one 512-page arena. After each event we take
# the pool's page map (the kind of every page).

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
    print(wrap(f"E (400 tokens) refused: {err}"))
snap("E (400) does not fit; the pool is unchanged")
for name, cache in live.items():
    print(f"{name}: {cache.seq_len:3d} tokens on {cache.n_pages:3d} pages")

# %%
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from kimilab.config import PAGE_KINDS

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

# %% [markdown]
# ## Four ways to size pages
#
# <a id="term-page-layout"></a>A **page layout** says which pools exist, how big their
# pages are, and how a request's objects map to pages. Four layouts, each a small object
# in `kimilab.pool.layouts`:
#
# - **unified** (`UnifiedPages`, this chapter): one pool of small pages (one 16-token KV
#   block of one layer); a state spans as many pages as it needs, scattered anywhere.
# - **vLLM-style padded** (`VllmPaddedPages`, [vllm](references.md#vllm)): one pool of
#   equal pages. The attention block grows until one layer's page holds one KDA layer's
#   states; the state page is padded up to it; layers go in equal-size groups.
# - **Jenga-style LCM** (`JengaPages`): large pages of the least common multiple of the
#   KV page and the state page, each large page carved into small pages of one kind.
# - **split pools** (`SplitPools`, SGLang-style): a KV pool plus a separate state pool with
#   one slot per request; the state pool gets r / (1 + r) of the memory, r being SGLang's
#   `--mamba-full-memory-ratio` (default 0.9).
#
# <a id="term-internal-waste"></a>A layout's **internal waste** for one request is the
# bytes it reserves minus the bytes it uses: page rounding, the unfilled tail of the last
# KV block, state padding. For the 48B model on one TP4 device:

# %%
layouts = {"unified": UnifiedPages(), "vllm-padded": VllmPaddedPages(), "jenga": JengaPages(),
           "split": SplitPools(0.9)}
rows = []
for key, layout in layouts.items():
    pages = ", ".join(f"{pool} {size(n)}" for pool, n in layout.page_bytes(s48).items())
    waste = [layout.footprint(s48, n) for n in (100, 32768)]
    rows.append([key, pages, layout.block_tokens(s48), *(f"{size(f.waste_bytes)} {f.waste_fraction:5.1%}" for f in waste)])
show_table(rows, ["layout", "page", "KV block", "waste, 100 tok", "waste, 32,768 tok"],
           title="Kimi-Linear-48B, one TP4 device: pages, KV block (tokens), internal waste per request")

# %% [markdown]
# vLLM's padding is the large one: 3.65 MiB (24.7%) for a 100-token request, still
# 1.3% at 32,768 tokens, where the others waste well under 1%. The split pools' cost is
# elsewhere (memory stranded in the pool that is not the bottleneck), and so is Jenga's
# (large pages half used by one kind are unusable by the other): only serving a workload
# shows those. The deep dive derives vLLM's layout: 480-token blocks, 20 KDA layers in
# three groups of 7 (21 pages of states), and padding from 740.00 KiB to 4.41 MiB per
# request over all lengths, while the unified pool never wastes more than 318.12 KiB.
#
# ### Deep dive: vLLM's layout step by step, and the padding per request at every length
#
# `VllmPaddedPages().pages` is `costs.vllm_hybrid_pages` (chapter 3), in two steps. *Per
# layer*, the attention block grows in multiples of 16 tokens until one MLA layer's page
# holds one KDA layer's state + conv state, and the state page is padded up to it
# (`HybridAttentionMambaModelConfig.verify_and_update_config` in
# `vllm/model_executor/models/config.py`). *Per group*, layers are grouped by type into
# groups of one size, the last group of a type padded with empty layer slots, and a block
# id names one page in every layer of its group (`_get_kv_cache_groups_uniform_page_size`
# in `vllm/v1/core/kv_cache_utils.py`). So a KV block costs a page in each of the 7 MLA
# layers, and a request's states cost one block in each KDA group, padded slot included.
# Every layout on every model of this chapter:

# %%
from IPython.display import display

rows = []
for name, s in shapes.items():
    for key, layout in layouts.items():
        pages = ", ".join(f"{pool}={n:,} B" for pool, n in layout.page_bytes(s).items())
        rows.append([name, key, pages, layout.block_tokens(s), layout.kv_block_pages(s)])
display(show_table(rows, ["model", "layout", "pages", "KV block (tokens)", "pages per KV block"],
                   title="Page layouts (vLLM: one page = one block id across a group of layers)"))
print(f"per layer: {vp.block_tokens:,}-token blocks (a multiple of {vp.align_tokens}), page {vp.page_bytes:,} B;")
print(f"  a {vp.state_bytes:,} B state page padded by {vp.state_padding_bytes:,} B")
print(f"groups of {vp.group_size}: {vp.attn_groups} MLA group, {vp.kda_groups} KDA groups for {vp.n_kda_layers} "
      f"KDA layers ({vp.kda_padded_slots} padded slot);")
print(f"  one block id = {vp.group_size} pages = {size(vp.block_bytes)}")
print(f"a request's states: {vp.checkpoint_blocks} blocks = {vp.checkpoint_blocks * vp.group_size} pages = "
      f"{size(vp.checkpoint_page_bytes)} for {size(vp.checkpoint_bytes)} of states:")
print(f"  {size(vp.checkpoint_padding_bytes)} padding, {size(vp.kda_padded_slots * vp.page_bytes)} of it the padded slot")
print(f"without layer groups it would be {vp.n_kda_layers} pages and "
      f"{size(vp.n_kda_layers * vp.state_padding_bytes)} of padding")
vpd = VllmPaddedPages().pages(shapes["48B, DP device"])
print(f"under DP-attention: {vpd.block_tokens:,}-token blocks, page {vpd.page_bytes:,} B = {size(vpd.page_bytes)}")
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
# chapter keeps the cited 16-token layout. The waste per request, by model and length:

# %%
contexts = [1, 100, 1000, 32768]
rows = []
for name, s in shapes.items():
    for key, layout in layouts.items():
        fps = [layout.footprint(s, n) for n in contexts]
        rows.append([name.replace(", ", " ").replace(" device", ""), key,
                     *(f"{size(fp.waste_bytes)} {100 * fp.waste_fraction:4.1f}%" for fp in fps)])
show_table(rows, ["model", "layout", *(f"{n:,} tok" for n in contexts)],
           title="Internal waste per request (bytes and share of what it reserves)")

# %% [markdown]
# Under DP-attention vLLM's padded layout needs 1,888-token attention blocks to match a
# 2.07 MiB state page, so a short chat reserves a whole 1,888-token block on every MLA
# layer and its states take 21 pages for 20 layers: a 100-token request pads 15.90 MiB,
# 27.4% of what it reserves, and even a 32,768-token one pads 3.8%. (For `tiny` the
# default unified page, one 16-token block = 32 KiB, is larger than a 9 KiB conv state,
# so tiny's unified waste is high; the 4 KiB arena above avoids that, and an open exercise
# is about page size.) Over all lengths on one TP4 device:

# %%
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
print(f"one TP4 device: vLLM-style waste {size(int(wv.min()))} to {size(int(wv.max()))} per request")
print(f"  (the states' padding alone {size(vp.checkpoint_padding_bytes)}); unified at most {size(unified_worst)}")

# %% [markdown]
# vLLM-style padding never falls below the states' 740.00 KiB (dotted): at a multiple of
# 480 tokens the KV blocks are full, but the states still pad, most of it the padded
# layer slot. Jenga (dashed) and split pools waste the same per request (the tail of the
# last 16-token block) and nothing at block boundaries.
#
# ## The experiment: one mixed workload, five layouts, one device's memory
#
# The budget is what one TP4 device really has for its caches (`costs.cache_budget_bytes`:
# 90% of its HBM minus its quarter of the weights and an activation reserve). Short chats
# do not fill it; long context does. `mixed_workload` draws a deterministic stream over
# 60 s of simulated time: chats all along (60 per second, prompts log-normal around 8k
# tokens) and, between 20 s and 40 s only, long documents (4 per second, 64k-512k
# tokens). vLLM's layout keeps its 480-token blocks; the others use 64-token blocks, the
# alignment vLLM's MLA kernels need.
#
# `kimilab.sim.simulate`, given a `memory=` budget, serves the stream with the real
# `PagePool` allocators in accounting-only mode. Each step it admits queued requests
# first come, first served while their prompt fits, then every running request makes one
# token.
#
# <a id="term-preemption"></a>A request that needs a new KV block and finds none causes a
# **preemption**: the newest running request goes back to the head of the queue and is
# recomputed later (vLLM's recompute preemption).
#
# <a id="term-utilisation"></a>Two more measures: **utilisation**, the bytes that really
# hold cache over the budget while anything runs, and <a id="term-makespan"></a>
# **makespan**, the time the last request finishes. Padding is bytes held but holding
# nothing; wait is the mean time from arrival to first admission. The simulations ran
# once, in the Key results cell:

# %%
rows = []
for name, res in runs.items():
    s = res.summary()
    rows.append([name, s["mean_running"], int(s["peak_running"]), 100 * s["mean_utilisation"],
                 s["mean_padding_MiB"], int(s["preemptions"]), int(s["refused"]), s["makespan_s"],
                 s["mean_wait_s"], running["unified"] / s["mean_running"]])
show_table(rows, ["layout", "running", "peak", "util %", "pad MiB", "preempt", "refused", "makespan s", "wait s",
                  "unified/x"], formats={c: ".1f" for c in ("running", "util %", "pad MiB", "makespan s", "wait s")}
           | {"unified/x": ".3f"}, title=f"{len(requests):,} requests, one {DEP.name} device, "
           f"{BUDGET / 1e9:.1f} GB for caches; running = mean at once")

# %%
def line_style(name):  # the house colour per layout; split ratios as shades of its orange, own dashes
    if not name.startswith("split"):
        return {**plots.style_of(name), "lw": 1.8}
    r = float(name.split("=")[1])
    return {"color": {0.9: "#E69F00", 0.2: "#5C3D00"}[r], "ls": {0.9: "-.", 0.2: "--"}[r], "lw": 1.4,
            "label": f"{plots.label('split')}, state:KV = {r}"}


def smooth(y):  # a 0.5 s moving average, for readability
    return np.convolve(y, np.ones(25) / 25, mode="same")


fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8.0, 6.6), sharex=True)
for name, res in runs.items():
    ax1.plot(res.time_ms / 1000, smooth(res.running), **line_style(name))
    ax2.plot(res.time_ms / 1000, 100 * smooth(res.utilisation), **line_style(name))
for ax in (ax1, ax2):
    ax.axvspan(20, 40, color="#DDDDDD", alpha=0.5, lw=0)
    ax.set_xlim(0, 150)
ax1.text(30, 40, "documents arrive", ha="center", fontsize=9)
ax1.set(ylabel="requests running at once",
        title=f"Kimi-Linear-48B on one {DEP.name} device, {BUDGET / 1e9:.1f} GB for caches, one mixed workload")
ax2.set(ylabel="budget holding cache bytes (%)", xlabel="simulated time (s)")
fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.07))
fig.tight_layout(rect=(0, 0.05, 1, 1))
plots.save(fig, "ch04-admission-timeline")
plt.show()

# %% [markdown]
# **Verdict on one TP4 device's cache budget.** One pool wins, however its pages are cut:
# unified, vLLM-style and Jenga run the same requests (506.7 on average; the unified line
# hides under the others), because states are a small share of a request's bytes. The
# fixed split loses: SGLang's default ratio gives the states 47.4% of the memory while the
# long requests need KV, the queue grows (a 29.7 s mean wait), the workload ends at
# 142.2 s instead of 93.7 s, and one pool runs 1.517x as many requests. A split tuned to
# this traffic (0.2) comes close (1.064x), but its ratio must be chosen in advance.
#
# The verdict holds across deployments (second deep dive): on TP4, TP8 and DP-attention
# devices, three seeds each, prefill charged, one pool runs 1.27-1.42 times as many
# requests as the default split, and the unified pool is within 1% of the best other
# layout (0.994 to 0.999). The first deep dive shows the workload, the admission step,
# and each layout's phases.
#
# ### Deep dive: the workload, admission, and what each layout held
#
# The workload, and what one request holds on one device:

# %%
chats = [r for r in requests if r.kind == "chat"]
docs = [r for r in requests if r.kind == "document"]
print(f"{len(requests)} requests: {len(chats)} chats, {len(docs)} documents; "
      f"budget {BUDGET / 1e9:.1f} GB per device of {DEP.name}")
print(f"chat prompt tokens: median {int(np.median([r.input_length for r in chats])):,d}; "
      f"documents: median {int(np.median([r.input_length for r in docs])):,d}, "
      f"max {max(r.input_length for r in docs):,d}")
print(f"on one device: a 1,000-token chat holds {size(s48.request_bytes(1000))}, "
      f"a 50,000-token document {size(s48.request_bytes(50_000))}")
print(f"  ({size(50_000 * s48.kv_bytes_per_token)} of it KV)")

# %% [markdown]
# The admission step of `RequestAllocator` (all of a request's states and its prompt's
# KV blocks, or nothing):

# %%
show_source(RequestAllocator.admit)

# %%
PHASES = {"chats 0-20 s": (0, 20_000), "docs 20-40 s": (20_000, 40_000), "chats 40-60 s": (40_000, 60_000)}
state_share = np.mean([s48.fixed_bytes / s48.request_bytes(r.input_length + r.output_length) for r in requests])
print(f"states' share of a request's bytes at full length, mean over requests: {state_share:.1%}")
print(f"SGLang's default split gives them {0.9 / 1.9:.1%} of the memory")
show_table([[name, *res.phase_means(PHASES).values()] for name, res in runs.items()], ["layout", *PHASES],
           formats={p: ".1f" for p in PHASES}, title="Mean requests running, by phase")

# %%
from matplotlib.patches import Patch

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
# States are 14.6% of a request's bytes on average, against the 47.4% SGLang's default
# split reserves for them. Padding is where Jenga's large pages show (5092.8 MiB held but
# empty on average: large pages of one kind partly used), yet at this budget it costs no
# requests; makespan is where the split pools lose.
#
# ### Deep dive: one operating point proves nothing, so sweep deployments and seeds
#
# Everything above is one point: one deployment, one load, one seed, and prefill that
# costs no time. Now the same comparison on every named deployment's device: TP4 and TP8
# (tensor parallelism shrinks the states per device, not the latent), and DP-attention
# (whole requests per device, states four times larger than at TP4), each with its own
# budget, over three seeds, with prefill charged in time: a request admitted with T
# tokens, or re-admitted after a preemption to recompute them, holds its memory for
# ceil(T / 8,192) steps before its first token (the deployment's `max_batched_tokens`, as
# one chunk per step). To stay within the chapter's time the sweep's workload lasts 30 s,
# documents between 10 and 20 s, and the 36 simulations run on the machine's cores
# (`sim.simulate_many`).

# %%
from kimilab.sim import simulate_many

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
print(f"{len(jobs)} simulations")


def over_seeds(dep, name, value):
    return np.array([value(sweep[dep.name, seed, name]) for seed in SEEDS])


rows = [[dep.name, costs.cache_budget_bytes(kimi_linear_48b, dep) / 1e9, name,
         over_seeds(dep, name, lambda r: r.summary()["mean_running"]).mean(),
         over_seeds(dep, name, lambda r: r.makespan_ms / 1000).mean(),
         over_seeds(dep, name, lambda r: r.preemptions).mean(),
         over_seeds(dep, name, lambda r: r.preempted_tokens).mean()]
        for dep in SWEEP_DEPS for name in SWEEP_LAYOUTS]
show_table(rows, ["deployment", "budget GB", "layout", "mean running", "makespan s", "preempted", "recomputed tokens"],
           formats={"budget GB": ".1f", "mean running": ".1f", "makespan s": ".1f", "preempted": ".1f",
                    "recomputed tokens": ",.0f"}, title=f"Means over {len(SEEDS)} seeds, prefill charged")

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
rows = []
for dep in SWEEP_DEPS:
    mean = {name: over_seeds(dep, name, lambda r: r.summary()["mean_running"]).mean() for name in SWEEP_LAYOUTS}
    best_other = max((n for n in mean if n != "unified"), key=mean.get)
    rows.append([dep.name, best_other, mean["unified"] / mean[best_other], mean["unified"] / mean["split r=0.9"]])
show_table(rows, ["deployment", "best other", "unified / best other", "unified / split r=0.9"],
           formats={"unified / best other": ".3f", "unified / split r=0.9": ".3f"}, title="Mean requests running, ratios")

# %% [markdown]
# One pool, cut any of the three ways, runs the same number of requests within 3% on
# every deployment (under DP-attention vLLM's padding is four times larger and costs it
# 3%: 366.2 against 377.2), and 1.27-1.42 times as many as SGLang's default split.
# Charged for prefill, the split pools preempt most (28.0 per run at TP4 against 15.7)
# and recompute the most tokens. The first edition of this chapter found the unified pool
# 3.0-4.6% ahead of Jenga at a 2-8 GiB budget; at a real device's budget that lead is
# gone, and what remains is the cost of splitting memory by kind in advance.
#
# ## What the unified pool costs
#
# Indirection: states and KV are gathered through page lists before a kernel uses them
# (on a GPU, vLLM's paged attention reads through block tables). The deep dive times a
# tiny-model decode step on this CPU, paged against contiguous: the gather is small.
#
# ### Deep dive: paged against contiguous decode, CPU wall clock
#
# Wall clock, varies by machine:

# %%
# NBVAL_IGNORE_OUTPUT
from kimilab.timing import best_seconds


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
# For the tiny model the gather is small beside the rest of a decode step:
# `bench/bench_pool.py` measured paged/contiguous between 1.0x and 1.6x at 64-2,048
# tokens across runs (CPU wall clock on a shared 2-core machine, so noisy). The pool
# itself is cheap: allocation pops pages off a stack, independent of the pool's size.

# %% [markdown]
# ## Summary
#
# - **Built:** one arena of small pages with typed, reference-counted allocations for KV,
#   KDA states and conv states; the tiny model runs on it with bit-identical logits.
# - **Sizes:** on one TP4 device one KDA state equals 455 tokens of one MLA layer's KV
#   (1,820 under DP-attention): tensor parallelism splits the states, not MLA's latent.
# - **Padding:** vLLM-style equal pages waste 740.00 KiB to 4.41 MiB per request on a TP4
#   device; the unified pool at most 318.12 KiB.
# - **Serving:** on a 98.9 GB TP4 cache budget the three one-pool layouts run 506.7
#   requests at once, SGLang's default split 334.1 (1.517x); across deployments and seeds
#   one pool leads the default split by 1.27-1.42x. The price is indirection.
#
# **Next chapter:** when many requests share a prompt's beginning, how much of its
# prefill can a cache of shared KV pages skip, and why does a KV hit alone save nothing
# for a hybrid model?

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
# **4.2 Half the devices (predict, then run).** Serve Kimi-Linear-48B with the TP4
# recipe's settings on two devices (TP2). First write down a prediction: is vLLM's block
# on one TP2 device larger or smaller than the TP4 device's 480 tokens, and by about what
# factor? Then compute the block size (tokens) at the default 16-token alignment.

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
# **4.4 Short chats (predict, then run).** Give the same TP4 device's whole cache budget
# to the unified pool and then to vLLM's padded layout (`VllmPaddedPages()`). First
# predict from the waste table: roughly how many times as many requests of **300 tokens**
# does the unified pool hold? Then compute how many more it holds at once.

# %% tags=["solution"]
fits = {}
for name, layout in (("unified", UnifiedPages()), ("vllm-padded", VllmPaddedPages())):
    page = layout.page_bytes(s48)["main"]
    fits[name] = (int(costs.cache_budget_bytes(kimi_linear_48b, DEP)) // page) // (layout.footprint(s48, 300).reserved_bytes // page)
answer = fits["unified"] - fits["vllm-padded"]  # a 300-token chat still takes a whole 480-token block per MLA layer

# %%
verify("4.4", answer)

# %% [markdown]
# **4.5 (open, ~45 min) The best split ratio.** Find the split ratio r that maximises the
# mean number of running requests on this chapter's workload (try
# `np.linspace(0.05, 0.5, 7)` with `SplitPools(r, 64)`). Then make the workload short
# chats only (`chat_prompt_median=700`, `doc_rate_per_s=0`, and a rate that fills the
# device) and search again. How far apart are the two best ratios, and how close does
# each get to the unified pool?
#
# **4.6 (open, ~45 min) Page size and alignment.** (a) Run
# `VllmPaddedPages(align_tokens=...)` with 1, 16 and 64 and compare the padding per
# 100-token request. Why can alignment not remove the padding, and which part of it does
# no alignment touch? (b) Give the unified pool larger pages
# (`UnifiedPages(page_bytes_=..., block_tokens_=...)`, e.g. one 2,174,976-byte vLLM page
# holding 1,888 tokens). Which kind of request loses, and by how much?
