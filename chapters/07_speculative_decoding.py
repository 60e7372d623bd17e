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
# (`kimilab.speculative.speculative_generate`): a cheap *drafter* guesses the next tokens
# — a chain of k, or a tree of alternatives — the target model checks all of them in one
# forward pass, and the longest agreeing path is kept. Then the first two exact ways to
# undo the rejected guesses in a KDA layer, both keeping a state per draft position as
# production engines do: SGLang's **copy-back** and vLLM's **slot selection**.
#
# **What you'll learn.**
# - Why rejecting a draft is free for a KV cache (forget the rows) and impossible for a
#   KDA state (it has already absorbed them), shown by running the loop *without* a
#   rollback and watching the text drift away from greedy decoding.
# - The two snapshot designs, and what separates them: copying the accepted state back
#   moves k+4 states a step, selecting its slot moves k+2 and keeps one state fewer.
# - Token trees: verifying several candidate continuations in one pass with an ancestor
#   mask, exactly.
# - Two notions of acceptance, kept apart: the per-position acceptance *probability* α a
#   drafter has, and the accepted *fraction* a run measures; a drafter whose α decays with
#   depth; tokens per step measured over 50 seeds with error bars.
# - That sampling (not only greedy) verification keeps the target's distribution: a
#   chi-square test on the reduced model.
# - What snapshots cost at Kimi-Linear-48B sizes **per GPU**, and why the answer depends on
#   the deployment (tensor-parallel attention or DP-attention).
#
# **What you'll need.** Chapter 3 (the model, its cache protocol and `truncate`) and
# chapter 4 (the page pool). Everything runs on the reduced, *untrained* `tiny` model;
# bytes at 48B come from `kimilab.costs` on named deployments. Chapter 8 builds the
# cheaper rollbacks.

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
from kimilab.speculative import sampling
from kimilab.tokenizer import ByteTokenizer

plots.use_style()
CFG = kimi_linear_48b
TP4, DP4 = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200
model = Model(tiny, seed=0)
tok = ByteTokenizer()
prompt = tok.encode("the state absorbs every token; the state absorbs every draft; the state ")
N_NEW = 24
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
# ## Drafters behind one interface
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
    r = spec.speculative_generate(model, prompt, 12, drafter, k=4, rollback="slot")
    print(f"{name:<24s} accepted fraction {r.accepted_fraction:.3f}  tokens per verify {r.tokens_per_step:.2f}  "
          f"same as greedy: {r.tokens == greedy[:12]}")

# %% [markdown]
# Both are exact (the output is the greedy text) and both are useless here: a random
# model's next token is nearly unpredictable, from its own past text or from another
# random model. A trained target with a trained drafter accepts a large share of the
# drafts; how large depends on the task, which we cannot measure with these weights.
#
# So the book uses a third drafter, clearly a **test instrument**: the
# `ControlledDrafter` knows the target's own greedy continuation and guesses it right with
# a chosen probability. Its draws depend only on (seed, position, depth), so a run is
# reproducible.

# %% [markdown]
# ## Two names for acceptance
#
# "Acceptance rate" is used for two different things; this book gives each its own name.
#
# - The **acceptance probability** α_d: the chance that the draft at depth d (1 = the
#   first draft of a step) is accepted, given that every draft before it was. A drafter
#   *has* it. Real drafters are better near the root: α_d falls with depth, as a draft
#   conditions on more of its own guesses. The controlled drafter takes
#   α_d = (1 − corruption) · decay^(d − 1).
# - The **accepted fraction**: accepted drafts / proposed drafts, what a run *measures*
#   (`SpecResult.accepted_fraction`).
#
# They are not the same number. With a constant α a step yields
# 1 + α + α² + … + α^k tokens, so the accepted fraction is (α + … + α^k) / k, well
# below α for long chains:

# %%
show_source(spec_costs.accepted_fraction)

# %%
for a in (0.5, 0.8, 0.95):
    print(f"alpha {a:.2f}: accepted fraction at k = 1, 4, 8: "
          + ", ".join(f"{spec_costs.accepted_fraction(a, k):.3f}" for k in (1, 4, 8))
          + f"; an accepted fraction of 0.5 at k = 4 means alpha = {spec_costs.alpha_from_accepted_fraction(0.5, 4):.3f}"
          * (a == 0.5))
controlled = spec.ControlledDrafter(model, prompt, N_NEW + 10, corruption=0.3, seed=7)
decaying = controlled.with_corruption(0.1, decay=0.8)
print("alpha by depth 1..6, decay 0.8:", " ".join(f"{decaying.alpha(d):.3f}" for d in range(1, 7)))
print("reference = greedy:", controlled.reference[:N_NEW] == greedy)

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
      f"of {N_NEW} tokens differ; accepted fraction {trim.accepted_fraction:.3f}")

# %% [markdown]
# The first steps agree: until a draft is rejected, the kept state is the right one.
# After the first rejection the KDA states carry tokens that are not in the text, every
# later logit is computed from them, and the output drifts away for good (and with it
# the accepted fraction, since the controlled drafter keeps proposing the true greedy
# text). Nothing raised an error.

# %% [markdown]
# ## Fix 1: a snapshot per position, copied back (SGLang)
#
# SGLang's verify kernel writes the state after every draft position into an
# intermediate buffer; after acceptance the accepted one is copied into the request's
# state ([sglang](references.md#sglang)). `SnapshotRollback` does this with every KDA and conv
# state after each of the k+1 verified positions, written to `"scratch"` pages of the
# page pool and freed after the step. A step moves k+4 states through memory: the verify
# reads the committed one and writes k+1, the copy-back reads one and writes it home.
#
# One honest difference: a GPU verify kernel writes these states as it passes each
# position. Our verify is the chunked kernel, which only yields the last state, so
# `save` recomputes the per-position states from the committed state and the inputs the
# verify captured — the same arithmetic as decoding.
#
# Two strategies of this book fill scratch slots at every verify and free them after
# the rollback: snapshots here, replay records in chapter 8. What they share is one
# class; each says only what a slot holds (`_layout`, `_arrays`) and how it restores.

# %%
show_source(spec.StepSlotsRollback)

# %%
show_source(spec.SnapshotRollback)

# %% [markdown]
# ## Fix 2: select the slot, copy nothing (vLLM)
#
# vLLM's recurrent kernels do without the copy (`fla/ops/fused_recurrent.py`, reached for
# KDA from `fla/ops/kda.py` with `IS_KDA=True`; [vllm-fused-recurrent](references.md#vllm-fused-recurrent)). Each
# request owns a row of state slots. A verify *reads* its initial state from slot
# `num_accepted_tokens − 1` — the state after the last token the previous step accepted —
# and *writes* the state after its position t to slot t. Acceptance only records which
# slot is live. The request's own state is one of the slots, so a request holds k+1
# states in all (copy-back: k+2), and a step moves k+2 (read one, write k+1).
#
# `SlotRollback` does the same with the cache protocol: slot 0 is the request's own
# state, slots 1..k are scratch pages held for the whole request. While the live slot is
# not 0 the cache's own state is stale, so the strategy shows the model a view whose
# states are the live slot's (`current`), and copies the live slot home once, when the
# request ends (`finish`).

# %%
show_source(spec.SlotRollback)

# %% [markdown]
# The loop ties it together. The cache always holds every emitted token but the last,
# as `Model.generate` leaves it. Each step asks the strategy for the request as the model
# must see it, verifies, lets the strategy save, accepts, and restores the cache to the
# committed position plus the tokens kept, through the protocol's `truncate(n, checkpoint)`.
# A window may also run past `max_new_tokens`; then fewer tokens are kept than were
# accepted, and the same rollback handles it.

# %%
show_source(spec.speculative_generate, lines=(36, 72))

# %% [markdown]
# ## Exact, for every drafter, on the page pool too
#
# The check the tests run under hypothesis, here once per drafter and snapshot design:
# the tokens equal greedy decoding, and after every step the KDA and conv states equal
# those of a plain decode run at the same position (float64). The controlled drafter's
# runs use a `PagedHybridCache`: the snapshots then come out of the request's own pool as
# pages of kind `"scratch"` — copy-back's for one step, slot selection's for the whole
# request — and the pool's invariants are checked after every step. The last column is
# the bytes each step moved, in states (the strategy counts them as it runs).

# %%
# `GreedyReference` decodes the prompt one token at a time and keeps the KDA and conv states at
# every length; `state_error(cache)` is the largest difference from them at the cache's length.
reference = spec.GreedyReference(model, prompt, N_NEW)  # plain decoding, its states kept per length
print("reference tokens = greedy:", reference.tokens == greedy)
state_error = reference.state_error
STATE = costs.checkpoint_bytes(tiny, costs.LOCAL)
drafters = {"n-gram lookup": real_drafters["n-gram lookup"], "controlled 0.5 (paged)": controlled.with_corruption(0.5),
            "controlled 1.0": controlled.with_corruption(1.0)}
print(f"{'drafter':<23s} {'rollback':<9s} {'steps':>5s} {'accepted':>8s} {'same tokens':>11s} "
      f"{'states <= 1e-10':>15s} {'states moved/step':>17s}")
for name, drafter in drafters.items():
    for rollback in ("snapshot", "slot"):
        pool = PagePool(1200, 4096) if "paged" in name else None
        cache = PagedHybridCache(tiny, pool, block_tokens=16) if pool else HybridCache(tiny)
        errors = []

        def check(c, s):
            errors.append(state_error(c))
            if pool is not None:
                pool.check_invariants()

        r = spec.speculative_generate(model, prompt, N_NEW, drafter, k=4, rollback=rollback, cache=cache,
                                      on_step=check)
        moved = sorted({s.moved_bytes / STATE for s in r.steps})
        print(f"{name:<23s} {rollback:<9s} {len(r.steps):5d} {r.accepted_fraction:8.3f} {str(r.tokens == greedy):>11s} "
              f"{str(max(errors) <= 1e-10):>15s} {', '.join(f'{m:g}' for m in moved):>17s}")
        if pool is not None:
            pages = spec.make_rollback(rollback, model, None, 4).scratch_pages(4096)
            print(f"{'':<23s} scratch during a step {r.peak_rollback_bytes:,d} B ({pages} pages); the request "
                  f"itself {cache.n_pages} pages; scratch pages after the run: {pool.stats().pages_by_kind['scratch']}")
            cache.free()
            pool.check_invariants()

# %% [markdown]
# Corruption 1.0 proposes garbage at every position: every step keeps one token, as
# plain decoding would, and the output is still exact. At k = 4 copy-back moves 8 states
# a step and slot selection 6, whatever is accepted (when the n-gram lookup finds nothing
# to propose, a step verifies one position and moves 4 and 2). On the tiny model the
# snapshots of one step take more pages than the whole request's KV and states.

# %% [markdown]
# ## Token trees
#
# A chain bets everything on one guess per position. A **tree** hedges: at each node
# several candidate next tokens, each continued by its own guesses (the static trees of
# Medusa and EAGLE). The target checks every node in one pass; acceptance walks down from
# the root, following at each node the child whose token equals the target's choice.
# `DraftTree.shape(widths)` builds a full tree with `widths[d]` children per node at depth
# d; node 0 of the verify window is the last committed token.
#
# What changes in the verify is only *who precedes whom*: a node's past is its root
# path, not the window positions before it. The verify applies that **ancestor mask**
# in every place the model looks back: the short conv (a node convolves over its
# ancestors' inputs), global attention (a node attends to the committed keys and its
# ancestors), and KDA, whose chunked form needs two substitutions — the cumulative gate
# runs along the root path, and "earlier in the chunk" becomes "an ancestor"
# ([sglang-tree-verify](references.md#sglang-tree-verify)). Cross-branch terms of the chunk's triangular
# solve then vanish, so on every root-to-leaf path the result is that path's chain.

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
      f"largest logit difference {worst:.1e}")
print("accepted path and next token:", spec.greedy_accept_tree(window_tokens, win, tree_logits))

# %% [markdown]
# A snapshot strategy keeps a state per *node* (vLLM's `IS_EAGLE_TREE` kernel starts each
# node from its parent's slot), so a tree of 10 nodes keeps 11 states where a chain of 3
# keeps 4. Both designs stay exact on trees, and the tree yields more tokens per step:

# %%
half = controlled.with_corruption(0.5)
for rollback in ("snapshot", "slot"):
    errors = []
    r = spec.speculative_generate(model, prompt, N_NEW, half, k=3, rollback=rollback, tree=widths,
                                  on_step=lambda c, s: errors.append(state_error(c)))
    chain = half.emitted_per_step(N_NEW, 3)
    print(f"{rollback:<9s} tree {widths}: {r.steps[0].drafted} nodes, tokens/step {r.tokens_per_step:.2f} "
          f"(the chain of 3 with the same drafter: {np.mean(chain):.2f}); same tokens {r.tokens == greedy}; "
          f"states <= 1e-10 {max(errors) <= 1e-10}; scratch {r.peak_rollback_bytes // STATE} states")

# %% [markdown]
# ## Tokens per step, over many seeds
#
# What speculation buys is tokens per forward pass: 1 + Σ_d Π_{e ≤ d} α_e on a chain, and
# on a tree each depth's factor becomes 1 − (1 − α_e)^w_e, the chance that one of w
# children is right. A single run is one draw of a noisy count — 24 tokens are a dozen
# steps — so every measured point below is the mean of 50 seeds, with a 95% interval
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


print(f"{SEEDS} seeds x {SWEEP_NEW} tokens; measured mean +- 95% interval / formula")
print(f"{'alpha':>5s}  " + "  ".join(f"{name:>22s}" for name in cases))
for a in alphas:
    print(f"{a:5.2f}  " + "  ".join(f"{measured[n, a][0]:5.2f} +- {measured[n, a][1]:4.2f} / {formula(c, a):5.2f}"
                                   for n, c in cases.items()))

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
# With temperature > 0 a token is drawn, not chosen, and "equal to the target's argmax"
# no longer makes sense. The rule of Leviathan et al. and Chen et al.
# ([speculative-sampling](references.md#speculative-sampling)) keeps the output distributed exactly as
# the target's own samples: a draft x drawn from the drafter's q is accepted with
# probability min(1, p(x)/q(x)); at the first rejection the token is drawn from the
# residual max(0, p − q), renormalised. The rollback is the same as for greedy
# verification: it only follows the tokens kept.

# %%
show_source(sampling.accept_sampled)

# %% [markdown]
# The check, on the reduced model: the target is `tiny`, the drafter the 2-layer model
# (far from the target: the total-variation distance between their next-token
# distributions is printed below). From tables of p and q after the prompt and after
# every possible first token, we draw the first two output tokens of speculative
# sampling many times (seeded) and test them against the target's exact distributions
# with Pearson's chi-square; a broken rule that keeps every draft must fail the same test.

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
for rule_name, rule in (("min(1, p/q) + residual", sampling.accept_sampled), ("keep every draft (wrong)", keep_every_draft)):
    draws = sampling.first_tokens(p1, q1, p2, q2, DRAWS, seed=0, rule=rule)
    for which, probs in ((0, p1), (1, p1 @ p2)):
        stat, df, pval = sampling.chi_square(draws[:, which], probs)
        print(f"{rule_name:<26s} token {which + 1}: chi-square {stat:9.1f} on {df} degrees of freedom, p = {pval:.3g}")

# %% [markdown]
# The rule passes (p-values far from 0; the tests require p > 0.001 with a fixed seed, so
# the check is not flaky) and the broken rule fails by orders of magnitude: it samples the
# drafter's distribution, not the target's.

# %% [markdown]
# ## What snapshots cost at 48B, per GPU
#
# One checkpoint of Kimi-Linear-48B — 20 KDA states of `32 × 128 × 128` numbers in fp32
# plus their conv states in bf16 — is 43.4 MB for the whole model. What one GPU holds
# depends on the deployment. Under vLLM's recipe (`--tensor-parallel-size 4`, the default
# deployment) the KDA heads are split over the four GPUs, so each holds a quarter of every
# state, while MLA's latent KV is replicated on all of them. Under DP-attention each GPU
# runs whole requests and holds their whole states:

# %%
ks = np.arange(1, 9)
print(f"{'deployment':<16s} {'checkpoint':>10s} {'KV/token':>9s} {'32K request':>11s}   snapshot bytes per request "
      f"at k = 1, 2, 4, 8 (MB per GPU)")
own, snap = {}, {}
for dep in (TP4, DP4):
    own[dep.name] = {L: costs.request_total_bytes(CFG, dep, L) / 1e6 for L in (4096, 32768)}
    snap[dep.name] = {s: np.array([spec_costs.rollback_bytes(CFG, dep, s, int(k)) for k in ks]) / 1e6
                      for s in ("snapshot", "slot")}
    print(f"{dep.name:<16s} {costs.checkpoint_bytes(CFG, dep) / 1e6:7.2f} MB {costs.kv_bytes_per_token(CFG, dep):7,d} B "
          f"{own[dep.name][32768]:8.1f} MB   copy-back "
          + " ".join(f"{snap[dep.name]['snapshot'][k - 1]:5.1f}" for k in (1, 2, 4, 8))
          + " | slot " + " ".join(f"{snap[dep.name]['slot'][k - 1]:5.1f}" for k in (1, 2, 4, 8)))
for dep in (TP4, DP4):
    plain = costs.max_batch(CFG, dep, 32768)
    budget = costs.cache_budget_bytes(CFG, dep) * (1 if dep.attention == "tp" else dep.n_devices)
    for s in ("snapshot", "slot"):
        per = costs.request_total_bytes(CFG, dep, 32768) + spec_costs.rollback_bytes(CFG, dep, s, 4)
        fit = int(costs.cache_budget_bytes(CFG, dep) // per) * (1 if dep.attention == "tp" else dep.n_devices)
        print(f"{dep.name}: 32K-token requests that fit: {plain} plain, {fit} with {s} at k = 4 "
              f"({1 - fit / plain:.0%} fewer)")

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
# 32K request 16% of the batch under TP4 and 41% under DP-attention.

# %% [markdown]
# ## What breaks token equality in production
#
# "Equal to greedy decoding, token for token" holds here because every path computes in
# float64, where the chunked verify, the token-by-token decode and a replay agree to
# ~1e-15 and no argmax is ever close enough to flip. Production kernels compute in bf16
# (states in fp32), and there the same function computed two ways rounds differently:
# a verify of k+1 tokens runs a chunked kernel whose reduction order differs from the
# one-token decode kernel; matmul tiling, split-K and the order of a sum depend on the
# batch's shape (how many requests, how many tokens each); and a recurrent state
# accumulates these differences over thousands of tokens. When the top two logits are
# within rounding of each other, speculative and plain greedy decoding pick different
# tokens, and from there the texts diverge — both correct to within the model's own
# precision, neither "wrong". So serving engines test speculative decoding by its
# acceptance length and by logprob closeness, not by token identity (vLLM checks
# logprobs, and its ReplaySSM port reports an acceptance-length match
# ([vllm-rfc-47572](references.md#vllm-rfc-47572))); and a lazy state that is folded in a
# different order than it was built must be checked the same way (SGLang's ReplaySSM port
# had to fix a long-output degeneration with an exact fold;
# [sglang-28695](references.md#sglang-28695)). Exactness in this book is the float64 statement:
# the mechanism computes the same function.

# %% [markdown]
# ## Summary
#
# - Speculative decoding verifies drafts in one forward pass and keeps the longest path
#   the target agrees with; with greedy acceptance the output is the target's greedy text
#   whatever the drafter proposes, and with the min(1, p/q) rule a sampled output keeps
#   the target's distribution (chi-square, above).
# - A KV cache undoes rejected drafts by forgetting rows; a KDA state has absorbed them.
#   Keeping the verified state (a KV-only `trim`, the bug mlx-lm found) makes the text
#   drift silently after the first rejection.
# - The verify leaves the committed state intact (`VerifyView`). Then a state per
#   verified position undoes any rejection: SGLang copies the accepted one back (k+4
#   states moved a step, k+1 held beside the request's), vLLM starts the next verify from
#   the accepted slot (k+2 moved, k held). Both are exact for every drafter, on chains
#   and on token trees, on contiguous and paged caches.
# - A token tree is verified in one pass with an ancestor mask in the conv, the attention
#   and the chunked KDA; every root path equals its chain. Snapshots grow with its nodes.
# - The acceptance probability α (what a drafter has, per position) and the accepted
#   fraction (what a run measures) are different numbers; measured over 50 seeds, tokens
#   per step follow the formula, including a drafter whose α decays with depth.
# - At 48B the snapshot memory per GPU depends on the deployment: a fraction of a 32K
#   request's cache under TP4, more than all of it under DP-attention.
#
# Chapter 8 keeps the committed state and a much smaller record per token instead — and
# then stops writing the state at all.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **7.1 Snapshot memory per GPU at k = 4.** How many MB (1e6 bytes) of copy-back
# snapshots does one Kimi-Linear-48B request keep on one GPU of the default deployment for
# one verify step with k = 4 drafts? Use `costs.checkpoint_bytes(CFG, TP4)`.

# %% tags=["solution"]
answer = 5 * costs.checkpoint_bytes(CFG, TP4) / 1e6  # the last committed token + 4 drafts, one state each

# %%
verify("7.1", answer)

# %% [markdown]
# **7.2 Tokens per step.** With acceptance probability α = 0.7 at every depth and k = 4
# drafts, how many tokens does one verify step yield on average?

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
# **7.5 One state fewer.** Per request, how many more states does slot selection hold than
# copy-back, for the same k (the request's own state included)? A negative number means
# fewer.

# %% tags=["solution"]
k = 4
answer = (k + 1) - (1 + (k + 1))  # slots 0..k (slot 0 is the request's own) vs own + k+1 scratch

# %%
verify("7.5", answer)

# %% [markdown]
# **7.6 (open) When is the trim right?** Run `spec.speculative_generate(model, prompt,
# N_NEW, controlled.with_corruption(c), 4, "none")` for c in 0.0, 0.5 and 1.0. For which
# c does the output still equal `greedy`, and why? Is the *cache* also right at the end?
#
# **7.7 (open) A better draft model.** Give the draft model the target's own weights for
# its first layers (build it with the same seed and a shorter `layer_pattern`, then copy
# `weights["embed"]`, `final_norm` and `lm_head` from the target). Does the accepted
# fraction rise above the 2-layer random model's? Is the output still exact? Try
# `DraftModelDrafter.propose_tree` with widths (3, 2): does a tree help it?
#
# **7.8 (open) A tree's best shape.** For 10 draft nodes, which widths — (10,), (5, 1),
# (2, 4), (2, 2, 1) or (1,) * 10 — yield the most tokens per step at α = 0.5, 0.75 and
# 0.9? Use `spec_costs.expected_tokens_per_step_tree`, then check one with
# `ControlledDrafter.emitted_per_step` over 20 seeds.
