"""Part B of the book's experiment: the same ablation at Kimi-Linear-48B sizes, on the real trace.

The real Mooncake conversation trace (``data/mooncake_conversation.jsonl``) is replayed
at its own timestamps on a fixed fleet of engine instances (chapter 10's simulator:
continuous batching, chunked prefill, one page pool per instance for running requests
and the prefix cache, step times from the ``costs`` roofline). Starting from a plain
baseline -- no prefix reuse, round-robin routing -- ONE component is toggled at a time:

* ``prefix:no-states``   a prefix cache that keeps KV blocks but no KDA state (Part A's
  lesson at scale: KV hits, no usable hit);
* ``prefix:every-block`` / ``prefix:dual`` KV + state checkpoints (chapter 6's policies);
* ``router:state-aware`` the router that scores usable hits, toggled over ``prefix:dual``
  (a cache-aware router has nothing to route on without a cache).

Speculative decoding is not here: ``costs.spec`` models one request's tokens per second,
and the engine's batched decode step has no hook for it, so speculation stays Part A only.

Every variant reports the usable and KV hit rates, TTFT p50/p99, TPOT p50/p99, throughput,
the prefill tokens computed, accelerator-seconds (provisioned: every device of every
instance for the whole run; busy: only while stepping) and the cost per million output
tokens at a stated price per accelerator-hour -- an estimate whose assumptions are
returned beside it. Everything is deterministic except the wall-clock fields, whose names
end in ``_wall_s``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace, reuse_upper_bound
from kimilab.validate import check_float, check_int

__all__ = ["Variant", "VARIANTS", "VARIANT_NAMES", "TRACE_PATH", "no_reuse", "run_variant", "run_part_b",
           "cost_per_m_output"]

TRACE_PATH = Path(__file__).resolve().parents[2] / "data" / MOONCAKE_CONVERSATION
BLOCK = 512  # the trace's block size (tokens per hash id)


@dataclass(frozen=True)
class Variant:
    """One row of the ablation: a prefix-cache policy (or none) and a router."""

    name: str
    policy: str | None  # None: no prefix reuse
    router: str
    over: str  # the variant this one toggles one component of


VARIANTS = (
    Variant("baseline", None, "round-robin", "-"),
    Variant("prefix:no-states", "no-states", "round-robin", "baseline"),
    Variant("prefix:every-block", "every-block", "round-robin", "baseline"),
    Variant("prefix:dual", "dual", "round-robin", "baseline"),
    Variant("router:state-aware", "dual", "state-aware", "prefix:dual"),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def no_reuse(requests) -> list:
    """The same requests with every block given an id no other request uses: no prefix can hit."""
    out, nxt = [], 1 << 50
    for r in requests:
        n = len(r.hash_ids) if r.hash_ids is not None else -(-r.input_length // BLOCK)
        out.append(dataclasses.replace(r, hash_ids=tuple(range(nxt, nxt + n))))
        nxt += n
    return out


def cost_per_m_output(accelerator_seconds: float, price_per_hour: float, output_tokens: int) -> float:
    """Dollars per million output tokens: accelerator-hours x price / output tokens x 1e6."""
    return accelerator_seconds / 3600.0 * price_per_hour / max(int(output_tokens), 1) * 1e6


def run_variant(requests, variant: Variant, *, deployment: costs.Deployment, instances: int, capacity_tokens: int,
                price_per_hour: float) -> dict:
    """Serve ``requests`` under one variant; one row of numbers (seconds are simulated unless named wall).

    Each instance is one ``deployment``: its pages, states and step times."""
    from kimilab.fleet import run_fleet

    reqs = no_reuse(requests) if variant.policy is None else requests
    policy = variant.policy or "kv-only"  # with unique block ids no policy can hit: states never matter
    t0 = time.perf_counter()
    res = run_fleet(reqs, kimi_linear_48b, deployment=deployment, instances=instances, router=variant.router,
                    capacity_tokens=capacity_tokens, policy=policy, block_size=BLOCK)
    wall = time.perf_counter() - t0
    s = res.summary()
    out_tok = int(res.output_tokens.sum())
    makespan = float((res.arrival_s + res.e2e_s).max()) if res.finished else 0.0  # the fleet is up from t = 0
    devices = deployment.n_devices
    accel = instances * devices * makespan
    busy = float(res.busy_s.sum()) * devices
    return {
        "variant": variant.name, "policy": variant.policy or "none (no prefix reuse)", "router": variant.router,
        "over": variant.over, "requests": res.requests, "finished": res.finished, "refused": res.refused,
        "preemptions": res.preemptions,
        "usable_hit_rate": s["usable_hit_rate"], "kv_hit_rate": s["kv_hit_rate"],
        "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
        "tpot_p50_s": s["tpot_p50_s"], "tpot_p99_s": s["tpot_p99_s"],
        "prompt_tokens": int(res.input_tokens.sum()), "usable_hit_tokens": s["usable_hit_tokens"],
        "prefill_tokens_computed": int(res.computed.sum()),
        "output_tokens": out_tok, "makespan_s": round(makespan, 6),
        "throughput_tokens_per_s": round(out_tok / makespan, 6) if makespan else 0.0,
        "accelerator_seconds": round(accel, 6), "busy_accelerator_seconds": round(busy, 6),
        "busy_fraction": round(busy / accel, 6) if accel else 0.0,
        "tokens_per_busy_accelerator_s": round(out_tok / busy, 6) if busy else 0.0,
        "cost_per_m_output_usd": round(cost_per_m_output(accel, price_per_hour, out_tok), 6),
        "busy_cost_per_m_output_usd": round(cost_per_m_output(busy, price_per_hour, out_tok), 6),
        "run_wall_s": round(wall, 3),
    }


def assumptions(*, deployment: costs.Deployment, instances: int, capacity_tokens: int, price_per_hour: float,
                n_requests: int, trace: str) -> dict:
    """What the estimate rests on, printed next to it."""
    cfg, dev = kimi_linear_48b, deployment.device
    return {
        "model": cfg.name, "trace": trace, "requests": n_requests, "arrivals": "the trace's own timestamps",
        "instances": instances, "deployment": deployment.describe(), "accelerator": dev.name,
        "accelerators_per_instance": deployment.n_devices,
        "attention_split": deployment.attention, "hbm_gb_per_accelerator": dev.hbm_bytes / 1e9,
        "hbm_tb_per_s_per_accelerator": dev.hbm_bandwidth / 1e12, "peak_tflops_per_accelerator": dev.peak_flops / 1e12,
        "kernels": {k: getattr(deployment.kernels, k) for k in ("gemm", "attention", "kda", "bandwidth",
                                                                 "layer_overhead_s")},
        "pool_tokens_per_instance": capacity_tokens,
        "pool_gb_per_device": round(capacity_tokens * costs.kv_bytes_per_token(cfg, deployment) / 1e9, 3),
        "block_tokens": BLOCK, "price_usd_per_accelerator_hour": price_per_hour,
        "notes": ["latencies are simulated seconds from the calibrated step model (chapter 3), not measurements",
                  "price is an assumption; every cost scales linearly with it",
                  "accelerator_seconds = instances x accelerators per instance x makespan (what a fixed fleet "
                  "rents); busy_accelerator_seconds counts only time an instance was stepping (a fleet sized "
                  "perfectly to its load)",
                  "throughput_tokens_per_s is output tokens over the makespan: at the trace's own timestamps it "
                  "is set by the arrivals; tokens_per_busy_accelerator_s is what the accelerators did while busy",
                  "speculative decoding: Part A only (no batched TPOT model to plug into the engine)",
                  "drafting, networking, host overheads and failures are not modelled"],
    }


def run_part_b(out: Path | str | None = None, *, deployment: costs.Deployment, n_requests: int | None = None,
               instances: int = 8, capacity_tokens: int = 2_000_000, price_per_hour: float = 2.0,
               trace: Path | str | None = None, variants=VARIANT_NAMES) -> dict:
    """Part B on the real trace (its first ``n_requests``, or all); writes ``out/part_b.json`` and ``.md``."""
    instances = check_int("instances", instances, 1)
    capacity_tokens = check_int("capacity_tokens", capacity_tokens, 1, unit="tokens of KV per instance")
    price_per_hour = check_float("price_per_hour", price_per_hour, minimum=0.0)
    unknown = [v for v in variants if v not in VARIANT_NAMES]
    if unknown or not variants:
        raise ValueError(f"variants={list(variants)!r}: expected a non-empty subset of {VARIANT_NAMES}")
    path = Path(trace) if trace is not None else TRACE_PATH
    if not path.is_file():
        raise FileNotFoundError(f"trace={str(path)!r}: no such file (the real trace ships in data/)")
    requests = load_trace(path, BLOCK)
    if n_requests is not None:
        requests = requests[:check_int("n_requests", n_requests, 1)]
    t0 = time.perf_counter()
    rows = [run_variant(requests, v, deployment=deployment, instances=instances, capacity_tokens=capacity_tokens,
                        price_per_hour=price_per_hour) for v in VARIANTS if v.name in variants]
    from kimilab.experiment.results import _version

    result = {
        "experiment": "part B: the ablation at Kimi-Linear-48B sizes on the real Mooncake conversation trace "
                      "(fleet simulator, simulated time)",
        "config": assumptions(deployment=deployment, instances=instances, capacity_tokens=capacity_tokens,
                              price_per_hour=price_per_hour, n_requests=len(requests), trace=path.name),
        "reuse_upper_bound": round(reuse_upper_bound(requests, BLOCK), 6),
        "kimilab": _version(),
        "rows": rows,
        "run_wall_s": round(time.perf_counter() - t0, 3),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        import json

        (out / "part_b.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (out / "part_b.md").write_text(part_b_table(result) + "\n", encoding="utf-8")
    return result


def part_b_table(result: dict) -> str:
    """Markdown: one row per variant, then the assumptions the cost rests on."""
    c = result["config"]
    lines = ["| variant | toggles over | usable hit | KV hit | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) "
             "| throughput (tok/s) | prefill computed | accel-s (busy) | $/M out (fleet) | $/M out (busy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['over']} | {r['usable_hit_rate']:.3f} | {r['kv_hit_rate']:.3f} "
                     f"| {r['ttft_p50_s']:.4f} | {r['ttft_p99_s']:.3f} | {1e3 * r['tpot_p50_s']:.3f} "
                     f"| {r['throughput_tokens_per_s']:,.0f} | {r['prefill_tokens_computed']:,} "
                     f"| {r['accelerator_seconds']:,.0f} ({r['busy_accelerator_seconds']:,.0f}) "
                     f"| {r['cost_per_m_output_usd']:.2f} | {r['busy_cost_per_m_output_usd']:.3f} |")
    lines += ["", f"Assumptions: {c['requests']:,} requests of {c['trace']} at {c['arrivals']}; {c['instances']} "
              f"instances of {c['accelerators_per_instance']} x {c['accelerator']} ({c['attention_split']} attention); "
              f"a pool of {c['pool_tokens_per_instance']:,} tokens of KV ({c['pool_gb_per_device']:g} GB per "
              f"device) per instance; ${c['price_usd_per_accelerator_hour']:g} per accelerator-hour. Infinite-cache hit-rate "
              f"ceiling of these requests: {result['reuse_upper_bound']:.3f}."]
    lines += [f"- {n}" for n in c["notes"]]
    return "\n".join(lines)
