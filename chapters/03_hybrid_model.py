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
# # 3. A reduced hybrid model (3 KDA : 1 global)
#
# **What you'll build.** A small Kimi-Linear-style language model that runs on a CPU:
# eight layers, three *KDA* layers (Kimi Delta Attention, chapter 2) for every
# *global* softmax-attention layer, a byte-level tokenizer, and the per-request cache
# such a model needs. You will run the same prompt three ways — prefill in one call,
# prefill in pieces, one token at a time — and check they agree to rounding error.
#
# **What you'll learn.**
# - What a hybrid model must remember per request: a KV cache that grows with the
#   context for the global layers, and two small fixed-size states (the KDA state
#   matrix and the short-convolution state) for the KDA layers.
# - How many bytes that is for the real Kimi-Linear-48B shapes, and where the tech
#   report's "up to 75% less KV cache" and its higher long-context decoding *throughput*
#   come from — and why that is throughput, not a shorter time per output token.
# - Why this mixed cache breaks three things serving engines take for granted with KV
#   caches: fixed-size pages, prefix sharing and cheap rollback.
#
# **What you'll need.** Chapter 1 (KV cache) and chapter 2 (the KDA recurrence and its
# chunked form). numpy and matplotlib; everything runs in a few seconds.
#
# **Honest scope.** The model is *reduced* (8 layers, d_model 128, 4 heads of 32, dense
# MLP instead of Kimi Linear's mixture of experts, MHA instead of MLA in the global
# layers) and *untrained*: its weights are seeded random numbers. Every mechanism is
# the real one and is checked exactly; the text it writes is meaningless. Speeds are
# CPU speeds.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyBboxPatch, Patch

from kimilab import costs, kda, plots
from kimilab.config import all_mla_27, kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.model import HybridCache, KDALayer, Model
from kimilab.notebook import show_source
from kimilab.ops.conv import causal_conv1d, causal_conv1d_step
from kimilab.timing import best_seconds
from kimilab.tokenizer import ByteTokenizer

plots.use_style()


def same(a, b, tol=1e-10):
    """'max |diff| < tol: True' — how this book prints exactness checks."""
    diff = float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
    return f"max |diff| < {tol:.0e}: {diff < tol}"


def kib(n):
    return f"{n / 1024:,.1f} KiB"


# %% [markdown]
# ## The configuration
#
# A `ModelConfig` is plain data: one letter per layer (`K` = KDA, `A` = global
# attention) and the sizes of everything. `tiny` is the model this book runs;
# `kimi_linear_48b` has the real shapes of the public Kimi-Linear-48B-A3B config
# ([references: kimi-config](references.md#kimi-config); 27 layers, MLA at 1-based layers
# 4, 8, 12, 16, 20, 24, 27 — 20 KDA : 7 MLA) and is *shapes only*: it feeds the
# analytic cost model (`kimilab.costs`), and asking for its weights is an error. Its
# parameter counts (48B total, 3B activated: the tech report's abstract,
# [kimi-report](references.md#kimi-report)) travel with the config as `cfg.weights`, so a
# renamed or edited copy keeps them. Element widths are per kind: `tiny` computes and
# stores everything in float64; the 48B model is served with bf16 weights, KV and conv
# state, and an fp32 KDA state (the width vLLM uses for KDA's recurrent state,
# [vllm](references.md#vllm)).

# %%
rows = [("layer_pattern", lambda c: c.layer_pattern), ("d_model", lambda c: c.d_model),
        ("KDA heads x head dim", lambda c: f"{c.n_heads} x {c.head_dim}"),
        ("global layers", lambda c: c.attn_kind), ("conv kernel", lambda c: c.conv_kernel),
        ("vocab", lambda c: c.vocab_size),
        ("bytes/elem weights", lambda c: costs.weight_model(c).bytes_per_param),
        ("bytes/elem KV,state,conv", lambda c: f"{c.kv_bytes},{c.state_bytes},{c.conv_bytes}"),
        ("weights (GB)", lambda c: f"{costs.weight_bytes(c) / 1e9:.3g}")]
for title, value in rows:
    print(f"{title:24s} {str(value(tiny)):>10s}   {value(kimi_linear_48b)}")

try:
    Model(kimi_linear_48b)
except ValueError as err:
    print("\nModel(kimi_linear_48b) ->", err)

# %% [markdown]
# ## The architecture
#
# Each layer is a pre-norm residual block: `h = h + mixer(RMSNorm(h))`, then
# `h = h + MLP(RMSNorm(h))`. The *mixer* is either a KDA layer or a global attention
# layer. The global layers use no positional encoding (*NoPE*), as Kimi Linear's MLA
# layers do: position information comes from the KDA layers' recurrence and their short
# convolution. The figure shows the eight layers of `tiny` and what each keeps between
# tokens.

# %%
model = Model(tiny, seed=0)
print(model)

H, K, W = tiny.n_heads, tiny.head_dim, tiny.conv_kernel
kda_layer_bytes = costs.kda_state_bytes_per_layer(tiny)
conv_layer_bytes = costs.conv_state_bytes_per_layer(tiny)
kv_layer_token = costs.kv_bytes_per_token_layer(tiny)

fig, ax = plt.subplots(figsize=(9.0, 3.6))
for i, kind in enumerate(tiny.layer_pattern):
    key = "kda-state" if kind == "K" else "kv-cache"
    ax.add_patch(FancyBboxPatch((i + 0.08, 1.55), 0.84, 0.9, boxstyle="round,pad=0.02",
                                color=plots.color(key), alpha=0.9))
    ax.text(i + 0.5, 2.0, "KDA" if kind == "K" else "global\nattn\n(NoPE)", ha="center", va="center",
            color="white", fontsize=9, weight="bold")
    if kind == "K":
        ax.add_patch(FancyBboxPatch((i + 0.12, 0.75), 0.76, 0.55, boxstyle="round,pad=0.02",
                                    color=plots.color("kda-state"), alpha=0.35))
        ax.text(i + 0.5, 1.02, f"S {H}x{K}x{K}\n{kib(kda_layer_bytes)}", ha="center", va="center", fontsize=7)
        ax.add_patch(FancyBboxPatch((i + 0.12, 0.1), 0.76, 0.5, boxstyle="round,pad=0.02",
                                    color=plots.color("conv-state"), alpha=0.35))
        ax.text(i + 0.5, 0.35, f"conv {W - 1}x{tiny.conv_channels}\n{kib(conv_layer_bytes)}",
                ha="center", va="center", fontsize=7)
    else:
        ax.add_patch(FancyBboxPatch((i + 0.12, 0.1), 0.76, 1.2, boxstyle="round,pad=0.02",
                                    color=plots.color("kv-cache"), alpha=0.35))
        ax.text(i + 0.5, 0.7, f"K,V\n+{kib(kv_layer_token)}\nper token", ha="center", va="center", fontsize=7)
ax.annotate("", xy=(8.15, 2.0), xytext=(-0.15, 2.0), arrowprops=dict(arrowstyle="->", color="0.6"), zorder=0)
ax.set_xlim(-0.2, 8.2)
ax.set_ylim(0, 2.6)
ax.set_xticks(np.arange(8) + 0.5, [str(i) for i in range(8)])
ax.set_yticks([0.35, 1.02, 2.0], ["conv state\n(fixed)", "KDA state (fixed)\nor KV (grows)", "mixer"])
ax.set_xlabel("layer index (0-based); the residual stream flows left to right")
ax.set_ylabel("per-request cache of the layer")
ax.grid(False)
ax.set_title("tiny: 3 KDA : 1 global, per-request cache of each layer")
ax.legend(handles=[Patch(color=plots.color(k), label=plots.label(k)) for k in ("kda-state", "conv-state", "kv-cache")],
          loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
plots.save(fig, "ch03-architecture")
plt.show()

# %% [markdown]
# Six of the eight layers hold a cache whose size never changes (the orange KDA state
# and the pink conv state); only the two blue global layers grow with every token.
#
# ## One KDA layer, step by step
#
# The tech report's §4 (pp. 5–6, Eq. 10; [kimi-report](references.md#kimi-report))
# fixes the KDA layer: q, k, v projections -> causal depthwise convolution
# (kernel 4) -> SiLU (Swish) -> L2 norm on q and k; a per-channel forget gate from a
# low-rank projection (d_model -> head_dim -> H*K), which flash-linear-attention's
# reference code ([fla](references.md#fla)) writes as
# `g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`; `beta = sigmoid(b_proj x)`; then
# the KDA recurrence of chapter 2; then a per-head RMSNorm times a sigmoid output gate,
# and the output projection. The model's layers are objects with three public steps —
# `project` (everything per token before the recurrence), `mix` (the recurrence) and
# `output` — so that later chapters can run them on a slice of a sequence. This is
# `KDALayer.project`:

# %%
show_source(KDALayer.project)

# %% [markdown]
# The short convolution is the one new cache. Channel c of the output at step t mixes
# channel c of the inputs at steps t-3..t, so to continue a sequence a request must keep
# its last 3 inputs: a rolling *conv state* of shape `[W-1, C]` with
# `C = 3 * H * K = 384` channels (q, k and v side by side).

# %%
show_source(causal_conv1d)

# %% [markdown]
# The sequence form and the one-token twin agree, and cutting a sequence anywhere and
# carrying the state across the cut changes nothing:

# %%
rng = np.random.default_rng(3)
x = rng.standard_normal((20, 6))
w = rng.standard_normal((6, 4))
y_whole, s_whole = causal_conv1d(x, w)
y_a, s_a = causal_conv1d(x[:7], w)
y_b, s_b = causal_conv1d(x[7:], w, s_a)
state, steps = None, []
for t in range(20):
    y_t, state = causal_conv1d_step(x[t], w, state)
    steps.append(y_t)
print("split at 7 == whole:   ", same(np.concatenate([y_a, y_b]), y_whole), "| states equal:", np.array_equal(s_b, s_whole))
print("20 single steps == whole:", same(np.stack(steps), y_whole))

# %% [markdown]
# After the recurrence, `KDALayer.output`: normalise each head, gate it, project back.

# %%
show_source(KDALayer.output)

# %% [markdown]
# ## Text in, text out
#
# The tokenizer is byte-level: token ids 0..255 are UTF-8 bytes, and four specials sit
# above them (`<bos>=256, <eos>=257, <pad>=258, <unk>=259`), 260 ids in all. Any
# text round-trips exactly. Greedy generation from the untrained model writes bytes
# with no meaning — which is fine: this book checks mechanisms, not prose.

# %%
tok = ByteTokenizer()
prompt = tok.encode("Kimi Linear keeps a state, ")
print("ids:", prompt)
print("round trip:", tok.decode(prompt) == "Kimi Linear keeps a state, ")
generated = model.generate(prompt, 12)
print("generated ids:", generated)
print("as text:", repr(tok.decode(generated)))

# %% [markdown]
# ## The per-request cache
#
# The model reads and writes a request's memory only through a small protocol,
# `kimilab.model.CacheProtocol` (`kda_state(i)`, `conv_state(i)`, `append_kv(i, k, v)`,
# `kv(i)`, `advance(n)`, `truncate(n, checkpoint)`, `nbytes_by_kind()`, `clone()`,
# `checkpoint()`). `HybridCache` implements it with contiguous arrays; chapter 4
# implements the same protocol on pool pages, and the model does not notice the
# difference.
#
# Here is the anatomy of one request after 100 tokens, measured from the cache and
# computed independently by `kimilab.costs` (the analytic model later chapters use for
# the 48B shapes).

# %%
cache = model.new_cache()
model.prefill(rng.integers(0, 256, size=100), cache)
measured = cache.nbytes_by_kind()
analytic = costs.request_bytes(tiny, 100)
shape = {"kv": f"2 x [T, {tiny.attn_kv_heads_eff}, {tiny.attn_head_dim_eff}]",
         "kda_state": f"[{H}, {K}, {K}]", "conv_state": f"[{W - 1}, {tiny.conv_channels}]"}
print(f"{'kind':11s} {'layers':>6s}  {'per-layer shape':20s} {'bytes per layer':>22s} "
      f"{'total at T=100':>15s}  grows with T")
for row in costs.cache_anatomy(tiny):
    kind = row["kind"]
    per = f"{row['bytes_per_layer']:,} B {row['unit']}"
    print(f"{kind:11s} {row['layers']:6d}  {shape[kind]:20s} {per:>22s} {measured[kind]:>13,} B  "
          f"{'yes' if row['grows_with_context'] else 'no'}")
print(f"{'total':11s} {'':6s}  {'':20s} {'':>22s} {cache.nbytes:>13,} B")
print("measured == kimilab.costs for every kind:", measured == analytic)
print(f"fixed part (KDA + conv states): {kib(costs.checkpoint_bytes(tiny))}; KV grows by "
      f"{costs.kv_bytes_per_token(tiny):,} B per token")

# %% [markdown]
# At T = 100 the KV cache of just two layers is already the largest part. The fixed
# part (KDA + conv states, 246.0 KiB) is what a later chapter has to copy whenever it
# wants to remember a position.
#
# ## Prefill and decode: three ways, one answer
#
# - `forward(tokens)`: the whole sequence from scratch, no cache; KDA runs token by token
#   (`recurrent_kda`), attention over the full sequence.
# - `prefill(tokens, cache)`: absorb a piece of the prompt on top of whatever the cache
#   holds; KDA runs in chunks of 64 (`chunk_kda`, chapter 2), each global layer appends
#   its K and V and attends over everything cached.
# - `decode(token, cache)`: one token; KDA takes one recurrent step (`kda_step`), the
#   conv takes one step, attention reads the whole KV cache.
#
# All three run the same layer loop; only the KDA kernel (`"recurrent"`, `"chunk"` or
# `"step"`) and the cache differ:

# %%
show_source(Model.run_layers)

# %% [markdown]
# Each layer object does its part against the cache; here is the KDA layer's:

# %%
show_source(KDALayer.__call__)

# %% [markdown]
# We take a 100-token prompt (two chunks: 64 + 36) and compare the logits
# (scores over the 260 tokens) and the final caches.

# %%
tokens = np.random.default_rng(11).integers(0, 256, size=100)
reference = model.forward(tokens)

whole = model.new_cache()
logits_whole = model.prefill(tokens, whole)

pieces = model.new_cache()
cuts = [0, 37, 81, 100]
logits_pieces = np.concatenate([model.prefill(tokens[a:b], pieces) for a, b in zip(cuts[:-1], cuts[1:])])

stepwise = model.new_cache()
logits_steps = np.stack([model.decode(int(t), stepwise) for t in tokens])


def cache_diff(a, b):
    d = [np.abs(a.kda_state(i) - b.kda_state(i)).max() for i in tiny.kda_layers]
    d += [np.abs(a.conv_state(i) - b.conv_state(i)).max() for i in tiny.kda_layers]
    d += [np.abs(a.kv(i)[j] - b.kv(i)[j]).max() for i in tiny.attn_layers for j in (0, 1)]
    return max(d)


print("prefill(whole)      vs forward():", same(logits_whole, reference))
print("prefill(37+44+19)   vs forward():", same(logits_pieces, reference))
print("100 x decode()      vs forward():", same(logits_steps, reference))
print("final caches: pieces vs whole:", f"max |diff| < 1e-10: {cache_diff(pieces, whole) < 1e-10}",
      "| steps vs whole:", f"max |diff| < 1e-10: {cache_diff(stepwise, whole) < 1e-10}")
print("seq_len:", whole.seq_len, pieces.seq_len, stepwise.seq_len)

# %% [markdown]
# The same holds in float32, to float32's precision:

# %%
model32 = Model(tiny.with_(name="tiny-float32", dtype="float32"), seed=0)
ref32 = model32.forward(tokens)
c32 = model32.new_cache()
got32 = np.concatenate([model32.prefill(tokens[:70], c32), np.stack([model32.decode(int(t), c32) for t in tokens[70:]])])
print("float32: prefill(70) + 30 x decode vs forward():", same(got32, ref32, tol=1e-5))

# %% [markdown]
# Prefill really does use the chunked kernel and decode the recurrent step: we count
# the calls by wrapping the two functions for one prefill and one decode.

# %%
counts = {"chunk_kda": 0, "kda_step": 0, "recurrent_kda": 0}
originals = {name: getattr(kda, name) for name in counts}


def counting(name):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return originals[name](*args, **kwargs)
    return wrapper


for name in counts:
    setattr(kda, name, counting(name))
try:
    tmp = model.new_cache()
    model.prefill(tokens[:80], tmp)
    model.decode(int(tokens[80]), tmp)
finally:
    for name, fn in originals.items():
        setattr(kda, name, fn)
print(counts, f"(one call per KDA layer; {len(tiny.kda_layers)} KDA layers)")

# %% [markdown]
# ## Memory at the 48B scale
#
# The same anatomy, computed for the real shapes. Per token, each of the 7 MLA layers
# caches a 512-wide latent (`kv_lora_rank`) plus 64 more dims in bf16: 1,152 B per layer.
# The config calls those 64 dims `qk_rope_head_dim`; in DeepSeek-style MLA they are the
# *decoupled key part* that carries the rotary position, shared by all heads. Kimi Linear
# sets `mla_use_nope: true` (no positional encoding in MLA layers, report §4, p. 6): the
# 64 dims are still computed, cached and used in the scores, just never rotated. Each of
# the 20 KDA layers holds a `32 x 128 x 128` state (2 MiB in fp32) and a `3 x 12,288` conv
# state in bf16. The fp32 state is vLLM's choice, not the report's: vLLM's
# `MambaStateDtypeCalculator.kda_state_dtype` returns float32 for KDA's recurrent state
# and the cache dtype for its conv state ([vllm](references.md#vllm)). A bf16 state is a
# plausible engine choice too, so we carry both.

# %%
kimi_bf16_state = kimi_linear_48b.with_(name="kimi_linear_48b (bf16 state)", state_bytes=2)
for cfg in (kimi_linear_48b, all_mla_27):
    print(cfg.name)
    for row in costs.cache_anatomy(cfg):
        print(f"  {row['kind']:11s} {row['layers']:3d} layers x {row['bytes_per_layer']:>10,} B {row['unit']:11s}"
              f" grows with T: {'yes' if row['grows_with_context'] else 'no'}")

contexts = np.unique(np.round(np.logspace(10, 20, 41, base=2)).astype(int))
hybrid_gb = np.array([costs.request_total_bytes(kimi_linear_48b, int(n)) for n in contexts]) / 1e9
bf16_gb = np.array([costs.request_total_bytes(kimi_bf16_state, int(n)) for n in contexts]) / 1e9
mla_gb = np.array([costs.request_total_bytes(all_mla_27, int(n)) for n in contexts]) / 1e9
fixed_gb = costs.checkpoint_bytes(kimi_linear_48b) / 1e9

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.0, 4.0))
ax.loglog(contexts, mla_gb, **plots.style_of("all-mla"))
ax.loglog(contexts, hybrid_gb, **{**plots.style_of("hybrid"), "label": "hybrid, fp32 state"})
ax.loglog(contexts, bf16_gb, color=plots.color("hybrid"), linestyle=":", label="hybrid, bf16 state")
ax.axhline(fixed_gb, linestyle="--", color=plots.color("kda-state"),
           label=f"hybrid fixed part (fp32): {plots.label('kda-state')} + {plots.label('conv-state')}")
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("cache per request (GB)")
ax.set_title("Kimi-Linear-48B shapes: cache of one request")
ax.legend(fontsize=8)
ax2.semilogx(contexts, 100 * (1 - hybrid_gb / mla_gb), **{**plots.style_of("hybrid"), "label": "hybrid, fp32 state"})
ax2.semilogx(contexts, 100 * (1 - bf16_gb / mla_gb), color=plots.color("hybrid"), linestyle=":",
             label="hybrid, bf16 state")
ax2.axhline(75, linestyle="--", color=plots.color("analytic"), label="tech report: up to 75% less")
ax2.set_xlabel("context length (tokens)")
ax2.set_ylabel("cache saved vs all-MLA (%)")
ax2.set_ylim(-100, 100)
ax2.axhline(0, color="0.3", linewidth=0.8)
ax2.set_title("saving of the hybrid")
ax2.legend(loc="lower right", fontsize=8)
plots.save(fig, "ch03-memory-48b")
plt.show()

# %% [markdown]
# *Takeaway:* below a couple of thousand tokens the hybrid's fixed states make it hold
# *more* than all-MLA; past that the growing KV takes over and the saving approaches the
# layer-count limit. Exactly where the lines cross depends on the state's width:

# %%
per_token_saved = costs.kv_bytes_per_token(all_mla_27) - costs.kv_bytes_per_token(kimi_linear_48b)
print(f"KV per token: hybrid {costs.kv_bytes_per_token(kimi_linear_48b):,} B, "
      f"all-MLA {costs.kv_bytes_per_token(all_mla_27):,} B")
for cfg in (kimi_linear_48b, kimi_bf16_state):
    fixed = costs.checkpoint_bytes(cfg)
    print(f"{cfg.name:30s} fixed states {fixed:>11,} B; holds less than all-MLA from "
          f"{costs.crossover_tokens(cfg, all_mla_27):,} tokens on; its own KV passes its states at "
          f"{fixed // costs.kv_bytes_per_token(cfg) + 1:,} tokens")
for n in (131072, 1048576):
    h, a = costs.request_total_bytes(kimi_linear_48b, n), costs.request_total_bytes(all_mla_27, n)
    print(f"context {n:>9,}: hybrid {h / 1e9:6.2f} GB, all-MLA {a / 1e9:6.2f} GB per request "
          f"-> {100 * (1 - h / a):.1f}% less cache")
print(f"limit (KV only): 1 - 7/27 = {100 * (1 - 7 / 27):.1f}%")

# %% [markdown]
# With vLLM's fp32 state the hybrid holds less than all-MLA from 1,885 tokens on; with a
# bf16 state from 975. At 128k tokens the saving is 73.0% (73.9% at 1M), close to the
# layer-count limit 20/27 = 74.1%: the tech report's "up to 75%" (abstract, p. 1). The state's width
# matters for short requests, and for every copy of a state a prefix cache keeps
# (chapter 6).
#
# ## Why less cache means more decoding throughput
#
# The report makes three decoding claims; they are measured under different conditions
# ([kimi-report](references.md#kimi-report)):
#
# - abstract (p. 1) and §1 (p. 2): "up to 6× decoding throughput" at 1M context;
# - Figure 1(b) (p. 1): time per output token (TPOT) against decoding length, "6.3×
#   faster TPOT (1.84ms vs. 11.48ms) than MLA at 1M tokens", which the caption
#   attributes to the larger batches the hybrid's memory allows — a step's time shared
#   by its batch, that is, inverse throughput;
# - Figure 7(b) (p. 13): TPOT at batch size 1 (the figure is annotated 2.2× and 1.8×;
#   §6.3 on p. 16 reads it as a 2.3× speedup at 1M). The 2.3× and 2.9× of Figure 7(a)
#   are *prefill* times at 512K and 1M.
#
# A decode step is memory-bound: it reads the weights it touches once (shared by the
# batch) plus every request's whole cache, and every request waits for the step.
# `kimilab.costs` turns that into a roofline on assumed hardware (one node of 8
# H800-class devices: 80 GB and 3.35 TB/s each — data-sheet numbers, not measurements),
# and a step takes as long as its busiest device. *How* the 8 devices split the work
# matters for MLA, and a `Deployment` says which way:
#
# - **`attention="tp"`** (tensor parallelism, what `--tensor-parallel-size 8` gives in
#   vLLM or SGLang): every layer is split by heads. KDA states shard by head, but MLA
#   caches ONE latent shared by all heads, so every device holds — and reads — the whole
#   latent cache of every request.
# - **`attention="dp"`** (data-parallel attention, vLLM's and SGLang's DP-attention):
#   each device runs attention for its own requests and holds their whole caches; the
#   mixer (KDA and MLA) weights are replicated on every device, the experts spread.
#
# The code that decides what one device holds:

# %%
show_source(costs.request_rank_bytes)
show_source(costs.max_batch)

# %%
n = 1048576
tp = costs.DEFAULT_DEPLOYMENT
dp = tp.with_attention("dp")
print(f"{tp.n_devices} x {tp.device.name}: {tp.device.hbm_bytes / 1e9:.0f} GB at "
      f"{tp.device.hbm_bandwidth / 1e12:.2f} TB/s each; weights {costs.weight_bytes(kimi_linear_48b) / 1e9:.0f} GB "
      f"bf16; context {n:,} tokens")
points = {}
for dep in (tp, dp):
    print(f"\n{dep.attention.upper()} attention{'':17s}{'hybrid':>10s} {'all-MLA':>10s} {'ratio':>7s}")
    rows = {}
    for cfg in (kimi_linear_48b, all_mla_27):
        one, full = costs.decode_point(cfg, n, 1, dep), costs.decode_point(cfg, n, None, dep)
        points[dep.attention, cfg.name] = full
        rows.setdefault("requests that fit", []).append(full.batch)
        rows.setdefault("step at batch 1 (ms)", []).append(one.step_seconds * 1e3)
        rows.setdefault("step at largest batch (ms)", []).append(full.step_seconds * 1e3)
        rows.setdefault("throughput (tokens/s)", []).append(full.tokens_per_second)
    for label, (h, a) in rows.items():
        better = a / h if "step" in label else h / a
        fmt = "{:10,d}" if isinstance(h, int) else "{:10,.2f}" if "ms" in label else "{:10,.0f}"
        print(f"  {label:28s}{fmt.format(h)} {fmt.format(a)} {better:6.2f}x")
cache_ratio = costs.request_total_bytes(all_mla_27, n) / costs.request_total_bytes(kimi_linear_48b, n)
print(f"\ncache bytes per request, all-MLA / hybrid (the ceiling of the gain): {cache_ratio:.2f}x")
print("throughput DP / TP: " + ", ".join(
    f"{name} {points['dp', name].tokens_per_second / points['tp', name].tokens_per_second:.1f}x"
    for name in (kimi_linear_48b.name, all_mla_27.name)))

# %% [markdown]
# The ratio column is "how much better the hybrid is" (all-MLA / hybrid for times,
# hybrid / all-MLA for the rest). Reading it:
#
# - **Under TP** only 8 hybrid and 2 all-MLA requests of 1M tokens fit, because every
#   device stores the whole MLA latent of each one. At batch 1 the hybrid's step is 3.62×
#   shorter — more than the report's batch-1 figure (2.2–2.3×), as a roofline with
#   perfect bandwidth and no kernel overheads would be.
# - **The gain at full memory is throughput, not TPOT.** Each model at its largest batch,
#   the hybrid's deployment produces 3.75× more tokens per second under TP and 3.50×
#   under DP-attention — the same kind of number as the report's "up to 6× decoding
#   throughput" and its 6.3× of Figure 1(b), smaller because this idealised model (no
#   activation memory, no kernel overheads, an assumed node) is not the report's serving
#   stack. Each *request* waits as long as ever, or longer: at its batch of 8 the
#   hybrid's step takes 21.10 ms, all-MLA's at batch 2 takes 19.80 ms.
# - **DP-attention** fits 56 vs 16 requests (7 per device for the hybrid, once the
#   replicated mixer weights are paid) and multiplies the hybrid's throughput by 6.9 and
#   all-MLA's by 7.4 at about the same per-request step time. The ceiling of the hybrid's
#   gain is the cache ratio, 3.84×.
#
# The figure shows the whole curve: throughput against batch, each line ending at the
# largest batch that fits.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.0), sharey=True)
for ax, dep in zip(axes, (tp, dp)):
    for cfg, key in ((all_mla_27, "all-mla"), (kimi_linear_48b, "hybrid")):
        top = costs.max_batch(cfg, n, dep)
        batches = sorted({2 ** k for k in range(top.bit_length()) if 2 ** k <= top} | {top})
        tps = [costs.decode_point(cfg, n, b, dep).tokens_per_second for b in batches]
        ax.plot(batches, tps, marker="o", markersize=3, **plots.style_of(key))
        ax.annotate(f"{top} fit", (batches[-1], tps[-1]), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests of 1M tokens)")
    ax.set_title(f"{dep.n_devices} devices, {dep.attention.upper()} attention")
    ax.legend(loc="lower right")
axes[0].set_ylabel("decode throughput (tokens/s, roofline)")
plots.save(fig, "ch03-decode-throughput")
plt.show()

# %% [markdown]
# *Takeaway:* under TP both lines are nearly flat — at 1M tokens a step is almost all
# cache reads, so each added request adds its own read time — and the hybrid's sits
# higher because it reads less per request. Under DP-attention added requests land on
# idle devices and throughput climbs with the batch. Either way the hybrid's line runs
# 3.5 to 4 times further to the right before memory runs out.
#
# The same roofline prices a prefill (FLOPs at an assumed 50% of peak against bytes at
# full bandwidth, `costs.prefill_seconds`), which later chapters use to turn prefix-cache
# hits into seconds of time-to-first-token saved, and the copy a state checkpoint costs
# (`costs.checkpoint_write_seconds`: read and write its bytes once):

# %%
print(f"prefill FLOPs run at {costs.PREFILL_EFFICIENCY:.0%} of peak (an assumption)")
for dep in (tp, dp):
    for cfg in (kimi_linear_48b, all_mla_27):
        cold = costs.prefill_seconds(cfg, 10_000, 0, dep)
        saved = costs.prefill_seconds_saved(cfg, 10_000, 8_000, dep)
        print(f"{dep.attention.upper()} {cfg.name:16s} prefill of 10,000 tokens {cold * 1e3:6.2f} ms; "
              f"an 8,000-token hit saves {saved * 1e3:6.2f} ms")
    print(f"{dep.attention.upper()} copy of one {costs.checkpoint_bytes(kimi_linear_48b) / 1e6:.1f} MB state checkpoint: "
          f"{costs.checkpoint_write_seconds(kimi_linear_48b, dep) * 1e6:.1f} us")

# %% [markdown]
# A 10,000-token prompt costs tens of milliseconds to prefill; copying a checkpoint costs
# microseconds. Under DP-attention one request's attention runs on one device, so a
# single prefill is slower than under TP — the price of DP's larger batches.
#
# ## Decode time on the tiny model (a real CPU measurement)
#
# On our CPU the shape is different. First the deterministic part: bytes one decode step
# reads (float64 weights plus the request's cache) at a few context lengths.

# %%
timed_contexts = [64, 256, 512, 1024]
weights_bytes = model.n_params * 8
print(f"{'context':>8s} {'KV bytes':>11s} {'fixed states':>13s} {'weights':>12s} {'read per token':>15s}")
for n in timed_contexts:
    b = costs.request_bytes(tiny, n)
    total = weights_bytes + sum(b.values())
    print(f"{n:8d} {b['kv']:11,} {b['kda_state'] + b['conv_state']:13,} {weights_bytes:12,} {total:15,}")

# %% [markdown]
# Then the measurement: we prefill a long prompt in steps and, at each context length,
# time 10 decode steps on a clone of the cache (so the timed steps do not change the
# context we measure at) and keep the fastest. Wall-clock numbers vary between runs and
# machines.

# %%
# NBVAL_IGNORE_OUTPUT
long_prompt = np.random.default_rng(5).integers(0, 256, size=max(timed_contexts))
timing_cache, pos, ms_per_token = model.new_cache(), 0, []
for n in timed_contexts:
    model.prefill(long_prompt[pos:n], timing_cache)
    pos = n
    probe = timing_cache.clone()
    ms_per_token.append(best_seconds(lambda: model.decode(7, probe), repeats=10, warmup=1) * 1e3)
for n, ms in zip(timed_contexts, ms_per_token):
    print(f"context {n:5d}: {ms:6.2f} ms per decoded token (CPU, float64)")

fig, ax = plt.subplots()
ax.plot(timed_contexts, ms_per_token, marker="o", **plots.style_of("measured"))
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("decode time per token (ms, this CPU)")
ax.set_ylim(0, None)
ax.set_title("tiny hybrid model: measured decode time")
ax.legend()
plots.save(fig, "ch03-decode-time")
plt.show()

# %% [markdown]
# Decode time per token barely moves with context on `tiny`. Is that the weights? We
# measure it: the same step against the matrix-vector products it does with every weight
# matrix (one token times each of them, nothing else), and we count the Python function
# calls one decode step makes.

# %%
# NBVAL_IGNORE_OUTPUT
import sys

matrices = []
stack = [v for k, v in model.weights.items() if k != "embed"]  # decode reads one embedding row
while stack:
    item = stack.pop()
    if isinstance(item, dict):
        stack.extend(item.values())
    elif isinstance(item, list):
        stack.extend(item)
    elif isinstance(item, np.ndarray) and item.ndim == 2:
        matrices.append(item)
vectors = [np.ones(w.shape[0]) for w in matrices]


def weights_only():
    for x, w in zip(vectors, matrices):
        x @ w


probe = timing_cache.clone()
step_ms = best_seconds(lambda: model.decode(7, probe), repeats=20, warmup=2) * 1e3
weights_ms = best_seconds(weights_only, repeats=20, warmup=2) * 1e3
calls = {"call": 0, "c_call": 0}


def count_calls(frame, event, arg):
    if event in calls:
        calls[event] += 1


probe = timing_cache.clone()
sys.setprofile(count_calls)
try:
    model.decode(7, probe)
finally:
    sys.setprofile(None)
print(f"{len(matrices)} weight matrices, {sum(w.nbytes for w in matrices) / 1e6:.1f} MB")
print(f"decode step {step_ms:.2f} ms; its weight products alone {weights_ms:.2f} ms "
      f"({100 * weights_ms / step_ms:.0f}% of the step)")
print(f"one decode step makes {calls['call']:,} Python function calls and {calls['c_call']:,} C-function calls")

# %% [markdown]
# The weight products are a minority of the step — well under half of it on the machines
# we tried. Most of a `tiny` decode step is interpreter overhead: about a thousand
# Python function calls per token, each costing microseconds — the fixed "Python and
# numpy call overhead" chapter 1 saw flatten its cached decode step. The KV read that grows with context (4,096 B per
# token for `tiny`) is small beside it. On a GPU at the 48B scale the balance is the
# roofline's above: bytes, not calls.
#
# ## Why this cache breaks the serving engine's assumptions
#
# Everything a modern engine does with a KV cache rests on one property: the cache of a
# prefix is a *prefix of the cache*. Rows are appended and never changed. A KDA state is
# the opposite: one matrix, overwritten by every token. Three consequences, each shown
# on the tiny model:
#
# **1. Pages of different sizes (chapter 4).** KV is stored in fixed pages of a few
# tokens. A state is one indivisible block per layer whose size has nothing to do with
# the page size (for `tiny` the KDA state happens to equal one page; the conv state does
# not, and at the 48B scale a state is over a hundred pages):

# %%
for cfg in (tiny, kimi_linear_48b):
    page = 16 * costs.kv_bytes_per_token_layer(cfg)
    state = costs.kda_state_bytes_per_layer(cfg)
    conv = costs.conv_state_bytes_per_layer(cfg)
    print(f"{cfg.name:16s} KV page (16 tokens, 1 layer): {page:>7,} B | KDA state: {state:>9,} B "
          f"= {state / page:5.1f} pages | conv state: {conv:>6,} B = {conv / page:4.2f} pages")

# %% [markdown]
# vLLM's answer ([vllm](references.md#vllm)) is to make the pages equal, one layer at a
# time: it raises the attention block size until one MLA layer's page holds one KDA
# layer's state (padding the state page to match), then groups layers so that every
# group has as many layers as the smallest type. `costs.vllm_hybrid_pages` derives that
# layout from the per-layer bytes; chapters 4 and 6 build on it.

# %%
vp = costs.vllm_hybrid_pages(kimi_linear_48b)
print(f"one MLA layer: {vp.kv_token_bytes:,} B per token; one KDA layer's state + conv: {vp.state_bytes:,} B")
print(f"attention block: {vp.block_tokens:,} tokens (a multiple of {vp.align_tokens}); page {vp.page_bytes:,} B, "
      f"state page padded by {vp.state_padding_bytes:,} B")
print(f"layer groups of {vp.group_size}: {vp.attn_groups} MLA group, {vp.kda_groups} KDA groups "
      f"({vp.padded_layers} padded layer slot)")
print(f"one whole-model state = {vp.checkpoint_blocks} blocks = the price of {vp.state_to_kv_blocks:.0f} KV blocks "
      f"of {vp.block_tokens:,} tokens")
print(f"the same state in 512-token KV blocks of all 7 MLA layers: "
      f"{costs.checkpoint_bytes(kimi_linear_48b) / (512 * costs.kv_bytes_per_token(kimi_linear_48b)):.1f} blocks")
for align, tp_size in ((64, 1), (16, 8)):
    other = costs.vllm_hybrid_pages(kimi_linear_48b, align_tokens=align, tensor_parallel=tp_size)
    print(f"  with {align}-token alignment and TP {tp_size}: {other.block_tokens:,}-token blocks")

# %% [markdown]
# **2. Prefix sharing (chapters 5–6).** Two requests that share a 60-token prefix can
# share its KV rows: the first 60 rows of the longer request's KV are exactly the KV of
# the prefix. The KDA state after 100 tokens, though, says nothing usable about the
# state after 60 — the state at 60 exists only if someone saved a copy at 60.

# %%
base = tokens
long_cache, short_cache = model.new_cache(), model.new_cache()
model.prefill(base, long_cache)
model.prefill(base[:60], short_cache)
layer_a, layer_k = tiny.attn_layers[0], tiny.kda_layers[0]
print("KV rows 0..59 of the 100-token cache == KV of the 60-token prefix:",
      same(long_cache.kv(layer_a)[0][:60], short_cache.kv(layer_a)[0]))
gap = np.abs(long_cache.kda_state(layer_k) - short_cache.kda_state(layer_k)).max()
print(f"KDA state after 100 vs after 60 tokens: max |diff| = {gap:.2f} (nothing to slice)")
ckpt = short_cache.checkpoint()
resumed = HybridCache.from_checkpoint(tiny, ckpt, kv={i: tuple(a[:60] for a in long_cache.kv(i))
                                                      for i in tiny.attn_layers})
model.prefill(base[60:], resumed)
print(f"checkpoint at 60 ({ckpt.nbytes:,} B) + shared KV rows, then 40 more tokens == 100-token cache:",
      f"max |diff| < 1e-10: {cache_diff(resumed, long_cache) < 1e-10}")

# %% [markdown]
# **3. Rollback (chapters 7–8).** Speculative decoding appends a few draft tokens and
# then rejects some. For KV, rejecting means forgetting the last rows. For a state there
# is no "minus a token": the delta rule overwrote what was there. The way back is a
# snapshot taken before the drafts (`cache.truncate(n, checkpoint)` refuses to roll a
# KDA cache back without one), or *replay*: keep the layer's projected inputs
# (`capture`, one `KDACapture` record per KDA layer) and re-run the recurrence for the
# accepted tokens only.

# %%
snapshot = long_cache.clone()
captured = {}
for t in (65, 66, 67, 68):  # four draft tokens; suppose only the first two are accepted
    model.decode(t, long_cache, capture=captured)
accepted = snapshot.clone()
for t in (65, 66):
    model.decode(t, accepted)
inp = captured[layer_k]
_, replayed = kda.recurrent_kda(inp.q[:2], inp.k[:2], inp.v[:2], inp.g[:2], inp.beta[:2],
                                initial_state=snapshot.kda_state(layer_k))
print("KV after rollback = first 102 rows:", same(long_cache.kv(layer_a)[0][:102], accepted.kv(layer_a)[0]))
print("state after 4 drafts == state after the 2 accepted:",
      bool(np.abs(long_cache.kda_state(layer_k) - accepted.kda_state(layer_k)).max() < 1e-10))
print("replaying 2 captured steps from the snapshot gives it back:", same(replayed, accepted.kda_state(layer_k)))

# %% [markdown]
# **4. Splitting a sequence (chapter 9)** runs into the same wall from the other side:
# plain linear attention's state is a sum, so two halves of a sequence add; KDA's halves
# *compose*, in order, as affine maps `S -> M S + C` (chapter 2). We check it on the
# captured inputs of one layer: the state after 100 tokens is the second half's map
# applied to the first half's state.

# %%
cap = {}
model.prefill(base, model.new_cache(), capture=cap)
c0 = cap[layer_k]
M1, C1 = kda.segment_transition(c0.k[:50], c0.v[:50], c0.g[:50], c0.beta[:50])
M2, C2 = kda.segment_transition(c0.k[50:], c0.v[50:], c0.g[50:], c0.beta[50:])
state_100 = snapshot.kda_state(layer_k)  # the cache after the 100 tokens, before the drafts
S_first = kda.apply_transition(M1, C1, np.zeros_like(C1))
print("M2 (M1 0 + C1) + C2 == state after 100 tokens:", same(kda.apply_transition(M2, C2, S_first), state_100))
print("C1 + C2 (adding the halves) == state after 100 tokens:", bool(np.abs(C1 + C2 - state_100).max() < 1e-10))

# %% [markdown]
# ## Summary
#
# - The reduced hybrid model has the real Kimi Linear mechanisms: KDA layers (projections,
#   kernel-4 causal conv, SiLU, L2 norm, low-rank forget gate, beta, delta-rule
#   recurrence, gated RMSNorm) and NoPE global attention layers, 3 : 1. It is untrained.
# - Its per-request cache has three kinds: KV for global layers (grows with T), and a KDA
#   state plus a conv state per KDA layer (fixed size). `HybridCache` holds them behind a
#   small protocol (`CacheProtocol`) that chapter 4 implements again on pages.
# - Prefill in one piece, in any pieces, and token-by-token decode — one layer loop with
#   three KDA kernels — give the same logits and the same final cache as a from-scratch
#   pass (max |diff| < 1e-10 in float64).
# - At the 48B scale the hybrid stores 73.0–73.9% less cache per request at 128k–1M than
#   an all-MLA model, and holds less from 1,885 tokens on (975 with a bf16 state). On a
#   memory-bound roofline that is a shorter step at batch 1 and 4x (tensor parallelism:
#   8 vs 2) or 3.5x (DP-attention: 56 vs 16) more 1M-token requests per node: 3.75x /
#   3.50x more decode *throughput*, not a shorter time per output token.
# - vLLM makes the mixed cache fit one pool by equalising per-layer pages (1,888-token
#   blocks for the 48B model) and grouping layers; one state then costs 3 KV blocks.
# - The fixed state cannot be paged like KV, sliced to a prefix, or rolled back by
#   truncation — the problems chapters 4–9 solve.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **3.1 A tiny request.** How many bytes does one `tiny` request hold after **1,000**
# tokens, all kinds together? Compute it any way you like (a cache and `nbytes`, or
# the anatomy table above).

# %% tags=["solution"]
c = model.new_cache()
model.prefill(np.zeros(1000, int), c)
answer = c.nbytes  # 1000 x 4,096 B of KV + 196,608 B of KDA states + 55,296 B of conv states

# %%
verify("3.1", answer)

# %% [markdown]
# **3.2 Where KV overtakes the states.** At what context length does the `tiny`
# model's KV cache first become *larger* than its fixed states (KDA + conv together)?
# Give the smallest such number of tokens.

# %% tags=["solution"]
answer = costs.checkpoint_bytes(tiny) // costs.kv_bytes_per_token(tiny) + 1  # 251,904 B fixed, 4,096 B a token

# %%
verify("3.2", answer)

# %% [markdown]
# **3.3 The 48B states.** How many bytes of KDA and conv state does one
# Kimi-Linear-48B request hold, whatever its length?

# %% tags=["solution"]
answer = costs.checkpoint_bytes(kimi_linear_48b)  # 20 layers x (2 MiB fp32 state + bf16 conv state)

# %%
verify("3.3", answer)

# %% [markdown]
# **3.4 (open)** Make a 1 KDA : 1 global variant, `tiny.with_(name="tiny-1to1",
# layer_pattern="KAKAKAKA")`, and rerun the three-way exactness check. Then do the same
# at the 48B scale with `kimi_linear_48b.with_(name="kimi-1to1", layer_pattern=...)`: how
# much of the 75% saving is left, and how many 1M-token requests fit under TP and under
# DP-attention? (The copy keeps the 48B weight model, `cfg.weights`; that the weights
# stay the same is an assumption worth stating.)
#
# **3.5 (open)** Use `capture` to replay a whole prompt through one KDA layer with
# `kda.chunk_kda` and compare its final state with `cache.kda_state(i)`. What else
# (besides q, k, v, g, beta) would you need to store to rebuild the conv state?
