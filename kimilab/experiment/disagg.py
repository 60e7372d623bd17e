"""Part B's question with prefill/decode disaggregation: does the hybrid's lead survive it?

For each workload and variant, goodput on ``instances`` instances served colocated, and
disaggregated at every split of them into P prefill and ``instances - P`` decode instances
(:class:`kimilab.fleet.DisaggregatedFleet`); the split with the highest mean goodput is the
variant's tuned ratio, and the verdict compares each variant at its best. Part B's protocol
throughout: its SLOs, ``orders`` orders reported as mean, min and max, chat tuned first (here per
split, on the fleet itself: a split's prefill and decode instances share one setting), agents at
the deployment's setting. :func:`split_corners` repeats the best splits at the kernel band's corners.

:func:`handover_bytes` is what the split costs on the link: each request's prompt KV, plus
its states for a hybrid, per device, over a trace's prompts.
"""

from __future__ import annotations

import numpy as np

from kimilab import costs
from kimilab.engine.disagg import transfer_bytes
from kimilab.experiment import tuning
from kimilab.experiment.variants import model_of, variant
from kimilab.parallel import pool_map
from kimilab.validate import check_int

__all__ = ["split_goodputs", "split_corners", "handover_bytes", "best_splits"]


def _goodput(workload: str, name: str, prefill: int | None, kw: dict, scheduler: dict | None, orders: int) -> dict:
    from kimilab.experiment.scale import agent_capacity, conversation_goodput

    fn = conversation_goodput if workload == "chat" else agent_capacity
    return fn(variant(name), prefill=prefill, scheduler=scheduler, orders=orders, **kw)


def _job(job: tuple) -> dict:
    """One (workload, variant, split): chat tuned on order 0 over ``budgets`` x ``seqs`` first, then
    measured in every order at the best setting; agents at the deployment's setting, as Part B runs them."""
    workload, name, prefill, kw, orders, grid = job
    tuned = None
    if grid is not None:
        tuned = tuning.tune(lambda changes: _goodput(workload, name, prefill, kw, changes, 1)["goodput"],
                            budgets=grid[0], seqs=grid[1])
    got = _goodput(workload, name, prefill, kw, None if tuned is None else tuned.changes, orders)
    if tuned is not None:
        got["tuning"] = list(tuned.rows)
    return {**got, "workload": workload, "variant": name, "prefill": prefill}


def split_goodputs(pairs: dict, budgets: dict, *, instances: int = 4, n_requests: int, rel_tol: float,
                   start: float, agent_duration_s: float, orders: int, workers: int = 2,
                   deployment: str | None = None) -> list[dict]:
    """One row per (workload ``"chat"``/``"agents"`` of ``pairs``, variant, split): its goodput row, with
    ``prefill`` None (colocated) or 1 .. instances - 1. Chat is tuned per split over the variant's tuned
    budget (``budgets[name]``, from Part B) and 16K tokens, each with 256 or 1,024 requests running (a
    decode instance holds several prefill instances' decodes); ``start``: chat's first rate scale per
    instance."""
    instances = check_int("instances", instances, 2)
    unknown = set(pairs) - {"chat", "agents"}
    if unknown:
        raise ValueError(f"pairs: unknown workloads {sorted(unknown)}; expected 'chat' and/or 'agents'")
    common = {"instances": instances, "rel_tol": rel_tol, "deployment": deployment}
    per = {"chat": dict(common, n_requests=n_requests, start=start * instances),
           "agents": dict(common, duration_s=agent_duration_s, start=16 * instances)}
    grid = {name: (tuple(dict.fromkeys((check_int(f"budgets[{name!r}]", budgets[name], 1), 16384))), tuning.SEQS)
            for name in pairs.get("chat", [])}
    jobs = [(w, name, p, dict(per[w]), orders, grid.get(name) if w == "chat" else None)
            for w, names in pairs.items() for name in names for p in (None, *range(1, instances))]
    return pool_map(_job, jobs, workers)


def split_corners(rows: list[dict], *, n_requests: int, rel_tol: float, start: float, agent_duration_s: float,
                  deployment: str | None = None) -> list[dict]:
    """Each (workload, variant) of ``rows`` colocated and at its best split (:func:`best_splits`), at the
    kernel band's central set and two corners (order 0, each at the scheduler it was measured at): one
    row per (workload, set, variant, split), from :func:`kimilab.experiment.capacity.corner_goodputs`."""
    from kimilab.experiment.capacity import corner_goodputs

    out = []
    for (w, name), pair in best_splits(rows).items():
        for r in pair:
            got = corner_goodputs({w: [name]}, {name: r["scheduler"]}, n_requests=n_requests, rel_tol=rel_tol,
                                  start=start, agent_duration_s=agent_duration_s, deployment=deployment,
                                  instances=r["instances"], prefill={w: {name: r["prefill"]}})
            out += [dict(g, prefill=r["prefill"]) for g in got]
    return out


def best_splits(rows: list[dict]) -> dict:
    """(workload, variant) -> (colocated row, the disaggregated row with the highest mean goodput)."""
    out: dict = {}
    for r in rows:
        key = (r["workload"], r["variant"])
        co, best = out.get(key, (None, None))
        if r["prefill"] is None:
            co = r
        elif best is None or r["goodput"] > best["goodput"]:
            best = r
        out[key] = (co, best)
    return out


def handover_bytes(model: str, input_lengths, deployment: costs.Deployment | None = None) -> np.ndarray:
    """Bytes one device sends to hand each prompt of ``input_lengths`` from a prefill to a decode instance
    (``model``: a preset's name, or Part B's ``all_mla_27_fp8kv``)."""
    cfg, dep = model_of(model), deployment or costs.DEFAULT_DEPLOYMENT
    per_token = costs.kv_bytes_per_token(cfg, dep)
    states = transfer_bytes(cfg, dep, 0)
    return np.asarray(input_lengths, dtype=np.float64) * per_token + states
