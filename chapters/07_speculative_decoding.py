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
# # 7. Speculative decoding meets a mutable state
#
# **What you'll build.** A speculative decoding loop for the hybrid model
# (`kimilab.spec.speculative_generate`): a cheap *drafter* guesses k tokens, the target
# model checks all of them in one forward pass, and the longest agreeing prefix is kept.
# Three drafters behind one small interface, and the first correct way to undo the
# rejected guesses in a KDA layer: a snapshot of every state at every draft position,
# held in the page pool's scratch pages.
#
# **What you'll learn.**
# - Why rejecting a draft is free for a KV cache (forget the rows) and impossible for a
#   KDA state (it has already absorbed them), shown by running the loop *without* a
#   rollback and watching the text drift away from greedy decoding.
# - How vLLM and SGLang solve it — one state per draft position — and that it is exact:
#   the speculative output equals greedy decoding token for token, and the states equal
#   a plain decode run to rounding error.
# - What it costs: at Kimi-Linear-48B sizes the snapshots of one verify step weigh more
#   than the request's whole KV cache at a few thousand tokens of context.
#
# **What you'll need.** Chapter 3 (the model, its cache protocol and `truncate`) and
# chapter 4 (the page pool). Everything runs on the reduced, *untrained* `tiny` model;
# bytes at 48B come from `kimilab.costs`. Chapter 8 builds the cheaper rollbacks.

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
model = Model(tiny, seed=0)
tok = ByteTokenizer()
prompt = tok.encode("the state absorbs every token; the state absorbs every draft; the state ")
N_NEW = 32
greedy = model.generate(prompt, N_NEW)
print(f"prompt: {len(prompt)} tokens; greedy continuation: {N_NEW} tokens")
print("first 12 greedy tokens:", greedy[:12])

# %% [markdown]
# ## Draft, verify, accept
#
# Decoding one token at a time reads every weight once per token. A verify pass over
# k+1 tokens reads them once for all k+1, so if a cheap drafter can guess what the
# target would say, one forward pass yields several tokens. With greedy decoding the
# rule is exact: the window is `[last committed token, d_1 .. d_k]`; row t of the
# logits is the target's prediction after position t; draft d_{t+1} is kept while it
# equals that argmax, and the target's own token at the first mismatch comes free with
# the same pass. So every step yields between 1 and k+1 tokens, and the text is the
# target's greedy text whatever the drafter guessed.

# %%
show_source(spec.greedy_accept)

# %% [markdown]
# ## Three drafters behind one interface
#
# A drafter gets the text so far and returns at most k guesses. Two are real:
# **n-gram prompt lookup** (find the last few tokens earlier in the text, propose what
# followed them; the idea of vLLM's `ngram` proposer) and a **smaller draft model** (here
# a 2-layer model with its own seed). Our models are untrained, so neither guesses well:

# %%
draft_model = Model(tiny.with_(name="tiny-draft", layer_pattern="KA"), seed=1)
real_drafters = {"n-gram lookup": spec.NgramDrafter(max_n=3),
                 "draft model (2 layers)": spec.DraftModelDrafter(draft_model)}
for name, drafter in real_drafters.items():
    r = spec.speculative_generate(model, prompt, N_NEW, drafter, k=4, rollback="snapshot")
    print(f"{name:<24s} acceptance {r.acceptance_rate:.3f}  tokens per verify {r.tokens_per_step:.2f}  "
          f"same as greedy: {r.tokens == greedy}")

# %% [markdown]
# Both are exact (the output is the greedy text) and both are useless here: a random
# model's next token is nearly unpredictable, from its own past text or from another
# random model. A trained target with a trained drafter accepts a large share of the
# drafts; how large depends on the task, which we cannot measure with these weights.
#
# So the book uses a third drafter, clearly a **test instrument**: the
# `ControlledDrafter` proposes the target's own greedy continuation and replaces each
# token by a wrong one with a seeded probability `corruption`. Each draft is then
# accepted with probability 1 − corruption, and we can sweep acceptance from 0 to 1 on
# purpose. Its guesses depend only on (seed, position), so a run is reproducible.

# %%
show_source(spec.ControlledDrafter.guess)

# %%
controlled = spec.ControlledDrafter(model, prompt, N_NEW + 8, corruption=0.3, seed=7)
print("reference = greedy:", controlled.reference[:N_NEW] == greedy)
print("drafts at position 0, k=8:", controlled.propose(prompt, 8))
print("greedy tokens 0..7:       ", greedy[:8])

# %% [markdown]
# ## Verify from the committed state
#
# The verify pass runs the k+1 window through the model in **one chunked forward**
# (`Model.prefill`, the chunked KDA kernel of chapter 2), on top of the request's cache.
# What should it write? The global layers append the window's K and V to the request's
# KV cache: if drafts are rejected, those rows are simply dropped later. The KDA and
# conv states are different: the verify computes new ones, but the request must not
# lose the *committed* state before the window, because it may have to go back there.
# So the verify reads the cache through a `VerifyView`: KV goes to the request's cache,
# new states stay in the view.

# %%
show_source(spec.verify)

# %%
cache = HybridCache(tiny)
model.prefill(prompt, cache)
before = cache.checkpoint()
logits, captures, view = spec.verify(model, [greedy[0]] + controlled.propose(prompt + greedy[:1], 4), cache)
layer = tiny.kda_layers[0]
print(f"seq_len {before.seq_len} -> {cache.seq_len} (KV of the 5-token window appended)")
print("request's KDA state still the committed one:",
      np.array_equal(cache.kda_state(layer), before.kda_states[layer]))
print(f"verify's own state after the window differs by {np.abs(view.kda_state(layer) - before.kda_states[layer]).max():.3f}")
print(f"captured per KDA layer: {captures[layer]!r}")

# %% [markdown]
# ## The failure first: keep the verified state
#
# A KV cache rolls back by forgetting rows: `cache.truncate(n)` drops the KV past n.
# The tempting fix for a hybrid model is to do just that and keep the state the verify
# produced. That state has absorbed *every* window token, rejected drafts included.
# mlx-lm shipped exactly this bug: its `trim()` silently corrupted recurrent caches,
# and the fix was an exact rollback cache API ([mlx-lm-1486](references.md#mlx-lm-1486)). Our cache
# protocol refuses to truncate a KDA cache without a checkpoint:

# %%
probe = cache.clone()
try:
    probe.truncate(before.seq_len + 1)
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# `TrimOnly` defeats the guard the way a careless implementation would: it hands the
# protocol the verify's final states *labelled* as the position it truncates to.

# %%
show_source(spec.TrimOnly)

# %%
trim = spec.speculative_generate(model, prompt, N_NEW, controlled, k=4, rollback="none")
first_wrong = next((i for i, (a, b) in enumerate(zip(trim.tokens, greedy)) if a != b), None)
print("greedy:   ", greedy[:16])
print("trim only:", trim.tokens[:16])
print(f"first wrong token at position {first_wrong}; {sum(a != b for a, b in zip(trim.tokens, greedy))} "
      f"of {N_NEW} tokens differ; acceptance {trim.acceptance_rate:.3f}")

# %% [markdown]
# The first steps agree: until a draft is rejected, the kept state is the right one.
# After the first rejection the KDA states carry tokens that are not in the text, every
# later logit is computed from them, and the output drifts away for good (and with it
# the acceptance rate, since the controlled drafter keeps proposing the true greedy
# text). Nothing raised an error.

# %% [markdown]
# ## The baseline fix: a snapshot at every draft position
#
# vLLM and SGLang keep one state per draft position ([vllm](references.md#vllm),
# [sglang](references.md#sglang)): SGLang caches the intermediate state of every draft
# token and copies the accepted one back; vLLM's TPU runner keeps a state slot per
# window position, so rollback is choosing a slot. `SnapshotRollback` does this with
# every KDA and conv state after each of the k+1 verified positions, written to
# `"scratch"` pages of the page pool and freed after the step.
#
# One honest difference: a GPU verify kernel writes these states as it passes each
# position. Our verify is the chunked kernel, which only yields the last state, so
# `save` recomputes the per-position states token by token from the committed state and
# the inputs the verify captured — the same arithmetic as decoding (`state_steps`).

# %%
show_source(spec.SnapshotRollback)

# %% [markdown]
# The loop ties it together. The cache always holds every emitted token but the last,
# as `Model.generate` leaves it; after acceptance the strategy moves the cache to the
# committed position plus the tokens kept, through the protocol's `truncate(n,
# checkpoint)`: the global layers forget their extra KV rows, the KDA layers get the
# chosen snapshot. A window may also run past `max_new_tokens`; then fewer tokens are
# kept than were accepted, and the same rollback handles it.

# %%
show_source(spec.speculative_generate, lines=(28, 48))

# %% [markdown]
# ## Exact, for every drafter
#
# The check the tests run under hypothesis, here once per drafter: the tokens equal
# greedy decoding, and after every step the KDA and conv states equal those of a
# plain decode run at the same position (float64).

# %%
ref_cache = HybridCache(tiny)
logits0 = model.prefill(prompt, ref_cache)[-1]
ref_states = {ref_cache.seq_len: ref_cache.checkpoint()}
for t in greedy[:-1]:
    model.decode(t, ref_cache)
    ref_states[ref_cache.seq_len] = ref_cache.checkpoint()


def state_error(c):
    """Largest difference between the cache's states and greedy decoding's at the same position."""
    ref = ref_states[c.seq_len]
    return max(max(np.abs(c.kda_state(i) - ref.kda_states[i]).max(),
                   np.abs(c.conv_state(i) - ref.conv_states[i]).max()) for i in tiny.kda_layers)


drafters = dict(real_drafters)
for c in (0.0, 0.5, 1.0):
    drafters[f"controlled, corruption {c}"] = controlled.with_corruption(c)
print(f"{'drafter':<28s} {'steps':>5s} {'accept':>7s} {'same tokens':>11s} {'state error <= 1e-10':>21s}")
for name, drafter in drafters.items():
    errors = []
    r = spec.speculative_generate(model, prompt, N_NEW, drafter, k=4, rollback="snapshot",
                                  on_step=lambda c, s: errors.append(state_error(c)))
    print(f"{name:<28s} {len(r.steps):5d} {r.acceptance_rate:7.3f} {str(r.tokens == greedy):>11s} "
          f"{str(max(errors) <= 1e-10):>21s}")

# %% [markdown]
# Corruption 1.0 proposes garbage at every position: every step keeps one token, as
# plain decoding would, and the output is still exact.

# %% [markdown]
# ## On the page pool
#
# With a `PagedHybridCache` the snapshots come out of the request's own pool as pages of
# kind `"scratch"`. During a step they sit beside the request's KV and states; after
# the rollback they are gone, and the pool's invariants hold.

# %%
pool = PagePool(1200, 4096)
paged = PagedHybridCache(tiny, pool, block_tokens=16)
held_pages = []


def after_step(c, stats):
    pool.check_invariants()
    held_pages.append(stats.rollback_bytes)


r = spec.speculative_generate(model, prompt, N_NEW, controlled.with_corruption(0.3), k=8,
                              rollback="snapshot", cache=paged, on_step=after_step)
snap_pages = 9 * pool.pages_for_bytes(costs.checkpoint_bytes(tiny))
print(f"exact: {r.tokens == greedy}; {len(r.steps)} steps; scratch held per step: "
      f"{max(held_pages):,d} B = 9 checkpoints of {costs.checkpoint_bytes(tiny):,d} B ({snap_pages} pages)")
print(f"the request itself ({paged.seq_len} tokens): {paged.n_pages} pages; scratch pages in use after the run: "
      f"{pool.stats().pages_by_kind['scratch']}")
paged.free()
pool.check_invariants()

# %% [markdown]
# On the tiny model a verify step at k = 8 holds more pages of snapshots than the whole
# request holds for all its tokens' KV and its states.

# %% [markdown]
# ## What the snapshots cost at 48B
#
# One checkpoint of Kimi-Linear-48B — 20 KDA states of `32 × 128 × 128` numbers in fp32 plus
# their conv states in bf16 — weighs about 43 MB (chapter 6). A verify of k drafts
# keeps k+1 of them per request, next to the request's own cache:

# %%
ks = np.arange(1, 9)
snap_mb = np.array([spec_costs.rollback_bytes(CFG, "snapshot", int(k)) for k in ks]) / 1e6
own = {L: costs.request_total_bytes(CFG, L) / 1e6 for L in (4096, 32768)}
print(f"one checkpoint: {costs.checkpoint_bytes(CFG) / 1e6:.1f} MB; KV per token: {costs.kv_bytes_per_token(CFG):,d} B")
for k in (1, 4, 8):
    print(f"k={k}: snapshots {snap_mb[k - 1]:6.1f} MB per request   "
          f"(request's own cache: {own[4096]:.1f} MB at 4K tokens, {own[32768]:.1f} MB at 32K)")
print(f"at k=8 the snapshots equal the KV of {spec_costs.rollback_bytes(CFG, 'snapshot', 8) // costs.kv_bytes_per_token(CFG):,d} tokens")

# %%
fig, ax = plt.subplots()
ax.plot(ks, snap_mb, marker="o", **plots.style_of("snapshot"))
for L, ls in ((4096, "--"), (32768, ":")):
    ax.axhline(own[L], color=plots.color("kv-cache"), ls=ls,
               label=f"the request's own cache at {L // 1024}K tokens (KV + states)")
ax.set_xlabel("draft tokens per verify step, k")
ax.set_ylabel("bytes per request (MB)")
ax.set_ylim(0, None)
ax.set_title("Kimi-Linear-48B: snapshot memory of one verify step")
ax.legend()
plots.save(fig, "ch07-snapshot-memory")
plt.show()

# %% [markdown]
# Takeaway: at k = 8 the per-position snapshots of one request (391 MB) outweigh its
# whole cache at 32K tokens of context, so the batch a GPU can hold while speculating shrinks.

# %% [markdown]
# ## Accepted tokens per verify step
#
# What speculation buys is tokens per forward pass. With the controlled drafter each
# draft is accepted with probability α = 1 − corruption, independently, so a step yields
# (1 − α^(k+1)) / (1 − α) tokens on average (the accepted prefix plus the target's
# own token). The measured runs (`SWEEP_NEW` tokens each, one seed per k) scatter around
# the formula — a run of 64 tokens has only a dozen or two steps at high α — and lose a
# little at α = 1 because the last window of a run is cut at `max_new_tokens`.

# %%
alphas = np.array([0.25, 0.5, 0.75, 1.0])  # alpha = 0 keeps one token per step, always
SWEEP_NEW = 64
sweep = spec.ControlledDrafter(model, prompt, SWEEP_NEW + 8, corruption=0.0, seed=11)
measured = {}
for k in (2, 4, 8):
    for a in alphas:  # a different seed per k: each k sees its own corruption pattern
        r = spec.speculative_generate(model, prompt, SWEEP_NEW, sweep.with_corruption(1.0 - a, seed=k), k=k,
                                      rollback="snapshot")
        measured[k, a] = r.tokens_per_step
print("alpha  " + "  ".join(f"k={k}: measured / formula" for k in (2, 4, 8)))
for a in alphas:
    print(f"{a:5.2f}  " + "  ".join(f"    {measured[k, a]:5.2f} / {spec_costs.expected_tokens_per_step(a, k):5.2f}    "
                                    for k in (2, 4, 8)))

# %%
fig, ax = plt.subplots()
grid = np.linspace(0.0, 1.0, 101)
for k in (2, 4, 8):
    style = plots.style_of(f"spec-k{k}")
    ax.plot(grid, [spec_costs.expected_tokens_per_step(a, k) for a in grid], color=style["color"],
            label=f"{style['label']}: formula")
    ax.plot(alphas, [measured[k, a] for a in alphas], "o", color=style["color"],
            label=f"{style['label']}: measured (tiny model)")
ax.axhline(1.0, **plots.style_of("plain-decode"), lw=1)
ax.set_xlabel("draft acceptance rate α (controlled drafter: 1 − corruption)")
ax.set_ylabel("tokens per verify step")
ax.set_title("Tokens per forward pass vs acceptance")
ax.legend(ncol=2, fontsize=8)
plots.save(fig, "ch07-tokens-per-step")
plt.show()

# %% [markdown]
# Takeaway: a long window pays only when acceptance is high — at α = 0.5 eight drafts give
# 2.00 tokens per step against 1.94 for four (formula), while each draft adds a snapshot.

# %% [markdown]
# ## Summary
#
# - Speculative decoding verifies k drafts in one forward pass and keeps the longest
#   prefix the target agrees with; with greedy acceptance the output is the target's
#   greedy text whatever the drafter proposes.
# - A KV cache undoes rejected drafts by forgetting rows; a KDA state has absorbed them.
#   Keeping the verified state (a KV-only `trim`, the bug mlx-lm found) makes the text
#   drift silently after the first rejection.
# - The verify must leave the committed state intact (`VerifyView`); `SnapshotRollback`
#   then keeps every state at every window position in scratch pages and restores the
#   chosen one through `truncate(n, checkpoint)`. It is exact for every drafter — the
#   n-gram lookup, a draft model and the controlled drafter from corruption 0 to 1 —
#   with states equal to plain decoding to 1e-10, on contiguous and paged caches.
# - The price is memory: at 48B one verify step at k = 8 keeps 391 MB of snapshots per
#   request, more than its whole cache at 32K tokens of context.
# - The untrained model makes real drafters useless, so acceptance is swept with a
#   controlled drafter; measured tokens per step follow (1 − α^(k+1)) / (1 − α).
#
# Chapter 8 keeps the committed state and a much smaller record per token instead.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **7.1 Snapshot memory at k = 4.** How many MB (1e6 bytes) of snapshots does one
# Kimi-Linear-48B request keep for one verify step with k = 4 drafts? Use
# `costs.checkpoint_bytes`.

# %% tags=["solution"]
answer = 5 * costs.checkpoint_bytes(CFG) / 1e6  # the last committed token + 4 drafts, one checkpoint each

# %%
verify("7.1", answer)

# %% [markdown]
# **7.2 Tokens per step.** With independent acceptance α = 0.6 and k = 4 drafts, how
# many tokens does one verify step yield on average?

# %% tags=["solution"]
a = 0.6
answer = sum(a**i for i in range(5))  # the target's own token always, the first draft with a, two with a^2, ...

# %%
verify("7.2", answer)

# %% [markdown]
# **7.3 Scratch pages.** A pool of 4096-byte pages serves the tiny model with
# `rollback="snapshot"` and k = 8. How many scratch pages does one verify step hold?
# (`spec.checkpoint_layout(tiny).nbytes` is one snapshot slot; slots are page-aligned.)

# %% tags=["solution"]
pool = PagePool(1200, 4096)
answer = 9 * pool.pages_for_bytes(spec.checkpoint_layout(tiny).nbytes)  # k+1 slots of 62 pages

# %%
verify("7.3", answer)

# %% [markdown]
# **7.4 (open) When is the trim right?** Run `spec.speculative_generate(model, prompt,
# N_NEW, controlled.with_corruption(c), 4, "none")` for c in 0.0, 0.5 and 1.0. For which
# c does the output still equal `greedy`, and why? Is the *cache* also right at the end?
#
# **7.5 (open) A better draft model.** Give the draft model the target's own weights for
# its first layers (build it with the same seed and a shorter `layer_pattern`, then copy
# `weights["embed"]`, `final_norm` and `lm_head` from the target). Does the acceptance
# rate rise above the 2-layer random model's? Is the output still exact?
#
# **7.6 (open) Slot selection instead of a copy.** vLLM's TPU runner does not copy the
# accepted state back; it makes the chosen slot the request's state. What would
# `SnapshotRollback.restore` need from the page pool to do that (hint: `pool.share`)?
