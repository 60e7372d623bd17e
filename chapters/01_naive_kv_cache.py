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
# # 1. The naive KV cache
#
# **What you'll build.** Full causal softmax attention in numpy, a contiguous
# append-only *KV cache*, and a two-layer toy decoder that generates one token at a
# time with the cache and without it.
#
# **What you'll learn.**
# - Why decoding with a cache gives *exactly* the same outputs as recomputing the
#   whole prefix, and how much work it saves.
# - How many bytes a KV cache costs per token for real model shapes: Kimi-Linear-48B's
#   seven MLA layers, an all-MLA 27-layer baseline, and a GQA 8B-class model.
# - Why, at long context, the cache and not the weights decides how many requests a
#   GPU can serve, and how fast.
#
# **What you'll need.** numpy and the idea of softmax attention. Everything runs on a
# CPU in a few seconds. The small model here is random and untrained: the mechanisms
# are exact, the numbers it produces mean nothing as language.
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

from kimilab import costs, plots
from kimilab.config import all_mla_27, gqa_8b, kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.notebook import key_results, show_source, show_table
from kimilab.ops.attention import (KVCache, causal_attention, decode_flops, decode_step,
                                   reference_causal_attention)
from kimilab.timing import best_seconds

plots.use_style()
rng = np.random.default_rng(0)

# %%
# Key results (each number is computed here and derived step by step below)
one, node, M = costs.ONE_H200, costs.DEFAULT_DEPLOYMENT, 2**20  # M: a 1M-token context
toy_shape = dict(n_heads=4, head_dim=16, n_kv_heads=2, d_model=64, n_layers=2)  # the toy built below
flop_saving = decode_flops(M, cached=False, **toy_shape) / decode_flops(M, cached=True, **toy_shape)
hy_b, mla_b, gqa_b = (costs.kv_bytes_per_token(cfg, one) for cfg in (kimi_linear_48b, all_mla_27, gqa_8b))
gqa_1m = costs.request_bytes(gqa_8b, one, M)["kv"]
key_results(
    f"Decoding with a KV cache equals recomputing the prefix, with {flop_saving:,.0f}x fewer FLOPs per token "
    f"at {M:,} tokens in the toy decoder (~L instead of ~L²).",
    f"Per token Kimi-Linear-48B's {len(kimi_linear_48b.attn_layers)} MLA layers cache {hy_b:,} B, "
    f"{hy_b / mla_b:.0%} of all-MLA's {mla_b:,} B; a GQA 8B-class model caches {gqa_b:,} B.",
    f"At 1M tokens one GQA-8B request's cache is {gqa_1m / 1e9:.0f} GB, "
    f"{gqa_1m / costs.device_weight_bytes(gqa_8b, one):.1f}x its weights and over the "
    f"{costs.cache_budget_bytes(gqa_8b, one) / 1e9:.0f} GB an H200 has left for caches.",
    f"On vLLM's {node.n_devices}-H200 recipe {costs.max_batch(kimi_linear_48b, node, 8192):,} hybrid requests "
    f"of 8k tokens fit, only {costs.max_batch(kimi_linear_48b, node, M)} of 1M: the cache sets the batch.",
)

# %% [markdown]
# ## Attention, the last T of L positions
#
# One attention head turns each query vector into a weighted average of value vectors;
# the weights are a softmax over the query's dot products with the keys. *Causal* means
# position t only sees keys 0..t.
#
# `causal_attention(q, k, v)` takes queries `q [T, H, D]`, keys `k [L, Hkv, D]` and
# values `v [L, Hkv, Dv]`; the T queries are the **last** T of the L positions. Two
# cases matter for serving:
#
# - <a id="term-prefill"></a>**prefill**: `T == L`, every position of the prompt at once;
# - <a id="term-decode"></a>**decode**: `T == 1`, one new token looking back at everything
#   before it.
#
# <a id="term-gqa"></a>**Grouped-query attention (GQA)** lets `H` query heads share `Hkv < H`
# key/value heads (each KV head serves `H // Hkv` consecutive query heads), which shrinks
# what must be stored. The softmax subtracts each row's maximum before `exp`, so large
# scores cannot overflow.

# %%
show_source(causal_attention)

# %% [markdown]
# The vectorised version must agree with its slow twin, which loops over queries and
# heads one at a time. We check a GQA shape (6 query heads sharing 2 KV heads) for
# prefill, for a block of late queries and for one decode query.

# %%
L, H, Hkv, D = 40, 6, 2, 8
q, k, v = rng.standard_normal((L, H, D)), rng.standard_normal((L, Hkv, D)), rng.standard_normal((L, Hkv, D))
for T in (L, 7, 1):
    fast = causal_attention(q[L - T:], k, v, query_block=16)
    slow = reference_causal_attention(q[L - T:], k, v)
    print(f"T={T} of L={L}: output {fast.shape}, max |fast - slow| < 1e-10: {np.abs(fast - slow).max() < 1e-10}")

# %% [markdown]
# ## Decoding without a cache, and with one
#
# A decoder generates token t+1 from the hidden states of tokens 0..t. Without a cache,
# every step runs the whole prefix through every layer again, because layer 2's keys at
# position 3 depend on layer 1's output at position 3, and so on up the stack.
#
# <a id="term-kv-cache"></a>A **KV cache** keeps each layer's keys and values from earlier
# steps. A decode step then projects only the new token, appends its key and value, and
# attends its one query over the cache.
#
# <a id="term-append-only"></a>Nothing already stored ever changes: the cache is
# **append-only**. This is what lets serving engines page, share and truncate it freely
# (chapters 4 and 5). `decode_step` checks its inputs first, so a bad call leaves the
# cache unchanged, then appends and attends:

# %%
show_source(decode_step)

# %% [markdown]
# A toy decoder makes the comparison concrete: two attention layers with residual
# connections (no MLP, no norms, random weights), model width 64, 4 query heads sharing
# 2 KV heads of dimension 16. `forward_no_cache` recomputes every position;
# `decode_with_cache` feeds one token through, layer by layer, with one `KVCache` per
# layer.

# %%
D_MODEL, N_HEADS, N_KV_HEADS, HEAD_DIM, N_LAYERS = 64, 4, 2, 16, 2


def weight(n_in, n_out):
    return rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)


layers = [dict(wq=weight(D_MODEL, N_HEADS * HEAD_DIM), wk=weight(D_MODEL, N_KV_HEADS * HEAD_DIM),
               wv=weight(D_MODEL, N_KV_HEADS * HEAD_DIM), wo=weight(N_HEADS * HEAD_DIM, D_MODEL))
          for _ in range(N_LAYERS)]


def project(w, h):
    """Queries, keys and values of hidden states h [T, D_MODEL]."""
    T = h.shape[0]
    return ((h @ w["wq"]).reshape(T, N_HEADS, HEAD_DIM),
            (h @ w["wk"]).reshape(T, N_KV_HEADS, HEAD_DIM),
            (h @ w["wv"]).reshape(T, N_KV_HEADS, HEAD_DIM))


def forward_no_cache(x):
    """Every layer over every position: x [T, D_MODEL] -> hidden states [T, D_MODEL]."""
    h = x
    for w in layers:
        q, k, v = project(w, h)
        h = h + causal_attention(q, k, v).reshape(len(h), -1) @ w["wo"]
    return h


def decode_with_cache(x_new, caches):
    """One new token x_new [1, D_MODEL] through every layer, using and extending the caches."""
    h = x_new
    for w, cache in zip(layers, caches):
        q, k, v = project(w, h)
        h = h + decode_step(q, k, v, cache).reshape(1, -1) @ w["wo"]
    return h


def new_caches():
    return [KVCache(N_KV_HEADS, HEAD_DIM) for _ in range(N_LAYERS)]


# %% [markdown]
# **Exactness.** For each length N we decode N tokens with the cache and, at every
# step, also recompute the whole prefix from scratch; the two last-position outputs
# must agree to float64 rounding (we require at most 1e-10).

# %%
held, worst = [], 0.0
for N in (1, 8, 64, 128):
    x = rng.standard_normal((N, D_MODEL))
    caches = new_caches()
    for t in range(N):
        with_cache = decode_with_cache(x[t:t + 1], caches)[0]
        recomputed = forward_no_cache(x[: t + 1])[-1]
        worst = max(worst, float(np.abs(with_cache - recomputed).max()))
    held.append(caches[0].length)
print(f"decoded N = 1, 8, 64, 128 steps; each layer's cache then holds {held} tokens")
print(f"max |cached - recomputed| over every step < 1e-10: {worst < 1e-10}")

# %% [markdown]
# The deep dive below lists `KVCache.append`: it grows its storage by doubling, so a
# thousand single-token appends regrow it only 6 times.
#
# ### Deep dive: how the cache grows
#
# `append` validates the new keys and values, then copies them after the last stored
# token. When the buffers are full it allocates new ones of twice the size (or exactly
# enough, if more is needed) and copies the old tokens over, so appending one token costs
# amortised constant time. `truncate` (used from chapter 7 on) only moves the length back.

# %%
show_source(KVCache.append)

# %%
growth_cache, regrown_at = KVCache(N_KV_HEADS, HEAD_DIM), []  # room for 16 tokens at first
for _ in range(1000):
    before = growth_cache.capacity_nbytes
    growth_cache.append(np.zeros((1, N_KV_HEADS, HEAD_DIM)), np.zeros((1, N_KV_HEADS, HEAD_DIM)))
    if growth_cache.capacity_nbytes != before:
        regrown_at.append(growth_cache.length)
print(f"{growth_cache.length:,} single-token appends regrew the storage {len(regrown_at)} times, "
      f"at lengths {regrown_at}")

# %% [markdown]
# ## What the cache saves: counted work
#
# `decode_flops` counts the multiply-adds (2 FLOPs each) of producing the token at
# position L in our toy, with and without the cache: the q/k/v/output projections and
# the attention scores and mixing over the causal (query, key) pairs. The counts are
# exact integers, the same on every machine.
#
# - With the cache: project 1 token, attend 1 query over L keys. Grows like L.
# - Without: project L tokens, attend all L queries causally (L(L+1)/2 pairs). Grows
#   like L².

# %%
toy = dict(n_heads=N_HEADS, head_dim=HEAD_DIM, n_kv_heads=N_KV_HEADS, d_model=D_MODEL, n_layers=N_LAYERS)
assert toy == toy_shape  # the shape the key results used
contexts = 2 ** np.arange(4, 21)  # 16 ... 1M tokens
flops_cached = np.array([decode_flops(int(n), cached=True, **toy) for n in contexts], dtype=float)
flops_nocache = np.array([decode_flops(int(n), cached=False, **toy) for n in contexts], dtype=float)
fig, ax = plt.subplots()
ax.loglog(contexts, flops_nocache, marker="o", **plots.style_of("no-cache"))
ax.loglog(contexts, flops_cached, marker="o", **plots.style_of("kv-cache"))
ax.set_xlabel("context length L (tokens)")
ax.set_ylabel("FLOPs to decode one token (counted)")
ax.set_title("Toy 2-layer decoder: work per decoded token")
ax.legend()
plots.save(fig, "ch01-decode-flops")
plt.show()

# %% [markdown]
# *Takeaway:* without a cache the work per token grows like L² (slope 2 on log axes),
# with one like L (slope 1); at 1M tokens the cache saves a factor of 524,336, 5.7
# orders of magnitude. The deep dive lists the counter and its numbers, and times both
# paths on this CPU: measured times follow the counts only loosely.
#
# ### Deep dive: the FLOP counter, and measured CPU time

# %%
show_source(decode_flops)

# %%
shown = np.isin(contexts, (16, 1024, 65536, 1048576))
show_table([(int(n), c, u, u / c) for n, c, u in zip(contexts[shown], flops_cached[shown], flops_nocache[shown])],
           ["context L", "with cache", "no cache", "saving (x)"],
           formats={"with cache": ".3e", "no cache": ".3e", "saving (x)": ",.1f"},
           title=f"FLOPs to decode one token, toy decoder; at 1M tokens the cache saves "
                 f"10^{np.log10(flops_nocache[-1] / flops_cached[-1]):.1f}")

# %% [markdown]
# The same comparison timed on this CPU (wall-clock numbers, so the cell's output is not
# checked and will differ on your machine). For each context L we first fill the caches
# with L − 1 tokens in one prefill call, then time single decode steps (best of 5); the
# no-cache path times one full forward over L tokens (best of 3). `best_seconds` keeps
# the fastest run, the one least disturbed by other work on the machine.

# %%
# NBVAL_IGNORE_OUTPUT
timed_contexts = [32, 64, 128, 256, 512]
t_cached, t_nocache = [], []
for n in timed_contexts:
    x = rng.standard_normal((n + 8, D_MODEL))
    caches = new_caches()
    h = x[: n - 1]
    for w, cache in zip(layers, caches):  # prefill n - 1 tokens into each layer's cache
        q, k, v = project(w, h)
        h = h + decode_step(q, k, v, cache).reshape(len(h), -1) @ w["wo"]
    step = iter(range(n - 1, n + 8))
    t_cached.append(best_seconds(lambda: decode_with_cache(x[next(step)][None], caches), 5))
    t_nocache.append(best_seconds(lambda: forward_no_cache(x[:n]), 3))

fig, ax = plt.subplots()
ax.loglog(timed_contexts, np.array(t_nocache) * 1e3, marker="o", **plots.style_of("no-cache"))
ax.loglog(timed_contexts, np.array(t_cached) * 1e3, marker="o", **plots.style_of("kv-cache"))
ax.set_xlabel("context length L (tokens)")
ax.set_xscale("log", base=2)
ax.set_xticks(timed_contexts, [str(n) for n in timed_contexts])
ax.minorticks_off()
ax.set_ylabel("time per decoded token (ms, this CPU)")
ax.set_title("Toy 2-layer decoder: measured time per decoded token")
ax.legend()
plots.save(fig, "ch01-decode-time")
plt.show()
show_table([(n, c * 1e3, u * 1e3, u / c) for n, c, u in zip(timed_contexts, t_cached, t_nocache)],
           ["L", "with cache (ms)", "without (ms)", "ratio (x)"],
           formats={"with cache (ms)": ".3f", "without (ms)": ".3f", "ratio (x)": ".1f"},
           title="Measured time per decoded token, this CPU (best of 5 and of 3 runs)")

# %% [markdown]
# *Takeaway:* the cached step is dominated by fixed Python and numpy call overhead
# (nearly flat); the recomputed one grows quickly with L. On a busy machine,
# multithreaded BLAS can add sudden jumps to the no-cache line; the counted FLOPs are the
# stable comparison.

# %% [markdown]
# ## What the cache costs: bytes
#
# The work saved is paid for in memory. Per token, a layer caches a key and a value per
# KV head: `2 × Hkv × D` numbers. `kimilab.costs` counts these bytes for any
# `ModelConfig` without building an array. Every byte it returns is *per device* of a
# named deployment (chapter 3 introduces them), so each call names one.

# %%
show_source(costs.kv_bytes_per_token)

# %% [markdown]
# Now real shapes, cached in bf16 (2 bytes a number); no weights are built. The shapes
# come from the models' published configurations ([references](references.md)); the
# next cell prints them from `kimilab.config`.
#
# <a id="term-mla"></a>**MLA** (multi-head *latent* attention) caches, per token and
# layer, one compressed latent shared by all heads instead of a key and a value per KV
# head.
#
# - **Kimi-Linear-48B-A3B** keeps global attention in 7 of its 27 layers
#   (`full_attn_layers` in its `config.json`, [kimi-config](references.md#kimi-config)).
#   They are MLA layers: a latent (`kv_lora_rank`) plus a decoupled key part
#   (`qk_rope_head_dim`, not rotated by RoPE). Its other 20 layers are KDA layers with a
#   fixed-size state, the subject of chapter 2.
# - **All-MLA 27 layers**: the same shapes with MLA in every layer, the tech report's
#   full-attention baseline.
# - **GQA 8B-class** (Llama-3-8B-like): 32 layers of 8 KV heads, K and V each.
#
# <a id="term-hybrid"></a>**The hybrid.** Every chapter calls Kimi-Linear-48B *the hybrid*:
# three KDA layers for each MLA layer (20 : 7 over 27 layers), the ratio of the Kimi
# Linear tech report (arXiv:2510.26692, §4 and Figure 3, p. 6; [kimi-report](references.md#kimi-report)).
# Here the whole model sits on one H200 (`costs.ONE_H200`), so the bytes per device are
# the model's own; chapter 3 splits models over devices.

# %%
hy = kimi_linear_48b
print(f"{hy.name}: MLA layers (1-based) {[i + 1 for i in hy.attn_layers]} of {hy.n_layers}")
print(f"  per token and layer: a latent of {hy.kv_lora_rank} + a key part of {hy.qk_rope_head_dim} numbers "
      f"for {hy.n_heads} heads")
print(f"{gqa_8b.name}: {gqa_8b.n_layers} layers, {gqa_8b.attn_kv_heads_eff} KV heads of {gqa_8b.attn_head_dim_eff} "
      f"dims; hybrid / all-MLA bytes per token {hy_b / mla_b:.4f} (7/27 = {7 / 27:.4f})")
print(f"hybrid's fixed KDA + conv states (chapter 2): {costs.checkpoint_bytes(hy, one) / 1e6:.1f} MB a request")
show_table([(cfg.name, len(cfg.attn_layers), costs.kv_bytes_per_token_layer(cfg, one), b, b * 2**17 / 1e9,
             b * 2**20 / 1e9) for cfg, b in ((hy, hy_b), (all_mla_27, mla_b), (gqa_8b, gqa_b))],
           ["model", "global layers", "B/token/layer", "B/token", "GB at 128k", "GB at 1M"],
           formats={"GB at 128k": ".2f", "GB at 1M": ".2f"}, title=f"KV cache bytes (bf16) on {one.describe()}")

# %% [markdown]
# The hybrid caches 7/27 ≈ 26% of the all-MLA baseline's KV bytes: the tech report's
# "up to 75% less KV cache" (arXiv:2510.26692, abstract, p. 1;
# [kimi-report](references.md#kimi-report)) comes from the layer count alone. Plotted to
# 1M tokens, beside the weights the model must also hold:

# %%
lengths = np.unique(np.logspace(np.log10(1024), np.log10(2**20), 40).astype(int))
weights_48b, weights_8b = costs.device_weight_bytes(hy, one), costs.device_weight_bytes(gqa_8b, one)
fig, ax = plt.subplots()
for cfg, key in ((gqa_8b, "gqa"), (all_mla_27, "all-mla"), (kimi_linear_48b, "hybrid")):
    ax.loglog(lengths, [costs.request_bytes(cfg, one, int(n))["kv"] / 1e9 for n in lengths], **plots.style_of(key))
for w, style, size in ((weights_48b, "--", "48B"), (weights_8b, ":", "8B")):
    ax.axhline(w / 1e9, linestyle=style, color=plots.color("weights"),
               label=f"{plots.label('weights')}, {size} bf16 ({w / 1e9:.0f} GB)")
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("KV cache of ONE request (GB)")
ax.set_title(f"KV cache bytes vs context (bf16), whole model on one device ({one.name})")
ax.legend(loc="lower right")
plots.save(fig, "ch01-kv-bytes")
plt.show()
print(f"a {gqa_8b.name} request's cache equals its {weights_8b / 1e9:.0f} GB of weights at {weights_8b / gqa_b:,.0f} tokens")
for cfg in (all_mla_27, kimi_linear_48b):
    w = costs.device_weight_bytes(cfg, one)
    print(f"{cfg.name} at 1M tokens: one request's cache = {costs.request_bytes(cfg, one, M)['kv'] / w:.3f} x "
          f"the {w / 1e9:.0f} GB of weights")

# %% [markdown]
# *Takeaway* (whole model on one device): one GQA-8B request passes its model's entire
# 16 GB of weights near 123k tokens; at 1M tokens one all-MLA request needs a third of
# the 48B model's weights (0.340), the hybrid under a tenth (0.088). The deep dive checks
# the byte count against real arrays: equal at 1, 100 and 1,000 tokens.
#
# ### Deep dive: the byte count against real arrays
#
# The runnable `tiny` config on `costs.LOCAL` (this CPU holding the book's reduced model,
# stored in float64): we fill real `KVCache`s and compare their bytes with the count.

# %%
tiny_caches = [KVCache(tiny.attn_kv_heads_eff, tiny.attn_head_dim_eff, dtype=tiny.dtype) for _ in tiny.attn_layers]
rows = []
for n_tokens in (1, 100, 1000):
    for cache in tiny_caches:
        extra = n_tokens - cache.length
        cache.append(rng.standard_normal((extra, cache.n_kv_heads, cache.head_dim)),
                     rng.standard_normal((extra, cache.n_kv_heads, cache.value_dim)))
    measured = sum(cache.nbytes for cache in tiny_caches)
    analytic = costs.request_bytes(tiny, costs.LOCAL, n_tokens)["kv"]
    rows.append((n_tokens, measured, analytic, str(measured == analytic)))
show_table(rows, ["tokens", "measured (B)", "analytic (B)", "equal"],
           title=f"tiny: {len(tiny.attn_layers)} global layers, {tiny.attn_kv_heads_eff} KV heads x "
                 f"{tiny.attn_head_dim_eff} dims, {tiny.dtype}, on {costs.LOCAL.name}")


# %% [markdown]
# ## Why the cache, not the weights, limits long-context serving
#
# Two consequences, computed per device of a named deployment. The 48B models run as
# vLLM's published recipe for Kimi Linear runs them, `costs.DEFAULT_DEPLOYMENT`: tensor
# parallelism over 4 H200s ([vllm-recipe](references.md#vllm-recipe)); the 8B model on
# one H200. Device numbers are data-sheet figures (the deep dive prints them).
#
# 1. **Capacity.** Each device holds its share of the weights and, for every request,
#    its share of that request's cache. The memory left after the weights (and a
#    reserve for a step's activations) divided by one request's cache is the batch that
#    fits. MLA caches one latent shared by all heads, so tensor parallelism cannot
#    split it: every device holds the whole latent of every request
#    ([vllm-mla-tp](references.md#vllm-mla-tp); chapter 3).
# 2. **Bandwidth.** Decoding one token reads the weights it uses (a mixture-of-experts
#    model like Kimi-Linear-48B-A3B activates ~3B of its 48B parameters per token) and
#    the whole cache of its request. At long context the cache is most of the bytes.

# %%
served = ((kimi_linear_48b, node), (all_mla_27, node), (gqa_8b, one))


def cache_share_read(cfg, dep, n):
    """The cache's share of the bytes one device reads to decode one token of an n-token request."""
    work = costs.step_work(cfg, dep, decode=(1, n))
    return work.cache_bytes / (work.cache_bytes + work.weight_bytes)


show_table([(cfg.name, dep.name, costs.max_batch(cfg, dep, 8192), costs.max_batch(cfg, dep, M),
             cache_share_read(cfg, dep, M)) for cfg, dep in served],
           ["model", "deployment", "fit at 8k", "fit at 1M", "cache share read at 1M"],
           formats={"cache share read at 1M": ".1%"},
           title="Requests that fit; the cache's share of the bytes read per decoded token (batch 1)")

# %% [markdown]
# At 8k tokens the 4-device instance holds hundreds of requests (1,285 of the hybrid's,
# 388 all-MLA). At 1M tokens it fits only a handful, since every device stores the whole
# MLA latent of every request, and one H200 cannot hold even one GQA-8B request: its
# 137 GB cache is 8.6x the model and more than the 107 GB the device has left for
# caches. Decoding one 1M-token request, most of the bytes a device reads per token are
# cache (the last column).
#
# **Verdict (a byte verdict: it follows from bytes alone, not from timing).** Long
# context needs a smaller cache, not smaller weights. The hybrid keeps only 7 global
# layers; chapter 2 shows what its other 20 layers keep instead, a state whose size never
# grows. The deep dive tabulates 8k, 128k and 1M tokens and finds where the cache's read
# equals the active weights' read: at 48,225 tokens for all-MLA and 186,012 for the
# hybrid on TP4.
#
# ### Deep dive: capacity and bytes read across context lengths
#
# The deployments, their weights per device, and the full sweep.

# %%
for dep in (node, one):
    print(f"deployment: {dep.describe()}")
print(f"48B models on {node.name}: {costs.device_weight_bytes(hy, node) / 1e9:.0f} GB of weights per device")
print(f"  read per token at batch 1: {costs.device_weight_bytes_read(hy, node, 1) / 1e9:.1f} GB per device "
      f"({costs.weight_model(hy).active_params / 1e9:.0f}B active parameters in all)")
print(f"one {gqa_8b.name} request at 1M tokens: {gqa_1m / 1e9:.0f} GB of KV cache = {gqa_1m / weights_8b:.1f} x its "
      f"weights;")
print(f"  the device has {one.device.hbm_bytes / 1e9:.0f} GB, of which "
      f"{costs.cache_budget_bytes(gqa_8b, one) / 1e9:.0f} GB are left for caches")
crossover = {cfg.name: costs.device_weight_bytes_read(cfg, dep, 1) / costs.kv_bytes_per_token(cfg, dep)
             for cfg, dep in served}
print("context at which one request's cache read = the active weights' read (tokens):")
print("  " + ", ".join(f"{k} {v:,.0f}" for k, v in crossover.items()))
rows = [(cfg.name, dep.name, n, costs.max_batch(cfg, dep, n), cache_share_read(cfg, dep, n))
        for cfg, dep in served for n in (8192, 2**17, M)]
show_table(rows, ["model", "deployment", "context", "fit", "cache share read"],
           formats={"cache share read": ".1%"},
           title="Requests that fit and the cache's share of bytes read (batch 1), by context")

# %% [markdown]
# Past the context at which one request's cache read equals the active weights' read per
# device, the cache is most of the bytes a decoded token reads.

# %% [markdown]
# ## Summary
#
# - **Built:** `causal_attention` (GQA by grouping, equal to its loop-by-loop twin), an
#   append-only `KVCache`, and a toy decoder whose cached decoding equals recomputing the
#   prefix (max difference < 1e-10 in float64), with ~L work per token instead of ~L²:
#   5.7 orders of magnitude less at 1M tokens.
# - **Bytes:** per token, layers × (what one layer stores) × bytes per number. On one
#   device, Kimi-Linear-48B's 7 MLA layers store 8,064 B/token, all-MLA 31,104 B (26%:
#   the tech report's "up to 75% less"), GQA-8B 131,072 B.
# - **Verdict (bytes):** at long context the cache outgrows the weights. On vLLM's TP4
#   recipe it sets the batch that fits (1,285 hybrid requests at 8k tokens, 11 at 1M)
#   and most of the bytes each decoded token reads.
#
# **Next chapter:** what do the hybrid's other 20 layers keep instead of a growing cache,
# and does their fixed-size state give the same outputs token by token as chunk by chunk?

# %% [markdown]
# ## Exercises
#
# A checked exercise is three cells: the question, your computation (empty in the
# student edition, `make student`), and `verify("N.M", answer)`, which says "correct" or
# what is off.
#
# **1.1 A deeper model without GQA.** Take `gqa_8b`, deepen it from 32 to 48 layers,
# and give every one of its 32 query heads its own K and V head (plain multi-head
# attention). How many bytes per token would its KV cache take? Compute it by hand
# (layers × 2 × KV heads × head dim × bytes).

# %% tags=["solution"]
answer = 48 * 2 * 32 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16 bytes: 4x GQA's 8 KV heads, 1.5x the layers

# %%
verify("1.1", answer)

# %% [markdown]
# **1.2 A long request.** With the whole model on one device (`costs.ONE_H200`), how
# many bytes does one 32,768-token request's KV cache take under `gqa_8b`?

# %% tags=["solution"]
answer = costs.kv_bytes_per_token(gqa_8b, costs.ONE_H200) * 32_768  # 131,072 B a token

# %%
verify("1.2", answer)

# %% [markdown]
# **1.3 Where the cache equals the weights (predict, then run).** The bytes plot stops at
# 1M tokens. First write down a prediction: does one all-MLA request's KV cache reach all
# of the 48B model's bf16 weights before 1M tokens, or after, and roughly where? Then
# compute it, with the whole model on one device (`costs.ONE_H200`): at what context
# length are the two equal? (Answers within 1% pass.)

# %% tags=["solution"]
answer = (costs.device_weight_bytes(all_mla_27, costs.ONE_H200)
          / costs.kv_bytes_per_token(all_mla_27, costs.ONE_H200))  # 96e9 B / 31,104 B a token

# %%
verify("1.3", answer)

# %% [markdown]
# **1.4 (open, ~45 min)** Time a 4,096-token prefill through `causal_attention` with
# `query_block` 16, 256 and 4,096, and check the outputs stay equal. What limits the
# largest block? (Hint: the score array is H × block × L.)
#
# **1.5 (open, ~1 h)** Add a sliding window to the cache: keep only the last W tokens.
# Which outputs change, and which test in `tests/test_attention.py` would you have to
# rewrite?
#
# **1.6 Eight devices instead of four (predict, then run).** vLLM's recipe also runs the
# model with tensor parallelism over 8 H200s (`costs.VLLM_TP8_H200`). Each device keeps
# 90% of its HBM for the engine, less its share of the weights and a 4 GB activation
# reserve. Predict first: do twice as many all-MLA requests of 131,072 tokens fit as on
# 4 devices? (What does one device hold of each request?) Then compute how many fit.

# %% tags=["solution"]
tp8 = costs.VLLM_TP8_H200
budget = 0.9 * tp8.device.hbm_bytes - costs.device_weight_bytes(all_mla_27, tp8) - 4e9  # per device
per_request = 131_072 * costs.kv_bytes_per_token(all_mla_27, tp8)  # the whole latent: TP cannot split it
answer = int(budget // per_request)

# %%
verify("1.6", answer)
