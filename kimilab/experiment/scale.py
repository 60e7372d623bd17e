"""Part B of the book's experiment: what each method is worth in instances and dollars at a latency target.

For every variant of :mod:`kimilab.experiment.variants` (prefix policy x router on the
hybrid, and the all-MLA transformer), on chapter 10's fleet simulator with the default
deployment's step times and each device's real HBM as the pool:

* **conversation** (the real Mooncake trace, open loop at its own timestamps divided by a
  rate scale): the highest scale ``instances`` instances serve within
  :data:`~kimilab.fleet.goodput.MOONCAKE_SLO` (TTFT p99 <= 30 s, TPOT p99 <= 100 ms),
  as requests/s per instance, and dollars per million output tokens for the fleet at
  that load;
* **agents** (the real Claude Code sessions, closed loop: each request a recorded think
  time after the reply it waited for): the most concurrent sessions ``agent_instances``
  instances serve within :data:`~kimilab.fleet.goodput.AGENT_SLO` (TTFT p95 <= 2 s), per
  instance, and dollars per million output tokens.

Each variant's row carries its ratio to the strong baseline (``ends`` + ``prefix-affinity``).
Everything is deterministic except the wall-clock fields, whose names end in ``_wall_s``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

from kimilab import costs
from kimilab.experiment.variants import BASELINE, VARIANT_NAMES, VARIANTS, Variant, model_of, variant
from kimilab.fleet import Fleet, run_fleet
from kimilab.fleet.closed import run_closed_loop, session_turns
from kimilab.fleet.goodput import (AGENT_SLO, MOONCAKE_SLO, SloGuard, max_rate_scale, max_sessions, priced,
                                   window)
from kimilab.traffic import CLAUDE_CODE, MOONCAKE_CONVERSATION, load_sessions, load_trace
from kimilab.validate import check_float, check_int

__all__ = ["TRACE_PATH", "SESSIONS_PATH", "no_reuse", "cost_per_m_output", "conversation_goodput",
           "agent_capacity", "run_part_b", "VARIANTS", "VARIANT_NAMES", "Variant"]

DATA = Path(__file__).resolve().parents[2] / "data"
TRACE_PATH = DATA / MOONCAKE_CONVERSATION
SESSIONS_PATH = DATA / CLAUDE_CODE
BLOCK = 512  # the traces' block size (tokens per hash id)


def no_reuse(requests) -> list:
    """The same requests with every block given an id no other request uses: no prefix can hit."""
    out, nxt = [], 1 << 50
    for r in requests:
        n = len(r.hash_ids) if r.hash_ids is not None else -(-r.input_length // BLOCK)
        out.append(dataclasses.replace(r, hash_ids=tuple(range(nxt, nxt + n))))
        nxt += n
    return out


def _no_reuse_turns(sessions) -> list:
    nxt = 0
    out = []
    for s in sessions:
        turns = []
        for t in s:
            turns.append(dataclasses.replace(t, hash_ids=tuple(range(nxt, nxt + len(t.hash_ids)))))
            nxt += len(t.hash_ids)
        out.append(turns)
    return out


def cost_per_m_output(accelerator_seconds: float, price_per_hour: float, output_tokens: int) -> float:
    """Dollars per million output tokens: accelerator-hours x price / output tokens x 1e6."""
    return accelerator_seconds / 3600.0 * price_per_hour / max(int(output_tokens), 1) * 1e6


@lru_cache(maxsize=4)
def _trace(path: str, n_requests: int | None) -> tuple:
    reqs = load_trace(path, BLOCK)
    return tuple(reqs if n_requests is None else reqs[:n_requests])


@lru_cache(maxsize=2)
def _sessions(path: str) -> tuple:
    return tuple(tuple(s) for s in session_turns(load_sessions(path)))


def _setup(v: Variant, deployment: str | None = None):
    """The variant's model, deployment (``deployment`` replaces the tensor-parallel one), policy, pool."""
    dep_name = deployment if deployment and v.deployment == costs.DEFAULT_DEPLOYMENT.name else v.deployment
    cfg, dep = model_of(v.model), costs.deployment(dep_name)
    policy = "kv-only" if v.policy == "none" else v.policy  # unique ids: nothing hits, states never matter
    return cfg, dep, policy, costs.capacity_tokens(cfg, dep)


def _base_row(v: Variant, workload: str) -> dict:
    return {"workload": workload, "variant": v.name, "family": v.family, "model": v.model, "policy": v.policy,
            "router": v.router, "deployment": v.deployment}


def _knee(row: dict, result, slo) -> dict:
    got = window(result, slo)
    row.update({"ttft_limit_pct_s": round(got["ttft_s"], 6), "ttft_p50_s": round(got["ttft_p50_s"], 6),
                "tpot_p50_s": round(got["tpot_p50_s"], 6),
                "tpot_limit_pct_s": None if got["tpot_s"] is None else round(got["tpot_s"], 6)})
    return row


def conversation_goodput(v: Variant, *, n_requests: int | None = None, instances: int = 8,
                         price_per_hour: float = 2.0, start: float = 4.0, rel_tol: float = 0.05,
                         trace: Path | str | None = None, slo=MOONCAKE_SLO,
                         deployment: str | None = None) -> dict:
    """The highest rate scale ``instances`` instances serve the trace at within ``slo``, and its price."""
    cfg, dep, policy, cap = _setup(v, deployment)
    reqs = list(_trace(str(trace or TRACE_PATH), n_requests))
    if v.policy == "none":
        reqs = no_reuse(reqs)
    t0 = time.perf_counter()

    def run(scale):
        return run_fleet(reqs, cfg, deployment=dep, instances=instances, router=v.router,
                         capacity_tokens=cap, rate_scale=scale, policy=policy, block_size=BLOCK,
                         guard=SloGuard(slo, reqs))

    scale, res, tried = max_rate_scale(run, slo, start=start, rel_tol=rel_tol)
    row = _base_row(v, "conversation")
    row["deployment"] = dep.name
    row.update({"instances": instances, "max_rate_scale": round(scale, 6),
                "tried": [[round(s, 6), ok] for s, ok in tried]})
    if res is None:
        row["goodput"] = 0.0
        return row
    span = (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000.0 / scale
    p = priced(res, span_s=span, price_per_hour=price_per_hour)
    row.update({"requests_per_s": round(len(reqs) / span, 6),
                "goodput": round(p["requests_per_s_per_instance"], 6),
                "output_tokens_per_s_per_instance": round(p["output_tokens_per_s_per_instance"], 6),
                "usd_per_m_output": round(p["usd_per_m_output"], 6),
                "busy_fraction": round(p["busy_fraction"], 6),
                "usable_hit_rate": round(res.usable_hit_rate(), 6),
                "kv_hit_rate": round(float(res.kv_hit.sum() / res.input_tokens.sum()), 6),
                "preemptions": res.preemptions, "run_wall_s": round(time.perf_counter() - t0, 3)})
    return _knee(row, res, slo)


def agent_capacity(v: Variant, *, instances: int = 4, duration_s: float = 900.0, seeds: int = 3,
                   price_per_hour: float = 2.0, start: int = 16, rel_tol: float = 0.05, slo=AGENT_SLO,
                   sessions_path: Path | str | None = None, deployment: str | None = None) -> dict:
    """The most concurrent agent sessions ``instances`` instances serve within ``slo`` (closed loop, each
    load replayed with ``seeds`` session orders and judged on their requests pooled)."""
    cfg, dep, policy, cap = _setup(v, deployment)
    sessions = [list(s) for s in _sessions(str(sessions_path or SESSIONS_PATH))]
    if v.policy == "none":
        sessions = _no_reuse_turns(sessions)
    t0 = time.perf_counter()

    def run(n):
        out = []
        for seed in range(seeds):
            fleet = Fleet(cfg, instances, v.router, deployment=dep, capacity_tokens=cap, policy=policy,
                          block_size=BLOCK)
            out.append(run_closed_loop(fleet, sessions, concurrency=n, duration_s=duration_s, seed=seed))
        return out

    n, res, tried = max_sessions(run, slo, start=start, rel_tol=rel_tol)
    row = _base_row(v, "agents")
    row["deployment"] = dep.name
    row.update({"instances": instances, "max_sessions": n, "tried": [[k, ok] for k, ok in tried],
                "goodput": round(n / instances, 6)})
    if res is None:
        return row
    p = priced(res, span_s=duration_s, price_per_hour=price_per_hour)
    hit = sum(float(r.usable_hit.sum()) for r in res) / sum(float(r.input_tokens.sum()) for r in res)
    row.update({"requests_per_s_per_instance": round(p["requests_per_s_per_instance"], 6),
                "output_tokens_per_s_per_instance": round(p["output_tokens_per_s_per_instance"], 6),
                "usd_per_m_output": round(p["usd_per_m_output"], 6), "busy_fraction": round(p["busy_fraction"], 6),
                "usable_hit_rate": round(hit, 6), "preemptions": sum(r.preemptions for r in res),
                "run_wall_s": round(time.perf_counter() - t0, 3)})
    return _knee(row, res, slo)


def _job(job: tuple) -> dict:
    workload, name, kwargs = job
    fn = conversation_goodput if workload == "conversation" else agent_capacity
    return fn(variant(name), **kwargs)


def run_part_b(out: Path | str | None = None, *, n_requests: int | None = None, instances: int = 8,
               agent_instances: int = 4, agent_duration_s: float = 900.0, seeds: int = 3, price_per_hour: float = 2.0,
               rel_tol: float = 0.05, variants=None, workloads=("conversation", "agents"),
               workers: int | None = None, deployment: str | None = None, start_scale: float = 8.0) -> dict:
    """Every variant's goodput on both workloads (jobs spread over ``workers`` processes; the numbers do
    not depend on how many); writes ``out/part_b.json`` and ``.md`` if ``out`` is given."""
    variants = VARIANT_NAMES if variants is None else tuple(variants)
    instances = check_int("instances", instances, 1)
    agent_instances = check_int("agent_instances", agent_instances, 1)
    price_per_hour = check_float("price_per_hour", price_per_hour, minimum=0.0)
    unknown = [v for v in variants if v not in VARIANT_NAMES]
    if unknown or not variants:
        raise ValueError(f"variants={list(variants)!r}: expected a non-empty subset of {list(VARIANT_NAMES)}")
    if BASELINE not in variants:
        raise ValueError(f"variants: must include the baseline {BASELINE!r} (every ratio is to it)")
    if not TRACE_PATH.is_file():
        raise FileNotFoundError(f"trace={str(TRACE_PATH)!r}: no such file (the real trace ships in data/)")
    if deployment is not None:
        costs.deployment(deployment)  # a bad name is a ValueError naming the argument
    if not set(workloads) <= {"conversation", "agents"} or not workloads:
        raise ValueError(f"workloads={list(workloads)!r}: expected a non-empty subset of ['conversation', 'agents']")
    kw = {"conversation": {"n_requests": n_requests, "instances": instances, "price_per_hour": price_per_hour,
                           "rel_tol": rel_tol, "deployment": deployment, "start": start_scale},
          "agents": {"instances": agent_instances, "duration_s": agent_duration_s, "seeds": seeds,
                     "price_per_hour": price_per_hour, "rel_tol": rel_tol, "start": 16 * agent_instances,
                     "deployment": deployment}}
    # On one tensor-parallel instance every router sends every request to it: run one router per
    # (model, policy, deployment) and copy its row to the others (they would be identical).
    single = {"conversation": instances == 1, "agents": agent_instances == 1}
    jobs, same = [], {}
    for name in variants:
        v = variant(name)
        for w in workloads:
            key = (w, v.model, v.policy, v.deployment)
            if single[w] and v.deployment == costs.DEFAULT_DEPLOYMENT.name and key in same:
                continue
            same.setdefault(key, name)
            jobs.append((w, name, kw[w]))
    t0 = time.perf_counter()
    workers = workers or min(len(jobs), os.cpu_count() or 1, 4)
    if workers <= 1:
        done = [_job(j) for j in jobs]
    else:
        with ProcessPoolExecutor(workers) as pool:
            done = list(pool.map(_job, jobs))
    by = {(r["workload"], r["variant"]): r for r in done}
    rows = []
    for name in variants:
        v = variant(name)
        for w in workloads:
            row = by.get((w, name))
            if row is None:  # a router that cannot differ on one instance
                first = by[(w, same[(w, v.model, v.policy, v.deployment)])]
                row = dict(first, variant=name, router=v.router, same_as=first["variant"])
            rows.append(row)
    for w in workloads:
        base = next(r for r in rows if r["workload"] == w and r["variant"] == BASELINE)
        for r in rows:
            if r["workload"] == w:
                r["goodput_ratio"] = round(r["goodput"] / base["goodput"], 6) if base["goodput"] else None
                if r.get("usd_per_m_output") and base.get("usd_per_m_output"):
                    r["cost_ratio"] = round(r["usd_per_m_output"] / base["usd_per_m_output"], 6)
    from kimilab.experiment.results import _version
    from kimilab.experiment.tables import assumptions

    result = {"experiment": "part B: goodput and dollars at the SLO, per variant, on real chat and agent traffic "
                            "(fleet simulator, simulated time)",
              "config": assumptions(n_requests=len(_trace(str(TRACE_PATH), n_requests)), instances=instances,
                                    agent_instances=agent_instances, agent_duration_s=agent_duration_s, seeds=seeds,
                                    price_per_hour=price_per_hour, rel_tol=rel_tol,
                                    deployment=costs.deployment(deployment or costs.DEFAULT_DEPLOYMENT.name)),
              "baseline": BASELINE, "kimilab": _version(), "rows": rows,
              "run_wall_s": round(time.perf_counter() - t0, 3)}
    if out is not None:
        import json

        from kimilab.experiment.tables import part_b_table

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "part_b.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (out / "part_b.md").write_text(part_b_table(result) + "\n", encoding="utf-8")
    return result
