"""Running the experiment and keeping its results: one JSON file per run, a markdown table.

``python -m kimilab experiment --out results/`` (``make experiment``) runs Part A
(:mod:`kimilab.experiment.second`) on both workloads and writes
``results/part_a.json`` -- the configuration, the package version, and one row per
(workload, component) -- and ``results/part_a.md``, the table a reader remembers:
what each component saves on the second request and what it costs. Then Part B
(:mod:`kimilab.experiment.scale`): the same ablation at 48B sizes through the fleet
simulator on the real trace, ``results/part_b.json`` and ``results/part_b.md``
(``--part a|b|all``). Everything in the files is deterministic except the wall-clock
seconds, which say so in their names.
"""

from __future__ import annotations

import json
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kimilab.config import tiny
from kimilab.experiment.second import CONFIGS, second_request, sessions
from kimilab.model import Model
from kimilab.validate import check_int

__all__ = ["WORKLOADS", "PARTS", "run_part_a", "part_a_table", "add_arguments", "main"]

WORKLOADS = ("agent", "chat")


def _version() -> str:
    try:
        return version("kimilab")
    except PackageNotFoundError:  # running from a checkout without an install
        return "unknown"


def run_part_a(out: Path | str | None = None, *, n_sessions: int = 2, n_out: int = 12, repeats: int = 1,
               seed: int = 0) -> dict:
    """Part A on the reduced model, every workload x component; writes ``out/part_a.json`` if given."""
    n_sessions = check_int("n_sessions", n_sessions, 1)
    model = Model(tiny, seed=seed)
    rows = []
    for kind in WORKLOADS:
        work = sessions(kind, n_sessions, seed, tiny.vocab_size)
        reference = None
        for config in CONFIGS:
            cost, outputs = second_request(model, config, work, n_out=n_out, repeats=repeats, reference=reference)
            reference = outputs if reference is None else reference
            rows.append({"workload": kind, **cost.as_dict()})
    result = {
        "experiment": "part A: what a second request saves (reduced model, real CPU work)",
        "config": {"model": tiny.name, "seed": seed, "sessions_per_workload": n_sessions, "new_tokens": n_out,
                   "repeats": repeats, "drafter": "controlled, corruption 0.2, k = 4", "block_tokens": 16},
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


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kimilab.experiment.scale import part_b_table, run_part_b

    parser = argparse.ArgumentParser(prog="python -m kimilab experiment", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    for name in ("sessions", "repeats", "instances", "capacity_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive int")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests {args.requests}: expected a positive int")
    if not args.price >= 0:
        parser.error(f"--price {args.price}: expected a price >= 0 (dollars per accelerator-hour)")
    ok = True
    if args.part in ("a", "all"):
        result = run_part_a(args.out, n_sessions=args.sessions, repeats=args.repeats)
        print(part_a_table(result))
        print(f"written: {Path(args.out) / 'part_a.json'}, {Path(args.out) / 'part_a.md'}")
        ok = all(r["same_tokens"] for r in result["rows"])
    if args.part in ("b", "all"):
        result = run_part_b(args.out, n_requests=args.requests, instances=args.instances,
                            capacity_tokens=args.capacity_tokens, price_per_hour=args.price)
        print(part_b_table(result))
        print(f"written: {Path(args.out) / 'part_b.json'}, {Path(args.out) / 'part_b.md'}")
        ok = ok and all(r["finished"] == r["requests"] for r in result["rows"])
    return 0 if ok else 1


def add_arguments(parser) -> None:
    """The experiment's options (shared by ``python -m kimilab experiment``)."""
    parser.add_argument("--out", default="results", help="directory for the result files")
    parser.add_argument("--part", default="all", choices=PARTS, help="a: reduced model on CPU; b: 48B fleet "
                        "simulator on the real trace; all (default): both")
    parser.add_argument("--sessions", type=int, default=2, help="part A: sessions per workload")
    parser.add_argument("--repeats", type=int, default=1, help="part A: wall-clock repeats (the best is kept)")
    parser.add_argument("--requests", type=int, default=None, help="part B: the trace's first N requests "
                        "(default: all)")
    parser.add_argument("--instances", type=int, default=8, help="part B: engine instances (default 8)")
    parser.add_argument("--capacity-tokens", type=int, default=2_000_000,
                        help="part B: each instance's pool in tokens of KV (default 2,000,000)")
    parser.add_argument("--price", type=float, default=2.0,
                        help="part B: assumed dollars per accelerator-hour (default 2.0)")
