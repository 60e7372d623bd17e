"""Prefix-cache replay speed on the real trace, per policy, and what each keeps of the attention bound.

Replays data/mooncake_conversation.jsonl (Moonshot's Mooncake conversation trace:
12,031 requests, 512-token blocks, its own timestamps) through every checkpoint
policy at Kimi-Linear-48B byte sizes per device of the default deployment, at 10 and
40 GB of cache memory, in this one process, through both prefix caches:
``RunPrefixCache`` (runs of blocks, what chapter 6 sweeps with) and its twin
``HybridPrefixCache`` (one node per block). The goal is a whole-trace replay under
0.5 s. Times are the best of three (wall clock and CPU), the ratio is block tree / runs
in this same run, and the two caches' usable hit rates must agree exactly; the first
replay of a model also fills the shared FLOP and prefill-time memos, which later
replays reuse, so it is timed apart. Then the caches of the designs that ship
(``sim.CACHES``: vLLM align at its own block, Marconi with a fixed alpha and with its
online tuning, SGLang's strategies, the clairvoyant cache), best of three, beside ``ends``.
"""

from __future__ import annotations

import time
from pathlib import Path

from kimilab.config import kimi_linear_48b
from kimilab.costs import DEFAULT_DEPLOYMENT as DEPLOYMENT, kv_bytes_per_token
from kimilab.prefix import POLICIES, HybridPrefixCache, RunPrefixCache, make_policy
from kimilab.sim import simulate
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

TRACE = Path(__file__).resolve().parent.parent / "data" / MOONCAKE_CONVERSATION
BLOCK = 512
GOAL_S = 0.5
GIGABYTES = (10, 40)


def _replay(records, name: str, capacity_tokens: int, runs: bool = True):
    if runs:
        cache = RunPrefixCache(kimi_linear_48b, make_policy(name), deployment=DEPLOYMENT, block_size=BLOCK,
                               capacity_tokens=capacity_tokens)
    else:
        cache = HybridPrefixCache.for_budget(kimi_linear_48b, make_policy(name), deployment=DEPLOYMENT, block_size=BLOCK,
                                             capacity_tokens=capacity_tokens)
    wall, cpu = time.perf_counter(), time.process_time()
    res = simulate(records, cache=cache)
    return res, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    start = time.perf_counter()
    records = load_trace(TRACE, BLOCK)
    load_s = time.perf_counter() - start
    n_blocks = sum(len(r.hash_ids) for r in records)
    print(f"trace: {TRACE.name}, {len(records)} requests, {n_blocks} blocks, loaded in {load_s:.2f} s")
    per_token = kv_bytes_per_token(kimi_linear_48b, DEPLOYMENT)
    print(f"per device of {DEPLOYMENT.describe()}")
    for gb in GIGABYTES:
        cap = int(gb * 1e9 // per_token)
        _, first, _ = _replay(records, "kv-only", cap)
        print(f"{gb} GB = {cap} tokens of 48B KV (first replay, filling the FLOP memo: {first:.2f} s)")
        kv = None
        for name in POLICIES:
            fast = [_replay(records, name, cap) for _ in range(3)]
            slow = [_replay(records, name, cap, runs=False) for _ in range(3)]
            res = fast[0][0]
            if res.usable_hit_rate != slow[0][0].usable_hit_rate:
                raise AssertionError(f"{name} at {gb} GB: the twins disagree")
            kv = kv if kv is not None else res.usable_hit_rate
            wall, cpu = min(r[1] for r in fast), min(r[2] for r in fast)
            slow_wall = min(r[1] for r in slow)
            print(f"replay_{name}_{gb}GB: runs {wall:.2f} s wall, {cpu:.2f} s CPU "
                  f"({'meets' if wall < GOAL_S else 'misses'} the {GOAL_S} s goal); block tree {slow_wall:.2f} s "
                  f"= {slow_wall / wall:.1f}x slower; usable hit {res.usable_hit_rate:.4f} "
                  f"= {res.usable_hit_rate / kv:.3f}x kv-only, {res.checkpoints_admitted} checkpoints")

def shipped() -> None:
    from kimilab.sim import Replay, replay

    for gb in GIGABYTES:
        base = min(replay(Replay(str(TRACE), "ends", gb, DEPLOYMENT)).wall_seconds for _ in range(3))
        for name, opts in (("vllm-align", ()), ("marconi", (("alpha", 0.5),)), ("marconi", ()), ("oracle", ()),
                           ("sglang-no-buffer", ()), ("sglang-extra-buffer", ())):
            wall = min(replay(Replay(str(TRACE), name, gb, DEPLOYMENT, options=opts)).wall_seconds for _ in range(3))
            tag = name + ("" if not opts else f"_alpha{dict(opts)['alpha']}")
            print(f"replay_{tag}_{gb}GB: {wall:.2f} s wall = {wall / base:.1f}x ends ({base:.2f} s)")


if __name__ == "__main__":
    main()
    shipped()
