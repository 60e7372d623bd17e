"""Part B of the book's experiment: what each method is worth in instances and dollars at a latency target.

For every variant of :mod:`kimilab.experiment.variants` (prefix policy x router on the
hybrid, and the all-MLA transformer), on chapter 10's fleet simulator with the default
deployment's step times and each device's real HBM as the pool:

* **conversation** (the real Mooncake trace, open loop at its own timestamps divided by a
  rate scale): the highest scale ``instances`` instances serve within
  :data:`~kimilab.fleet.goodput.MOONCAKE_SLO` (TTFT p99 <= 30 s, per-token TBT p99 <= 100 ms, and a
  steady state: after a 10% warm-up, the median TTFT grows by at most 30 s per hour of arrivals), as
  requests/s per instance, and dollars per million output tokens for the fleet at that load;
* **agents** (the real Claude Code sessions, closed loop: each request a recorded think
  time after the reply it waited for): the most concurrent sessions ``agent_instances``
  instances serve within :data:`~kimilab.fleet.goodput.AGENT_SLO` (TTFT p95 <= 2 s), per
  instance, and dollars per million output tokens.

Each number is measured in ``orders`` orders of the same traffic and reported as its mean,
min and max over them (:class:`Spread`). What changes between orders: for the agents, the
order in which the slots take the sessions (``run_closed_loop``'s seed); for the
conversation, the gaps between consecutive arrivals (:func:`arrival_order`; order 0 is the
trace's own timestamps). In each order the load is found by
:func:`~kimilab.fleet.goodput.scan_capacity` (scan a grid, then confirm), which does not
assume that pass/fail is monotone in the load. :func:`compare` calls a gap no larger than
the spread a tie.

With ``tune``, each variant is first tuned as a serving engineer tunes it (:func:`tune_variant`: the
step token budget and ``max_num_seqs``, on order 0), then measured in every order at its best setting.

Each variant's row carries its ratio to the strong baseline (``ends`` + ``prefix-affinity``).
Everything is deterministic except the wall-clock fields, whose names end in ``_wall_s``.
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path


from kimilab import costs
from kimilab.experiment import tuning
from kimilab.experiment.orders import BLOCK, arrival_order, no_reuse, no_reuse_turns
from kimilab.experiment.spread import Spread, compare  # noqa: F401  (importable from here as before)
from kimilab.experiment.tiers import check_ratios, spec_note, speculation_of, tier_keywords, tier_note
from kimilab.experiment.variants import BASELINE, VARIANT_NAMES, VARIANTS, Variant, model_of, variant
from kimilab.fleet import open_fleet, run_fleet
from kimilab.fleet.closed import run_closed_loop, session_turns
from kimilab.parallel import default_workers, pool_map
from kimilab.fleet.goodput import (AGENT_SLO, MOONCAKE_SLO, SloGuard, priced, rate_grid, scan_capacity,
                                   session_grid, window)
from kimilab.traffic import CLAUDE_CODE, MOONCAKE_CONVERSATION, load_sessions, load_trace
from kimilab.validate import check_float, check_int

__all__ = ["TRACE_PATH", "SESSIONS_PATH", "ORDERS", "no_reuse", "arrival_order", "cost_per_m_output", "Spread",
           "compare", "conversation_goodput", "agent_capacity", "tune_variant", "variant_rows", "run_part_b", "VARIANTS",
           "VARIANT_NAMES", "Variant"]

DATA = Path(__file__).resolve().parents[2] / "data"
TRACE_PATH = DATA / MOONCAKE_CONVERSATION
SESSIONS_PATH = DATA / CLAUDE_CODE
ORDERS = 5  # orders each number is measured over, by default


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


SCHEDULER_KNOBS = ("max_batched_tokens", "max_num_seqs")  # what a serving engineer tunes (tuning.tune)


def _setup(v: Variant, deployment: str | None = None, kernels: costs.Kernels | None = None,
           scheduler: dict | None = None, speculation: dict | None = None):
    """The variant's model, deployment (``deployment`` replaces the tensor-parallel one; ``kernels``
    replaces its kernel numbers, e.g. a member of the band's ensemble; ``scheduler`` sets its
    ``max_batched_tokens`` and ``max_num_seqs``), policy, pool (less the drafter's weights and KV
    with ``speculation``)."""
    dep_name = deployment if deployment and v.deployment == costs.DEFAULT_DEPLOYMENT.name else v.deployment
    cfg, dep = model_of(v.model), costs.deployment(dep_name)
    if kernels is not None:
        dep = dep.with_(kernels=kernels)
    if scheduler:
        bad = sorted(set(scheduler) - set(SCHEDULER_KNOBS))
        if bad:
            raise ValueError(f"scheduler: unknown field(s) {bad}; expected a subset of {list(SCHEDULER_KNOBS)}")
        dep = dep.with_(**{k: check_int(f"scheduler[{k!r}]", x, 1) for k, x in scheduler.items()})
    policy = "kv-only" if v.policy == "none" else v.policy  # unique ids: nothing hits, states never matter
    spec = speculation_of(speculation)
    return cfg, dep, policy, costs.capacity_tokens(cfg, dep) if spec is None else spec.capacity_tokens(cfg, dep)


def _options(cfg, dep, cap: int, instances: int, host_ratio, store_ratio, overlap_loads, prefill, speculation) -> dict:
    """The fleet's keywords for the options production turns on (:mod:`kimilab.experiment.tiers`)."""
    out = tier_keywords(cfg, dep, cap, instances, host_ratio, store_ratio, overlap_loads, prefill)
    spec = speculation_of(speculation)
    return out if spec is None else dict(out, speculation=spec)


def _base_row(v: Variant, workload: str, dep, instances: int, prefill: int | None = None,
              speculation: dict | None = None) -> dict:
    return ({"workload": workload, "variant": v.name, "family": v.family, "model": v.model, "policy": v.policy,
             "router": v.router, "deployment": dep.name, "instances": instances,
             "scheduler": {k: getattr(dep, k) for k in SCHEDULER_KNOBS}} | ({"prefill": prefill} if prefill else {})
            | ({"speculation": dict(speculation)} if speculation else {}))


def _order(k: int, scan, load_key: str, goodput: float, priced_: dict | None, extra: dict) -> dict:
    """One order's record: its load and goodput, its price, and what the scan saw."""
    out = {"order": k, load_key: round(float(scan.capacity), 6), "goodput": round(goodput, 6)}
    if priced_ is not None:
        out.update({key: round(float(priced_[key]), 6) for key in
                    ("output_tokens_per_s_per_instance", "usd_per_m_output", "busy_fraction")})
    out.update({key: round(float(x), 6) for key, x in extra.items()})
    out.update({"non_monotone": [round(float(x), 6) for x in scan.non_monotone],
                "lowest_fail": None if scan.lowest_fail is None else round(float(scan.lowest_fail), 6),
                "at_ceiling": scan.at_ceiling, "tried": [[round(float(x), 6), ok] for x, ok in scan.tried]})
    return out


def _summary(row: dict, per: list[dict], results: list, slo, t0: float) -> dict:
    """``row`` with the orders' records ``per``: each number's mean over the orders that have it (goodput
    and $/M also their min and max), the SLO's percentiles over every order's run at its load pooled."""
    skip = ("order", "non_monotone", "lowest_fail", "at_ceiling", "tried")
    numeric = dict.fromkeys(k for r in per for k, x in r.items() if k not in skip and not isinstance(x, bool))
    for key in numeric:
        got = [r[key] for r in per if r.get(key) is not None]
        if got:
            s = Spread.of(got)
            row[key] = round(s.mean, 6)
            if key in ("goodput", "usd_per_m_output"):
                row.update({f"{key}_min": round(s.min, 6), f"{key}_max": round(s.max, 6),
                            f"{key}_spread": round(s.spread, 6)})
    row.update({"orders": per, "non_monotone_orders": sum(bool(r["non_monotone"]) for r in per),
                "tried": [pair for r in per for pair in r["tried"]]})
    if results:
        got = window(results, slo)  # every order passed at its load; their tails pooled
        pick = {"ttft_limit_pct_s": "ttft_s", "ttft_p50_s": "ttft_p50_s", "tpot_limit_pct_s": "tpot_s",
                "tpot_p50_s": "tpot_p50_s", "tbt_limit_pct_s": "tbt_s", "tbt_p50_s": "tbt_p50_s"}
        row.update({k: None if got.get(g) is None else round(got[g], 6) for k, g in pick.items() if g in got})
    row["run_wall_s"] = round(time.perf_counter() - t0, 3)
    return row


def conversation_goodput(v: Variant, *, n_requests: int | None = None, instances: int = 8,
                         price_per_hour: float = 2.0, start: float = 4.0, rel_tol: float = 0.05,
                         trace: Path | str | None = None, slo=MOONCAKE_SLO, deployment: str | None = None,
                         orders: int = ORDERS, confirm: int = 2, kernels: costs.Kernels | None = None,
                         scheduler: dict | None = None, host_ratio: float | None = None,
                         store_ratio: float | None = None, overlap_loads: bool = False, prefill: int | None = None,
                         speculation: dict | None = None) -> dict:
    """The highest rate scale ``instances`` instances serve the trace at within ``slo`` (a grid ``rel_tol``
    apart, scanned), and its price, in each of ``orders`` arrival orders: their mean, min and max.
    ``scheduler``: the deployment's ``max_batched_tokens`` and ``max_num_seqs`` (a tuned setting);
    ``host_ratio``, ``store_ratio``, ``overlap_loads``, ``prefill``, ``speculation``: as in
    :func:`agent_capacity`."""
    cfg, dep, policy, cap = _setup(v, deployment, kernels, scheduler, speculation)
    tier = _options(cfg, dep, cap, instances, host_ratio, store_ratio, overlap_loads, prefill, speculation)
    reqs = list(_trace(str(trace or TRACE_PATH), n_requests))
    if v.policy == "none":
        reqs = no_reuse(reqs)
    if len(reqs) < 2 or reqs[-1].arrival_ms <= reqs[0].arrival_ms:
        raise ValueError("trace: expected arrivals spanning a positive time (a rate needs a duration)")
    t0, per, results = time.perf_counter(), [], []
    for k in range(check_int("orders", orders, 1)):
        timed = arrival_order(reqs, k)

        def run(scale, timed=timed):
            return run_fleet(timed, cfg, deployment=dep, instances=instances, router=v.router, capacity_tokens=cap,
                             rate_scale=scale, policy=policy, block_size=BLOCK, guard=SloGuard(slo, timed, rate_scale=scale),
                             **tier)

        scan = scan_capacity(run, slo, rate_grid(start, rel_tol), start=start, confirm=confirm)
        res, extra, p = scan.result, {}, None
        if res is not None:
            results.append(res)
            span = (timed[-1].arrival_ms - timed[0].arrival_ms) / 1000.0 / scan.capacity
            p = priced(res, span_s=span, price_per_hour=price_per_hour)
            extra = {"requests_per_s": len(reqs) / span, "usable_hit_rate": res.usable_hit_rate(),
                     "kv_hit_rate": float(res.kv_hit.sum() / res.input_tokens.sum()), "preemptions": res.preemptions}
        per.append(_order(k, scan, "max_rate_scale", p["requests_per_s_per_instance"] if p else 0.0, p, extra))
    return _summary(_base_row(v, "conversation", dep, instances, prefill, speculation), per, results, slo, t0)


def agent_capacity(v: Variant, *, instances: int = 4, duration_s: float = 900.0, orders: int = ORDERS,
                   price_per_hour: float = 2.0, start: int = 16, rel_tol: float = 0.05, slo=AGENT_SLO,
                   sessions_path: Path | str | None = None, deployment: str | None = None, confirm: int = 2,
                   part: tuple[int, int] | None = None, kernels: costs.Kernels | None = None,
                   scheduler: dict | None = None, host_ratio: float | None = None,
                   store_ratio: float | None = None, overlap_loads: bool = False, prefill: int | None = None,
                   speculation: dict | None = None) -> dict:
    """The most concurrent agent sessions ``instances`` instances serve within ``slo`` (closed loop; a grid
    ``rel_tol`` apart, scanned), in each of ``orders`` session orders (seeds 0, 1, ...: which session each
    slot plays next): their mean, min and max. ``part=(r, m)`` keeps the sessions whose index i has
    i % m == r (the shipped file's two halves: (0, 2) and (1, 2)); ``scheduler`` as in
    :func:`conversation_goodput`; ``host_ratio``, ``store_ratio``: a host tier under each instance's cache,
    or a store they share, loaded before each step or under it (``overlap_loads``); ``prefill``: that many of
    the instances prefill, the rest decode; ``speculation``: the fields of a :class:`~kimilab.engine.Speculation`
    every engine decodes with (:mod:`kimilab.experiment.tiers`)."""
    cfg, dep, policy, cap = _setup(v, deployment, kernels, scheduler, speculation)
    tier = _options(cfg, dep, cap, instances, host_ratio, store_ratio, overlap_loads, prefill, speculation)
    duration_s = check_float("duration_s", duration_s, minimum=0.0)
    if duration_s <= slo.warmup_s:
        raise ValueError(f"duration_s={duration_s!r}: expected more than the SLO's {slo.warmup_s:g} s warm-up "
                         "(no request after it would be judged)")
    sessions = [list(s) for s in _sessions(str(sessions_path or SESSIONS_PATH))]
    if part is not None:
        r, m = part
        if check_int("part[1]", m, 1) <= check_int("part[0]", r, 0):
            raise ValueError(f"part={part!r}: expected (r, m) with 0 <= r < m")
        sessions = sessions[r::m]
    if v.policy == "none":
        sessions = no_reuse_turns(sessions)
    t0, per, results = time.perf_counter(), [], []
    for k in range(check_int("orders", orders, 1)):
        def run(n, k=k):
            with open_fleet(cfg, instances, v.router, deployment=dep, capacity_tokens=cap, policy=policy,
                            block_size=BLOCK, **tier) as fleet:
                return run_closed_loop(fleet, sessions, concurrency=n, duration_s=duration_s, seed=k)

        scan = scan_capacity(run, slo, session_grid(start, rel_tol), start=start, confirm=confirm)
        res, extra, p = scan.result, {}, None
        if res is not None:
            results.append(res)
            p = priced(res, span_s=duration_s, price_per_hour=price_per_hour)
            extra = {"requests_per_s_per_instance": p["requests_per_s_per_instance"],
                     "usable_hit_rate": float(res.usable_hit.sum() / res.input_tokens.sum()),
                     "preemptions": res.preemptions}
        per.append(_order(k, scan, "max_sessions", scan.capacity / instances, p, extra))
    row = _base_row(v, "agents", dep, instances, prefill, speculation)
    if part is not None:
        row["part"] = list(part)
    return _summary(row, per, results, slo, t0)


def tune_variant(name: str, workload: str, kwargs: dict, *, budgets=tuning.BUDGETS,
                 seqs=tuning.SEQS) -> tuning.Tuned:
    """The variant's best scheduler setting on ``workload`` (:func:`kimilab.experiment.tuning.tune` over
    ``budgets`` x ``seqs``), each point the goodput of order 0 alone (``kwargs`` as for the workload's
    function): tune on one order, then compare on all of them."""
    fn = conversation_goodput if workload == "conversation" else agent_capacity
    v = variant(name)
    return tuning.tune(lambda changes: fn(v, **dict(kwargs, orders=1, scheduler=changes))["goodput"],
                budgets=budgets, seqs=seqs)


# Tuning runs where a serving engineer tunes: one instance, on a slice of the traffic (every grid
# point is a whole capacity search). The fleet is then measured at the setting found.
TUNE_REQUESTS = 2400  # chat: the trace's first requests (chapter 11 shows the goodput has settled there)
TUNE_WINDOW_S = 240.0  # agents: each closed-loop replay's window


def _tuning_kwargs(workload: str, kwargs: dict) -> dict:
    """``kwargs`` moved to one instance (colocated) and a slice of the traffic, for :func:`tune_variant`."""
    kwargs = {k: v for k, v in kwargs.items() if k != "prefill"}
    if workload == "conversation":
        n = kwargs.get("n_requests")
        return dict(kwargs, instances=1, n_requests=TUNE_REQUESTS if n is None else min(n, TUNE_REQUESTS))
    return dict(kwargs, instances=1, duration_s=min(kwargs.get("duration_s", TUNE_WINDOW_S), TUNE_WINDOW_S),
                start=16)


def _job(job: tuple) -> dict:
    workload, name, kwargs = job
    kwargs = dict(kwargs)
    grid = kwargs.pop("tune", None)
    fn = conversation_goodput if workload == "conversation" else agent_capacity
    if grid is None:
        return fn(variant(name), **kwargs)
    tuned = tune_variant(name, workload, _tuning_kwargs(workload, kwargs), budgets=grid[0], seqs=grid[1])
    row = fn(variant(name), **dict(kwargs, scheduler=tuned.changes))
    row["tuning"] = [{**r, "value": round(r["value"], 6)} for r in tuned.rows]
    return row


def _run_jobs(jobs: list, workers: int, progress=None) -> list[dict]:
    """``_job`` over ``jobs`` on ``workers`` processes, results in the jobs' order; ``progress(line)``
    (if given) hears of each job as it finishes, with a count and an estimate of the time left."""
    t0 = time.perf_counter()

    def tell(i: int, k: int, row: dict) -> None:
        if progress is not None:
            el = time.perf_counter() - t0
            w, name, _ = jobs[i]
            progress(f"[{k}/{len(jobs)}] {w}: {name}: goodput {row['goodput']:.4g} "
                     f"({el:.0f} s, about {el / k * (len(jobs) - k):.0f} s left)")

    return pool_map(_job, jobs, workers, on_done=tell)


def variant_rows(variants, kw: dict, *, workers: int | None = None, progress=None) -> list[dict]:
    """Every variant's row on every workload of ``kw`` (workload -> the keyword arguments of
    :func:`conversation_goodput` or :func:`agent_capacity`), jobs spread over ``workers`` processes
    (the numbers do not depend on how many), each row with its ratio and :func:`compare` label
    (``vs_baseline``) against the baseline's row of the same workload. ``progress``: see
    :func:`_run_jobs`."""
    variants = tuple(variants)
    unknown = [v for v in variants if v not in VARIANT_NAMES]
    if unknown or not variants:
        raise ValueError(f"variants={list(variants)!r}: expected a non-empty subset of {list(VARIANT_NAMES)}")
    if BASELINE not in variants:
        raise ValueError(f"variants: must include the baseline {BASELINE!r} (every ratio is to it)")
    # On one tensor-parallel instance every router sends every request to it: run one router per
    # (model, policy, deployment) and copy its row to the others (they would be identical).
    single = {w: k.get("instances", 1) == 1 for w, k in kw.items()}
    jobs, same = [], {}
    for name in variants:
        v = variant(name)
        for w in kw:
            key = (w, v.model, v.policy, v.deployment)
            if single[w] and v.deployment == costs.DEFAULT_DEPLOYMENT.name and key in same:
                continue
            same.setdefault(key, name)
            jobs.append((w, name, kw[w]))
    workers = workers or default_workers(len(jobs), cap=4)
    done = _run_jobs(jobs, workers, progress)
    by = {(r["workload"], r["variant"]): r for r in done}
    rows = []
    for name in variants:
        v = variant(name)
        for w in kw:
            row = by.get((w, name))
            if row is None:  # a router that cannot differ on one instance
                first = by[(w, same[(w, v.model, v.policy, v.deployment)])]
                row = dict(first, variant=name, router=v.router, same_as=first["variant"])
            rows.append(row)
    for w in kw:
        base = next(r for r in rows if r["workload"] == w and r["variant"] == BASELINE)
        for r in rows:
            if r["workload"] == w:
                _ratios(r, base)
    return rows


def _ratios(r: dict, base: dict) -> None:
    """``r``'s ratios to ``base``: the means' ratio, its min and max over the orders (order k against
    the baseline's order k), $/M's ratio, and the :func:`compare` label."""
    r["goodput_ratio"] = round(r["goodput"] / base["goodput"], 6) if base["goodput"] else None
    paired = [a["goodput"] / b["goodput"] for a, b in zip(r["orders"], base["orders"]) if b["goodput"]]
    if r["goodput_ratio"] is not None and paired:
        r["goodput_ratio_min"], r["goodput_ratio_max"] = round(min(paired), 6), round(max(paired), 6)
    if r.get("usd_per_m_output") and base.get("usd_per_m_output"):
        r["cost_ratio"] = round(r["usd_per_m_output"] / base["usd_per_m_output"], 6)
    r["vs_baseline"] = "baseline" if r["variant"] == BASELINE else compare(r, base)


def run_part_b(out: Path | str | None = None, *, n_requests: int | None = None, instances: int = 8,
               agent_instances: int = 4, agent_duration_s: float = 900.0, orders: int = ORDERS,
               seeds: int | None = None, price_per_hour: float = 2.0, rel_tol: float = 0.1, variants=None,
               workloads=("conversation", "agents"), workers: int | None = None, deployment: str | None = None,
               start_scale: float = 8.0, confirm: int = 2, trace: Path | str | None = None,
               sessions: Path | str | None = None, tune: dict | None = None, host_ratio: float | None = None,
               store_ratio: float | None = None, overlap_loads: bool = False, prefill: int | None = None,
               speculation: dict | None = None, progress=None) -> dict:
    """Every variant's goodput on both workloads, each over ``orders`` orders (``seeds``: its old name) on a
    load grid ``rel_tol`` apart; writes ``out/part_b.json`` and ``.md`` if ``out`` is given. ``trace`` and
    ``sessions`` replace the shipped files. ``tune`` (workload -> ``(budgets, seqs)``) tunes each variant's
    scheduler on that workload first (:func:`tune_variant`, on one instance and at most ``TUNE_REQUESTS``
    requests or ``TUNE_WINDOW_S`` seconds of it) and measures it at its best setting. ``host_ratio``,
    ``store_ratio``, ``overlap_loads``: a host tier under every instance's cache, or a store they share;
    ``prefill``: disaggregated, that many instances prefill; ``speculation``: the fields of a
    :class:`~kimilab.engine.Speculation` (:func:`agent_capacity`). ``progress(line)`` hears of each
    variant as it finishes (the CLI prints it to stderr)."""
    variants = VARIANT_NAMES if variants is None else tuple(variants)
    orders = check_int("orders", orders if seeds is None else seeds, 1)
    instances = check_int("instances", instances, 1)
    agent_instances = check_int("agent_instances", agent_instances, 1)
    price_per_hour = check_float("price_per_hour", price_per_hour, minimum=0.0)
    if not set(workloads) <= {"conversation", "agents"} or not workloads:
        raise ValueError(f"workloads={list(workloads)!r}: expected a non-empty subset of ['conversation', 'agents']")
    trace, sessions = Path(trace or TRACE_PATH), Path(sessions or SESSIONS_PATH)
    for name, path, w in (("trace", trace, "conversation"), ("sessions", sessions, "agents")):
        if w in workloads and not path.is_file():
            raise FileNotFoundError(f"{name}={str(path)!r}: no such file")
    if deployment is not None:
        costs.deployment(deployment)  # a bad name is a ValueError naming the argument
    kw = {"conversation": {"n_requests": n_requests, "instances": instances, "price_per_hour": price_per_hour,
                           "rel_tol": rel_tol, "deployment": deployment, "start": start_scale, "orders": orders,
                           "confirm": confirm, "trace": str(trace)},
          "agents": {"instances": agent_instances, "duration_s": agent_duration_s, "orders": orders,
                     "price_per_hour": price_per_hour, "rel_tol": rel_tol, "start": 16 * agent_instances,
                     "deployment": deployment, "confirm": confirm, "sessions_path": str(sessions)}}
    for w, grid in (tune or {}).items():
        if w not in workloads or not isinstance(grid, (tuple, list)) or len(grid) != 2:
            raise ValueError(f"tune[{w!r}]={grid!r}: expected a workload of {list(workloads)} -> (budgets, seqs)")
        kw[w]["tune"] = (tuple(grid[0]), tuple(grid[1]))
    for w in kw:
        kw[w].update(check_ratios(host_ratio, store_ratio, overlap_loads, prefill))
        if speculation_of(speculation) is not None:
            kw[w]["speculation"] = dict(speculation)
        if prefill is not None and kw[w]["instances"] <= prefill:
            raise ValueError(f"prefill={prefill}: expected fewer than the {w} run's {kw[w]['instances']} instances")
    t0 = time.perf_counter()
    rows = variant_rows(variants, {w: kw[w] for w in workloads}, workers=workers, progress=progress)
    from kimilab.experiment.results import _version
    from kimilab.experiment.tables import assumptions

    n_req = len(_trace(str(trace), n_requests)) if "conversation" in workloads else None
    result = {"experiment": "part B: goodput and dollars at the SLO, per variant, on real chat and agent traffic "
                            "(fleet simulator, simulated time)",
              "config": assumptions(n_requests=n_req, instances=instances, agent_instances=agent_instances,
                                    agent_duration_s=agent_duration_s, seeds=orders, price_per_hour=price_per_hour,
                                    rel_tol=rel_tol,
                                    deployment=costs.deployment(deployment or costs.DEFAULT_DEPLOYMENT.name)),
              "baseline": BASELINE, "kimilab": _version(), "rows": rows,
              "run_wall_s": round(time.perf_counter() - t0, 3)}
    result["config"].update(tier_note(host_ratio, store_ratio, overlap_loads, prefill) | spec_note(speculation))
    if out is not None:
        import json

        from kimilab.experiment.tables import part_b_table

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "part_b.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (out / "part_b.md").write_text(part_b_table(result) + "\n", encoding="utf-8")
    return result
