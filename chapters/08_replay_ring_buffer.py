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
# # 8. Projection replay and the ring buffer
#
# **What you'll build.** Three more exact rollbacks, behind chapter 7's interface:
# **projection replay** (keep the committed state and a small per-token record of the
# projected KDA inputs; after acceptance, replay the kept tokens), the **ring buffer**
# (the same records in scratch pages reserved once, the conv state a pointer), and the
# **lazy ring** of ReplaySSM (a checkpoint written back only every L tokens, a ring of
# per-token update vectors, and a rollback that is a cursor move).
#
# **What you'll learn.**
# - What going back needs: at Kimi-Linear-48B a token's record is 20–90 times smaller
#   than a state.
# - That all five strategies are exact, and move exactly the bytes the cost model says.
# - What each costs per GPU at 48B in bytes, and in time at batch 1 to 256: the acceptance
#   at which speculation pays, and why it is not monotone in batch.
# - In deep dives: both rings step by step, trees, the flush interval, CPU timings, and
#   where replay stops paying.
#
# **What you'll need.** Chapter 7 (the loop, the `VerifyView`, snapshots, trees) and
# chapter 2 (the KDA recurrence and its chunked form). The model is the reduced,
# *untrained* `tiny` model; speeds are CPU speeds, labelled; 48B numbers are analytic
# (`kimilab.costs`) on named deployments.
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
import textwrap

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

from kimilab import costs, plots, speculative as spec
from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import spec as spec_costs
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import key_results, show_source, show_table
from kimilab.pool import PagedHybridCache, PagePool
from kimilab.tokenizer import ByteTokenizer

plots.use_style()
CFG = kimi_linear_48b
TP4, DP4, ONE = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200, costs.ONE_H200
STRATEGIES = spec.EXACT_ROLLBACKS
S4 = costs.checkpoint_bytes(CFG, TP4)  # one 48B checkpoint on one GPU of the default (TP4) deployment
TAU = spec_costs.expected_tokens_per_step(0.75, 4)  # tokens per step at k = 4, alpha = 0.75
RINGS = [5, 8, 12, 16, 24, 32, 48, 64, 128]  # lazy-ring lengths swept below
model = Model(tiny, seed=0)
prompt = ByteTokenizer().encode("the state absorbs every token; the state absorbs every draft; the state ")
N_NEW = 24
greedy = model.generate(prompt, N_NEW)
controlled = spec.ControlledDrafter(model, prompt, N_NEW + 10, corruption=0.3, seed=7)
print(f"prompt {len(prompt)} tokens, {N_NEW} greedy tokens; strategies:", ", ".join(STRATEGIES))

# %%
# Key results (each number is computed here and derived step by step below)
ratio = {keep: costs.checkpoint_bytes(CFG, ONE) / spec_costs.record_bytes_per_token(CFG, ONE, keep, 2)
         for keep in spec_costs.RECORD_KEEPS}
moved4 = {s: spec_costs.mean_moved_bytes(CFG, TP4, s, 4, 5) / S4 for s in STRATEGIES}
lazy_best = min(spec_costs.mean_moved_bytes(CFG, TP4, "lazy-ring", 4, 3, ring_len=L, tokens_per_step=TAU)
                for L in RINGS) / TAU / 1e6
be_slot = [spec_costs.break_even_acceptance(CFG, TP4, 4096, 4, "slot", batch=B) for B in (1, 16, 64, 256)]
be_at = lambda d, B: spec_costs.break_even_acceptance(CFG, d, 4096, 4, "slot", batch=B)  # noqa: E731
be256 = costs.band(lambda d: be_at(d, 256), TP4, lambda a: a < 0.75)  # over the 36 kernel sets: pays at alpha = 0.75?
fall = costs.band(lambda d: be_at(d, 16) - be_at(d, 64), TP4, lambda x: x > 0)  # falls from batch 16 to 64?
key_results(
    f"Going back needs only what the state update reads: at 48B a token's record (bf16) is "
    f"{ratio['post-conv']:.1f}x smaller than a state, {ratio['low-rank']:.1f}x for the leanest record.",
    f"Five rollbacks behind one interface are all exact; per step at k = 4 on a TP4 GPU copy-back moves "
    f"{moved4['snapshot']:.2f} states, replay {moved4['replay']:.2f} and the lazy ring {moved4['lazy-ring']:.2f}, "
    f"less than plain decoding's 2.",
    f"The lazy ring writes its state back only when its ring is full: at its best ring length it moves "
    f"{lazy_best:.2f} MB per token against {2 * S4 / 1e6:.2f} MB for plain decoding (k = 4, α = 0.75).",
    f"The acceptance at which speculation pays is not monotone in batch: with slot selection at k = 4 on TP4 it "
    f"is {be_slot[0]:.3f}, {be_slot[1]:.3f}, {be_slot[2]:.3f} and {be_slot[3]:.3f} at batch 1, 16, 64 and 256. Over "
    f"the 36 plausible kernel sets, the break-even at 256 stays below the α = 0.75 used here: {be256.describe()}; "
    f"its fall from 16 to 64: {fall.describe()}.",
)

# %% [markdown]
# ## What going back needs
#
# Chapter 7 kept a whole state per verified position. But one KDA step (chapter 2) decays
# the state S by exp(g_t), then corrects it with beta_t k_t (v_t − Sᵀk_t)ᵀ; the query q_t
# only *reads* the result. So from the committed state, the k, v, g and beta of the kept
# tokens recompute the state exactly, and the verify captures them anyway (`KDACapture`).
# The conv state is the last (kernel − 1) *raw* conv inputs, which can be kept too.
#
# <a id="term-replay-record"></a>A **replay record** is what one token keeps for going back:
# post-conv k, v, g, beta plus the raw conv inputs (what `kimilab.speculative` stores); or
# only the raw conv inputs, g and beta (k and v recomputed through the conv); or the gate's
# low-rank input instead of g (`costs.spec.RECORD_KEEPS`). States and records shard by head
# alike, so the ratio is the same on every deployment.

# %%
show_source(spec_costs.record_elems_per_layer)

# %%
state_layer = costs.kda_state_bytes_per_layer(CFG, ONE) + costs.conv_state_bytes_per_layer(CFG, ONE)
ckpt = costs.checkpoint_bytes(CFG, ONE)
print(f"Kimi-Linear-48B, {len(CFG.kda_layers)} KDA layers; per layer, state + conv state = {state_layer:,d} B "
      "(fp32, bf16)")
rows = [(keep, spec_costs.record_elems_per_layer(CFG, keep), dtype,
         spec_costs.record_bytes_per_token(CFG, ONE, keep, act) / 1e6,
         ckpt / spec_costs.record_bytes_per_token(CFG, ONE, keep, act))
        for keep in spec_costs.RECORD_KEEPS for act, dtype in ((2, "bf16"), (4, "fp32"))]
show_table(rows, ["record keeps", "elems/layer", "dtype", "MB per token", "state / record"],
           formats={"MB per token": ".3f", "state / record": ".1f"}, title="whole model, all 20 KDA layers")

# %% [markdown]
# A 48B state is 32 heads × 128 × 128 numbers per layer; a record is a few vectors of
# 32 × 128. In fp32 the state is 22.1x larger than a post-conv record; engines keep the
# captured activations in bf16, which doubles it to 44.1x; the leanest record reaches 87.2x.

# %% [markdown]
# ## Projection replay
#
# <a id="term-projection-replay"></a>**Projection replay**: `ReplayRollback.save` writes the
# verified positions' records to scratch pages; the committed state is untouched (the verify
# ran through a `VerifyView`). `restore(path)` runs the accepted path's records as recurrent
# steps from the committed state (`state_steps`: the state half of the KDA update, no output
# read) and rebuilds the conv state from the raw inputs. On a tree, replay's work grows with
# the *accepted* path, not with the tree. This is the replay TensorRT-LLM merged for Mamba-2
# ([trtllm-13453](references.md#trtllm-13453)), fused there into the next step's verify.

# %%
show_source(spec.state_steps)

# %%
show_source(spec.ReplayRollback)

# %% [markdown]
# ## The ring buffer
#
# <a id="term-ring-buffer"></a>Replay allocates and frees its records every step. A serving
# engine prefers memory reserved once per request: the **ring buffer** (`RingRollback`)
# keeps the records in a fixed window of `window` ≥ k+1 slots reused every step, and the raw
# conv rows in a `ConvRing` that also holds the (kernel − 1) committed rows before the
# window. The conv state after any accepted path is then a slice of that ring, and its
# rollback is moving `head`:

# %%
show_source(spec.ConvRing.commit)

# %% [markdown]
# The ring still replays and writes the request's state every step: it saves an allocation
# and a conv copy, not state traffic. The deep dive runs it step by step: the head advances
# by the kept length on the same 65 scratch pages, and a window shorter than k+1 is refused.
#
# ### Deep dive: the ring, step by step

# %%
show_source(spec.RingRollback, limit=None)

# %%
pool = PagePool(400, 4096)
cache = HybridCache(tiny)
model.prefill(prompt, cache)
ring = spec.RingRollback(tiny, pool, k=4)
out, rows = [greedy[0]], []
for step in range(4):
    drafts = controlled.propose(prompt + out, 4)
    logits, captures, view = spec.verify(model, [out[-1]] + drafts, ring.current(cache))
    ring.save(view, captures)
    j, bonus = spec.greedy_accept(drafts, logits)
    ring.restore(cache, j + 1)
    out += drafts[:j] + [bonus]
    rows.append((step, j + 1, len(drafts) + 1, ring.head, ring.conv_slots_n, pool.stats().pages_by_kind["scratch"]))
ring.close()
print("tokens so far equal greedy:", out == greedy[:len(out)], f"({len(out)} tokens)")
try:
    spec.RingRollback(tiny, pool, k=4, window=4)
except ValueError as err:
    print(textwrap.fill(f"ValueError: {err}", 100))
show_table(rows, ["step", "kept", "of", "conv-ring head", "ring rows", "scratch pages"], title="RingRollback, k = 4")

# %% [markdown]
# ## The lazy ring: write the state back every L tokens
#
# Every strategy so far reads the committed state and writes a new one each step, as
# plain decoding does. ReplaySSM ([vllm-rfc-47572](references.md#vllm-rfc-47572); ports listed in
# the deep dive on production systems) stops writing it. The identity behind it is
# chapter 2's chunked form: after entries i = 1..m the state is
#
#     S_m = diag(exp(G_m)) S_0 + Σ_i diag(exp(G_m − G_i)) k_i d_iᵀ,
#
# where G is the running sum of the gates and d_i = beta_i (v_i − (decayed S_{i−1})ᵀ k_i) is
# the *corrected update vector* that the verify computes anyway. Keeping d instead of v
# removes the serial dependency: any prefix of entries folds into a state in one product.

# %%
show_source(spec.fold)

# %% [markdown]
# <a id="term-lazy-ring"></a>In the **lazy ring** the request's state slot holds a
# **checkpoint** S_0, and a ring of `ring_len` entries (d, k, g per position) holds what came
# after it. A verify reads the checkpoint and the ring (a GPU kernel folds in registers) and
# writes the window's entries after the cursor. A **rollback is a cursor move** past the
# accepted entries; the next verify overwrites the rejected ones.
#
# <a id="term-flush"></a>When the next verify would not fit, the committed entries are folded
# into the checkpoint and written back: a **flush**, about every `ring_len − k` tokens.

# %%
show_source(spec.LazyRingRollback._restore)

# %% [markdown]
# The deep dive runs it for six steps with a ring of 12: the ring writes back twice, and
# after `finish()` the cache's state equals a plain prefill of the same 93 tokens to 2.0e-15.
#
# ### Deep dive: the lazy ring, step by step

# %%
show_source(spec.LazyRingRollback, limit=None)

# %%
lazy_pool = PagePool(400, 4096)
cache = HybridCache(tiny)
model.prefill(prompt, cache)
lazy = spec.LazyRingRollback(tiny, lazy_pool, k=4, ring_len=12)
out, rows = [greedy[0]], []
drafter = controlled.with_corruption(0.1)
for step in range(6):
    request = lazy.current(cache)
    drafts = drafter.propose(prompt + out, 4)
    logits, captures, view = spec.verify(model, [out[-1]] + drafts, request)
    lazy.save(view, captures)
    j, bonus = spec.greedy_accept(drafts, logits)
    lazy.restore(cache, j + 1)
    out += drafts[:j] + [bonus]
    rows.append((step, lazy.last_history, lazy.last_flush, j + 1, lazy.cursor, cache.seq_len - lazy.cursor,
                 cache.seq_len))
lazy.finish(cache)
plain = HybridCache(tiny)
model.prefill(prompt + out[:-1], plain)
drift = max(np.abs(cache.kda_state(i) - plain.kda_state(i)).max() for i in tiny.kda_layers)
print(f"after finish(): tokens equal greedy {out == greedy[:len(out)]}")
print(f"the cache's state against a plain prefill of the same {plain.seq_len} tokens: largest difference {drift:.1e}")
lazy.close()
show_table(rows, ["step", "entries folded", "wrote back", "kept", "cursor (of 12)", "checkpoint at",
                  "request at"], title="LazyRingRollback, k = 4, ring_len = 12")

# %% [markdown]
# ## Five strategies, one interface, all exact
#
# `speculative_generate(..., rollback=...)` takes any of them. For each: a chain on a paged
# cache (pool invariants checked after every step) and a tree (2, 2, 1). The check: tokens
# equal greedy decoding, states after each step equal plain decoding's (float64), and the
# scratch held and bytes moved equal `kimilab.costs.spec`'s prediction, at every step.

# %%
reference = spec.GreedyReference(model, prompt, N_NEW)  # plain decoding, its states kept per length
print("reference tokens = greedy:", reference.tokens == greedy)
STATE = costs.checkpoint_bytes(tiny, costs.LOCAL)
tables = {None: [], (2, 2, 1): []}
for name in STRATEGIES:
    for tree in (None, (2, 2, 1)):
        k, nodes = (4, 5) if tree is None else (3, 11)
        pool = PagePool(1400, 4096) if tree is None else None
        cache = PagedHybridCache(tiny, pool, block_tokens=16) if pool else HybridCache(tiny)
        errors = []

        def check(c, s):  # after every step: states against plain decoding's, and the pool's invariants
            errors.append(reference.state_error(c))
            if pool is not None:
                pool.check_invariants()

        r = spec.speculative_generate(model, prompt, N_NEW, controlled, k, name, cache, tree=tree, on_step=check)
        held_model = spec_costs.rollback_bytes(tiny, costs.LOCAL, name, k, act_bytes=8, nodes=nodes)
        moved_ok = all(s.moved_bytes == spec.predicted_moved(model, name, k, s, nodes) for s in r.steps)
        tables[tree].append((name, r.tokens == greedy, max(errors) <= 1e-10, r.peak_rollback_bytes,
                             r.peak_rollback_bytes == held_model, np.mean([s.moved_bytes for s in r.steps]) / STATE,
                             moved_ok, r.flushes))
        if pool is not None:
            cache.free()
            assert pool.stats().pages_by_kind["scratch"] == 0 and pool.n_free == pool.n_pages
columns = ["strategy", "same tokens", "states", "held (B)", "held = model", "moved (states)", "moved = model",
           "flushes"]
display(show_table(tables[None], columns, formats={"moved (states)": ".2f"}, title="chain, k = 4, paged cache"))
show_table(tables[(2, 2, 1)], columns, formats={"moved (states)": ".2f"}, title="tree (2, 2, 1), contiguous cache")

# %% [markdown]
# Every strategy is exact on both shapes, and its byte counts are the model's, step by
# step. On the tiny model the state is small against a record (head_dim 32), so the
# byte ratios here are modest; at 48B they are not. The deep dive places the five designs
# among the production systems that ship them.
#
# ### Deep dive: against the production systems
#
# - **SGLang** keeps a state per draft position and copies the accepted one back
#   ([sglang-copy-back](references.md#sglang-copy-back)); its tree verify is output-only with an
#   ancestor mask ([sglang-tree-verify](references.md#sglang-tree-verify)).
# - **vLLM** writes each position's state to its own slot and starts the next verify
#   from the accepted one, trees included ([vllm-fused-recurrent](references.md#vllm-fused-recurrent)).
# - **TensorRT-LLM** replays: first with the state one step behind
#   ([trtllm-13453](references.md#trtllm-13453)), then with a checkpoint kept further back
#   ([trtllm-14203](references.md#trtllm-14203)), the lazy ring.
# - **ReplaySSM** in vLLM ([vllm-rfc-47572](references.md#vllm-rfc-47572), [vllm-47576](references.md#vllm-47576)),
#   SGLang ([sglang-replayssm](references.md#sglang-replayssm)) and Megatron-LM
#   ([megatron-6617](references.md#megatron-6617)): a checkpoint, a ring of (d, k, g), a cursor.
#   A Kimi-K3 port replaced 8 state slots per request by one ([rocm-atom-1883](references.md#rocm-atom-1883): 28.91 GiB per rank).
# - **Megatron-LM** first proposed a factorised exact rollback: rank-1 factors per draft
#   token, the accepted ones applied in one matmul ([megatron-5803](references.md#megatron-5803)), the
#   fold above.
# - **mlx-lm** replaced a `trim()` that corrupted recurrent caches with an exact rollback
#   cache API ([mlx-lm-1486](references.md#mlx-lm-1486)): chapter 7's failure.

# %% [markdown]
# ## Bytes per GPU at 48B: held and moved
#
# Per request on one GPU of the default deployment (TP4): what each strategy **holds**
# beyond the request's own state, and what a step **moves** through HBM, in states (the
# verify's read of the committed state included; plain decoding moves 2). Records in bf16;
# the lazy ring at its default `ring_len` of 16, with k+1 tokens a step.

# %%
ks = (1, 2, 4, 8)
held = {s: [spec_costs.rollback_bytes(CFG, TP4, s, k) / 1e6 for k in ks] for s in STRATEGIES}


def moved_states(s, k, dep=TP4, nodes=None, kept=None, gathered=False, ring_len=spec_costs.DEFAULT_RING):
    """Bytes a step moves per request, in states (the lazy ring: its steady state, kept tokens a step)."""
    kept = k + 1 if kept is None else kept
    return spec_costs.mean_moved_bytes(CFG, dep, s, k, kept, nodes=nodes, gathered=gathered,
                                       ring_len=ring_len) / costs.checkpoint_bytes(CFG, dep)


print(f"one checkpoint on a GPU of {TP4.name}: {S4 / 1e6:.2f} MB")
show_table([(s, *held[s], *(moved_states(s, k) for k in ks)) for s in STRATEGIES],
           ["strategy"] + [f"held k={k}" for k in ks] + [f"moved k={k}" for k in ks],
           formats={f"{x} k={k}": ".2f" for x in ("held", "moved") for k in ks},
           title="per request and step: held (MB per GPU), moved (states)")

# %% [markdown]
# At MTP's usual k = 1, slot selection moves 3 states a step and replay 3.09 (it reads the
# committed state twice); from k = 2 on, replay moves less. At k ≤ 4 the lazy ring moves
# 1.31–1.61 states, less than plain decoding's 2, since it writes the state only at a
# flush. Snapshots hold 10.85–97.69 MB, replay 0.49–2.21 MB.
#
# In the deep dives, snapshot costs grow with every tree node while replay's traffic grows
# only with the accepted path; and the lazy ring moves 5.17 MB per token at its best ring
# length (24), a quarter of plain decoding's 21.71 MB, within 10% from 12 to 48 entries.
#
# ### Deep dive: rollback costs against tree size
#
# A snapshot strategy keeps and writes a state per *node*; replay keeps a record per node
# but replays only the accepted path; the lazy ring writes an entry per node and moves the
# accepted path's entries together. Over full trees of growing size, at 48B on TP4, with a
# 3-deep accepted path:

# %%
shapes = [(1,), (2,), (1, 1, 1), (2, 2), (3, 2), (2, 2, 2), (4, 2, 2), (2, 2, 2, 2)]
tree_nodes = [len(spec.DraftTree.shape(w)) + 1 for w in shapes]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
for s in STRATEGIES:
    st = plots.style_of(s)
    hb, mb = [], []
    for w, n in zip(shapes, tree_nodes):
        k, kept, gathered = len(w), min(len(w) + 1, 3), any(x > 1 for x in w)
        hb.append(spec_costs.rollback_bytes(CFG, TP4, s, k, nodes=n, ring_len=max(16, n)) / 1e6)
        mb.append(moved_states(s, k, nodes=n, kept=kept, gathered=gathered, ring_len=max(16, n)))
    ax1.plot(tree_nodes, hb, marker="o", **st)
    ax2.plot(tree_nodes, mb, marker="o", **st)
ax2.axhline(2.0, lw=1, **plots.style_of("plain-decode"))
ax2.legend(handles=ax2.lines[-1:], fontsize=7)
print(textwrap.fill("tree widths -> verified positions: " + ", ".join(f"{w}: {n}" for w, n in zip(shapes, tree_nodes)),
                    100))
ax1.set_yscale("log")
ax1.set_xlabel("verified positions (1 + draft tree nodes)")
ax1.set_ylabel("held beyond the request's state (MB per GPU, log)")
ax2.set_xlabel("verified positions (1 + draft tree nodes)")
ax2.set_ylabel("moved per step (states)")
ax1.set_title("Memory per request")
ax2.set_title("HBM traffic per request and step")
ax1.legend(fontsize=7)
fig.suptitle("Kimi-Linear-48B on vllm-tp4-h200: rollback costs against tree size (accepted path: 3)")
plots.save(fig, "ch08-tree-costs")
plt.show()

# %% [markdown]
# Takeaway: snapshot memory and traffic grow with every node of the tree; replay's memory
# grows only by a record per node and its traffic by the accepted path; the lazy ring's
# memory is its ring (16 entries, or the tree's size if larger), and its traffic stays
# under plain decoding's while the tree sits well inside the ring. A tree that nearly
# fills it forces a write-back every step.
#
# ### Deep dive: the lazy ring's flush interval
#
# A longer ring writes the state back less often (one state per flush, amortised over the
# tokens between flushes) but reads a longer history every step (each verify folds the
# entries since the checkpoint). Per token, at k = 4 with α = 0.75 (3.05 tokens a step),
# the history read grows like e·L/2 and the write-back falls like S·τ/L, so the traffic is
# smallest near L = √(2 τ S / e): about 20 entries at 48B, where vLLM's and SGLang's
# default is 16. The CPU implementation counts the same bytes on the tiny model:

# %%
Skda, e48 = costs.kda_state_bytes(CFG, TP4), spec_costs.lazy_entry_bytes(CFG, TP4)


def lazy_per_token(dep, L):
    return spec_costs.mean_moved_bytes(CFG, dep, "lazy-ring", 4, 3, ring_len=L, tokens_per_step=TAU) / TAU


per_token = [lazy_per_token(TP4, L) / 1e6 for L in RINGS]
plain_token = 2 * S4 / 1e6
slot_token = moved_states("slot", 4) * S4 / TAU / 1e6
best = RINGS[int(np.argmin(per_token))]
print(f"48B on {TP4.name}, k = 4, {TAU:.2f} tokens per step; sqrt(2 tau S / e) = {np.sqrt(2 * TAU * Skda / e48):.1f}")
print(f"least traffic at ring_len {best}; plain decoding moves {plain_token:.2f} MB per token, "
      f"slot selection at k = 4 {slot_token:.2f}")
show_table([(L, m, spec_costs.rollback_bytes(CFG, TP4, "lazy-ring", 4, ring_len=L) / 1e6,
             1e6 * spec_costs.rollback_seconds(CFG, TP4, "lazy-ring", 4, 3, batch=64, ring_len=L, tokens_per_step=TAU))
            for L, m in zip(RINGS, per_token)],
           ["ring_len", "MB moved per token", "ring held (MB)", "rollback us/step, B=64"],
           formats={"MB moved per token": ".2f", "ring held (MB)": ".2f", "rollback us/step, B=64": ".1f"},
           title="the lazy ring on one TP4 GPU, fluid limit")

# %% [markdown]
# That is the fluid limit, with every step yielding the mean 3.05 tokens. The real cursor
# moves by a random number of tokens a step, so the ring writes back at irregular
# intervals. `costs.spec.lazy_steps` walks the cursor over a run's actual steps; one real
# run on the tiny model shows the walk is the loop's own, and 50 seeds of the controlled
# drafter at α = 0.75 (256 tokens each, model-free as in chapter 7) give the bytes per token
# at 48B with a 95% interval:

# %%
r = spec.speculative_generate(model, prompt, N_NEW, controlled.with_corruption(0.25), 4, "lazy-ring", ring_len=8)
walk = spec_costs.lazy_steps([s.emitted for s in r.steps], 5, 8)
print(f"tiny, ring_len 8: {r.flushes} write-backs in {len(r.steps)} steps; the walk equals the loop's: "
      f"{walk == [(s.history, s.flushed) for s in r.steps]}")
SEEDS = 50
LONG = 256
sweep = spec.ControlledDrafter(model, prompt, LONG, corruption=0.25, seed=0)
emitted = [sweep.with_corruption(0.25, seed=s).emitted_per_step(LONG, 4)[:-1] for s in range(SEEDS)]
base = spec_costs.moved_bytes(CFG, TP4, "lazy-ring", 4, 1)  # a step's bytes are linear in history and flush
per_entry = spec_costs.moved_bytes(CFG, TP4, "lazy-ring", 4, 1, history=1) - base
per_flush = spec_costs.moved_bytes(CFG, TP4, "lazy-ring", 4, 1, flush=True) - base
walked = {}
for L in RINGS:
    per_seed = []
    for em in emitted:
        h, f = np.array(spec_costs.lazy_steps(em, 5, L)).T
        per_seed.append((len(em) * base + per_entry * h.sum() + per_flush * f.sum()) / sum(em) / 1e6)
    walked[L] = (np.mean(per_seed), 1.96 * np.std(per_seed, ddof=1) / np.sqrt(SEEDS))
show_table([(L, m, *walked[L]) for L, m in zip(RINGS, per_token)],
           ["ring_len", "fluid MB/token", "50 seeds MB/token", "+- 95%"],
           formats={"fluid MB/token": ".2f", "50 seeds MB/token": ".2f", "+- 95%": ".2f"},
           title="the fluid limit against 50 seeds' random cursor")

# %%
fig, ax = plt.subplots()
st = plots.style_of("lazy-ring")
ax.plot(RINGS, per_token, color=st["color"], label=f"{st['label']}: steady state (fluid)")
ax.errorbar(RINGS, [walked[L][0] for L in RINGS], yerr=[walked[L][1] for L in RINGS], fmt="o", capsize=3,
            color=st["color"], label=f"{st['label']}: {SEEDS} seeds, 95% interval")
ax.axhline(plain_token, lw=1, **plots.style_of("plain-decode"))
ax.axhline(slot_token, lw=1, ls="--", color=plots.color("slot"), label=f"{plots.label('slot')}, k = 4")
ax.axvline(spec.DEFAULT_RING, color="grey", lw=0.8, ls=":", label="vLLM / SGLang default (16)")
ax.set_xscale("log", base=2)
ax.set_xticks(RINGS, [str(L) for L in RINGS])
ax.set_xlabel("ring length L (entries)")
ax.set_ylabel("state + ring bytes moved per token (MB per GPU)")
ax.set_ylim(0, None)
ax.set_title("Kimi-Linear-48B on vllm-tp4-h200, k = 4, α = 0.75: the flush interval")
ax.legend(fontsize=8)
plots.save(fig, "ch08-flush-interval")
plt.show()

# %% [markdown]
# Takeaway: the lazy ring moves 5.17 MB per token at its best ring length against 21.71
# for plain decoding and 21.35 for slot selection (a quarter), and the minimum is flat:
# anything from 12 to 48 entries is within 10% of it. The shortest ring (L = k+1)
# writes back every step and still moves only about a third: it is the replay with the
# state one step behind (TensorRT-LLM's #13453). The random cursor of real runs lands
# within 2% of the fluid curve except at L = 8 (6.23 against 7.63): the fluid limit writes
# back every step there, while a real step that keeps 1–3 tokens still leaves the next
# verify room in the ring.

# %% [markdown]
# ## Time at serving batch
#
# A speculative step of B requests is **one** forward pass over their verified positions
# (chapter 3's step model) plus each request's rollback: its extra bytes over the GPU's
# bandwidth and its replay arithmetic at 5% of peak (our assumption; nothing published
# measures it). Drafting is taken as free (an n-gram lookup).
#
# <a id="term-break-even-acceptance"></a>The **break-even acceptance** is the acceptance
# probability α above which speculation beats plain decoding in tokens per second:

# %%
batches = (1, 16, 64, 256)
be = {(d.name, s, k): [spec_costs.break_even_acceptance(CFG, d, 4096, k, s, batch=B) for B in batches]
      for d in (TP4, DP4) for s in STRATEGIES for k in ks}
share = {(d.name, s, k): [spec_costs.rollback_share(CFG, d, 4096, k, s, batch=B) for B in batches]
         for d in (TP4, DP4) for s in STRATEGIES for k in ks}

# %%
fig, axes = plt.subplots(2, 4, figsize=(13, 6.2), sharex=True, sharey=True)
for row, d in enumerate((TP4, DP4)):
    for col, k in enumerate(ks):
        ax = axes[row, col]
        for s in STRATEGIES:
            ax.plot(batches, be[d.name, s, k], marker="o", **plots.style_of(s))
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"{d.name}, k = {k}", fontsize=9)
        if col == 0:
            ax.set_ylabel("break-even acceptance α")
        if row == 1:
            ax.set_xlabel("batch B (requests)")
axes[0, 0].legend(fontsize=7)
fig.suptitle("Kimi-Linear-48B, 4K context: the acceptance above which speculation beats plain decoding")
plots.save(fig, "ch08-break-even")
plt.show()

# %% [markdown]
# Takeaway: break-even is low at batch 1 (0.060–0.307 on TP4 for k = 1–8: a step is
# mostly fixed cost), rises at 16 and falls at 64. At 256 (0.000–0.487) it climbs again
# from k = 4 on, where the verify's matmuls turn compute-bound; at k = 1 it falls further
# for all but copy-back, and the strategies spread: from 0.000 (lazy ring: its verify step
# costs no more than a decode step, so speculating never loses) to 0.189 (copy-back). The two
# deployments agree to within 0.025, so the verdict holds on both; batch moves it. Over
# chapter 3's 36 plausible kernel sets (Key results) the fall from 16 to 64 holds, and
# slot selection at k = 4 and batch 256 needs 0.212–0.326.
#
# The deep dives explain the rise at 16 (80 verified tokens touch 236 of 256 experts, 16
# decoded ones 102) and give the rollback's share of a step (up to 30.5% at 256), CPU
# timings, replay FLOPs and where replay stops paying.
#
# ### Deep dive: why a verify is cheap at batch 1 and dear at 256

# %%
w = costs.weight_model(CFG)
rows = []
for B in (1, 16, 64, 256):
    d = costs.decode_step_seconds(CFG, TP4, 4096, B)
    v = spec_costs.verify_step_seconds(CFG, TP4, 4096, 4, batch=B, strategy="slot")
    ex = [w.n_routed_experts * (1 - (1 - w.routed_top_k / w.n_routed_experts) ** t) for t in (B, 5 * B)]
    rows.append((B, 1e3 * d, 1e3 * v, v / d, ex[0], ex[1], ex[1] / ex[0]))
show_table(rows, ["batch", "decode ms", "verify k=4 ms", "ratio", "experts: decode", "verify", "x"],
           formats={"decode ms": ".2f", "verify k=4 ms": ".2f", "ratio": ".2f", "experts: decode": ".1f",
                    "verify": ".1f", "x": ".2f"},
           title=f"experts read per layer, of {w.n_routed_experts} ({w.routed_top_k} per token)")

# %% [markdown]
# At batch 1 the step is mostly fixed cost (27 layers of kernel launches and the
# all-reduces' latency), so verifying 5 tokens instead of 1 adds 23%. At batch 16 the
# decode step's 16 tokens touch 102 of the 256 experts per layer, but the verify's 80
# tokens touch 236: the verify reads 2.31 times the expert weights, and costs 1.62 decode
# steps. At batch 64 both already read nearly every expert, and the verify is back to
# 1.19. At batch 256 the decode step still reads its weights faster than it multiplies
# them, the verify's five tokens a request do not (its matmuls are compute-bound), and 5
# times the tokens cost 1.38 times the time. This **mixture-of-experts
# union** makes the price of a verify, and with it the break-even acceptance, rise, fall
# and rise again with batch (uniform routing assumed, as the step model does; real routing
# is skewed, which narrows the gap).
#
# ### Deep dive: the break-even and rollback-share tables
#
# Per deployment, context 4,096 tokens: the break-even α at each batch, and the
# rollback's share of the step (k+1 kept).

# %%
for d in (TP4, DP4):
    t = show_table([(s, k, *be[d.name, s, k], *share[d.name, s, k]) for k in ks for s in STRATEGIES],
                   ["strategy", "k"] + [f"B={B}" for B in batches] + [f"share B={B}" for B in batches],
                   formats={**{f"B={B}": ".3f" for B in batches}, **{f"share B={B}": ".1%" for B in batches}},
                   title=d.describe())
    display(t)

# %%
fig, axes = plt.subplots(2, 4, figsize=(13, 6.2), sharex=True, sharey=True)
for row, d in enumerate((TP4, DP4)):
    for col, k in enumerate(ks):
        ax = axes[row, col]
        for s in STRATEGIES:
            ax.plot(batches, 100 * np.array(share[d.name, s, k]), marker="o", **plots.style_of(s))
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"{d.name}, k = {k}", fontsize=9)
        if col == 0:
            ax.set_ylabel("rollback share of a step (%)")
        if row == 1:
            ax.set_xlabel("batch B (requests)")
axes[0, 0].legend(fontsize=7)
fig.suptitle("Kimi-Linear-48B, 4K context: rollback time / verify step time (below 0: it saves)")
plots.save(fig, "ch08-rollback-share")
plt.show()

# %% [markdown]
# Takeaway: at batch 1 every rollback is at most 2.3% of a step; at batch 256 copy-back
# costs 14.3–30.5% of it, slot selection 5.3–26.0%, replay and the ring 6.4–8.7%, and the
# lazy ring saves up to 4.0% (it writes fewer states than the forward pass is charged for)
# until k = 8 fills its 16-entry ring. With faster kernels the step shrinks and the bytes
# a rollback moves do not, so at large batch and long drafts the copies are what a
# serving engineer should avoid. At one draft token our rollbacks stay at most 15.5% of a
# step even at batch 256 and under 1% at batch 1; a measured profile on vLLM-metal put 19.3%
# of a speculative step in rejection trim/restore/replay at one draft token
# ([vllm-metal-610](references.md#vllm-metal-610)): at small batch such overheads come from the
# implementation (launches, host-side copies), not from the bytes a rollback must move.
#
# ### Deep dive: rollback time on the reduced model (wall clock)
#
# CPU time of each strategy's `current` (the lazy ring's fold), `save` and `restore` on the
# tiny model, k = 8, keeping 1 or all 9 positions. Measured on this machine, best of two
# runs: the numbers change from run to run; the shape is the result.

# %%
# NBVAL_IGNORE_OUTPUT
keeps = (1, 9)
timings = {name: spec.rollback_timings(model, name, 8, keeps, repeats=2) for name in STRATEGIES}
show_table([(name, j, *(1e3 * timings[name][j][part] for part in ("current", "save", "restore")))
            for name in STRATEGIES for j in keeps],
           ["strategy", "keep", "current ms", "save ms", "restore ms"],
           formats={"current ms": ".2f", "save ms": ".2f", "restore ms": ".2f"}, title="CPU, tiny model, k = 8")

# %% [markdown]
# On a CPU the snapshot strategies pay in `save` (our chunked verify yields no per-position
# states, so they are recomputed) and the replay strategies in `restore`; the lazy ring pays
# in `save` (the update vectors) and `current` (the fold). A GPU kernel produces the
# per-position states, records and update vectors as it verifies; the 48B model charges
# what remains: the bytes moved and the replay arithmetic.
#
# ### Deep dive: replay FLOPs against a full re-verify
#
# The other way back is recomputation: truncate everything and push the accepted tokens
# through the whole model again. Replay recomputes only the KDA recurrence of the kept
# tokens (the projections were captured), and only its state update: the outputs were
# read in the verify. At a 4K-token context:

# %%
show_table([(kept, spec_costs.replay_flops(CFG, kept) / 1e6, spec_costs.reverify_flops(CFG, kept, 4096) / 1e9,
             spec_costs.replay_flops(CFG, kept) / spec_costs.reverify_flops(CFG, kept, 4096)) for kept in (1, 3, 5, 9)],
           ["kept", "replay (MFLOP)", "re-verify (GFLOP)", "replay / re-verify"],
           formats={"replay (MFLOP)": ".1f", "re-verify (GFLOP)": ".2f", "replay / re-verify": ".4f"})

# %% [markdown]
# Replay is about one percent of a re-verify: the expert and projection matmuls, which
# dominate a forward pass, are not repeated.
#
# ### Deep dive: where replay stops paying
#
# Replay trades bytes for recomputation: a snapshot's cost is fixed (write the states, copy
# or select one), replay's grows with the kept length j. On the 48B model the replay is so
# cheap that it wins from k = 2, *if* the replay kernel runs at a fair fraction of peak.
# A token-by-token recurrence is latency-bound, so we vary that assumed efficiency
# (`Kernels.replay`, 5% in the calibrated deployments), at k = 8 and batch 64: the table
# gives replay's time over copy-back's for each kept length j, and the first j at which
# copy-back and slot selection win.

# %%
rows = []
for eff in (0.05, 0.005, 0.002, 0.001):
    dep = TP4.with_(name=f"replay at {eff:g}", kernels=TP4.kernels.__class__(**{**TP4.kernels.__dict__, "replay": eff}))
    rep = [spec_costs.rollback_seconds(CFG, dep, "replay", 8, j, batch=64) for j in range(1, 10)]
    snap = spec_costs.rollback_seconds(CFG, dep, "snapshot", 8, 1, batch=64)
    slot = spec_costs.rollback_seconds(CFG, dep, "slot", 8, 1, batch=64)
    first = [next((j for j, x in enumerate(rep, 1) if x > ref), None) for ref in (snap, slot)]
    rows.append((eff, *(x / snap for x in rep), str(first[0]), str(first[1])))
show_table(rows, ["efficiency"] + [f"j={j}" for j in range(1, 10)] + ["copy-back", "slot"],
           formats={"efficiency": ".3f", **{f"j={j}": ".2f" for j in range(1, 10)}},
           title="replay / copy-back time at k = 8, batch 64; first j where copy-back / slot wins")

# %% [markdown]
# And memory: the saving is the state-to-record ratio, so it shrinks with the state.
# Keeping everything else at 48B shapes and shrinking the head dimension (the state per
# head is head_dim², a record is linear in it):

# %%
rows = []
for hd in (16, 32, 64, 128, 256):
    c = CFG.with_(head_dim=hd)
    s_layer = costs.kda_state_bytes_per_layer(c, ONE) + costs.conv_state_bytes_per_layer(c, ONE)
    rec = spec_costs.record_bytes_per_token(c, ONE) // len(c.kda_layers)
    rows.append((hd, s_layer, rec, spec_costs.rollback_bytes(c, ONE, "snapshot", 8)
                 / spec_costs.rollback_bytes(c, ONE, "replay", 8)))
show_table(rows, ["head_dim", "state+conv / layer (B)", "record / layer (B, bf16)", "k=8 snapshot / replay"],
           formats={"k=8 snapshot / replay": ".1f"})

# %% [markdown]
# So replay stops paying where the state is small and the kept length long: with
# head_dim 16 the bytes saved fall to single digits, and if the replay kernel runs at
# 0.2% of peak, slot selection beats replaying 4 kept positions and copy-back 5. Chapter
# 12 collects this crossover with the others.

# %% [markdown]
# ## Summary
#
# - Built: projection replay, the ring buffer and the lazy ring, behind chapter 7's
#   interface. Going back needs only what the state update reads: a 48B record is 44.1x
#   smaller than a state in bf16 (22.1x in fp32, 87.2x for the leanest).
# - All five strategies are exact on chains and trees, paged or not, and move exactly the
#   bytes the cost model predicts.
# - Per GPU at 48B under TP4: snapshots hold 10.85–97.69 MB per request at k = 1–8, replay
#   0.49–2.21 MB. Slot selection moves the fewest states at k = 1, replay from k = 2, and
#   the lazy ring (k ≤ 4) fewer than plain decoding: a quarter of its bytes per token.
# - Break-even acceptance is not monotone in batch (0.190, 0.388, 0.163, 0.277 at batch 1,
#   16, 64, 256 for slot selection at k = 4): at small batch the verify's tokens touch more
#   experts than the decode's. The fall from 16 to 64 holds under all 36 plausible kernel
#   sets.
#
# **Next chapter:** how can one long prompt be prefilled across several GPUs when a KDA
# state, unlike attention's, cannot be split into parts that simply add?

# %% [markdown]
# ## Exercises
#
# Each checked exercise is a question, a cell for your answer (empty in the student
# edition) and `verify("N.M", answer)`. Open exercises and a project follow.
#
# **8.1 A leaner record.** How many bytes per token (all 20 KDA layers, bf16) does a `"raw"`
# record (raw conv inputs, g and beta) take at 48B? Count it from the shapes.

# %% tags=["solution"]
H, K = CFG.n_heads, CFG.head_dim
answer = len(CFG.kda_layers) * (3 * H * K + H * K + H) * 2

# %%
verify("8.1", answer)

# %% [markdown]
# **8.2 The smallest ring (predict, then try).** What is the smallest `window` a
# `RingRollback` accepts for k = 6 drafts? Write down your prediction and the reason first,
# then find it by trying.

# %% tags=["solution"]
answer = None
for w in range(1, 12):
    try:
        spec.RingRollback(tiny, PagePool(400, 4096), k=6, window=w)
    except ValueError:
        continue
    answer = w  # k + 1: every verified position stays until acceptance is known
    break

# %%
verify("8.2", answer)

# %% [markdown]
# **8.3 Replay FLOPs.** How many GFLOP does replaying 5 kept positions cost at 48B, all
# KDA layers? A replay only updates the state: count `kda.recurrent_kda_flops` (one layer,
# with the output read) and subtract the output read, 2 K V + K per head and token.

# %% tags=["solution"]
from kimilab import kda

H, K = CFG.n_heads, CFG.head_dim
answer = len(CFG.kda_layers) * (kda.recurrent_kda_flops(5, H, K, K) - 5 * H * (2 * K * K + K)) / 1e9

# %%
verify("8.3", answer)

# %% [markdown]
# **8.4 How often a lazy ring writes back (predict, then count).** A lazy ring of 16 entries
# serves verifies of 4 positions (k = 3) that yield 2 tokens each; it writes back before a
# verify when cursor + 4 > 16, and the cursor grows by 2 a step. Predict roughly first, then
# count exactly: how many write-backs per step, in steady state?

# %% tags=["solution"]
cursor, steps = 2, 1  # the step of the write-back leaves its 2 accepted entries behind
while cursor + 4 <= 16:
    cursor, steps = cursor + 2, steps + 1
answer = 1 / steps

# %%
verify("8.4", answer)

# %% [markdown]
# **8.5 (project, ~6 h) Replay from the raw record.** In a loop of your own like the ring's
# deep dive, and with public calls only, keep after `spec.verify` just the raw conv inputs
# (`captures[i].conv_inputs`), `g` and `beta`. After acceptance, recompute the kept k and v
# as `KDALayer.project` does (conv with `model.layers[i].weights["conv"]` from the committed
# conv state, SiLU, L2 norm for k), replay with `spec.state_steps`, rebuild the conv state
# with `spec.conv_after`, and set the cache with `cache.truncate(n, spec.checkpoint_at(...))`.
# Check it against `spec.GreedyReference` (tokens, `state_error`) at corruption 0, 0.5 and 1,
# and compare its bytes with `spec_costs.record_bytes_per_token`. Extension: trees.
#
# **8.6 (open, ~1 h) The ring in bf16.** Round the lazy ring's entries to bf16 (keep 8
# mantissa bits) and run 200 tokens with ring lengths 5, 16 and 64. How far do the states
# drift from a plain decode's, and does the text change? (Chapter 7's deep dive on
# production exactness; [sglang-28695](references.md#sglang-28695).)
#
# **8.7 (open, ~30 min) A ring for many requests.** Size one scratch region for a batch of
# 64 requests at 48B with k = 4 on one TP4 GPU: copy-back, slot selection, ring and lazy
# ring, in GB (`costs.spec.rollback_bytes`). How many 32K-token requests' caches does the
# difference hold?
