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
# # 2. The KDA state matrix
#
# **What you'll build.** Kimi Delta Attention (KDA), the layer that fills 20 of
# Kimi-Linear-48B's 27 layers, in two exact forms: a token-by-token recurrence and a
# chunkwise form that does the same arithmetic with matrix products. Then the map a
# whole segment applies to the state, `S_out = M S_in + C`.
#
# **What you'll learn.**
# - How KDA grows out of linear attention in three small steps: the delta rule, a
#   forget gate, and a gate per key channel.
# - How the chunkwise form falls out of unrolling the delta rule inside a chunk (a
#   triangular solve, the "UT transform"), and why it is faster on a CPU even though it
#   does *more* arithmetic.
# - That a KDA state has a fixed size, whatever the context length, while a KV cache
#   grows with every token.
# - That KDA states do not add: two halves of a sequence *compose*, in order. Every
#   later chapter (prefix caching, speculative decoding, context parallelism) has to
#   work around this.
#
# **What you'll need.** Chapter 1 (attention and the KV cache), numpy, and matrix
# products. Everything here is float64 arithmetic on random inputs (float32 where
# said); no trained model is involved. Timings are CPU timings on whatever machine runs
# the notebook.
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

from kimilab import costs, kda, plots
from kimilab.config import all_mla_27, kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.kda.testing import PROPERTY_EXAMPLES, random_inputs
from kimilab.notebook import key_results, show_source, show_table
from kimilab.ops.attention import KVCache
from kimilab.timing import best_seconds

plots.use_style()
rng = np.random.default_rng(0)


def max_error(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))


def close(a, b, tol=1e-10):
    """Printed as a boolean: float64 noise must not leak into stored outputs."""
    return max_error(a, b) < tol


def magnitude(x):
    """An error as its nearest power of ten, '~1e-06': rounding noise stays out of stored outputs."""
    return "0" if x == 0 else f"~1e{int(np.round(np.log10(x))):+03d}"


# %%
# Key results (each number is computed here and derived step by step below)
one, tp4, hy = costs.ONE_H200, costs.DEFAULT_DEPLOYMENT, kimi_linear_48b
state_total, kv_token = costs.kda_state_bytes(hy, one), costs.kv_bytes_per_token(hy, one)
state_tp4, kv_token_tp4 = costs.kda_state_bytes(hy, tp4), costs.kv_bytes_per_token(hy, tp4)
flop_ratio = kda.chunk_kda_flops(4096, 4, 64, 64, 64) / kda.recurrent_kda_flops(4096, 4, 64, 64)
(qs, ks, vs, gs, bs), _ = random_inputs(80, 1, 4, 4, seed=11)  # a sequence AB: A = 50 tokens, B = 30
S_A, S_B, S_AB = (kda.chunk_kda(qs[s], ks[s], vs[s], gs[s], bs[s])[1] for s in (np.s_[:50], np.s_[50:], np.s_[:]))
M_B, C_B = kda.segment_transition(ks[50:], vs[50:], gs[50:], bs[50:])
key_results(
    f"A KDA layer keeps an H x K x V state whatever the context: the hybrid's {hy.layer_pattern.count('K')} KDA "
    f"layers hold {state_total / 2**20:.0f} MiB per request (fp32). Its MLA layers' KV cache passes that after "
    f"{state_total / kv_token:,.0f} tokens and is {costs.request_bytes(hy, one, 2**20)['kv'] / state_total:.0f}x "
    f"the state at 1M tokens.",
    f"Under vLLM's TP4 recipe a device holds a quarter of the state ({state_tp4 / 2**20:.0f} MiB) but the whole "
    f"MLA latent, so the KV passes it after {state_tp4 / kv_token_tp4:,.0f} tokens.",
    f"The chunkwise form equals the token-by-token recurrence to float64 rounding; at chunk 64 it does "
    f"{flop_ratio:.2f}x the recurrence's arithmetic, in large matrix products that a CPU runs faster.",
    f"States do not add: split 50 + 30 tokens, S(A) + S(B) misses S(AB) by up to "
    f"{max_error(S_A + S_B, S_AB):.3f}; the segment map M_B S(A) + C_B equals S(AB) to < 1e-10: "
    f"{close(kda.apply_transition(M_B, C_B, S_A), S_AB)}.",
)

# %% [markdown]
# ## Step 0: linear attention keeps a K x V matrix
#
# <a id="term-state"></a>Drop the softmax from causal attention and the output at step t
# is `o_t = sum_{s<=t} (q_t . k_s) v_s = (sum_{s<=t} k_s v_s^T)^T q_t`. The sum in
# brackets is a K x V matrix, the **state** `S`. Each token *adds* `k_t v_t^T` to it
# and reads it with its query. The state has the same size at token 10 and at token
# 10 million. We check the recurrence against the quadratic form, which is attention
# with its softmax dropped:

# %%
T, K, V = 12, 4, 3
q = kda.l2_normalize(rng.standard_normal((T, K)))
k = kda.l2_normalize(rng.standard_normal((T, K)))
v = rng.standard_normal((T, V))

S = np.zeros((K, V))
outputs = []
for t in range(T):
    S = S + np.outer(k[t], v[t])  # linear attention: add k v^T
    outputs.append(S.T @ q[t])  # read with the query
quadratic = np.tril(q @ k.T) @ v  # the same thing as causal "attention" without softmax
print(f"state shape {S.shape} after {T} tokens; recurrence == quadratic form: {close(outputs, quadratic)}")

# %% [markdown]
# ## Step 1: the delta rule overwrites instead of adding
#
# <a id="term-delta-rule"></a>Adding has a flaw: write the same key twice and the state
# returns the *sum* of the two values. The **delta rule** first reads what the state
# currently holds for `k_t`, `S^T k_t`, and writes only the difference, with a strength
# `beta_t` in (0, 1): `S <- S + beta_t k_t (v_t - S^T k_t)^T`. With `beta = 1` and a
# unit key, the new value replaces the old one:

# %%
key = kda.l2_normalize(np.array([1.0, 2.0, 0.0, -1.0]))
v_old, v_new = np.array([1.0, 0.0, 0.0]), np.array([0.0, 5.0, 0.0])
S_add, S_delta = np.zeros((K, V)), np.zeros((K, V))
for value in (v_old, v_new):
    S_add = S_add + np.outer(key, value)
    S_delta = S_delta + 1.0 * np.outer(key, value - S_delta.T @ key)
print("read back after writing v_old then v_new under the same key")
print("  linear attention:", np.round(S_add.T @ key, 3))
print("  delta rule:      ", np.round(S_delta.T @ key, 3))

# %% [markdown]
# With many keys that overlap, later writes disturb earlier ones. The deep dive stores N
# pairs in a 16 x 16 state: the delta rule recalls them better than linear attention,
# but its error still passes 1 (worse than reading back zero) at 29 pairs.
#
# ### Deep dive: how many pairs a 16 x 16 state recalls
#
# We store N (key, value) pairs in a K = 16 state and read every value back with its own
# key. Both rules build the state from writes along keys, `S = sum_i k_i u_i^T`
# (`u_i = v_i` for linear attention, the corrected value for the delta rule), so reading
# key `k_j` returns `S^T k_j = sum_i (k_i . k_j) u_i`: every stored pair whose key
# overlaps `k_j` leaks into the read. So:
#
# - with **orthonormal** keys (possible only while N <= K), both rules read back every
#   value exactly;
# - with random unit keys, which overlap, each delta write `beta k_t (v_t - S^T k_t)^T`
#   makes the read of key t exact at that moment but also shifts the read of every
#   earlier key j by `(k_j . k_t)` times the correction: later writes disturb earlier
#   ones. Past N = K the keys cannot all be orthogonal, and the state has only K
#   independent directions to hold N values.

# %%
def readback_error(n_pairs, rule, K=16, V=16, seed=1, orthonormal=False):
    """Mean relative error reading back n_pairs stored (key, value) pairs."""
    r = np.random.default_rng(seed)
    keys = kda.l2_normalize(r.standard_normal((n_pairs, K)))
    if orthonormal:  # rows of a random orthogonal matrix: needs n_pairs <= K
        keys = np.linalg.qr(r.standard_normal((K, K)))[0][:n_pairs]
    values = r.standard_normal((n_pairs, V))
    S = np.zeros((K, V))
    for key_t, value_t in zip(keys, values):
        if rule == "linear-attention":
            S += np.outer(key_t, value_t)
        else:
            S += np.outer(key_t, value_t - S.T @ key_t)  # beta = 1
    errors = np.linalg.norm(keys @ S - values, axis=1) / np.linalg.norm(values, axis=1)
    return float(errors.mean())


pairs = np.arange(1, 65)
fig, ax = plt.subplots()
for rule in ("linear-attention", "delta-rule"):
    ax.plot(pairs, [readback_error(int(n), rule) for n in pairs], **plots.style_of(rule))
orth_pairs = pairs[pairs <= 16]
orth_errors = [readback_error(int(n), "delta-rule", orthonormal=True) for n in orth_pairs]
ax.plot(orth_pairs, orth_errors, linestyle="--", marker="o", color=plots.color("delta-rule"),
        label=f"{plots.label('delta-rule')}, orthonormal keys (N <= K)")
ax.axvline(16, linestyle=":", color=plots.color("analytic"), label="key dimension K = 16")
ax.set_xlabel("pairs stored in the state (count)")
ax.set_ylabel("mean relative read-back error (ratio)")
ax.set_title("Recalling stored values from a 16 x 16 state")
ax.legend()
plots.save(fig, "ch02-readback")
plt.show()
worst_orth = max(max(readback_error(n, rule, orthonormal=True) for n in range(1, 17))
                 for rule in ("linear-attention", "delta-rule"))
first_above = next(int(n) for n in pairs if readback_error(int(n), "delta-rule") > 1)
print(f"delta rule: error first above 1 at {first_above} pairs")
print(f"orthonormal keys, 1..16 pairs, both rules: largest error {magnitude(worst_orth)} (float64 rounding)")
show_table([(n, readback_error(n, "linear-attention"), readback_error(n, "delta-rule")) for n in (1, 8, 16, 32, 64)],
           ["pairs", "linear attention", "delta rule"], formats={"linear attention": ".2f", "delta rule": ".2f"},
           title="Mean relative read-back error, random unit keys")

# %% [markdown]
# *Takeaway:* with orthonormal keys and N <= K the read-back is exact (the dashed line
# sits at 0). With overlapping random keys both rules recall only a single pair
# exactly; beyond that the delta rule's error is lower at every count printed, but it
# still grows: 0.80 at 16 pairs, first above 1 at 29 pairs, 1.20 at 64. An error above
# 1 means the read-back is further from the stored value than a read of zero would be:
# those pairs are effectively overwritten. Linear attention's interference piles up
# faster (2.03 at 64).

# %% [markdown]
# ## Step 2: a forget gate (the gated delta rule)
#
# A state that never forgets fills up. The **gated delta rule** multiplies the whole
# state by a decay `alpha_t` in (0, 1] before the delta step: `S <- alpha_t S`, then
# the correction. One scalar per head and token decides how much of the past to keep.
#
# ## Step 3: one gate per key channel (KDA)
#
# <a id="term-kda"></a>**KDA** makes the decay a vector: each of the K key channels (rows
# of `S`) has its own forget rate, `S <- diag(exp(g_t)) S`, with `g_t` a vector of
# natural-log decays (`g <= 0`). Some channels can keep information for hundreds of
# tokens while others forget within a few. Per head, in the notation of the Kimi Linear
# tech report (arXiv:2510.26692, [kimi-report](references.md#kimi-report)) and of
# flash-linear-attention's KDA kernels ([fla](references.md#fla)):
#
# ```
# S <- diag(exp(g_t)) S                 # decay each key-row
# S <- S + beta_t k_t (v_t - S^T k_t)^T # delta-rule correction
# o_t = S^T (scale q_t)                 # output reads the UPDATED state
# ```
#
# This is the package's one-token update, shared by the sequence loop and by decode:

# %%
show_source(kda.kda_update)

# %% [markdown]
# The deep dive lists the sequence loop `recurrent_kda`, checks that steps 1 and 2 are
# KDA with `g = 0` and with one `g` per head, and shows how a layer makes its gates: in
# a two-head example, channel half-lives range from 0.4 to 693.1 tokens.
#
# ### Deep dive: the sequence loop, the special cases, and where g and beta come from

# %%
show_source(kda.recurrent_kda)

# %% [markdown]
# The earlier steps are special cases of this kernel: the delta rule is KDA with
# `g = 0`; the gated delta rule is KDA with the same `g` in every channel. (The
# hand-written loops below read with `scale = 1`.)

# %%
def delta_rule(q, k, v, beta, alpha=None):
    """The hand-written (gated) delta rule of steps 1-2, one head."""
    S = np.zeros((k.shape[1], v.shape[1]))
    out = []
    for t in range(len(k)):
        if alpha is not None:
            S = alpha[t] * S
        S = S + beta[t] * np.outer(k[t], v[t] - S.T @ k[t])
        out.append(S.T @ q[t])
    return np.array(out)


beta = kda.beta_from_logits(rng.standard_normal(T))
alpha = np.exp(-rng.uniform(0.0, 0.5, T))
as_heads = lambda x: x[:, None]  # noqa: E731  [T, ...] -> [T, H=1, ...]
o_delta, _ = kda.recurrent_kda(as_heads(q), as_heads(k), as_heads(v), np.zeros((T, 1, K)), as_heads(beta), scale=1.0)
g_shared = np.repeat(np.log(alpha)[:, None, None], K, axis=2)  # the same decay in every channel
o_gated, _ = kda.recurrent_kda(as_heads(q), as_heads(k), as_heads(v), g_shared, as_heads(beta), scale=1.0)
print("delta rule       == KDA with g = 0:             ", close(delta_rule(q, k, v, beta), o_delta[:, 0]))
print("gated delta rule == KDA with one g per head:    ", close(delta_rule(q, k, v, beta, alpha), o_gated[:, 0]))

# %% [markdown]
# In the layer (chapter 3) a low-rank projection of the token produces a raw gate per
# head and channel. KDA's gate turns it into a decay with a per-head scale
# `exp(A_log[h])` and a per-channel bias; an optional bounded form keeps every decay
# in (lower_bound, 0). `beta` is a sigmoid of another projection.

# %%
show_source(kda.kda_gate)

# %%
H_demo, K_demo = 2, 6
A_log = np.log(np.array([1.0, 16.0]))  # a slow head and a fast head
dt_bias = np.log(np.expm1(np.tile(np.geomspace(1e-3, 1e-1, K_demo), H_demo)))  # softplus(dt_bias): 0.001 .. 0.1
g_demo = kda.kda_gate(np.zeros((1, H_demo, K_demo)), A_log, dt_bias)[0]
half_life = np.log(0.5) / g_demo  # tokens until a channel keeps half of what it held
for h in range(H_demo):
    print(f"head {h} (exp(A_log) = {np.exp(A_log[h]):4.1f}): per-channel half-life in tokens",
          np.round(half_life[h], 1))

# %% [markdown]
# ## The chunkwise form
#
# <a id="term-chunkwise-form"></a>The recurrence runs T tiny steps, each a handful of
# K x V operations. On a CPU (or a GPU) that is slow: every step pays call overhead and
# cannot use matrix-multiply hardware. The **chunkwise form** cuts the sequence into
# chunks of C tokens (C = 64 by default) and, inside each chunk, rewrites the C delta
# steps as a few C x C and C x K matrix products. It is derived by unrolling the
# recurrence inside one chunk.
#
# ### Unrolling the delta rule inside a chunk
#
# Take one chunk, number its tokens i = 1..c, and let `S` be the state entering it. Let
# `G_i = g_1 + ... + g_i` (a vector over the K channels) be the cumulative log-decay
# from the start of the chunk through token i, and `D_i = diag(exp(G_i))`. Write
# `u_i` for the value token i actually writes, so that one step is
#
# $$S_i = \mathrm{diag}(e^{g_i})\, S_{i-1} + k_i u_i^\top, \qquad
#   u_i = \beta_i \big(v_i - (\mathrm{diag}(e^{g_i}) S_{i-1})^\top k_i\big).$$
#
# **The state.** Unrolling the first equation from `S_0 = S`, each write `k_j u_j^T` is
# decayed by the gates of the tokens after it:
#
# $$S_i = D_i S + \sum_{j \le i} D_i D_j^{-1} k_j u_j^\top .$$
#
# **The writes.** Put that (for `S_{i-1}`, decayed by `e^{g_i}`) into `u_i`. The
# product `k_i^T D_i D_j^{-1} k_j` is a decayed key-key score,
# `Akk[i,j] = sum_d k_id k_jd exp(G_id - G_jd)`, and
#
# $$u_i + \beta_i \sum_{j<i} A^{kk}_{ij}\, u_j = \beta_i \big(v_i - S^\top (e^{G_i} \odot k_i)\big).$$
#
# Stacked over the chunk's rows this is one lower-triangular system,
# `(I + diag(beta) StrictTril(Akk)) V' = diag(beta) (V - (exp(G) * K) S)`, with `V'`
# the matrix of rows `u_i`. Call `T = (I + diag(beta) StrictTril(Akk))^-1 diag(beta)`
# and split the right-hand side:
#
# $$V' = \underbrace{T V}_{U} - \underbrace{T (e^{G} \odot K)}_{W}\, S .$$
#
# `T`, `W` and `U` do not depend on `S`: they can be computed for every chunk at once.
# Only `V' = U - W S` needs the state. `T` itself is found row by row, by **forward
# substitution**: `T_i = beta_i (e_i - sum_{j<i} Akk[i,j] T_j)`. That is the delta
# rule's sequential dependence again, now on c x c numbers instead of K x V states
# (this compact form of a product of rank-one updates is the "WY" or "UT" transform of
# DeltaNet's chunkwise algorithm: Yang et al., *Parallelizing Linear Transformers with
# the Delta Rule over Sequence Length*, NeurIPS 2024, arXiv:2406.06484).
#
# **The outputs and the next state.** `o_i = S_i^T q_i` with the unrolled state gives a
# part read from the entering state plus decayed query-key scores
# `Aqk[i,j] = sum_d q_id k_jd exp(G_id - G_jd)` (j <= i) over the chunk's writes, and
# the state leaving the chunk is the unrolled state at i = c:
#
# $$o_i = (e^{G_i} \odot q_i)^\top S + \sum_{j \le i} A^{qk}_{ij} u_j, \qquad
#   S \leftarrow \mathrm{diag}(e^{G_c})\, S + (e^{G_c - G} \odot K)^\top V' .$$
#
# `kda.naive_chunk_kda` is exactly this, for one head in float64, with explicit loops
# over chunks and rows (listed in the deep dive below). It reproduces the recurrence,
# for chunk sizes that do and do not divide T:

# %%
(q1, k1, v1, g1, b1), S1 = random_inputs(100, 1, 8, 6, seed=21)
o_rec, s_rec = kda.recurrent_kda(q1, k1, v1, g1, b1, initial_state=S1)
naive_ok = {}
for C_ in (1, 7, 16, 64, 100):
    o_nv, s_nv = kda.naive_chunk_kda(q1[:, 0], k1[:, 0], v1[:, 0], g1[:, 0], b1[:, 0], initial_state=S1[0],
                                     chunk_size=C_)
    naive_ok[C_] = close(o_nv, o_rec[:, 0]) and close(s_nv, s_rec[0])
print(f"T=100, chunk sizes {list(naive_ok)}:")
print(f"  naive chunked == recurrent (outputs and state): {list(naive_ok.values())}")

# %% [markdown]
# Decoding uses the one-token step, `kda_step`; a loop of steps equals the sequence
# kernel, so a request can be prefilled in chunks and then decoded token by token:

# %%
args, S0 = random_inputs(40, 2, 8, 8, seed=3)
o_seq, s_seq = kda.recurrent_kda(*args, initial_state=S0)
S_loop, outs = S0, []
for t in range(40):
    o_t, S_loop = kda.kda_step(*(x[t] for x in args), S_loop)
    outs.append(o_t)
print(f"40 kda_step calls == recurrent_kda: outputs {close(outs, o_seq)}, state {close(S_loop, s_seq)}")

# %% [markdown]
# The deep dives list both chunked kernels, check the optimised `chunk_kda` against the
# recurrence (5 shapes here, 120 random ones in the tests) and measure float32 rounding:
# with strong gates the chunked form's error is ~1e-05, the recurrence's ~1e-07.
#
# ### Deep dive: the two chunked kernels, listed
#
# The naive twin, line by line as derived above:

# %%
show_source(kda.naive_chunk_kda, limit=None)

# %% [markdown]
# `kda.chunk_kda` runs the same algebra fast, for many heads and a batch at once:
#
# - everything that does not depend on the state (`Akk`, `Aqk`, `W`, `U`, the decay
#   factors) is computed for a slab of chunks and all heads in a few batched matrix
#   products; only `V' = U - W S`, the state update and one output product per slab
#   walk the chunks in order;
# - `W` and `U` come from one *block* forward substitution on
#   `[beta exp(G) K | beta V]`: 16 x 16 diagonal blocks are inverted, and each block row
#   of the solution is one product with the rows already solved. No c x c inverse is
#   formed (`make bench` times this against `np.linalg.solve`);
# - `exp(G_i - G_j)` above the diagonal is a *growth* that overflows for strong gates,
#   so it is never formed: the pair exponent is split as `exp(G_i - G_r) exp(G_r - G_j)`
#   around the first row r of a block of rows, with blocks small enough that both
#   factors stay within `e^(±60)` in float32 (`e^(±300)` in float64); strong gates get
#   smaller blocks, down to one row;
# - decays below `1e-10` (float32) are set to exactly 0, which keeps subnormal numbers,
#   which make BLAS slow, out of the products.
#
# Its public entry point:

# %%
show_source(kda.chunk_kda)

# %% [markdown]
# ### Deep dive: chunked == recurrent, in float64 and in float32
#
# The three forms must agree to rounding error. We try ragged lengths, chunk sizes that
# do not divide T, strong and weak gates, with and without an initial state, in float64;
# the naive twin runs on the first head. The test suite (`tests/test_kda.py`) does the
# same with hypothesis, over the number of random shapes the next cell prints. The
# inputs come from `random_inputs` in `kimilab.kda.testing`, the one seeded generator
# the tests and `make bench` draw from too: `"kimi-init"` gates are those of a freshly
# initialised layer, `"strong"` ones decay by up to e^-20 per step.

# %%
print(f"tests/test_kda.py draws {PROPERTY_EXAMPLES} random shapes for chunked == recurrent in float64")
rows = []
for T_, C_, gate, with_state in [(64, 64, "kimi-init", False), (100, 64, "kimi-init", True), (257, 64, "strong", True),
                                 (77, 16, "kimi-init", True), (33, 7, "strong", False)]:
    args, S0 = random_inputs(T_, 3, 16, 8, seed=T_, gate=gate)
    init = S0 if with_state else None
    o_r, s_r = kda.recurrent_kda(*args, initial_state=init)
    o_c, s_c = kda.chunk_kda(*args, initial_state=init, chunk_size=C_)
    o_n, s_n = kda.naive_chunk_kda(*(x[:, 0] for x in args), initial_state=None if init is None else init[0],
                                   chunk_size=C_)
    rows.append((T_, C_, gate, str(with_state), f"{close(o_c, o_r)}, {close(s_c, s_r)}",
                 f"{close(o_n, o_r[:, 0])}, {close(s_n, s_r[0])}"))
show_table(rows, ["T", "chunk", "gates", "S0", "chunk_kda (o, S)", "naive, head 0 (o, S)"],
           title="max |chunked - recurrent| < 1e-10, float64")

# %% [markdown]
# In float32 (how the model is served) both forms make rounding errors; how large? We
# run each in float32 and compare with the recurrence in float64 on the same (float32)
# inputs, as a relative error `max |o - o_ref| / max |o_ref|`, for the chapter's two
# kinds of gates, at the default chunk of 64. Errors are printed as their nearest power
# of ten: the exact digits depend on the CPU's BLAS.

# %%
def float32_errors(gate, chunk_size=64, T=1000, H=4, K=64, seed=5):
    """Relative float32 errors (recurrent, chunked) of outputs against a float64 recurrence."""
    args32, S32 = random_inputs(T, H, K, K, seed=seed, dtype=np.float32, gate=gate)
    o_ref, _ = kda.recurrent_kda(*(x.astype(np.float64) for x in args32), initial_state=S32.astype(np.float64))
    o_rec32, _ = kda.recurrent_kda(*args32, initial_state=S32)
    o_chk32, _ = kda.chunk_kda(*args32, initial_state=S32, chunk_size=chunk_size)
    assert o_chk32.dtype == np.float32
    scale = np.abs(o_ref).max()
    return max_error(o_rec32, o_ref) / scale, max_error(o_chk32, o_ref) / scale


show_table([(gate, *(magnitude(e) for e in float32_errors(gate))) for gate in ("kimi-init", "strong")],
           ["gates", "recurrent", "chunked"],
           title="float32, T=1000, H=4, K=V=64, chunk 64: relative error vs a float64 reference")

# %% [markdown]
# With the gentle gates of a freshly initialised layer both forms are at float32
# rounding, about 1e-7. With strong gates the chunked form is about 30 times worse
# on the machine that built the book (exact digits in the chunk-size deep dive's
# wall-clock cell): inside a chunk it works with the *cumulative* gate `G`, which for
# strong gates reaches hundreds, and a neighbour decay `exp(G_i - G_j)` is then the
# difference of two large float32 numbers, whose rounding grows with C. The recurrence
# multiplies one `exp(g_t)` per step. The chunk-size sweep shows the error growing with C.

# %% [markdown]
# ## The state never grows
#
# A KDA layer's whole memory of the past is `H x K x V` numbers per request, whatever
# the context. We measure it on the book's `tiny` shapes beside a KV cache for one
# global layer of the same width:

# %%
H_t, D_t = tiny.n_heads, tiny.head_dim
rows = []
for n_tokens in (64, 512, 4096):
    args, _ = random_inputs(n_tokens, H_t, D_t, D_t, seed=1)
    _, state = kda.chunk_kda(*args)
    kv = KVCache(H_t, D_t, dtype="float64")
    kv.append(rng.standard_normal((n_tokens, H_t, D_t)), rng.standard_normal((n_tokens, H_t, D_t)))
    rows.append((n_tokens, state.nbytes, kv.nbytes))
show_table(rows, ["tokens", "KDA state (B)", "KV cache, 1 layer (B)"],
           title=f"tiny: {H_t} heads, K = V = {D_t}, {tiny.dtype}; analytic KDA state per layer "
                 f"{costs.kda_state_bytes_per_layer(tiny, costs.LOCAL):,d} B")

# %% [markdown]
# At real scale (Kimi-Linear-48B's `config.json`, [kimi-config](references.md#kimi-config):
# 20 KDA layers of 32 heads with K = V = 128) the state is counted in fp32: the report
# gives no state dtype; fp32 is what vLLM allocates for KDA's recurrent state
# ([vllm](references.md#vllm)), and chapter 3 also prices a bf16 state.
#
# Bytes are per device. With the whole model on one device (`costs.ONE_H200`) they are
# the model's own. Under vLLM's tensor-parallel recipe (`costs.DEFAULT_DEPLOYMENT`, 4
# devices) each device holds a quarter of every state (the KDA heads are split) but the
# whole MLA latent, one head that cannot be split ([vllm](references.md#vllm); chapter 3).

# %%
print(f"{one.describe()}:")
print(f"  KDA state {state_total / 2**20:.0f} MiB per request ({costs.kda_state_bytes_per_layer(hy, one) / 2**20:.0f} "
      f"MiB per layer x {hy.layer_pattern.count('K')} layers), conv states {costs.conv_state_bytes(hy, one) / 2**20:.1f} MiB")
print(f"  the 7 MLA layers cache {kv_token:,d} B per token: as many bytes as the 20 KDA states after "
      f"{state_total / kv_token:,.0f} tokens")
kv_1m = costs.request_bytes(hy, one, 2**20)["kv"]
print(f"  at 1M tokens: KV cache {kv_1m / 1e9:.2f} GB = {kv_1m / state_total:.0f} x the KDA state "
      f"({state_total / 1e9:.3f} GB)")
print(f"{tp4.describe()}:")
print(f"  per device {state_tp4 / 2**20:.0f} MiB of KDA state and {kv_token_tp4:,d} B of KV per token: equal "
      f"after {state_tp4 / kv_token_tp4:,.0f} tokens")

lengths = np.unique(np.logspace(np.log10(1024), np.log10(2**20), 40).astype(int))
fig, ax = plt.subplots()
ax.loglog(lengths, [costs.request_bytes(all_mla_27, one, int(n))["kv"] / 1e9 for n in lengths],
          **plots.style_of("all-mla"))
ax.loglog(lengths, [costs.request_bytes(hy, one, int(n))["kv"] / 1e9 for n in lengths], linestyle="--",
          color=plots.color("kv-cache"), label=f"{plots.label('kv-cache')}, hybrid's 7 MLA layers")
for state, style, where in ((state_total, "-", "hybrid's 20 KDA layers (fp32)"),
                            (state_tp4, ":", f"one device of {tp4.name} (a quarter)")):
    ax.loglog(lengths, np.full(len(lengths), state / 1e9), linestyle=style, color=plots.color("kda-state"),
              label=f"{plots.label('kda-state')}, {where}")
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("bytes of ONE request per device (GB)")
ax.set_title(f"Kimi-Linear-48B: growing KV cache vs fixed KDA state ({one.name} unless named)")
ax.legend(loc="upper left")
plots.save(fig, "ch02-state-vs-kv")
plt.show()

# %% [markdown]
# *Takeaway:* with the whole model on one device the KDA state is a flat line at
# 0.04 GB; past about 5.2k tokens the seven MLA layers' KV cache is the larger part of a
# request, and at 1M tokens it is 202 times the state. On one device of the TP4 recipe
# the state is a quarter as large and the KV the same, so the KV passes it already at
# about 1.3k tokens.

# %% [markdown]
# ## States do not add
#
# Linear attention's state is a sum, `S = sum_t k_t v_t^T`, so the state of a sequence
# AB is the state of A plus the state of B: two workers could each summarise half and
# add. KDA's is not: the decay and the delta correction of segment B act on whatever
# state B starts from.
#
# <a id="term-segment-transition"></a>So a segment B is an **affine map** of its input
# state, `S_out = M_B S_in + C_B`, its *segment transition*. `M_B` (K x K per head) is
# the product over B's chunks of `diag(exp(G_C)) - (exp(G_C - G) K)^T W`; `C_B` is the
# state B reaches from zero. Halves *compose*, in order. The key results cell split 80
# tokens into A (the first 50) and B (the last 30); its numbers beside linear attention:

# %%
A, B = slice(0, 50), slice(50, 80)
lin_A, lin_B, lin_AB = (kda.linear_attention_state(ks[s], vs[s]) for s in (A, B, slice(0, 80)))
S_AB_composed = kda.apply_transition(M_B, C_B, S_A)
show_table([(kind, what, max_error(x, y), str(close(x, y))) for kind, what, x, y in (
               ("linear attention", "S(A) + S(B) vs S(AB)", lin_A + lin_B, lin_AB),
               ("KDA", "S(A) + S(B) vs S(AB)", S_A + S_B, S_AB),
               ("KDA", "M_B S(A) + C_B vs S(AB)", S_AB_composed, S_AB),
               ("KDA", "C_B vs S(B) from zero", C_B, S_B))],
           ["state", "compared", "max |difference|", "< 1e-10"], formats={"max |difference|": ".3f"},
           title="Two segments of one sequence, head 0: adding vs composing")

# %% [markdown]
# Composition is associative, so the transitions of many segments can be combined in
# a tree (chapter 9 uses this for context parallelism, where fla all-gathers per-rank
# `(M, S)` pairs and merges them in rank order), but never reordered:

# %%
(q3, k3, v3, g3, b3), S0 = random_inputs(150, 2, 8, 8, seed=12)
cuts = [0, 40, 97, 150]
maps = [kda.segment_transition(k3[a:b], v3[a:b], g3[a:b], b3[a:b]) for a, b in zip(cuts, cuts[1:])]
left_to_right = kda.compose_transitions(kda.compose_transitions(maps[0], maps[1]), maps[2])
tree = kda.compose_transitions(maps[0], kda.compose_transitions(maps[1], maps[2]))
reordered = kda.compose_transitions(kda.compose_transitions(maps[1], maps[0]), maps[2])
_, S_whole = kda.recurrent_kda(q3, k3, v3, g3, b3, initial_state=S0)
print("3 segments, composed left to right == whole:", close(kda.apply_transition(*left_to_right, S0), S_whole))
print("3 segments, composed as a tree      == whole:", close(kda.apply_transition(*tree, S0), S_whole))
print("first two segments swapped          == whole:", close(kda.apply_transition(*reordered, S0), S_whole))

# %% [markdown]
# The deep dive lists `segment_transition`: it runs the chunked update on an augmented
# state `[C | M]`, K x (V + K) per head, started from `[0 | I]`.
#
# ### Deep dive: how segment_transition builds M and C

# %%
show_source(kda.segment_transition)

# %% [markdown]
# ## Cost: counted FLOPs and measured time
#
# Counted per chunk (`kda.chunk_kda_flops`), the chunkwise form does *more* arithmetic
# than the recurrence: it builds C x C matrices the recurrence never forms. Yet on a CPU
# it runs faster, because its work is a few large batched matrix products instead of a
# handful of small numpy calls per token.

# %%
H_b, K_b = 4, 64
T_values = np.array([128, 256, 512, 1024, 2048, 4096])
flops_rec = np.array([kda.recurrent_kda_flops(int(t), H_b, K_b, K_b) for t in T_values])
flops_chunk = np.array([kda.chunk_kda_flops(int(t), H_b, K_b, K_b, 64) for t in T_values])
print(f"H={H_b}, K=V={K_b}, chunk 64: chunked / recurrent FLOPs = {np.unique(np.round(flops_chunk / flops_rec, 2))} "
      f"at T = {T_values.min()} ... {T_values.max()}")

# %% [markdown]
# **Verdict.** KDA replaces a cache that grows with every token by a fixed state (a byte
# verdict: it holds at every context length, and the KV of the hybrid's 7 MLA layers
# passes the state within a few thousand tokens). The chunked form computes it exactly,
# with about 2.1x the arithmetic at chunk 64 but faster on this CPU (a CPU timing:
# machine-dependent). The price is that states compose in order instead of adding.
# The deep dives count the FLOPs against T, time both forms, and sweep the chunk size:
# on the machine that built the book chunks of 16 and 32 were as fast as 64 or faster,
# and 256 did 5.49x the recurrence's arithmetic.
#
# ### Deep dive: the FLOP count and measured time
#
# The count follows the products `chunk_kda` runs, including its block forward
# substitution (no inverse is formed, so none is counted). These counts are exact and
# machine-independent:

# %%
show_source(kda.chunk_kda_flops)

# %%
fig, ax = plt.subplots()
ax.loglog(T_values, flops_rec / 1e6, marker="o", **plots.style_of("recurrent"))
ax.loglog(T_values, flops_chunk / 1e6, marker="s", **plots.style_of("chunked"))
ax.set_xscale("log", base=2)
ax.set_xticks(T_values, [str(t) for t in T_values])
ax.minorticks_off()
ax.set_xlabel("sequence length T (tokens)")
ax.set_ylabel("counted work (MFLOP)")
ax.set_title(f"KDA arithmetic, H={H_b}, K=V={K_b}, chunk 64")
ax.legend()
plots.save(fig, "ch02-flops")
plt.show()
show_table([(int(t), fr / 1e6, fc / 1e6, fc / fr) for t, fr, fc in zip(T_values, flops_rec, flops_chunk)],
           ["T", "recurrent (MFLOP)", "chunked (MFLOP)", "ratio"],
           formats={"recurrent (MFLOP)": ".1f", "chunked (MFLOP)": ".1f", "ratio": ".2f"},
           title=f"Counted KDA work, H={H_b}, K=V={K_b}, chunk 64")

# %% [markdown]
# Both grow linearly in T (no T^2 term, unlike attention). Measured on this machine
# (float32, best of 1-3 runs; wall-clock numbers change from run to run):

# %%
# NBVAL_IGNORE_OUTPUT
times_rec, times_chunk = [], []
for t in T_values:
    args, _ = random_inputs(int(t), H_b, K_b, K_b, seed=0, dtype=np.float32)
    times_rec.append(best_seconds(lambda: kda.recurrent_kda(*args), repeats=1 if t >= 2048 else 2))
    times_chunk.append(best_seconds(lambda: kda.chunk_kda(*args)))
fig, ax = plt.subplots()
ax.loglog(T_values, 1e3 * np.array(times_rec), marker="o", **plots.style_of("recurrent"))
ax.loglog(T_values, 1e3 * np.array(times_chunk), marker="s", **plots.style_of("chunked"))
ax.set_xscale("log", base=2)
ax.set_xticks(T_values, [str(t) for t in T_values])
ax.minorticks_off()
ax.set_xlabel("sequence length T (tokens)")
ax.set_ylabel("wall-clock time (ms, best of 1-3 runs)")
ax.set_title(f"KDA on this CPU, H={H_b}, K=V={K_b}, float32")
ax.legend()
plots.save(fig, "ch02-runtime")
plt.show()
show_table([(int(t), 1e3 * tr, 1e3 * tc, tr / tc) for t, tr, tc in zip(T_values, times_rec, times_chunk)],
           ["T", "recurrent (ms)", "chunked (ms)", "speed-up (x)"],
           formats={"recurrent (ms)": ".1f", "chunked (ms)": ".1f", "speed-up (x)": ".1f"},
           title="Measured time on this CPU, float32")

# %% [markdown]
# *Takeaway:* on the machine that built the book the chunked form was the faster one at
# every length shown despite its larger FLOP count (the speed-ups printed above);
# `make bench` measures the ratio at T = 4096 and compares it with
# flash-linear-attention's PyTorch reference. Prefill (many tokens at once) uses the
# chunked form; decode (one token) uses `kda_step`.
#
# ### Deep dive: choosing the chunk size
#
# C trades arithmetic against sequential steps. Per token, the chunk's C x C work
# (`Akk`, `Aqk`, the solve, the in-chunk part of the output) grows like C, while the
# number of state steps (and of Python-level loop iterations) falls like T / C. We sweep
# C = 16 ... 256 at T = 4096 (H = 4, K = V = 64): counted FLOPs against the recurrence,
# the float64 error against the recurrence (max absolute difference of the outputs),
# and the float32 error with strong gates (relative to a float64 reference). All three
# are deterministic:

# %%
chunk_sizes = [16, 32, 64, 128, 256]
T_sweep = int(T_values[-1])
args_sweep, _ = random_inputs(T_sweep, H_b, K_b, K_b, seed=0)
o_ref_sweep, _ = kda.recurrent_kda(*args_sweep)
sweep = {}
for C_ in chunk_sizes:
    o_sweep, _ = kda.chunk_kda(*args_sweep, chunk_size=C_)
    ratio = kda.chunk_kda_flops(T_sweep, H_b, K_b, K_b, C_) / kda.recurrent_kda_flops(T_sweep, H_b, K_b, K_b)
    sweep[C_] = (ratio, max_error(o_sweep, o_ref_sweep), float32_errors("strong", chunk_size=C_)[1])
show_table([(C_, r, magnitude(e64), magnitude(e32)) for C_, (r, e64, e32) in sweep.items()],
           ["chunk", "FLOPs / recurrent", "float64 error", "float32 error, strong gates"],
           formats={"FLOPs / recurrent": ".2f"}, title=f"Chunk-size sweep, T={T_sweep}, H={H_b}, K=V={K_b}")

# %% [markdown]
# And the wall time of each chunk size on this machine (float32, best of 3 runs; the
# output of this cell is not checked and will differ on yours). It also prints the
# exact float32 error digits behind the rounded ones above.

# %%
# NBVAL_IGNORE_OUTPUT
args32_sweep, _ = random_inputs(T_sweep, H_b, K_b, K_b, seed=0, dtype=np.float32)
t_rec_sweep = best_seconds(lambda: kda.recurrent_kda(*args32_sweep), repeats=1)
t_sweep = {C_: best_seconds(lambda: kda.chunk_kda(*args32_sweep, chunk_size=C_), repeats=3) for C_ in chunk_sizes}
fastest = min(t_sweep, key=t_sweep.get)
print(f"recurrent: {1e3 * t_rec_sweep:.1f} ms; fastest chunk size on this machine: {fastest} "
      f"({1e3 * t_sweep[fastest]:.1f} ms; default 64: {1e3 * t_sweep[64]:.1f} ms)")
err_rec, err_chunk = float32_errors("strong")
print(f"float32, strong gates, chunk 64: recurrent {err_rec:.1e}, chunked {err_chunk:.1e} ({err_chunk / err_rec:.0f}x)")

fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.6))
ax1.plot(chunk_sizes, [1e3 * t_sweep[c] for c in chunk_sizes], marker="s", **plots.style_of("chunked"))
ax1.axhline(1e3 * t_rec_sweep, linestyle="--", **plots.style_of("recurrent"))
ax1.set_ylim(bottom=0)
ax1.set_ylabel("wall-clock time (ms, this CPU)")
ax1.set_title("time, float32")
ax2.plot(chunk_sizes, [sweep[c][0] for c in chunk_sizes], marker="s", **plots.style_of("chunked"))
ax2.axhline(1.0, linestyle="--", **plots.style_of("recurrent"))
ax2.set_ylabel("counted FLOPs / recurrent (ratio)")
ax2.set_title("arithmetic")
ax3.plot(chunk_sizes, [sweep[c][2] for c in chunk_sizes], marker="s", **plots.style_of("chunked"))
ax3.axhline(err_rec, linestyle="--", **plots.style_of("recurrent"))
ax3.set_yscale("log")
ax3.set_ylabel("relative error vs float64 (ratio)")
ax3.set_title("float32 error, strong gates")
for ax in (ax1, ax2, ax3):
    ax.set_xscale("log", base=2)
    ax.set_xticks(chunk_sizes, [str(c) for c in chunk_sizes])
    ax.minorticks_off()
    ax.set_xlabel("chunk size C (tokens)")
    ax.legend()
fig.suptitle(f"Chunk-size sweep, T={T_sweep}, H={H_b}, K=V={K_b}", y=1.04)
plots.save(fig, "ch02-chunk-sweep")
plt.show()
show_table([(C_, 1e3 * t_sweep[C_], t_rec_sweep / t_sweep[C_], sweep[C_][0], sweep[C_][2]) for C_ in chunk_sizes],
           ["chunk", "ms", "speed-up (x)", "FLOPs / recurrent", "float32 error, strong"],
           formats={"ms": ".1f", "speed-up (x)": ".1f", "FLOPs / recurrent": ".2f", "float32 error, strong": ".1e"},
           title="Chunk sizes on this CPU, float32")

# %% [markdown]
# *Takeaway:* larger chunks cost more arithmetic (1.25x the recurrence at C = 16, 5.49x
# at C = 256) and, with strong gates in float32, more rounding error (about 1e-6 at
# C = 16, 1e-5 at C = 256); in float64 every C is exact to 1e-16 .. 1e-15. Wall time
# does not follow the FLOPs alone: on the machine that built the book (2 shared cores)
# chunks of 16 and 32 were as fast as the default 64 or faster, and 128 and 256 much
# slower (the numbers are in the cell above; on a busy machine the large chunks slow
# down most). The default is the chunk size of flash-linear-attention's KDA kernels
# (`chunk_local_cumsum(g, chunk_size=64)` in `fla/ops/kda/chunk.py`,
# [fla](references.md#fla)), which are tuned for GPU tensor cores, not for this CPU.

# %% [markdown]
# ## Summary
#
# - **Built:** linear attention's K x V state, the delta rule (write only `v - S^T k`),
#   the gated delta rule, and KDA, which forgets per key channel. Unrolled inside a
#   chunk, the delta rule becomes a triangular solve, `V' = U - W S`, with `T`, `W` and
#   `U` independent of the state.
# - **Exact:** `recurrent_kda`, `naive_chunk_kda`, `chunk_kda` and a loop of `kda_step`
#   agree to 1e-10 in float64; in float32 with strong gates the chunked form's rounding
#   grows with the chunk size.
# - **Bytes:** the state is `H x K x V` per layer at any context: 40 MiB for
#   Kimi-Linear-48B's 20 KDA layers on one device, against a KV cache growing by 8,064 B
#   a token in its 7 MLA layers. Tensor parallelism splits the state, not the latent.
# - **The catch:** states do not add. A segment is an affine map `S_out = M S_in + C`,
#   and segments compose in order: prefix caching (chapters 5-6), speculative rollback
#   (7-8) and context parallelism (9) must live with that.
#
# **Next chapter:** how do KDA and global-attention layers combine into one model whose
# prompt gives the same outputs prefilled at once, in pieces, or token by token, and
# what must it keep per request?

# %% [markdown]
# ## Exercises
#
# A checked exercise is three cells: the question, your computation (empty in the
# student edition, `make student`), and `verify("N.M", answer)`, which says "correct" or
# what is off.
#
# **2.1 The state of one layer.** With the whole model on one device
# (`costs.ONE_H200`), how many bytes does ONE Kimi-Linear-48B KDA layer's state take for
# one request? It has 32 heads, K = V = 128, and the state is kept in fp32 (4 bytes).

# %% tags=["solution"]
answer = 32 * 128 * 128 * 4  # H x K x V numbers of 4 bytes: 2 MiB, at 1 token and at 1M tokens

# %%
verify("2.1", answer)

# %% [markdown]
# **2.2 Forgetting (predict, then run).** A gated delta rule with a constant forget gate
# `alpha = 0.99` and no new writes: what fraction of the state is left after 100 tokens?
# Write down a guess first: more than half, or less? Then compute it.

# %% tags=["solution"]
answer = 0.99 ** 100  # each token multiplies the state by alpha

# %%
verify("2.2", answer)

# %% [markdown]
# **2.3 A segment that does nothing.** A segment with `g = 0` (no forgetting) and
# `beta = 0` (no writing) leaves the state unchanged. Compute `segment_transition` for
# such a segment of 10 tokens (H = 1, K = 3, V = 2) and put head 0's `M` in `answer`.

# %% tags=["solution"]
rng = np.random.default_rng(0)
M, C = kda.segment_transition(rng.normal(size=(10, 1, 3)), rng.normal(size=(10, 1, 2)),
                              np.zeros((10, 1, 3)), np.zeros((10, 1)))
answer = M[0]  # the identity (and C = 0): kda.identity_transition

# %%
verify("2.3", answer)

# %% [markdown]
# **2.4 (open, ~45 min)** `naive_chunk_kda` computes every decay as `np.exp(G[i] - G[j])`.
# Change a copy of it to compute `np.exp(G[i]) / np.exp(G[j])` instead, and run both on
# one head of `random_inputs(256, 1, 8, 8, seed=0, gate="extreme")` with `chunk_size=64`,
# against `kda.recurrent_kda`. What goes wrong, and why? Why must `chunk_kda`, which
# uses matrix products, never form `exp(G_i - G_j)` for j > i?
#
# **2.5 KV overtakes the state, per device (predict, then run).** On one device of
# vLLM's TP8 recipe (`costs.VLLM_TP8_H200`: the 48B hybrid with tensor parallelism over
# 8 H200s), what is the smallest context at which one request's MLA KV cache on that
# device holds *more* bytes than its 20 KDA recurrent states on that device (conv states
# left out)? Predict first from the TP4 number above: which of the two do the 8 devices
# split, which does each keep whole, and so is the answer about half of TP4's, or about
# the same? Then compute it.

# %% tags=["solution"]
tp8 = costs.VLLM_TP8_H200
state_tp8 = costs.kda_state_bytes(kimi_linear_48b, tp8)  # 32 heads over 8 devices: 4 heads a layer
answer = state_tp8 // costs.kv_bytes_per_token(kimi_linear_48b, tp8) + 1  # the latent is whole: 8,064 B a token

# %%
verify("2.5", answer)
