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
# - Why the chunkwise form is faster on a CPU even though it does *more* arithmetic.
# - That a KDA state has a fixed size, whatever the context length, while a KV cache
#   grows with every token.
# - That KDA states do not add: two halves of a sequence *compose*, in order. Every
#   later chapter (prefix caching, speculative decoding, context parallelism) has to
#   work around this.
#
# **What you'll need.** Chapter 1 (attention and the KV cache), numpy, and matrix
# products. Everything here is exact float64 arithmetic on random inputs; no trained
# model is involved. Timings are CPU timings on whatever machine runs the notebook.

# %%
import matplotlib.pyplot as plt
import numpy as np

from kimilab import costs, kda, plots
from kimilab.config import all_mla_27, kimi_linear_48b, tiny
from kimilab.exercises import check
from kimilab.kda.testing import random_inputs
from kimilab.notebook import show_source
from kimilab.ops.attention import KVCache
from kimilab.timing import best_seconds

plots.use_style()
rng = np.random.default_rng(0)


def close(a, b, tol=1e-10):
    """Printed as a boolean: float64 noise must not leak into stored outputs."""
    return bool(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0) < tol)


# %% [markdown]
# ## Step 0: linear attention keeps a K x V matrix
#
# Drop the softmax from causal attention and the output at step t is
# `o_t = sum_{s<=t} (q_t . k_s) v_s = (sum_{s<=t} k_s v_s^T)^T q_t`. The sum in
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
# Adding has a flaw: write the same key twice and the state returns the *sum* of the
# two values. The **delta rule** first reads what the state currently holds for
# `k_t`, `S^T k_t`, and writes only the difference, with a strength `beta_t` in (0, 1):
# `S <- S + beta_t k_t (v_t - S^T k_t)^T`. With `beta = 1` and a unit key, the new value
# replaces the old one:

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
# The difference matters once more pairs are stored than the state has room for. We
# store N random (key, value) pairs in a K = 16 state and read every value back with
# its own key:

# %%
def readback_error(n_pairs, rule, K=16, V=16, seed=1):
    """Mean relative error reading back n_pairs stored (key, value) pairs."""
    r = np.random.default_rng(seed)
    keys = kda.l2_normalize(r.standard_normal((n_pairs, K)))
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
ax.axvline(16, linestyle=":", color=plots.color("analytic"), label="key dimension K = 16")
ax.set_xlabel("pairs stored in the state (count)")
ax.set_ylabel("mean relative read-back error (ratio)")
ax.set_title("Recalling stored values from a 16 x 16 state")
ax.legend()
plots.save(fig, "ch02-readback")
plt.show()
print("error with 8 pairs stored: linear attention "
      f"{readback_error(8, 'linear-attention'):.2f}, delta rule {readback_error(8, 'delta-rule'):.2f}")

# %% [markdown]
# *Takeaway:* both recall a single pair exactly. Beyond that the delta rule's error
# is lower at every count and levels off near 1 (old pairs are overwritten), while
# linear attention's interference keeps piling up (error 2 at 64 pairs).
#
# ## Step 2: a forget gate (the gated delta rule)
#
# A state that never forgets fills up. The **gated delta rule** multiplies the whole
# state by a decay `alpha_t` in (0, 1] before the delta step: `S <- alpha_t S`, then
# the correction. One scalar per head and token decides how much of the past to keep.
#
# ## Step 3: one gate per key channel (KDA)
#
# KDA makes the decay a vector: each of the K key channels (rows of `S`) has its own
# forget rate, `S <- diag(exp(g_t)) S`, with `g_t` a vector of natural-log decays
# (`g <= 0`). Some channels can keep information for thousands of tokens while others
# forget within a few. In BOOK.md's notation, per head:
#
# ```
# S <- diag(exp(g_t)) S                 # decay each key-row
# S <- S + beta_t k_t (v_t - S^T k_t)^T # delta-rule correction
# o_t = S^T (scale q_t)                 # output reads the UPDATED state
# ```
#
# This is the package's one-token update, shared by the sequence loop and by decode:

# %%
show_source(kda.recurrent._recurrent_update)

# %%
show_source(kda.recurrent_kda)

# %% [markdown]
# The earlier steps are special cases of this kernel, which we check numerically:
# the delta rule is KDA with `g = 0`; the gated delta rule is KDA with the same `g`
# in every channel. (The hand-written loops below read with `scale = 1`.)

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
# ### Where g and beta come from
#
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
# The recurrence runs T tiny steps, each a handful of K x V operations. On a CPU (or a
# GPU) that is slow: every step pays call overhead and cannot use matrix-multiply
# hardware. The chunkwise form splits the sequence into chunks of C = 64 tokens and,
# inside each chunk, rewrites the C delta steps as a few C x C and C x K matrix
# products. With `q` already scaled and `G` the cumulative sum of `g` inside the chunk:
#
# ```
# Akk[i,j] = sum_d k_id k_jd exp(G_id - G_jd)   (j < i)
# T  = (I + StrictTril(diag(beta) Akk))^-1 diag(beta)     # UT transform
# W  = T (exp(G) * K);  U = T V;  V' = U - W S
# Aqk[i,j] = sum_d q_id k_jd exp(G_id - G_jd)   (j <= i)
# O  = (exp(G) * Q) S + Aqk V'
# S <- diag(exp(G_C)) S + (exp(G_C - G) * K)^T V'
# ```
#
# `Akk`, `Aqk`, the triangular inverse, `W` and `U` do not depend on the state, so
# they are computed for *every chunk and head at once*. Only the last line (and the
# two that read `S`) walk through the chunks in order. A short last chunk is padded
# with `k = v = beta = g = 0`, which leaves the state untouched.

# %%
show_source(kda.chunk_kda)

# %% [markdown]
# Two numerical details. First, `exp(G_i - G_j)` above the diagonal (j > i) is a
# *growth*, not a decay, and overflows for strong gates, so those entries must never
# be formed as a large number and masked afterwards. Second, to use matrix products
# the pair exponent is split as `exp(G_i - G_r) exp(G_r - G_j)` around the first row
# r of a block of rows. Both factors stay within `e^(±spread)`, the spread being the
# range of G over the block, so the package picks the largest block whose spread is
# safe (strong gates get smaller blocks, down to one row, which is always safe) and
# zeroes the bounded upper triangle after the product:

# %%
show_source(kda.chunk._block_sizes)

# %% [markdown]
# The UT transform needs `(I + L)^-1` applied to `diag(beta) exp(G) K` and
# `diag(beta) V`, with `L` strictly lower triangular. Rather than forming the inverse,
# the package solves for both right-hand sides at once by *block* forward
# substitution: small diagonal blocks are inverted row by row, and each block row of
# the solution is one batched product with the rows already solved. `make bench` times
# it against `np.linalg.solve` on the same stack.

# %%
show_source(kda.chunk._unit_lower_solve)

# %% [markdown]
# ### Chunked == recurrent
#
# The two forms must agree to rounding error. We try ragged lengths, chunk sizes that
# do not divide T, strong and weak gates, with and without an initial state, in
# float64 (the test suite does the same with hypothesis over thousands of shapes).
# The inputs come from `random_inputs` in `kimilab.kda.testing`, the one seeded
# generator the tests and `make bench` draw from too: `"kimi-init"` gates are those of
# a freshly initialised layer, `"strong"` ones decay by up to e^-20 per step.

# %%
print(f"{'T':>5} {'chunk':>5} {'gates':>9} {'S0':>5}  max|chunked - recurrent| < 1e-10 (outputs, final state)")
for T_, C_, gate, with_state in [(64, 64, "kimi-init", False), (100, 64, "kimi-init", True), (257, 64, "strong", True),
                                 (77, 16, "kimi-init", True), (33, 7, "strong", False)]:
    args, S0 = random_inputs(T_, 3, 16, 8, seed=T_, gate=gate)
    init = S0 if with_state else None
    o_r, s_r = kda.recurrent_kda(*args, initial_state=init)
    o_c, s_c = kda.chunk_kda(*args, initial_state=init, chunk_size=C_)
    print(f"{T_:5d} {C_:5d} {gate:>9} {str(with_state):>5}  {close(o_c, o_r)}, {close(s_c, s_r)}")

# %% [markdown]
# In float32 (how the model is served) the two forms differ by float32 rounding only:

# %%
args32, S0_32 = random_inputs(1000, 4, 64, 64, seed=5, dtype=np.float32)
o_r, s_r = kda.recurrent_kda(*args32, initial_state=S0_32)
o_c, s_c = kda.chunk_kda(*args32, initial_state=S0_32)
rel = np.abs(o_c - o_r).max() / np.abs(o_r).max()
print(f"float32, T=1000, H=4, K=V=64: dtype {o_c.dtype}, relative difference < 1e-5: {bool(rel < 1e-5)}")

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
# ## The state never grows
#
# A KDA layer's whole memory of the past is `H x K x V` numbers per request, whatever
# the context. We measure it on the book's `tiny` shapes (4 heads, K = V = 32, float64)
# beside a KV cache for one global layer of the same width:

# %%
H_t, D_t = tiny.n_heads, tiny.head_dim
print(f"{'tokens':>7} {'KDA state bytes':>16} {'KV cache bytes (1 layer)':>25}")
for n_tokens in (64, 512, 4096):
    args, _ = random_inputs(n_tokens, H_t, D_t, D_t, seed=1)
    _, state = kda.chunk_kda(*args)
    kv = KVCache(H_t, D_t, dtype="float64")
    kv.append(rng.standard_normal((n_tokens, H_t, D_t)), rng.standard_normal((n_tokens, H_t, D_t)))
    print(f"{n_tokens:7d} {state.nbytes:16,d} {kv.nbytes:25,d}")
print(f"analytic KDA state per layer (tiny): {costs.kda_state_bytes_per_layer(tiny):,d} B")

# %% [markdown]
# At real scale (BOOK.md: Kimi-Linear-48B has 20 KDA layers of 32 heads x 128 x 128,
# states kept in fp32) the fixed state is 40 MiB per request, beside chapter 1's KV
# lines (bf16):

# %%
lengths = np.unique(np.logspace(np.log10(1024), np.log10(2**20), 40).astype(int))
state_total = costs.kda_state_bytes(kimi_linear_48b)
print(f"Kimi-Linear-48B KDA state per request: {state_total / 2**20:.0f} MiB "
      f"({costs.kda_state_bytes_per_layer(kimi_linear_48b) / 2**20:.0f} MiB per layer x "
      f"{kimi_linear_48b.layer_pattern.count('K')} layers); conv states {costs.conv_state_bytes(kimi_linear_48b) / 2**20:.1f} MiB")
crossover = state_total / costs.kv_bytes_per_token(kimi_linear_48b)
print(f"the hybrid's 7 MLA layers cache as many bytes as its 20 KDA states after {crossover:,.0f} tokens")

fig, ax = plt.subplots()
ax.loglog(lengths, [costs.request_bytes(all_mla_27, int(n))["kv"] / 1e9 for n in lengths], **plots.style_of("all-mla"))
ax.loglog(lengths, [costs.request_bytes(kimi_linear_48b, int(n))["kv"] / 1e9 for n in lengths], linestyle="--",
          color=plots.color("kv-cache"), label=f"{plots.label('kv-cache')}, hybrid's 7 MLA layers")
ax.loglog(lengths, np.full(len(lengths), state_total / 1e9),
          color=plots.color("kda-state"), label=f"{plots.label('kda-state')}, hybrid's 20 KDA layers (fp32)")
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("bytes of ONE request (GB)")
ax.set_title("Kimi-Linear-48B: growing KV cache vs fixed KDA state")
ax.legend(loc="upper left")
plots.save(fig, "ch02-state-vs-kv")
plt.show()

# %% [markdown]
# *Takeaway:* the KDA state is a flat line at 0.04 GB; past about 5k tokens the seven
# MLA layers' KV cache is the larger part of a request, and at 1M tokens it is 200
# times the state.
#
# ## States do not add
#
# Linear attention's state is a sum, `S = sum_t k_t v_t^T`, so the state of a sequence
# AB is the state of A plus the state of B: two workers could each summarise half
# and add. KDA's is not. The decay and the delta correction of segment B act on
# whatever state B starts from, so B is an **affine map** of its input state:
# `S_out = M_B S_in + C_B`. `M_B` (K x K per head, acting on the key dimension) is the
# product over B's chunks of `diag(exp(G_C)) - (exp(G_C - G) K)^T W`; `C_B` is the
# state B reaches from zero. Halves *compose*, in order.

# %%
show_source(kda.segment_transition)

# %%
(q2, k2, v2, g2, b2), _ = random_inputs(80, 1, 4, 4, seed=11)
A, B = slice(0, 50), slice(50, 80)

# linear attention: the state of AB is the state of A plus the state of B
lin_A, lin_B = kda.linear_attention_state(k2[A], v2[A]), kda.linear_attention_state(k2[B], v2[B])
lin_AB = kda.linear_attention_state(k2, v2)
print("linear attention, first row of the state (head 0):")
print("  S(A) + S(B):", np.round((lin_A + lin_B)[0, 0], 3))
print("  S(AB):      ", np.round(lin_AB[0, 0], 3), "  equal:", close(lin_A + lin_B, lin_AB))

# KDA: adding is wrong; composing is right
_, S_A = kda.chunk_kda(q2[A], k2[A], v2[A], g2[A], b2[A])
_, S_B = kda.chunk_kda(q2[B], k2[B], v2[B], g2[B], b2[B])
_, S_AB = kda.chunk_kda(q2, k2, v2, g2, b2)
M_B, C_B = kda.segment_transition(k2[B], v2[B], g2[B], b2[B])
print("KDA, first row of the state (head 0):")
print("  S(A) + S(B):      ", np.round((S_A + S_B)[0, 0], 3))
print("  M_B S(A) + C_B:   ", np.round(kda.apply_transition(M_B, C_B, S_A)[0, 0], 3))
print("  S(AB):            ", np.round(S_AB[0, 0], 3))
print(f"  max |S(AB) - (S(A) + S(B))| = {np.abs(S_AB - (S_A + S_B)).max():.3f};"
      f"  M_B S(A) + C_B == S(AB): {close(kda.apply_transition(M_B, C_B, S_A), S_AB)}")
print(f"  C_B is S(B) from zero: {close(C_B, S_B)}")

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
# ## Cost: counted FLOPs and measured time
#
# Counted per chunk (`kda.chunk_kda_flops`), the chunkwise form does *more* arithmetic
# than the recurrence: it builds C x C matrices the recurrence never forms. These
# counts are exact and machine-independent:

# %%
show_source(kda.chunk_kda_flops)

# %%
H_b, K_b = 4, 64
T_values = np.array([128, 256, 512, 1024, 2048, 4096])
flops_rec = np.array([kda.recurrent_kda_flops(int(t), H_b, K_b, K_b) for t in T_values])
flops_chunk = np.array([kda.chunk_kda_flops(int(t), H_b, K_b, K_b, 64) for t in T_values])
for t, fr, fc in zip(T_values, flops_rec, flops_chunk):
    print(f"T={t:5d}: recurrent {fr / 1e6:8.1f} MFLOP, chunked {fc / 1e6:8.1f} MFLOP, ratio {fc / fr:.2f}")

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

# %% [markdown]
# *Takeaway:* both grow linearly in T (no T^2 term, unlike attention), and the
# chunked form does about 2.4x more arithmetic than the recurrence.
#
# Yet on a CPU it runs faster, because its work is a few large batched matrix
# products instead of 4 x T small numpy calls. Measured on this machine (float32,
# best of 1-3 runs; wall-clock numbers change from run to run):

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
for t, tr, tc in zip(T_values, times_rec, times_chunk):
    print(f"T={t:5d}: recurrent {1e3 * tr:7.1f} ms, chunked {1e3 * tc:6.1f} ms, speed-up {tr / tc:4.1f}x")

# %% [markdown]
# *Takeaway:* the chunked form is the faster one at every length shown despite its
# larger FLOP count; `make bench` measures the ratio at T = 4096 (a few x on our
# 2-core machines) and compares it with flash-linear-attention's PyTorch reference.
# Prefill (many tokens at once) uses the chunked form; decode (one token) uses
# `kda_step`.

# %% [markdown]
# ## Summary
#
# - Linear attention keeps a K x V state and adds `k v^T`; the delta rule writes only
#   the difference `v - S^T k`; the gated delta rule forgets by a scalar per step;
#   KDA forgets per key channel, `S <- diag(exp(g_t)) S`.
# - `recurrent_kda` (one token at a time) and `chunk_kda` (UT transform over chunks of
#   64) agree to 1e-10 in float64; a loop of `kda_step` agrees with both.
# - The state is `H x K x V` per layer whatever the context: 40 MiB for
#   Kimi-Linear-48B's 20 KDA layers, against a KV cache that grows by 8 KB per token
#   in its 7 MLA layers.
# - States do not add. A segment is an affine map `S_out = M S_in + C`; segments
#   compose in order. Prefix caching (chapters 5-6), speculative rollback (7-8) and
#   context parallelism (9) all have to live with that.
#
# ## Exercises
#
# **1.** How many bytes does ONE Kimi-Linear-48B KDA layer's state take for one
# request? It has 32 heads, K = V = 128, and the state is kept in fp32 (4 bytes).

# %%
answer = None  # your number of bytes here
check(answer, kda.state_bytes(kimi_linear_48b.n_heads, kimi_linear_48b.head_dim, kimi_linear_48b.head_dim, 4),
      name="KDA state bytes per layer", hint="A state is H x K x V numbers; multiply by the bytes per number.")

# %% [markdown]
# *Solution:* `32 * 128 * 128 * 4 = 2,097,152` bytes (2 MiB), the same at 1 token and
# at 1M tokens.
#
# **2.** A segment with `g = 0` (no forgetting) and `beta = 0` (no writing) leaves
# the state unchanged. What are its `M` and `C`? Compute `segment_transition` for such
# a segment of 10 tokens (H = 1, K = 3, V = 2) and compare `M` with `np.eye(3)`.

# %%
answer_M = None  # e.g. kda.segment_transition(k, v, np.zeros(...), np.zeros(...))[0][0]
check(answer_M, np.eye(3), name="M of a do-nothing segment", atol=1e-12,
      hint="Build k, v of shapes [10, 1, 3] and [10, 1, 2], g = zeros [10, 1, 3], beta = zeros [10, 1].")

# %% [markdown]
# *Solution:* `M = I` and `C = 0`: the identity transition (`kda.identity_transition`).
#
# **3.** (Open) Re-run the "chunked == recurrent" cell with `gate="strong"` and a
# long T, and print `kda.chunk._block_sizes` for its chunks. Why do strong gates force
# smaller blocks, and what would go wrong if the exponents were masked *after* `exp`?
