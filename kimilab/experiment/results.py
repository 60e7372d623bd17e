"""Running the experiment and keeping its results: one JSON file per run, a markdown table.

``python -m kimilab experiment --out results/`` (``make experiment``) runs Part A
(:mod:`kimilab.experiment.second`) on both workloads and writes
``results/part_a.json`` -- the configuration, the package version, and one row per
(workload, component) -- and ``results/part_a.md``, the table a reader remembers:
what each component saves on the second request and what it costs. Then Part B
(:mod:`kimilab.experiment.scale`): each variant's goodput and dollars at an SLO on the
real conversation trace and the real agent sessions, ``results/part_b.json`` and
``results/part_b.md`` (``--part a|b|all``). By default Part B runs at the size chapter 11
stores and shows (``--scale book``, the same numbers, under two minutes on 2 cores);
``--scale full`` runs every variant on the whole hour. Everything in the files is
deterministic except the wall-clock seconds, which say so in their names.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kimilab.config import tiny
from kimilab.experiment.second import CONFIGS, second_request, sessions
from kimilab.fleet.command import add_spec_arguments, spec_fields
from kimilab.model import Model
from kimilab.validate import HelpWithDefaults, check_int, nonnegative_float_arg, positive_int_arg, writable_dir

__all__ = ["WORKLOADS", "PARTS", "SCALES", "TUNE_CHOICES", "tune_grid", "part_b_arguments", "run_part_a", "part_a_table",
           "add_arguments", "run", "main"]

WORKLOADS = ("agent", "chat")


def _version() -> str:
    try:
        return version("kimilab")
    except PackageNotFoundError:  # running from a checkout without an install
        return "unknown"


def run_part_a(out: Path | str | None = None, *, n_sessions: int = 2, n_out: int = 12,
               repeats: int = 1, seed: int = 0) -> dict:
    """Part A on the reduced model, every workload x component; writes ``out/part_a.json`` if given."""
    n_sessions = check_int("n_sessions", n_sessions, 1)
    model = Model(tiny, seed=seed)
    rows = []
    for kind in WORKLOADS:
        work = sessions(kind, n_sessions, seed, tiny.vocab_size)
        reference = None
        for config in CONFIGS:
            cost, outputs = second_request(model, config, work, n_out=n_out, repeats=repeats,
                                           reference=reference)
            reference = outputs if reference is None else reference
            rows.append({"workload": kind, **cost.as_dict()})
    result = {
        "experiment": "part A: what a second request saves (reduced model, real CPU work)",
        "config": {"model": tiny.name, "seed": seed, "sessions_per_workload": n_sessions,
                   "new_tokens": n_out, "repeats": repeats,
                   "drafter": "controlled, corruption 0.2, k = 4", "block_tokens": 16},
        "kimilab": _version(),
        "python": platform.python_version(),
        "rows": rows,
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "part_a.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (out / "part_a.md").write_text(part_a_table(result) + "\n", encoding="utf-8")
    return result


def part_a_table(result: dict) -> str:
    """Markdown: per workload and component, turn 2's prefill saved and what the component holds."""
    lines = ["| workload | component | prefill tokens computed | prefill FLOPs saved | decode passes | held (KiB) "
             "| same tokens |", "|---|---|---|---|---|---|---|"]
    base = {r["workload"]: r for r in result["rows"] if r["config"] == "baseline"}
    for r in result["rows"]:
        b = base[r["workload"]]
        saved = 1 - r["prefill_flops"] / b["prefill_flops"]
        lines.append(f"| {r['workload']} | {r['config']} | {r['prefill_tokens']:,} of {r['prompt_tokens']:,} "
                     f"| {saved:.0%} | {r['decode_passes']} | {r['held_bytes'] / 1024:,.0f} "
                     f"| {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


PARTS = ("a", "b", "all")


def _scales() -> dict:
    """Part B's sizes, by name (``--scale``): ``book``, what chapter 11 stores and shows, and ``full``."""
    from kimilab.experiment.tuning import BUDGETS, SEQS
    from kimilab.experiment.variants import BASELINE

    chat = {"conversation": (BUDGETS, SEQS)}
    return {
        # the five variants chapter 11 compares, one instance, the chat trace's first 2,400 requests and
        # 4-minute agent windows, five orders, each variant's chat scheduler tuned first
        "book": dict(n_requests=2400, instances=1, agent_instances=1, agent_duration_s=240.0, orders=5, rel_tol=0.1,
                     start_scale=4.0, variants=(BASELINE, "ends + state-aware", "none + prefix-affinity",
                                                "all-MLA bf16 TP4", "all-MLA fp8 TP4"), tune=chat),
        # every variant, the whole hour on 8 instances, agents on 4 in 15-minute windows (about an hour)
        "full": dict(n_requests=None, instances=8, agent_instances=4, agent_duration_s=900.0, orders=5, rel_tol=0.1,
                     start_scale=8.0, variants=None, tune=chat),
    }


SCALES = ("book", "full")


def part_b_arguments(scale: str = "book", **changes) -> dict:
    """:func:`kimilab.experiment.scale.run_part_b`'s keyword arguments at ``scale`` (``book``: chapter 11's
    stored run, ``make experiment``'s default; ``full``: every variant on the whole hour), with ``changes``."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}: expected one of {list(SCALES)}")
    return dict(_scales()[scale], **changes)


def main(argv: list[str] | None = None) -> int:
    """``python -m kimilab experiment`` without the rest of the command line."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kimilab experiment", description=__doc__.split("\n")[0],
                                     formatter_class=HelpWithDefaults)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    """Run the parts ``args`` asks for; 0 if every check in them held."""
    from kimilab.experiment.scale import run_part_b
    from kimilab.experiment.tables import part_b_table

    writable_dir("--out", args.out)  # before any work: a run must not end in a failed write
    if args.overlap_loads and args.host_ratio is None and args.store_ratio is None:
        print("python -m kimilab experiment: error: --overlap-loads: expected --host-ratio or --store-ratio "
              "(without a tier nothing is loaded)", file=sys.stderr)
        raise SystemExit(2)
    ok = True
    if args.part in ("a", "all"):
        result = run_part_a(args.out, n_sessions=args.sessions, repeats=args.repeats)
        print(part_a_table(result))
        print(f"written: {Path(args.out) / 'part_a.json'}, {Path(args.out) / 'part_a.md'}")
        ok = all(r["same_tokens"] for r in result["rows"])
    if args.part in ("b", "all"):
        from kimilab.costs import deployment

        print(f"deployment: {deployment(args.deployment).describe()} (the hybrid's; all-MLA also under "
              f"DP-attention)")
        given = {"n_requests": args.requests, "instances": args.instances, "agent_instances": args.agent_instances,
                 "agent_duration_s": None if args.agent_minutes is None else 60.0 * args.agent_minutes,
                 "orders": args.orders, "tune": None if args.tune is None else tune_grid(args.tune),
                 "host_ratio": args.host_ratio, "store_ratio": args.store_ratio,
                 "overlap_loads": args.overlap_loads or None, "prefill": args.prefill,
                 "speculation": spec_fields(args, _Parser())}
        kwargs = part_b_arguments(args.scale, **{k: v for k, v in given.items() if v is not None})
        for key in ("instances", "agent_instances"):
            if args.prefill is not None and kwargs[key] <= args.prefill:
                print(f"python -m kimilab experiment: error: --prefill={args.prefill}: expected fewer than part B's "
                      f"{kwargs[key]} {key.replace('_', ' ')} (--{key.replace('_', '-')})", file=sys.stderr)
                raise SystemExit(2)
        if args.tune == "none":
            kwargs["tune"] = None
        result = run_part_b(args.out, deployment=args.deployment, price_per_hour=args.price, workers=args.workers,
                            progress=lambda line: print(line, file=sys.stderr, flush=True), **kwargs)
        print(part_b_table(result))
        print(f"written: {Path(args.out) / 'part_b.json'}, {Path(args.out) / 'part_b.md'} "
              f"({result['run_wall_s']:.0f} s wall)")
        ok = ok and all(r["goodput"] > 0 for r in result["rows"] if r["policy"] != "none")
    return 0 if ok else 1


class _Parser:
    """What :func:`~kimilab.fleet.command.spec_fields` needs of a parser: a one-line error, exit 2."""

    @staticmethod
    def error(message: str) -> None:
        print(f"python -m kimilab experiment: error: {message}", file=sys.stderr)
        raise SystemExit(2)


TUNE_CHOICES = ("none", "chat", "all")
def tune_grid(which: str) -> dict | None:
    """``--tune``'s grids for :func:`kimilab.experiment.scale.run_part_b`: the step token budget over
    2K-16K x ``max_num_seqs`` 256 or 1,024 (:mod:`kimilab.experiment.tuning`), on chat ("chat") or on
    both workloads ("all"); "none": the deployment's own setting."""
    from kimilab.experiment.tuning import BUDGETS, SEQS

    if which not in TUNE_CHOICES:
        raise ValueError(f"tune={which!r}: expected one of {list(TUNE_CHOICES)}")
    grid = (BUDGETS, SEQS)
    return {"none": None, "chat": {"conversation": grid},
            "all": {"conversation": grid, "agents": grid}}[which]


def add_arguments(parser) -> None:
    """The experiment's options (``python -m kimilab experiment`` and :func:`main`); argparse adds
    each default to its help."""
    parser.add_argument("--out", default="results", help="directory for the result files")
    parser.add_argument("--part", default="all", choices=PARTS, help="a: reduced model on CPU; b: 48B fleet "
                        "simulator on the real trace; all: both")
    parser.add_argument("--sessions", type=positive_int_arg, default=2, help="part A: sessions per workload")
    parser.add_argument("--repeats", type=positive_int_arg, default=1,
                        help="part A: wall-clock repeats; the fastest is kept")
    parser.add_argument("--scale", default="book", choices=SCALES,
                        help="part B's size: book, chapter 11's five variants on one instance (the chat trace's first "
                             "2,400 requests, 4-minute agent windows; the numbers the chapter stores); full, every "
                             "variant on the whole hour on 8 instances, agents on 4 in 15-minute windows (about an "
                             "hour on 2 cores). The options below change one size of it")
    parser.add_argument("--requests", type=positive_int_arg, default=None,
                        help="part B: the conversation trace's first N requests (book: 2,400; full: all)")
    parser.add_argument("--instances", type=positive_int_arg, default=None,
                        help="part B: instances serving the conversation trace (book: 1; full: 8)")
    parser.add_argument("--agent-instances", type=positive_int_arg, default=None,
                        help="part B: instances serving the agent sessions (book: 1; full: 4)")
    parser.add_argument("--agent-minutes", type=positive_int_arg, default=None,
                        help="part B: simulated minutes of each closed-loop agent replay (book: 4; full: 15)")
    parser.add_argument("--orders", "--seeds", dest="orders", type=positive_int_arg, default=None,
                        help="part B: orders each goodput is measured in (agents: the sessions' order; chat: the "
                             "gaps between arrivals, shuffled), reported as mean, min and max (both scales: 5)")
    tiers = parser.add_mutually_exclusive_group()  # one tier under the cache: an instance's own, or shared
    tiers.add_argument("--host-ratio", type=nonnegative_float_arg, default=None,
                        help="part B: a host-memory tier of this many times each instance's HBM pool under its "
                             "prefix cache (kimilab.prefix.host; SGLang's HiCache guide uses 2); none given: no tier")
    tiers.add_argument("--store-ratio", type=nonnegative_float_arg, default=None,
                        help="part B: instead, one store the instances share (as Mooncake Store pools the cluster's "
                             "DRAM), this many times their HBM pools together, written through over RDMA "
                             "(kimilab.experiment.tiers); it shares only between instances, so use it with more "
                             "than one")
    parser.add_argument("--overlap-loads", action="store_true",
                        help="part B, with --host-ratio or --store-ratio: load layer by layer under each step's "
                             "compute (SGLang's HiCache) instead of before it")
    tiers.add_argument("--prefill", type=positive_int_arg, default=None, metavar="N",
                       help="part B, instead of a tier: disaggregate, N of each workload's instances only prefill and "
                            "hand each request's KV and states to the rest, which only decode (kimilab.fleet.disagg); "
                            "needs more instances than N (--instances, --agent-instances)")
    add_spec_arguments(parser)
    parser.add_argument("--workers", type=positive_int_arg, default=None,
                        help="part B: processes the variants are spread over (default: cores, at most 4)")
    parser.add_argument("--price", type=nonnegative_float_arg, default=2.0,
                        help="part B: assumed dollars per accelerator-hour")
    parser.add_argument("--tune", default=None, choices=TUNE_CHOICES,
                        help="part B: tune each variant's max_batched_tokens (2K-16K) and max_num_seqs on order 0 "
                             "of this workload before measuring it (all: chat and agents, each on its own; "
                             "both scales: chat)")
    from kimilab.costs import DEFAULT_DEPLOYMENT, DEPLOYMENTS

    parser.add_argument("--deployment", default=DEFAULT_DEPLOYMENT.name, choices=sorted(DEPLOYMENTS),
                        help="part B: the hybrid's deployment (pages, states and step times)")
