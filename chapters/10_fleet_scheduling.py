# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10. Scheduling: the engine and the fleet
#
# **What you'll build.** A continuous-batching engine (`kimilab.engine`) that serves
# many requests at once on the hybrid cache: chunked prefill sharing one token budget
# with decodes, admission against the ONE page pool that also holds the prefix cache,
# preemption by recompute. Then a fleet (`kimilab.fleet`): instances on one
# discrete-event clock behind five routers, a latency target and the most traffic the
# fleet serves within it (*goodput*), real agent sessions replayed closed-loop,
# instance failures, and per-tenant isolation.
#
# **What you'll learn.**
# - What a service-level objective (SLO) is, and why the capacity of a fleet is the
#   load at which it stops meeting one, not how busy it looks.
# - How routers differ only near that load: load-only routers (by requests, or by
#   prompt tokens), SGLang's cache-aware rule, a Dynamo-style predicted-TTFT router, and
#   a *state-aware* router that scores the prefill a hybrid model can actually skip.
# - How many concurrent coding-agent sessions one instance serves within a TTFT target.
# - What a failure costs near the knee, and what quotas and fair admission buy a quiet
#   tenant next to a flood.
#
# **What you'll need.** Chapters 4 (one page pool), 5 (radix tree, the real trace), 6
# (usable hits, the `ends` and `dual` policies) and 3 (the deployment and its step
# times). Time is simulated from the book's calibrated step model (`kimilab.costs`) at
# Kimi-Linear-48B sizes on the default deployment; nothing here runs the model, so the
# latencies are this cost model's, not measurements.

# %%
import dataclasses
import time

import matplotlib.pyplot as plt
import numpy as np

from kimilab import costs, plots
from kimilab.config import kimi_linear_48b
from kimilab.engine import Engine, InstanceMemory
from kimilab.engine.clock import DecodeClock
from kimilab.engine.reference import ReferenceEngine
from kimilab.exercises import verify
from kimilab.fleet import Fleet, StateAware, run_fleet
from kimilab.fleet.closed import run_closed_loop, session_turns
from kimilab.fleet.goodput import (AGENT_SLO, MOONCAKE_SLO, SloGuard, max_rate_scale, max_sessions, min_instances,
                                   priced, window)
from kimilab.fleet.sweep import run_many
from kimilab.fleet.tenants import merge_tenants
from kimilab.notebook import show_source
from kimilab.traffic import CLAUDE_CODE, MOONCAKE_CONVERSATION, Request, load_sessions, load_trace

plots.use_style()
CFG, DEP = kimi_linear_48b, costs.DEFAULT_DEPLOYMENT
TRACE = load_trace("../data/" + MOONCAKE_CONVERSATION)
CAPACITY = costs.capacity_tokens(CFG, DEP)  # each instance's pool: its devices' whole cache budget
RATE = len(TRACE) / (TRACE[-1].arrival_ms / 1e3)  # the trace's own request rate
stamps, per_stamp = np.unique([r.arrival_ms for r in TRACE], return_counts=True)
print(f"{len(TRACE):,} requests over {TRACE[-1].arrival_ms / 1e3:,.0f} s of the real trace: {RATE:.2f} requests/s")
print(f"they arrive in groups: {len(stamps):,} distinct timestamps, {np.median(np.diff(stamps)) / 1e3:.0f} s apart "
      f"(median), {per_stamp.mean():.1f} requests each")

# %% [markdown]
# The published timestamps are coarse: requests come in groups that share a timestamp.
# Replayed as published, each group is a burst, and a burst of ten long prompts on one
# instance queues behind itself even when the fleet is idle on average. Dividing the
# timestamps by a rate scale keeps the groups.
#
# ## The deployment, in one table
#
# Each instance is the default deployment, vLLM's published Kimi-Linear recipe: four
# H200s, tensor-parallel attention (chapter 3). Every byte below is per device, every
# second comes from the step model calibrated in chapter 3, and the pool is what the
# devices' memory holds once the weights and an activation reserve are taken out.

# %%
mem = InstanceMemory(CFG, deployment=DEP, capacity_tokens=CAPACITY)
step = costs.StepTimer(CFG, DEP)
rows = [
    ("deployment", DEP.describe()),
    ("KV bytes per token, per device", costs.kv_bytes_per_token(CFG, DEP)),
    ("one checkpoint (KDA + conv states), MB per device", round(costs.checkpoint_bytes(CFG, DEP) / 1e6, 2)),
    ("pool per instance (tokens of KV)", f"{CAPACITY:,}"),
    ("pages per live request's states / per checkpoint", mem.state_pages),
    ("token budget per step (decodes + prefill chunks)", DEP.max_batched_tokens),
    ("decode step, 1 request at 8k tokens (ms)", round(1e3 * step.step(1, 8192), 2)),
    ("decode step, 64 requests at 8k tokens (ms)", round(1e3 * step.step(64, 64 * 8192), 2)),
    ("a step with one full 8,192-token prefill chunk (ms)", round(1e3 * step.step(0, 0, [(8192, 0)]), 1)),
]
for name, value in rows:
    print(f"{name:<52} {value}")

# %% [markdown]
# Two numbers set the rest of the chapter. A decode step costs milliseconds whatever the
# batch (the weights are read once per step), so an instance can decode many requests
# at once. And a step that carries a full prefill chunk costs well over 100 ms: every
# request decoding in that step waits that long for its next token. That is the price of
# chunked prefill, and it is what makes a fleet miss a latency target first.
#
# ## The engine: one step
#
# A step serves every decoding request one token, then fills the rest of the token
# budget with prefill chunks, oldest admission first, as one forward pass. Steps that
# only decode are identical until a request finishes, crosses a page boundary or
# something arrives, so the engine jumps over them in one go. Admission pins the prompt's
# blocks in the prefix cache; the usable hit is where prefill starts. A block counts as a
# KV hit, and a checkpoint as a starting point, only once a prefill has passed its
# position; a request refused or preempted mid-prefill takes back, with `abandon`,
# everything it had not computed.

# %%
show_source(Engine._admit)

# %% [markdown]
# When the pool runs out while a request grows, the cache is evicted first (it is only a
# cache); if everything left is pinned by running requests, the newest running request
# is preempted and later recomputed from its usable hit. One instance with a small pool,
# the first requests at 40 times the trace's rate, to see it all:

# %%
one = Fleet(CFG, 1, "least-work", deployment=DEP, capacity_tokens=600_000, keep_steps=True)
res_one = one.run(TRACE[:400], rate_scale=40)
steps = np.array(one.instances[0].steps)  # start_s, dt_s, k, n_decode, prefill_tokens
mixed = (steps[:, 3] > 0) & (steps[:, 4] > 0)
print(f"steps simulated: {int(steps[:, 2].sum()):,} in {len(steps):,} loop iterations (decode-only runs jumped over)")
print(f"steps mixing decodes and a prefill chunk: {mixed.sum():,}; preemptions: {res_one.preemptions}; "
      f"refused: {res_one.refused}")
print(f"TTFT p50 {np.percentile(res_one.ttft_s, 50):.3f} s, p99 {np.percentile(res_one.ttft_s, 99):.3f} s; "
      f"usable hit {res_one.usable_hit_rate():.3f}")

# %%
fig, ax = plt.subplots(figsize=(9, 3.4))
t = steps[:, 0]
ax.step(t, steps[:, 3], where="post", color=plots.color("least-loaded"), lw=1.5, label="decoding requests in the step")
ax2 = ax.twinx()
ax2.plot(t, steps[:, 4], "o", ms=3, color=plots.color("checkpoint"), label="prefill tokens in the step")
ax.set_xlabel("simulated time (s)")
ax.set_ylabel("decoding requests")
ax2.set_ylabel("prefill tokens per step")
ax2.set_ylim(0, 1.15 * DEP.max_batched_tokens)
ax.set_title("One instance: batch composition per step")
h1, l1 = ax.get_legend_handles_labels()
h2, l2 = ax2.get_legend_handles_labels()
fig.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False, markerscale=2)
plots.save(fig, "ch10-batch-composition")
plt.show()

# %% [markdown]
# Takeaway: prefill chunks ride along with the decodes at every arrival, and the decode
# batch grows while requests overlap; a long prompt fills the token budget for several
# steps in a row, and every decode in those steps waits for it.
#
# ### Keeping a step cheap when the queue is long
#
# An overloaded instance has a long queue and a full batch. The engine's per-step work
# must not grow with either: the pages a router reads are a counter, not a sum over the
# queue; and decoding requests sit on a *decode clock*. Every decoder makes the same
# number of tokens in a step, so one counter says how many each has made since it
# started, and two heaps say when the next one needs a KV page and when the next one is
# done. A step touches only the requests something happens to.

# %%
show_source(DecodeClock._anchor)

# %% [markdown]
# `ReferenceEngine` is the same engine with the plain loop over the running batch; a
# property test holds the two equal on every latency, hit and preemption. Side by side
# on the trace's first 2,000 requests at 128 times its rate (wall clock, this machine):

# %%
# NBVAL_IGNORE_OUTPUT
timing = {}
for cls in (Engine, ReferenceEngine):
    t0 = time.process_time()
    r = run_fleet(TRACE[:2000], CFG, deployment=DEP, instances=4, router="prefix-affinity", capacity_tokens=CAPACITY,
                  rate_scale=128, engine_class=cls)
    timing[cls.__name__] = (time.process_time() - t0, r)
(fast_s, a), (slow_s, b) = timing["Engine"], timing["ReferenceEngine"]
print(f"plain loop {slow_s:.2f} s CPU, engine {fast_s:.2f} s CPU: {slow_s / fast_s:.1f}x; "
      f"same latencies: {np.array_equal(a.ttft_s, b.ttft_s) and np.array_equal(a.tpot_s, b.tpot_s)}")

# %% [markdown]
# ## A latency target, and goodput
#
# A fleet's capacity is not how busy it is. An instance that decodes a handful of
# requests steps all the time (the per-layer overhead alone is several milliseconds a
# step) and reads as busy while it could take ten times the load. Capacity is the most
# load it carries while its users still get the latency they were promised: a
# *service-level objective* (SLO) on time to first token (TTFT) and time per output
# token (TPOT). The highest load within it is the fleet's *goodput*, the word DistServe
# uses ([distserve](references.md#distserve)); Mooncake calls it effective request capacity.
#
# Two SLOs, each from the source of the traffic it judges:

# %%
for slo in (MOONCAKE_SLO, AGENT_SLO):
    print(f"{slo.describe()}\n    source: {slo.source}\n")

# %% [markdown]
# The conversation SLO is Mooncake's own ([mooncake-slo](references.md#mooncake-slo),
# section 5.1): a TTFT threshold of 30 s, and a time-between-tokens threshold of 100, 200 or 300
# ms. We hold the 99th percentile of each request's TPOT to the middle one, 200 ms: a
# single step carrying a full prefill chunk takes 176 ms on this deployment (the table
# above), so under the strictest threshold any request that shares one such step
# with a short reply misses, at any load. The agent SLO is the one the Claude Code
# sessions' own replay tool checks: TTFT p95 within 2 s
# ([kv-cache-tester](references.md#kv-cache-tester)).
#
# ## Routers: where a request goes decides what it hits
#
# Five routers behind one `choose(request, instances)`:
#
# - **least-loaded**: the fewest requests running or waiting;
# - **least-work**: the fewest prompt tokens still to prefill, so a 100k-token prompt
#   weighs a hundred 1k ones;
# - **prefix affinity**: SGLang's cache-aware rule
#   ([sglang-router](references.md#sglang-router)): the instance with the longest
#   cached prefix if it covers 30% of the prompt, unless the fleet is badly imbalanced;
#   it counts KV blocks;
# - **cost**: in the spirit of Dynamo's KV router
#   ([dynamo-selector](references.md#dynamo-selector)), which picks the worker with the
#   lowest cost, prefill blocks still to do there (this request's after its cached
#   overlap included) plus its decode load. Ours is a predicted TTFT in seconds: the
#   instance's prefill backlog plus this request's prefill after its *usable* hit;
# - **state-aware**: SGLang's rule scored in prefill seconds saved by the usable hit,
#   plus the checkpoint the request will leave behind where KV is cached but no state.

# %%
show_source(StateAware.choose)

# %% [markdown]
# The real trace's first 1,500 requests (about 8 minutes of Kimi's traffic) on 8
# instances with the `ends` policy, the arrival times divided by a rate scale, from
# idle to past the point where the tail explodes. Beside them, prefix affinity reading
# its own approximate tree instead of the instances' caches (`approximate=True`), and
# prefix affinity against state-aware under `align`, which keeps states sparsely:

# %%
ROUTERS = ["least-loaded", "least-work", "prefix-affinity", "cost", "state-aware"]
SWEEP = TRACE[:1500]
SCALES = [2, 8, 14, 20]
BASE = dict(deployment=DEP, instances=8, capacity_tokens=CAPACITY, policy="ends")
jobs = [dict(BASE, router=r, rate_scale=s) for s in SCALES for r in ROUTERS]
jobs += [dict(BASE, router="prefix-affinity", rate_scale=s, router_options={"approximate": True}) for s in SCALES]
jobs += [dict(BASE, router=r, rate_scale=s, policy="align") for s in SCALES[1:3] for r in ("prefix-affinity", "state-aware")]
out = iter(run_many(SWEEP, jobs))
sweep = {(r, s): next(out) for s in SCALES for r in ROUTERS}
sweep.update({("approximate", s): next(out) for s in SCALES})
aligned = {(r, s): next(out) for s in SCALES[1:3] for r in ("prefix-affinity", "state-aware")}
print(f"{'router':<17} {'scale':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p99':>9} {'usable hit':>10}")
for s in SCALES:
    for r in ROUTERS + ["approximate"]:
        o = sweep[r, s].summary()
        print(f"{r:<17} {s:>4}x {o['ttft_p50_s']:>8.3f}s {o['ttft_p99_s']:>8.2f}s {1e3 * o['tpot_p99_s']:>7.0f}ms "
              f"{o['usable_hit_rate']:>10.3f}")

# %%
fig, axes = plt.subplots(1, 3, figsize=(14, 4.0))
for r in ROUTERS + ["approximate"]:
    summ = [sweep[r, s].summary() for s in SCALES]
    axes[0].plot(SCALES, [o["ttft_p99_s"] for o in summ], "o-", **plots.style_of(r))
    axes[1].plot(SCALES, [1e3 * o["tpot_p99_s"] for o in summ], "o-", **plots.style_of(r))
    axes[2].plot(SCALES, [o["usable_hit_rate"] for o in summ], "o-", **plots.style_of(r))
axes[0].axhline(MOONCAKE_SLO.ttft_s, color="k", ls=":", lw=1, label="SLO limit")
axes[1].axhline(1e3 * MOONCAKE_SLO.tpot_s, color="k", ls=":", lw=1, label="SLO limit")
for ax, ylab in zip(axes, ["TTFT p99 (simulated s, log)", "TPOT p99 (simulated ms, log)",
                           "usable hit rate (fraction of prompt tokens)"]):
    ax.set_xlabel(f"rate scale (x the trace's {RATE:.1f} requests/s)")
    ax.set_ylabel(ylab)
axes[0].set_yscale("log")
axes[1].set_yscale("log")
axes[0].set_title("Tail TTFT across the knee")
axes[1].set_title("Tail TPOT across the knee")
axes[2].set_title("What routing finds in cache")
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, frameon=False)
fig.subplots_adjust(wspace=0.3)
plots.save(fig, "ch10-routers-vs-rate")
plt.show()
pa, sa, lw, co, ap = (sweep[r, 14].summary() for r in ("prefix-affinity", "state-aware", "least-work", "cost",
                                                      "approximate"))
print(f"at 14x: TTFT p99 least-work {lw['ttft_p99_s']:.2f} s, prefix affinity {pa['ttft_p99_s']:.2f} s, "
      f"cost {co['ttft_p99_s']:.2f} s, state-aware {sa['ttft_p99_s']:.2f} s, its own tree {ap['ttft_p99_s']:.2f} s")
print(f"at 14x: usable hit prefix affinity {pa['usable_hit_rate']:.3f}, cost {co['usable_hit_rate']:.3f}, "
      f"state-aware {sa['usable_hit_rate']:.3f}, its own tree {ap['usable_hit_rate']:.3f}")
for s in SCALES[1:3]:
    p, q = (aligned[r, s].summary() for r in ("prefix-affinity", "state-aware"))
    print(f"align, {s}x: usable hit prefix affinity {p['usable_hit_rate']:.3f}, state-aware {q['usable_hit_rate']:.3f}; "
          f"TTFT p99 {p['ttft_p99_s']:.2f} s vs {q['ttft_p99_s']:.2f} s")

# %% [markdown]
# Takeaway: at twice the trace's rate every router meets the SLO and the tails barely
# differ; the routers separate near the knee. The load-only routers find about a third
# of the hits the cache-aware ones find, and past the knee their tails are the first to
# explode (least-work, counting tokens, holds out longer than least-loaded). The
# Dynamo-style cost router minimises each request's own predicted TTFT, so it has the
# lowest tail below the knee (it balances best), but as load grows it sends more requests
# away from the busy instance that holds their prefix: each such move recomputes a whole
# prompt elsewhere, its hit rate falls with load, and past the knee its tail is worse than
# prefix affinity's. State-aware routing is a near tie with prefix affinity: a slightly
# lower tail up to the knee, a slightly higher one far past it, the same hits under `ends`
# and under `align` (a request-end state at every turn leaves little for it to find that
# KV hits miss). That is the finding: scoring states pays little when the policy keeps a
# state wherever a conversation will return. Past the knee, prefix affinity on its own
# approximate tree (what SGLang's router keeps) does best of all: it records a prompt when
# it routes it, while an instance's cache learns it only when the request is admitted.
# With long queues a conversation's next turn arrives while the previous one is still
# waiting, the real caches do not show it yet, and the turn goes elsewhere. The
# approximate tree never sees an eviction either, but with each device's whole memory as
# the pool these requests hardly evict anything. Past 8 times the trace's rate TPOT p99
# sits at one prefill chunk's step time for every router: every step carries a chunk.
#
# ## Goodput: the most traffic within the SLO
#
# Goodput is found by bisection on the rate scale: a replay either meets the SLO or not,
# and latencies grow with load. A replay that is clearly over the target stops early: once
# more requests have missed it than the 99th percentile allows, no later request can bring
# the percentile back.

# %%
show_source(SloGuard.check)

# %% [markdown]
# A prefix of the trace is only a fair test if its span at the knee is long against the
# 30 s TTFT limit: compress a few minutes of traffic enough and the whole prefix arrives
# inside one TTFT window, so a fleet can absorb it as one burst and look faster than it
# is. So the chapter asks one instance about the first 1,500 requests (about 8 minutes of
# traffic, still several minutes long at the knee); chapter 11 runs the same search on
# the whole hour and 8 instances (`make experiment`).

# %%
GOOD = TRACE[:1500]
SPAN = GOOD[-1].arrival_ms / 1e3


def one_instance(scale):
    return run_fleet(GOOD, CFG, deployment=DEP, instances=1, router="prefix-affinity", capacity_tokens=CAPACITY,
                     rate_scale=scale, policy="ends", guard=SloGuard(MOONCAKE_SLO, GOOD))


best, knee, tried = max_rate_scale(one_instance, MOONCAKE_SLO, start=1.0, rel_tol=0.06)
p = priced(knee, span_s=SPAN / best, price_per_hour=2.0)
got = window(knee, MOONCAKE_SLO)
print("tried:", ", ".join(f"{s:.2f}x {'pass' if ok else 'miss'}" for s, ok in tried))
print(f"goodput of one instance: {best:.2f}x the trace's rate = {p['requests_per_s_per_instance']:.2f} requests/s "
      f"({p['output_tokens_per_s_per_instance']:,.0f} output tokens/s); at that load TTFT p99 {got['ttft_s']:.1f} s, "
      f"TPOT p99 {1e3 * got['tpot_s']:.0f} ms; busy {p['busy_fraction']:.0%} of the time")
print(f"cost at the SLO: {p['usd_per_m_output']:.2f} USD per million output tokens at 2 USD per accelerator-hour")
tenth = priced(one_instance(best / 10), span_s=SPAN / (best / 10), price_per_hour=2.0)
print(f"at a tenth of that load the same instance is still busy {tenth['busy_fraction']:.0%} of the time, "
      f"at {tenth['usd_per_m_output']:.2f} USD per million output tokens")

# %% [markdown]
# The other question a capacity planner asks: how many instances serve a given rate?
# The same requests at 6 times their rate, the fewest instances that keep the SLO:

# %%
def fleet_of(n):
    return run_fleet(GOOD, CFG, deployment=DEP, instances=n, router="prefix-affinity", capacity_tokens=CAPACITY,
                     rate_scale=6, policy="ends", guard=SloGuard(MOONCAKE_SLO, GOOD))


n_min, sized, tried_n = min_instances(fleet_of, MOONCAKE_SLO)
ps = priced(sized, span_s=SPAN / 6, price_per_hour=2.0)
print("tried:", ", ".join(f"{n} {'pass' if ok else 'miss'}" for n, ok in tried_n))
print(f"{len(GOOD) / SPAN * 6:.1f} requests/s need {n_min} instances: {ps['requests_per_s_per_instance']:.2f} requests/s "
      f"each, {ps['usd_per_m_output']:.2f} USD per million output tokens, busy {ps['busy_fraction']:.0%}")

# %% [markdown]
# Takeaway: one instance of the default deployment serves the printed number of chat
# requests a second within Mooncake's SLO, and at that load it is busy nearly all the
# time; a fleet sized to a target rate is the rate over that, rounded up. Busy is not
# the same as full: at a tenth of its goodput the same instance is still stepping about a
# third of the time, not a tenth (printed above), because a small decode batch steps as
# often as a large one; and every token costs ten times as much.
#
# ## Real agent traffic: concurrent sessions within a TTFT target
#
# Coding agents are a different shape of traffic: a session's prompts grow turn by turn
# to hundreds of thousands of tokens, nearly all of it the previous turn's prompt, and
# the next request is sent when the previous reply is back, after the tool or the user
# has done its part. So the agent replay is *closed-loop*: each request of the 80 real
# Claude Code sessions waits for the latest reply it could have seen, plus the think time
# the recording shows (capped at 60 s, as the sessions' replay tool caps it). N sessions
# run at once; when one ends, its slot starts the next, with fresh block ids.

# %%
SESSIONS = session_turns(load_sessions("../data/" + CLAUDE_CODE))
think = np.array([t.think_s for s in SESSIONS for t in s if t.after >= 0])
print(f"{len(SESSIONS)} sessions, {sum(map(len, SESSIONS)):,} requests; think time median {np.median(think):.1f} s, "
      f"p90 {np.percentile(think, 90):.0f} s (capped at 60 s)")
show_source(run_closed_loop)

# %%
def agents(n):
    fleet = Fleet(CFG, 1, "prefix-affinity", deployment=DEP, capacity_tokens=CAPACITY, policy="ends")
    return run_closed_loop(fleet, SESSIONS, concurrency=n, duration_s=900.0, seed=0)


cap_n, cap_res, tried_a = max_sessions(agents, AGENT_SLO, start=16, rel_tol=0.1)
pa_ = priced(cap_res, span_s=900.0, price_per_hour=2.0)
print("tried:", ", ".join(f"{n} {'pass' if ok else 'miss'}" for n, ok in tried_a))
print(f"one instance serves {cap_n} concurrent sessions within {AGENT_SLO.describe()}: "
      f"{pa_['requests_per_s_per_instance']:.2f} requests/s, {pa_['output_tokens_per_s_per_instance']:.0f} output "
      f"tokens/s, {pa_['usd_per_m_output']:.2f} USD per million output tokens; usable hit "
      f"{cap_res.usable_hit_rate():.3f}")

# %% [markdown]
# Takeaway: the agent sessions reuse almost everything (the usable hit above), so an
# instance spends its time on the new tokens of each turn and on decoding next to
# contexts of a hundred thousand tokens; its TTFT tail comes from the few turns that are
# not cached: a session's first request, and turns whose new content is a long tool
# output. Chapter 11 asks the same question of every variant.
#
# ## Failures near the knee: the cache dies with the instance
#
# One of 8 instances fails a third of the way through the trace's first 2,400 requests,
# replayed at 14 times their rate: near the knee, where the other seven have little room
# to take its work. Its running and waiting requests are routed again and recompute; the
# routers stop sending to it. Two reference runs without a failure separate what it
# costs: the same 8 instances (what the failure costs in all), and 7 instances that never
# had the eighth (what the lost capacity costs for good).

# %%
FAIL_SCALE, WINDOW = 14, 10.0
FTRACE = TRACE[:2400]
FAIL_AT = FTRACE[len(FTRACE) // 3].arrival_ms / 1e3 / FAIL_SCALE
fjobs = [dict(BASE, router="state-aware", rate_scale=FAIL_SCALE, instances=n, fails=f)
         for n, f in ((8, [(3, FAIL_AT)]), (8, []), (7, []))]
failed, eight, seven = run_many(FTRACE, fjobs)
lost = failed.restarts
after = failed.arrival_s > FAIL_AT
for name, res in (("8 instances, one fails", failed), ("8 instances", eight), ("7 instances", seven)):
    a = res.arrival_s > FAIL_AT
    print(f"{name:<24} arrivals after the failure: TTFT p99 {np.percentile(res.ttft_s[a], 99):6.2f} s, "
          f"TPOT p99 {1e3 * np.percentile(res.tpot_s[a & (res.output_tokens > 1)], 99):4.0f} ms, "
          f"usable hit {res.usable_hit_rate(a):.3f}")
print(f"the failure at {FAIL_AT:.0f} s re-routed {lost} requests")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for res, name, style in ((failed, "8 instances, one fails", "-"), (eight, "8 instances", "--"),
                         (seven, "7 instances", ":")):
    w = res.window(WINDOW)
    axes[0].plot(w["t_s"], w["ttft_p99_s"], style, marker="o", ms=3, color=plots.color("state-aware"), label=name)
    axes[1].plot(w["t_s"], w["usable_hit_rate"], style, marker="o", ms=3, color=plots.color("state-aware"), label=name)
for ax in axes:
    ax.axvline(FAIL_AT, color="k", lw=1, label="instance 3 fails")
    ax.set_xlabel("arrival time (simulated s)")
axes[0].set_yscale("log")
axes[0].set_ylabel(f"TTFT p99 per {WINDOW:.0f} s window (s, log)")
axes[1].set_ylabel(f"usable hit per {WINDOW:.0f} s window")
axes[0].set_title("Tail latency with one instance failing")
axes[1].set_title("What the fleet finds in cache")
axes[1].legend(fontsize=8, loc="lower right")
plots.save(fig, "ch10-failure")
plt.show()

# %% [markdown]
# Takeaway: near the knee a failure is not a blip. The re-routed requests recompute
# their prompts on instances that were already nearly full, and seven instances are at
# the edge of the SLO at this load: from the failure on, the failed fleet's tail tracks
# the seven-instance fleet's, far above the eight-instance one, and stays there. What the
# failure destroys for good is capacity. The lost cache is the smaller part: after the
# failure the fleet finds about as much in cache as the seven-instance fleet, a little
# less than eight instances would (the hit rates printed above).
#
# ## Budget isolation: a noisy neighbour
#
# Two tenants on one instance. `chat` replays real conversation requests at well under
# half of what the instance can serve within the SLO: less than its fair share, were the
# instance split evenly. `flood` sends long documents (each its own 48-block prompt) faster
# than the instance can serve them: alone, its queue grows without end. Without
# isolation they share one cache and one first-come-first-served queue. With isolation
# each tenant has its own cache with a reserved share of the pool that the other cannot
# evict, and admission picks the tenant with the smallest virtual token counter
# ([vtc](references.md#vtc)): the tenant that has been served less goes first.

# %%
show_source(InstanceMemory.reclaim)

# %%
CHAT_SCALE = 0.5
chat = [dataclasses.replace(q, arrival_ms=int(q.arrival_ms / CHAT_SCALE)) for q in TRACE[:240]]
span = chat[-1].arrival_ms
N_FLOOD = 3 * span // 1000  # three 24k-token documents a second
flood = [Request(i, int(i * span / N_FLOOD), 48 * 512, 64, hash_ids=tuple(range(48 * i, 48 * i + 48)))
         for i in range(N_FLOOD)]
TENANTS = merge_tenants([("chat", chat), ("flood", flood)])
njobs = [dict(deployment=DEP, instances=1, router="least-work", capacity_tokens=CAPACITY, policy="ends",
              isolation=iso) for iso in ("none", "quota")]
njobs.append(dict(njobs[0], requests=merge_tenants([("chat", chat)])))  # the chat tenant alone
*both, solo = run_many(TENANTS, njobs)
noisy = dict(zip(["none", "quota"], both))
print(f"chat asks {len(chat) / (span / 1e3):.2f} requests/s (one instance's goodput above: "
      f"{p['requests_per_s_per_instance']:.2f}); flood asks {N_FLOOD / (span / 1e3):.1f} documents/s")
for name, res in (("chat alone", solo), ("shared, FIFO", noisy["none"]), ("quotas + VTC", noisy["quota"])):
    ten = res.summary()["tenants"]
    c = ten["chat"]
    f = ten.get("flood")
    fl = f"flood TTFT p99 {f['ttft_p99_s']:7.1f} s" if f else ""
    print(f"{name:<14} chat: TTFT p50 {c['ttft_p50_s']:6.2f} s, p99 {c['ttft_p99_s']:7.2f} s, usable hit "
          f"{c['usable_hit_rate']:.3f} | {fl} | preemptions {res.preemptions}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
for name, res, key in (("chat alone", solo, "least-loaded"), ("shared, FIFO", noisy["none"], "isolation-none"),
                       ("quotas + VTC", noisy["quota"], "isolation-quota")):
    m = res.tenant == "chat"
    ax.plot(res.arrival_s[m], res.ttft_s[m], "o", ms=3, alpha=0.7, color=plots.color(key),
            label=f"chat: {name}")
ax.set_yscale("log")
ax.set_xlabel("arrival time of the chat request (simulated s)")
ax.set_ylabel("TTFT (simulated s, log)")
ax.set_title("The quiet tenant's TTFT while a flood arrives")
ax.legend(fontsize=8, loc="upper left", markerscale=2)
plots.save(fig, "ch10-noisy-neighbour")
plt.show()

# %% [markdown]
# Takeaway: what the simulator shows is a queue. Without isolation the flood's documents
# arrive faster than the instance prefills them, so the one first-come-first-served queue
# grows for the whole run and every chat request waits behind all the documents that
# came before it: its TTFT rises with its arrival time, without bound. With fair
# admission the chat tenant, having been served less, is admitted ahead of the flood's
# backlog whenever it has a request waiting, so its TTFT stays near what it gets alone;
# the rest of the gap is compute the isolation does not reserve (the flood's admitted
# documents still share every step's token budget). The flood's own queue grows either
# way: it asks for more than the instance has. No request was preempted in any run (the
# counts above): the pool is large enough for everything admitted, so the whole story is
# admission order.
#
# ## Summary
#
# - One engine loop serves batches on the hybrid cache: chunked prefill in a shared
#   token budget, admission against one pool that also holds the prefix cache,
#   preemption by recompute, simulated time from the calibrated step model; its
#   per-step work does not grow with the queue.
# - Capacity is goodput: the most load within an SLO (Mooncake's for chat, the replay
#   tool's for agents), found by bisection; a busy fraction says nothing about it.
# - Routers differ only near the knee. Load-only routers lose the cache; a router that
#   minimises each request's own TTFT balances best below the knee but trades the cache
#   away as load grows; SGLang's rule keeps the hits, and scoring usable seconds instead
#   of KV blocks barely changes it when every turn leaves a state; a router tree that
#   records what it routes beats reading the caches once queues are long.
# - Near the knee a failure costs capacity for good, and the lost cache briefly.
# - Fair admission keeps a tenant that asks for less than its share out of another
#   tenant's backlog.
# - Honest scope: prefixes of real traces (the whole hour runs in chapter 11's
#   `make experiment`); a cost model, not a cluster.
#
# ## Exercises
#
# Checked exercises come in three cells: the question, a cell where you compute the
# answer, and `verify("N.M", answer)`.
#
# **10.1 One decode step.** How long is one decode step of 64 requests at `8192`
# tokens of context each on the default deployment?

# %% tags=["solution"]
answer = costs.decode_step_seconds(CFG, DEP, 8192, 64)

# %%
verify("10.1", answer)

# %% [markdown]
# **10.2 A reserved share.** An instance with `capacity_tokens=1_000_000`, two tenants
# and quotas: how many pages does each tenant reserve, with the fleet's default of half
# the pool split evenly?

# %% tags=["solution"]
answer = InstanceMemory(CFG, deployment=DEP, capacity_tokens=1_000_000, quotas={"a": 0.25, "b": 0.25}).reserved["a"]

# %%
verify("10.2", answer)

# %% [markdown]
# **10.3 The load-only baseline.** Run the first `1000` requests of the real trace on 4
# instances routed by request count, each instance with its devices' whole cache budget
# as the pool. What usable hit rate does the fleet get?

# %% tags=["solution"]
answer = run_fleet(TRACE[:1000], CFG, deployment=DEP, instances=4, router="least-loaded",
                   capacity_tokens=CAPACITY).usable_hit_rate()

# %%
verify("10.3", answer)

# %% [markdown]
# **10.4 (open) Sparse states.** Re-run the router sweep with the `align` policy at every
# scale and with `dual`. Where does state-aware routing beat prefix affinity, and by how
# much of the usable hit?
#
# **10.5 (open) Tenants on a failure.** Give each of two tenants its own four instances
# (a small router of your own) and fail one of tenant `a`'s near the knee. Does tenant
# `b` notice at all? What does `a` lose compared with sharing all eight?
#
# **10.6 Goodput per instance.** A fleet of 8 instances serves the whole trace within
# the SLO at up to 12.5 times its own rate. How many requests per second is that, per
# instance? (The trace's own rate is printed at the top of the chapter.)

# %% tags=["solution"]
answer = 12.5 * RATE / 8

# %%
verify("10.6", answer)
