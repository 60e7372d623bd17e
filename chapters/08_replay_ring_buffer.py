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
# **What you'll build.** Three more exact rollbacks for speculative decoding on a hybrid
# model, exchangeable with chapter 7's two snapshot designs behind one interface:
# **projection replay** (keep the committed state and a small per-token record of the
# projected KDA inputs; after acceptance, replay the kept tokens), the **ring buffer**
# (the same records in scratch pages reserved once, the conv state a pointer), and the
# **lazy ring** of ReplaySSM (the state slot holds a checkpoint that is written back only
# every L tokens; a ring of per-token update vectors holds the rest; a rollback is a
# cursor move). All five on chains and on token trees.
#
# **What you'll learn.**
# - What going back needs, derived before building: at Kimi-Linear-48B sizes a token's
#   record is 20–90 times smaller than a state.
# - That all five strategies are exact — equal to greedy decoding, states to 1e-10 — on
#   chains and trees, and that the bytes each one moves, counted as it runs, are the cost
#   model's to the byte.
# - What each costs per GPU at 48B: bytes held and moved over k and tree size, the lazy
#   ring's flush interval, and the time at serving batch: the rollback's share of a step
#   and the acceptance at which speculation pays, for batch 1 to 256, on the default
#   deployment and under DP-attention — and why that break-even is not monotone in batch.
#
# **What you'll need.** Chapter 7 (the loop, the `VerifyView`, snapshots, trees) and
# chapter 2 (the KDA recurrence and its chunked form). The model is the reduced,
# *untrained* `tiny` model; speeds are CPU speeds, labelled; 48B numbers are analytic
# (`kimilab.costs`) on named deployments.

# %%
import matplotlib.pyplot as plt
import numpy as np

from kimilab import costs, plots, speculative as spec
from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import spec as spec_costs
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import show_source
from kimilab.pool import PagedHybridCache, PagePool
from kimilab.tokenizer import ByteTokenizer

plots.use_style()
CFG = kimi_linear_48b
TP4, DP4, ONE = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200, costs.ONE_H200
STRATEGIES = spec.EXACT_ROLLBACKS
model = Model(tiny, seed=0)
prompt = ByteTokenizer().encode("the state absorbs every token; the state absorbs every draft; the state ")
N_NEW = 24
greedy = model.generate(prompt, N_NEW)
controlled = spec.ControlledDrafter(model, prompt, N_NEW + 10, corruption=0.3, seed=7)
print(f"prompt {len(prompt)} tokens, {N_NEW} greedy tokens; controlled drafter: {controlled!r}")
print("strategies:", ", ".join(STRATEGIES))

# %% [markdown]
# ## What going back needs
#
# Chapter 7 kept a whole state per verified position. But look at what one KDA step
# reads (chapter 2): the state S is decayed by exp(g_t), then corrected with
# beta_t k_t (v_t − Sᵀk_t)ᵀ. The query q_t only *reads* the updated state to make the
# output. So from the committed state, the k, v, g and beta of the kept tokens are
# enough to recompute the state exactly — they are the verify pass's own capture record
# (`KDACapture`, chapter 3). The conv state is the last (kernel − 1) *raw* conv inputs,
# so keeping the raw q | k | v inputs of the window rebuilds it exactly too.
#
# How much is that per token, against a state? It depends on what a record keeps
# (`costs.spec.RECORD_KEEPS`): post-conv k, v, g, beta plus the raw conv inputs
# (replayable without any weight — what `kimilab.speculative` stores); or only the raw
# conv inputs plus g and beta, recomputing k and v through the conv; or the gate's
# low-rank input (head_dim numbers per token) instead of g, recomputing the gate too. The
# ratio is the same on every deployment (states and records shard by head alike); the
# table counts the whole model.

# %%
show_source(spec_costs.record_elems_per_layer)

# %%
state_layer = costs.kda_state_bytes_per_layer(CFG, ONE) + costs.conv_state_bytes_per_layer(CFG, ONE)
ckpt = costs.checkpoint_bytes(CFG, ONE)
print(f"Kimi-Linear-48B, per KDA layer: state + conv state = {state_layer:,d} B "
      f"(KDA state fp32, conv bf16); {len(CFG.kda_layers)} KDA layers")
print(f"{'record keeps':<12s} {'elems/layer':>11s} {'dtype':>6s} {'per token, all layers':>22s} {'state / record':>15s}")
for keep in spec_costs.RECORD_KEEPS:
    for act, dtype in ((2, "bf16"), (4, "fp32")):
        rec = spec_costs.record_bytes_per_token(CFG, ONE, keep, act)
        print(f"{keep:<12s} {spec_costs.record_elems_per_layer(CFG, keep):11,d} {dtype:>6s} "
              f"{rec / 1e6:18.3f} MB {ckpt / rec:14.1f}x")

# %% [markdown]
# A 48B state is 32 heads × 128 × 128 numbers per layer; a token's record is a few
# vectors of 32 × 128. With post-conv records in fp32 — about 2 MB per token over 20
# layers against 43 MB per state — the state is 22.1x larger. Engines keep the captured
# activations in bf16 (the state stays fp32), which doubles it to 44.1x; the leaner
# records reach 87.2x. What the record keeps decides the saving; the state never has to
# be copied at all.

# %% [markdown]
# ## Projection replay
#
# `ReplayRollback.save` writes the verified positions' records to scratch pages; the
# committed state is untouched (the verify ran through a `VerifyView`). `restore(path)`
# runs the accepted path's records as recurrent steps from the committed state — the
# state half of the KDA update, no output read — and rebuilds the conv state from the raw
# inputs. On a tree the path is any root path, so replay's work grows with the *accepted*
# path, not with the tree. This is the replay TensorRT-LLM merged for Mamba-2
# ([trtllm-13453](references.md#trtllm-13453)), which fuses it into the next step's verify.

# %%
show_source(spec.state_steps)

# %%
show_source(spec.ReplayRollback)

# %% [markdown]
# ## The ring buffer
#
# Replay allocates and frees its records every step. A serving engine prefers memory it
# reserves once per request: `RingRollback` keeps the records in a fixed window of
# `window` ≥ k+1 slots, reused every step, and the raw conv rows in a `ConvRing` of
# window + kernel − 1 slots that also holds the (kernel − 1) committed rows before the
# window. The conv state after any accepted path is then a slice of that ring: its
# rollback is moving `head` (a tree path's rows are first moved together). A window
# shorter than k+1 would overwrite records the rollback still needs, so it is refused.

# %%
show_source(spec.RingRollback)

# %%
pool = PagePool(400, 4096)
cache = HybridCache(tiny)
model.prefill(prompt, cache)
ring = spec.RingRollback(tiny, pool, k=4)
out = [greedy[0]]
for step in range(4):
    drafts = controlled.propose(prompt + out, 4)
    logits, captures, view = spec.verify(model, [out[-1]] + drafts, ring.current(cache))
    ring.save(view, captures)
    j, bonus = spec.greedy_accept(drafts, logits)
    ring.restore(cache, j + 1)
    out += drafts[:j] + [bonus]
    print(f"step {step}: kept {j + 1} of {len(drafts) + 1} positions, conv-ring head -> {ring.head:2d} "
          f"(ring of {ring.conv_slots_n} rows), scratch pages {pool.stats().pages_by_kind['scratch']}")
ring.close()
print("tokens so far equal greedy:", out == greedy[:len(out)], f"({len(out)} tokens)")
try:
    spec.RingRollback(tiny, pool, k=4, window=4)
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# The ring takes the same pages every step and the head advances by the kept length. But
# it still replays every step and writes the request's state every step: it saves an
# allocation and a conv copy, not state traffic.

# %% [markdown]
# ## The lazy ring: write the state back every L tokens
#
# Every strategy so far reads the committed state and writes a new one each step — as
# plain decoding does. ReplaySSM (vLLM RFC [vllm-rfc-47572](references.md#vllm-rfc-47572), the
# implementation in [vllm-47576](references.md#vllm-47576); ports in SGLang
# [sglang-replayssm](references.md#sglang-replayssm), Megatron-LM [megatron-6617](references.md#megatron-6617) and
# TensorRT-LLM [trtllm-14203](references.md#trtllm-14203)) stops writing it. The identity behind it
# is chapter 7's chunked form: after entries i = 1..m the state is
#
#     S_m = diag(exp(G_m)) S_0 + Σ_i diag(exp(G_m − G_i)) k_i d_iᵀ,
#
# where G is the running sum of the gates and d_i = beta_i (v_i − (decayed S_{i−1})ᵀ k_i) is
# the *corrected update vector* — the V′ of the chunk form, which the verify computes
# anyway. Keeping d instead of v makes the sum free of the serial dependency: any prefix
# of entries folds into a state in one product (`fold`).

# %%
show_source(spec.fold)

# %% [markdown]
# So the request's state slot holds a **checkpoint** S_0, and a ring of `ring_len` entries
# (d, k, g per position) holds what came after it. A verify computes its outputs from the
# checkpoint and the ring (here the fold becomes a temporary array the model reads; a GPU
# kernel keeps it in registers, one tile at a time, and never builds the state) and
# writes the window's entries after the cursor. A **rollback is a cursor move** past the
# accepted entries; the rejected ones are overwritten by the next verify. When the next
# verify would not fit, the committed entries are folded into the checkpoint and written
# back — a **flush**, about every `ring_len − k` tokens. On a tree, the accepted path's
# entries are first moved together (SGLang's port takes chains only; this is our extension).

# %%
show_source(spec.LazyRingRollback)

# %%
lazy_pool = PagePool(400, 4096)
cache = HybridCache(tiny)
model.prefill(prompt, cache)
lazy = spec.LazyRingRollback(tiny, lazy_pool, k=4, ring_len=12)
out = [greedy[0]]
drafter = controlled.with_corruption(0.1)
for step in range(6):
    request = lazy.current(cache)
    drafts = drafter.propose(prompt + out, 4)
    logits, captures, view = spec.verify(model, [out[-1]] + drafts, request)
    lazy.save(view, captures)
    j, bonus = spec.greedy_accept(drafts, logits)
    lazy.restore(cache, j + 1)
    out += drafts[:j] + [bonus]
    print(f"step {step}: folded {lazy.last_history:2d} entries {'and wrote the state back' if lazy.last_flush else '                         '}"
          f" | kept {j + 1}, cursor -> {lazy.cursor:2d} of {lazy.ring_len}; the cache's state is the checkpoint "
          f"at {cache.seq_len - lazy.cursor}, the request is at {cache.seq_len}")
lazy.finish(cache)
plain = HybridCache(tiny)
model.prefill(prompt + out[:-1], plain)
drift = max(np.abs(cache.kda_state(i) - plain.kda_state(i)).max() for i in tiny.kda_layers)
print(f"after finish(): tokens equal greedy {out == greedy[:len(out)]}; the cache's state against a plain "
      f"prefill of the same {plain.seq_len} tokens: largest difference {drift:.1e}")
lazy.close()

# %% [markdown]
# ## Five strategies, one interface, all exact
#
# `speculative_generate(..., rollback=...)` takes any of them, on chains (`k` drafts) and
# token trees (`tree=widths`). For each strategy: a chain on a paged cache (the pool's
# invariants checked after every step) and a tree (2, 2, 1) on a contiguous one. The
# tokens equal greedy decoding, the KDA and conv states after each step equal a plain
# decode run's (float64), and two byte counts — the scratch the step held and the bytes
# it moved — equal what `kimilab.costs.spec` predicts for the tiny model, at every step.

# %%
reference = spec.GreedyReference(model, prompt, N_NEW)  # plain decoding, its states kept per length
print("reference tokens = greedy:", reference.tokens == greedy)
state_error = reference.state_error
STATE = costs.checkpoint_bytes(tiny, costs.LOCAL)
print(f"{'strategy':<10s} {'shape':<16s} {'same tokens':>11s} {'states':>7s} {'held (B)':>10s} {'= model':>7s} "
      f"{'moved/step (states)':>20s} {'= model':>7s} {'flushes':>7s}")
runs = {}
for name in STRATEGIES:
    for tree in (None, (2, 2, 1)):
        k = 4 if tree is None else 3
        nodes = k + 1 if tree is None else 11
        pool = PagePool(1400, 4096) if tree is None else None
        cache = PagedHybridCache(tiny, pool, block_tokens=16) if pool else HybridCache(tiny)
        errors = []

        def check(c, s):
            errors.append(state_error(c))
            if pool is not None:
                pool.check_invariants()

        r = spec.speculative_generate(model, prompt, N_NEW, controlled, k, name, cache, tree=tree, on_step=check)
        runs[name, tree] = r
        held_model = spec_costs.rollback_bytes(tiny, costs.LOCAL, name, k, act_bytes=8, nodes=nodes)
        moved_ok = all(s.moved_bytes == spec.predicted_moved(model, name, k, s, nodes) for s in r.steps)
        mean_moved = np.mean([s.moved_bytes for s in r.steps]) / STATE
        shape = f"chain k={k} (paged)" if tree is None else f"tree {tree}"
        print(f"{name:<10s} {shape:<16s} {str(r.tokens == greedy):>11s} {str(max(errors) <= 1e-10):>7s} "
              f"{r.peak_rollback_bytes:10,d} {str(r.peak_rollback_bytes == held_model):>7s} {mean_moved:20.2f} "
              f"{str(moved_ok):>7s} {r.flushes:7d}")
        if pool is not None:
            cache.free()
            assert pool.stats().pages_by_kind["scratch"] == 0 and pool.n_free == pool.n_pages

# %% [markdown]
# Every strategy is exact on both shapes, and its byte counts are the model's, step by
# step. On the tiny model the state is small against a record (head_dim 32), so the
# byte ratios here are modest; at 48B they are not.

# %% [markdown]
# ## Bytes per GPU at 48B: held and moved
#
# Per request on one GPU of the default deployment (TP4: a quarter of every state and
# record), for verifies of k drafts: what each strategy **holds** beyond the request's own
# state, and what a step **moves** through HBM, in states (the verify's read of the
# committed state included; plain decoding moves 2). Records and ring entries in bf16
# (the lazy ring's gates in fp32, as vLLM keeps them); the lazy ring at its default
# `ring_len` of 16, in steady state with k+1 tokens a step (every draft accepted).

# %%
ks = (1, 2, 4, 8)
S4 = costs.checkpoint_bytes(CFG, TP4)
held = {s: [spec_costs.rollback_bytes(CFG, TP4, s, k) / 1e6 for k in ks] for s in STRATEGIES}


def moved_states(s, k, dep=TP4, nodes=None, kept=None, gathered=False, ring_len=spec_costs.DEFAULT_RING):
    """Bytes a step moves per request, in states (the lazy ring: its steady state, kept tokens a step)."""
    kept = k + 1 if kept is None else kept
    return spec_costs.mean_moved_bytes(CFG, dep, s, k, kept, nodes=nodes, gathered=gathered,
                                       ring_len=ring_len) / costs.checkpoint_bytes(CFG, dep)


print(f"one checkpoint on a GPU of {TP4.name}: {S4 / 1e6:.2f} MB")
print(f"{'strategy':<10s} " + " ".join(f"{'k=' + str(k) + ' held':>11s}" for k in ks) + "   "
      + " ".join(f"{'k=' + str(k) + ' moved':>11s}" for k in ks))
for s in STRATEGIES:
    print(f"{s:<10s} " + " ".join(f"{h:8.2f} MB" for h in held[s]) + "   "
          + " ".join(f"{moved_states(s, k):6.2f} st." for k in ks))

# %% [markdown]
# At MTP's usual k = 1, slot selection moves 3 states a step and replay 3.09 (the ring
# 3.07): selecting a slot beats replaying, because replay reads the committed state a
# second time. From k = 2 on, replay moves less (snapshots grow by a state per draft,
# replay by a record). At k ≤ 4 the lazy ring moves 1.31–1.61 states — less than plain
# decoding's 2 — because it writes the state only at a flush; at k = 8 its 16-entry ring
# is full after every step, it writes back every step and moves 2.34. In memory,
# snapshots hold 10.85–97.69 MB per GPU and request; replay 0.49–2.21 MB; the lazy ring a
# fixed ring of 16 entries, 3.24–4.10 MB.
#
# Trees: a snapshot strategy keeps and writes a state per *node*; replay keeps a record per
# node but replays only the accepted path; the lazy ring writes an entry per node and moves
# the accepted path's entries together. Over full trees of growing size, at 48B on TP4,
# with a 3-deep accepted path:

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
print("tree widths -> verified positions:", ", ".join(f"{w}: {n}" for w, n in zip(shapes, tree_nodes)))
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
# under plain decoding's while the tree sits well inside the ring — a tree that nearly
# fills it forces a write-back every step.

# %% [markdown]
# ## The lazy ring's flush interval
#
# A longer ring writes the state back less often (one state per flush, amortised over the
# tokens between flushes) but reads a longer history every step (each verify folds the
# entries since the checkpoint). Per token, at k = 4 with α = 0.75 (3.05 tokens a step),
# the history read grows like e·L/2 and the write-back falls like S·τ/L, so the traffic is
# smallest near L = √(2 τ S / e) — about 20 entries at 48B, where vLLM's and SGLang's
# default is 16. The CPU implementation counts the same bytes on the tiny model:

# %%
tau = spec_costs.expected_tokens_per_step(0.75, 4)
Skda, e48 = costs.kda_state_bytes(CFG, TP4), spec_costs.lazy_entry_bytes(CFG, TP4)
rings = [5, 8, 12, 16, 24, 32, 48, 64, 128]


def lazy_per_token(dep, L):
    return spec_costs.mean_moved_bytes(CFG, dep, "lazy-ring", 4, 3, ring_len=L, tokens_per_step=tau) / tau


per_token = [lazy_per_token(TP4, L) / 1e6 for L in rings]
plain_token = 2 * S4 / 1e6
slot_token = moved_states("slot", 4) * S4 / tau / 1e6
best = rings[int(np.argmin(per_token))]
print(f"48B on {TP4.name}, k = 4, {tau:.2f} tokens per step; sqrt(2 tau S / e) = {np.sqrt(2 * tau * Skda / e48):.1f}")
print(f"{'ring_len':>8s} {'MB moved per token':>19s} {'ring held (MB)':>15s} {'rollback us/step, B=64':>23s}")
for L, m in zip(rings, per_token):
    us = 1e6 * spec_costs.rollback_seconds(CFG, TP4, "lazy-ring", 4, 3, batch=64, ring_len=L, tokens_per_step=tau)
    print(f"{L:8d} {m:19.2f} {spec_costs.rollback_bytes(CFG, TP4, 'lazy-ring', 4, ring_len=L) / 1e6:15.2f} {us:23.1f}")
print(f"least traffic at ring_len {best}; plain decoding moves {plain_token:.2f} MB per token, "
      f"slot selection at k = 4 {slot_token:.2f}")

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
for L in rings:
    per_seed = []
    for em in emitted:
        h, f = np.array(spec_costs.lazy_steps(em, 5, L)).T
        per_seed.append((len(em) * base + per_entry * h.sum() + per_flush * f.sum()) / sum(em) / 1e6)
    walked[L] = (np.mean(per_seed), 1.96 * np.std(per_seed, ddof=1) / np.sqrt(SEEDS))
print(f"{'ring_len':>8s} {'fluid MB/token':>15s} {'50 seeds MB/token':>18s}")
for L, m in zip(rings, per_token):
    print(f"{L:8d} {m:15.2f} {walked[L][0]:11.2f} +- {walked[L][1]:.2f}")

# %%
fig, ax = plt.subplots()
st = plots.style_of("lazy-ring")
ax.plot(rings, per_token, color=st["color"], label=f"{st['label']}: steady state (fluid)")
ax.errorbar(rings, [walked[L][0] for L in rings], yerr=[walked[L][1] for L in rings], fmt="o", capsize=3,
            color=st["color"], label=f"{st['label']}: {SEEDS} seeds, 95% interval")
ax.axhline(plain_token, lw=1, **plots.style_of("plain-decode"))
ax.axhline(slot_token, lw=1, ls="--", color=plots.color("slot"), label=f"{plots.label('slot')}, k = 4")
ax.axvline(spec.DEFAULT_RING, color="grey", lw=0.8, ls=":", label="vLLM / SGLang default (16)")
ax.set_xscale("log", base=2)
ax.set_xticks(rings, [str(L) for L in rings])
ax.set_xlabel("ring length L (entries)")
ax.set_ylabel("state + ring bytes moved per token (MB per GPU)")
ax.set_ylim(0, None)
ax.set_title("Kimi-Linear-48B on vllm-tp4-h200, k = 4, α = 0.75: the flush interval")
ax.legend(fontsize=8)
plots.save(fig, "ch08-flush-interval")
plt.show()

# %% [markdown]
# Takeaway: the lazy ring moves 5.17 MB per token at its best ring length against 21.71
# for plain decoding and 21.35 for slot selection — a quarter — and the minimum is flat:
# anything from 12 to 48 entries is within 10% of it. The shortest ring (L = k+1)
# writes back every step and still moves only about a third: it is the replay with the
# state one step behind (TensorRT-LLM's #13453). The random cursor of real runs lands
# within 2% of the fluid curve except at L = 8 (6.23 against 7.63): the fluid limit writes
# back every step there, while a real step that keeps 1–3 tokens still leaves the next
# verify room in the ring.

# %% [markdown]
# ## Replay FLOPs against a full re-verify
#
# The other way back is recomputation: truncate everything and push the accepted tokens
# through the whole model again. Replay recomputes only the KDA recurrence of the kept
# tokens (the projections were captured), and only its state update: the outputs were
# read in the verify. At a 4K-token context:

# %%
print(f"{'kept':>4s} {'replay (MFLOP)':>15s} {'re-verify (GFLOP)':>18s} {'replay / re-verify':>19s}")
for kept in (1, 3, 5, 9):
    rp, rv = spec_costs.replay_flops(CFG, kept), spec_costs.reverify_flops(CFG, kept, 4096)
    print(f"{kept:4d} {rp / 1e6:15.1f} {rv / 1e9:18.2f} {rp / rv:19.4f}")

# %% [markdown]
# Replay is about one percent of a re-verify: the expert and projection matmuls, which
# dominate a forward pass, are not repeated.

# %% [markdown]
# ## Rollback time on the reduced model (wall clock)
#
# CPU time of each strategy's `current` (the lazy ring's fold), `save` and `restore` on the
# tiny model, k = 8, keeping 1 or all 9 positions. Measured on this machine, best of two
# runs: the numbers change from run to run; the shape is the result.

# %%
# NBVAL_IGNORE_OUTPUT
keeps = (1, 9)
timings = {name: spec.rollback_timings(model, name, 8, keeps, repeats=2) for name in STRATEGIES}
for name in STRATEGIES:
    print(f"{name:<10s} " + "   ".join(
        f"keep {j}: " + " + ".join(f"{part} {1e3 * timings[name][j][part]:.2f}" for part in ("current", "save", "restore"))
        + " ms" for j in keeps))

# %% [markdown]
# On a CPU the snapshot strategies pay in `save` (our chunked verify yields no per-position
# states, so they are recomputed) and the replay strategies in `restore`; the lazy ring pays
# in `save` (the update vectors) and `current` (the fold). A GPU kernel produces the
# per-position states, records and update vectors as it verifies; the 48B model below
# charges what remains: the bytes moved and the replay arithmetic.

# %% [markdown]
# ## Time at serving batch
#
# A speculative step of B requests is **one** forward pass over their verified positions
# (chapter 3's step model: weights read once for the whole step, each request's KV and
# state read once and its state written once, collectives, a per-layer overhead), plus each
# request's rollback beyond that one state read and write. The rollback's time is its extra
# bytes over the GPU's bandwidth and its replay arithmetic at the `kernels.replay`
# efficiency (5% of peak: our assumption, nothing published measures it); for the lazy ring
# it is negative. Drafting is taken as free (an n-gram lookup).
#
# First, why a verify is cheap at batch 1 and dear at batch 256 — and neither in between:

# %%
w = costs.weight_model(CFG)
print(f"{'batch':>5s} {'decode ms':>10s} {'verify k=4 ms':>14s} {'ratio':>6s} "
      f"{'experts read: decode':>21s} {'verify':>7s}   (of {w.n_routed_experts} per layer, {w.routed_top_k} per token)")
for B in (1, 16, 64, 256):
    d = costs.decode_step_seconds(CFG, TP4, 4096, B)
    v = spec_costs.verify_step_seconds(CFG, TP4, 4096, 4, batch=B, strategy="slot")
    ex = [w.n_routed_experts * (1 - (1 - w.routed_top_k / w.n_routed_experts) ** t) for t in (B, 5 * B)]
    print(f"{B:5d} {1e3 * d:10.2f} {1e3 * v:14.2f} {v / d:6.2f} {ex[0]:21.1f} {ex[1]:7.1f}  ({ex[1] / ex[0]:.2f}x)")

# %% [markdown]
# At batch 1 the step is mostly fixed cost (27 layers of kernel launches and host work), so
# verifying 5 tokens instead of 1 adds 13%. At batch 16 the decode step's 16 tokens touch
# 102 of the 256 experts per layer, but the verify's 80 tokens touch 236: the verify reads
# 2.31 times the expert weights, and costs 1.44 decode steps. At batch 64 both already read
# nearly every expert, and the verify is back to 1.16. At batch 256 the step is
# compute-bound, and 5 times the tokens cost 2.38 times the time. The **mixture-of-experts
# union** makes the price of a verify — and with it the acceptance at which speculation
# pays — rise, fall and rise again with batch (uniform routing assumed, as the step model
# does; real routing is skewed, which narrows the gap).

# %%
batches = (1, 16, 64, 256)
be = {(d.name, s, k): [spec_costs.break_even_acceptance(CFG, d, 4096, k, s, batch=B) for B in batches]
      for d in (TP4, DP4) for s in STRATEGIES for k in ks}
share = {(d.name, s, k): [spec_costs.rollback_share(CFG, d, 4096, k, s, batch=B) for B in batches]
         for d in (TP4, DP4) for s in STRATEGIES for k in ks}
for d in (TP4, DP4):
    print(f"{d.describe()}; context 4,096 tokens")
    print(f"  {'strategy':<10s} {'k':>2s}  break-even alpha at B = 1, 16, 64, 256     rollback share of the step (k+1 kept)")
    for k in ks:
        for s in STRATEGIES:
            print(f"  {s:<10s} {k:2d}  " + " ".join(f"{x:6.3f}" for x in be[d.name, s, k]) + "          "
                  + " ".join(f"{100 * x:6.1f}%" for x in share[d.name, s, k]))

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
# Takeaway: break-even is low at batch 1 (0.034–0.202 on TP4 for k = 1–8: a step is
# mostly fixed cost), rises at 16 (the verify's expert union), falls again at 64 and
# climbs at 256, where the step is compute-bound (0.164–0.789 over both deployments). At
# batch 1 the strategies agree to a few thousandths; the gap widens with batch — at 256
# and k = 1 from 0.181 (lazy ring) to 0.359 (copy-back) on TP4 — snapshots highest, the
# lazy ring lowest. The two deployments agree to within two hundredths: the verify's
# weight read, not the state layout, sets the curve.

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
# Takeaway: at batch 1 every rollback is under 2% of a step; at batch 256 copy-back costs
# 10.6–12.5% of it, slot selection 3.8–10.2%, replay and the ring 2.8–5.2%, and the lazy
# ring saves up to 2.8% (it writes fewer states than the forward pass is charged for) until
# k = 8 fills its 16-entry ring. A measured profile on vLLM-metal put 19.3% of a speculative
# step in rejection trim/restore/replay at one draft token
# ([vllm-metal-610](references.md#vllm-metal-610)): such overheads come from the implementation
# (launches, host-side copies), not from the bytes a rollback must move.

# %% [markdown]
# ## Where replay stops paying
#
# Replay trades bytes for recomputation: a snapshot's cost is fixed (write the states, copy
# or select one), replay's grows with the kept length j. On the 48B model the replay is so
# cheap that it wins from k = 2 — *if* the replay kernel runs at a fair fraction of peak.
# A token-by-token recurrence is latency-bound, so we vary that assumed efficiency
# (`Kernels.replay`, 5% in the calibrated deployments), at k = 8 and batch 64:

# %%
print(f"{'replay efficiency':>17s}  " + " ".join(f"j={j:<5d}" for j in range(1, 10))
      + "  replay / copy-back time; first j where copy-back / slot wins")
for eff in (0.05, 0.005, 0.002, 0.001):
    dep = TP4.with_(name=f"replay at {eff:g}", kernels=TP4.kernels.__class__(**{**TP4.kernels.__dict__, "replay": eff}))
    rep = [spec_costs.rollback_seconds(CFG, dep, "replay", 8, j, batch=64) for j in range(1, 10)]
    snap = spec_costs.rollback_seconds(CFG, dep, "snapshot", 8, 1, batch=64)
    slot = spec_costs.rollback_seconds(CFG, dep, "slot", 8, 1, batch=64)
    first = [next((j for j, x in enumerate(rep, 1) if x > ref), None) for ref in (snap, slot)]
    print(f"{eff:17.3f}  " + " ".join(f"{x / snap:7.2f}" for x in rep) + f"  {first[0]}, {first[1]}")

# %% [markdown]
# And memory: the saving is the state-to-record ratio, so it shrinks with the state.
# Keeping everything else at 48B shapes and shrinking the head dimension (the state per
# head is head_dim², a record is linear in it):

# %%
print(f"{'head_dim':>8s} {'state+conv / layer':>19s} {'record / layer (bf16)':>22s} {'k=8 snapshot / replay':>22s}")
for hd in (16, 32, 64, 128, 256):
    c = CFG.with_(head_dim=hd)
    s_layer = costs.kda_state_bytes_per_layer(c, ONE) + costs.conv_state_bytes_per_layer(c, ONE)
    rec = spec_costs.record_bytes_per_token(c, ONE) // len(c.kda_layers)
    ratio = spec_costs.rollback_bytes(c, ONE, "snapshot", 8) / spec_costs.rollback_bytes(c, ONE, "replay", 8)
    print(f"{hd:8d} {s_layer:17,d} B {rec:20,d} B {ratio:21.1f}x")

# %% [markdown]
# So replay stops paying where the state is small and the kept length long: with
# head_dim 16 the bytes saved fall to single digits, and if the replay kernel runs at
# 0.2% of peak, slot selection beats replaying 3 kept positions and copy-back 4. Chapter
# 12 collects this crossover with the others.

# %% [markdown]
# ## Against the production systems
#
# - **SGLang** keeps a state per draft position and copies the accepted one back
#   ([sglang-copy-back](references.md#sglang-copy-back)); its tree verify is output-only with an ancestor
#   mask ([sglang-tree-verify](references.md#sglang-tree-verify)).
# - **vLLM** writes each position's state to its own slot and starts the next verify
#   from the accepted one, trees included ([vllm-fused-recurrent](references.md#vllm-fused-recurrent)).
# - **TensorRT-LLM** replays: first with the state one step behind
#   ([trtllm-13453](references.md#trtllm-13453)), then with a checkpoint kept further back
#   ([trtllm-14203](references.md#trtllm-14203)) — the lazy ring.
# - **ReplaySSM** in vLLM ([vllm-rfc-47572](references.md#vllm-rfc-47572), [vllm-47576](references.md#vllm-47576)),
#   SGLang ([sglang-replayssm](references.md#sglang-replayssm)) and Megatron-LM
#   ([megatron-6617](references.md#megatron-6617)): a checkpoint, a ring of (d, k, g), a cursor.
#   A Kimi-K3 port replaced 8 state slots per request by one ([rocm-atom-1883](references.md#rocm-atom-1883): 28.91 GiB per rank).
# - **Megatron-LM** first proposed a factorised exact rollback: rank-1 factors per draft
#   token, the accepted ones applied in one matmul ([megatron-5803](references.md#megatron-5803)) — the
#   fold above.
# - **mlx-lm** replaced a `trim()` that corrupted recurrent caches with an exact rollback
#   cache API ([mlx-lm-1486](references.md#mlx-lm-1486)) — chapter 7's failure.

# %% [markdown]
# ## Summary
#
# - Going back needs only what the state update reads: k, v, g, beta per token (never
#   q) and the raw conv inputs. At 48B a post-conv record is 22.1x smaller than a state in
#   fp32 and 44.1x in bf16; leaner records reach 87.2x.
# - Five strategies behind one interface, all exact on chains and token trees, on
#   contiguous and paged caches: copy-back, slot selection, replay, the ring, and the lazy
#   ring (a checkpoint, a ring of update vectors, a cursor). The bytes each one moves,
#   counted as it runs, are the cost model's.
# - Per GPU at 48B under TP4: snapshots hold 10.85–97.69 MB per request at k = 1–8, replay
#   0.49–2.21 MB, the lazy ring a fixed 3.24–4.10 MB. Per step, slot selection moves the
#   fewest states at k = 1, replay from k = 2, and the lazy ring (k ≤ 4) fewer than plain
#   decoding: at its best ring length a quarter of plain decoding's bytes per token.
# - At serving batch the rollback is under 2% of a step at batch 1 and up to 12.5% at
#   batch 256 (copy-back); break-even acceptance is not monotone in batch, because the
#   verify's tokens touch more experts than the decode's at small batch.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **8.1 A leaner record.** How many bytes per token (all 20 KDA layers) does a `"raw"`
# record — raw conv inputs, g and beta; k and v recomputed through the conv — take at
# 48B in bf16 (the whole model)? Count it from the shapes.

# %% tags=["solution"]
H, K = CFG.n_heads, CFG.head_dim
answer = len(CFG.kda_layers) * (3 * H * K + H * K + H) * 2

# %%
verify("8.1", answer)

# %% [markdown]
# **8.2 The smallest ring.** What is the smallest `window` a `RingRollback` accepts for
# k = 6 drafts? Find it by trying.

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
# **8.4 How often a lazy ring writes back.** A lazy ring of 16 entries serves verifies of
# k = 3 drafts (4 positions) that yield 2 tokens each. After a write-back the cursor
# grows by 2 a step, and the ring writes back before a verify when cursor + 4 > 16. How
# many write-backs per step, in steady state?

# %% tags=["solution"]
cursor, steps = 2, 1  # the step of the write-back leaves its 2 accepted entries behind
while cursor + 4 <= 16:
    cursor, steps = cursor + 2, steps + 1
answer = 1 / steps

# %%
verify("8.4", answer)

# %% [markdown]
# **8.5 (open) Build the raw record.** Write a `Rollback` subclass that stores only the
# raw conv inputs, g and beta, and recomputes k and v in `restore` with the layer's conv
# weights (`model.layers[i].weights["conv"]`, `kimilab.ops.conv.causal_conv1d`, SiLU,
# L2 norm). Check it against greedy decoding; how would you extend `make_rollback`?
#
# **8.6 (open) The ring in bf16.** Round the lazy ring's entries to bf16 (keep 8 mantissa
# bits) before writing them, and run 200 tokens with ring lengths 5, 16 and 64. How far do
# the states drift from a plain decode's, and does the text change? (Chapter 7's paragraph
# on bf16, and SGLang's fix in [sglang-28695](references.md#sglang-28695).)
#
# **8.7 (open) A ring for many requests.** Size one scratch region for a batch of 64
# requests at 48B with k = 4 on one TP4 GPU: copy-back, slot selection, ring and lazy ring,
# in GB (`costs.spec.rollback_bytes`). How many 32K-token requests' caches does the
# difference hold?
