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
# 12,031 requests from one hour of Kimi's service, anonymised to timestamps, lengths and
# 512-token prefix-block hashes, and 80 real Claude Code agent sessions in the same form.
# Then a radix tree over blocks that caches KV pages across requests, and a replay that
# measures how much prompt work the cache saves as its memory per device grows.
#
# **What you'll learn.**
# - How a Mooncake trace describes prefix sharing with nothing but chained block ids.
# - What a radix tree of blocks does: longest-prefix match, reference counts that pin
#   blocks in use, leaf-first LRU eviction.
# - The *token-weighted hit rate* of each workload as a function of cache capacity.
# - Why, for a hybrid model, a KV hit alone saves **nothing**: without the KDA state at
#   the hit position the whole prompt must be recomputed. Chapter 6 solves that.
#
# **What you'll need.** Chapters 3 (the hybrid model, its cache, the named deployments)
# and 4 (the page pool). Two traces are real (Apache-2.0, sources and checksums in
# `data/README.md`); the others are generated, and the text says which is which. Bytes
# are per device of vLLM's Kimi-Linear recipe (four H200s, tensor parallelism 4) unless a
# cell says otherwise. The model is the reduced, untrained `tiny` config: the mechanisms
# are exact. Reference pages: [glossary](glossary.md), [notation](notation.md), [API](api.md).

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
import matplotlib.pyplot as plt
import numpy as np

import kimilab.prefix as prefix
import kimilab.traffic as wl
from kimilab import costs, plots
from kimilab.config import kimi_linear_48b, tiny
from kimilab.exercises import verify
from kimilab.model import HybridCache, Model
from kimilab.notebook import key_results, show_source, show_table
from kimilab.pool import PagePool
from kimilab.prefix import RadixTree
from kimilab.sim import simulate
from kimilab.tokenizer import ByteTokenizer

plots.use_style()
CFG = kimi_linear_48b
DEP, DP = costs.DEFAULT_DEPLOYMENT, costs.DP4_EP4_H200


def style(key):  # the house style of each workload; the real agent sessions take the agent colour
    return dict(color=plots.color("agent"), label="Claude Code agent sessions (real)") if key == "claude-code" \
        else plots.style_of(key)


# %%
# Key results (each number is computed here and derived step by step below)
files = {"mooncake": "mooncake_conversation.jsonl",  # real: Kimi's traffic, as published
         "chat": "chat.jsonl", "document": "document.jsonl", "conversation": "conversation_like.jsonl"}  # generated
traces = {key: wl.load_trace(f"../data/{name}", 512) for key, name in files.items()}
sessions = wl.load_sessions(f"../data/{wl.CLAUDE_CODE}")  # real agent traffic, without start times
traces["claude-code"] = wl.agent_requests(sessions, 0.05, seed=0)  # sessions start 0.05 per second
traces = {k: traces[k] for k in ("mooncake", "claude-code", "chat", "document", "conversation")}
replayed = dict(traces, conversation=[r for r in traces["conversation"] if r.arrival_ms < 10 * 60 * 1000])
capacities = [4, 16, 64, 256, 1024, 4096, 16384, 65536]  # cache capacity in blocks of 512 tokens
results = {(key, b): simulate(records, cache=prefix.RunPrefixCache(CFG, prefix.KVOnly(), deployment=DEP,
                                                                   block_size=512, capacity_tokens=b * 512))
           for key, records in replayed.items() for b in capacities}  # the capacity sweep below, run once here
hit = {key: [results[key, b].kv_hit_rate for b in capacities] for key in replayed}
ceiling = {key: wl.reuse_upper_bound(records, 512) for key, records in replayed.items()}
reach = {key: next((b * 512 for b, h in zip(capacities, hit[key]) if h >= 0.9 * ceiling[key]), None)
         for key in replayed}  # the capacity where each workload reaches 90% of its ceiling
kv_bytes, budget = costs.kv_bytes_per_token(CFG, DEP), costs.cache_budget_bytes(CFG, DEP)
whole_hour, (moon, agent) = wl.reuse_upper_bound(traces["conversation"], 512), (reach["mooncake"], reach["claude-code"])
key_results(
    f"On one hour of Kimi's real chat traffic ({len(traces['mooncake']):,} requests) even an infinite prefix cache "
    f"serves only {ceiling['mooncake']:.3f} of prompt tokens; a generated trace with the same lengths claims "
    f"{whole_hour:.3f}, {whole_hour / ceiling['mooncake']:.2f}x too much.",
    f"90% of that ceiling takes {moon / 1e6:.1f}M cached tokens: {moon * kv_bytes / 1e9:.2f} GB of KV on every "
    f"TP4 device, {moon * kv_bytes / budget:.2f}x its cache budget (tensor parallelism replicates MLA's latent).",
    f"Real Claude Code agent sessions re-send their whole context: {agent / 1e6:.1f}M cached tokens "
    f"({agent * kv_bytes / 1e9:.2f} GB a device) serve {hit['claude-code'][capacities.index(agent // 512)]:.3f} "
    f"of their prompt tokens.",
    f"For a hybrid model a KV hit alone saves nothing: resuming needs the KDA state at exactly the hit, and one such "
    f"checkpoint weighs {costs.checkpoint_bytes(CFG, DEP) / (kv_bytes * 512):.2f} blocks of 512-token KV a device.",
)

# %% [markdown]
# ## Requests that share prefixes
#
# <a id="term-prefix-cache"></a>A **prefix cache** keeps the KV of prompts it has already
# processed, so a later prompt that starts with the same tokens skips them. Whether that
# pays depends on the traffic. Three shapes dominate real serving:
#
# - **multi-turn chat**: every turn re-sends the system prompt, the whole history and
#   the model's previous reply, plus one new message;
# - **agent / tool loops**: a long shared tool prompt, then tool outputs appended step
#   by step; sub-tasks fork from the same point;
# - **shared-document Q&A**: many readers ask about the same few documents.
#
# `kimilab.traffic` generates each from a seed. A request is token ids plus an arrival
# time in simulated milliseconds. A toy chat: two sessions, a 6-token system prompt,
# messages of about 3 tokens; each later turn starts with the earlier turn's tokens.

# %%
toy = wl.chat_sessions(2, seed=2, system_len=6, user_len=3, reply_len=3, mean_turns=3, vocab_size=50)
for r in toy:
    print(f"request {r.request_id}  session {r.session}  t={r.arrival_ms:>5d} ms  in={r.input_length:2d}  "
          f"out={r.output_length}  {' '.join(map(str, r.tokens.tolist()))}")

# %% [markdown]
# The deep dive lists the chat generator, which builds each prompt from *segments*
# (system prompt, user messages, replies), each with its own seeded token stream.
#
# ### Deep dive: how the chat generator builds prompts from segments

# %%
from kimilab.traffic.generators import chat_specs

show_source(chat_specs, limit=None)

# %% [markdown]
# The generator first builds each prompt as a list of *segments* `(uid, length)`: the
# system prompt, each user message, each reply. Tokens come later, one seeded stream
# per segment, so two prompts share tokens exactly where they share segments.
#
# ## The Mooncake trace format
#
# <a id="term-hash-ids"></a>Moonshot published Kimi's request traces without any text:
# one JSON line per request with `timestamp` (ms), `input_length`, `output_length` and
# `hash_ids`. The prompt is cut into 512-token blocks (the last may be partial) and
# `hash_ids[j]` names **the whole prefix up to and including block j**, so two requests
# share `hash_ids[j]` exactly when their first `j + 1` blocks are identical. The toy chat
# with 4-token blocks:

# %%
for rec in wl.to_trace(toy, block_size=4):
    print(rec.to_json())

# %% [markdown]
# Each turn repeats the previous turn's full blocks; the previous turn's *partial* last
# block gets a new id, because there the longer prompt has a full block with different
# content. Both sessions start with block 0, the system prompt. The committed traces in
# `data/` use 512-token blocks; the Key results cell loaded them. Their statistics:

# %%
stats = {key: wl.trace_stats(records, 512) for key, records in traces.items()}
show_table([[key, s["requests"], s["duration_s"], s["input_mean"], s["input_p50"], s["input_p99"], s["output_mean"],
             s["share_first_block"], s["reuse_upper_bound"]] for key, s in stats.items()],
           ["trace", "requests", "span s", "in mean", "in p50", "in p99", "out mean", "1st blk", "reuse"],
           formats={"span s": ",.0f", "in mean": ",.0f", "in p50": ",.0f", "in p99": ",.0f", "out mean": ",.0f",
                    "1st blk": ".2f", "reuse": ".3f"}, title="The five traces (prompt lengths in tokens)")

# %% [markdown]
# <a id="term-reuse-ceiling"></a>`1st blk` is the share of requests whose first block is
# the most common first block. `reuse` is the token-weighted hit rate of an *infinite*
# block cache (every block seen before is a hit): a property of the traffic, the
# **reuse ceiling** for any real cache.
#
# The first two rows are real traffic; the Claude Code sessions have prompts ten times
# longer than chat, and 0.959 of their tokens at infinite cache are the session's own
# earlier requests. The generated conversation-like trace matches the real one's length
# statistics within a few percent but claims a reuse ceiling of 0.669, 1.79 times the real
# 0.374. Lengths do not pin down reuse, so every Mooncake comparison below uses the real
# trace; the generators stay for what it lacks. The deep dive computes and validates hash
# ids and sets the generated trace beside the real one.
#
# ### Deep dive: computing and validating hash ids, and a generated trace beside the real one
#
# The Claude Code source reports 96.9% reuse per session ([claude-code](references.md#claude-code));
# the sessions' start times are our choice, stated in the Key results cell. Mooncake's
# release also holds a Kimi agent trace, `toolagent_trace.jsonl` ([mooncake](references.md#mooncake): 23,608 requests,
# reported cache ratio 59%); the copy of the release this project could read has no such
# file, so the book's agent numbers rest on the Claude Code sessions.
#
# `to_trace` computes the ids by looking each block up under its parent's id:

# %%
show_source(wl.to_trace)

# %% [markdown]
# `load_trace` validates every line and names the line and field of the first bad one:

# %%
try:
    wl.parse_line('{"timestamp": 5, "input_length": 1000, "output_length": 7, "hash_ids": [0]}',
                   lineno=17, block_size=512)
except ValueError as err:
    print("ValueError:", str(err).replace("; ", ";\n  "))

# %% [markdown]
# The generated conversation-like trace was written (before we shipped the real one) to
# match the real trace's published length statistics, and it does; but its reuse was not
# tuned, and conversations of three turns on average give it a ceiling far above the real
# trace's:

# %%
real, generated = stats["mooncake"], stats["conversation"]
fields = ("requests", "input_mean", "input_p50", "input_p99", "output_mean", "reuse_upper_bound")
fmt = lambda f, v: f"{v:,.3f}" if f == "reuse_upper_bound" else f"{v:,.0f}"  # noqa: E731
show_table([[f, fmt(f, real[f]), fmt(f, generated[f]), generated[f] / real[f]] for f in fields],
           ["statistic", "real", "generated", "generated / real"], formats={"generated / real": ".2f"},
           title="The real conversation trace and the generated one shaped like it")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for key, records in traces.items():
    lengths = np.sort([r.input_length for r in records])
    ax.plot(lengths, np.arange(1, len(lengths) + 1) / len(lengths), **style(key))
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
# many more short prompts. The real agent sessions (vermilion) are long from the first
# request on: a coding agent's context is its tool definitions, the repository it read
# and every tool output so far.
#
# ## A radix tree over blocks
#
# <a id="term-radix-tree"></a>A serving engine keeps cached KV in pool pages (chapter 4).
# The prefix cache is a **radix tree** whose nodes are blocks: a node's key names the
# block given its parent, so a path from the root names a whole prefix, exactly what a
# Mooncake hash id is. Three operations matter:
#
# - **match**: walk down from the root while the next block is cached; the hit is the
#   deepest node reached (a whole number of blocks);
# - **insert**: add the missing blocks below it, each taking pages from the pool;
#   blocks used by a running request are *pinned* by a reference count;
# - **evict**: when the pool is full, free unpinned *leaves*, least recently used first.
#   Only leaves: a parent is the prefix its children need.
#
# `kimilab.prefix.radix` (written for chapter 6, used here) implements it. The match:

# %%
show_source(RadixTree.match_blocks)

# %% [markdown]
# A pool of 4 pages, one page per 4-token block, and three prompts. The second prompt
# shares two blocks with the first, so it adds one. The third shares only the first
# block and needs two new ones, but the pool is full: the cache evicts the two least
# recently used leaves, A's last block and then B's last block. Block [5..8] survives
# the first eviction because it still had a child; it is kept as a cached prefix.

# %%
tree = RadixTree(PagePool(4, 64, backed=False), block_size=4)
prompts = {"A": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "B": [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23],
           "C": [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37]}
for name, tokens in prompts.items():
    m = tree.serve(tokens=tokens)
    cached = " ".join(f"[{n.tokens[0]}..{n.tokens[-1]}]" for n in tree.nodes())
    print(f"prompt {name}: hit {m.hit_tokens:2d} of {len(tokens)} tokens; evicted so far: {tree.n_evicted}; "
          f"cached: {cached}")

# %% [markdown]
# The deep dive lists eviction and `serve`, which matches, pins, inserts and evicts in
# one call.
#
# ### Deep dive: eviction and `serve`

# %%
show_source(RadixTree.evict)

# %%
show_source(RadixTree.serve)

# %% [markdown]
# ## Hit rate vs cache capacity
#
# <a id="term-token-weighted-hit-rate"></a>The number that matters is the
# **token-weighted hit rate**: prompt tokens served from the cache over all prompt tokens.
# A 100k-token hit outweighs a hundred 512-token hits, as it should: prefill work grows
# with tokens.
#
# `kimilab.sim.simulate(records, cache=...)` feeds a trace through a cache in timestamp
# order, calling the cache's `serve` for each request and adding up the hits. For whole
# traces it uses the run-length twin of this tree (`prefix.RunPrefixCache`, chapter 6),
# which a test holds equal to it request by request. Capacity is KV memory **per device**:
# under vLLM's TP4 recipe each device holds the whole MLA latent of every cached token.
# The Key results cell swept 4 blocks (2k tokens) to 65,536 blocks (33.6M tokens), the
# real traces whole and the generated conversation-like trace in its first 10 minutes:

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.3))
x = np.array(capacities) * 512
for key in replayed:
    ax.plot(x, hit[key], marker="o", **style(key))
    ax.axhline(ceiling[key], color=style(key)["color"], linestyle=":", linewidth=1)
ax.set_xscale("log")
ax.axvline(budget / kv_bytes, color="black", linestyle="--", linewidth=0.8)
ax.text(budget / kv_bytes * 1.15, 0.47, "one TP4\ndevice's\ncache\nbudget", ha="left", fontsize=8)
ax.set(xlabel="cache capacity (cached tokens; 1M tokens = 8.1 GB of KV per device)", ylim=(0, 1),
       ylabel="token-weighted hit rate", title="Prefix-cache hit rate vs capacity (dotted: infinite cache)")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
plots.save(fig, "ch05-hit-rate-vs-capacity")
plt.show()

# %% [markdown]
# <a id="term-working-set"></a>Each workload climbs from "only the shared first prefix
# fits" to its ceiling (dotted) once the cache holds its **working set**: the blocks that
# will be asked for again before LRU pushes them out. How much capacity that takes, per
# device:

# %%
rows = [[key, ceiling[key], reach[key], reach[key] * kv_bytes / 1e9] for key in replayed]
show_table(rows, ["trace", "ceiling", "90% of it at (tokens)", "= GB of KV per device"],
           formats={"ceiling": ".3f", "90% of it at (tokens)": ",d", "= GB of KV per device": ".2f"},
           title="Capacity to reach 90% of each ceiling")

# %% [markdown]
# The small generated workloads are saturated by 131k cached tokens (1.06 GB per device).
# Real traffic is not. **Chat (Mooncake):** thousands of conversations are open at once,
# each re-sending ~12k tokens of history after a pause, so 90% of the ceiling takes 33.6M
# cached tokens, 270.58 GB of KV *on every TP4 device*, 2.74 times the 98.9 GB a device has
# for its cache. **Agents (Claude Code):** each session re-sends its whole growing context,
# so a cache holding the live sessions hits almost everything, 0.953 at 8.4M cached tokens
# (67.65 GB), within one device's budget.
#
# An infinite cache serves 0.374 of the real trace's prompt tokens, close to the cache
# ratio of about 40% Mooncake reports for it ([mooncake](references.md#mooncake)). The
# deep dives tabulate every hit rate, price the hits in prefill time (on the agent
# sessions 982.01 ms saved of a 1,040 ms cold prefill, were every hit usable; 912–1,480 ms
# across chapter 3's 36 plausible kernel sets, and about 0.95 of the cold prefill under every one), and show
# that token-exact matching of partial blocks lifts the chat workload from 0.717 to 0.807.
#
# ### Deep dive: every hit rate, the hits in prefill time, and Mooncake's reported ratios

# %%
print(f"Kimi-Linear-48B KV: {kv_bytes:,d} bytes per token per device ({kv_bytes * 1e6 / 1e9:.1f} GB per million "
      f"tokens);")
print(f"  one TP4 device has {budget / 1e9:.1f} GB for its cache = {budget / kv_bytes / 1e6:.1f}M tokens")
big = capacities[-1] * 512 * kv_bytes / 1e9
print(f"33.6M cached tokens: {big:.2f} GB on EVERY TP4 device = {big / budget * 1e9:.2f}x its cache budget;")
print(f"  sharded over DP-attention's 4 devices {big / 4:.2f} GB each "
      f"({big / 4 / (costs.cache_budget_bytes(CFG, DP) / 1e9):.2f}x a DP device's budget)")
for key in ("mooncake", "claude-code", "conversation"):
    print(f"{key}: {len(replayed[key]):,} requests, {sum(r.input_length for r in replayed[key]):,} prompt tokens")
cap_names = [f"{b * 512 / 1e3:.0f}k" if b * 512 < 1e6 else f"{b * 512 / 1e6:.1f}M" for b in capacities]
show_table([[key, *hit[key], ceiling[key]] for key in replayed], ["trace", *cap_names, "infinite"],
           formats={c: ".3f" for c in [*cap_names, "infinite"]}, title="Token-weighted hit rate by capacity (tokens)")

# %% [markdown]
# The real chat trace stays at the shared first block's share (0.043) up to 131k cached
# tokens; the agent sessions reach 0.841 at 2.1M. Sharded over the four devices of
# DP-attention the chat trace's 33.6M tokens would be 67.65 GB each, but a DP rank only
# hits its own cache, so that needs prefix-aware routing (chapter 10); fitting it into one
# instance needs a second tier (chapter 6). Chapter 3's cost model prices the prefill each request skips, for
# the 48B model on the TP4 recipe, as if every hit were usable (chapter 6 shows it is not
# for a hybrid):

# %%
saved_ms = {key: [results[key, b].prefill_ms_saved_per_request for b in capacities] for key in replayed}
fig, ax = plt.subplots(figsize=(7.5, 4.3))
for key in replayed:
    ax.plot(x, saved_ms[key], marker="o", **style(key))
ax.axvline(budget / kv_bytes, color="black", linestyle="--", linewidth=0.8)
ax.set(xscale="log", yscale="log", xlabel="cache capacity (cached tokens)",
       ylabel=f"prefill saved per request (ms, {DEP.name}, log)",
       title="Prefill time saved, were every hit usable (48B)")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
plots.save(fig, "ch05-prefill-saved-vs-capacity")
plt.show()
rows = [[key, saved_ms[key][0], saved_ms[key][-1], 1e3 * results[key, capacities[-1]].prefill_seconds_cold
         / results[key, capacities[-1]].requests] for key in replayed]
show_table(rows, ["trace", f"saved at {cap_names[0]}", f"saved at {cap_names[-1]}", "cold prefill"],
           formats={c: ",.2f" for c in (f"saved at {cap_names[0]}", f"saved at {cap_names[-1]}")}
           | {"cold prefill": ",.1f"}, title=f"Prefill per request, ms ({DEP.name})")

# %% [markdown]
# Takeaway: prefill time saved per request climbs with capacity until each trace's reuse
# ceiling; the agent sessions, which re-send their whole context, save by far the most, and
# the real chat trace needs the most capacity before it saves anything.

# %%
forty = next((b * 512 for b, h in zip(capacities, hit["mooncake"]) if h >= 0.40), None)
print(f"real trace: hit rate >= 0.40 at "
      f"{'no capacity swept (its ceiling is below 0.40)' if forty is None else f'{forty:,d} tokens'}")
for key in ("mooncake", "claude-code"):
    r = simulate(replayed[key], cache=prefix.RunPrefixCache(CFG, prefix.KVOnly(), deployment=DP, block_size=512,
                                                           capacity_tokens=capacities[-1] * 512))
    print(f"{key:<12} at {cap_names[-1]} tokens under {DP.name}: {r.prefill_ms_saved_per_request:8.2f} ms saved "
          f"of a {1e3 * r.prefill_seconds_cold / r.requests:,.1f} ms cold prefill")
# The band: the agent sessions' hits (TP4, 33.6M tokens) priced under each of the 36 plausible kernel sets
# (costs.members, chapter 3), on every 4th request in arrival order to keep it to seconds.
kept = simulate(replayed["claude-code"], keep_per_request=True, cache=prefix.RunPrefixCache(
    CFG, prefix.KVOnly(), deployment=DEP, block_size=512, capacity_tokens=capacities[-1] * 512))
order = sorted(replayed["claude-code"], key=lambda r: r.arrival_ms)  # simulate's order (a stable sort)
sample = [(r.input_length, out.usable_hit) for r, out in zip(order, kept.per_request)][::4]
priced = {}  # kernels -> (seconds saved, cold seconds) over the sample


def saved_and_cold(dep):
    if dep.kernels not in priced:
        timer = costs.StepTimer(CFG, dep)
        priced[dep.kernels] = (sum(timer.prefill_saved(n, h) for n, h in sample), sum(timer.prefill(n) for n, _ in sample))
    return priced[dep.kernels]


ms = costs.band(lambda d: 1e3 * saved_and_cold(d)[0] / len(sample), DEP)
share = costs.band(lambda d: saved_and_cold(d)[0] / saved_and_cold(d)[1], DEP, lambda f: f > 0.9)
print(f"claude-code (every 4th request), saved: {ms.describe('{:,.0f}', 'ms')}")
print(f"  share of the cold prefill, over 0.9: {share.describe('{:.3f}')}")

# %% [markdown]
# On the conversation trace a cache saves 1.98 ms of a 67.1 ms cold prefill per request
# while it holds only the shared first block, and 21.22 ms at 33.6M cached tokens; on the
# agent sessions 982.01 ms of 1,040 ms. Under DP-attention the same hits save more time,
# because a request's whole prefill runs on one device. The chat workload's prompts are
# short, so even its 0.717 hit rate is worth 6.30 ms. The last line prices the agent
# sessions' hits under each of the 36 kernel sets (on every 4th request, 975 ms under the
# central one): the milliseconds move by half, the share of the cold prefill a hit skips
# hardly at all, because a hit skips the same work whatever the kernels cost.
#
# **Against Mooncake's reported cache ratios.** Mooncake reports a cache ratio of about
# 40% for this conversation trace ([mooncake](references.md#mooncake)). Replaying the
# same trace, an infinite block cache serves 0.374 of its prompt tokens, close to the
# reported figure: their 40% is near what any cache could get from this traffic, and no
# capacity in our sweep gets a plain LRU cache past 40% (its ceiling is below it). The
# generated conversation-like trace claims a ceiling of 0.669 over the whole hour, 1.79
# times the real one; an argument built on it would have overstated every prefix-caching
# gain by that much. Mooncake reports 59% for its own tool-and-agent trace; the Claude
# Code sessions' 0.959 is a coding agent re-sending its entire context every step, not a
# number to compare one for one.
#
# ### Deep dive: whole blocks lose the tail
#
# A block cache only matches whole blocks. A chat turn re-sends the previous prompt plus
# a reply and a new message, but the previous prompt's partial last block is not a full
# block, so it is recomputed. A radix tree that keeps tokens can match *inside* a block
# (`partial_blocks=True`, token-exact, as SGLang's per-token tree does). For the chat
# workload, with an unlimited cache:

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
# story: the KV of a shared prefix is the same for every request that shares it. A hybrid
# model also has KDA layers (20 of 27 in Kimi-Linear-48B), each of which keeps no
# per-token KV but one state matrix that every token overwrites (chapter 2). To continue
# from position p it needs **the state at exactly p**, and the cache above stored KV only.
#
# On the tiny model: turn 1 is a system prompt and a question; the model replies
# (untrained, so the reply is noise); turn 2 re-sends all of it plus a follow-up. The
# reference is a cold prefill of turn 2; turn 1, served first, leaves the KV of every
# global layer for all its tokens.

# %%
tok, model, BLOCK = ByteTokenizer(), Model(tiny, seed=0), 16
turn1 = tok.encode("System: you are a careful assistant.\nUser: what is a KV cache, briefly?\n")
reply = model.generate(turn1, 12)
turn2 = turn1 + reply + tok.encode("User: and a KDA state?\n", bos=False)
kv_tree = RadixTree(PagePool(64, 64, backed=False), BLOCK)
kv_tree.serve(tokens=turn1)
kv_hit = kv_tree.match(tokens=turn2).hit_tokens
print(f"turn 1: {len(turn1)} tokens; reply: {len(reply)} tokens; turn 2: {len(turn2)} tokens")
print(f"the block radix tree (block {BLOCK}) finds a KV hit of {kv_hit} tokens for turn 2")
cold, cache1 = model.new_cache(), model.new_cache()
logits_cold = model.prefill(turn2, cold)  # the reference
model.prefill(turn1, cache1)  # turn 1 as an engine serves it
shared_kv = {i: (cache1.kv(i)[0][:kv_hit], cache1.kv(i)[1][:kv_hit]) for i in tiny.attn_layers}

# %% [markdown]
# The hit is 4 whole blocks; turn 1's last 9 tokens sit in a partial block. The shared
# KV is right (the deep dive checks it). But the KDA layers need their state at position
# 64, and the only state turn 1 left behind is the one at its end (73). Resuming with the
# shared KV and *zero* KDA states, or the end-of-turn-1 states, gives wrong logits:

# %%
def resume(states, n):
    """A cache at position n: shared KV for the global layers, the given (KDA, conv) states for KDA layers."""
    c = model.new_cache()
    for i in tiny.attn_layers:
        c.append_kv(i, *shared_kv[i])
    for i in tiny.kda_layers:
        c.set_kda_state(i, states[i][0])
        c.set_conv_state(i, states[i][1])
    c.advance(n)
    return c


ends = {i: (cache1.kda_state(i), cache1.conv_state(i)) for i in tiny.kda_layers}
for name, states in (("zero KDA states", {i: tuple(np.zeros_like(s) for s in ends[i]) for i in ends}),
                     ("states from the end of turn 1", ends)):
    out = model.prefill(turn2[kv_hit:], resume(states, kv_hit))
    err = np.max(np.abs(out - logits_cold[kv_hit:]))
    agree = np.mean(out.argmax(-1) == logits_cold[kv_hit:].argmax(-1))
    print(f"resume at {kv_hit} with {name:<29}: max |logit diff| {err:.2e}, greedy tokens agree {agree:.0%}")

# %% [markdown]
# A KDA state cannot be *cut* back to position 64: it is not a sum over tokens that could
# be subtracted (chapter 2). With a checkpoint of the states at exactly 64 plus the shared
# KV, the resume is exact, and only the last tokens are recomputed:

# %%
probe = model.new_cache()
model.prefill(turn1[:kv_hit], probe)
ckpt = probe.checkpoint()  # what a state checkpoint at position 64 holds
restored = HybridCache.from_checkpoint(tiny, ckpt, kv=shared_kv)
out = model.prefill(turn2[kv_hit:], restored)
same_logits = np.max(np.abs(out - logits_cold[kv_hit:])) < 1e-10
same_states = all(np.max(np.abs(restored.kda_state(i) - cold.kda_state(i))) < 1e-10 for i in tiny.kda_layers)
print(f"resume from checkpoint at {kv_hit}: logits equal cold prefill (max |diff| < 1e-10): {same_logits};")
print(f"  final KDA states equal: {same_states}")

# %% [markdown]
# At trace scale, a KV-only prefix cache lets a hybrid model resume nowhere: its *usable*
# hit rate is zero on every workload above, at any capacity, where an attention model
# would have saved 0.374 of the real trace's prompt tokens. The fix is to keep state
# checkpoints too, but one Kimi-Linear-48B checkpoint is large:

# %%
show_table([[dep.name, costs.checkpoint_bytes(CFG, dep) / 1e6, costs.checkpoint_bytes(CFG, dep) / kv_bytes,
             costs.checkpoint_bytes(CFG, dep) / (kv_bytes * 512)] for dep in (DEP, DP)],
           ["deployment", "MB per device", "= KV of tokens", "= 512-token blocks"],
           formats={"MB per device": ".2f", "= KV of tokens": ",.0f", "= 512-token blocks": ".2f"},
           title="One Kimi-Linear-48B state checkpoint, per device")

# %% [markdown]
# A checkpoint at every block boundary would cost 2.63 times more memory than the KV it
# makes usable under TP4 and 10.52 times under DP-attention, where a device holds whole
# requests (vLLM prices it per layer group instead; chapter 6 works through both). The
# deep dive serves both turns through a real prefix cache on the tiny model: with a
# KV-only cache the hybrid skips none of turn 2's prompt tokens, with state checkpoints
# 64, the same as an attention-only model. It also checks that the shared KV was exact
# and that the end-of-turn state is far from the one at 64.
#
# ### Deep dive: a real prefix cache on the tiny model, the shared KV, and the state gap
#
# Serve turn 1 and then turn 2 through a prefix cache holding the tiny model's real KV
# pages and states (`kimilab.prefix.ModelPrefixCache`, chapter 6 builds it), once with a
# policy that keeps **no** states (a KV-only cache, a three-line policy) and once with
# `ends`, which checkpoints the state where each request's last whole block ends. An
# attention-only model would resume at the KV hit the radix tree found.

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


scenarios = {"no-cache": ("no cache", 0), "kv-only": ("KV hit, attention-only model", kv_hit),
             "kda-state": ("KV-only cache, hybrid model", served(NoStates())),
             "checkpoint": ("KV + state checkpoints (ends), hybrid", served("ends"))}
show_table([[name, saved, len(turn2) - saved] for name, saved in scenarios.values()],
           ["cache", "tokens saved", "tokens recomputed"], title=f"Turn 2 ({len(turn2)} prompt tokens), tiny model")

# %% [markdown]
# The radix tree finds the same 64-token KV hit in every cached case, but the hybrid
# model can use it only when a state checkpoint at that position exists; with the
# KV-only cache it recomputes every token of turn 2, exactly like no cache. The shared KV
# itself was exact, the end-of-turn state is far from the one at 64, and the checkpoint
# is small for `tiny`:

# %%
same_kv = all(np.max(np.abs(shared_kv[i][0] - cold.kv(i)[0][:kv_hit])) < 1e-10 for i in tiny.attn_layers)
print(f"global layers {list(tiny.attn_layers)}: cached KV of the first {kv_hit} tokens")
print(f"  equals turn 2's own KV (max |diff| < 1e-10): {same_kv}")
gap = max(np.max(np.abs(ckpt.kda_states[i] - cache1.kda_state(i))) for i in tiny.kda_layers)
print(f"max |S({len(turn1)}) - S({kv_hit})| over KDA layers = {gap:.2e}")
print(f"checkpoint size: {ckpt.nbytes:,} bytes for tiny; {costs.checkpoint_bytes(CFG, costs.ONE_H200):,} bytes "
      f"for Kimi-Linear-48B (the whole model),")
print(f"  {costs.checkpoint_bytes(CFG, DEP):,} on one TP4 device")

# %%
from matplotlib.patches import Patch

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
# Takeaway: a KV hit alone leaves the hybrid recomputing its whole prompt; with a state
# checkpoint at the hit it serves exactly what an attention-only model serves.

# %% [markdown]
# ## Summary
#
# - **Built:** a replay of real chat and agent traffic in the Mooncake format (chained
#   block ids), and a radix tree of blocks with pinning and leaf-first LRU eviction.
# - **Real chat:** an infinite cache serves 0.374 of the Kimi trace's prompt tokens
#   (Mooncake reports about 40%), and 90% of that takes 270.58 GB of KV on every TP4
#   device, 2.74 times a device's cache budget. The agent sessions reach 0.953 within one
#   device (67.65 GB).
# - **Generated traffic:** a trace matching the real one's lengths overstated its reuse
#   by 1.79x (0.669): lengths do not determine reuse.
# - **Hybrid:** a KV hit is usable only where the KDA (and conv) state at that exact
#   position was kept. A KV-only cache saves a hybrid model nothing, and a checkpoint
#   costs 2.63 KV blocks per device under TP4, 10.52 under DP-attention.
#
# **Next chapter:** which positions should a hybrid's prefix cache keep state
# checkpoints at, and how many can it afford, so that its usable hits come close to the
# KV hits measured here?

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
# **5.3 Forgetting after five minutes (predict, then run).** Keep the infinite cache, but
# drop a block once it has gone five minutes (300 s of the trace's arrival times) without
# being used. First write down a prediction: will this cache keep most of the real
# Mooncake trace's `reuse` ceiling, or lose most of it? Then compute the token-weighted hit
# rate it reaches on the whole real trace (512-token blocks) and compare.

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
# **5.4 The tail no block cache holds (predict, then run).** A whole-block cache never
# stores the tokens after a prompt's last full block. First predict: with prompts of
# about 12k tokens on average, roughly what fraction of all prompt tokens of the real
# Mooncake trace sit in such partial last blocks (512-token blocks)? Then compute it.

# %% tags=["solution"]
lengths = np.array([r.input_length for r in traces["mooncake"]])
answer = float((lengths % 512).sum() / lengths.sum())

# %%
verify("5.4", answer)

# %% [markdown]
# **5.5 (open, ~45 min) Capacity and concurrency.** The agent sessions' start times are
# ours. Rebuild `traces["claude-code"]` with `wl.agent_requests(..., sessions_per_s)` at
# 0.01 and 0.2 sessions per second and replay each at 4,096 and 65,536 blocks. Why does
# the rate move the hit rate of a small cache and hardly that of a large one?
#
# **5.6 (open, ~45 min) Windows and turns of the generated trace.** (a) Replay all 12,044
# requests of the generated conversation-like trace at 4,096 blocks. Is the hit rate close
# to the 10-minute window's? Why might a window show a *higher* hit rate at equal
# capacity, or a lower one? Replay the first 10 minutes of the real trace the same way.
# (b) Generate `wl.mooncake_conversation_like(seed=0, mean_turns=1.5)` and compute
# `wl.reuse_upper_bound`. How many turns per conversation would make the ceiling about
# 40%?
