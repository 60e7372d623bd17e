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
# **What you'll build.** Two cheaper exact rollbacks for speculative decoding on a hybrid
# model, exchangeable with chapter 7's snapshots behind one interface:
# **projection replay** (keep the committed state and a small per-token record of the
# projected KDA inputs; after acceptance, replay the kept tokens) and a **ring buffer**
# (the same records in a fixed window of scratch pages reused every step, where the conv
# state's rollback is a pointer move).
#
# **What you'll learn.**
# - What going back needs, derived before building: the state update reads k, v, g and
#   beta, never q; the conv state is a window of raw inputs. At Kimi-Linear-48B sizes
#   a token's record is 20–90 times smaller than a state, depending on what you keep and
#   in which dtype.
# - That replay is exact (equal to greedy decoding, states to 1e-10) for every drafter.
# - What each strategy costs at 48B — bytes per request, replay FLOPs against a full
#   re-verify, rollback time on a roofline — and where replay stops paying.
#
# **What you'll need.** Chapter 7 (the loop, the `VerifyView`, snapshots) and chapter 2
# (the KDA recurrence). The model is the reduced, *untrained* `tiny` model; speeds are
# CPU speeds, labelled; 48B numbers are analytic (`kimilab.costs`).

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
STRATEGIES = ("snapshot", "replay", "ring")
model = Model(tiny, seed=0)
prompt = ByteTokenizer().encode("the state absorbs every token; the state absorbs every draft; the state ")
N_NEW = 32
greedy = model.generate(prompt, N_NEW)
controlled = spec.ControlledDrafter(model, prompt, N_NEW + 8, corruption=0.3, seed=7)
print(f"prompt {len(prompt)} tokens, {N_NEW} greedy tokens; controlled drafter: {controlled!r}")

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
# (replayable without any weight — what `kimilab.spec` stores); or only the raw conv
# inputs plus g and beta, recomputing k and v through the conv; or the gate's low-rank
# input (head_dim numbers per token) instead of g, recomputing the gate too.

# %%
show_source(spec_costs.record_elems_per_layer)

# %%
state_layer = costs.kda_state_bytes_per_layer(CFG) + costs.conv_state_bytes_per_layer(CFG)
print(f"Kimi-Linear-48B, per KDA layer: state + conv state = {state_layer:,d} B "
      f"(KDA state fp32, conv bf16); {len(CFG.kda_layers)} KDA layers")
print(f"{'record keeps':<12s} {'elems/layer':>11s} {'dtype':>6s} {'per token, all layers':>22s} "
      f"{'state / record':>15s} {'k=8: snapshot / replay':>23s}")
snap8 = spec_costs.rollback_bytes(CFG, "snapshot", 8)
for keep in spec_costs.RECORD_KEEPS:
    for act, dtype in ((2, "bf16"), (4, "fp32")):
        rec = spec_costs.record_bytes_per_token(CFG, keep, act)
        print(f"{keep:<12s} {spec_costs.record_elems_per_layer(CFG, keep):11,d} {dtype:>6s} "
              f"{rec / 1e6:18.3f} MB {costs.checkpoint_bytes(CFG) / rec:14.1f}x "
              f"{snap8 / spec_costs.rollback_bytes(CFG, 'replay', 8, keep=keep, act_bytes=act):22.1f}x")

# %% [markdown]
# A 48B state is 32 heads × 128 × 128 numbers per layer; a token's record is a few
# vectors of 32 × 128. With post-conv records in fp32 — about 2 MB per token over 20
# layers against 43 MB per state — the saving is 22.1x, just over 20. Engines keep the
# captured activations in bf16 (the state stays fp32), which doubles it to 44.1x; the
# leaner records reach 87.2x. What the record keeps decides the saving; the state never
# has to be copied at all.

# %% [markdown]
# ## Projection replay
#
# `ReplayRollback.save` writes the k+1 records of the window to scratch pages; the
# committed state is untouched (the verify ran through a `VerifyView`). `restore(keep)`
# runs `keep` recurrent steps from the committed state — the state half of the KDA
# update, no output read — and rebuilds the conv state from the raw inputs. This is the
# approach TensorRT-LLM merged for Mamba-2 ([trtllm-13453](references.md#trtllm-13453)).

# %%
show_source(spec.state_steps)

# %%
show_source(spec.ReplayRollback)

# %% [markdown]
# ## The ring buffer
#
# Replay allocates and frees its records every step. A serving engine prefers memory it
# reserves once per request: `RingRollback` keeps the records in a fixed window of
# `window` ≥ k+1 slots, reused every step, and the raw conv rows in a ring of
# window + kernel − 1 slots that also holds the (kernel − 1) committed rows before the
# window. The conv state after any accepted length is then a slice of that ring: its
# rollback is moving `head`. (Our cache protocol keeps its own copy of the conv state,
# so `restore` still copies the three rows into the cache; a kernel reading the ring
# directly would copy nothing.) A window shorter than k+1 would overwrite records the
# rollback still needs, so it is refused when the strategy is made, and a verify that
# does not fit is refused before anything is written.

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
    logits, captures, view = spec.verify(model, [out[-1]] + drafts, cache)
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
# The ring takes the same pages every step and the head advances by the kept length.

# %% [markdown]
# ## Three strategies, one interface, all exact
#
# `speculative_generate(..., rollback=...)` takes any of them. For every drafter and
# strategy: the same tokens as greedy decoding, the KDA and conv states after each step
# equal to a plain decode run's (float64), and the scratch bytes each step held, next to
# what `kimilab.costs.spec` predicts for the tiny model (float64 everywhere).

# %%
ref_cache = HybridCache(tiny)
model.prefill(prompt, ref_cache)
ref_states = {ref_cache.seq_len: ref_cache.checkpoint()}
for t in greedy[:-1]:
    model.decode(t, ref_cache)
    ref_states[ref_cache.seq_len] = ref_cache.checkpoint()


def state_error(c):
    ref = ref_states[c.seq_len]
    return max(max(np.abs(c.kda_state(i) - ref.kda_states[i]).max(),
                   np.abs(c.conv_state(i) - ref.conv_states[i]).max()) for i in tiny.kda_layers)


drafters = {"n-gram": spec.NgramDrafter(), "controlled 0.0": controlled.with_corruption(0.0),
            "controlled 0.3": controlled, "controlled 1.0": controlled.with_corruption(1.0)}
K = 4
print(f"{'strategy':<9s} {'drafter':<15s} {'same tokens':>11s} {'states <= 1e-10':>16s} "
      f"{'scratch B/step':>15s} {'cost model':>11s}")
for name in STRATEGIES:
    for dname, drafter in drafters.items():
        errors = []
        r = spec.speculative_generate(model, prompt, N_NEW, drafter, K, name,
                                      on_step=lambda c, s: errors.append(state_error(c)))
        print(f"{name:<9s} {dname:<15s} {str(r.tokens == greedy):>11s} {str(max(errors) <= 1e-10):>16s} "
              f"{r.peak_rollback_bytes:15,d} {spec_costs.rollback_bytes(tiny, name, K, act_bytes=8):11,d}")

# %% [markdown]
# The same on a paged cache, with the pool's invariants checked after every step:

# %%
for name in STRATEGIES:
    pool = PagePool(1200, 4096)
    paged = PagedHybridCache(tiny, pool, block_tokens=16)
    r = spec.speculative_generate(model, prompt, N_NEW, controlled, 8, name, paged,
                                  on_step=lambda c, s: pool.check_invariants())
    print(f"{name:<9s} paged: same tokens {r.tokens == greedy}, states <= 1e-10 "
          f"{state_error(paged) <= 1e-10}, scratch pages after the run "
          f"{pool.stats().pages_by_kind['scratch']}, peak scratch {r.peak_rollback_bytes:,d} B")
    paged.free()

# %% [markdown]
# ## Bytes per request at 48B
#
# Per request, for one verify step of k drafts (KDA states fp32, conv state bf16;
# records in bf16 as engines keep activations, and in fp32 for comparison):

# %%
ks = np.arange(1, 9)
mb = {(name, act): np.array([spec_costs.rollback_bytes(CFG, name, int(k), act_bytes=act) for k in ks]) / 1e6
      for name in STRATEGIES for act in (2, 4)}
for k in (1, 4, 8):
    print(f"k={k}: snapshot {mb['snapshot', 2][k - 1]:6.1f} MB | replay {mb['replay', 2][k - 1]:5.2f} MB bf16, "
          f"{mb['replay', 4][k - 1]:5.2f} MB fp32 | ring {mb['ring', 2][k - 1]:5.2f} MB bf16, "
          f"{mb['ring', 4][k - 1]:5.2f} MB fp32")
print(f"k=8 snapshot / replay: {mb['snapshot', 2][-1] / mb['replay', 2][-1]:.1f}x (bf16), "
      f"{mb['snapshot', 2][-1] / mb['replay', 4][-1]:.1f}x (fp32); snapshot / ring: "
      f"{mb['snapshot', 2][-1] / mb['ring', 2][-1]:.1f}x (bf16), {mb['snapshot', 2][-1] / mb['ring', 4][-1]:.1f}x (fp32)")

# %%
fig, ax = plt.subplots()
ax.plot(ks, mb["snapshot", 2], marker="o", **plots.style_of("snapshot"))
for name in ("replay", "ring"):
    style = plots.style_of(name)
    ax.plot(ks, mb[name, 2], marker="o", color=style["color"], label=f"{style['label']} (records bf16)")
    ax.plot(ks, mb[name, 4], marker="o", ls="--", color=style["color"], label=f"{style['label']} (records fp32)")
ax.set_yscale("log")
ax.set_xlabel("draft tokens per verify step, k")
ax.set_ylabel("rollback bytes per request (MB, log scale)")
ax.set_title("Kimi-Linear-48B: what each rollback keeps per request")
ax.legend()
plots.save(fig, "ch08-rollback-bytes")
plt.show()

# %% [markdown]
# Takeaway: replay keeps 22.1x (fp32 records) to 44.1x (bf16) less than snapshots at every
# k; the ring pays for its conv history, most at small k (at k = 8: 18.9x fp32, 37.8x bf16).

# %% [markdown]
# ## Replay FLOPs against a full re-verify
#
# The other way back is recomputation: truncate everything and push the accepted tokens
# through the whole model again. Replay recomputes only the KDA recurrence of the kept
# tokens (the projections were captured), so at a 4K-token context:

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
# CPU time of each strategy's `save` (after the verify) and `restore` (after acceptance)
# on the tiny model, k = 8, by the number of positions kept. Measured on this machine,
# best of five runs: the numbers change from run to run; the shape is the result.

# %%
# NBVAL_IGNORE_OUTPUT
keeps = (1, 3, 5, 7, 9)
timings = {name: spec.rollback_timings(model, name, 8, keeps, repeats=5) for name in STRATEGIES}
for name in STRATEGIES:
    print(f"{name:<9s} restore ms: " + " ".join(f"{1e3 * timings[name][j]['restore']:.2f}" for j in keeps)
          + "   save ms: " + " ".join(f"{1e3 * timings[name][j]['save']:.2f}" for j in keeps))
ratio = np.mean([timings["replay"][j]["restore"] / timings["snapshot"][j]["restore"] for j in keeps])
total = np.mean([sum(timings["replay"][j].values()) / sum(timings["snapshot"][j].values()) for j in keeps])
print(f"replay / snapshot: restore {ratio:.2f}x, save + restore {total:.2f}x (mean over kept lengths)")

# %%
fig, ax = plt.subplots()
for name in STRATEGIES:
    style = plots.style_of(name)
    ax.plot(keeps, [1e3 * timings[name][j]["restore"] for j in keeps], marker="o", color=style["color"],
            label=f"{style['label']}: restore")
    ax.plot(keeps, [1e3 * sum(timings[name][j].values()) for j in keeps], ls="--", color=style["color"],
            label=f"{style['label']}: save + restore")
ax.set_xlabel("positions kept after acceptance (of k+1 = 9)")
ax.set_ylabel("CPU time per step (ms, wall clock)")
ax.set_title("Rollback time on the tiny model (measured, this machine)")
ax.set_ylim(0, None)
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
plots.save(fig, "ch08-rollback-time")
plt.show()

# %% [markdown]
# Takeaway: a snapshot's restore is a flat copy while replay's grows with the kept length;
# but the snapshot pays first, computing and writing nine states every step, so summed
# over save and restore the strategies are of the same order on this CPU, replay ahead
# when few positions are kept. (A GPU verify kernel writes those states as it goes, so
# its snapshot save is only write bandwidth; the 48B roofline below counts exactly that.)

# %% [markdown]
# ## Tokens per second at 48B, including the verify
#
# The cost model of chapter 3, on its assumed hardware (8 H800-class devices,
# tensor-parallel attention, 4K-token context, one request): a step verifies k+1 tokens
# (the prefill roofline — with a mixture of experts, more tokens touch more experts, so
# the verify reads more weights than one decode step), then rolls back; it yields
# (1 − α^(k+1)) / (1 − α) tokens. Drafting is taken as free (an n-gram lookup).

# %%
CTX = 4096
decode_s = costs.prefill_seconds(CFG, 1, CTX)
print(f"one decode step: {1e3 * decode_s:.3f} ms")
for k in (2, 4, 8):
    verify_s = costs.prefill_seconds(CFG, k + 1, CTX)
    snap_s = spec_costs.rollback_seconds(CFG, "snapshot", k, k + 1)
    replay_s = spec_costs.rollback_seconds(CFG, "replay", k, k + 1)
    print(f"k={k}: verify {1e3 * verify_s:.3f} ms ({verify_s / decode_s:.2f}x a decode step); rollback "
          f"snapshot {1e6 * snap_s:5.1f} us ({snap_s / (verify_s + snap_s):.1%} of the step), "
          f"replay {1e6 * replay_s:4.1f} us ({replay_s / (verify_s + replay_s):.1%})")

# %%
grid = np.linspace(0.0, 1.0, 51)
fig, ax = plt.subplots()
ax.axhline(1.0 / decode_s, lw=1, **plots.style_of("plain-decode"))
for k in (2, 4, 8):
    style = plots.style_of(f"spec-k{k}")
    for name, ls in (("replay", "-"), ("snapshot", ":")):
        tps = [spec_costs.spec_tokens_per_second(CFG, CTX, k, a, name) for a in grid]
        ax.plot(grid, tps, ls=ls, color=style["color"], label=f"{style['label']}, {name}")
ax.set_xlabel("draft acceptance rate α")
ax.set_ylabel("tokens per second, one request (roofline)")
ax.set_title("Kimi-Linear-48B at 4K context: speculative vs plain decoding")
ax.legend(ncol=2, fontsize=8)
plots.save(fig, "ch08-tokens-per-second")
plt.show()
for k in (2, 4, 8):
    even = next(a for a in grid if spec_costs.spec_tokens_per_second(CFG, CTX, k, a) >= 1.0 / decode_s)
    print(f"k={k}: speculation beats plain decoding from alpha = {even:.2f}; at alpha = 1: "
          f"{spec_costs.spec_tokens_per_second(CFG, CTX, k, 1.0) * decode_s:.2f}x")

# %% [markdown]
# Takeaway: on this roofline the rollback strategy hardly moves tokens per second (the
# dotted and solid lines overlap); what decides is acceptance, and the verify's growing
# expert reads make long windows pay only near α = 1. The rollback's real price at 48B
# is memory — the batch it displaces — not time.
#
# A measured profile disagrees on time. On vLLM-metal, at one draft token, 19.3% of a speculative step went to rejection trim/restore/replay against 69.0% to verification ([vllm-metal-610](references.md#vllm-metal-610)).
# Our roofline puts any rollback at a few percent of a step
# (printed above), so such overheads come from the implementation (kernel launches,
# host-side copies, small ops), not from the bytes or FLOPs a rollback must move.

# %% [markdown]
# ## Where replay stops paying
#
# Replay trades bytes for recomputation: a snapshot's cost is fixed (write k+1 states,
# copy one back), replay's grows with the kept length j. On the roofline at 48B the
# replay is so cheap that it always wins — *if* the replay kernel runs at a fair
# fraction of peak. A token-by-token recurrence is latency-bound, so we vary that
# assumed efficiency (`costs.spec.REPLAY_EFFICIENCY` is 5%):

# %%
print(f"{'replay efficiency':>17s}  " + " ".join(f"j={j:<5d}" for j in range(1, 10)) + "  replay/snapshot time")
for eff in (0.05, 0.005, 0.002, 0.001):
    r = [spec_costs.rollback_seconds(CFG, "replay", 8, j, efficiency=eff)
         / spec_costs.rollback_seconds(CFG, "snapshot", 8, j) for j in range(1, 10)]
    cross = next((j for j, x in enumerate(r, 1) if x > 1), None)
    print(f"{eff:17.3f}  " + " ".join(f"{x:7.2f}" for x in r) + f"  first j where snapshot wins: {cross}")

# %% [markdown]
# And memory: the saving is the state-to-record ratio, so it shrinks with the state.
# Keeping everything else at 48B shapes and shrinking the head dimension (the state per
# head is head_dim², a record is linear in it):

# %%
print(f"{'head_dim':>8s} {'state+conv / layer':>19s} {'record / layer (bf16)':>22s} {'k=8 snapshot / replay':>22s}")
for hd in (16, 32, 64, 128, 256):
    c = CFG.with_(head_dim=hd)
    s = costs.kda_state_bytes_per_layer(c) + costs.conv_state_bytes_per_layer(c)
    rec = spec_costs.record_bytes_per_token(c) // len(c.kda_layers)
    print(f"{hd:8d} {s:17,d} B {rec:20,d} B {spec_costs.rollback_bytes(c, 'snapshot', 8) / spec_costs.rollback_bytes(c, 'replay', 8):21.1f}x")

# %% [markdown]
# So replay stops paying where the state is small and the kept length long: with
# head_dim 16 the bytes saved fall to single digits, and if the replay kernel runs at
# 0.2% of peak or less, a snapshot's copy beats replaying four or more positions.
# Chapter 12 collects this crossover with the others.

# %% [markdown]
# ## Against the production systems
#
# - **vLLM, SGLang** keep one state per draft position (chapter 7's `snapshot`):
#   simple, a rollback is choosing (vLLM's TPU runner) or copying back (SGLang), and the
#   memory is k+1 states per request ([vllm](references.md#vllm), [sglang](references.md#sglang)).
# - **TensorRT-LLM** merged a replay method for Mamba-2: keep the committed state,
#   recompute the accepted steps — our `replay` ([trtllm-13453](references.md#trtllm-13453)).
# - **Megatron-LM** proposed a factorised exact rollback: checkpoint rank-1 factors per
#   draft token and apply the accepted ones in one matmul ([megatron-5803](references.md#megatron-5803)). Our record holds
#   those factors (k, v, g, beta); we apply them as a loop, they as one product.
# - **mlx-lm** replaced a `trim()` that corrupted recurrent caches with an exact rollback
#   cache API ([mlx-lm-1486](references.md#mlx-lm-1486)) — chapter 7's failure, and why every strategy here
#   goes through `truncate(n, checkpoint)`.

# %% [markdown]
# ## Summary
#
# - Going back needs only what the state update reads: k, v, g, beta per token (never
#   q) and the raw conv inputs. At 48B a post-conv record is 22.1x smaller than a state in
#   fp32 and 44.1x in bf16; keeping only raw inputs or the low-rank gate input goes
#   further (up to 87.2x).
# - `ReplayRollback` keeps the committed state and k+1 records and replays the kept
#   tokens; `RingRollback` keeps them in a fixed window reused every step, the conv
#   state a pointer into a ring, and refuses a window smaller than k+1. Both are exact —
#   tokens equal greedy, states within 1e-10 — for every drafter, on contiguous and
#   paged caches, with no scratch page leaked.
# - At 48B and k = 8 a request keeps 8.86 MB (replay) or 10.33 MB (ring) instead of
#   390.8 MB of snapshots; replay FLOPs are about 1% of re-verifying the kept tokens.
# - On the roofline, rollback time is a few percent of a verify step for any strategy;
#   the speed of speculation is decided by acceptance and by the verify's expert reads.
#   Replay stops paying only for small states and a replay kernel far below peak.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **8.1 A leaner record.** How many bytes per token (all 20 KDA layers) does a `"raw"`
# record — raw conv inputs, g and beta; k and v recomputed through the conv — take at
# 48B in bf16? Count it from the shapes.

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
# KDA layers? (`kda.recurrent_kda_flops` counts one layer.)

# %% tags=["solution"]
from kimilab import kda

answer = len(CFG.kda_layers) * kda.recurrent_kda_flops(5, CFG.n_heads, CFG.head_dim, CFG.head_dim) / 1e9

# %%
verify("8.3", answer)

# %% [markdown]
# **8.4 (open) Build the raw record.** Write a `Rollback` subclass that stores only the
# raw conv inputs, g and beta, and recomputes k and v in `restore` with the layer's conv
# weights (`model.layers[i].weights["conv"]`, `kimilab.ops.conv.causal_conv1d`, SiLU,
# L2 norm). Check it against greedy decoding; how would you extend `make_rollback`?
#
# **8.5 (open) The factorised rollback.** Megatron-LM applies the accepted rank-1 factors
# in one matmul. For j tokens, write the state after them as M S + C (chapter 2's segment
# transition, `kda.segment_transition`) and compare its FLOPs with j recurrent steps. For
# which j is the one-matmul form cheaper?
#
# **8.6 (open) A ring for many requests.** Size one scratch region for a batch of 64
# requests at 48B with k = 4: snapshot vs ring, in GB (`costs.spec.rollback_bytes`). How
# many requests of 32K tokens' cache does the difference hold?
