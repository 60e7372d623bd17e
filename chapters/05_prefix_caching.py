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
# # 5. Prefix caching for attention
#
# **What you'll build.** A replay of two kinds of **real traffic**: the conversation
# trace Moonshot AI published with Mooncake (FAST'25; [mooncake](references.md#mooncake)),
# 12,031 requests from one hour of Kimi's online service, anonymised to timestamps,
# lengths and 512-token prefix-block hashes; and 80 real Claude Code agent sessions,
# converted to the same form (`data/README.md`). Beside them, generated traffic for what
# they lack (multi-turn chat we can run on the tiny model, shared-document Q&A). Then a
# radix tree over page-sized blocks that caches KV pages across requests, and a replay
# that measures how much prompt work the cache saves as its memory per device grows.
#
# **What you'll learn.**
# - How a Mooncake trace describes prefix sharing with nothing but chained block ids.
# - What a radix tree of blocks does: longest-prefix match, reference counts that pin
#   blocks in use, leaf-first LRU eviction.
# - The *token-weighted hit rate* (prompt tokens served from cache / all prompt
#   tokens) of each workload as a function of cache capacity, next to Mooncake's
#   reported cache ratios.
# - Why, for a hybrid model, a KV hit alone saves **nothing**: without the KDA state
#   at the hit position the whole prompt must be recomputed anyway. That is the
#   problem chapter 6 solves.
#
# **What you'll need.** Chapters 3 (the hybrid model, its cache, and the named
# deployments every byte and second is priced on) and 4 (the page pool). Two traces are
# real (`data/mooncake_conversation.jsonl` and `data/claude_code_sessions.jsonl.gz`,
# Apache-2.0, sources and checksums in `data/README.md`); the others are generated, and
# the text says which is which. Bytes are per device of vLLM's Kimi-Linear recipe (four
# H200s, tensor parallelism 4) unless a cell says otherwise. The model is the reduced,
# untrained `tiny` config: the mechanisms are exact. Everything runs on a CPU in a few
# seconds.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

import kimilab.prefix as prefix
import kimilab.traffic as wl
from kimilab import costs, plots
from kimilab.config import kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import show_source
from kimilab.pool import PagePool
from kimilab.prefix import RadixTree
from kimilab.sim import simulate
from kimilab.tokenizer import ByteTokenizer
from kimilab.traffic.generators import chat_specs

plots.use_style()
CFG = kimi_linear_48b
DEP, DP = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200

# %% [markdown]
# ## Requests that share prefixes
#
# A *prefix cache* keeps the KV of prompts it has already processed, so a later prompt
# that starts with the same tokens skips them. Whether that pays depends on the
# traffic. Three shapes dominate real serving:
#
# - **multi-turn chat**: every turn re-sends the system prompt, the whole history and
#   the model's previous reply, plus one new message;
# - **agent / tool loops**: a long shared tool prompt, then tool outputs appended step
#   by step; sub-tasks fork from the same point;
# - **shared-document Q&A**: many readers ask about the same few documents.
#
# `kimilab.traffic` generates each one from a seed (`numpy.random.default_rng`, so
# the same requests on every machine). A request is token ids plus an arrival time in
# simulated milliseconds. Here is the chat generator:

# %%
show_source(chat_specs)

# %% [markdown]
# The generator first builds each prompt as a list of *segments* `(uid, length)`: the
# system prompt, each user message, each reply. Tokens come later, one seeded stream
# per segment. A toy example: two sessions with a 6-token system prompt and messages
# of about 3 tokens. Each later turn of a session starts with the earlier turn's tokens.

# %%
toy = wl.chat_sessions(2, seed=2, system_len=6, user_len=3, reply_len=3, mean_turns=3,
                       vocab_size=50)
for r in toy:
    print(f"request {r.request_id}  session {r.session}  t={r.arrival_ms:>6d} ms  "
          f"in={r.input_length:2d}  out={r.output_length}  tokens={r.tokens.tolist()}")

# %% [markdown]
# ## The Mooncake trace format
#
# Moonshot published Kimi's request traces (Mooncake, FAST'25) without any text: one
# JSON line per request with `timestamp` (ms), `input_length`, `output_length` and
# `hash_ids`. The prompt is cut into 512-token blocks (the last may be partial) and
# `hash_ids[j]` names **the whole prefix up to and including block j**. Ids are
# handed out 0, 1, 2, ... in order of first appearance, so two requests share
# `hash_ids[j]` exactly when their first `j + 1` blocks are identical. `to_trace`
# computes them by looking each block up under its parent's id:

# %%
show_source(wl.to_trace)

# %% [markdown]
# The toy chat with 4-token blocks. Within a session each turn repeats the previous
# turn's full blocks; the previous turn's *partial* last block gets a new id, because
# at that position the longer prompt has a full block with different content. Both
# sessions start with the same block 0, the system prompt.

# %%
for rec in wl.to_trace(toy, block_size=4):
    print(rec.to_json())

# %% [markdown]
# The committed traces in `data/` (see `data/README.md`; `python -m kimilab traces
# regenerate data/` rewrites them byte for byte) use 512-token blocks. `load_trace`
# validates every line and names the line and field of the first bad one:

# %%
files = {"mooncake": "mooncake_conversation.jsonl",  # real: Kimi's traffic, as published
         "chat": "chat.jsonl", "document": "document.jsonl",  # generated
         "conversation": "conversation_like.jsonl"}  # generated, shaped like the real trace
traces = {key: wl.load_trace(f"../data/{name}", 512) for key, name in files.items()}
# real agent traffic: 80 Claude Code sessions; they carry no start times, so sessions start as a
# Poisson process at 0.05 per second and each replays its requests at their recorded offsets
traces["claude-code"] = wl.agent_requests(wl.load_sessions(f"../data/{wl.CLAUDE_CODE}"), 0.05, seed=0)
traces = {k: traces[k] for k in ("mooncake", "claude-code", "chat", "document", "conversation")}

try:
    wl.parse_line('{"timestamp": 5, "input_length": 1000, "output_length": 7, "hash_ids": [0]}',
                   lineno=17, block_size=512)
except ValueError as err:
    print("ValueError:", err)

# %%
print(f"{'trace':<13}{'requests':>9}{'span s':>8}{'in mean':>9}{'p50':>8}{'p99':>8}"
      f"{'out mean':>9}{'1st blk':>8}{'reuse':>7}")
stats = {}
for key, records in traces.items():
    s = stats[key] = wl.trace_stats(records, 512)
    print(f"{key:<13}{s['requests']:>9,d}{s['duration_s']:>8.0f}{s['input_mean']:>9,.0f}"
          f"{s['input_p50']:>8,.0f}{s['input_p99']:>8,.0f}{s['output_mean']:>9.0f}"
          f"{s['share_first_block']:>8.2f}{s['reuse_upper_bound']:>7.3f}")

# %% [markdown]
# `1st blk` is the share of requests whose first block is the most common first block;
# `reuse` is the token-weighted hit rate of an *infinite* block cache (every block seen
# before is a hit) — a property of the traffic, the ceiling for any real cache.
#
# The first two rows are real traffic. The Claude Code sessions are another world than
# chat: prompts ten times longer, and 0.959 of their tokens at infinite cache are the
# session's own earlier requests (the source reports 96.9% per session, [claude-code](references.md#claude-code)).
# Their start times are our choice, stated above; the rows below them are generated.
# Mooncake's release also holds a Kimi agent trace, `toolagent_trace.jsonl` ([mooncake](references.md#mooncake): 23,608 requests,
# reported cache ratio 59%); the copy of the release this project could read has no such
# file, so the book's agent numbers rest on the Claude Code sessions.
#
# The generated conversation-like
# trace was written (before we shipped the real one) to match the real trace's
# published length statistics, and it does — requests per hour, input mean, p50 and
# p99 within a few percent, one common first block — but its reuse was not tuned, and
# it is far too high: conversations of three turns on average give it an
# infinite-cache ceiling well above the real trace's (the `reuse` column). Length
# statistics do not pin down reuse, so from here on every Mooncake comparison is made on
# the real trace; the generators stay for what it does not contain (shared long
# documents, chat the tiny model can actually run):

# %%
real, generated = stats["mooncake"], stats["conversation"]
for field in ("requests", "input_mean", "input_p50", "input_p99", "output_mean", "reuse_upper_bound"):
    digits = 3 if field == "reuse_upper_bound" else 0
    print(f"{field:<18} real {real[field]:>9,.{digits}f}   generated {generated[field]:>9,.{digits}f}   "
          f"generated / real {generated[field] / real[field]:5.2f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
STYLE = {"claude-code": dict(color=plots.color("agent"), label="Claude Code agent sessions (real)")}
for key, records in traces.items():
    lengths = np.sort([r.input_length for r in records])
    ax.plot(lengths, np.arange(1, len(lengths) + 1) / len(lengths), **(STYLE.get(key) or plots.style_of(key)))
ax.set_xscale("log")
ax.set_xlabel("prompt length (tokens)")
ax.set_ylabel("fraction of requests (CDF)")
ax.set_title("Prompt lengths: two real traces and three generated workloads")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
plots.save(fig, "ch05-prompt-lengths")
plt.show()

# %% [markdown]
# The generated conversation-like trace (pink) meets the real one (black) at the median
# and the 99th percentile, as it was tuned to, but not in between: the real trace has
# many more short prompts. And it overstates reuse, as the next section measures. The
# real agent sessions (vermilion) are long from the first request on: a coding agent's
# context is its tool definitions, the repository it read and every tool output so far.

# %% [markdown]
# ## A radix tree over blocks
#
# A serving engine keeps cached KV in pool pages (chapter 4). The prefix cache is a
# *radix tree* whose nodes are blocks: a node's key names the block given its parent,
# so a path from the root names a whole prefix — exactly what a Mooncake hash id is.
# Three operations matter:
#
# - **match**: walk down from the root while the next block is cached; the hit is the
#   deepest node reached (a whole number of blocks);
# - **insert**: add the missing blocks below it, each taking pages from the pool;
#   blocks used by a running request are *pinned* by a reference count;
# - **evict**: when the pool is full, free unpinned *leaves*, least recently used first.
#   Only leaves: a parent is the prefix its children need.
#
# `kimilab.prefix.radix` (written for chapter 6, used here) implements it:

# %%
show_source(RadixTree.match_blocks)

# %%
show_source(RadixTree.evict)

# %% [markdown]
# A pool of 4 pages, one page per 4-token block, and three prompts. The second prompt
# shares two blocks with the first, so it adds one. The third shares only the first
# block and needs two new ones, but the pool is full: the cache evicts the two least
# recently used leaves, A's last block and then B's last block. Block [5..8] survives
# the first eviction because it still had a child; it is kept as a cached prefix.

# %%
tree = RadixTree(PagePool(4, 64, backed=False), block_size=4)
prompts = {
    "A": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    "B": [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23],
    "C": [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37],
}
for name, tokens in prompts.items():
    m = tree.serve(tokens=tokens)
    cached = " ".join(f"[{n.tokens[0]}..{n.tokens[-1]}]" for n in tree.nodes())
    print(f"prompt {name}: hit {m.hit_tokens:2d} of {len(tokens)} tokens;  "
          f"cached blocks (root first): {cached};  evicted so far: {tree.n_evicted}")

# %% [markdown]
# ## Hit rate vs cache capacity
#
# The number that matters is the **token-weighted hit rate**: prompt tokens served from
# the cache divided by all prompt tokens. A 100k-token hit on one request outweighs a
# hundred 512-token hits, as it should: prefill work grows with tokens.
#
# `kimilab.sim.simulate(records, cache=...)` feeds a trace through a cache in timestamp
# order, one request at a time (the book's one simulation loop; chapter 4 gave it a
# memory budget instead of a cache): for each request it calls the cache's `serve`
# (below) and adds up the hit. The caches here are attention-only (`kv-only`): for a
# whole trace we use the run-length twin of this tree from chapter 6
# (`prefix.RunPrefixCache` with the `kv-only` policy), which a test holds equal to it
# request by request, and which is fast enough for 12,031 requests at eight sizes.
# Capacity is KV memory **per device**: under vLLM's TP4 recipe each device holds the
# whole MLA latent of every cached token (MLA has one latent head, replicated by tensor
# parallelism), 8,064 bytes per token. We sweep from 4 blocks (2k tokens) to 65,536
# blocks (33.6M tokens). The real traces are replayed whole, by their own timestamps;
# the generated conversation-like trace in its **first 10 minutes** (a time window, not
# a random sample, so sessions stay whole), to keep the chapter within its time budget.

# %%
show_source(RadixTree.serve)

# %%
window_ms = 10 * 60 * 1000
replayed = dict(traces)
replayed["conversation"] = [r for r in traces["conversation"] if r.arrival_ms < window_ms]  # generated
capacities = [4, 16, 64, 256, 1024, 4096, 16384, 65536]  # blocks of 512 tokens
hit = {key: [] for key in replayed}
saved_ms = {key: [] for key in replayed}  # prefill (TTFT) saved per request, if every hit were usable
results = {}
for key, records in replayed.items():
    for blocks in capacities:
        cache = prefix.RunPrefixCache(CFG, prefix.KVOnly(), deployment=DEP, block_size=512,
                                      capacity_tokens=blocks * 512)
        results[key, blocks] = r = simulate(records, cache=cache)
        hit[key].append(r.kv_hit_rate)
        saved_ms[key].append(r.prefill_ms_saved_per_request)
ceiling = {key: wl.reuse_upper_bound(records, 512) for key, records in replayed.items()}

for key in ("mooncake", "claude-code", "conversation"):
    print(f"{key}: {len(replayed[key]):,} requests, {sum(r.input_length for r in replayed[key]):,} prompt tokens")
print("capacity (tokens): " + "  ".join(f"{b * 512:>9,d}" for b in capacities) + "   infinite")
for key in replayed:
    print(f"{key:<17} " + "  ".join(f"{h:>9.3f}" for h in hit[key]) + f"   {ceiling[key]:8.3f}")

# %%
kv_bytes = costs.kv_bytes_per_token(CFG, DEP)
budget_gb = costs.cache_budget_bytes(CFG, DEP) / 1e9
print(f"Kimi-Linear-48B KV: {kv_bytes:,d} bytes per token per device ({kv_bytes * 1e6 / 1e9:.1f} GB per million "
      f"tokens); one TP4 device has {budget_gb:.1f} GB for its cache = {budget_gb * 1e9 / kv_bytes / 1e6:.1f}M tokens")
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.3))
x = np.array(capacities) * 512
for key in replayed:
    style = STYLE.get(key) or plots.style_of(key)
    ax.plot(x, hit[key], marker="o", **style)
    ax.axhline(ceiling[key], color=style["color"], linestyle=":", linewidth=1)
    ax2.plot(x, saved_ms[key], marker="o", **style)
for a in (ax, ax2):
    a.set_xscale("log")
    a.axvline(budget_gb * 1e9 / kv_bytes, color="black", linestyle="--", linewidth=0.8)
ax.text(budget_gb * 1e9 / kv_bytes * 1.15, 0.47, "one TP4\ndevice's\ncache\nbudget", ha="left", fontsize=8)
ax.set_xlabel("cache capacity (cached tokens; 1M tokens = 8.1 GB of KV per device)")
ax2.set_xlabel("cache capacity (cached tokens)")
ax.set_ylim(0, 1)
ax.set_ylabel("token-weighted hit rate")
ax.set_title("Prefix-cache hit rate vs capacity (dotted: infinite cache)")
ax2.set_yscale("log")
ax2.set_ylabel(f"prefill saved per request (ms, {DEP.name}, log)")
ax2.set_title("... in prefill time, were every hit usable (48B)")
handles, labels = ax.get_legend_handles_labels()
fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8)
plots.save(fig, "ch05-hit-rate-vs-capacity")
plt.show()

# %% [markdown]
# Each workload climbs from "only the shared first prefix fits" to its ceiling (dotted)
# once the cache holds its working set -- the blocks that will be asked for again before
# LRU pushes them out. How much capacity that takes, per device:

# %%
for key in replayed:
    reach = next((b * 512 for b, h in zip(capacities, hit[key]) if h >= 0.9 * ceiling[key]), None)
    where = (f"at {reach:>10,d} cached tokens = {reach * kv_bytes / 1e9:6.2f} GB of KV per device" if reach
             else f"not within {capacities[-1] * 512:,d} cached tokens")
    print(f"{key:<13} reaches 90% of its ceiling ({ceiling[key]:.3f}) {where}")
for key in replayed:
    r0, r1 = results[key, capacities[0]], results[key, capacities[-1]]
    print(f"{key:<13} prefill saved per request: {saved_ms[key][0]:8.2f} ms at {capacities[0] * 512:,d} tokens, "
          f"{saved_ms[key][-1]:8.2f} ms at {capacities[-1] * 512:,d} (cold prefill "
          f"{1e3 * r1.prefill_seconds_cold / r1.requests:,.1f} ms, {DEP.name})")
forty = next((b * 512 for b, h in zip(capacities, hit["mooncake"]) if h >= 0.40), None)
print(f"real trace: hit rate >= 0.40 at {'no capacity swept (its ceiling is below 0.40)' if forty is None else f'{forty:,d} tokens'}")
for key in ("mooncake", "claude-code"):
    r = simulate(replayed[key], cache=prefix.RunPrefixCache(CFG, prefix.KVOnly(), deployment=DP, block_size=512,
                                                           capacity_tokens=capacities[-1] * 512))
    print(f"{key:<13} the same hits at {capacities[-1] * 512:,d} tokens under {DP.name}: "
          f"{r.prefill_ms_saved_per_request:8.2f} ms saved of a {1e3 * r.prefill_seconds_cold / r.requests:,.1f} ms cold prefill")
big = capacities[-1] * 512 * kv_bytes / 1e9
print(f"33.6M cached tokens: {big:.2f} GB on EVERY device under TP4 (the latent is replicated) = "
      f"{big / budget_gb:.2f}x one device's cache budget; sharded over the 4 devices of DP-attention "
      f"{big / 4:.2f} GB each ({big / 4 / (costs.cache_budget_bytes(CFG, DP) / 1e9):.2f}x a DP device's budget)")

# %% [markdown]
# The small generated workloads are saturated by a cache of 131k tokens (1.06 GB of KV
# per device): their sessions are short and their shared prefixes few. Real traffic is
# different, in two ways:
#
# - **Chat (Mooncake).** Thousands of conversations are open at once, each re-sending a
#   history of ~12k tokens after a pause, so the working set is tens of millions of
#   tokens. The hit rate stays at the shared first block's share (0.043) up to 131k
#   cached tokens and reaches 90% of its ceiling only at 33.6M cached tokens. That is
#   270.58 GB of KV *on every device* of the TP4 recipe, because tensor parallelism
#   replicates MLA's one latent head: 2.74 times the 98.9 GB a device has for its cache.
#   Sharded over the four devices of DP-attention it would be 67.65 GB each -- but a
#   DP rank only hits its own cache, so that needs prefix-aware routing (chapter 10).
#   What the trace asks for fits one instance only with a second tier (chapter 6).
# - **Agents (Claude Code).** Each session re-sends its whole growing context, so a cache
#   that holds the live sessions hits almost everything: 0.841 at 2.1M cached tokens and
#   0.953 at 8.4M, 67.65 GB per device -- within one TP4 device's budget.
#
# In time (the right panel, log scale; chapter 3's cost model for the 48B model on the
# TP4 recipe, as if every hit were usable, which chapter 6 shows it is not for a
# hybrid): on the conversation trace a cache saves 10.81 ms of a 267.9 ms cold prefill
# per request while it holds only the shared first block, and 96.11 ms at 33.6M cached
# tokens; on the agent sessions 2841.56 ms of 2975.7 ms. Under DP-attention the same
# hits save more time, because a request's whole prefill runs on one device (printed
# above). The chat workload's prompts are short, so even its 0.717 hit rate is worth
# 39.56 ms.
#
# **Against Mooncake's reported cache ratios.** Mooncake reports a cache ratio of about
# 40% for this conversation trace ([mooncake](references.md#mooncake)). Replaying the
# same trace, an infinite block cache serves 0.374 of its prompt tokens -- close to the
# reported figure, so their 40% is near what any cache could get from this traffic, and
# no capacity in our sweep gets a plain LRU cache past 40% (its ceiling is below it).
# The generated conversation-like trace, tuned only to the real trace's lengths, claims
# a ceiling of 0.669 over the whole hour -- 1.79 times the real one. An argument built on
# it would have overstated every prefix-caching gain by that much; from here on, the
# book's chat numbers come from the real trace. Mooncake reports 59% for its own
# tool-and-agent trace; the Claude Code sessions' 0.959 is a coding agent re-sending its
# entire context every step, not a number to compare one for one.

# %% [markdown]
# ## Whole blocks lose the tail
#
# A block cache only matches whole blocks. A chat turn re-sends the previous prompt
# plus a reply and a new message, but the previous prompt's partial last block (up to
# one token short of a block) is not a full block, so it is recomputed. A radix tree that keeps tokens
# can match *inside* a block (`partial_blocks=True`, token-exact, as SGLang's per-token
# tree does). For the chat workload, with an unlimited cache:

# %%
chat_requests = wl.chat_sessions(60, seed=1)  # the generator call behind data/chat.jsonl
for partial in (False, True):
    t = RadixTree(PagePool(1 << 20, 1, backed=False), 512, partial_blocks=partial)
    served = sum(t.serve(tokens=r.tokens).hit_tokens for r in chat_requests)
    total = sum(r.input_length for r in chat_requests)
    print(f"partial_blocks={partial!s:<5}: hit rate {served / total:.3f}")

# %% [markdown]
# ## For a hybrid model, a KV hit alone saves nothing
#
# Everything above counted *KV* hits. For a pure attention model that is the whole
# story: attention at position t reads the KV of positions 0..t, the KV of a shared
# prefix is identical for every request that shares it, and the model continues from
# the first uncached token.
#
# A hybrid model also has KDA layers (three of every four in `tiny`, 20 of 27 in
# Kimi-Linear-48B). A KDA layer keeps no per-token KV; its whole past is one state
# matrix that every token overwrites (chapter 2). To continue from position p it needs
# **the state at exactly p**. The prefix cache above stored KV pages only; the state at
# the hit position was overwritten long ago by the rest of the earlier prompt.
#
# Let us see it on the tiny model. Request 1 is a system prompt and a question; the
# model replies (untrained, so the reply is noise); request 2 re-sends all of it plus a
# follow-up question — one chat session, two turns.

# %%
tok = ByteTokenizer()
model = Model(tiny, seed=0)
turn1 = tok.encode("System: you are a careful assistant.\nUser: what is a KV cache, briefly?\n")
reply = model.generate(turn1, 12)
turn2 = turn1 + reply + tok.encode("User: and a KDA state?\n", bos=False)
print(f"turn 1: {len(turn1)} tokens; reply: {len(reply)} tokens; turn 2: {len(turn2)} tokens")

BLOCK = 16
kv_tree = RadixTree(PagePool(64, 64, backed=False), BLOCK)
kv_tree.serve(tokens=turn1)
kv_hit = kv_tree.match(tokens=turn2).hit_tokens
print(f"the block radix tree (block {BLOCK}) finds a KV hit of {kv_hit} tokens for turn 2")

# %% [markdown]
# The hit is 4 whole blocks; turn 1's last 9 tokens sit in a partial block. The
# reference is a cold prefill of turn 2. Then turn 1 as an engine serves it — prefill
# into a cache — which leaves the KV of every global layer for all its tokens,
# including the 64 that the tree says turn 2 shares.

# %%
cold = model.new_cache()
logits_cold = model.prefill(turn2, cold)

cache1 = model.new_cache()
model.prefill(turn1, cache1)
shared_kv = {i: (cache1.kv(i)[0][:kv_hit], cache1.kv(i)[1][:kv_hit]) for i in tiny.attn_layers}
same_kv = all(np.max(np.abs(shared_kv[i][0] - cold.kv(i)[0][:kv_hit])) < 1e-10 for i in tiny.attn_layers)
print(f"global layers {list(tiny.attn_layers)}: cached KV of the first {kv_hit} tokens "
      f"equals turn 2's own KV (max |diff| < 1e-10): {same_kv}")

# %% [markdown]
# The KV is right. Now try to use it. The KDA layers need their state at position 64,
# but the only state turn 1 left behind is the one at its end (position 73; a real
# engine has even decoded the reply into it since). Resuming with the shared KV and *zero* KDA states (or the
# end-of-turn-1 states) gives wrong logits:

# %%
def resume(kda_states, conv_states, n):
    """A cache at position n: shared KV for global layers, the given states for KDA layers."""
    c = model.new_cache()
    for i in tiny.attn_layers:
        c.append_kv(i, *shared_kv[i])
    for i in tiny.kda_layers:
        c.set_kda_state(i, kda_states[i])
        c.set_conv_state(i, conv_states[i])
    c.advance(n)
    return c


zeros = resume({i: np.zeros_like(cache1.kda_state(i)) for i in tiny.kda_layers},
               {i: np.zeros_like(cache1.conv_state(i)) for i in tiny.kda_layers}, kv_hit)
stale = resume({i: cache1.kda_state(i) for i in tiny.kda_layers},
               {i: cache1.conv_state(i) for i in tiny.kda_layers}, kv_hit)
for name, c in (("zero KDA states", zeros), ("states from the end of turn 1", stale)):
    out = model.prefill(turn2[kv_hit:], c)
    err = np.max(np.abs(out - logits_cold[kv_hit:]))
    agree = np.mean(out.argmax(-1) == logits_cold[kv_hit:].argmax(-1))
    print(f"resume at {kv_hit} with {name:<30}: max |logit diff| = {err:.2e}, "
          f"greedy tokens agree {agree:.0%}")

# %% [markdown]
# There is no way to *cut* the end-of-turn-1 state back to position 64: a KDA state is
# not a sum over tokens that could be subtracted (chapter 2), and the states differ:

# %%
probe = model.new_cache()
model.prefill(turn1[:kv_hit], probe)
ckpt = probe.checkpoint()  # what a state checkpoint at position 64 would hold
gap = max(np.max(np.abs(ckpt.kda_states[i] - cache1.kda_state(i))) for i in tiny.kda_layers)
print(f"max |S({len(turn1)}) - S({kv_hit})| over KDA layers = {gap:.2e}")

# %% [markdown]
# With that checkpoint — states at exactly 64 plus the shared KV — the resume is exact,
# and only the last tokens are recomputed:

# %%
restored = HybridCache.from_checkpoint(tiny, ckpt, kv=shared_kv)
out = model.prefill(turn2[kv_hit:], restored)
same_logits = np.max(np.abs(out - logits_cold[kv_hit:])) < 1e-10
same_states = all(np.max(np.abs(restored.kda_state(i) - cold.kda_state(i))) < 1e-10
                  for i in tiny.kda_layers)
print(f"resume from checkpoint at {kv_hit}: logits equal cold prefill (max |diff| < 1e-10): "
      f"{same_logits}; final KDA states equal: {same_states}")
print(f"checkpoint size: {ckpt.nbytes:,} bytes for tiny; {costs.checkpoint_bytes(CFG, costs.ONE_H200):,} bytes "
      f"for Kimi-Linear-48B (the whole model), {costs.checkpoint_bytes(CFG, DEP):,} on one TP4 device")

# %% [markdown]
# So how much of turn 2's prompt work does a cache save? Measure it: serve turn 1 and
# then turn 2 through a prefix cache holding the tiny model's real KV pages and states
# (`kimilab.prefix.ModelPrefixCache`, chapter 6 builds it), once with a policy that
# keeps **no** states (a KV-only cache, written here as a three-line policy) and once
# with `ends`, which checkpoints the state where each request's last whole block ends.
# An attention-only model would resume at the KV hit the radix tree found.

# %%
class NoStates(prefix.Policy):
    """A KV-only prefix cache on a hybrid model: never admits a state checkpoint."""

    name = "no-states"

    def positions(self, placement):
        return []


def served(policy):
    """Prompt tokens of turn 2 a hybrid model skips, after turn 1 went through the cache."""
    store = prefix.ModelPrefixCache(model, policy, block_size=BLOCK, capacity_tokens=BLOCK * 64)
    for prompt in (turn1, turn2):
        _, cache, out = store.prefill(prompt)
        cache.free()
    return out.usable_hit


scenarios = {
    "no-cache": ("no cache", 0),
    "kv-only": ("KV hit, attention-only model", kv_hit),
    "kda-state": ("KV-only cache, hybrid model", served(NoStates())),
    "checkpoint": ("KV + state checkpoints (ends), hybrid", served("ends")),
}
for key, (name, saved) in scenarios.items():
    print(f"{name:<38} saved {saved:2d} tokens, recompute {len(turn2) - saved:2d} of {len(turn2)}")

fig, ax = plt.subplots(figsize=(7.5, 3.6))
names = [name for name, _ in scenarios.values()]
y = np.arange(len(names))[::-1]
for yi, (key, (name, s)) in zip(y, scenarios.items()):
    r = len(turn2) - s
    ax.barh(yi, s, color=plots.color(key))
    ax.barh(yi, r, left=s, color="#DDDDDD", edgecolor="#999999")
    ax.text(s + r / 2, yi, f"recompute {r}", ha="center", va="center", fontsize=8)
    if s:
        ax.text(s / 2, yi, f"served {s}", ha="center", va="center", fontsize=8, color="white")
handles = [Patch(color=plots.color("kv-only"), label="served from cache, attention-only model"),
           Patch(color=plots.color("checkpoint"), label="served from cache, hybrid + checkpoint"),
           Patch(facecolor="#DDDDDD", edgecolor="#999999", label="recomputed")]
ax.set_yticks(y, names)
ax.set_xlim(0, len(turn2) * 1.02)
ax.set_xlabel(f"prompt tokens of turn 2 ({len(turn2)} in all)")
ax.set_title(f"What a KV hit of {kv_hit} tokens buys, tiny model")
ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=7)
plots.save(fig, "ch05-kv-only")
plt.show()

# %% [markdown]
# The radix tree finds the same 64-token KV hit in every cached case, but the hybrid
# model can use it only when a state checkpoint at that position exists; with the
# KV-only cache it recomputes every token of turn 2, exactly like no cache.
#
# At trace scale the consequence is stark. With a KV-only prefix cache a hybrid model
# resumes nowhere — no state is ever stored, so its *usable* hit rate is zero on every
# workload above, at any capacity — while the same cache would have saved an attention
# model the hit rates measured above (0.374 of the real trace's prompt tokens with
# unlimited memory). The fix is to keep state checkpoints too, but one Kimi-Linear-48B
# checkpoint is large:

# %%
for dep in (DEP, DP):
    per_ckpt = costs.checkpoint_bytes(CFG, dep)
    print(f"{dep.name:<14} one checkpoint = {per_ckpt / 1e6:5.2f} MB per device = KV of {per_ckpt / kv_bytes:,.0f} "
          f"tokens = {per_ckpt / (kv_bytes * 512):.2f} blocks of 512 tokens")

# %% [markdown]
# Priced in 512-token KV blocks on one device, a checkpoint at every block boundary would
# cost 2.63 times more memory than the KV it makes usable under TP4 -- tensor parallelism
# splits the states over the devices but not MLA's one latent head -- and 10.52 times
# under DP-attention, where a device holds whole requests. (vLLM prices it per layer
# group instead, three of its own blocks; chapter 6 works through both.) Which positions
# deserve a checkpoint, and how many, is chapter 6.
#
# ## Summary
#
# - Traffic shares prefixes: chat re-sends history, agents re-send their whole context,
#   readers share documents. The Mooncake trace format captures that with chained
#   512-token block ids; `kimilab.traffic` loads Moonshot's real conversation trace and
#   80 real Claude Code agent sessions, and generates, exports, validates and reloads our
#   own traces, byte-identically.
# - A radix tree of blocks with pinning and leaf-first LRU turns that sharing into hits.
#   On the real Kimi trace an infinite cache serves 0.374 of prompt tokens (Mooncake
#   reports about 40%) and 90% of that takes 270.58 GB of KV on every TP4 device, 2.74
#   times a device's cache budget; the agent sessions reach 0.953 within one device
#   (67.65 GB).
# - A generated trace that matches the real one's length statistics still overstated its
#   reuse by 1.79x (0.669): lengths do not determine reuse. Generated traffic is used
#   only for what the real traces lack: 0.717 (chat), 0.938 (document).
# - Whole-block matching loses each prompt's partial last block; token-exact matching
#   recovers part of it.
# - For a hybrid model a KV hit is usable only where the KDA (and conv) state at that
#   exact position was kept. A KV-only cache saves a hybrid model nothing, and a
#   checkpoint costs 2.63 KV blocks per device under TP4, 10.52 under DP-attention.

# %% [markdown]
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer (the student edition, `make student`, leaves it empty for you), and
# `verify("N.M", answer)`, which says "correct" or what is off. Open exercises follow.
#
# **5.1 Whole blocks.** A chat turn re-sends a 2,900-token previous prompt plus 400 new
# tokens. With a whole-block cache of 512-token blocks that already holds the previous
# prompt, how many prompt tokens of the new turn are served from cache?

# %% tags=["solution"]
answer = (2900 // 512) * 512  # 5 full blocks; the last 340 tokens sat in a partial block

# %%
verify("5.1", answer)

# %% [markdown]
# **5.2 Bytes of a million tokens.** How many GB (1e9 bytes) of Kimi-Linear-48B KV does a
# cache of one million tokens hold on each device of the TP4 recipe?

# %% tags=["solution"]
answer = costs.kv_bytes_per_token(CFG, DEP) * 1e6 / 1e9

# %%
verify("5.2", answer)

# %% [markdown]
# **5.3 Forgetting after five minutes.** Keep the infinite cache, but drop a block once
# it has gone five minutes (300 s of the trace's arrival times) without being used. What
# token-weighted hit rate does it reach on the whole real Mooncake trace (512-token
# blocks)? Compare it with the `reuse` ceiling in the statistics table: how much of the
# real trace's reuse comes back within five minutes?

# %% tags=["solution"]
last_used, hit, total = {}, 0, 0
for r in traces["mooncake"]:
    for h, n in zip(r.hash_ids, r.block_lengths(512)):
        hit += int(n) if h in last_used and r.arrival_ms - last_used[h] <= 300_000 else 0
        total += int(n)
    last_used.update(dict.fromkeys(r.hash_ids, r.arrival_ms))
answer = hit / total

# %%
verify("5.3", answer)

# %% [markdown]
# **5.4 The tail no block cache holds.** A whole-block cache never stores the tokens after
# a prompt's last full block. What fraction of all prompt tokens of the real Mooncake
# trace sit in such partial last blocks (512-token blocks)?

# %% tags=["solution"]
lengths = np.array([r.input_length for r in traces["mooncake"]])
answer = float((lengths % 512).sum() / lengths.sum())

# %%
verify("5.4", answer)

# %% [markdown]
# **5.5 (open) Capacity and concurrency.** The agent sessions' start times are ours.
# Rebuild `traces["claude-code"]` with `wl.agent_requests(..., sessions_per_s)` at 0.01
# and 0.2 sessions per second and replay each at 4,096 and 65,536 blocks. Why does the
# rate move the hit rate of a small cache and hardly that of a large one?
#
# **5.6 (open) Full hour.** Replay all 12,044 requests of the generated
# conversation-like trace at 4,096 blocks (a few seconds). Is the hit rate close to the
# 10-minute window's? Why might a window of a trace show a *higher* hit rate at equal
# capacity, or a lower one? Then replay the first 10 minutes of the real trace the same way.
#
# **5.7 (open) Fewer turns.** Generate `wl.mooncake_conversation_like(seed=0, mean_turns=1.5)`
# and compute `wl.reuse_upper_bound`. How many turns per conversation would make the
# ceiling about 40%?
