"""Prefix-cache replay speed and what dual granularity keeps of the attention bound.

Replays data/conversation_like.jsonl (~12k requests, 512-token blocks, the
Mooncake-conversation-like trace) through the ``dual`` policy at
Kimi-Linear-48B byte sizes, and through ``kv-only`` (a pure-attention model's
upper bound) at the same memory, in this one process.
"""

from __future__ import annotations

import time
from pathlib import Path

from kimilab.config import kimi_linear_48b
from kimilab.costs import kv_bytes_per_token
from kimilab.prefix import HybridPrefixCache, make_policy
from kimilab.sim import simulate
from kimilab.traffic import load_trace

TRACE = Path(__file__).resolve().parent.parent / "data" / "conversation_like.jsonl"
BLOCK = 512
CAPACITIES = (1 << 20, 1 << 22)  # tokens of 48B KV: 8.5 GB and 33.8 GB


def main() -> None:
    start = time.perf_counter()
    records = load_trace(TRACE, BLOCK)
    load_s = time.perf_counter() - start
    n_blocks = sum(len(r.hash_ids) for r in records)
    print(f"trace: {len(records)} requests, {n_blocks} blocks, loaded in {load_s:.2f} s")
    for cap in CAPACITIES:
        gb = cap * kv_bytes_per_token(kimi_linear_48b) / 1e9
        dual, kv = (simulate(records, cache=HybridPrefixCache.for_budget(
            kimi_linear_48b, make_policy(name), block_size=BLOCK, capacity_tokens=cap)) for name in ("dual", "kv-only"))
        print(f"replay_dual_{cap}: {dual.wall_seconds:.2f} s for {dual.requests} requests "
              f"(goal < 5 s; kv-only replay {kv.wall_seconds:.2f} s; "
              f"{dual.requests / dual.wall_seconds:,.0f} requests/s)")
        print(f"dual_vs_kv_only_{cap}: ratio={dual.usable_hit_rate / kv.usable_hit_rate:.3f}x "
              f"(dual usable hit {dual.usable_hit_rate:.3f}, kv-only {kv.usable_hit_rate:.3f}, "
              f"memory {cap} tokens = {gb:.1f} GB, checkpoint share of memory "
              f"{dual.checkpoint_bytes_mean / (dual.checkpoint_bytes_mean + dual.kv_bytes_mean):.2f})")


if __name__ == "__main__":
    main()
