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
# per rank, with outputs equal to one rank's. You will climb a ladder of recurrences from
# LASP-2's additive state to KDA's dense transition, let a rank work before it knows the
# state entering its slice, pass that state between ranks in five ways, balance the
# global-attention layers with a zigzag layout, and run it all as real processes over MPI:
# `mpiexec -n P python -m kimilab cp --tokens T`.
#
# **What you'll learn.**
# - Why KDA's slices compose in order, through a dense K x K matrix M, where linear
#   attention's states just add.
# - When M matters at all: with random keys it dies within a few thousand tokens; with
#   low-rank keys and a slow gate it lives.
# - Two ways to work before the entering state is known (one affine pass with a
#   correction, or flash-linear-attention's two passes), and which costs less where.
# - Why causal attention wants a zigzag layout while KDA wants contiguous slices.
# - What a cost model predicts for one KDA layer and for the whole model on a GPU cluster.
#
# **What you'll need.** Chapter 2 (the state, the chunk pass, the segment transition
# `(M, C)`) and chapter 3 (the hybrid model and the calibrated cost model behind
# `costs.Deployment`). The GPU numbers are that cost model; wall-clock numbers are this
# shared 2-core CPU machine's. Ranks are real processes in the `mpiexec` section;
# elsewhere an in-process backend runs the same code.
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
if sys.platform == "emscripten":  # Python in the browser (JupyterLite) starts no threads or processes
    raise SystemExit("Chapter 9 runs its ranks as threads, and as processes under mpiexec, which Python in the browser cannot start. "
                     "Open it in Binder or Colab, or read its stored outputs on the web.")

# %%
import json
import os

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

from kimilab import costs, cp, kda, plots
from kimilab.config import kimi_linear_48b, tiny
from kimilab.cp.launch import launch
from kimilab.cp.ladder import transition_values
from kimilab.cp.passes import cost_ratios, pass_flops, pass_seconds
from kimilab.exercises import verify
from kimilab.kda.testing import random_inputs
from kimilab.model import Model
from kimilab.notebook import key_results, show_source, show_table
from kimilab.verdict import crossover

plots.use_style()
H, K, V, H2 = 4, 64, 64, 2  # heads and dims; H2 heads of 64 for the cells that time passes
DEP = costs.VLLM_TP8_H200  # the GPU numbers' device, links and calibrated kernels (chapter 3)

# %%
# Key results (each number is computed here and derived step by step below)
worst = cp.worst_cp_difference(600, H, 16, 16, seed=1)  # every scheme, method and cut vs one rank
life = cp.regime_lifetimes(8192, H, K, seed=0, block=256)  # M's largest entry as a slice grows
tokens, top = life["low-rank", "slow"]
work = [cp.causal_work(lay) for lay in (cp.contiguous_layout(cp.split_bounds(2**17, 8)), cp.zigzag_layout(2**17, 8))]
model8 = [cp.model_cp_prefill(kimi_linear_48b, T, 8, deployment=DEP, schedule="exchange", layout="zigzag",
                              affine_cost=1.5) for T in (2**15, 2**17, 2**20)]
key_results(
    f"All {len(cp.SCHEMES)} ways of passing the state, with both ways of working before it arrives, match one "
    f"rank's outputs and final state to {worst:.1e} in float64.",
    f"With random keys the transition M falls below float32's flush level within "
    f"{cp.lifetime_tokens(*life['random', 'kimi-init']):,} tokens; with keys in {K // 4} of {K} dimensions and "
    f"a slow gate its largest entry is still {top[-1]:.2f} after {tokens[-1]:,} tokens.",
    f"On contiguous slices the busiest of 8 ranks does {max(work[0]) / np.mean(work[0]):.2f}x the mean "
    f"causal-attention work at {2**17:,} tokens; a zigzag layout brings it to {max(work[1]) / np.mean(work[1]):.3f}x.",
    f"In the cost model, Kimi-Linear-48B on 8 x {model8[0]['device']} with zigzag global layers prefills "
    f"{min(v['speedup'] for v in model8):.1f}x-{max(v['speedup'] for v in model8):.1f}x faster than on one, "
    f"for prompts of {model8[0]['T']:,} to {model8[-1]['T']:,} tokens.",
)

# %% [markdown]
# ## The problem: a state that does not add
#
# <a id="term-context-parallelism"></a><a id="term-rank"></a>**Context parallelism** (CP) cuts
# one long prompt into P contiguous slices, one per *rank* (a process on its own device),
# so that P devices share one prefill. A segment acts on the KDA state as an affine map,
# its transition `S_out = M S_in + C` (chapter 2). Slices A then B give
# `M_B (M_A S + C_A) + C_B`: the maps compose, but **in order**. Attention's partial
# results over two key blocks merge with the log-sum-exp rule in either order:

# %%
(q, k, v, g, beta), S0 = random_inputs(256, 2, 8, 8, seed=0)
A = kda.segment_transition(*(x[:128] for x in (k, v, g, beta)))
B = kda.segment_transition(*(x[128:] for x in (k, v, g, beta)))
AB, BA = kda.compose_transitions(A, B), kda.compose_transitions(B, A)
gap = np.abs(kda.apply_transition(*AB, S0) - kda.apply_transition(*BA, S0)).max()
print(f"KDA: |state(A then B) - state(B then A)| = {gap:.3f}")
pos = np.arange(256)
left = cp.partial_attention(q, k[:128], v[:128], pos, pos[:128])
right = cp.partial_attention(q, k[128:], v[128:], pos, pos[128:])
gap = np.abs(cp.merge_partials(left, right)[0] - cp.merge_partials(right, left)[0]).max()
print(f"attention: |merge(left, right) - merge(right, left)| = {gap:.1e}")

# %% [markdown]
# So a rank cannot finish its slice until it knows the state entering it, which depends
# on every slice before it.
#
# ## A ladder from LASP-2 to KDA
#
# <a id="term-all-gather"></a>Linear attention's state is a sum, `S_t = S_{t-1} + k_t v_t^T`,
# so the state entering rank r is the sum of the earlier ranks' states, in any order.
# LASP-2 ([lasp-2](references.md#lasp-2)) gets it with one *all-gather* (every rank
# receives every other rank's piece), after which each rank sums the ones before it.
# Every rung of the ladder is a recurrence `S_t = A_t S_{t-1} + w_t` read by
# `o_t = S_t^T q_t`, so a slice maps its entering state affinely, `S_out = M S_in + C` and
# `o = o0 + Qt S_in`; what changes up the ladder is M:
#
# - **additive** (linear attention): `A_t = I`, so M = I;
# - **scalar decay** (one gate per head): `A_t = a_t I`, one number per head;
# - **per-channel decay** (as in GLA): `A_t = Diag(a_t)`, K numbers per head;
# - **KDA**: `A_t = (I - b_t k_t k_t^T) Diag(a_t)`, a dense K x K matrix per head.
#
# On the first three rungs `Qt` (what each output reads of the entering state) is `q_t`
# times the decay so far, known from the inputs; on KDA's it is what the delta rule made
# of the entering state, and it costs a pass. The deep dive runs all four rungs through
# `cp.ladder_cp` (exact) and sizes their messages: KDA's is twice the others', 4.00 MiB
# per rank for one layer of Kimi-Linear-48B.

# %% [markdown]
# ### Deep dive: the four rungs, run and sized
#
# LASP ([lasp](references.md#lasp)) passed the additive state around a ring of devices
# before LASP-2's all-gather. `cp.ladder_cp` runs every rung the same way: one pass from
# zero, an all-gather of (M, C), a fold in rank order, a correction. Each rung at P = 4,
# against its token-by-token loop, in float64 (the tests add hypothesis over P, T and
# cuts); the bytes rank 1 sends here (2 heads of 8); and one rank's message for one layer
# of Kimi-Linear-48B's shape (32 heads of 128, float32):

# %%
(q, k, v, g, beta), S0 = random_inputs(256, 2, 8, 8, seed=1)
cfg, rows = kimi_linear_48b, []
for rung in cp.RUNGS:
    o, S = cp.ladder_reference(rung, q, k, v, g, beta, S0)
    oc, Sc, comms = cp.ladder_cp(rung, q, k, v, g, beta, ranks=4, initial_state=S0)
    values = transition_values(rung, cfg.n_heads, cfg.head_dim) + cfg.n_heads * cfg.head_dim ** 2
    rows.append((rung, max(np.abs(oc - o).max(), np.abs(Sc - S).max()), comms[1].bytes_sent,
                 transition_values(rung, 1, 8), values * 4 / 2**20, "no: a pass" if rung == "kda" else "yes"))
show_table(rows, ["rung", "error vs one rank", "bytes rank 1 sends", "M per head", "48B MiB", "Qt free"],
           formats={"error vs one rank": ".1e", "48B MiB": ".2f"}, title="The ladder at P = 4")

# %% [markdown]
# Every rung is exact with one pass and a correction. What grows is the message and the
# price of `Qt`: up to per-channel decay a rank sends C plus at most K numbers per head,
# and `Qt` is free; on KDA's rung M is as large as C (K = V here), so the message
# doubles, and `Qt` needs a pass.

# %% [markdown]
# ## One pass, then a correction
#
# <a id="term-relay"></a>The obvious schedule is a *relay*: rank 0 runs its slice and sends
# its final state to rank 1, which runs its slice, and so on, as rtp-llm does for
# Qwen3.5's Gated DeltaNet layers ([rtp-llm-relay](references.md#rtp-llm-relay)). It is
# exact and, within one layer, gains nothing: P ranks take as long as one.
#
# <a id="term-affine-pass"></a>A rank can instead work before its entering state arrives.
# From state `S` a chunk pass gives outputs `o = o0 + Qt S` and final state `M S + C`. The
# *affine pass*, `kda.chunk_kda_affine`, runs the chunk state pass once on the augmented
# state `[S | M]` from `[0 | I]`, so the same products yield `o0` (the outputs from zero),
# `Qt` and `(M, C)`. Once the gates have decayed M to zero (flushed below 1e-10, as the
# chunk kernel flushes decays), it drops the extra columns and costs a plain pass.
# flash-linear-attention's *KCP* ([fla-kcp](references.md#fla-kcp)) instead makes two
# passes over one shared preparation of the chunks: a pre-pass for `(M, C)`, then, once
# the state is known, the main pass. A rank's work before the exchange, by either method
# (rank 0 knows its entering state and runs the plain pass):

# %%
show_source(cp.kda_cp._local)

# %% [markdown]
# Exactness against one rank's `chunk_kda`, in float64 on 600 tokens:
# `cp.worst_cp_difference` runs every scheme (below) with both methods, P from 1 to 8, and
# ragged cuts (a slice of one token, one shorter than a chunk); `tests/test_cp.py` adds
# hypothesis over P, T and the cut points.

# %%
worst = cp.worst_cp_difference(600, H, 16, 16, seed=1)  # memoised: the key results' run
print(f"{len(cp.SCHEMES)} schemes x {len(cp.METHODS)} methods x 6 cuts: largest difference from one rank "
      f"{worst:.1e} (<= 1e-10: {worst <= 1e-10})")

# %% [markdown]
# The deep dive lists a rank's whole job and both methods' passes in full: each pass
# carries `[S | M]` and drops M's columns once M has flushed.
#
# ### Deep dive: a rank's job, the affine pass and KCP's pre-pass, in full
#
# `cp.cp_kda_rank` is a rank's whole job: a collective shape check (a bad input errors on
# every rank instead of leaving the others waiting), the work it can do alone, the
# exchange, the rest:

# %%
show_source(cp.cp_kda_rank)

# %% [markdown]
# KCP first prepares every chunk once: the gate factors, the UT/WY transform `W, U` and
# the in-chunk scores, which on this CPU is most of a pass's work. A pre-pass over that
# preparation turns the slice into its transition `(M, C)`; the ranks all-gather the
# transitions, and each folds the earlier ones in rank order (`h = M_j h + C_j`, in fp32).
# A main pass over the same preparation then runs from the true entering state.
# `kda.prepare_kda`, `kda.prepared_transition` and `kda.run_prepared` are those three
# steps (the tests hold them equal to `segment_transition` and `chunk_kda`). The
# affine pass instead does it all in one pass and corrects the outputs afterwards with
# `kda.apply_affine_outputs`, touching only the rows before M flushed:

# %%
show_source(kda.chunk_kda_affine, limit=None)

# %%
show_source(kda.prepared_transition)

# %% [markdown]
# ## A transition that lives
#
# `M = prod_t (I - b_t k_t k_t^T) Diag(a_t)` shrinks along every key direction the slice
# writes (the delta rule) and every channel the gate decays. Random unit keys write all K
# directions, so M dies whatever the gate. But trained models' keys occupy a
# low-dimensional subspace ([loki](references.md#loki)), and a layer kept for long
# context has slow gates. `cp.regime_lifetimes` draws random keys or keys in 16 of 64
# dimensions, with Kimi's gate at initialisation or a slow gate (decay rates 1e-6 to 1e-4
# per token), and tracks M's largest entry over 256-token blocks:

# %%
life = cp.regime_lifetimes(8192, H, K, seed=0, block=256)  # memoised: the key results' run
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for (keys, gate), (tokens, top) in life.items():
    regime = "flushed" if keys == "random" else "living"
    style = plots.style_of(f"cp-{regime}") if cp.REGIMES[regime] == (keys, gate) else \
        {"color": plots.color(f"cp-{regime}"), "ls": ":",
         "label": "random keys, slow gate" if keys == "random" else "keys in 16 of 64 dims, Kimi's gate"}
    ax.plot(tokens, np.maximum(top, 1e-300), **style)
ax.axhline(1e-10, color="#999999", lw=1, ls="--")
ax.text(200, 2e-9, "float32 flush level (1e-10)", fontsize=8, color="#666666")
ax.set(yscale="log", ylim=(1e-40, 10), xlabel="slice length (tokens)", ylabel="largest entry of M",
       title="How long the transition lives (4 heads, K = 64)")
ax.legend(fontsize=8)
plots.save(fig, "ch09-m-lifetime")
plt.show()
show_table([(keys, gate, top[7], top[-1], cp.lifetime_tokens(tokens, top) or "never")
            for (keys, gate), (tokens, top) in life.items()],
           ["keys", "gate", "after 2,048", "after 8,192", "below 1e-10 from (tokens)"],
           formats={"after 2,048": ".1e", "after 8,192": ".1e"}, title="Largest entry of M")

# %% [markdown]
# With random keys the delta rule alone erases M, under either gate. Low-rank keys alone
# do not save it from Kimi's gate at initialisation, whose fast, unequal decays turn
# unwritten directions into written ones. Only low-rank keys and a slow gate keep M near 1
# for the whole prompt. From here on the chapter runs both regimes:
#
# - <a id="term-flushed-regime"></a>**flushed** (random keys, Kimi's gate): M reaches zero
#   inside a slice, so the state leaving it is its C whatever entered;
# - <a id="term-living-regime"></a>**living** (keys in 16 of 64 dimensions, slow gate): M
#   stays near 1, and every rank needs every earlier transition.
#
# The last rank's entering state is a chain of P - 1 transitions; the deep dive folds it
# in float32 and finds it stays near float32's rounding in both regimes.
#
# ### Deep dive: folding the chain in float32
#
# Transitions of 32 base slices are computed once in float64 and composed into P slices;
# the fold is done in both precisions, and beside it the whole float32 CP run (P = 4) is
# compared with the float64 reference:

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
display(show_table([(regime, f"{T:,}", *e) for (regime, T), e in errors.items()], ["regime", "T", *map(str, Pc)],
                   formats={str(P): ".1e" for P in Pc}, title="Relative error of the float32 fold, by P"))
show_table([(regime, a, b) for regime, (a, b) in runs32.items()], ["regime", "CP at P = 4", "one rank"],
           formats={"CP at P = 4": ".1e", "one rank": ".1e"}, title="float32 outputs vs float64, relative")

# %% [markdown]
# The fold stays near float32's rounding (about `1e-7` relative) in both regimes; the
# living chain is a little worse, since nothing erases its errors, but a chain of at most
# 32 small matrix products does not accumulate much. The whole float32 CP run is as
# accurate as one float32 rank. Precision starts to matter below float32:
# flash-linear-attention keeps this chain in fp32 precisely because rounding to bf16
# between steps compounds ([fla-kcp](references.md#fla-kcp)).

# %% [markdown]
# ## What a rank's pass costs
#
# The methods differ in the work a rank r > 0 does beyond rank 0's plain pass. The affine
# pass carries K extra columns through the state pass and the output product while M
# lives, then corrects the rows before the flush. KCP runs one extra state pass (on K + V
# columns while M lives, V after) but writes outputs over V columns only. The deep dive
# counts both (and `kcp-recompute`, which also prepares the chunks twice) and times them:
# by FLOPs KCP is the cheaper method while M lives and the affine pass once M has flushed
# (1.00 against 1.39 at Kimi-Linear-48B's shape), while on this CPU the wider products
# cost more than their FLOPs say, which favours KCP.
#
# ### Deep dive: counting and timing the passes
#
# Counted first (`cp.passes.pass_flops`, from `kda.chunk_kda_flops`' terms), relative to
# the plain pass, for a slice of 4,096 tokens of this chapter's shapes and of
# Kimi-Linear-48B's, with M alive throughout (living), flushed after the lifetime
# measured above, or flushed from the start (the limit of a long slice):

# %%
flop_ratio = {}
lifetime = cp.lifetime_tokens(*life["random", "kimi-init"])  # the flushed regime's M, measured above
for shape, (Hs, Ks) in (("4 x 64", (H, K)), ("32 x 128", (32, 128))):
    for regime, alive in (("living", None), (f"flushed after {lifetime:,}", lifetime), ("flushed", 0)):
        if shape == "32 x 128" and regime.startswith("flushed after"):
            continue  # M's lifetime was measured at K = 64 only
        f = pass_flops(4096, Hs, Ks, Ks, alive=alive)
        flop_ratio[shape, regime] = {name: f[name] / f["plain"] for name in f}
show_table([(shape, regime, r["affine"], r["kcp"], r["kcp-recompute"]) for (shape, regime), r in flop_ratio.items()],
           ["heads x K", "M", "affine", "kcp", "kcp-recompute"],
           formats={c: ".2f" for c in ("affine", "kcp", "kcp-recompute")}, title="FLOPs relative to the plain pass")

# %% [markdown]
# KCP is the cheaper method while M lives (its second state pass costs less than the
# affine pass's wider output product and full correction), the affine pass once M has
# flushed (it then does the plain pass's work, KCP still its pre-pass), already when M
# dies a third of the way into the slice; preparing twice costs most everywhere. Timed
# on this machine, one slice of 4,096 tokens (a P = 2 run's slice of 8,192 tokens; two
# heads of 64), in interleaved rounds so that the machine's busy moments hit every pass
# alike; each pass's cost is its time over the plain pass's in the same round, median and
# range:

# %%
# NBVAL_IGNORE_OUTPUT
SLICE = 4096
measured = {}
for regime in cp.REGIMES:
    x, _ = cp.regime_inputs(SLICE, H2, K, V, seed=3, regime=regime, dtype=np.float32)
    measured[regime] = cost_ratios(pass_seconds(x, rounds=4))
AFFINE = {regime: max(1.0, r["affine"][0]) for regime, r in measured.items()}  # it does at least the plain work
print(f"load average of this machine: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
show_table([(regime, *(f"{m:.2f} [{lo:.2f}-{hi:.2f}]" for name, (m, lo, hi) in r.items() if name != "plain"),
             min(("affine", "kcp"), key=lambda n: r[n][0])) for regime, r in measured.items()],
           ["regime", *(n for n in next(iter(measured.values())) if n != "plain"), "cheaper here"],
           title="Time relative to the plain pass, median [range] (wall clock)")

# %% [markdown]
# The ranges show how much one round on a shared machine can mislead; the medians are
# what the cut below uses, and `bench/bench_cp.py` takes more rounds on longer slices.
# On this CPU the numpy passes cost more than their FLOPs say, the wider products most,
# so the measurement favours KCP more than the counts do. The clever single pass does not
# beat fla's two passes once the preparation is shared; it wins only where M flushes
# early in a long slice, and then by KCP's pre-pass.

# %% [markdown]
# ## Five ways to pass the state
#
# - **sequential**: rank r waits for rank r-1's final state, then sends its own: one
#   state per rank, but a chain of P - 1 messages on the critical path.
# - **relay**: the same chain, with each rank's pass in it too.
# - **all-gather + local fold** (fla's): every rank receives every other rank's transition
#   and folds the earlier ones itself: `log2 P` steps with recursive doubling, but P - 1
#   transitions per rank. The default here.
# - **tree scan**: a log-depth inclusive scan of the transitions (each round composes
#   with the partial result `d` ranks back, then `d` doubles), then one shift of the
#   state to the next rank.
# - **needed**: a one-flag all-gather (is my M alive?), then each rank sends its C to its
#   neighbour, and its (M, C) further only while the ranks in between have M alive.
#
# The deep dive counts bytes and steps: at the P of one machine the all-gather has the
# shortest critical path and its bytes are small; the tree sends fewer bytes from P = 4;
# the needed scheme sends 2(P - 1) times fewer than the all-gather in the flushed regime
# once slices outlive M; and ring attention's bytes, unlike KDA's, grow with the prompt
# (2048x KDA's at P = 8 and 2^20 tokens).
#
# ### Deep dive: bytes and steps of each scheme
#
# Counted for the chapter's shapes (H = 4, K = V = 64, float32): payload bytes of the
# busiest rank and critical-path steps. `tests/test_cp.py` holds these counts against
# what the in-process ranks sent, and `tests/test_cp_mpi.py` against the pickled buffers
# MPI actually carried:

# %%
shape_check = 40  # the collective shape check: 5 numbers of 8 bytes to each other rank
shown = ("sequential", "allgather", "tree", "needed")
rows = {P: cp.scheme_costs(P, H, K, V) for P in (2, 3, 4, 8, 16, 64)}
tree_from = next(P for P in range(2, 65) if cp.scheme_costs(P, H, K, V)["tree"]["bytes"]
                 < cp.scheme_costs(P, H, K, V)["allgather"]["bytes"])
print(f"the tree sends fewer bytes than the all-gather from P = {tree_from}; at P = 2 it sends "
      f"{rows[2]['tree']['bytes'] / rows[2]['allgather']['bytes']:.1f}x the all-gather's")
(q, k, v, g, beta), _ = random_inputs(2048, H, K, V, seed=2, dtype=np.float32)
_, _, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=8, scheme="allgather")
print(f"in-process all-gather at P = 8: {comms[3].bytes_sent - 7 * shape_check:,} bytes sent by rank 3 "
      f"(counted: {rows[8]['allgather']['bytes']:,})")
show_table([(P, *(f"{c[s]['bytes'] // 1024} KiB, {c[s]['steps']} step" + "s" * (c[s]["steps"] > 1) for s in shown))
            for P, c in rows.items()],
           ["P", *shown], title="Busiest rank's bytes and critical-path steps (needed: every M alive)")

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
#
# The needed scheme depends on the regime. Bytes the busiest rank sends for one layer of
# two heads of 64 in float32, at T = 8,192 (the all-gather's are counted, the needed
# scheme's are what the in-process ranks sent):

# %%
regime_x = {r: cp.regime_inputs(8192, H2, K, V, seed=3, regime=r, dtype=np.float32)[0] for r in cp.REGIMES}
rows = []
for regime, x in regime_x.items():
    for P in (2, 4, 8):
        _, _, comms = cp.context_parallel_kda(*x, ranks=P, scheme="needed")
        needed = max(c.bytes_sent for c in comms) - (P - 1) * shape_check
        slices_ = [a.reshape(P, 8192 // P, *a.shape[1:]) for a in x]  # P equal slices, one batched pass
        M = kda.chunk_kda_affine(*slices_)[2]
        flushed = int(sum(not M[r].any() for r in range(1, P)))
        rows.append((regime, P, 8192 // P, cp.scheme_costs(P, H2, K, V)["allgather"]["bytes"] / 1024,
                     needed / 1024, f"{flushed} of {P - 1}"))
show_table(rows, ["regime", "P", "slice", "all-gather KiB", "needed KiB", "ranks r > 0 whose M flushed"],
           formats={"slice": "d", "all-gather KiB": ".0f", "needed KiB": ".0f"})

# %% [markdown]
# In the flushed regime, once slices are longer than M's lifetime, one state to the
# neighbour is all anyone needs, 2(P - 1) times fewer bytes than the all-gather. Shorter
# slices (P = 8 here) keep some M alive and the saving shrinks. In the living regime every
# later rank needs every earlier transition; the busiest rank sends one transition fewer
# than in the all-gather, not much of a saving.
#
# Attention is the contrast. Ring attention (`cp.ring_attention_rank`, defined in the
# next section) passes each rank's key/value block around the ring: P - 1 blocks of
# T / P tokens, so its bytes grow with T. KDA's exchange is a transition per rank, whatever
# T. For one layer of the chapter's shapes (attention with the same 4 heads of 64,
# float32 keys and values), at P = 8:

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
# KDA's line is flat; attention's grows linearly with the prompt. (The commutative merge
# is what lets ring attention overlap sending with computing; KDA's ordered composition
# instead needs the one small exchange in the middle.)

# %% [markdown]
# ## The whole model, and balanced global layers
#
# `cp.context_parallel_prefill` runs the book's reduced hybrid model (chapter 3) across P
# ranks. A KDA layer takes the conv's halo (the earlier ranks' last conv inputs,
# all-gathered) and its entering state as above.
#
# <a id="term-ring-attention"></a>A global-attention layer runs *ring attention*
# ([ring-attention](references.md#ring-attention)): each rank's key/value block travels
# around the ring of ranks, each rank merges its partials with the log-sum-exp rule and
# skips blocks whose keys all come after its queries.
#
# <a id="term-zigzag-layout"></a>Contiguous slices make causal attention unbalanced: the
# last rank's queries see every key, the first rank's only its own. Megatron-LM's *zigzag
# layout* ([megatron-cp-layout](references.md#megatron-cp-layout)) cuts the prompt into 2P
# chunks and gives rank r chunks r and 2P - 1 - r. KDA cannot run on it (its state flows
# from rank r - 1 into rank r), so the model keeps contiguous slices and each global layer
# re-deals its input to zigzag and its output back, one all-to-all each way
# (`cp.relayout`). The logits and the final cache must equal one `Model.prefill`'s with
# either layout, even with slices of one and two tokens:

# %%
model = Model(tiny, seed=0)
prompt = np.random.default_rng(5).integers(0, tiny.vocab_size, 128)
ref_cache = model.new_cache()
ref_logits = model.prefill(prompt, ref_cache)
rows = []
for layout, cut in (("contiguous", {"ranks": 4}), ("zigzag", {"ranks": 4}), ("zigzag", {"bounds": [0, 1, 3, 80, 128]})):
    stats = []
    logits, cache = cp.context_parallel_prefill(model, prompt, **cut, layout=layout, stats=stats)
    state_diff = max(np.abs(cache.kda_state(layer.index) - ref_cache.kda_state(layer.index)).max()
                     for layer in model.layers if layer.kind == "K")
    kv_diff = max(np.abs(a - b).max() for layer in model.layers if layer.kind == "A"
                  for a, b in zip(cache.kv(layer.index), ref_cache.kv(layer.index)))
    w = [s["score_entries"] for s in stats]
    rows.append((layout, str(cut.get("bounds", "4 even")), np.abs(logits - ref_logits).max(), state_diff, kv_diff,
                 " ".join(map(str, w)), max(w) / np.mean(w)))
show_table(rows, ["layout", "cut", "logits", "KDA states", "keys/values", "scores per rank", "max/mean"],
           formats={"logits": ".1e", "KDA states": ".1e", "keys/values": ".1e", "max/mean": ".2f"},
           title="Differences from one Model.prefill, and attention scores per rank")

# %% [markdown]
# Both layouts match one rank to rounding. On 4 even slices the last contiguous rank
# computes 1.60 times the mean attention scores, zigzag's busiest 1.08. The deep dive
# counts tiles at 2^17 tokens: at P = 8, 1.78 times the mean (2P / (P + 1)) against 1.051.
#
# ### Deep dive: causal attention's balance at long prompts
#
# The same count for a long prompt, without running it (`cp.causal_work`, which the tests
# hold equal to what the ring computed):

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
# could give; with zigzag every rank does the same work to within a tile. The cost model
# below charges zigzag's two all-to-alls.

# %% [markdown]
# ## Real processes: `mpiexec`
#
# The `cp` command runs the same `cp_kda_rank` on every rank of an MPI job (`mpi4py` and
# `mpich`, both in the default install). Each rank draws the same seeded inputs and keeps
# its slice; rank 0 also runs the whole prompt alone. With `--repeats N` the two runs
# alternate N times after a warm-up, and the speedup is the ratio of their medians. Rank 0
# takes the larger slice (the affine cost timed above sets the cut). P = 2 on this
# 2-core machine, T = 8,192, two heads of 64, 5 repeats:

# %%
# NBVAL_IGNORE_OUTPUT
runs = {regime: launch(2, 2 * SLICE, heads=H2, dim=K, inputs=regime, affine_cost=AFFINE[regime], repeats=5)
        for regime in cp.REGIMES}
print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
print(json.dumps({k: runs["living"][k] for k in ("ranks", "tokens", "inputs", "bounds")}))
one, two = ({r: np.array(out[f"seconds_{n}_each"]) for r, out in runs.items()} for n in ("one_rank", "p_ranks"))
show_table([(r, np.median(one[r]), np.median(two[r]), out["speedup"], f"{min(one[r] / two[r]):.2f}-"
             f"{max(one[r] / two[r]):.2f}", out["speedup"] / 2, out["bounds"][1], out["bytes_sent_per_rank"][0],
             out["wire_bytes_sent_per_rank"][0], out["max_abs_error"]) for r, out in runs.items()],
           ["regime", "1 rank s", "P=2 s", "speedup", "per repeat", "eff.", "cut", "payload B", "wire B", "error"],
           formats={"1 rank s": ".3f", "P=2 s": ".3f", "speedup": ".2f", "eff.": ".0%", "error": ".1e"},
           title="mpiexec -n 2, wall clock (bytes sent by rank 0)")

# %% [markdown]
# These are a shared machine's seconds: the medians move from run to run, and the
# per-repeat ratios show by how much. Two ranks on two cores can at best halve the time;
# other work, the unequal passes and an MPI job's fixed costs take part of that.
# `bench/bench_cp.py` runs `2**16` tokens with more repeats. The same command runs the
# whole reduced model (`--model tiny --layout zigzag`), and on several machines only the
# launch changes (`mpiexec -f hostfile -n P ...`). The deep dive finds the cut at which
# rank 0 (plain pass) and rank 1 (affine pass) finish together, and the P = 2 speedup
# bound `(1 + a) / a` for an affine cost `a`.
#
# ### Deep dive: where to cut
#
# With the cost measured above (at least 1: the affine pass does the plain pass's work
# and more), the time of each rank is a line in where the cut falls; the best cut is
# where they cross:

# %%
# NBVAL_IGNORE_OUTPUT
share = np.linspace(0.3, 0.8, 51)
fig, ax = plt.subplots(figsize=(6.4, 3.6))
rows = []
for regime, a in AFFINE.items():
    ax.plot(share, np.maximum(share, (1 - share) * a), **plots.style_of(f"cp-{regime}"))
    w = cp.balanced_weights(2, a)
    rows.append((regime, a, a / (1 + a), w[0] / sum(w), (1 + a) / a))
ax.plot(share, share, color=plots.color("chunked"), lw=1, ls="--", label="rank 0 alone (plain pass)")
ax.set_xlabel("rank 0's share of the prompt")
ax.set_ylabel("critical path, as a share of one rank's pass")
ax.set_title("P = 2: the cut that balances the critical path (measured costs)")
ax.legend(fontsize=8)
plots.save(fig, "ch09-split")
plt.show()
show_table(rows, ["regime", "affine cost", "rank 0 share", "cp.balanced_weights", "P = 2 bound"],
           formats={"affine cost": ".2f", "rank 0 share": ".0%", "cp.balanced_weights": ".0%", "P = 2 bound": ".2f"})

# %% [markdown]
# `cp.balanced_weights(P, affine_cost)` computes the cut, and the `cp` command uses it
# (`--affine-cost`, or `--even` for equal slices). The bound is the best the cut can do;
# the measured speedups above sit below it by the machine's other costs.

# %% [markdown]
# ## What a GPU cluster would do
#
# A cost model, not a measurement: `cp.model_cp_prefill` takes the device, links and
# calibrated kernel efficiencies of `vllm-tp8-h200` (chapter 3), gives each of P devices
# one CP rank, and names each answer's regime: what runs, over which link (NVLink within
# a node of 8, the inter-node link beyond), P and T. KDA is a small share of the whole
# model's prefill; the MoE weight matmuls and, at long prompts, attention dominate. Four
# ways to run the model on P devices:
#
# - **exchange, contiguous**: every layer on all ranks at once (KDA by the affine pass and
#   the all-gather, attention by the ring);
# - **exchange, zigzag**: the same, with the global layers re-dealt to zigzag and back;
# - **relay** (rtp-llm's): each KDA layer's kernel runs rank after rank;
# - **relay pipelined across layers** (our model): rank r starts layer l + 1 once it has
#   finished layer l and received rank r - 1's state or keys and values: no affine pass,
#   but P - 1 layer-steps to fill and contiguous attention's imbalance.

# %%
SCHED = [("exchange", "contiguous", "cp-contiguous"), ("exchange", "zigzag", "cp-zigzag"),
         ("relay", "zigzag", "cp-relay"), ("relay-pipelined", "contiguous", "cp-relay-pipelined")]
P_MODEL, T_MODEL = [2, 4, 8, 16], [2**15, 2**17, 2**20]
verdicts = {(s, lay, P, T): cp.model_cp_prefill(kimi_linear_48b, T, P, deployment=DEP, schedule=s, layout=lay,
                                                 affine_cost=1.5)
            for s, lay, _ in SCHED for P in P_MODEL for T in T_MODEL}
v = verdicts["exchange", "zigzag", 8, 2**20]
print(f"best: {v['scope']}, {v['schedule']} + {v['layout']}, T = {v['T']:,}, on {v['P']} x {v['device']}")
print(f"  over {v['link']}: {v['speedup']:.2f}x, efficiency {v['efficiency']:.0%}")
print("one device: " + ", ".join(f"T = {T:,} {verdicts['exchange', 'zigzag', 2, T]['one_device_seconds']:.2f} s"
                                 for T in T_MODEL))


def half_used(d, P):  # the prompt length from which P devices of d reach 50% efficiency (exchange, zigzag)
    c = crossover(lambda T: cp.model_cp_prefill(kimi_linear_48b, int(T), P, deployment=d, schedule="exchange",
                                                layout="zigzag", affine_cost=1.5)["efficiency"] - 0.5, 256, 2**22, grid=13)
    return c.x if c.x else (c.lo if c.kind.startswith("pays") else c.hi)


for P in (8, 16):  # over chapter 3's 36 plausible kernel sets; the verdict: half of P used below 2^17 tokens
    print(f"P = {P}: efficiency >= 50% from "
          f"{costs.band(lambda d: half_used(d, P), DEP, lambda x: x < 2**17).describe('{:,.0f}', 'tokens')}")
cols = [f"T=2^{T.bit_length() - 1} P{P}" for T in T_MODEL for P in (8, 16)]
show_table([(f"{s}, {lay}", *(verdicts[s, lay, P, T]["speedup"] for T in T_MODEL for P in (8, 16)))
            for s, lay, _ in SCHED], ["schedule, layout", *cols], formats={c: ".1f" for c in cols},
           title="Whole model: speedup over one device (x), affine cost 1.5")

# %% [markdown]
# The exchange with zigzag global layers keeps most of P from 2^17 tokens on, within a
# node and across two. At 2^15 tokens 16 devices are no faster than 8 (5.1x against
# 5.2x): each device still reads the whole model's weights, for a slice too short to hide
# that read. The two lines above the table give the prompt length from which the
# exchange keeps half of P, under each of chapter 3's 36 plausible kernel sets:
# 14,608–19,612 tokens on 8 devices and 49,760–70,658 on 16, so the verdict "half of P
# below 2^17 tokens" holds across the band. Contiguous slices lose nearly half the devices
# at 2^20 tokens, where attention dominates. The relay serialises only the KDA kernels,
# so it comes close where attention dominates (7.5x against 7.9x at 2^20 tokens on 8)
# and falls behind at short prompts; the pipelined relay never beats the exchange. This
# rests on chapter 3's calibrated kernels: take away the ordering more than the digits
# (rtp-llm's relay measured 3.39x at CP = 8 on 32K tokens of Qwen3.5-9B, our relay 3.9x
# on 2^15 tokens of the 48B model, [rtp-llm-relay](references.md#rtp-llm-relay)). The
# deep dive gives one KDA layer's band (4.85x-7.79x at P = 8 and 2^20 tokens, living to
# flushed M) and splits the model's time (attention 91.6% at 2^20 tokens, KDA 0.9%).
#
# ### Deep dive: one KDA layer's band, and where the model's time goes
#
# One KDA layer of Kimi-Linear-48B's shape (32 heads of 128) over 2^20 tokens. The affine
# cost enters as a band, from the counted cost of the cheaper method with M flushed to
# that with M alive (above); every speedup is printed beside the device efficiency,
# speedup / P:

# %%
T_GPU, Pg = 2**20, [1, 2, 4, 8, 16, 32, 64]
edges = {regime: min(flop_ratio["32 x 128", regime][m] for m in ("affine", "kcp")) for regime in ("flushed", "living")}
band = {regime: [cp.predicted_speedup(P, T_GPU, 32, 128, 128, deployment=DEP, affine_cost=a) for P in Pg]
        for regime, a in edges.items()}
print("counted cost of the cheaper method: " + ", ".join(f"{r} {a:.2f}" for r, a in edges.items()))
rows = []
for P in (8, 16, 64):
    v = {r: cp.kda_layer_verdict(P, T_GPU, 32, 128, 128, deployment=DEP, affine_cost=a) for r, a in edges.items()}
    rows.append((P, v["flushed"]["link"], f"{v['living']['speedup']:.2f}x-{v['flushed']['speedup']:.2f}x",
                 f"{v['living']['efficiency']:.0%}-{v['flushed']['efficiency']:.0%}"))
show_table(rows, ["P", "link", "speedup (living to flushed)", "efficiency"], title=v["flushed"]["scope"])

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
      f"{meas[1][3]:.2f}x-{meas[0][3]:.2f}x")
print(f"this machine at P = 2: {runs['flushed']['speedup']:.2f}x (flushed)")

# %% [markdown]
# For one KDA layer at 2^20 tokens the exchange is small next to the compute within a
# node, so up to P = 8 the prediction is mostly the affine cost: the band is the answer.
# The grey line at P = 8 marks where the link changes from NVLink to the inter-node one;
# beyond it the exchange takes over, and 64 devices gain little more than 16 (7.72x-8.50x
# against 7.64x-11.46x). The costs measured
# on this CPU are a proxy; a GPU kernel's ratio would have to be measured on a GPU, and
# would move the prediction within (or beyond) the band. Where the whole model's time
# goes on one device:

# %%
rows = []
for T in (2**15, 2**20):
    parts = cp.model_costs.one_device_parts(kimi_linear_48b, T, deployment=DEP)
    total = sum(parts.values())
    rows.append((f"{T:,}", total, *(sec / total for sec in parts.values())))
show_table(rows, ["T", "seconds", *parts], formats={"seconds": ".2f", **{n: ".1%" for n in parts}},
           title=f"Kimi-Linear-48B prefill on one {DEP.device.name}")

# %%
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

# %% [markdown]
# The efficiency view of the table above, at the shortest and the longest prompt: the
# exchange with zigzag stays near 1 at every P; the pipelined relay's fill costs most at
# long prompts, where each layer-step is long.

# %% [markdown]
# ## Summary
#
# - We built context-parallel KDA: a slice is an affine map of its entering state, and
#   maps compose in order (attention's partials in any order). A rank works before its
#   state arrives by one affine pass on `[S | M]` plus a correction, or by fla's two
#   passes; every scheme and method matches one rank to rounding, and so does the whole
#   reduced model's CP prefill.
# - M dies within 1,280 tokens when keys are random (flushed), and a rank then needs only
#   its neighbour's C; with low-rank keys and a slow gate it lives (0.87 after 8,192).
# - By FLOPs fla's two passes are cheaper while M lives (1.78 against 1.87 at the 48B
#   shape), the affine pass once it has flushed (1.00 against 1.39).
# - Contiguous slices give causal attention's busiest rank about twice the mean work;
#   zigzag balances it at two all-to-alls per global layer.
# - In the cost model the whole 48B model keeps most of P with the exchange and zigzag
#   (7.93x on 8 devices at 2^20 tokens; half of P from 17,712 tokens on 8 devices, and
#   from 14,608–19,612 under every plausible kernel set); one KDA layer's speedup is a
#   band, 4.85x-7.79x.
#
# **Next chapter:** with one long prompt split across devices, how does one engine serve
# many requests at once on one page pool, and how much traffic can a fleet of engines
# serve within a latency target?

# %% [markdown]
# ## Exercises
#
# Each checked exercise is a question, a cell for your answer (empty in the student
# edition, `make student`) and `verify("N.M", answer)`. Open exercises follow.
#
# **9.1 A real layer's exchange.** Kimi-Linear-48B's KDA layers have `32` heads with
# `K = V = 128` (`kimilab.config.kimi_linear_48b`). How many bytes is one rank's
# transition `(M, C)` for one layer in float32?

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
# **9.7 The tree's bytes at 48B (predict, then run).** At this chapter's shapes the tree
# sends fewer bytes than the all-gather from P = 4. Predict first: at Kimi-Linear-48B's
# shape (32 heads, `K = V = 128`, float32), is the smallest such P smaller, the same or
# larger, and why? Then compute it (`cp.scheme_costs`).

# %% tags=["solution"]
answer = next(P for P in range(2, 65) if cp.scheme_costs(P, 32, 128, 128)["tree"]["bytes"]
              < cp.scheme_costs(P, 32, 128, 128)["allgather"]["bytes"])

# %%
verify("9.7", answer)

# %% [markdown]
# **9.8 Zigzag's point (predict, then run).** With contiguous slices, counting whole
# tiles, how many times the mean causal-attention work does the busiest of P = 16 ranks
# do? Write down a guess first (from the P = 4 and P = 8 numbers above), then compute it
# (`cp.causal_work` on `cp.contiguous_layout`, any T divisible by 16).

# %% tags=["solution"]
w = cp.causal_work(cp.contiguous_layout(cp.split_bounds(16 * 1024, 16)))
answer = max(w) / np.mean(w)

# %%
verify("9.8", answer)

# %% [markdown]
# **9.4 (open, ~30 min) A middle rung.** GDN has one decay per head (the scalar rung)
# plus the delta rule. Where does its M sit between the scalar rung and KDA's? Write its
# transition for one token and decide whether `Qt` needs a pass.
#
# **9.5 (open, ~1 h) A bf16 chain.** Repeat the deep dive's float32 chain experiment in
# both regimes with the transitions rounded to bf16 between steps (zero the low 16 bits
# of float32). At what P does the error pass `1e-2`?
