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
#   whole prefix, and how much work it saves (counted, then timed).
# - How many bytes a KV cache costs per token for real model shapes: Kimi-Linear-48B's
#   seven MLA layers, an all-MLA 27-layer baseline, and a GQA 8B-class model.
# - Why, at long context, the cache and not the weights decides how many requests a
#   GPU can serve, and how fast.
#
# **What you'll need.** numpy and the idea of softmax attention. Everything runs on a
# CPU in a few seconds. The small model here is random and untrained: the mechanisms
# are exact, the numbers it produces mean nothing as language.

# %%
import matplotlib.pyplot as plt
import numpy as np

from kimilab import costs, plots
from kimilab.config import all_mla_27, gqa_8b, kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.notebook import show_source
from kimilab.ops.attention import KVCache, causal_attention, decode_flops, decode_step, reference_causal_attention
from kimilab.timing import best_seconds

plots.use_style()
rng = np.random.default_rng(0)

# %% [markdown]
# ## Attention, the last T of L positions
#
# One attention head turns each query vector into a weighted average of value vectors.
# The weights are a softmax over the query's dot products with the keys. *Causal*
# means position t only sees keys 0..t.
#
# `causal_attention(q, k, v)` takes queries `q [T, H, D]`, keys `k [L, Hkv, D]` and
# values `v [L, Hkv, Dv]`. The T queries are the **last** T of the L positions. Two
# cases matter for serving:
#
# - *prefill*: `T == L`, every position of the prompt at once;
# - *decode*: `T == 1`, one new token looking back at everything before it.
#
# Grouped-query attention (GQA) lets `H` query heads share `Hkv < H` key/value heads
# (each KV head serves `H // Hkv` consecutive query heads), which shrinks what must be
# stored. The softmax subtracts each row's maximum before `exp`, so large scores cannot
# overflow.

# %%
show_source(causal_attention)

# %% [markdown]
# The vectorised version must agree with its slow, obvious twin, which loops over
# queries and heads one at a time. We check a GQA shape (6 query heads sharing 2 KV
# heads), for prefill, for a block of late queries and for one decode query.

# %%
L, H, Hkv, D = 40, 6, 2, 8
q = rng.standard_normal((L, H, D))
k = rng.standard_normal((L, Hkv, D))
v = rng.standard_normal((L, Hkv, D))
for T in (L, 7, 1):
    fast = causal_attention(q[L - T:], k, v, query_block=16)
    slow = reference_causal_attention(q[L - T:], k, v)
    print(f"T={T:2d} of L={L}: output {fast.shape}, max |fast - slow| < 1e-10: {np.abs(fast - slow).max() < 1e-10}")

# %% [markdown]
# ## Decoding without a cache, and with one
#
# A decoder generates token t+1 from the hidden states of tokens 0..t. Without a
# cache, every step runs the whole prefix through every layer again, because layer 2's
# keys at position 3 depend on layer 1's output at position 3, and so on up the stack.
#
# A **KV cache** keeps each layer's keys and values from earlier steps. A decode step
# then projects only the new token, appends its key and value, and attends its one
# query over the cache. Nothing already stored ever changes, so the cache is
# *append-only*: this is what lets serving engines page, share and truncate it freely
# (chapters 4 and 5). Here is the append and the decode step:

# %%
show_source(KVCache.append)

# %%
show_source(decode_step)

# %% [markdown]
# A toy decoder makes the comparison concrete: two attention layers with residual
# connections (no MLP, no norms, random weights), model width 64, 4 query heads
# sharing 2 KV heads of dimension 16. `forward_no_cache` recomputes every position;
# `decode_with_cache` feeds one token through, layer by layer, with one `KVCache` per
# layer.

# %%
D_MODEL, N_HEADS, N_KV_HEADS, HEAD_DIM, N_LAYERS = 64, 4, 2, 16, 2
layers = [
    {
        "wq": rng.standard_normal((D_MODEL, N_HEADS * HEAD_DIM)) / np.sqrt(D_MODEL),
        "wk": rng.standard_normal((D_MODEL, N_KV_HEADS * HEAD_DIM)) / np.sqrt(D_MODEL),
        "wv": rng.standard_normal((D_MODEL, N_KV_HEADS * HEAD_DIM)) / np.sqrt(D_MODEL),
        "wo": rng.standard_normal((N_HEADS * HEAD_DIM, D_MODEL)) / np.sqrt(N_HEADS * HEAD_DIM),
    }
    for _ in range(N_LAYERS)
]


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
for N in (1, 8, 64, 128):
    x = rng.standard_normal((N, D_MODEL))
    caches = new_caches()
    worst = 0.0
    for t in range(N):
        with_cache = decode_with_cache(x[t:t + 1], caches)[0]
        recomputed = forward_no_cache(x[: t + 1])[-1]
        worst = max(worst, float(np.abs(with_cache - recomputed).max()))
    print(f"N={N:3d} steps: cache holds {caches[0].length:3d} tokens per layer, "
          f"max |cached - recomputed| < 1e-10: {worst < 1e-10}")

# %% [markdown]
# ## What the cache saves: counted work
#
# `decode_flops` counts the multiply-adds (2 FLOPs each) of producing the token at
# position L in our toy, with and without the cache: the q/k/v/output projections and
# the attention scores and mixing over the causal (query, key) pairs. Counts are exact
# integers, the same on every machine.
#
# - With the cache: project 1 token, attend 1 query over L keys. Grows like L.
# - Without: project L tokens, attend all L queries causally (L(L+1)/2 pairs). Grows
#   like L².

# %%
show_source(decode_flops)

# %%
toy = dict(n_heads=N_HEADS, head_dim=HEAD_DIM, n_kv_heads=N_KV_HEADS, d_model=D_MODEL, n_layers=N_LAYERS)
contexts = 2 ** np.arange(4, 21)  # 16 ... 1M tokens
flops_cached = np.array([decode_flops(int(n), cached=True, **toy) for n in contexts], dtype=float)
flops_nocache = np.array([decode_flops(int(n), cached=False, **toy) for n in contexts], dtype=float)
print(f"{'context':>9} {'with cache':>12} {'no cache':>12} {'saving':>10}")
for n, c, u in zip(contexts, flops_cached, flops_nocache):
    if n in (16, 1024, 65536, 1048576):
        print(f"{n:9d} {c:12.3e} {u:12.3e} {u / c:9.1f}x")
saving_1m = flops_nocache[-1] / flops_cached[-1]
print(f"at {contexts[-1]:,} tokens the cache saves a factor of {saving_1m:,.0f}, "
      f"10^{np.log10(saving_1m):.1f}: {np.log10(saving_1m):.1f} orders of magnitude")

# %%
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
# orders of magnitude (printed above).
#
# **Measured time.** The same comparison timed on this CPU (wall-clock numbers, so the
# cell's output is not checked and will differ on your machine). For each context L we
# first fill the caches with L − 1 tokens in one prefill call, then time single decode
# steps (best of 5); the no-cache path times one full forward over L tokens (best of 3).
# `kimilab.timing.best_seconds` keeps the fastest run, the one least disturbed by other
# work on the machine.

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
for n, c, u in zip(timed_contexts, t_cached, t_nocache):
    print(f"L={n:5d}: with cache {c * 1e3:7.3f} ms, without {u * 1e3:8.3f} ms ({u / c:6.1f}x)")

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

# %% [markdown]
# *Takeaway:* measured times follow the counted FLOPs only loosely: the cached step is
# dominated by fixed Python and numpy call overhead (flat), the recomputed one grows
# quickly with L. On a busy machine, multithreaded BLAS can add sudden jumps to the
# no-cache line; the counted FLOPs above are the stable comparison.

# %% [markdown]
# ## What the cache costs: bytes
#
# The work saved is paid for in memory. A layer caches, for every token, a key and a
# value per KV head: `2 × Hkv × D` numbers. The analytic model in `kimilab.costs`
# counts these bytes for any `ModelConfig` without building an array. Every byte it
# returns is *per device* of a named deployment (chapter 3 introduces them), so each
# call names one: here `costs.LOCAL`, the book's reduced model on this CPU, one device
# that holds everything. First we check the count against real arrays: the runnable
# `tiny` config has 2 global layers of 4 KV heads × 32 dims, stored in float64 (the cell
# prints them).

# %%
show_source(costs.kv_bytes_per_token)

# %%
print(f"tiny: {len(tiny.attn_layers)} global layers, {tiny.attn_kv_heads_eff} KV heads x "
      f"{tiny.attn_head_dim_eff} dims, {tiny.dtype}; deployment {costs.LOCAL.name} ({costs.LOCAL.source})")
tiny_caches = [KVCache(tiny.attn_kv_heads_eff, tiny.attn_head_dim_eff, dtype=tiny.dtype) for _ in tiny.attn_layers]
for n_tokens in (1, 100, 1000):
    for cache in tiny_caches:
        extra = n_tokens - cache.length
        cache.append(rng.standard_normal((extra, cache.n_kv_heads, cache.head_dim)),
                     rng.standard_normal((extra, cache.n_kv_heads, cache.value_dim)))
    measured = sum(cache.nbytes for cache in tiny_caches)
    analytic = costs.request_bytes(tiny, costs.LOCAL, n_tokens)["kv"]
    print(f"tiny, {n_tokens:4d} tokens: measured {measured:8d} B, analytic {analytic:8d} B, equal: {measured == analytic}")

# %% [markdown]
# Now real shapes (shapes only: no weights are built). Their caches are stored in
# bf16, 2 bytes per number. The shapes come from the models' published configurations
# (sources in [the references](references.md)); the next cell prints them from
# `kimilab.config`.
#
# - **Kimi-Linear-48B-A3B** keeps global attention in 7 of its 27 layers (1-based
#   layers 4, 8, 12, 16, 20, 24, 27: `full_attn_layers` in the model's `config.json`,
#   [kimi-config](references.md#kimi-config)).
#   They are MLA layers: multi-head *latent* attention caches, per token and layer, one
#   compressed latent of 512 numbers (`kv_lora_rank`) plus 64 numbers of a decoupled key
#   part (`qk_rope_head_dim`; the config sets `mla_use_nope: true`, so these 64 dims are
#   not rotated by RoPE), shared by all 32 heads. Its other 20 layers are KDA layers
#   with a fixed-size state, the subject of chapter 2. This is what the book calls
#   **the hybrid** in every chapter: three KDA layers for each MLA layer (20 : 7 over 27
#   layers), the ratio of the Kimi Linear tech report (arXiv:2510.26692, §4 and
#   Figure 3, p. 6; [kimi-report](references.md#kimi-report)).
# - **All-MLA 27 layers**: the same shapes with MLA in every layer, the full-attention
#   baseline the tech report compares against.
# - **GQA 8B-class** (Llama-3-8B-like): 32 layers, 8 KV heads of 128 dims, K and V each.
#
# The regime is `costs.ONE_H200`: the whole model on one device (an H200, 141 GB), so
# the bytes per device are the model's own. (Split over several devices, a device holds
# a share of some caches and all of others: chapter 3.)

# %%
one = costs.ONE_H200
hy = kimi_linear_48b
print(f"deployment: {one.describe()}")
print(f"{hy.name}: MLA layers (1-based) {[i + 1 for i in hy.attn_layers]} of {hy.n_layers}; per token and layer "
      f"a latent of {hy.kv_lora_rank} + a decoupled key part of {hy.qk_rope_head_dim} numbers, {hy.n_heads} heads")
print(f"{gqa_8b.name}: {gqa_8b.n_layers} layers, {gqa_8b.attn_kv_heads_eff} KV heads of {gqa_8b.attn_head_dim_eff} dims")
print(f"{'model':16} {'global layers':>13} {'B/token/layer':>14} {'B/token':>9} {'at 128k':>10} {'at 1M':>10}")
for cfg in (kimi_linear_48b, all_mla_27, gqa_8b):
    per_layer = costs.kv_bytes_per_token_layer(cfg, one)
    per_token = costs.kv_bytes_per_token(cfg, one)
    print(f"{cfg.name:16} {len(cfg.attn_layers):13d} {per_layer:14,d} {per_token:9,d} "
          f"{per_token * 2**17 / 1e9:8.2f} GB {per_token * 2**20 / 1e9:8.2f} GB")
ratio = costs.kv_bytes_per_token(kimi_linear_48b, one) / costs.kv_bytes_per_token(all_mla_27, one)
print(f"hybrid / all-MLA KV bytes per token: {ratio:.4f}  (= 7/27 = {7 / 27:.4f})")
print(f"hybrid's fixed KDA + conv states (chapter 2), per request: "
      f"{costs.checkpoint_bytes(kimi_linear_48b, one) / 1e6:.1f} MB")

# %% [markdown]
# The hybrid caches 7/27 ≈ 26% of the all-MLA baseline's KV bytes: the tech report's
# "up to 75% less KV cache" (arXiv:2510.26692, abstract, p. 1;
# [kimi-report](references.md#kimi-report)) comes from the layer count
# alone. Plotted to 1M tokens, beside the weights the model must also hold:

# %%
lengths = np.unique(np.logspace(np.log10(1024), np.log10(2**20), 40).astype(int))
weights_48b = costs.device_weight_bytes(kimi_linear_48b, one)
weights_8b = costs.device_weight_bytes(gqa_8b, one)
fig, ax = plt.subplots()
for cfg, key in ((gqa_8b, "gqa"), (all_mla_27, "all-mla"), (kimi_linear_48b, "hybrid")):
    kv = np.array([costs.request_bytes(cfg, one, int(n))["kv"] for n in lengths]) / 1e9
    ax.loglog(lengths, kv, **plots.style_of(key))
ax.axhline(weights_48b / 1e9, linestyle="--", color=plots.color("weights"),
           label=f"{plots.label('weights')}, 48B bf16 ({weights_48b / 1e9:.0f} GB)")
ax.axhline(weights_8b / 1e9, linestyle=":", color=plots.color("weights"),
           label=f"{plots.label('weights')}, 8B bf16 ({weights_8b / 1e9:.0f} GB)")
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("KV cache of ONE request (GB)")
ax.set_title(f"KV cache bytes vs context (bf16), whole model on one device ({one.name})")
ax.legend(loc="lower right")
plots.save(fig, "ch01-kv-bytes")
plt.show()
print(f"one {gqa_8b.name} request's KV cache equals its {weights_8b / 1e9:.0f} GB of weights at "
      f"{weights_8b / costs.kv_bytes_per_token(gqa_8b, one):,.0f} tokens")
for cfg in (all_mla_27, kimi_linear_48b):
    share = costs.request_bytes(cfg, one, 2**20)["kv"] / costs.device_weight_bytes(cfg, one)
    print(f"{cfg.name} at 1M tokens: one request's KV cache = {share:.3f} x the "
          f"{costs.device_weight_bytes(cfg, one) / 1e9:.0f} GB of weights (1/{1 / share:.1f})")

# %% [markdown]
# *Takeaway* (whole model on one device): one GQA-8B request passes its model's entire
# 16 GB of weights near 123k tokens; at 1M tokens one all-MLA request needs a third of
# the 48B model's weights (0.340), the hybrid under a tenth (0.088).

# %% [markdown]
# ## Why the cache, not the weights, limits long-context serving
#
# Two consequences, computed per device of a named deployment. The 48B models run as
# vLLM's published recipe for Kimi Linear runs them, `costs.DEFAULT_DEPLOYMENT`: tensor
# parallelism over 4 H200s ([vllm-recipe](references.md#vllm-recipe)); the 8B model on
# one H200. Device numbers are data-sheet figures; the next cell prints them.
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
node = costs.DEFAULT_DEPLOYMENT
for dep in (node, one):
    print(f"deployment: {dep.describe()}")
print(f"48B models on {node.name}: {costs.device_weight_bytes(kimi_linear_48b, node) / 1e9:.0f} GB of weights per "
      f"device; read per token at batch 1: {costs.device_weight_bytes_read(kimi_linear_48b, node, 1) / 1e9:.1f} GB "
      f"per device ({costs.weight_model(kimi_linear_48b).active_params / 1e9:.0f}B active parameters in all)")
print(f"{'model':16} {'deployment':>14} {'context':>8} {'fits (requests)':>16} {'cache share of bytes read, batch 1':>36}")
for cfg, dep in ((kimi_linear_48b, node), (all_mla_27, node), (gqa_8b, one)):
    for n in (8192, 2**17, 2**20):
        fits = costs.max_batch(cfg, dep, n)
        work = costs.step_work(cfg, dep, decode=(1, n))  # what one device reads in one decode step
        share = work.cache_bytes / (work.cache_bytes + work.weight_bytes)
        print(f"{cfg.name:16} {dep.name:>14} {n:8d} {fits:16d} {share:35.1%}")
    crossover = costs.device_weight_bytes_read(cfg, dep, 1) / costs.kv_bytes_per_token(cfg, dep)
    print(f"{'':16} {'':>14} cache read = active weights read at {crossover:,.0f} tokens")
gqa_1m = costs.request_bytes(gqa_8b, one, 2**20)["kv"]
print(f"one {gqa_8b.name} request at 1M tokens: {gqa_1m / 1e9:.0f} GB of KV cache = "
      f"{gqa_1m / weights_8b:.1f} x its weights; the device has {one.device.hbm_bytes / 1e9:.0f} GB, of which "
      f"{costs.cache_budget_bytes(gqa_8b, one) / 1e9:.0f} GB are left for caches")

# %% [markdown]
# At 8k tokens the weights dominate the bytes read and the 4-device instance holds
# hundreds of requests (1,285 of the hybrid's, 388 all-MLA). At 1M tokens it fits only
# a handful (the "fits" column: every
# device stores the whole MLA latent of every request), and one H200 cannot hold even
# one GQA-8B request: its 137 GB cache is 8.6x the model and more than the 107 GB the
# device has left for caches. When decoding one 1M-token request, most of the bytes an
# all-MLA device reads per token are cache (the last column). Shrinking the cache, not
# the weights, is what long context needs. The hybrid keeps only 7 global layers, and
# chapter 2 shows what its other 20 layers keep instead: a state whose size never grows.

# %% [markdown]
# ## Summary
#
# - `causal_attention` computes softmax attention for the last T of L positions,
#   vectorised over heads, with GQA by grouping; it equals its loop-by-loop twin.
# - A `KVCache` stores every layer's keys and values, append-only. Decoding with it
#   equals recomputing the whole prefix (max difference < 1e-10 in float64) and turns
#   per-token work from ~L² into ~L: 5.7 orders of magnitude less at 1M tokens in the toy.
# - The price is memory: bytes per token = layers × (what one layer stores) × bytes per
#   number. With the whole model on one device (`costs.ONE_H200`), Kimi-Linear-48B's 7
#   MLA layers store 8,064 B/token, the all-MLA baseline 31,104 B/token (26%: the tech
#   report's "up to 75% less"), a GQA-8B model 131,072 B/token.
# - Every byte is per device of a named deployment. At long context the cache outgrows
#   the weights: on vLLM's TP4 recipe it decides the batch that fits and most of the
#   bytes each decoded token reads.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
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
# **1.3 Where the cache equals the weights.** With the whole model on one device
# (`costs.ONE_H200`), at what context length does one all-MLA request's KV cache hold as
# many bytes as all of the 48B model's bf16 weights? (Answers within 1% pass.)

# %% tags=["solution"]
answer = (costs.device_weight_bytes(all_mla_27, costs.ONE_H200)
          / costs.kv_bytes_per_token(all_mla_27, costs.ONE_H200))  # 96e9 B / 31,104 B a token

# %%
verify("1.3", answer)

# %% [markdown]
# **1.4 (open)** `causal_attention` processes queries in blocks (`query_block`). Time a
# prefill of 4,096 tokens with blocks of 16, 256 and 4,096, and check the outputs stay
# equal. What limits the largest block? (Hint: the score array is H × block × L.)
#
# **1.5 (open)** Add a sliding window to the cache: keep only the last W tokens. Which
# outputs change, and which test in `tests/test_attention.py` would you have to
# rewrite?
#
# **1.6 Eight devices instead of four.** vLLM's recipe also runs the model with tensor
# parallelism over 8 H200s (`costs.VLLM_TP8_H200`). How many all-MLA requests of 131,072
# tokens fit in that instance at once? Each device keeps 90% of its HBM for the engine,
# of which its share of the weights and a 4 GB activation reserve are not cache.
# Think first about what one device holds of each request.

# %% tags=["solution"]
tp8 = costs.VLLM_TP8_H200
budget = 0.9 * tp8.device.hbm_bytes - costs.device_weight_bytes(all_mla_27, tp8) - 4e9  # per device
per_request = 131_072 * costs.kv_bytes_per_token(all_mla_27, tp8)  # the whole latent: TP cannot split it
answer = int(budget // per_request)

# %%
verify("1.6", answer)
