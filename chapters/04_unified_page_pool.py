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
# computes. Then you will serve one deterministic mixed workload on four memory layouts.
#
# **What you'll learn.**
# - Why a hybrid model makes paging awkward: its three kinds of memory differ in size
#   by orders of magnitude, and one of them grows while the others do not.
# - How the production systems cope ([references](references.md)): vLLM pads every page to one size in one
#   pool, SGLang keeps a separate state pool beside the KV pool, Jenga carves large pages
#   sized to the least common multiple of the page sizes.
# - What each choice costs at Kimi-Linear-48B scale: bytes lost to padding, memory
#   stranded in the wrong pool, and requests that could have run but did not.
#
# **What you'll need.** Chapter 3 (the hybrid model and its cache protocol). numpy and
# matplotlib; the chapter runs in a few seconds.
#
# **Honest scope.** The model is the reduced, untrained `tiny` model; the pool mechanics
# are exact. The serving experiment is *accounting*: it runs the real allocators on the
# real 48B byte sizes but in simulated time (one engine step = one token for every running
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
from kimilab.sim import simulate
from kimilab.timing import best_seconds
from kimilab.traffic import mixed_workload

plots.use_style()
MiB, GiB = 2**20, 2**30


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
# `CacheShapes` reads these sizes off a config. For Kimi-Linear-48B (bf16 KV, fp32 state):

# %%
shapes = {cfg.name: CacheShapes.from_config(cfg) for cfg in (tiny, kimi_linear_48b)}
print(f"{'':28s} {'tiny':>12s} {'kimi_linear_48b':>16s}")
rows = [("KV per token, one layer", lambda s: s.kv_token_bytes),
        ("global layers", lambda s: s.n_attn_layers),
        ("KDA state, one layer", lambda s: s.state_bytes),
        ("conv state, one layer", lambda s: s.conv_bytes),
        ("KDA layers", lambda s: s.n_kda_layers),
        ("fixed states per request", lambda s: s.fixed_bytes),
        ("KV per token, all layers", lambda s: s.kv_bytes_per_token)]
for title, get in rows:
    a, b = get(shapes["tiny"]), get(shapes["kimi_linear_48b"])
    fmt = (lambda n: f"{n:d}") if title.endswith("layers") else size
    print(f"{title:28s} {fmt(a):>12s} {fmt(b):>16s}")
s48 = shapes["kimi_linear_48b"]
print(f"\n48B: one KDA state = {s48.state_bytes // s48.kv_token_bytes:,d} tokens of one MLA layer's KV; "
      f"a request's fixed states = {s48.fixed_bytes // s48.kv_bytes_per_token:,d} tokens of all its KV")

# %% [markdown]
# One KDA state of the 48B model is as large as the KV of 1,820 tokens of one MLA layer,
# and a request's states together weigh as much as 5,384 tokens of KV. A paged KV cache
# wants small pages (a 16-token block of one MLA layer is 18 KiB); a state wants 2 MiB in
# one place. Any single page size is wrong for one of them.
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
# vLLM's layout for the 48B model, step by step (all from `VllmPaddedPages().pages`, which
# is `costs.vllm_hybrid_pages`):

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
# For the states, the layer groups cost far more than the page size: 20 KDA layers fill
# three groups of 7, so every request's states reserve 21 pages, and the empty 21st page
# is 2.07 MiB of padding beside 80 KiB of per-page padding. This is the layout at the
# vLLM commit cited in [vllm](references.md#vllm), which aligns blocks to 16 tokens.
# Versions that serve MLA hybrids align MLA blocks to 64 tokens (vLLM PR #24486; 128 on
# the CUTLASS MLA backend), which for this model gives 1,920-token blocks, 1.7% larger:
# a small change beside the padding above. The chapter keeps the cited 16-token layout.

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
# the unfilled tail of the last KV block, state padding). At 48B scale vLLM's padded
# layout needs 1,888-token attention blocks to match a 2.07 MiB state page, so a short
# chat reserves a whole 1,888-token block on every MLA layer, and its states take 21
# pages for 20 layers: a 100-token request pads 15.9 MiB, 27.4% of what it reserves, and
# even a 32,768-token one pads 3.8%. The unified pool and Jenga waste well under 1%
# at 48B scale. (For `tiny` the default unified page, one 16-token block = 32 KiB, is
# larger than a 9 KiB conv state, so tiny's unified waste is high; the 4 KiB arena above
# avoids that — exercise 4 is about page size.) Split
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
ax.set_title("Kimi-Linear-48B: padding per request by page layout")
ax.legend(fontsize=8, loc="lower left")
plots.save(fig, "ch04-waste-per-request")
plt.show()

# %% [markdown]
# vLLM-style padding costs up to 16.7 MiB per request and never less than 2.15 MiB (dotted):
# at a multiple of 1,888 tokens the KV blocks are full, but the states still pad 2.15 MiB,
# 2.07 MiB of it the padded layer slot. The unified pool never wastes more than 200 KiB.
# Jenga (dashed) and split pools waste the same per request (the tail of the last 16-token
# block) and nothing at block boundaries.
#
# ## The experiment: one mixed workload, four layouts
#
# `mixed_workload` draws a deterministic (seed 0) stream of requests over 60 s of
# simulated time: short chats all along (16 per second, prompts log-normal around 700
# tokens, 32-512 output tokens) and, between 20 s and 40 s only, long documents
# (1 per second, prompts 8k-64k tokens). So the first and last thirds are state-heavy
# (a chat's 41 MiB of states outweigh its KV) and the middle third is KV-heavy.

# %%
requests = mixed_workload(0, chat_rate_per_s=16.0)
chats = [r for r in requests if r.kind == "chat"]
docs = [r for r in requests if r.kind == "document"]
print(f"{len(requests)} requests: {len(chats)} chats, {len(docs)} documents")
print(f"chat prompt tokens: median {int(np.median([r.input_length for r in chats]))}, "
      f"documents: median {int(np.median([r.input_length for r in docs])):,d}, "
      f"max {max(r.input_length for r in docs):,d}")
total = sum(s48.request_bytes(r.input_length + r.output_length) for r in requests)
print(f"states + KV of all requests at full length: {size(total)}")

# %% [markdown]
# The simulation loop (`kimilab.sim.simulate`, given a `memory=` budget) serves it on a **4 GiB** cache budget
# for the 48B shapes. Each step it admits queued requests first come, first served
# while their prompt fits, then every running request makes one token; a request that
# needs a new KV block and finds none preempts the newest running request, which goes
# back to the head of the queue and is recomputed later (vLLM's recompute preemption).
# A request that could not fit even in an empty pool is refused. The pools are the
# real `PagePool` allocators in accounting-only mode (`backed=False`): no 4 GiB array.

# %%
show_source(RequestAllocator.admit)

# %%
BUDGET = 4 * GiB
SPLIT_RATIOS = (0.5, 0.9, 2.0, 4.0)
def serve(layout, label):
    return simulate(requests, memory=RequestAllocator(layout, s48, BUDGET), label=label)


runs = {"unified": serve(UnifiedPages(), "unified"), "vllm-padded": serve(VllmPaddedPages(), "vllm-padded"),
        "jenga": serve(JengaPages(), "jenga")}
for r in SPLIT_RATIOS:
    runs[f"split r={r}"] = serve(SplitPools(r), f"split r={r}")
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

# %% [markdown]
# Columns: mean and peak number of requests running at once; mean utilisation (bytes
# that really hold cache over the budget, while anything runs); mean padding (bytes held
# but holding nothing); preemptions; refusals; the time the last request finished; the
# mean wait from arrival to first admission.

# %%
SPLIT_STYLES = {0.5: ("#F3C969", ":"), 0.9: ("#E69F00", "-."), 2.0: ("#A86F00", "--"), 4.0: ("#5C3D00", "-")}


def line_style(name):
    """The house colour per layout; the split ratios as four shades of its orange, each with its own dash."""
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
    ax.set_xlim(0, 90)
ax1.text(30, 2, "documents arrive", ha="center", fontsize=9)
ax1.set_ylabel("requests running at once")
ax2.set_ylabel("budget holding cache bytes (%)")
ax2.set_xlabel("simulated time (s)")
ax1.set_title("Kimi-Linear-48B, 4 GiB cache budget, one mixed workload")
ax1.set_ylim(0, 90)
fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8,
           bbox_to_anchor=(0.5, -0.07))
fig.tight_layout(rect=(0, 0.05, 1, 1))
plots.save(fig, "ch04-admission-timeline")
plt.show()

# %% [markdown]
# The unified pool (green) holds the most requests on average in every phase and keeps
# the most of the budget holding real cache bytes (near 100% while the queue is full);
# split pools plateau at whatever their state pool allows (the flat orange lines) and
# finish long after the others (split 0.5 and 0.9 run on to 171 s and 122 s, beyond the
# plot). During the document phase every layout dips: a 50k-token document is 400 MiB of
# KV that, under first-come-first-served, blocks the queue behind it.

# %%
names = list(runs)
colors = [line_style(n)["color"] for n in names]
labels = [{"unified": "unified", "vllm-padded": "vLLM\npadded", "jenga": "Jenga"}.get(n, n.replace("split r=", "split\n"))
          for n in names]
fig, axes = plt.subplots(1, 3, figsize=(11.0, 3.8))
metrics = [("mean requests running", [runs[n].summary()["mean_running"] for n in names]),
           ("mean padding held (MiB)", [runs[n].summary()["mean_padding_MiB"] for n in names]),
           ("preemptions", [runs[n].preemptions for n in names])]
for ax, (title, values) in zip(axes, metrics):
    ax.bar(range(len(names)), values, color=colors)
    ax.set_xticks(range(len(names)), labels, fontsize=7)
    ax.set_ylabel(title)
    ax.set_xlabel("layout")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}" if v >= 10 or float(v).is_integer() else f"{v:.1f}",
                ha="center", va="bottom", fontsize=7)
fig.legend(handles=[Patch(color=plots.color(k), label=plots.label(k))
                    for k in ("unified", "vllm-padded", "jenga", "split")],
           loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.06))
fig.suptitle("What each layout did with the same 997 requests (4 GiB, 48B shapes)", fontsize=11)
fig.tight_layout(rect=(0, 0.04, 1, 1))
plots.save(fig, "ch04-admission-summary")
plt.show()

# %% [markdown]
# Padding is where vLLM-style pages lose (581.0 MiB of the 4 GiB held as padding on
# average) and where split pools do not (a few MiB); preemptions are highest where a
# layout packs requests tightly and then runs out of KV blocks mid-decode.

# %%
def best(metric):
    return max(runs, key=metric)


u = runs["unified"].summary()
split_best = max((n for n in runs if n.startswith("split")), key=lambda n: runs[n].summary()["mean_running"])
for name in ("vllm-padded", "jenga", split_best):
    s = runs[name].summary()
    print(f"unified vs {name:12s}: {u['mean_running'] / s['mean_running']:.2f}x the requests running, "
          f"utilisation {100 * u['mean_utilisation']:.1f}% vs {100 * s['mean_utilisation']:.1f}%, "
          f"makespan {u['makespan_s']:.1f} s vs {s['makespan_s']:.1f} s")
for phase in PHASES:
    winner = best(lambda n: runs[n].phase_means({phase: PHASES[phase]})[phase])
    ranked = sorted(runs, key=lambda n: -runs[n].phase_means({phase: PHASES[phase]})[phase])
    print(f"{phase}: most running = {winner}; best split = "
          f"{next(n for n in ranked if n.startswith('split'))}")

# %% [markdown]
# **Which wins where.**
#
# - **Unified pool: best overall.** 63.7 requests running on average (peak 84), 85.5% of
#   the budget holding real cache bytes, the workload done at 82.5 s. It wins every phase
#   because any freed page serves any kind: when documents arrive, chat states' pages
#   become document KV and back.
# - **Jenga-style LCM: close second** (61.5 running, 82.8%). No per-request padding, but
#   its 18.6 MiB large pages are dedicated to one kind at a time; partly used large pages
#   hold 286.8 MiB on average that the other kind cannot use.
# - **vLLM-style padded: loses on short requests** (55.8 running, 74.9%): the 1,888-token
#   blocks and the padded state page pad every chat by up to 16.7 MiB, 581.0 MiB of the
#   budget on average. A 32k-token document pads by 3.8%, so the gap narrows on a
#   document-only workload.
# - **Split pools: only as good as the ratio fits the phase.** The best fixed ratio here
#   (state:KV = 2) reaches 53.6 running; SGLang's default 0.9 holds only 46 state slots and
#   averages 43.1 with a 24 s mean wait. A state-heavy ratio (4.0) ties the unified pool in
#   the chat phase (62.2 vs 62.5) and collapses when documents need KV (45.5), while 0.5
#   is fine for KV and starves chats (30.4). No single ratio is right for both phases.
#
# Nothing was refused: every request fits an empty pool under every layout at 4 GiB.
#
# ## One operating point proves nothing: the sweep
#
# Everything above is one point: 4 GiB, 16 chats per second, one seed, and prefill that
# costs no time — so a preempted request's recomputation was free, and the recomputed
# tokens were invisible. Now sweep the budget (2, 4, 8 GiB) and the chat rate (8 and 16
# per second) over three seeds, with prefill charged in time: a request admitted with T
# tokens — or re-admitted after a preemption, to recompute them — holds its memory for
# ceil(T / 2,048) steps before its first token (2,048 prompt tokens per request per 20 ms
# step is our assumption, of the order a chunked-prefill engine gives one request). To
# stay within the chapter's time the sweep's workload lasts 30 s, documents between 10
# and 20 s.

# %%
SWEEP_LAYOUTS = {"unified": UnifiedPages(), "vllm-padded": VllmPaddedPages(), "jenga": JengaPages(),
                 "split r=0.9": SplitPools(0.9)}
BUDGETS_GIB, RATES, SEEDS, PREFILL = (2, 4, 8), (8.0, 16.0), (0, 1, 2), 2048
sweep = {}
for rate in RATES:
    for seed in SEEDS:
        reqs = mixed_workload(seed, duration_ms=30_000, doc_window_ms=(10_000, 20_000), chat_rate_per_s=rate)
        for gib in BUDGETS_GIB:
            for name, layout in SWEEP_LAYOUTS.items():
                sweep[rate, seed, gib, name] = simulate(reqs, memory=RequestAllocator(layout, s48, gib * GiB),
                                                        prefill_tokens_per_step=PREFILL, label=name)


def over_seeds(rate, gib, name, value):
    return np.array([value(sweep[rate, seed, gib, name]) for seed in SEEDS])


print(f"{'chats/s':>7s} {'budget':>6s} {'layout':<12s} {'mean running':>12s} {'makespan':>9s} "
      f"{'preempted':>9s} {'recomputed tokens':>17s}   (means over {len(SEEDS)} seeds)")
for rate in RATES:
    for gib in BUDGETS_GIB:
        for name in SWEEP_LAYOUTS:
            running = over_seeds(rate, gib, name, lambda r: r.summary()["mean_running"])
            makespan = over_seeds(rate, gib, name, lambda r: r.makespan_ms / 1000)
            preempted = over_seeds(rate, gib, name, lambda r: r.preemptions)
            recomputed = over_seeds(rate, gib, name, lambda r: r.preempted_tokens)
            print(f"{rate:7.0f} {gib:4d} GiB {name:<12s} {running.mean():12.1f} {makespan.mean():8.1f}s "
                  f"{preempted.mean():9.1f} {recomputed.mean():17,.0f}")

# %%
fig, axes = plt.subplots(1, len(RATES), figsize=(10.0, 3.9), sharey=True)
for ax, rate in zip(axes, RATES):
    for name in SWEEP_LAYOUTS:
        runs_at = [over_seeds(rate, gib, name, lambda r: r.summary()["mean_running"]) for gib in BUDGETS_GIB]
        mean = np.array([v.mean() for v in runs_at])
        spread = np.array([[v.mean() - v.min() for v in runs_at], [v.max() - v.mean() for v in runs_at]])
        style = line_style(name) if name.startswith("split") else plots.style_of(name)
        ax.errorbar(BUDGETS_GIB, mean, yerr=spread, marker="o", capsize=3, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(BUDGETS_GIB, [f"{g} GiB" for g in BUDGETS_GIB])
    ax.set_xlabel("cache budget (GiB of 48B KV + states)")
    ax.set_title(f"{rate:.0f} chats per second")
axes[0].set_ylabel("mean requests running at once")
axes[0].legend(fontsize=8)
fig.suptitle("Four layouts over budget and load (3 seeds: mean, bars = min-max; prefill charged)", fontsize=11)
fig.tight_layout()
plots.save(fig, "ch04-layout-sweep")
plt.show()

# %%
for rate in RATES:
    for gib in BUDGETS_GIB:
        mean = {name: over_seeds(rate, gib, name, lambda r: r.summary()["mean_running"]).mean()
                for name in SWEEP_LAYOUTS}
        best_other = max((n for n in mean if n != "unified"), key=mean.get)
        print(f"{rate:4.0f} chats/s, {gib} GiB: unified / best other ({best_other}) = "
              f"{mean['unified'] / mean[best_other]:.3f}")

# %% [markdown]
# The sweep answers "when does the layout matter?". Where memory is ample for the load
# (4 GiB at 8 chats/s, 8 GiB at either rate) every layout holds every request and they
# tie: ratio 1.000. Where memory binds, the ranking of the 4 GiB example holds, but the
# strongest simple rival is close: the unified pool leads Jenga's LCM pages by 3.0-4.6%
# in requests running; vLLM-style padding and, most of all, SGLang-style split pools at
# their default ratio fall further behind (table). The unified pool also packs requests
# most tightly and so preempts the most at 2 GiB, 16 chats/s (19.3 preemptions and
# 19,561 recomputed tokens per run on average, now paid in simulated time) — and still
# finishes first. The one dramatic example above is the upper end of this range, not
# the typical case.
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
#   at 48B scale one KDA layer's state equals 1,820 tokens of one MLA layer's KV.
# - One arena of small fixed pages with typed, reference-counted allocations holds all of
#   it; the tiny model runs on it with bit-identical logits, and freeing returns every page.
# - Per request, vLLM-style padding wastes up to 16.7 MiB (over a quarter of a short chat),
#   2.15 MiB of it on the states alone because 20 KDA layers fill three groups of 7;
#   the unified pool and Jenga waste under 1%; split pools waste nothing per request but
#   strand memory in whichever pool is not the bottleneck.
# - On one deterministic mixed workload at 4 GiB, the unified pool ran 63.7 requests at
#   once on average, Jenga 61.5, vLLM-style 55.8 and the best split ratio 53.6 (SGLang's
#   default ratio 43.1). Swept over budget, load and seeds with prefill charged in time,
#   its lead over Jenga is 3.0-4.6% where memory binds, and every layout ties where it
#   does not.
# - The price is indirection: states and KV are gathered through page lists.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **4.1 Size a pool.** You serve `kimi_linear_48b` with an **8 GiB** cache budget on a
# unified pool whose page is one 16-token MLA block of one layer (`UnifiedPages()`).
# How many requests of **4,096 tokens** each can be resident at once?

# %% tags=["solution"]
layout = UnifiedPages()
page_bytes = layout.page_bytes(s48)["main"]  # 16 x 1,152 B
per_request = layout.footprint(s48, 4096).reserved_bytes // page_bytes  # states (ceil per layer) + 7 x 256 KV
answer = (8 * GiB // page_bytes) // per_request

# %%
verify("4.1", answer)

# %% [markdown]
# **4.2 vLLM at a coarser alignment.** The commit cited rounds the attention block to a
# multiple of 16 tokens; later vLLM versions round MLA blocks to 64. What block size
# (tokens) does vLLM's derivation give for Kimi-Linear-48B at 64-token alignment?

# %% tags=["solution"]
answer = costs.vllm_hybrid_pages(kimi_linear_48b, align_tokens=64).block_tokens

# %%
verify("4.2", answer)

# %% [markdown]
# **4.3 The padding.** At the default alignment, how many bytes of each KDA layer's
# state page does vLLM's layout leave empty?

# %% tags=["solution"]
v16 = costs.vllm_hybrid_pages(kimi_linear_48b)
answer = v16.page_bytes - v16.state_bytes

# %%
verify("4.3", answer)

# %% [markdown]
# **4.4 (open)** Find the split ratio r that maximises the mean number of running
# requests on this workload (try `np.linspace(1, 4, 7)`). Then make the workload
# document-only (`chat_rate_per_s=0`) and search again. How far apart are the two best
# ratios, and how close does each get to the unified pool?
#
# **4.5 (open)** Run `VllmPaddedPages(align_tokens=...)` with 1, 16 and 64 and compare
# the padding per 100-token request. Why can alignment not remove the padding, and which
# part of it does no alignment touch?
#
# **4.6 (open)** Give the unified pool larger pages (`UnifiedPages(page_bytes=...)`, e.g.
# one 2,174,976-byte vLLM page). Which kind of request loses, and by how much?
