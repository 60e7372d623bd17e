"""Capacity on your own traffic, and a self-check that the capacity search can rank.

``python -m kimilab capacity --sessions PATH [--trace PATH]`` measures the variants of
:mod:`kimilab.experiment.variants` on converted Claude Code sessions (closed loop: concurrent
sessions per instance within the agent SLO) and/or a chat trace in Mooncake's format (open
loop: requests/s per instance within Mooncake's SLO). Each number is measured in ``orders``
orders of the traffic (:mod:`kimilab.experiment.scale` says what changes between them) by a
search that does not assume pass/fail is monotone in the load. One JSON object comes out: per
variant its mean, min, max and spread (half the min-max range), dollars per million output
tokens, its ratio to the baseline and a label, ``higher``, ``lower`` or ``tie`` (a gap no
larger than the spread: :func:`~kimilab.experiment.scale.compare`).

:func:`two_halves` splits the shipped sessions by index parity and measures each half: a
search that can rank orders the variants the same way on both, with ratios to the baseline
that agree within their spread.
"""

from __future__ import annotations

import time
from pathlib import Path

from kimilab import costs
from kimilab.costs import DEFAULT_DEPLOYMENT
from kimilab.experiment.scale import (BASELINE, ORDERS, SESSIONS_PATH, VARIANT_NAMES, Spread, _sessions, _trace,
                                      compare, variant_rows)
from kimilab.experiment.variants import variant
from kimilab.fleet.goodput import AGENT_SLO, MOONCAKE_SLO
from kimilab.validate import check_float, check_int

__all__ = ["ROW_KEYS", "HALVES_VARIANTS", "band_corners", "measure_capacity", "two_halves", "add_arguments", "run"]

# what each row of the command's JSON carries
ROW_KEYS = ("workload", "variant", "family", "unit", "goodput", "goodput_min", "goodput_max", "goodput_spread",
            "goodput_orders", "usd_per_m_output", "usd_per_m_output_min", "usd_per_m_output_max", "goodput_ratio",
            "goodput_ratio_min", "goodput_ratio_max", "vs_baseline", "non_monotone_orders", "same_as",
            "goodput_band", "goodput_ratio_band", "band_label", "scheduler", "tuning")
UNITS = {"agents": "concurrent sessions per instance", "conversation": "requests/s per instance"}
# the self-check's default variants: the baseline, no reuse, the impossible reference, the transformers
HALVES_VARIANTS = (BASELINE, "none + prefix-affinity", "kv-only + prefix-affinity", "all-MLA bf16 TP4",
                   "all-MLA fp8 TP4")


def _variants(variants) -> tuple:
    """``variants`` (all when None) with the baseline first; ValueError naming an unknown one."""
    names = VARIANT_NAMES if variants is None else tuple(variants)
    bad = [v for v in names if v not in VARIANT_NAMES]
    if bad or not names:
        raise ValueError(f"variants={list(names)!r}: expected names from {list(VARIANT_NAMES)}")
    return (BASELINE,) + tuple(v for v in dict.fromkeys(names) if v != BASELINE)


def _public(row: dict) -> dict:
    """A result row cut to :data:`ROW_KEYS` (absent keys left out), with each order's goodput."""
    out = {"unit": UNITS[row["workload"]], "goodput_orders": [o["goodput"] for o in row["orders"]]}
    out.update({k: row[k] for k in ROW_KEYS if k in row})
    return {k: out[k] for k in ROW_KEYS if k in out}


def _sessions_info(path) -> dict:
    """How many sessions and requests ``path`` holds (ValueError naming it if none)."""
    sessions = _sessions(str(path))
    if not sessions:
        raise ValueError(f"sessions={str(path)!r}: no sessions in the file")
    return {"file": str(path), "sessions": len(sessions), "requests": sum(map(len, sessions))}


def band_corners(deployment: str | None = None) -> list:
    """The two members of the kernel ensemble (:func:`kimilab.costs.members`) with the fastest and the
    slowest serving step on ``deployment``: a chat-like step (64 decodes at 4K context beside one
    2K-token prefill chunk) of the hybrid, summed with the same step of the all-MLA baseline. A
    capacity run costs minutes, so the band of a goodput is taken at these two corners."""
    from kimilab.config import all_mla_27, kimi_linear_48b

    dep = costs.deployment(deployment or DEFAULT_DEPLOYMENT.name)

    def step(m):
        d = dep.with_(kernels=m.kernels)
        return sum(costs.step_seconds(cfg, d, decode=(64, 64 * 4096), chunks=[(2048, 0)])
                   for cfg in (kimi_linear_48b, all_mla_27))

    ms = costs.members()[1:]
    times = [step(m) for m in ms]
    return [ms[times.index(min(times))], ms[times.index(max(times))]]


def _with_band(rows: list[dict], corner_rows: list[list[dict]], corners) -> None:
    """Give each row the goodput and ratio at the band's corners (with the central value), and a label:
    whether its place against the baseline (higher, lower or a tie) holds at both corners."""
    for row in rows:
        at = [next(r for r in cr if r["workload"] == row["workload"] and r["variant"] == row["variant"])
              for cr in corner_rows]
        good = [row["goodput"]] + [r["goodput"] for r in at]
        row["goodput_band"] = [round(min(good), 6), round(max(good), 6)]
        if "goodput_ratio" in row:
            ratios = [row["goodput_ratio"]] + [r.get("goodput_ratio") for r in at]
            known = [x for x in ratios if x is not None]
            row["goodput_ratio_band"] = [round(min(known), 6), round(max(known), 6)] if known else None
            flips = [m.differs() for m, r in zip(corners, at) if r.get("vs_baseline") != row.get("vs_baseline")]
            row["band_label"] = ("holds across the band" if not flips
                                 else "flips at " + "; ".join(flips))


def measure_capacity(sessions=None, trace=None, *, variants=None, orders: int = ORDERS, instances: int = 1,
             deployment: str | None = None, requests: int | None = None, duration_s: float = 900.0,
             price_per_hour: float = 2.0, step: float = 0.1, confirm: int = 2, workers: int | None = None,
             band: bool = False, tune: bool = False) -> dict:
    """Each variant's capacity on the agent ``sessions`` and/or the chat ``trace`` (paths), over ``orders``
    orders on ``instances`` instances: the command's JSON object. ``requests``: the trace's first N only;
    ``duration_s``: each closed-loop replay's window; ``step``: the load grid's relative spacing;
    ``band``: also measure at the kernel band's two corners (:func:`band_corners`; three times the work);
    ``tune``: tune each variant's scheduler first on each workload (:func:`~kimilab.experiment.scale.tune_variant`;
    at a corner, tuned again there)."""
    if sessions is None and trace is None:
        raise ValueError("sessions, trace: expected at least one file")
    orders, instances = check_int("orders", orders, 1), check_int("instances", instances, 1)
    price_per_hour = check_float("price_per_hour", price_per_hour, minimum=0.0)
    step = check_float("step", step, minimum=1e-3)
    variants = _variants(variants)
    kw, workloads = {}, {}
    common = {"orders": orders, "instances": instances, "price_per_hour": price_per_hour, "rel_tol": step,
              "deployment": deployment, "confirm": confirm}
    if trace is not None:
        reqs = _trace(str(trace), None if requests is None else check_int("requests", requests, 1))
        if len(reqs) < 2 or reqs[-1].arrival_ms <= reqs[0].arrival_ms:
            raise ValueError(f"trace={str(trace)!r}: expected at least two arrivals at different times")
        kw["conversation"] = dict(common, n_requests=requests, trace=str(trace), start=1.0)
        workloads["conversation"] = {"file": str(trace), "requests": len(reqs),
                                     "span_s": (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000.0,
                                     "slo": MOONCAKE_SLO.describe(), "unit": UNITS["conversation"],
                                     "orders": "order 0: the trace's timestamps; order k: the gaps between "
                                               "consecutive arrivals shuffled with seed k"}
    if sessions is not None:
        duration_s = check_float("duration_s", duration_s, minimum=0.0)
        if duration_s <= AGENT_SLO.warmup_s:
            raise ValueError(f"duration_s={duration_s!r}: expected more than the agent SLO's "
                             f"{AGENT_SLO.warmup_s:g} s warm-up")
        kw["agents"] = dict(common, duration_s=duration_s, sessions_path=str(sessions), start=16 * instances)
        workloads["agents"] = dict(_sessions_info(sessions), window_s=duration_s, slo=AGENT_SLO.describe(),
                                   unit=UNITS["agents"], orders="order k: the sessions' order, seed k")
    if tune:
        from kimilab.experiment.tuning import BUDGETS, SEQS

        for k in kw.values():
            k["tune"] = (BUDGETS, SEQS)
    t0 = time.perf_counter()
    rows = variant_rows(variants, kw, workers=workers)
    extra = {}
    if band:
        corners = band_corners(deployment)
        corner_rows = [variant_rows(variants, {w: dict(k, kernels=m.kernels) for w, k in kw.items()}, workers=workers)
                       for m in corners]
        _with_band(rows, corner_rows, corners)
        extra = {"band": "goodput and ratio at the central kernels and at the two corners of the 36-set "
                         "ensemble (fastest and slowest step): " + " | ".join(m.differs() for m in corners)}
    return {"baseline": BASELINE, "orders": orders, "instances": instances,
            "deployment": deployment or DEFAULT_DEPLOYMENT.name,
            "price_usd_per_accelerator_hour": price_per_hour, "grid_step": step, "confirm": confirm,
            "spread": "half the min-max range over the orders; a gap to the baseline no larger than the larger "
                      "of the two spreads is a tie",
            "workloads": workloads, "rows": [_public(r) for r in rows], **extra,
            "run_wall_s": round(time.perf_counter() - t0, 3)}


def two_halves(sessions=None, *, variants=HALVES_VARIANTS, orders: int = ORDERS, instances: int = 1,
               duration_s: float = 600.0, step: float = 0.1, confirm: int = 2, deployment: str | None = None,
               workers: int | None = None) -> dict:
    """Agent capacity on each half of ``sessions`` (default: the shipped file), split by session index
    parity: per half, every variant's row and the variants by mean goodput; then whether the halves agree.

    ``ratios_agree``: every variant's ratio to the baseline ties across the halves (:func:`compare` on
    the ratio's mean and its min and max over the orders); ``ordering_agrees``: no pair of variants is
    ``higher`` in one half and ``lower`` in the other (a tie in either half is no conflict)."""
    variants = _variants(variants)
    path = str(sessions or SESSIONS_PATH)
    kw = {"orders": check_int("orders", orders, 1), "instances": check_int("instances", instances, 1),
          "duration_s": duration_s, "rel_tol": step, "confirm": confirm, "deployment": deployment,
          "sessions_path": path, "start": 16 * instances}
    t0 = time.perf_counter()
    halves = {}
    for name, r in (("even", 0), ("odd", 1)):
        rows = variant_rows(variants, {"agents": dict(kw, part=(r, 2))}, workers=workers)
        halves[name] = {r["variant"]: r for r in rows}
    per_variant, ratios_agree = [], True
    for v in variants:
        a, b = halves["even"][v], halves["odd"][v]
        entry = {"variant": v, "goodput": [a["goodput"], b["goodput"]], "vs_baseline": [a["vs_baseline"],
                                                                                         b["vs_baseline"]]}
        if a.get("goodput_ratio") is not None and b.get("goodput_ratio") is not None:
            ra, rb = (Spread.from_row(x, "goodput_ratio") for x in (a, b))
            entry.update({"ratio": [ra.mean, rb.mean], "ratio_spread": [round(ra.spread, 6), round(rb.spread, 6)],
                          "ratios_agree": compare(ra, rb) == "tie"})
            ratios_agree &= entry["ratios_agree"]
        per_variant.append(entry)
    conflicts = []
    for i, x in enumerate(variants):
        for y in variants[i + 1:]:
            got = {compare(halves[h][x], halves[h][y]) for h in halves}
            if got >= {"higher", "lower"}:
                conflicts.append([x, y])
    order = {h: sorted(variants, key=lambda v: -halves[h][v]["goodput"]) for h in halves}
    return {"sessions": path, "split": "even: sessions 0, 2, 4, ... of the file; odd: 1, 3, 5, ...",
            "orders": kw["orders"], "instances": kw["instances"], "window_s": duration_s, "baseline": BASELINE,
            "halves": {h: [_public(halves[h][v]) for v in variants] for h in halves}, "ordering": order,
            "variants": per_variant, "conflicts": conflicts, "ratios_agree": bool(ratios_agree),
            "ordering_agrees": not conflicts, "agree": bool(ratios_agree) and not conflicts,
            "run_wall_s": round(time.perf_counter() - t0, 3)}


def corner_goodputs(pairs: dict, schedulers: dict, *, n_requests: int, rel_tol: float, start: float,
                    agent_duration_s: float, deployment: str | None = None, host_ratio: float | None = None,
                    instances: int = 1, prefill: dict | None = None, speculation: dict | None = None) -> list[dict]:
    """Each variant of ``pairs`` (workload ``"chat"``/``"agents"`` -> variant names) at the central kernel
    set and the band's two corners (:func:`band_corners`), order 0: one row per (workload, set, variant)
    with its goodput row. Chat runs each variant at ``schedulers[name]`` (its tuned setting); agents at
    the default scheduler, as Part B measures them. ``host_ratio``: a host tier under every cache, as in
    :func:`kimilab.experiment.scale.agent_capacity`; on ``instances`` instances (``start`` per instance),
    ``prefill[workload][name]`` of them prefill instances where given (disaggregated); ``speculation``: the
    fields of the :class:`~kimilab.engine.Speculation` every engine decodes with."""
    from kimilab.experiment.scale import agent_capacity, conversation_goodput

    corners = band_corners(deployment)
    sets = (("central", None), ("fastest", corners[0]), ("slowest", corners[1]))
    rows = []
    for workload, names in pairs.items():
        for label, m in sets:
            kw = dict(instances=instances, orders=1, rel_tol=rel_tol, deployment=deployment, host_ratio=host_ratio,
                      speculation=speculation, **({} if m is None else {"kernels": m.kernels}))
            for name in names:
                kw["prefill"] = (prefill or {}).get(workload, {}).get(name)
                if workload == "chat":
                    got = conversation_goodput(variant(name), n_requests=n_requests, start=start * instances,
                                               scheduler=schedulers[name], **kw)
                else:
                    got = agent_capacity(variant(name), duration_s=agent_duration_s, start=16 * instances, **kw)
                rows.append({**got, "workload": workload, "set": label, "variant": name})
    return rows


def baseline_at_lengths(lengths, *, scheduler: dict, rel_tol: float, start: float) -> list[dict]:
    """The baseline's chat goodput row (one instance, order 0, at ``scheduler``) on the trace's first n
    requests, for each n of ``lengths``: does the answer stop moving as the replay gets longer?"""
    from kimilab.experiment.scale import conversation_goodput

    return [{"n": n, **conversation_goodput(variant(BASELINE), n_requests=n, instances=1, orders=1, rel_tol=rel_tol,
                                            start=start, scheduler=scheduler)} for n in lengths]


def add_arguments(parser) -> None:
    """``python -m kimilab capacity``'s options; argparse adds each default to its help."""
    from kimilab.costs import DEFAULT_DEPLOYMENT, DEPLOYMENTS
    from kimilab.validate import nonnegative_float_arg, positive_float_arg, positive_int_arg

    parser.add_argument("--sessions", metavar="PATH", default=None,
                        help="converted Claude Code sessions, .jsonl or .jsonl.gz (what `traces convert-claude-code` "
                             "writes): the agent workload, closed loop")
    parser.add_argument("--trace", metavar="PATH", default=None,
                        help="a chat trace in Mooncake's jsonl format, 512-token blocks: the conversation workload, "
                             "open loop at its timestamps divided by a rate scale")
    parser.add_argument("--variants", nargs="+", metavar="NAME", default=None,
                        help="variants to measure (quote each name; the baseline is always added); none given: all: "
                             + ", ".join(VARIANT_NAMES))
    parser.add_argument("--orders", type=positive_int_arg, default=ORDERS,
                        help="orders each number is measured in (agents: the sessions' order; chat: the gaps between "
                             "arrivals), reported as mean, min and max")
    parser.add_argument("--instances", type=positive_int_arg, default=1, help="instances serving each workload")
    parser.add_argument("--deployment", default=DEFAULT_DEPLOYMENT.name, choices=sorted(DEPLOYMENTS),
                        help="the hybrid's deployment (the DP-attention variants keep theirs)")
    parser.add_argument("--requests", type=positive_int_arg, default=None,
                        help="only the trace's first N requests (none given: all)")
    parser.add_argument("--duration-s", type=positive_float_arg, default=900.0,
                        help=f"simulated seconds of each closed-loop replay (more than the agent SLO's "
                             f"{AGENT_SLO.warmup_s:g} s warm-up)")
    parser.add_argument("--price", type=nonnegative_float_arg, default=2.0, help="dollars per accelerator-hour")
    parser.add_argument("--step", type=positive_float_arg, default=0.1, help="the load grid's relative spacing")
    parser.add_argument("--confirm", type=positive_int_arg, default=2,
                        help="failing loads in a row that end the scan (and confirm the capacity below them)")
    parser.add_argument("--workers", type=positive_int_arg, default=None,
                        help="processes the variants are spread over (default: cores, at most 4)")
    parser.add_argument("--band", action="store_true",
                        help="also measure at the two corners of the kernel band (3x the work): each row gets "
                             "goodput_band, goodput_ratio_band and band_label")
    parser.add_argument("--tune", action="store_true",
                        help="tune each variant's max_batched_tokens (2K-16K) and max_num_seqs (256, 1024) on "
                             "order 0 of each workload, on one instance, before measuring it (8x the work)")
    parser.add_argument("--halves", action="store_true",
                        help="instead: the self-check, each half of --sessions (default: the shipped sessions) "
                             "measured and compared")


def run(args, parser) -> int:
    """Check the arguments (a bad one is ``parser.error``: one line naming it, exit status 2), measure,
    print one JSON object."""
    import json

    from kimilab.traffic import load_trace

    if args.sessions is None and args.trace is None and not args.halves:
        parser.error("expected --sessions PATH and/or --trace PATH (the traffic to measure)")
    if args.halves and args.trace is not None:
        parser.error("--trace: --halves splits agent sessions only")
    for flag, path in (("--sessions", args.sessions), ("--trace", args.trace)):
        if path is not None and not Path(path).is_file():
            parser.error(f"{flag}={path}: no such file")
    if args.variants is not None:
        bad = [v for v in args.variants if v not in VARIANT_NAMES]
        if bad:
            parser.error(f"--variants: {bad[0]!r} is not a variant; expected names from {list(VARIANT_NAMES)}")
    if (args.sessions is not None or args.halves) and args.duration_s <= AGENT_SLO.warmup_s:
        parser.error(f"--duration-s={args.duration_s:g}: expected more than the agent SLO's {AGENT_SLO.warmup_s:g} s "
                     "warm-up (no request after it would be judged)")
    try:
        if args.sessions is not None:
            _sessions_info(args.sessions)
    except (ValueError, OSError, EOFError) as err:
        parser.error(f"--sessions: {err} (expected converted Claude Code sessions)")
    if args.trace is not None:
        with open(args.trace, "rb") as f:
            if f.read(2) == b"\x1f\x8b":
                parser.error(f"--trace={args.trace}: a gzip file; expected a Mooncake jsonl trace (plain text; "
                             "converted agent sessions go to --sessions)")
        try:
            load_trace(args.trace, 512)
        except (ValueError, OSError) as err:
            parser.error(f"--trace={args.trace}: {err}")
    try:
        if args.halves:
            out = two_halves(args.sessions, variants=args.variants or HALVES_VARIANTS, orders=args.orders,
                             instances=args.instances, duration_s=args.duration_s, step=args.step,
                             confirm=args.confirm, deployment=args.deployment, workers=args.workers)
        else:
            out = measure_capacity(args.sessions, args.trace, variants=args.variants, orders=args.orders,
                           instances=args.instances, deployment=args.deployment, requests=args.requests,
                           duration_s=args.duration_s, price_per_hour=args.price, step=args.step,
                           confirm=args.confirm, workers=args.workers, band=args.band, tune=args.tune)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    print(json.dumps(out, indent=1))
    return 0
