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
# (`kimilab.speculative.speculative_generate`): a cheap *drafter* guesses the next tokens,
# the target model checks them all in one forward pass, and the longest agreeing run is
# kept. Then the first two exact ways to undo rejected guesses in a KDA layer, both keeping
# a state per draft position: SGLang's **copy-back** and vLLM's **slot selection**.
#
# **What you'll learn.**
# - Why rejecting a draft is free for a KV cache (forget the rows) and impossible for a
#   KDA state (it has already absorbed them): without a rollback the text drifts away.
# - The two snapshot designs: copying the accepted state back moves k+4 states a step,
#   selecting its slot moves k+2 and keeps one state fewer.
# - Two notions of acceptance: the acceptance *probability* α a drafter has, and the
#   accepted *fraction* a run measures.
# - What snapshots cost at Kimi-Linear-48B **per GPU**, on two deployments.
# - In deep dives: token trees, tokens per step over 50 seeds, sampling verification.
#
# **What you'll need.** Chapter 3 (the model, its cache protocol and `truncate`) and
# chapter 4 (the page pool). Everything runs on the reduced, *untrained* `tiny` model;
# bytes at 48B come from `kimilab.costs` on named deployments. Chapter 8 builds the
# cheaper rollbacks.
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
from kimilab.speculative import sampling
from kimilab.tokenizer import ByteTokenizer

plots.use_style()
CFG = kimi_linear_48b
TP4, DP4 = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200
model = Model(tiny, seed=0)
prompt = ByteTokenizer().encode("the state absorbs every token; the state absorbs every draft; the state ")
N_NEW = 24
greedy = model.generate(prompt, N_NEW)  # what every exact run must reproduce, token for token
controlled = spec.ControlledDrafter(model, prompt, N_NEW + 10, corruption=0.3, seed=7)  # a test drafter
STATE = costs.checkpoint_bytes(tiny, costs.LOCAL)  # one tiny-model checkpoint (all KDA and conv states), bytes

# %%
# Key results (each number is computed here and derived step by step below)
trim = spec.speculative_generate(model, prompt, N_NEW, controlled, k=4, rollback="none")  # no rollback
wrong = [i for i, (a, b) in enumerate(zip(trim.tokens, greedy)) if a != b]
moved4 = {s: spec_costs.moved_bytes(tiny, costs.LOCAL, s, 4, 5) / STATE for s in ("snapshot", "slot")}
chain8 = {d: spec_costs.expected_tokens_per_step_tree([0.75 * d**i for i in range(8)], (1,) * 8) for d in (1, 0.8)}
snap8 = {dep.name: spec_costs.rollback_bytes(CFG, dep, "snapshot", 8) / 1e6 for dep in (TP4, DP4)}
own32k = {dep.name: costs.request_total_bytes(CFG, dep, 32768) / 1e6 for dep in (TP4, DP4)}
key_results(
    f"Keeping the verified state after a rejection (a KV-only trim) corrupts the text silently: {len(wrong)} of "
    f"{N_NEW} tokens differ from greedy decoding, the first at position {wrong[0]}.",
    f"A state snapshot per verified position undoes any rejection exactly; at k = 4 SGLang's copy-back moves "
    f"{moved4['snapshot']:.0f} states a step, vLLM's slot selection {moved4['slot']:.0f}.",
    f"A verify step yields 1 + α + ... + α^k tokens on average: at α = 0.75, {chain8[1]:.2f} for a chain of 8 "
    f"drafts, but {chain8[0.8]:.2f} if α decays by a factor 0.8 a depth.",
    f"At Kimi-Linear-48B, copy-back snapshots at k = 8 take {snap8[TP4.name]:.1f} MB per GPU under TP4, against "
    f"{own32k[TP4.name]:.1f} MB for a 32K-token request's own cache; under DP-attention {snap8[DP4.name]:.1f} MB "
    f"against {own32k[DP4.name]:.1f} MB.",
)

# %% [markdown]
# ## Draft, verify, accept
#
# <a id="term-speculative-decoding"></a>Decoding one token at a time reads every weight once
# per token. **Speculative decoding** lets a cheap drafter guess k tokens and has the target
# check them all in one forward pass, the **verify**: a pass over k+1 tokens reads the
# weights once for all k+1, so one pass can yield several tokens.
#
# With greedy decoding the rule is exact. The window is `[last committed token, d_1 .. d_k]`;
# row t of the logits is the target's prediction after position t; draft d_{t+1} is kept
# while it equals that argmax, and the target's own token at the first mismatch comes free
# with the same pass. So every step yields between 1 and k+1 tokens, and the text is the
# target's greedy text whatever the drafter guessed.

# %%
show_source(spec.greedy_accept)

# %% [markdown]
# ## Drafters, and two names for acceptance
#
# <a id="term-drafter"></a>A **drafter** gets the text so far and returns at most k guesses.
# Two are real: **n-gram prompt lookup** (propose what followed the last few tokens earlier
# in the text; vLLM's `ngram` proposer) and a **smaller draft model**. Our models are
# untrained, so neither guesses well. So the book uses a **test instrument**: the
# `ControlledDrafter` knows the target's own greedy continuation and guesses it right with a
# chosen probability, reproducibly (its draws depend only on seed, position and depth).
#
# <a id="term-acceptance-rate"></a>"Acceptance rate" is used for two different things;
# this book gives each its own name.
#
# <a id="term-acceptance-probability"></a>The **acceptance probability** α_d is the chance
# that the draft at depth d (1 = the first draft of a step) is accepted, given that every
# draft before it was. A drafter *has* it. Real drafters are better near the root: α_d falls
# with depth. The controlled drafter takes α_d = (1 − corruption) · decay^(d − 1).
#
# <a id="term-accepted-fraction"></a>The **accepted fraction** is accepted drafts / proposed
# drafts, what a run *measures* (`SpecResult.accepted_fraction`). With a constant α a step
# yields 1 + α + α² + … + α^k tokens, so the accepted fraction is (α + … + α^k) / k, well
# below α for long chains:

# %%
show_source(spec_costs.accepted_fraction)

# %%
decaying = controlled.with_corruption(0.1, decay=0.8)
print(f"an accepted fraction of 0.5 at k = 4 means alpha = {spec_costs.alpha_from_accepted_fraction(0.5, 4):.3f}")
print("controlled drafter, alpha by depth 1..6, decay 0.8:", " ".join(f"{decaying.alpha(d):.3f}" for d in range(1, 7)))
print("the controlled drafter's reference = greedy:", controlled.reference[:N_NEW] == greedy)
show_table([(a, *(spec_costs.accepted_fraction(a, k) for k in (1, 4, 8))) for a in (0.5, 0.8, 0.95)],
           ["alpha", "k = 1", "k = 4", "k = 8"], formats={"alpha": ".2f", "k = 1": ".3f", "k = 4": ".3f",
                                                          "k = 8": ".3f"}, title="accepted fraction")

# %% [markdown]
# The two real drafters accept none of their drafts on these untrained weights
# (accepted fraction 0.000 in the deep dive) and are still exact.
#
# ### Deep dive: two real drafters on untrained weights
#
# The n-gram lookup and a 2-layer draft model with its own seed, 12 tokens at k = 4:

# %%
draft_model = Model(tiny.with_(name="tiny-draft", layer_pattern="KA"), seed=1)
real_drafters = {"n-gram lookup": spec.NgramDrafter(max_n=3),
                 "draft model (2 layers)": spec.DraftModelDrafter(draft_model)}
rows = []
for name, drafter in real_drafters.items():
    r = spec.speculative_generate(model, prompt, 12, drafter, k=4, rollback="slot")
    rows.append((name, r.accepted_fraction, r.tokens_per_step, r.tokens == greedy[:12]))
show_table(rows, ["drafter", "accepted fraction", "tokens per verify", "same as greedy"],
           formats={"accepted fraction": ".3f", "tokens per verify": ".2f"}, title="12 tokens, k = 4")

# %% [markdown]
# Both are exact (the output is the greedy text) and both are useless here: a random
# model's next token is nearly unpredictable, from its own past text or from another
# random model. A trained drafter accepts a large share of the drafts; how large depends
# on the task, which these weights cannot measure.

# %% [markdown]
# ## Verify from the committed state
#
# The verify runs the k+1 window through the model in **one chunked forward**
# (`Model.prefill`, chapter 2's chunked KDA kernel) on top of the request's cache. The
# window's K and V go to the request's KV cache (rejected rows are dropped later). But the
# request must keep its *committed* KDA and conv states, because it may have to go back
# there: so the verify reads the cache through a `VerifyView`, which keeps the new states.

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
# <a id="term-rollback"></a>A **rollback** puts the cache back at the committed position plus
# the tokens kept. A KV cache rolls back by forgetting rows: `cache.truncate(n)` drops the KV
# past n. The tempting fix for a hybrid model is to do just that and keep the state the
# verify produced, which has absorbed *every* window token, rejected drafts included.
# mlx-lm shipped exactly this bug in its `trim()` ([mlx-lm-1486](references.md#mlx-lm-1486)).
# Our cache protocol refuses to truncate a KDA cache without a checkpoint:

# %%
probe = cache.clone()
try:
    probe.truncate(before.seq_len + 1)
except ValueError as err:
    print(textwrap.fill(f"ValueError: {err}", 100))

# %% [markdown]
# `TrimOnly` defeats the guard the way a careless implementation would: it hands the
# protocol the verify's final states *labelled* as the position it truncates to. The run
# below is the one the Key results box made (`trim`, with the controlled drafter).

# %%
show_source(spec.TrimOnly)

# %%
print("greedy:   ", greedy[:16])
print("trim only:", trim.tokens[:16])
print(f"first wrong token at position {wrong[0]}; {len(wrong)} of {N_NEW} tokens differ; "
      f"accepted fraction {trim.accepted_fraction:.3f}")

# %% [markdown]
# The first steps agree: until a draft is rejected, the kept state is the right one.
# After the first rejection the KDA states carry tokens that are not in the text, every
# later logit is computed from them, and the output drifts away for good. Nothing raised
# an error.

# %% [markdown]
# ## Fix 1: a snapshot per position, copied back (SGLang)
#
# <a id="term-copy-back"></a>SGLang's verify kernel writes the state after every draft
# position into a buffer; after acceptance the accepted one is copied into the request's
# state ([sglang](references.md#sglang)): this is **copy-back**. `SnapshotRollback` keeps
# every KDA and conv state after each of the k+1 verified positions in `"scratch"` pages of
# the page pool, freed after the step. A step moves k+4 states: the verify reads the
# committed one and writes k+1, the copy-back reads one and writes it home.
#
# One honest difference: a GPU kernel writes these states as it verifies. Our chunked verify
# yields only the last state, so `save` recomputes the others from the committed state and
# the captured inputs, with the same arithmetic as decoding.

# %%
show_source(spec.SnapshotRollback)

# %% [markdown]
# `_layout` says what one scratch slot holds (a whole checkpoint), `_arrays` fills the slots
# from a verify, and `_restore` copies the accepted slot home. The rest (allocating the slots
# at every verify, freeing them after the rollback) is a base class shared with chapter 8's
# replay, shown in the deep dive below.
#
# ### Deep dive: the scratch-slot base class
#
# Two strategies of this book fill scratch slots at every verify and free them after the
# rollback: snapshots here, replay records in chapter 8. What they share is one class; each
# subclass says only what a slot holds (`_layout`, `_arrays`) and how it restores.

# %%
show_source(spec.StepSlotsRollback)

# %% [markdown]
# ## Fix 2: select the slot, copy nothing (vLLM)
#
# <a id="term-slot-selection"></a>vLLM's recurrent kernels do without the copy
# (`fla/ops/fused_recurrent.py`, reached for KDA from `fla/ops/kda.py` with `IS_KDA=True`;
# [vllm-fused-recurrent](references.md#vllm-fused-recurrent)): this is **slot selection**. Each
# request owns a row of state slots. A verify *reads* its initial state from slot
# `num_accepted_tokens − 1` (the state after the last token the previous step accepted) and
# *writes* the state after its position t to slot t. Acceptance only records which slot is
# live. The request's own state is one of the slots, so a request holds k+1 states in all
# (copy-back: k+2), and a step moves k+2 (read one, write k+1).
#
# In `SlotRollback` slot 0 is the request's own state and slots 1..k are scratch pages held
# for the whole request. Its whole rollback is two lines: remember the live slot, drop the
# rejected KV rows. The next verify reads the live slot (`current`), and the live slot is
# copied home once, when the request ends (`finish`).

# %%
show_source(spec.SlotRollback._restore)

# %% [markdown]
# The loop ties it together: each step asks the strategy for the request as the model must
# see it (`current`), verifies, lets the strategy `save`, accepts, and has the strategy
# `restore` the cache to the committed position plus the tokens kept. The deep dive lists
# `SlotRollback` and the loop in full.
#
# ### Deep dive: slot selection and the loop, in full
#
# `SlotRollback` whole: its slots are allocated once per request, `save` writes slot 0
# into the request's own state and the other positions into scratch slots.

# %%
show_source(spec.SlotRollback, limit=None)

# %% [markdown]
# The loop. A window may run past `max_new_tokens`; then fewer tokens are kept than were
# accepted, and the same rollback handles it.

# %%
show_source(spec.speculative_generate, limit=None)

# %% [markdown]
# ## Exact, for every drafter, on the page pool too
#
# The check the tests run under hypothesis, here once per drafter and design: the tokens
# equal greedy decoding, and after every step the KDA and conv states equal those of plain
# decoding at the same position (float64). The controlled drafter at corruption 0.5 runs on
# a `PagedHybridCache`, whose pool gives the snapshots `"scratch"` pages and has its
# invariants checked after every step. The last column is the states each step moved.

# %%
reference = spec.GreedyReference(model, prompt, N_NEW)  # plain decoding, its states kept per length
drafters = {"n-gram lookup": spec.NgramDrafter(max_n=3), "controlled 0.5 (paged)": controlled.with_corruption(0.5),
            "controlled 1.0": controlled.with_corruption(1.0)}
rows, paged = [], []
for name, drafter in drafters.items():
    for rollback in ("snapshot", "slot"):
        pool = PagePool(1200, 4096) if "paged" in name else None
        cache = PagedHybridCache(tiny, pool, block_tokens=16) if pool else HybridCache(tiny)
        errors = []

        def check(c, s):  # after every step: states against plain decoding's, and the pool's invariants
            errors.append(reference.state_error(c))
            if pool is not None:
                pool.check_invariants()

        r = spec.speculative_generate(model, prompt, N_NEW, drafter, k=4, rollback=rollback, cache=cache,
                                      on_step=check)
        moved = ", ".join(f"{m:g}" for m in sorted({s.moved_bytes / STATE for s in r.steps}))
        rows.append((name, rollback, len(r.steps), r.accepted_fraction, r.tokens == greedy, max(errors) <= 1e-10,
                     moved))
        if pool is not None:
            paged.append((rollback, r.peak_rollback_bytes, spec.make_rollback(rollback, model, None, 4)
                          .scratch_pages(4096), cache.n_pages, pool.stats().pages_by_kind["scratch"]))
            cache.free()
            pool.check_invariants()
print("reference tokens = greedy:", reference.tokens == greedy)
show_table(rows, ["drafter", "rollback", "steps", "accepted", "same tokens", "states <= 1e-10", "moved (states)"],
           formats={"accepted": ".3f"}, title="k = 4, 24 tokens")

# %% [markdown]
# Corruption 1.0 proposes garbage at every position: every step keeps one token, as
# plain decoding would, and the output is still exact. At k = 4 copy-back moves 8 states
# a step and slot selection 6, whatever is accepted (when the n-gram lookup finds nothing
# to propose, a step verifies one position and moves 4 and 2).
#
# The first deep dive below counts the paged runs' scratch pages: one copy-back step holds
# 310 pages, more than the whole request's 162. The second explains why production engines,
# computing in bf16, test speculative decoding by acceptance length and logprob closeness
# instead of token identity.
#
# ### Deep dive: scratch pages on the paged cache
#
# Copy-back's snapshots are held for one step, slot selection's for the whole request;
# both come back to the pool at the end of the run.

# %%
show_table(paged, ["rollback", "scratch B/step", "scratch pages", "request pages", "scratch after run"],
           title="the paged runs (4,096-byte pages)")

# %% [markdown]
# ### Deep dive: what breaks token equality in production
#
# "Equal to greedy decoding, token for token" holds here because every path computes in
# float64, where the chunked verify, the token-by-token decode and a replay agree to
# ~1e-15 and no argmax is ever close enough to flip. Production kernels compute in bf16
# (states in fp32), and there the same function computed two ways rounds differently:
# a verify of k+1 tokens runs a chunked kernel whose reduction order differs from the
# one-token decode kernel; matmul tiling, split-K and the order of a sum depend on the
# batch's shape; and a recurrent state accumulates these differences over thousands of
# tokens. When the top two logits are within rounding of each other, speculative and
# plain greedy decoding pick different tokens, and from there the texts diverge: both
# correct to within the model's own precision, neither "wrong".
#
# So serving engines test speculative decoding by its acceptance length and by logprob
# closeness, not by token identity (vLLM checks logprobs, and its ReplaySSM port reports
# an acceptance-length match ([vllm-rfc-47572](references.md#vllm-rfc-47572))); and a lazy
# state that is folded in a different order than it was built must be checked the same
# way (SGLang's ReplaySSM port had to fix a long-output degeneration with an exact fold;
# [sglang-28695](references.md#sglang-28695)). Exactness in this book is the float64
# statement: the mechanism computes the same function.

# %% [markdown]
# ## Token trees
#
# <a id="term-token-tree"></a>A chain bets everything on one guess per position. A **token
# tree** hedges: at each node several candidate next tokens, each continued by its own
# guesses (the static trees of Medusa and EAGLE). The target checks every node in one pass;
# acceptance walks down from the root, following at each node the child whose token equals
# the target's choice. A snapshot strategy then keeps a state per *node*.
#
# In the first deep dive a tree of widths (2, 2, 1) verifies in one pass, each path equal to
# its chain (3.3e-15), and yields 2.88 tokens a step against the chain's 2.09; in the second,
# 50 seeds land on the formula: at α = 0.75 eight drafts yield 3.70 tokens a step, 2.53 when
# α decays by 0.8 a depth.
#
# ### Deep dive: verifying a tree in one pass
#
# `DraftTree.shape(widths)` builds a full tree with `widths[d]` children per node at depth
# d; node 0 of the verify window is the last committed token. What changes in the verify is
# only *who precedes whom*: a node's past is its root path, not the window positions before
# it.
#
# <a id="term-ancestor-mask"></a>The verify applies that **ancestor mask** in every place the
# model looks back: the short conv (a node convolves over its ancestors' inputs), global
# attention (a node attends to the committed keys and its ancestors), and KDA, whose chunked
# form needs two substitutions: the cumulative gate runs along the root path, and "earlier
# in the chunk" becomes "an ancestor" ([sglang-tree-verify](references.md#sglang-tree-verify)).
# Cross-branch terms of the chunk's triangular solve then vanish, so on every root-to-leaf
# path the result is that path's chain.

# %%
show_source(spec.tree_kda)

# %%
widths = (2, 2, 1)
draft_tree = controlled.with_corruption(0.5).propose_tree(prompt + greedy[:1], widths)
win = spec.Window.of(draft_tree)
print(f"tree of widths {widths}: {len(draft_tree)} draft nodes, depth {draft_tree.depth}, parents {draft_tree.parents}")
print("ancestor mask (row = node, 1 = that column is the node itself or an ancestor):")
print("\n".join("  " + " ".join(str(int(x)) for x in row) for row in win.ancestors))
window_tokens = [greedy[0]] + list(draft_tree.tokens)
c_tree = HybridCache(tiny)
model.prefill(prompt, c_tree)
tree_logits, _, _ = spec.verify_tree(model, window_tokens, win, c_tree)
worst, leaves = 0.0, [i for i in range(len(win)) if not win.children(i)]
for leaf in leaves:
    path = win.path(leaf)
    c_chain = HybridCache(tiny)
    model.prefill(prompt, c_chain)
    chain_logits, _, _ = spec.verify(model, [window_tokens[j] for j in path], c_chain)
    worst = max(worst, float(np.abs(tree_logits[path] - chain_logits).max()))
print(f"one tree verify vs a chain verify of each of its {len(leaves)} root-to-leaf paths: "
      f"max logit difference {worst:.1e}")
print("accepted path and next token:", spec.greedy_accept_tree(window_tokens, win, tree_logits))

# %% [markdown]
# A snapshot strategy keeps a state per *node* (vLLM's `IS_EAGLE_TREE` kernel starts each
# node from its parent's slot), so a tree of 10 nodes keeps 11 states where a chain of 3
# keeps 4. Both designs stay exact on trees, and the tree yields more tokens per step:

# %%
half = controlled.with_corruption(0.5)
rows = []
for rollback in ("snapshot", "slot"):
    errors = []
    r = spec.speculative_generate(model, prompt, N_NEW, half, k=3, rollback=rollback, tree=widths,
                                  on_step=lambda c, s: errors.append(reference.state_error(c)))
    rows.append((rollback, r.steps[0].drafted, r.tokens_per_step, np.mean(half.emitted_per_step(N_NEW, 3)),
                 r.tokens == greedy, max(errors) <= 1e-10, r.peak_rollback_bytes // STATE))
show_table(rows, ["rollback", "nodes", "tokens/step", "chain of 3", "same tokens", "states <= 1e-10",
                  "scratch (states)"], formats={"tokens/step": ".2f", "chain of 3": ".2f"},
           title=f"tree {widths} vs the chain of 3, same drafter (corruption 0.5)")

# %% [markdown]
# ### Deep dive: tokens per step over 50 seeds
#
# What speculation buys is tokens per forward pass: 1 + Σ_d Π_{e ≤ d} α_e on a chain, and
# on a tree each depth's factor becomes 1 − (1 − α_e)^w_e, the chance that one of w
# children is right. A single run is one draw of a noisy count (24 tokens are a dozen
# steps), so every measured point below is the mean of 50 seeds, with a 95% interval
# (± 1.96 standard errors). The controlled drafter's acceptance depends on its guesses
# alone (the target's text is its reference), so `emitted_per_step` counts each seed's
# steps without running the model; a test holds that count equal to the real loop's.
# The last step of a run is cut at `max_new_tokens`, so it is left out of the mean.

# %%
SEEDS, SWEEP_NEW = 50, 64
sweep = spec.ControlledDrafter(model, prompt, SWEEP_NEW + 10, corruption=0.0, seed=0)
alphas = np.array([0.25, 0.5, 0.75, 0.9])
cases = {"k = 2": dict(k=2), "k = 4": dict(k=4), "k = 8": dict(k=8), "k = 8, decay 0.8": dict(k=8, decay=0.8),
         "tree (2, 2, 1)": dict(k=3, widths=(2, 2, 1))}
measured = {}
for name, case in cases.items():
    for a in alphas:
        runs = [np.mean(sweep.with_corruption(1 - a, seed=s, decay=case.get("decay", 1.0))
                        .emitted_per_step(SWEEP_NEW, case["k"], case.get("widths"))[:-1]) for s in range(SEEDS)]
        measured[name, a] = (np.mean(runs), 1.96 * np.std(runs, ddof=1) / np.sqrt(SEEDS))


def formula(case, a):
    depth = case["k"]
    return spec_costs.expected_tokens_per_step_tree([a * case.get("decay", 1.0) ** d for d in range(depth)],
                                                    case.get("widths", (1,) * depth))


show_table([(name, a, *measured[name, a], formula(case, a)) for name, case in cases.items() for a in alphas],
           ["case", "alpha", "measured", "+- 95%", "formula"],
           formats={"alpha": ".2f", "measured": ".2f", "+- 95%": ".2f", "formula": ".2f"},
           title=f"tokens per verify step: {SEEDS} seeds x {SWEEP_NEW} tokens")

# %%
fig, ax = plt.subplots()
grid = np.linspace(0.0, 1.0, 101)
styles = {"k = 2": plots.style_of("spec-k2"), "k = 4": plots.style_of("spec-k4"), "k = 8": plots.style_of("spec-k8"),
          "k = 8, decay 0.8": dict(plots.style_of("spec-k8"), ls="--"),
          "tree (2, 2, 1)": plots.style_of("spec-k1")}
for name, case in cases.items():
    st = styles[name]
    ax.plot(grid, [formula(case, a) for a in grid], color=st["color"], ls=st.get("ls", "-"), label=f"{name}: formula")
    ax.errorbar(alphas, [measured[name, a][0] for a in alphas], yerr=[measured[name, a][1] for a in alphas],
                fmt="o", color=st["color"], capsize=3, label=f"{name}: measured, {SEEDS} seeds")
ax.axhline(1.0, **plots.style_of("plain-decode"), lw=1)
ax.set_xlabel("acceptance probability α of the first draft (controlled drafter: 1 − corruption)")
ax.set_ylabel("tokens per verify step (mean, 95% interval)")
ax.set_title("Tokens per forward pass vs acceptance probability")
ax.legend(ncol=2, fontsize=7)
plots.save(fig, "ch07-tokens-per-step")
plt.show()

# %% [markdown]
# Takeaway: the measured means sit on the formulas within their intervals; a long
# chain pays only when acceptance is high and stays high with depth (at α = 0.75, eight
# drafts give 3.70 tokens per step, but only 2.53 when α decays by 0.8 a depth); the
# 10-node tree (2, 2, 1) beats the 4-deep chain up to α = 0.75, but not at 0.9, where a
# deeper guess is worth more than a wider one.

# %% [markdown]
# ## Sampling, not only greedy
#
# <a id="term-speculative-sampling"></a>With temperature > 0 a token is drawn, not chosen.
# **Speculative sampling** (Leviathan et al., Chen et al.;
# [speculative-sampling](references.md#speculative-sampling)) keeps the target's distribution: a draft x drawn from the drafter's q is accepted with
# probability min(1, p(x)/q(x)); at the first rejection the token is drawn from the residual
# max(0, p − q), renormalised. The rollback is unchanged: it only follows the tokens kept.
#
# In the deep dive the rule passes Pearson's chi-square test (p = 0.945 and 0.809 for the
# first two tokens), and a broken rule that keeps every draft fails with p = 0.
#
# ### Deep dive: the sampling rule passes a chi-square test

# %%
show_source(sampling.accept_sampled)

# %% [markdown]
# The target is `tiny`, the drafter the 2-layer model (far from the target: the
# total-variation distance between their next-token distributions is printed below). From
# tables of p and q after the prompt and after every possible first token, we draw the
# first two output tokens of speculative sampling many times (seeded) and test them
# against the target's exact distributions; a broken rule that keeps every draft must fail
# the same test.

# %%
T = 0.5


def next_token_tables(m):
    c = m.new_cache()
    first = sampling.softmax(m.prefill(prompt, c)[-1], T)
    second = np.stack([sampling.softmax(m.decode(x, c.clone()), T) for x in range(tiny.vocab_size)])
    return first, second


(p1, p2), (q1, q2) = next_token_tables(model), next_token_tables(draft_model)
DRAWS = 4_000


def keep_every_draft(drafts, q, p, rng):
    return len(drafts), int(rng.choice(p.shape[1], p=p[len(drafts)]))


print(f"temperature {T}; total variation between target and drafter, first token: {0.5 * np.abs(p1 - q1).sum():.3f}")
rows = []
for rule_name, rule in (("min(1, p/q) + residual", sampling.accept_sampled), ("keep every draft (wrong)", keep_every_draft)):
    draws = sampling.first_tokens(p1, q1, p2, q2, DRAWS, seed=0, rule=rule)
    for which, probs in ((0, p1), (1, p1 @ p2)):
        rows.append((rule_name, which + 1, *sampling.chi_square(draws[:, which], probs)))
show_table(rows, ["rule", "token", "chi-square", "degrees of freedom", "p"],
           formats={"chi-square": ".1f", "p": ".3g"}, title=f"{DRAWS:,} seeded draws")

# %% [markdown]
# The rule passes (p-values far from 0; the tests require p > 0.001 with a fixed seed, so
# the check is not flaky) and the broken rule fails by orders of magnitude: it samples the
# drafter's distribution, not the target's.

# %% [markdown]
# ## What snapshots cost at 48B, per GPU
#
# One checkpoint of Kimi-Linear-48B (20 KDA states of `32 × 128 × 128` numbers in fp32
# plus their conv states in bf16) is 43.42 MB. What one GPU holds depends on the
# deployment. Under vLLM's default `--tensor-parallel-size 4` (TP4) each GPU holds a quarter
# of every state, while MLA's latent KV is replicated on all four. Under DP-attention each
# GPU runs whole requests and holds their whole states:

# %%
ks = np.arange(1, 9)
own = {dep.name: {L: costs.request_total_bytes(CFG, dep, L) / 1e6 for L in (4096, 32768)} for dep in (TP4, DP4)}
snap = {dep.name: {s: np.array([spec_costs.rollback_bytes(CFG, dep, s, int(k)) for k in ks]) / 1e6
                   for s in ("snapshot", "slot")} for dep in (TP4, DP4)}

# %%
fig, ax = plt.subplots()
for dep, ls in ((TP4, "-"), (DP4, "--")):
    for s in ("snapshot", "slot"):
        st = plots.style_of(s)
        ax.plot(ks, snap[dep.name][s], marker="o", ls=ls, color=st["color"], label=f"{st['label']}, {dep.name}")
    ax.axhline(own[dep.name][32768], color=plots.color("kv-cache"), ls=ls, lw=1,
               label=f"the request's own cache at 32K tokens, {dep.name}")
ax.set_xlabel("draft tokens per verify step, k")
ax.set_ylabel("bytes per request on one GPU (MB)")
ax.set_ylim(0, None)
ax.set_title("Kimi-Linear-48B: snapshot memory of one verify step, per GPU")
ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
plots.save(fig, "ch07-snapshot-memory")
plt.show()

# %% [markdown]
# Takeaway: the regime decides. Under the default TP4 deployment, copy-back snapshots
# at k = 8 take 97.7 MB per GPU against 275.1 MB for a 32K-token request's own cache
# (the replicated MLA latent dominates it); under DP-attention each GPU holds whole
# states, and 390.8 MB of snapshots outweigh the request's 307.7 MB. At k = 4 they cost a
# 32K request 16% of the batch under TP4 and 41% under DP-attention. The verdict is
# byte-driven: it holds for either design on both deployments, and slot selection only
# trims it (14% and 36%). The deep dive has the table behind the plot.

# %% [markdown]
# ### Deep dive: the snapshot table and the batch it costs
#
# The bytes behind the plot, per request and GPU, and how many 32K-token requests still fit
# in a GPU's cache budget when each carries the snapshots of a k = 4 verify:

# %%
deployments, designs = [], []
for dep in (TP4, DP4):
    deployments.append((dep.name, costs.checkpoint_bytes(CFG, dep) / 1e6, costs.kv_bytes_per_token(CFG, dep),
                        own[dep.name][32768]))
    plain = costs.max_batch(CFG, dep, 32768)
    for s in ("snapshot", "slot"):
        per = costs.request_total_bytes(CFG, dep, 32768) + spec_costs.rollback_bytes(CFG, dep, s, 4)
        fit = int(costs.cache_budget_bytes(CFG, dep) // per) * (1 if dep.attention == "tp" else dep.n_devices)
        designs.append((dep.name, "copy-back" if s == "snapshot" else "slot", *snap[dep.name][s][[0, 1, 3, 7]],
                        plain, fit, 1 - fit / plain))
display(show_table(deployments, ["deployment", "checkpoint MB", "KV B/token", "32K request MB"],
                   formats={"checkpoint MB": ".2f", "32K request MB": ".1f"}, title="per GPU"))
show_table(designs, ["deployment", "design", "k=1", "k=2", "k=4", "k=8", "fit plain", "fit k=4", "fewer"],
           formats={"k=1": ".1f", "k=2": ".1f", "k=4": ".1f", "k=8": ".1f", "fewer": ".0%"},
           title="snapshot MB per request and GPU; 32K-token requests that fit")

# %% [markdown]
# ## Summary
#
# - Built: a speculative loop that verifies k drafts in one pass and keeps the longest run
#   the target agrees with, so the output is the target's greedy text whatever the drafter.
# - A KV cache undoes rejected drafts by forgetting rows; a KDA state has absorbed them.
#   Keeping the verified state (a KV-only trim) made 21 of 24 tokens differ, silently.
# - The verify leaves the committed state intact. A state per verified position then undoes
#   any rejection: copy-back moves 8 states a step at k = 4, slot selection 6 and holds one
#   state fewer. Both are exact for every drafter, paged or not, and on token trees.
# - The acceptance probability α (a drafter's, per position) is not the accepted fraction
#   (a run's); tokens per step follow 1 + α + … + α^k, 3.70 at α = 0.75 and k = 8.
# - At 48B the snapshot memory per GPU depends on the deployment: 97.7 MB against a 32K
#   request's 275.1 MB under TP4, 390.8 MB against 307.7 MB under DP-attention.
#
# **Next chapter:** can a rollback keep the committed state and a much smaller record per
# token instead of whole states, and then stop writing the state at all?

# %% [markdown]
# ## Exercises
#
# Each checked exercise is a question, a cell for your answer (empty in the student
# edition) and `verify("N.M", answer)`. Open exercises follow.
#
# **7.1 Snapshot memory per GPU at k = 4.** How many MB (1e6 bytes) of copy-back
# snapshots does one Kimi-Linear-48B request keep on one GPU of the default deployment for
# one verify step with k = 4 drafts? Use `costs.checkpoint_bytes(CFG, TP4)`.

# %% tags=["solution"]
answer = 5 * costs.checkpoint_bytes(CFG, TP4) / 1e6  # the last committed token + 4 drafts, one state each

# %%
verify("7.1", answer)

# %% [markdown]
# **7.2 Tokens per step (predict, then run).** With acceptance probability α = 0.7 at every
# depth and k = 4 drafts, how many tokens does one verify step yield on average? First write
# down a prediction: more or fewer than 1 + 4 · 0.7 = 3.8, and why? Then compute it.

# %% tags=["solution"]
a = 0.7
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
# **7.4 From a measured fraction to α.** A run at k = 4 reports an accepted fraction of
# 0.45. Assuming a constant acceptance probability α, what is α? (The fraction rises with
# α, so any root-finding on [0, 1] will do.)

# %% tags=["solution"]
lo, hi = 0.0, 1.0
for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if spec_costs.accepted_fraction(mid, 4) < 0.45 else (lo, mid)
answer = (lo + hi) / 2

# %%
verify("7.4", answer)

# %% [markdown]
# **7.5 One state fewer (predict, then count).** Per request, how many more states does slot
# selection hold than copy-back, for the same k (the request's own state included)? Write
# down your prediction first (more, fewer, or the same?), then count from the two designs.
# A negative number means fewer.

# %% tags=["solution"]
k = 4
answer = (k + 1) - (1 + (k + 1))  # slots 0..k (slot 0 is the request's own) vs own + k+1 scratch

# %%
verify("7.5", answer)

# %% [markdown]
# **7.6 (open, ~30 min) When is the trim right?** Run `spec.speculative_generate(model,
# prompt, N_NEW, controlled.with_corruption(c), 4, "none")` for c in 0.0, 0.5 and 1.0. For
# which c does the output still equal `greedy`, and why? Is the *cache* also right at the
# end?
#
# **7.7 (open, ~1.5 h) A better drafter, chain or tree.** Build a draft model with the
# target's seed and a shorter `layer_pattern`, and copy `weights["embed"]`, `final_norm` and
# `lm_head` from the target. Does the accepted fraction rise above the random 2-layer
# model's? Is the output still exact? Does `DraftModelDrafter.propose_tree` with widths
# (3, 2) help? Then, for 10 draft nodes, which shape (10,), (5, 1), (2, 4), (2, 2, 1) or
# (1,) * 10 yields the most tokens per step at α = 0.5, 0.75 and 0.9? Use
# `spec_costs.expected_tokens_per_step_tree`, and check one with
# `ControlledDrafter.emitted_per_step` over 20 seeds.
