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
# # 9. Context parallelism for a state that does not add
#
# **What you'll build.** Context-parallel KDA: one long prompt cut into P slices, one
# per rank, and outputs equal to one rank's. Ranks are real operating-system processes
# that talk over MPI (`mpi4py` and the `mpich` wheels, both in the default install);
# tests and most of this chapter use an in-process backend with the same math code.
# Three ways to hand each rank the state entering its slice, ring attention for the
# global-attention layers beside it, and a command line:
# `mpiexec -n P python -m kimilab cp --tokens T`.
#
# **What you'll learn.**
# - Why attention's context parallelism does not carry over: partial softmax results
#   merge in any order, KDA slices compose only in order.
# - How a rank can run its slice *before* it knows its entering state: the outputs are
#   affine in that state, so one pass plus a cheap correction replaces two passes.
# - What the exchange costs: a fixed number of bytes per rank, whatever T; and which
#   scheme is shortest on the critical path.
# - Where float32 stops being enough for the chain of transitions.
#
# **What you'll need.** Chapter 2 (the state, the chunk pass, the segment transition
# `(M, C)`), chapter 3 (the hybrid model's MLA layers). The GPU numbers are a cost model
# on assumed hardware; every wall-clock number is this 2-core CPU machine's.

# %%
import json

import matplotlib.pyplot as plt
import numpy as np

from kimilab import cp, kda, plots
from kimilab.cp.launch import launch
from kimilab.exercises import verify
from kimilab.kda.testing import random_inputs
from kimilab.notebook import show_source

plots.use_style()
H, K, V = 4, 64, 64

# %% [markdown]
# ## The problem: a state that does not add
#
# Chapter 2 showed that a segment acts on the KDA state as an affine map,
# `S_out = M S_in + C`. Two slices A then B give `M_B (M_A S + C_A) + C_B`: the pieces
# compose, associatively, but **in order**. Attention's partial results over two key
# blocks instead merge with the log-sum-exp rule, and that merge does not care which
# block came first. Both facts, checked:

# %%
(q, k, v, g, beta), S0 = random_inputs(256, 2, 8, 8, seed=0)
A = kda.segment_transition(*(x[:128] for x in (k, v, g, beta)))
B = kda.segment_transition(*(x[128:] for x in (k, v, g, beta)))
AB, BA = kda.compose_transitions(A, B), kda.compose_transitions(B, A)
print(f"KDA: |state(A then B) - state(B then A)| = {np.abs(kda.apply_transition(*AB, S0) - kda.apply_transition(*BA, S0)).max():.3f}")
pos = np.arange(256)
left = cp.partial_attention(q, k[:128], v[:128], pos, pos[:128])
right = cp.partial_attention(q, k[128:], v[128:], pos, pos[128:])
print(f"attention: |merge(left, right) - merge(right, left)| = "
      f"{np.abs(cp.merge_partials(left, right)[0] - cp.merge_partials(right, left)[0]).max():.1e}")

# %% [markdown]
# So a rank holding tokens in the middle of the prompt cannot finish its slice until it
# knows the state entering it, which depends on every slice before it.

# %% [markdown]
# ## Naive: wait, or pass twice
#
# The obvious schedule is a relay: rank 0 runs its slice, sends its final state to rank
# 1, which runs, and so on. That is exact and useless: P ranks take as long as one.
#
# flash-linear-attention's KDA context parallelism
# ([fla-kcp](references.md#fla-kcp)) breaks the relay: every rank first computes its
# slice's transition `(M_r, C_r)` from a zero state, the ranks all-gather them, each
# rank folds the earlier ones in rank order (`h = M_j h + C_j`) to get its entering
# state, and only then runs its main pass from that state. The chain of `M` is kept in
# fp32. The exchange is small and independent of T. But on a CPU the transition pass
# costs almost as much as the main pass (`segment_transition` runs the chunk state pass
# on `K + V` columns), so each rank works about twice: little is left of the speedup.

# %% [markdown]
# ## Better: pass once, correct later
#
# A chunk pass from state `S` gives outputs `o = o0 + Qt S` and final state
# `M S + C`: everything is affine in `S`. `kda.chunk_kda_affine` runs the chunk state
# pass **once** on the augmented state `[S | M]` starting from `[0 | I]`; the same
# output product then yields `o0` (the outputs from zero) and `Qt` (what each output
# reads from the entering state), and the final augmented state is `(C, M)`. When the
# gates have decayed `M` to zero (flushed, as the chunk kernel flushes decays), the rest
# of the pass drops the extra columns and costs what a plain pass costs.

# %%
show_source(kda.chunk_kda_affine, lines=(1, 12))

# %% [markdown]
# A rank's whole job, for any of the schemes below: a collective shape check first (so
# a bad input errors on every rank instead of leaving the others waiting), the pass,
# the exchange, the correction. Rank 0 knows its entering state (the prompt's initial
# state), so it runs the plain `chunk_kda`.

# %%
show_source(cp.cp_kda_rank)

# %% [markdown]
# Exactness, in float64, against one rank's `chunk_kda`: for P from 1 to 8, all three
# schemes, with an initial state, and on ragged cuts (a slice of one token, a slice
# shorter than a chunk). The tests (`tests/test_cp.py`) add hypothesis over P, T and the
# cut points.

# %%
(q, k, v, g, beta), S0 = random_inputs(600, H, 16, 16, seed=1)
o_ref, S_ref = kda.chunk_kda(q, k, v, g, beta, initial_state=S0)
worst = 0.0
for scheme in cp.SCHEMES:
    for P in range(1, 9):
        o, S, _ = cp.context_parallel_kda(q, k, v, g, beta, ranks=P, initial_state=S0, scheme=scheme)
        worst = max(worst, np.abs(o - o_ref).max(), np.abs(S - S_ref).max())
    o, S, _ = cp.context_parallel_kda(q, k, v, g, beta, bounds=[0, 1, 40, 41, 600], initial_state=S0, scheme=scheme)
    worst = max(worst, np.abs(o - o_ref).max(), np.abs(S - S_ref).max())
print(f"largest difference from one rank, float64: {worst:.1e}  (<= 1e-10: {worst <= 1e-10})")

# %% [markdown]
# ## Three ways to pass the state
#
# - **sequential**: rank r waits for rank r-1's final state, then sends its own. One
#   state per rank, but a chain of P - 1 messages on the critical path.
# - **all-gather + local fold** (fla's): every rank receives every other rank's
#   transition and folds the earlier ones itself: `log2 P` steps with recursive
#   doubling, but P - 1 transitions per rank.
# - **tree scan**: a log-depth inclusive scan of the transitions (each round composes
#   with the partial result `d` ranks back, then `d` doubles), then one shift of the
#   state to the next rank.
#
# Counted for the chapter's shapes (H = 4, K = V = 64, float32), and checked against the
# in-process backend, which counts what each rank actually sends:

# %%
rows = {P: cp.scheme_costs(P, H, K, V) for P in (2, 4, 8, 16, 64)}
print(f"{'P':>3} | " + " | ".join(f"{s:>24}" for s in cp.SCHEMES))
for P, c in rows.items():
    print(f"{P:>3} | " + " | ".join(f"{c[s]['bytes'] / 1024:>8.0f} KiB {c[s]['steps']:>3} steps" + " " * 5
                                    for s in cp.SCHEMES))
(q, k, v, g, beta), _ = random_inputs(2048, H, K, V, seed=2, dtype=np.float32)
_, _, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=8, scheme="allgather")
check = 7 * 40  # the shape check: 5 numbers of 8 bytes to each of 7 other ranks
print(f"\nin-process all-gather at P = 8: {comms[3].bytes_sent - check:,} bytes sent by rank 3 "
      f"(counted: {rows[8]['allgather']['bytes']:,})")

# %%
Ps = np.arange(2, 65)
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for s in cp.SCHEMES:
    ax.plot(Ps, [cp.scheme_costs(int(P), H, K, V)[s]["steps"] for P in Ps], **plots.style_of(f"cp-{s}"))
ax.set_xlabel("ranks P")
ax.set_ylabel("critical-path steps (messages in a chain)")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_title("Passing the KDA state: critical path vs P")
ax.legend()
plots.save(fig, "ch09-critical-path")
plt.show()

# %% [markdown]
# The relay's chain grows with P; the all-gather and the tree stay logarithmic. At the
# P of one machine (8 devices) fla's all-gather is the shortest and its bytes are
# still small, which is why it is the default here.

# %% [markdown]
# ## Bytes per rank: fixed for KDA, growing for attention
#
# Ring attention ([ring-attention](references.md#ring-attention), `cp.ring_attention_rank`) passes each rank's key/value block around
# the ring: P - 1 blocks of T / P tokens, so its bytes grow with T. KDA's exchange is a
# transition per rank, whatever T. For one layer of the chapter's shapes (attention
# with the same 4 heads of 64, float32 keys and values), at P = 8:

# %%
Ts = 2 ** np.arange(10, 21)
kv_per_token = 2 * H * K * 4
kda_bytes = [cp.scheme_costs(8, H, K, V)["allgather"]["bytes"] for _ in Ts]
ring_bytes = [cp.ring_attention_bytes(int(T), 8, kv_per_token) for T in Ts]
fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.plot(Ts, np.array(kda_bytes) / 2**20, **plots.style_of("kda-state"))
ax.plot(Ts, np.array(ring_bytes) / 2**20, **plots.style_of("kv-cache"))
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("prompt length T (tokens)")
ax.set_ylabel("bytes sent per rank, one layer (MiB)")
ax.set_title("Context parallelism at P = 8: what one rank sends")
ax.legend(["KDA: all-gather of (M, C)", "attention: ring of KV blocks"])
plots.save(fig, "ch09-bytes-vs-length")
plt.show()
cross = next(int(T) for T, a, b in zip(Ts, kda_bytes, ring_bytes) if b > a)
print(f"ring attention sends more than KDA's exchange from T = {cross:,} tokens; "
      f"at T = {Ts[-1]:,}: {ring_bytes[-1] / kda_bytes[-1]:.0f}x more")

# %% [markdown]
# KDA's line is flat; attention's grows linearly with the prompt. (The commutative
# merge is what lets ring attention overlap sending with computing; KDA's ordered
# composition instead needs the one small exchange in the middle.)

# %% [markdown]
# ## The whole model
#
# `cp.context_parallel_prefill` runs the book's reduced hybrid model (chapter 3) across
# P ranks: per layer, each rank normalises and projects its slice; a KDA layer takes
# the conv's halo (the last raw conv inputs of the earlier ranks, all-gathered) and the
# entering state as above; an MLA layer runs ring attention. The logits and the final
# cache (KDA states, conv states, every rank's keys and values) are those of one
# `Model.prefill`, including cuts of one and two tokens, shorter than the conv's reach:

# %%
from kimilab.config import tiny
from kimilab.model import Model

model = Model(tiny, seed=0)
prompt = np.random.default_rng(5).integers(0, tiny.vocab_size, 200)
ref_cache = model.new_cache()
ref_logits = model.prefill(prompt, ref_cache)
for cut in ({"ranks": 4}, {"bounds": [0, 1, 3, 120, 200]}):
    logits, cache = cp.context_parallel_prefill(model, prompt, **cut)
    state_diff = max(np.abs(cache.kda_state(l.index) - ref_cache.kda_state(l.index)).max()
                     for l in model.layers if l.kind == "K")
    print(f"{cut}: logits differ by {np.abs(logits - ref_logits).max():.1e}, KDA states by {state_diff:.1e}")

# %% [markdown]
# ## Real processes: `mpiexec`
#
# The `cp` command runs the same `cp_kda_rank` on every rank of an MPI job, with the
# `mpi4py` backend. Each rank draws the same seeded inputs and keeps its slice; rank 0
# also runs the whole prompt alone, in the same job, and prints one JSON object. Here
# the chapter launches it itself, with one BLAS thread per rank. Rank 0 takes a larger
# slice, because the other ranks' affine pass costs more per token (see the next
# section). This is wall clock on a machine with 2 cores shared with other work, so it
# varies from run to run.

# %%
# NBVAL_IGNORE_OUTPUT
runs = {P: launch(P, 16_384, heads=H, dim=K, dtype="float32") for P in (2, 4)}
for P, out in runs.items():
    print(f"P = {P}: {out['seconds_p_ranks']:.3f} s vs one rank {out['seconds_one_rank']:.3f} s -> "
          f"{out['speedup']:.2f}x; bytes sent per rank {out['bytes_sent_per_rank']}; "
          f"max error vs one rank {out['max_abs_error']:.1e}")
print(json.dumps({k: runs[2][k] for k in ("ranks", "tokens", "bounds", "max_abs_error")}))

# %%
# NBVAL_IGNORE_OUTPUT
Pg = [1, 2, 4, 8]
fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.plot([1] + list(runs), [1.0] + [runs[P]["speedup"] for P in runs], marker="o",
        label="wall clock, this 2-core machine, T = 16,384, 4 heads of 64", color=plots.color("cp-wall"))
model = [cp.predicted_speedup(P, 2**20, 32, 128, 128) for P in Pg]  # one 48B-shaped KDA layer, T = 2^20
ax.plot(Pg, model, marker="s", label="cost model: GPU cluster (assumed), T = 2^20, 32 heads of 128",
        color=plots.color("cp-predicted"))
ax.axvline(2, color="#cccccc", lw=1, ls=":")
ax.set_xlabel("ranks P")
ax.set_ylabel("speedup over one rank (x)")
ax.set_title("KDA context parallelism: speedup vs ranks")
ax.legend(fontsize=8)
plots.save(fig, "ch09-speedup")
plt.show()
print("cost model, T = 2^20, 48B-shaped layer: " + "  ".join(f"P={P}: {m:.2f}x" for P, m in zip(Pg, model)))

# %% [markdown]
# On this machine P = 4 puts two ranks on each of its 2 cores (the dotted line marks
# the core count): past it, more ranks only time-share the same cores, and the other
# work on the machine moves every wall-clock point from run to run. The grey line is a cost model for a GPU
# cluster (`cp.predicted_speedup`: assumed H800-class device at an assumed 30% of peak,
# an assumed NVLink-class link) on one KDA layer of Kimi-Linear-48B's shape over a
# prompt of 2^20 tokens: the exchange is tiny next to the compute, so the model's
# speedup stays close to the balanced bound (rank 0 takes more than 1/P of the prompt,
# so it is below P). On a short prompt the fixed per-message latency would soon
# outweigh the shrinking compute per device. On several
# machines the only change is the launch: `mpiexec -f hostfile -n P python -m kimilab cp
# --tokens T`, with the hostfile listing one machine per line (and the same Python
# environment on each).

# %% [markdown]
# ## Where to cut: balancing the critical path
#
# Rank 0 runs a plain pass; every other rank runs the affine pass, which costs more per
# token while `M` is still alive. With even slices the last rank finishes last. Timing
# both passes on one slice length here (one thread) gives the cost of each rank as a
# function of where the cut falls, for P = 2:

# %%
# NBVAL_IGNORE_OUTPUT
import time

(q, k, v, g, beta), _ = random_inputs(8192, H, K, V, seed=3, dtype=np.float32)
t0 = time.perf_counter(); kda.chunk_kda(q, k, v, g, beta); plain = time.perf_counter() - t0
t0 = time.perf_counter(); kda.chunk_kda_affine(q, k, v, g, beta); affine = time.perf_counter() - t0
share = np.linspace(0.3, 0.8, 51)
path = np.maximum(share * plain, (1 - share) * affine) / plain
best = share[np.argmin(path)]
fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.plot(share, share, label="rank 0 (plain pass)", color=plots.color("chunked"))
ax.plot(share, (1 - share) * affine / plain, label="rank 1 (affine pass)", color=plots.color("kda-state"))
ax.plot(share, path, label="critical path (the later of the two)", color="black", lw=2.5, alpha=0.5)
ax.axvline(best, color="#999999", ls=":")
ax.set_xlabel("rank 0's share of the prompt")
ax.set_ylabel("time, as a share of one rank's pass")
ax.set_title("P = 2: the cut that balances the critical path")
ax.legend()
plots.save(fig, "ch09-split")
plt.show()
print(f"affine / plain pass: {affine / plain:.2f}; best cut gives rank 0 {best:.0%} of the prompt, "
      f"bound {1 / path.min():.2f}x")

# %% [markdown]
# The best cut is where the two lines cross; `cp.balanced_weights(P, affine_cost)`
# computes it, and the `cp` command uses it by default (`--even` turns it off).

# %% [markdown]
# ## Where precision starts to matter: the fp32 chain of M
#
# The entering state of the last rank is a product of P - 1 transitions applied in a
# chain. Folding them in float32 instead of float64 loses a little at each step. The
# gates decide how much: a decaying gate shrinks `M` and with it the errors; with no
# decay (`gate="zero"`, the plain delta rule) the chain keeps everything. Transitions
# for 32 base slices are computed once in float64 and composed into P slices; then the
# fold is done in both precisions:

# %%
def chain_error(T, Ps, gate):
    (_, k, v, g, beta), _ = random_inputs(T, 2, 32, 32, seed=4, gate=gate)
    base = [kda.segment_transition(*(x[s] for x in (k, v, g, beta))) for s in cp.slices(cp.split_bounds(T, 32))]
    out = []
    for P in Ps:
        group = 32 // P
        trans = []
        for j in range(P):
            t = base[j * group]
            for nxt in base[j * group + 1:(j + 1) * group]:
                t = kda.compose_transitions(t, nxt)
            trans.append(t)
        exact = cp.fold_states(trans + [trans[-1]])[-1]
        f32 = cp.fold_states([(M.astype(np.float32), C.astype(np.float32)) for M, C in trans + [trans[-1]]])[-1]
        out.append(float(np.abs(f32 - exact).max() / np.abs(exact).max()))
    return out


Pc, Tc = [2, 4, 8, 16, 32], [1024, 4096, 16_384]
errors = {(T, gate): chain_error(T, Pc, gate) for T in Tc for gate in ("zero", "kimi-init")}
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for (T, gate), e in errors.items():
    ax.plot(Pc, e, marker="o", ls="-" if gate == "zero" else "--", label=f"T = {T:,}, gate {gate}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("ranks P (transitions in the chain)")
ax.set_ylabel("relative error of the fp32 fold")
ax.set_title("Folding the chain of M in float32 vs float64")
ax.legend(fontsize=8)
plots.save(fig, "ch09-fp32-chain")
plt.show()
for (T, gate), e in errors.items():
    print(f"T = {T:>6,}, gate {gate:>9}: " + "  ".join(f"P={P}: {x:.1e}" for P, x in zip(Pc, e)))

# %% [markdown]
# In float32 the fold stays near float32's rounding level (about `1e-7` relative) for
# every P and T here, with or without decay: a chain of at most 32 small matrix
# products does not accumulate much. Precision starts to matter below float32: fla
# keeps this chain in fp32 precisely because repeated rounding to bf16 between steps
# compounds ([fla-kcp](references.md#fla-kcp)).

# %% [markdown]
# ## Summary
#
# - A KDA slice is an affine map of the state that enters it; maps compose in order, not
#   in any order as attention's log-sum-exp partials do.
# - Each rank runs its slice once (`kda.chunk_kda_affine`), exchanges its transition,
#   folds the earlier ones, and corrects its outputs (`o = o0 + Qt S_in`): exact in
#   float64 for any P and any cut.
# - The exchange is a fixed number of bytes per rank, whatever T; ring attention's
#   grows with T.
# - Sequential relay: one state, P - 1 steps. All-gather + fold (fla's): P - 1
#   transitions, `log2 P` steps. Tree scan: `log2 P + 1` steps and fewer bytes.
# - Real processes under `mpiexec` on this 2-core machine: P = 2 beats one rank when
#   rank 0 takes the bigger slice; beyond the core count it stops paying.
# - The whole reduced model prefills across P ranks (conv halo, KDA state, ring
#   attention) with the same logits and cache as one rank.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **9.1 A real layer's exchange.** Kimi-Linear-48B's KDA layers have `32` heads with
# `K = V = 128` (`kimilab.config.kimi_linear_48b`). How many bytes is one rank's transition `(M, C)` for one layer in
# float32?

# %% tags=["solution"]
answer = 32 * 128 * (128 + 128) * 4

# %%
verify("9.1", answer)

# %% [markdown]
# **9.2 The relay.** How many critical-path steps does the sequential scheme take at
# P = 16? (`cp.scheme_costs`.)

# %% tags=["solution"]
answer = cp.scheme_costs(16, H, K, V)["sequential"]["steps"]

# %%
verify("9.2", answer)

# %% [markdown]
# **9.3 A balanced cut.** If the affine pass cost twice the plain pass per token, how
# many of `10,000` tokens would rank 0 take with P = 4? (`cp.split_bounds` with
# `cp.balanced_weights`.)

# %% tags=["solution"]
answer = cp.split_bounds(10_000, 4, cp.balanced_weights(4, 2.0))[1]

# %%
verify("9.3", answer)

# %% [markdown]
# **9.4 (open) The tree's bytes.** At which P does the tree scan send fewer bytes per
# rank than the all-gather? Is one fewer step worth them on the cost model's link?
#
# **9.5 (open) bf16 chain.** Repeat the fp32 chain experiment with the transitions
# rounded to bf16 between steps (emulate it by zeroing the low 16 bits of float32).
# Where does the error pass `1e-2`?
#
# **9.6 (open) The model under MPI.** `cp.cp_prefill_rank` takes any communicator. Write
# a script that runs it under `mpiexec -n 2` with `cp.MPIComm()` on the `tiny` model and
# compares rank 0's logits with `Model.prefill`. Which layers' exchanges grow with T?
