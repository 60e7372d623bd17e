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
# You will climb a ladder of recurrences from LASP-2's additive state to KDA's dense
# transition, hand each rank the state entering its slice in five ways, balance the
# global-attention layers with a zigzag layout, and run it all from a command line:
# `mpiexec -n P python -m kimilab cp --tokens T`.
#
# **What you'll learn.**
# - What changes from linear attention (LASP-2: states add) to KDA (states compose, in
#   order, through a dense K x K matrix M), one rung at a time.
# - When M matters at all: with random keys it dies within a few thousand tokens and
#   a rank needs only its neighbour's state; with low-rank keys and a slow gate it lives.
# - Two ways a rank can work before it knows its entering state (one affine pass with a
#   correction, or flash-linear-attention's two passes over one shared preparation), and
#   which one costs less where.
# - Why causal attention wants a zigzag layout while KDA wants contiguous slices, and
#   what the all-to-all between them costs.
# - How to measure a speedup on a shared machine (medians of interleaved runs, with
#   their spread), and what a cost model says for one KDA layer and for the whole model.
#
# **What you'll need.** Chapter 2 (the state, the chunk pass, the segment transition
# `(M, C)`), chapter 3 (the hybrid model, its MLA layers, and the calibrated cost model
# behind `costs.Deployment`). The GPU numbers are that cost model; every wall-clock
# number is this 2-core CPU machine's, shared with other work.

# %%
import json
import os

import matplotlib.pyplot as plt
import numpy as np

from kimilab import costs, cp, kda, plots
from kimilab.config import kimi_linear_48b, tiny
from kimilab.cp.launch import launch
from kimilab.cp.ladder import ladder_local, transition_values
from kimilab.cp.passes import cost_ratios, pass_flops, pass_seconds
from kimilab.exercises import verify
from kimilab.kda.testing import random_inputs
from kimilab.model import Model
from kimilab.notebook import show_source

plots.use_style()
H, K, V = 4, 64, 64
DEP = costs.VLLM_TP8_H200  # the GPU numbers' device, links and calibrated kernels (chapter 3)

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
# ## A ladder from LASP-2 to KDA
#
# Linear attention has the easy case. Its state is a sum, `S_t = S_{t-1} + k_t v_t^T`, so
# the state entering rank r is the sum of the earlier ranks' states from zero, in any
# order. LASP ([lasp](references.md#lasp)) passed that state around a ring of devices;
# LASP-2 ([lasp-2](references.md#lasp-2)) replaced the ring with a single all-gather of
# every rank's state, after which each rank sums the ones before it. KDA sits three rungs
# higher. Each rung is a recurrence `S_t = A_t S_{t-1} + w_t`, read by `o_t = S_t^T q_t`,
# so a slice still maps its entering state affinely: `S_out = M S_in + C` and
# `o = o0 + Qt S_in`. What changes up the ladder is M:
#
# - **additive** (linear attention): `A_t = I`, so M = I. A rank sends its C; the
#   entering state is a sum.
# - **scalar decay** (one gate per head): `A_t = a_t I`. M is one number per head; the
#   order now matters, but composing is scaling.
# - **per-channel decay** (a gate per key channel, as in GLA): `A_t = Diag(a_t)`. M is
#   K numbers per head, composed elementwise.
# - **KDA**: `A_t = (I - b_t k_t k_t^T) Diag(a_t)`. M is a dense K x K matrix per head,
#   composed by matrix products.
#
# On the first three rungs `Qt`, what each output reads of the entering state, is
# `q_t` times the decay so far: known from the inputs, without a pass. So a rank runs its
# slice once from zero and corrects later for almost nothing. On KDA's rung `Qt` is what
# the delta rule made of the entering state, and computing it costs a pass (below).
# `cp.ladder_cp` runs every rung the same way: one pass from zero, one all-gather of
# (M in its rung's form, C), a fold in rank order, a correction. Against each rung's
# token-by-token loop, at P = 4, in float64 (the tests add hypothesis over P, T and cuts):

# %%
(q, k, v, g, beta), S0 = random_inputs(256, 2, 8, 8, seed=1)
print(f"{'rung':>9} | {'error vs one rank':>17} | {'bytes rank 1 sends':>18} | {'M per head':>10} | Qt known without a pass")
for rung in cp.RUNGS:
    o, S = cp.ladder_reference(rung, q, k, v, g, beta, S0)
    oc, Sc, comms = cp.ladder_cp(rung, q, k, v, g, beta, ranks=4, initial_state=S0)
    err = max(np.abs(oc - o).max(), np.abs(Sc - S).max())
    qt_free = "yes" if rung != "kda" else "no: the affine pass computes it"
    print(f"{rung:>9} | {err:>17.1e} | {comms[1].bytes_sent:>18,} | {transition_values(rung, 1, 8):>10} | {qt_free}")
cfg = kimi_linear_48b
msg = {rung: (transition_values(rung, cfg.n_heads, cfg.head_dim) + cfg.n_heads * cfg.head_dim ** 2) * 4
       for rung in cp.RUNGS}
print("\none layer of Kimi-Linear-48B's shape (32 heads of 128, fp32), one rank's message: "
      + ", ".join(f"{r} {b / 2**20:.2f} MiB" for r, b in msg.items()))

# %% [markdown]
# Every rung is exact with one pass and a correction. What grows is what a rank must
# send, and what it takes to know `Qt`. Up to per-channel decay the message is C plus at
# most K numbers per head, and `Qt` is free. At KDA's rung M is as large as C (K = V
# here), so the message doubles, and `Qt` has to be computed by a pass.

# %% [markdown]
# ## Wait, or pass twice
#
# The obvious schedule is a relay: rank 0 runs its slice, sends its final state to rank
# 1, which runs, and so on (`scheme="relay"`). LASP's ring passes the state the same
# way, but for linear attention only the cheap correction has to wait for it (the first
# rungs' `Qt` is free). rtp-llm's context parallelism for Qwen3.5's Gated DeltaNet layers relays
# an fp32 state through the slices in global order, running each slice once
# ([rtp-llm-relay](references.md#rtp-llm-relay)). Within one layer it is exact and gains
# nothing: P ranks take as long as one. (Across layers it can pipeline; the cost model
# at the end of this chapter prices both.)
#
# flash-linear-attention's KDA context parallelism ([fla-kcp](references.md#fla-kcp))
# breaks the relay in two passes. Every rank first prepares its chunks once: the gate
# factors, the UT/WY transform `W, U` and the in-chunk scores, which on this CPU is most
# of a pass's work. A short pre-pass over that preparation turns the slice into its
# transition `(M, C)`; the ranks all-gather the transitions, and each folds the earlier
# ones in rank order (`h = M_j h + C_j`, in fp32). A main pass over the same
# preparation then runs from the true entering state and writes the outputs.
# `kda.prepare_kda`, `kda.prepared_transition` and `kda.run_prepared` are those three
# steps (the tests hold them equal to `segment_transition` and `chunk_kda`):

# %%
show_source(kda.prepared_transition)

# %% [markdown]
# ## Or pass once, and correct
#
# A chunk pass from state `S` gives outputs `o = o0 + Qt S` and final state `M S + C`:
# everything is affine in `S`. `kda.chunk_kda_affine` runs the chunk state pass **once**
# on the augmented state `[S | M]` starting from `[0 | I]`. The same output product
# then yields `o0` (the outputs from zero) and `Qt`, and the final augmented state is
# `(C, M)`. When the gates have decayed M to zero (flushed, as the chunk kernel flushes
# decays), the rest of the pass drops the extra columns and costs what a plain pass
# costs, and the correction `o0 + Qt S_in` touches only the rows before the flush.

# %%
show_source(kda.chunk_kda_affine, lines=(1, 12))

# %% [markdown]
# A rank's whole job, for any scheme and either method: a collective shape check first
# (so a bad input errors on every rank instead of leaving the others waiting), the work
# it can do alone, the exchange, the rest. Rank 0 knows its entering state (the prompt's
# initial state), so it runs the plain `chunk_kda`.

# %%
show_source(cp.cp_kda_rank)

# %% [markdown]
# Exactness, in float64, against one rank's `chunk_kda`: every scheme with both methods,
# P from 1 to 8, with an initial state, and on ragged cuts (a slice of one token, a slice
# shorter than a chunk). The tests (`tests/test_cp.py`) add hypothesis over P, T and the
# cut points.

# %%
(q, k, v, g, beta), S0 = random_inputs(600, H, 16, 16, seed=1)
o_ref, S_ref = kda.chunk_kda(q, k, v, g, beta, initial_state=S0)
worst = 0.0
for scheme in cp.SCHEMES:
    for method in cp.METHODS:
        for cut in [{"ranks": P} for P in (1, 2, 3, 5, 8)] + [{"bounds": [0, 1, 40, 41, 600]}]:
            o, S, _ = cp.context_parallel_kda(q, k, v, g, beta, **cut, initial_state=S0, scheme=scheme, method=method)
            worst = max(worst, np.abs(o - o_ref).max(), np.abs(S - S_ref).max())
print(f"{len(cp.SCHEMES)} schemes x {len(cp.METHODS)} methods: largest difference from one rank, "
      f"float64: {worst:.1e}  (<= 1e-10: {worst <= 1e-10})")

# %% [markdown]
# ## A transition that lives
#
# How much of M is left after a slice? `M = prod_t (I - b_t k_t k_t^T) Diag(a_t)` shrinks
# along every key direction the slice writes (the delta rule) and along every channel
# the gate decays. With random unit keys the writes cover all K directions, so M dies
# whatever the gate. Trained models' keys are not random: in softmax-attention models
# they occupy a low-dimensional subspace ([loki](references.md#loki)), and a layer kept
# for long context has slow gates. Where keys live in r of K dimensions, the other
# K - r directions are only decayed by the gate. `cp.regime_inputs` draws both kinds:
# random or low-rank keys (16 of 64 dimensions), Kimi's gate at initialisation or a slow
# gate (per-token decay rates from 1e-6 to 1e-4). `cp.m_lifetime` composes the
# transitions of 256-token blocks and tracks M's largest entry as the slice grows:

# %%
life = {}
for keys, gate in (("random", "kimi-init"), ("random", "slow"), ("low-rank", "kimi-init"), ("low-rank", "slow")):
    (_, k_, v_, g_, b_), _ = cp.regime_inputs(8192, H, K, 8, seed=0, keys=keys, gate=gate)
    life[keys, gate] = cp.m_lifetime(k_, v_, g_, b_, block=256)
fig, ax = plt.subplots(figsize=(6.4, 3.6))
styles = {("random", "kimi-init"): plots.style_of("cp-flushed"), ("low-rank", "slow"): plots.style_of("cp-living"),
          ("random", "slow"): {"color": plots.color("cp-flushed"), "ls": ":", "label": "random keys, slow gate"},
          ("low-rank", "kimi-init"): {"color": plots.color("cp-living"), "ls": ":",
                                      "label": "keys in 16 of 64 dims, Kimi's gate"}}
for combo, (tokens, top) in life.items():
    ax.plot(tokens, np.maximum(top, 1e-300), **styles[combo])
ax.axhline(1e-10, color="#999999", lw=1, ls="--")
ax.text(200, 2e-9, "float32 flush level (1e-10)", fontsize=8, color="#666666")
ax.set_yscale("log")
ax.set_ylim(1e-40, 10)
ax.set_xlabel("slice length (tokens)")
ax.set_ylabel("largest entry of M")
ax.set_title("How long the transition lives (4 heads, K = 64)")
ax.legend(fontsize=8)
plots.save(fig, "ch09-m-lifetime")
plt.show()
for (keys, gate), (tokens, top) in life.items():
    left = cp.lifetime_tokens(tokens, top)
    print(f"keys {keys:>8}, gate {gate:>9}: largest entry {top[7]:.1e} after 2,048 tokens, {top[-1]:.1e} after "
          f"8,192; below 1e-10 from {'never (within 8,192)' if left is None else f'{left:,} tokens'}")

# %% [markdown]
# With random keys M dies within a few thousand tokens, under Kimi's gate or a slow one:
# the delta rule alone erases it. This is the regime the chapter's benchmark ran in
# before (random keys, Kimi's gate, `2**16` tokens), where rank 1's entering state is
# just rank 0's C. Low-rank keys alone do not save M from Kimi's gate at
# initialisation: its decays are fast, and so unequal across channels that they turn
# unwritten directions into written ones, where the delta rule erases them. Only
# low-rank keys and a slow gate together keep M near 1 for the whole prompt. From here on the chapter runs both
# regimes: **flushed** (random keys, Kimi's gate) and **living** (keys in 16 of 64
# dimensions, slow gate).
#
# Once M has flushed, the state leaving a slice is its C whatever entered, so later
# ranks need nothing from before it. The `needed` scheme sends only that: a one-flag
# all-gather (is my M alive?), then each rank sends its C to its neighbour, and its
# (M, C) further only while the ranks in between have M alive. Bytes the busiest rank
# sends for one layer of two heads of 64 in float32, at T = 8,192 (the all-gather's are
# counted, the needed scheme's are what the in-process ranks sent):

# %%
H2 = 2  # two heads of 64 for the cells that run the passes: half the work, the same per-head behaviour
regime_x = {r: cp.regime_inputs(8192, H2, K, V, seed=3, regime=r, dtype=np.float32)[0] for r in cp.REGIMES}
shape_check = 40  # the collective shape check: 5 numbers of 8 bytes to each other rank
print(f"{'regime':>8} {'P':>3} {'slice':>6} | {'all-gather':>10} | {'needed':>7} | ranks r > 0 whose M flushed")
for regime, x in regime_x.items():
    for P in (2, 4, 8):
        _, _, comms = cp.context_parallel_kda(*x, ranks=P, scheme="needed")
        needed = max(c.bytes_sent for c in comms) - (P - 1) * shape_check
        slices_ = [a.reshape(P, 8192 // P, *a.shape[1:]) for a in x]  # P equal slices, one batched pass
        M = kda.chunk_kda_affine(*slices_)[2]
        flushed = int(sum(not M[r].any() for r in range(1, P)))
        print(f"{regime:>8} {P:>3} {8192 // P:>6} | {cp.scheme_costs(P, H2, K, V)['allgather']['bytes'] / 1024:>6.0f} KiB"
              f" | {needed / 1024:>3.0f} KiB | {flushed} of {P - 1}")

# %% [markdown]
# In the flushed regime, once slices are longer than M's lifetime, one state to the
# neighbour is all anyone needs, 2(P - 1) times fewer bytes than the all-gather. Shorter
# slices (P = 8 here) keep some M alive and the saving shrinks. In the living regime
# every later rank needs every earlier transition; the busiest rank sends one
# transition fewer than in the all-gather, not much of a saving.
#
# Precision follows the same split. The entering state of the last rank is a chain of
# P - 1 transitions; folding it in float32 loses a little at each step, and a living M
# carries those errors forward where a flushed one erases them. Transitions of 32 base
# slices are computed once in float64 and composed into P slices; the fold is done in
# both precisions, and beside it the whole float32 CP run (P = 4) is compared with the
# float64 reference:

# %%
def chain_error(x64, Ps):
    """Relative error of the float32 fold of P transitions, for each P (32 base slices, float64 truth)."""
    _, k, v, g, beta = x64
    T = k.shape[0]
    base = [kda.segment_transition(*(a[s] for a in (k, v, g, beta))) for s in cp.slices(cp.split_bounds(T, 32))]
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


Pc, Tc = [2, 4, 8, 16, 32], [1024, 8192]
errors, runs32 = {}, {}
for regime in cp.REGIMES:
    for T in Tc:
        x64, _ = cp.regime_inputs(T, 2, 32, 32, seed=4, regime=regime)
        errors[regime, T] = chain_error(x64, Pc)
    x64, _ = cp.regime_inputs(4096, 2, 32, 32, seed=5, regime=regime)
    o64, _ = kda.chunk_kda(*x64)
    o32, _, _ = cp.context_parallel_kda(*(a.astype(np.float32) for a in x64), ranks=4)
    one32, _ = kda.chunk_kda(*(a.astype(np.float32) for a in x64))
    runs32[regime] = (np.abs(o32 - o64).max() / np.abs(o64).max(), np.abs(one32 - o64).max() / np.abs(o64).max())
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for (regime, T), e in errors.items():
    ax.plot(Pc, e, marker="o", ls="-" if T == Tc[-1] else ":", color=plots.color(f"cp-{regime}"),
            label=f"{regime}, T = {T:,}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(Pc, [str(p) for p in Pc])
ax.set_xlabel("ranks P (transitions in the chain)")
ax.set_ylabel("relative error of the fp32 fold")
ax.set_title("Folding the chain of M in float32 vs float64")
ax.legend(fontsize=7, ncol=2)
plots.save(fig, "ch09-fp32-chain")
plt.show()
for (regime, T), e in errors.items():
    print(f"{regime:>8}, T = {T:>6,}: " + "  ".join(f"P={P}: {x:.1e}" for P, x in zip(Pc, e)))
for regime, (cp32, one32) in runs32.items():
    print(f"{regime:>8}: float32 CP outputs (P = 4) vs float64, relative {cp32:.1e}; one float32 rank {one32:.1e}")

# %% [markdown]
# In float32 the fold stays near float32's rounding (about `1e-7` relative) in both
# regimes; the living chain is a little worse, since nothing erases its errors, but a
# chain of at most 32 small matrix products does not accumulate much. The whole float32
# CP run is as accurate as one float32 rank. Precision starts to matter below float32:
# flash-linear-attention keeps this chain in fp32 precisely because rounding to bf16
# between steps compounds ([fla-kcp](references.md#fla-kcp)).

# %% [markdown]
# ## What a rank's pass costs
#
# The methods differ in the work a rank r > 0 does beyond rank 0's plain pass. The
# affine pass carries K extra columns through the state pass and the output product
# while M lives, then corrects the rows before the flush. KCP runs one extra state pass
# (on K + V columns while M lives, V after) but writes outputs over V columns only. The
# variant this book timed before, `kcp-recompute`, also prepares the chunks twice.
# Counted first (`cp.passes.pass_flops`, from `kda.chunk_kda_flops`' terms), relative to
# the plain pass, for a slice of 4,096 tokens of this chapter's shapes and for one of
# Kimi-Linear-48B's, with M alive throughout (living), flushed after the lifetime just
# measured, or flushed from the start (the limit of a long slice):

# %%
flop_ratio = {}
lifetime = cp.lifetime_tokens(*life["random", "kimi-init"])  # the flushed regime's M, measured above
for shape, (Hs, Ks) in (("4 x 64", (H, K)), ("32 x 128", (32, 128))):
    for regime, alive in (("living", None), (f"flushed after {lifetime:,}", lifetime), ("flushed", 0)):
        if shape == "32 x 128" and regime.startswith("flushed after"):
            continue  # M's lifetime was measured at K = 64 only
        f = pass_flops(4096, Hs, Ks, Ks, alive=alive)
        flop_ratio[shape, regime] = {name: f[name] / f["plain"] for name in f}
        print(f"heads x K {shape:>8}, {regime:>20}: " + "  ".join(
            f"{name} {r:.2f}" for name, r in flop_ratio[shape, regime].items() if name != "plain"))

# %% [markdown]
# By FLOPs, KCP is the cheaper method while M lives (its second state pass costs less
# than the affine pass's wider output product and full correction), the affine pass once
# M has flushed (it then does the plain pass's work, KCP still its pre-pass), already
# when M dies a third of the way into the slice, and preparing twice costs most
# everywhere. Timed on this machine, one slice of 4,096 tokens
# (the slice a P = 2 run of 8,192 tokens gives each rank; two heads of 64), in
# interleaved rounds so that the machine's busy moments hit every pass alike; each
# pass's cost is its time over the plain pass's in the same round, median and range:

# %%
# NBVAL_IGNORE_OUTPUT
SLICE = 4096
measured = {}
for regime in cp.REGIMES:
    x, _ = cp.regime_inputs(SLICE, H2, K, V, seed=3, regime=regime, dtype=np.float32)
    measured[regime] = cost_ratios(pass_seconds(x, rounds=4))
print(f"load average of this machine: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
for regime, r in measured.items():
    print(f"{regime:>8}: " + "  ".join(f"{name} {m:.2f} [{lo:.2f}-{hi:.2f}]" for name, (m, lo, hi) in r.items()
                                       if name != "plain")
          + f"  -> cheaper here: {min(('affine', 'kcp'), key=lambda n: r[n][0])}")
AFFINE = {regime: max(1.0, r["affine"][0]) for regime, r in measured.items()}  # it does at least the plain work

# %% [markdown]
# The ranges show how much one round on a shared machine can mislead; the medians are
# what the cut below uses, and `bench/bench_cp.py` takes more rounds on longer slices.
# On this CPU the numpy passes cost more than their FLOPs say, the wider products most,
# so the measurement favours KCP more than the counts do. The clever single pass does
# not beat fla's two passes once the preparation is shared; it wins only where M
# flushes early in a long slice, and then by KCP's pre-pass. That is the finding. (The
# measured affine cost is the one that balances the cut below.)

# %% [markdown]
# ## Five ways to pass the state
#
# - **sequential**: rank r waits for rank r-1's final state, then sends its own. One
#   state per rank, but a chain of P - 1 messages on the critical path.
# - **relay**: the same chain, but each rank also runs its slice only after its state
#   arrives: the compute is in the chain too.
# - **all-gather + local fold** (fla's): every rank receives every other rank's
#   transition and folds the earlier ones itself: `log2 P` steps with recursive
#   doubling, but P - 1 transitions per rank.
# - **tree scan**: a log-depth inclusive scan of the transitions (each round composes
#   with the partial result `d` ranks back, then `d` doubles), then one shift of the
#   state to the next rank.
# - **needed**: a flag all-gather, then neighbours (above).
#
# Counted for the chapter's shapes (H = 4, K = V = 64, float32), payload bytes of the
# busiest rank. `tests/test_cp.py` holds these counts against what the in-process ranks
# sent, and `tests/test_cp_mpi.py` against the pickled buffers MPI actually carried:

# %%
rows = {P: cp.scheme_costs(P, H, K, V) for P in (2, 3, 4, 8, 16, 64)}
shown = ("sequential", "allgather", "tree", "needed")
print(f"{'P':>3} | " + " | ".join(f"{s:>20}" for s in shown) + "    (needed: every M alive)")
for P, c in rows.items():
    print(f"{P:>3} | " + " | ".join(f"{c[s]['bytes'] / 1024:>6.0f} KiB {c[s]['steps']:>3} steps" + " " * 2 for s in shown))
tree_from = next(P for P in range(2, 65) if cp.scheme_costs(P, H, K, V)["tree"]["bytes"]
                 < cp.scheme_costs(P, H, K, V)["allgather"]["bytes"])
print(f"\nthe tree sends fewer bytes than the all-gather from P = {tree_from}; at P = 2 it sends "
      f"{rows[2]['tree']['bytes'] / rows[2]['allgather']['bytes']:.1f}x the all-gather's")
(q, k, v, g, beta), _ = random_inputs(2048, H, K, V, seed=2, dtype=np.float32)
_, _, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=8, scheme="allgather")
print(f"in-process all-gather at P = 8: {comms[3].bytes_sent - 7 * shape_check:,} bytes sent by rank 3 "
      f"(counted: {rows[8]['allgather']['bytes']:,})")

# %%
Ps = np.arange(2, 65)
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for s in ("sequential", "allgather", "tree"):
    ax.plot(Ps, [cp.scheme_costs(int(P), H, K, V)[s]["steps"] for P in Ps], **plots.style_of(f"cp-{s}"))
ax.plot(Ps, [cp.scheme_costs(int(P), H, K, V)["needed"]["steps"] for P in Ps], ls="--", **plots.style_of("cp-needed"))
ax.set_xlabel("ranks P")
ax.set_ylabel("critical-path steps (messages in a chain)")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_title("Passing the KDA state: critical path vs P")
ax.legend(fontsize=8)
plots.save(fig, "ch09-critical-path")
plt.show()

# %% [markdown]
# The relay's chain grows with P; the all-gather, the tree and the needed scheme stay
# logarithmic. Below P = 4 the tree sends more than the all-gather (one transition per
# round plus a state, against P - 1 transitions); from there on fewer, at one extra step.
# At the P of one machine the all-gather is the shortest and its bytes are still small,
# which is why it is the default here.

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
# ## The whole model, and balanced global layers
#
# `cp.context_parallel_prefill` runs the book's reduced hybrid model (chapter 3) across
# P ranks: per layer, each rank normalises and projects its slice; a KDA layer takes
# the conv's halo (the last raw conv inputs of the earlier ranks, all-gathered) and the
# entering state as above; a global-attention layer runs ring attention, skipping the
# blocks whose keys all come after its queries, as blockwise kernels skip masked tiles.
#
# Contiguous slices make that attention unbalanced: the last rank's queries see every
# key, the first rank's only its own. Megatron-LM balances causal attention with a
# zigzag layout ([megatron-cp-layout](references.md#megatron-cp-layout)): cut the prompt
# into 2P chunks and give rank r chunks r and 2P - 1 - r, an early chunk paired with a
# late one. KDA cannot run on that layout (its state flows from rank r - 1 into rank r),
# so the model keeps the contiguous layout, which 3 of every 4 layers need, and each
# global layer re-deals its input to zigzag and its output back, one all-to-all each way
# (`cp.relayout`), as Megatron's `zigzag_to_contiguous_chunks` does for layers that need
# their tokens in order. The logits and the final cache (KDA states, conv states, every key and value)
# are those of one `Model.prefill` with either layout, including cuts of one and two
# tokens; the scores each rank computed are counted as it runs:

# %%
model = Model(tiny, seed=0)
prompt = np.random.default_rng(5).integers(0, tiny.vocab_size, 128)
ref_cache = model.new_cache()
ref_logits = model.prefill(prompt, ref_cache)
work = {}
for layout, cut in (("contiguous", {"ranks": 4}), ("zigzag", {"ranks": 4}), ("zigzag", {"bounds": [0, 1, 3, 80, 128]})):
    stats = []
    logits, cache = cp.context_parallel_prefill(model, prompt, **cut, layout=layout, stats=stats)
    state_diff = max(np.abs(cache.kda_state(l.index) - ref_cache.kda_state(l.index)).max()
                     for l in model.layers if l.kind == "K")
    kv_diff = max(np.abs(a - b).max() for l in model.layers if l.kind == "A"
                  for a, b in zip(cache.kv(l.index), ref_cache.kv(l.index)))
    print(f"{layout:>10} {cut}: logits differ by {np.abs(logits - ref_logits).max():.1e}, KDA states by "
          f"{state_diff:.1e}, keys/values by {kv_diff:.1e}")
    if "ranks" in cut:
        work[layout] = [s["score_entries"] for s in stats]
for layout, w in work.items():
    print(f"{layout:>10}, P = 4: attention scores per rank {w} -> busiest / mean {max(w) / np.mean(w):.2f}")

# %% [markdown]
# The same count, for a long prompt, without running it (`cp.causal_work`, which the
# tests hold equal to what the ring computed):

# %%
T_LONG = 2**17
fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
imbalance = {}
for layout in ("contiguous", "zigzag"):
    ranks = range(2, 33)
    lay = {P: (cp.contiguous_layout(cp.split_bounds(T_LONG, P)) if layout == "contiguous"
               else cp.zigzag_layout(T_LONG, P)) for P in ranks}
    imbalance[layout] = [max(cp.causal_work(lay[P])) / np.mean(cp.causal_work(lay[P])) for P in ranks]
    axes[0].plot(list(ranks), imbalance[layout], **plots.style_of(f"cp-{layout}"))
    w8 = np.array(cp.causal_work(lay[8])) / np.mean(cp.causal_work(lay[8]))
    axes[1].bar(np.arange(8) + (-0.2 if layout == "contiguous" else 0.2), w8, width=0.4, **plots.style_of(f"cp-{layout}"))
axes[0].set_xlabel("ranks P")
axes[0].set_ylabel("busiest rank's work / mean")
axes[0].set_title(f"Causal attention, T = {T_LONG:,}")
axes[1].set_xlabel("rank (P = 8)")
axes[1].set_ylabel("work / mean")
axes[1].set_title("Work per rank at P = 8")
axes[0].legend(fontsize=8)
plots.save(fig, "ch09-zigzag-work")
plt.show()
print(f"busiest / mean at P = 8: contiguous {imbalance['contiguous'][6]:.2f}, zigzag {imbalance['zigzag'][6]:.3f}; "
      f"at P = 32: {imbalance['contiguous'][-1]:.2f} vs {imbalance['zigzag'][-1]:.3f}")

# %% [markdown]
# With contiguous slices the busiest rank does about twice the mean (2P / (P + 1) of it,
# counting whole tiles), so the attention layers run at about half the speed P ranks
# could give; with zigzag every rank does the same work to within a tile. The price is
# two all-to-alls of one hidden vector per token per global layer; the cost model below
# charges them.

# %% [markdown]
# ## Real processes: `mpiexec`
#
# The `cp` command runs the same `cp_kda_rank` on every rank of an MPI job, with the
# `mpi4py` backend. Each rank draws the same seeded inputs and keeps its slice; rank 0
# also runs the whole prompt alone, in the same job. With `--repeats N` the one-rank run
# and the P-rank run alternate N times after a warm-up of each, and the speedup is the
# ratio of their medians. Rank 0 takes the larger slice, balanced with the affine cost
# just measured in the same regime. The communicator counts both the arrays' payload and
# the pickled buffers it actually handed to MPI. P = 2 on this 2-core machine, both
# regimes, T = 8,192, two heads of 64, 5 repeats:

# %%
# NBVAL_IGNORE_OUTPUT
runs = {regime: launch(2, 2 * SLICE, heads=H2, dim=K, inputs=regime, affine_cost=AFFINE[regime], repeats=5)
        for regime in cp.REGIMES}
print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
for regime, out in runs.items():
    ones, walls = np.array(out["seconds_one_rank_each"]), np.array(out["seconds_p_ranks_each"])
    lo, hi = (ones / walls).min(), (ones / walls).max()
    print(f"{regime:>8}: one rank {np.median(ones):.3f} s, P = 2 {np.median(walls):.3f} s -> speedup "
          f"{out['speedup']:.2f}x (per-repeat ratios {lo:.2f}-{hi:.2f}), efficiency {out['speedup'] / 2:.0%}; "
          f"bounds {out['bounds']}; sent {out['bytes_sent_per_rank']} B payload, "
          f"{out['wire_bytes_sent_per_rank']} B on the wire; error {out['max_abs_error']:.1e}")
print(json.dumps({k: runs["living"][k] for k in ("ranks", "tokens", "inputs", "bounds", "max_abs_error")}))

# %% [markdown]
# These are one machine's seconds, and the machine is shared: the medians move from run
# to run, and the per-repeat ratios show by how much. Two ranks on two cores can at best
# halve the time; the other work on the machine, the unequal passes and the fixed costs
# of an MPI job (processes, barriers) take part of that. `bench/bench_cp.py` runs the
# same comparison on `2**16` tokens with more repeats. On several machines the only
# change is the launch: `mpiexec -f hostfile -n P python -m kimilab cp --tokens T`, with
# the hostfile listing one machine per line (and the same Python environment on each).

# %% [markdown]
# ## Where to cut: balancing the critical path
#
# Rank 0 runs a plain pass; every other rank runs the affine pass, which costs more per
# token while M is alive. With even slices the last rank finishes last. With the cost
# measured above (at least 1: the affine pass does the plain pass's work and more), the
# time of each rank is a line in where the cut falls; the best cut is where they cross,
# and the P = 2 speedup bound is `(1 + a) / a` for an affine cost `a`, at most 2:

# %%
# NBVAL_IGNORE_OUTPUT
share = np.linspace(0.3, 0.8, 51)
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for regime, a in AFFINE.items():
    path = np.maximum(share, (1 - share) * a)
    ax.plot(share, path, **plots.style_of(f"cp-{regime}"))
    best = a / (1 + a)
    w = cp.balanced_weights(2, a)
    print(f"{regime:>8}: affine cost {a:.2f} -> rank 0 takes {best:.0%} of the prompt "
          f"(cp.balanced_weights: {w[0] / sum(w):.0%}); P = 2 bound {(1 + a) / a:.2f}x")
ax.plot(share, share, color=plots.color("chunked"), lw=1, ls="--", label="rank 0 alone (plain pass)")
ax.set_xlabel("rank 0's share of the prompt")
ax.set_ylabel("critical path, as a share of one rank's pass")
ax.set_title("P = 2: the cut that balances the critical path (measured costs)")
ax.legend(fontsize=8)
plots.save(fig, "ch09-split")
plt.show()

# %% [markdown]
# `cp.balanced_weights(P, affine_cost)` computes the cut, and the `cp` command uses it
# (`--affine-cost`, or `--even` for equal slices). The bound is the best the cut can do;
# the measured speedups above sit below it by the machine's other costs.

# %% [markdown]
# ## What a GPU cluster would do: one KDA layer, then the whole model
#
# A cost model, not a measurement: `cp.predicted_speedup` and `cp.model_cp_prefill`
# take the device, the links and the calibrated kernel efficiencies of a named
# deployment (here the accelerator and links of `vllm-tp8-h200`, chapter 3), give each
# of P devices one CP rank, and name their regime: what runs (one KDA layer, or the whole
# 3 : 1 model), over which link (NVLink within a node of 8, the inter-node link beyond),
# P and T. Every speedup is printed beside the device efficiency, speedup / P.
#
# One KDA layer of Kimi-Linear-48B's shape (32 heads of 128) over 2^20 tokens. The model
# does not know the affine cost; it takes it as a band, from the counted cost of the
# cheaper method with M flushed to that with M alive (above), and the band is the
# prediction:

# %%
T_GPU, Pg = 2**20, [1, 2, 4, 8, 16, 32, 64]
edges = {regime: min(flop_ratio["32 x 128", regime][m] for m in ("affine", "kcp")) for regime in ("flushed", "living")}
band = {regime: [cp.predicted_speedup(P, T_GPU, 32, 128, 128, deployment=DEP, affine_cost=a) for P in Pg]
        for regime, a in edges.items()}
print("counted cost of the cheaper method: " + ", ".join(f"{r} {a:.2f}" for r, a in edges.items()))
for P in (8, 16, 64):
    v = {r: cp.kda_layer_verdict(P, T_GPU, 32, 128, 128, deployment=DEP, affine_cost=a) for r, a in edges.items()}
    print(f"{v['flushed']['scope']}, P = {P:>2} over {v['flushed']['link']}, T = {T_GPU:,}: speedup "
          f"{v['living']['speedup']:.2f}x-{v['flushed']['speedup']:.2f}x (efficiency {v['living']['efficiency']:.0%}-"
          f"{v['flushed']['efficiency']:.0%}), living to flushed")

# %%
# NBVAL_IGNORE_OUTPUT
cheaper = [min(r[m][0] for m in ("affine", "kcp")) for r in measured.values()]  # medians, per regime
lo_cost, hi_cost = max(1.0, min(cheaper)), max(1.0, max(cheaper))
fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.fill_between(Pg, band["living"], band["flushed"], color=plots.color("cp-predicted"), alpha=0.25,
                label=f"counted cost {edges['flushed']:.2f}-{edges['living']:.2f} (flushed to living)")
meas = [[cp.predicted_speedup(P, T_GPU, 32, 128, 128, deployment=DEP, affine_cost=a) for P in Pg] for a in (lo_cost, hi_cost)]
ax.fill_between(Pg, meas[1], meas[0], color=plots.color("cp-predicted"), alpha=0.6,
                label=f"measured here: {lo_cost:.2f}-{hi_cost:.2f} (median of the cheaper method)")
ax.plot([1, 2], [1.0, runs["flushed"]["speedup"]], marker="o", **plots.style_of("cp-wall"))
ax.plot(Pg, Pg, color="#cccccc", lw=1, ls=":", label="P (perfect)")
ax.axvline(8, color="#cccccc", lw=1)
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xticks(Pg, [str(p) for p in Pg])
ax.set_yticks(Pg, [str(p) for p in Pg])
ax.set_xlabel("ranks P (devices)")
ax.set_ylabel("speedup over one device (x)")
ax.set_title("One KDA layer, T = 2^20: cost model band vs this machine")
ax.legend(fontsize=7)
plots.save(fig, "ch09-speedup")
plt.show()
print(f"measured cost of the cheaper method (medians) {lo_cost:.2f}-{hi_cost:.2f} -> at P = 8: "
      f"{meas[1][3]:.2f}x-{meas[0][3]:.2f}x; this machine at P = 2: {runs['flushed']['speedup']:.2f}x (flushed)")

# %% [markdown]
# For one KDA layer the exchange is tiny next to the compute at 2^20 tokens, so the
# prediction is mostly the affine cost: the band is the answer, and the grey line at
# P = 8 marks where the link changes from NVLink to the inter-node one. The costs
# measured on this CPU are a proxy; a GPU kernel's ratio would have to be measured on a
# GPU, and would move the prediction within (or beyond) the band.
#
# The whole model is a different question. KDA is a small share of its prefill; the MoE
# weight matmuls and, at long prompts, the global attention dominate:

# %%
for T in (2**15, 2**20):
    parts = cp.model_costs.one_device_parts(kimi_linear_48b, T, deployment=DEP)
    total = sum(parts.values())
    print(f"one {DEP.device.name}, Kimi-Linear-48B, T = {T:>9,}: {total:7.2f} s = " + ", ".join(
        f"{name} {sec / total:.1%}" for name, sec in parts.items()))

# %% [markdown]
# So the affine cost matters little here, and attention's balance a lot.
# `cp.model_cp_prefill` compares four ways to run it on P devices, against one device:
#
# - **exchange, contiguous**: every layer on all ranks at once (KDA by the affine pass
#   and the all-gather, attention by the ring on contiguous slices);
# - **exchange, zigzag**: the same, with the global layers re-dealt to zigzag and back;
# - **relay** (rtp-llm's): each KDA layer's kernel runs rank after rank, the rest in
#   parallel ([rtp-llm-relay](references.md#rtp-llm-relay));
# - **relay pipelined across layers** (our model, not what that PR ships): rank r starts
#   layer l + 1 as soon as it has finished layer l and received rank r - 1's state or
#   keys and values of that layer: a wavefront with no affine pass, but P - 1 layer-steps
#   to fill and the contiguous layout's attention imbalance.

# %%
SCHED = [("exchange", "contiguous", "cp-contiguous"), ("exchange", "zigzag", "cp-zigzag"),
         ("relay", "zigzag", "cp-relay"), ("relay-pipelined", "contiguous", "cp-relay-pipelined")]
P_MODEL, T_MODEL = [2, 4, 8, 16], [2**15, 2**17, 2**20]
verdicts = {(s, lay, P, T): cp.model_cp_prefill(kimi_linear_48b, T, P, deployment=DEP, schedule=s, layout=lay,
                                                 affine_cost=1.5)
            for s, lay, _ in SCHED for P in P_MODEL for T in T_MODEL}
fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4), sharey=True)
for ax, T in zip(axes, (T_MODEL[0], T_MODEL[-1])):
    for s, lay, key in SCHED:
        ax.plot(P_MODEL, [verdicts[s, lay, P, T]["efficiency"] for P in P_MODEL], marker="o",
                label=f"{s}, {lay}", color=plots.color(key))
    ax.axvline(8, color="#cccccc", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(P_MODEL, [str(p) for p in P_MODEL])
    ax.set_xlabel("ranks P (devices)")
    ax.set_title(f"whole model, T = {T:,}")
axes[0].set_ylabel("device efficiency (speedup / P)")
axes[0].legend(fontsize=7)
plots.save(fig, "ch09-model-schedules")
plt.show()
for T in T_MODEL:
    one = verdicts["exchange", "zigzag", 2, T]["one_device_seconds"]
    print(f"T = {T:>9,} (one device {one:.2f} s): " + "; ".join(
        f"{s} {lay}: " + " ".join(f"P{P} {verdicts[s, lay, P, T]['speedup']:.1f}x" for P in (8, 16))
        for s, lay, _ in SCHED))
v = verdicts["exchange", "zigzag", 8, 2**20]
print(f"\nregime of the best: {v['scope']} on {v['P']} x {v['device']} over {v['link']}, T = {v['T']:,}, "
      f"{v['schedule']} + {v['layout']}: {v['speedup']:.2f}x, efficiency {v['efficiency']:.0%}")

# %% [markdown]
# On the whole model the exchange with zigzag global layers keeps most of P at every
# length, within a node and across two. Contiguous slices lose a third of the devices at
# 2^20 tokens, where attention dominates, to the busiest rank. The relay serialises only
# the KDA kernels, a small share, so it stays close at small P and falls behind as P
# grows. Pipelining the relay across layers removes the affine pass but adds P - 1
# layer-steps of fill, and it keeps the contiguous layout's attention imbalance: here it
# never beats the exchange. All of this rests on the calibrated kernel efficiencies of
# chapter 3; the ordering, not the digits, is what to take away. The digits are
# optimistic: rtp-llm's relay measured 3.39x at CP = 8 on 32K tokens of Qwen3.5-9B, a
# different model on different GPUs ([rtp-llm-relay](references.md#rtp-llm-relay)).

# %% [markdown]
# ## Summary
#
# - A KDA slice is an affine map of the state that enters it; maps compose in order, not
#   in any order as attention's log-sum-exp partials do.
# - The ladder from LASP-2 to KDA: additive states are summed in any order; scalar and
#   per-channel decays compose in order but cheaply; KDA's M is a dense K x K matrix, as
#   large as the state, and the part of each output that reads the entering state needs a
#   pass to compute. All four rungs are exact with one pass and a correction.
# - M dies within a few thousand tokens when keys are random (flushed); with low-rank
#   keys and a slow gate it lives (living). Once M has flushed a rank needs only its
#   neighbour's C (the `needed` scheme).
# - fla's two passes over one shared preparation cost about as much as the affine pass,
#   or less when M lives; the old comparison, which prepared twice, flattered the
#   affine pass.
# - Sequential and relay: one state, P - 1 steps. All-gather: P - 1 transitions,
#   `log2 P` steps. Tree: `log2 P + 1` steps, fewer bytes than the all-gather only from
#   P = 4.
# - Causal attention on contiguous slices loads the last rank with about twice the mean;
#   zigzag balances it, at two all-to-alls per global layer. The whole reduced model
#   prefills across P ranks with either layout and matches one rank.
# - Speedups on this machine are medians of interleaved repeats, shown with their spread
#   and efficiency; the GPU numbers are a cost model on a named deployment, for one
#   layer and for the whole model, each with its regime.

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
# **9.3 A balanced cut.** If the affine pass cost 1.8 times the plain pass per token, how
# many of `10,000` tokens would rank 0 take with P = 3, so that every rank finishes
# together? (Rank 0 runs the plain pass; round to a whole token.)

# %% tags=["solution"]
answer = cp.split_bounds(10_000, 3, cp.balanced_weights(3, 1.8))[1]

# %%
verify("9.3", answer)

# %% [markdown]
# **9.4 (open) A middle rung.** Kimi's gate is per channel, but a Mamba-2 or GDN layer
# has one decay per head (the ladder's scalar rung) and GDN adds the delta rule. Where
# does GDN's M sit between the scalar rung and KDA's? Write its transition for one token
# and decide whether `Qt` needs a pass.
#
# **9.5 (open) bf16 chain.** Repeat the fp32 chain experiment in both regimes with the
# transitions rounded to bf16 between steps (emulate it by zeroing the low 16 bits of
# float32). Where does the error pass `1e-2`?
#
# **9.6 (open) The model under MPI.** `mpiexec -n 2 python -m kimilab cp --model tiny
# --tokens 200 --layout zigzag` runs the whole reduced model's CP prefill with balanced
# global layers. Which of its exchanges grow with T, and which would the relay pipelined
# across layers remove?
#
# **9.7 The tree's bytes at 48B.** For Kimi-Linear-48B's KDA shape (32 heads,
# `K = V = 128`, float32), what is the smallest P at which the tree scan's busiest rank
# sends fewer bytes than the all-gather's? (`cp.scheme_costs`.)

# %% tags=["solution"]
answer = next(P for P in range(2, 65) if cp.scheme_costs(P, 32, 128, 128)["tree"]["bytes"]
              < cp.scheme_costs(P, 32, 128, 128)["allgather"]["bytes"])

# %%
verify("9.7", answer)

# %% [markdown]
# **9.8 Zigzag's point.** With contiguous slices, counting whole tiles, how many times
# the mean causal-attention work does the busiest of P = 16 ranks do? (`cp.causal_work`
# on `cp.contiguous_layout`; any T divisible by 16.)

# %% tags=["solution"]
w = cp.causal_work(cp.contiguous_layout(cp.split_bounds(16 * 1024, 16)))
answer = max(w) / np.mean(w)

# %%
verify("9.8", answer)
