"""The one command line: ``python -m kimilab <command>`` (or the ``kimilab`` script).

Commands:

* ``prefix TRACE``          replay a Mooncake-format trace through a prefix cache; one JSON object
* ``traces stats FILE...``  validate traces and print their statistics
* ``traces regenerate DIR`` write the book's generated traces (byte-identical to data/)
* ``memory``                a model's cache bytes and roofline decode time against a baseline
* ``book``                  execute every chapter and render the book (same as ``make book``)
* ``html``                  render the web edition from the stored chapters (``make html``)
* ``student``               write the classroom edition without solutions (``make student``)
* ``experiment``            the book's experiment: results/part_a.* and part_b.* (``make experiment``)
* ``fleet TRACE...``        serve traces (one tenant each) on a fleet of engines; one JSON object
* ``cp --tokens T``         context-parallel KDA on the ranks of ``mpiexec -n P``; one JSON object

A bad argument or a bad trace line is one line on stderr naming it, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

__all__ = ["main"]

_FLOAT_INF = ("inf", "infinity", "unbounded")


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage dump) and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive int")
    return value


def _capacity(text: str) -> int | None:
    """A positive int, or ``inf`` for an unbounded cache (None)."""
    if text.strip().lower() in _FLOAT_INF:
        return None
    return _positive_int(text)


def _parser() -> _Parser:
    from kimilab.config import PRESETS
    from kimilab.prefix.policies import POLICIES

    top = _Parser(prog="python -m kimilab", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("prefix", help="replay a trace through a prefix cache; print one JSON object",
                       description="Replay a Mooncake-format trace through a dual-granularity prefix "
                                   "cache and print one JSON object of hit rates, memory and FLOPs.")
    p.add_argument("trace", metavar="TRACE.jsonl",
                   help="Mooncake jsonl trace (timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--policy", choices=list(POLICIES), required=True,
                   help="where KDA states are checkpointed: " + ", ".join(POLICIES))
    p.add_argument("--capacity-tokens", type=_capacity, required=True, metavar="N|inf",
                   help="cache memory in tokens of the model's KV (N * kv_bytes_per_token bytes), shared "
                        "by KV pages and state checkpoints; 'inf' for no limit")
    p.add_argument("--model", default="kimi_linear_48b", choices=sorted(PRESETS),
                   help="config preset whose bytes and FLOPs are used (default kimi_linear_48b)")
    p.add_argument("--block-size", type=_positive_int, default=512,
                   help="tokens per hash block and per KV page (default 512, Mooncake's)")
    p.add_argument("--interval", type=_positive_int, default=None,
                   help="checkpoint interval in tokens for align (default 2048) and dual (default none)")
    p.add_argument("--alpha", type=float, default=0.005,
                   help="dual: weight of FLOPs-per-byte vs recency (in cache turnovers; default 0.005)")
    p.add_argument("--partial-blocks", action="store_true", help="also cache a prompt's trailing partial block")

    t = sub.add_parser("traces", help="trace files: statistics, or regenerate the book's traces")
    tsub = t.add_subparsers(dest="traces_command", required=True, parser_class=_Parser)
    st = tsub.add_parser("stats", help="validate traces and print their statistics")
    st.add_argument("files", nargs="+", metavar="FILE")
    st.add_argument("--block-size", type=_positive_int, default=512)
    rg = tsub.add_parser("regenerate", help="write the book's generated traces into DIR")
    rg.add_argument("directory", metavar="DIR")

    m = sub.add_parser("memory", help="cache bytes and roofline decode time of a model against a baseline")
    m.add_argument("--model", default="kimi_linear_48b", choices=sorted(PRESETS))
    m.add_argument("--baseline", default="all_mla_27", choices=sorted(PRESETS))

    b = sub.add_parser("book", help="execute every chapter and render the book")
    b.add_argument("--only", nargs="+", metavar="NN", help="build only these chapter numbers")
    b.add_argument("--no-html", action="store_true", help="skip rendering HTML")

    sub.add_parser("html", help="render the web edition from the executed chapters into _build/html/")
    sub.add_parser("student", help="write the classroom edition: student/NN_slug.ipynb, solutions removed")

    e = sub.add_parser("experiment", help="the book's experiment: what a second request saves (results/*.json)")
    e.add_argument("--out", default="results", help="directory for the result files")
    e.add_argument("--part", default="all", choices=["a", "b", "all"],
                   help="a: reduced model on CPU; b: 48B fleet simulator on the real trace; all (default): both")
    e.add_argument("--sessions", type=_positive_int, default=2, help="part A: sessions per workload")
    e.add_argument("--repeats", type=_positive_int, default=1, help="part A: wall-clock repeats (the best is kept)")
    e.add_argument("--requests", type=_positive_int, default=None, help="part B: the trace's first N requests "
                   "(default: all)")
    e.add_argument("--instances", type=_positive_int, default=8, help="part B: engine instances (default 8)")
    e.add_argument("--capacity-tokens", type=_positive_int, default=2_000_000,
                   help="part B: each instance's pool in tokens of KV (default 2000000)")
    e.add_argument("--price", type=_nonnegative_float, default=2.0,
                   help="part B: assumed dollars per accelerator-hour (default 2.0)")
    f = sub.add_parser("fleet", help="serve traces (one tenant per file) on N engine instances; print one JSON object",
                       description="Serve Mooncake-format traces, one tenant per file (named by its stem), on a "
                                   "fleet of continuous-batching engines on simulated time; print one JSON object.")
    f.add_argument("traces", nargs="+", metavar="TRACE.jsonl", help="Mooncake jsonl traces, one tenant each")
    f.add_argument("--instances", type=_positive_int, required=True, help="engine instances")
    f.add_argument("--router", required=True, choices=["round-robin", "least-loaded", "prefix-affinity", "state-aware"])
    f.add_argument("--isolation", default="none", choices=["none", "quota"],
                   help="quota: per-tenant reserved cache share and fair (virtual token counter) admission")
    f.add_argument("--capacity-tokens", type=_capacity, required=True, metavar="N|inf",
                   help="each instance's pool in tokens of KV (running requests + prefix cache); 'inf' for no limit")
    f.add_argument("--model", default="kimi_linear_48b", choices=sorted(PRESETS))
    f.add_argument("--rate-scale", type=_positive_float, default=1.0, help="divide arrival times by X (default 1)")
    f.add_argument("--fail", action="append", default=[], type=_failure, metavar="INSTANCE@SECONDS",
                   help="instance INSTANCE fails at SECONDS of simulated time (repeatable)")
    c = sub.add_parser("cp", help="context-parallel KDA across the ranks of mpiexec -n P; print one JSON object",
                       description="Run KDA context-parallel on seeded inputs across the ranks of "
                                   "`mpiexec -n P python -m kimilab cp`, and one rank alone in the same run; "
                                   "rank 0 prints one JSON object.")
    c.add_argument("--tokens", type=_positive_int, required=True, help="prompt length T")
    c.add_argument("--heads", type=_positive_int, default=4)
    c.add_argument("--dim", type=_positive_int, default=64, help="K = V")
    c.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    c.add_argument("--scheme", default="allgather", choices=["allgather", "sequential", "tree"])
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--even", action="store_true", help="equal slices (default: rank 0 takes more, to balance)")
    c.add_argument("--affine-cost", type=float, default=1.25,
                   help="work per token of a corrected (affine) slice over a plain one, for balancing (default 1.25)")
    c.add_argument("--repeats", type=int, default=1,
                   help="alternate the one-rank and P-rank runs this many times after a warm-up; medians (default 1)")
    c.add_argument("--timeout", type=_positive_float, default=120.0, help="seconds any blocking call may wait")
    return top


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive finite number")
    return value


def _failure(text: str) -> tuple[int, float]:
    inst, sep, at = text.partition("@")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected INSTANCE@SECONDS")
    try:
        i, t = int(inst), float(at)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected INSTANCE@SECONDS (an int and a number)") from None
    if i < 0 or not 0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a non-negative instance and time")
    return i, t


def _fleet(args, parser) -> int:
    from kimilab.config import preset
    from kimilab.fleet import run_fleet
    from kimilab.fleet.tenants import load_tenants

    for i, _ in args.fail:
        if i >= args.instances:
            parser.error(f"--fail {i}@...: expected an instance below --instances={args.instances}")
    if args.capacity_tokens is not None and args.capacity_tokens < 512:
        parser.error(f"--capacity-tokens={args.capacity_tokens}: expected at least one 512-token block")
    try:
        requests = load_tenants(args.traces)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    if not requests:
        parser.error("the traces hold no requests")
    try:
        result = run_fleet(requests, preset(args.model), instances=args.instances, router=args.router,
                           capacity_tokens=args.capacity_tokens, isolation=args.isolation,
                           rate_scale=args.rate_scale, fails=args.fail)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    print(json.dumps(result.summary()))
    return 0


def _cp(args, parser) -> int:
    from kimilab.cp.launch import mpi_run

    try:
        out = mpi_run(args.tokens, args.heads, args.dim, args.dtype, seed=args.seed, scheme=args.scheme,
                      affine_cost=None if args.even else args.affine_cost, timeout=args.timeout,
                      repeats=args.repeats)
    except (ValueError, TimeoutError) as exc:
        parser.error(str(exc))
    if out is not None:
        print(json.dumps(out))
    return 0


def _prefix(args, parser) -> int:
    from kimilab.config import preset
    from kimilab.prefix import HybridPrefixCache, RunPrefixCache, make_policy
    from kimilab.sim import simulate
    from kimilab.traffic import load_trace

    if args.interval is not None and args.policy not in ("align", "dual"):
        parser.error(f"--interval: only align and dual take a checkpoint interval, not {args.policy}")
    if args.capacity_tokens is not None and args.capacity_tokens < args.block_size:
        parser.error(f"--capacity-tokens={args.capacity_tokens}: expected at least one block "
                     f"(--block-size={args.block_size})")
    kwargs = {}
    if args.interval is not None:
        kwargs["interval"] = args.interval
    if args.policy == "dual":
        kwargs["alpha"] = args.alpha
    try:
        records = load_trace(args.trace, args.block_size)
    except (ValueError, OSError) as err:
        parser.error(f"{args.trace}: {err}")
    try:
        policy = make_policy(args.policy, **kwargs)
        if args.partial_blocks or any(r.tokens is not None for r in records):
            cache = HybridPrefixCache.for_budget(preset(args.model), policy, block_size=args.block_size,
                                                 capacity_tokens=args.capacity_tokens,
                                                 partial_blocks=args.partial_blocks)
        else:  # whole blocks keyed by hash ids: the run-length twin gives the same numbers, faster
            cache = RunPrefixCache(preset(args.model), policy, block_size=args.block_size,
                                   capacity_tokens=args.capacity_tokens)
    except ValueError as err:
        parser.error(str(err))
    result = simulate(records, cache=cache)
    out = result.as_dict()
    out["policy_detail"] = policy.describe()
    print(json.dumps(out))
    return 0


def _traces(args, parser) -> int:
    from kimilab.traffic import format_stats, load_trace, regenerate, trace_stats

    if args.traces_command == "regenerate":
        try:
            paths = regenerate(args.directory)
        except OSError as err:
            parser.error(f"{args.directory}: {err}")
        for path in paths:
            print(f"wrote {path} ({path.stat().st_size} bytes)")
        return 0
    for path in args.files:
        try:
            records = load_trace(path, args.block_size)
        except (ValueError, OSError) as err:
            parser.error(f"{path}: {err}")
        print(format_stats(path, trace_stats(records, args.block_size)))
    return 0


def _memory(args) -> int:
    from kimilab import costs
    from kimilab.config import preset

    for line in costs.summary(preset(args.model), preset(args.baseline)):
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # the subcommand's parser
    if args.command == "prefix":
        return _prefix(args, sub)
    if args.command == "traces":
        return _traces(args, sub._subparsers._group_actions[0].choices[args.traces_command])
    if args.command == "memory":
        return _memory(args)
    if args.command == "cp":
        return _cp(args, sub)
    if args.command == "fleet":
        return _fleet(args, sub)
    if args.command == "html":
        from kimilab import site

        return site.main()
    if args.command == "student":
        from kimilab import classroom

        return classroom.main()
    if args.command == "experiment":
        from kimilab.experiment import results

        return results.main(["--out", args.out, "--part", args.part, "--sessions", str(args.sessions),
                             "--repeats", str(args.repeats), "--instances", str(args.instances),
                             "--capacity-tokens", str(args.capacity_tokens), "--price", repr(args.price)]
                            + ([] if args.requests is None else ["--requests", str(args.requests)]))
    from kimilab import book

    return book.main((["--only", *args.only] if args.only else []) + (["--no-html"] if args.no_html else []))


if __name__ == "__main__":
    sys.exit(main())
