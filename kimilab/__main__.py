"""The one command line: ``python -m kimilab <command>`` (or the ``kimilab`` script).

Commands:

* ``prefix TRACE``          replay a Mooncake trace or Claude Code sessions through any cache of
                            chapter 6 (``kimilab.sim.command``); one JSON object
* ``traces stats FILE...``  validate traces and print their statistics
* ``traces regenerate DIR`` write the book's generated traces (byte-identical to data/)
* ``memory``                a model's cache bytes and roofline decode time against a baseline
* ``book``                  execute every chapter and render the book (same as ``make book``)
* ``html``                  render the web edition from the stored chapters (``make html``)
* ``student``               write the student bundle: no solutions, no answers (``make student``)
* ``grade SUBMISSION...``   execute answered student notebooks; a CSV of every exercise (``make grade``)
* ``experiment``            the book's experiment: results/part_a.* and part_b.* (``make experiment``)
* ``capacity``              every variant's capacity on your own sessions and/or chat trace; one JSON object
* ``fleet TRACE...``        serve traces (one tenant each) on a fleet of engines; one JSON object
* ``cp --tokens T``         context-parallel KDA on the ranks of ``mpiexec -n P``; one JSON object
* ``results [--check]``     the stored results of the chapters' long computations; recompute and compare

A bad argument or a bad trace line is one line on stderr naming it, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from kimilab.validate import (HOST_GB_HELP, HelpWithDefaults, gb_or_inf_arg, nonnegative_float_arg,
                              positive_float_arg, positive_int_arg, tokens_or_inf_arg)

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage dump) and exit status 2, and every option's
    help ends with its default (written by argparse, so it cannot drift from the code)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpWithDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def _nonnegative_int(text: str) -> int:
    """An int >= 0 (a seed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be an int >= 0")
    return value


def _add_deployment(parser) -> None:
    """``--deployment``: which named deployment prices every byte (per device) and second."""
    from kimilab.costs import DEFAULT_DEPLOYMENT, DEPLOYMENTS

    parser.add_argument("--deployment", default=DEFAULT_DEPLOYMENT.name, choices=sorted(DEPLOYMENTS),
                        help="the named deployment every byte (per device) and second is priced on")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kimilab")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown (not installed)"


def _parser() -> _Parser:
    from inspect import signature

    from kimilab.config import PRESETS
    from kimilab.prefix.policies import POLICIES
    from kimilab.sim import command
    from kimilab.sim.sweep import CACHES, SESSIONS_PER_S

    top = _Parser(prog="python -m kimilab", description=__doc__.splitlines()[0])
    top.add_argument("--version", action="version", version=f"kimilab {_version()}")
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("prefix", help="replay a trace through a prefix cache; print one JSON object",
                       description="Replay a Mooncake-format trace or converted Claude Code sessions through "
                                   "any prefix cache chapter 6 compares and print one JSON object of hit rates, "
                                   "memory and FLOPs (the numbers kimilab.sim.replay gives).")
    p.add_argument("trace", metavar="TRACE",
                   help="a Mooncake jsonl trace (timestamp, input_length, output_length, hash_ids), or converted "
                        "Claude Code sessions (a name ending in .jsonl.gz, as traces convert-claude-code writes)")
    p.add_argument("--policy", choices=[*CACHES, "auto"], required=True, metavar="NAME",
                   help="the cache: a checkpoint policy (where KDA states are kept: " + ", ".join(POLICIES) + "), "
                        "a design that ships (vllm-align at vLLM's own block for the deployment, marconi, "
                        "sglang-no-buffer, sglang-extra-buffer), the clairvoyant reference oracle, or auto: the "
                        "online policy chapter 6's map picks for the trace's sharing statistics (it prints why)")
    p.add_argument("--capacity-tokens", type=tokens_or_inf_arg, required=True, metavar="N|inf",
                   help="cache memory per device in tokens of KV (N * KV bytes per token on one device), shared "
                        "by KV pages and state checkpoints; 'inf' for no limit")
    p.add_argument("--model", default="kimi_linear_48b", choices=sorted(PRESETS),
                   help="config preset whose bytes and FLOPs are used")
    p.add_argument("--block-size", type=positive_int_arg, default=512,
                   help="tokens per KV page and per id of a Mooncake trace (512 is Mooncake's); sessions (an id "
                        "per 512 tokens) are re-keyed to it; vllm-align re-keys to vLLM's block instead")
    p.add_argument("--interval", type=positive_int_arg, default=None,
                   help="checkpoint interval in tokens, for the caches that take one (align, dual, chunk-ends, "
                        "periodic; SGLang's chunk size; if not given, each one's own default)")
    p.add_argument("--alpha", type=nonnegative_float_arg, default=None,
                   help="dual: weight of FLOPs-per-byte vs recency, in cache turnovers (if not given, "
                        f"{signature(POLICIES['dual']).parameters['alpha'].default}, dual's own); marconi: a fixed "
                        "alpha (if not given, tuned online as Marconi does)")
    p.add_argument("--sessions-per-s", type=positive_float_arg, default=None, metavar="RATE",
                   help=f"sessions only: Poisson session starts per second (if not given, {SESSIONS_PER_S}, as "
                        "chapter 6)")
    p.add_argument("--seed", type=_nonnegative_int, default=None,
                   help="sessions only: the seed of their order and start times (if not given, 0)")
    p.add_argument("--partial-blocks", action="store_true",
                   help="also cache a prompt's trailing partial block (the checkpoint policies only)")
    p.add_argument("--host-gb", type=gb_or_inf_arg, default=None, metavar="GB|inf",
                   help=HOST_GB_HELP + "; the checkpoint policies only, whole blocks")
    _add_deployment(p)
    p.set_defaults(func=command.run, parser=p)

    t = sub.add_parser("traces", help="trace files: statistics, or regenerate the book's traces")
    tsub = t.add_subparsers(dest="traces_command", required=True, parser_class=_Parser)
    st = tsub.add_parser("stats", help="validate traces and print their statistics")
    st.add_argument("files", nargs="+", metavar="FILE")
    st.add_argument("--block-size", type=positive_int_arg, default=512, help="tokens per hash block")
    st.set_defaults(func=_traces, parser=st)
    rg = tsub.add_parser("regenerate", help="write the book's generated traces into DIR")
    rg.add_argument("directory", metavar="DIR")
    rg.set_defaults(func=_traces, parser=rg)
    cc = tsub.add_parser("convert-claude-code", help="convert the Claude Code agent sessions into the book's form",
                         description="Convert kv-cache-tester's trace_*.json.gz sessions into one 512-token-block "
                                     "file (what data/claude_code_sessions.jsonl.gz is), byte for byte.")
    cc.add_argument("source", metavar="SOURCE_DIR", help="the folder of trace_*.json.gz files")
    cc.add_argument("out", metavar="OUT.jsonl.gz")
    cc.set_defaults(func=_traces, parser=cc)

    m = sub.add_parser("memory", help="cache bytes and roofline decode time of a model against a baseline")
    m.add_argument("--model", default="kimi_linear_48b", choices=sorted(PRESETS), help="the model to price")
    m.add_argument("--baseline", default="all_mla_27", choices=sorted(PRESETS), help="the model to compare with")
    _add_deployment(m)
    m.set_defaults(func=_memory, parser=m)

    b = sub.add_parser("book", help="execute every chapter and render the book")
    b.add_argument("--only", nargs="+", metavar="NN", help="build only these chapter numbers")
    b.add_argument("--no-html", action="store_true", help="skip rendering HTML")
    b.add_argument("--jobs", type=positive_int_arg, default=None, metavar="N",
                   help="chapters executed at once (if not given: one per core, at most 2)")
    b.set_defaults(func=_book, parser=b)

    h = sub.add_parser("html", help="render the web edition from the executed chapters into _build/html/")
    h.set_defaults(func=_html, parser=h)
    s = sub.add_parser("student", help="write the student bundle: student/ and student.zip, with no answers in it")
    s.set_defaults(func=_classroom, parser=s)
    g = sub.add_parser("grade", help="execute answered student notebooks and write a CSV of every exercise's result")
    g.add_argument("submissions", nargs="+", metavar="SUBMISSION", help="student notebooks, or folders of them")
    g.add_argument("--out", default="grades.csv", help="the CSV to write")
    g.add_argument("--timeout", type=positive_int_arg, default=600, help="seconds a cell may run")
    g.add_argument("--limit", type=positive_int_arg, default=1800, help="seconds a whole notebook may run")
    g.add_argument("--jobs", type=positive_int_arg, default=1, help="notebooks graded at once, each in its own kernel")
    g.set_defaults(func=_classroom, parser=g)

    from kimilab.experiment.results import add_arguments as experiment_arguments

    e = sub.add_parser("experiment", help="the book's experiment: what a second request saves (results/*.json)")
    experiment_arguments(e)
    e.set_defaults(func=_experiment, parser=e)
    from kimilab.experiment import capacity

    k = sub.add_parser("capacity", help="every variant's capacity on your own traffic, over several orders; "
                                        "print one JSON object",
                       description="Measure each variant's goodput on converted Claude Code sessions (--sessions) "
                                   "and/or a Mooncake-format chat trace (--trace), each over several orders of the "
                                   "traffic, with a search that does not assume pass/fail is monotone in the load; "
                                   "print one JSON object: per variant the mean, min, max and spread, $/M output "
                                   "tokens, the ratio to the baseline and a higher/lower/tie label.")
    capacity.add_arguments(k)
    k.set_defaults(func=capacity.run, parser=k)
    from kimilab import stored

    r = sub.add_parser("results", help="list the stored results of the chapters' long runs; --check recomputes them")
    stored.add_arguments(r)
    r.set_defaults(func=stored.run, parser=r)
    from kimilab.fleet import command as fleet_command

    f = sub.add_parser("fleet", help="serve traces (one tenant per file) on N engine instances; print one JSON object",
                       description="Serve Mooncake-format traces, one tenant per file (named by its stem), on a "
                                   "fleet of continuous-batching engines on simulated time; print one JSON object.")
    fleet_command.add_arguments(f)
    _add_deployment(f)
    f.set_defaults(func=fleet_command.run, parser=f)
    c = sub.add_parser("cp", help="context-parallel KDA across the ranks of mpiexec -n P; print one JSON object",
                       description="Run KDA context-parallel on seeded inputs across the ranks of "
                                   "`mpiexec -n P python -m kimilab cp`, and one rank alone in the same run; "
                                   "rank 0 prints one JSON object.")
    c.add_argument("--tokens", type=positive_int_arg, required=True, help="prompt length T")
    c.add_argument("--heads", type=positive_int_arg, default=4, help="KDA heads")
    c.add_argument("--dim", type=positive_int_arg, default=64, help="K = V")
    c.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute precision")
    c.add_argument("--scheme", default="allgather", choices=["allgather", "sequential", "tree", "needed", "relay"],
                   help="how ranks learn the state entering their slice")
    c.add_argument("--method", default="affine", choices=["affine", "kcp"],
                   help="what ranks r > 0 run before they know it: the affine pass, or fla's KCP (shared "
                        "preparation, a transition pre-pass, then the main pass)")
    c.add_argument("--inputs", default="flushed", choices=["flushed", "living"],
                   help="input regime: random keys and Kimi's gate (M flushes), or 16-dim keys and a slow "
                        "gate (M lives)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    c.add_argument("--even", action="store_true", help="equal slices (without it, rank 0 takes more, to balance)")
    c.add_argument("--affine-cost", type=positive_float_arg, default=1.25,
                   help="work per token of a corrected (affine) slice over a plain one, for balancing")
    c.add_argument("--repeats", type=positive_int_arg, default=1,
                   help="alternate the one-rank and P-rank runs this many times after a warm-up; medians")
    c.add_argument("--timeout", type=positive_float_arg, default=120.0, help="seconds any blocking call may wait")
    c.add_argument("--model", default=None, choices=sorted(n for n, cfg in PRESETS.items() if not cfg.shapes_only),
                   help="instead of one KDA layer: the whole reduced model's CP prefill (KDA state passing and "
                        "ring attention), checked against Model.prefill on one rank")
    c.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"],
                   help="with --model: the global-attention layers' layout (zigzag balances causal work)")
    c.set_defaults(func=_cp, parser=c)
    return top


def _cp(args, parser) -> int:
    from kimilab.cp.launch import MAX_CP_DIM, cp_input_bytes, machine_memory_bytes, mpi_prefill_run, mpi_run

    if args.model is None and args.layout != "contiguous":
        parser.error(f"--layout={args.layout}: only with --model (it is the global-attention layers' layout)")
    if args.model is None and args.dim > MAX_CP_DIM:
        parser.error(f"--dim={args.dim}: expected at most {MAX_CP_DIM} (Kimi's heads are 128; each chunk's work "
                     "grows with dim squared)")
    need = cp_input_bytes(args.tokens, args.heads, args.dim, args.dtype, args.model)
    if need > machine_memory_bytes() // 2:
        states = args.model is None and cp_input_bytes(0, args.heads, args.dim, args.dtype) > need // 2
        arg = f"--heads={args.heads} x --dim={args.dim}" if states else f"--tokens={args.tokens}"
        parser.error(f"{arg}: the inputs, outputs and states alone need {need / 2**30:.1f} GiB on each "
                     f"rank; this machine has {machine_memory_bytes() / 2**30:.1f} GiB")
    try:
        if args.model is not None:
            out = mpi_prefill_run(args.tokens, args.model, seed=args.seed, timeout=args.timeout, layout=args.layout)
        else:
            out = mpi_run(args.tokens, args.heads, args.dim, args.dtype, seed=args.seed, scheme=args.scheme,
                          method=args.method, inputs=args.inputs, affine_cost=None if args.even else args.affine_cost,
                          timeout=args.timeout, repeats=args.repeats)
    except ValueError as exc:  # raised on every rank before anything waits
        parser.error(str(exc))
    except TimeoutError as exc:  # a peer never answered: say so, then end every rank of the job
        from kimilab.cp.comm import MPIComm

        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        MPIComm.abort(2)
    if out is not None:
        print(json.dumps(out))
    return 0


def _traces(args, parser) -> int:
    from kimilab.sim.command import no_requests
    from kimilab.traffic import format_stats, load_trace, regenerate, trace_stats

    if args.traces_command == "convert-claude-code":
        from kimilab.traffic.claude_code import convert, write_sessions

        try:
            rows = convert(args.source)
        except (ValueError, OSError, KeyError) as err:
            parser.error(f"{args.source}: {err}")
        path = write_sessions(rows, args.out)
        print(f"wrote {path} ({len(rows)} requests, {len({r.session for r in rows})} sessions, "
              f"{path.stat().st_size} bytes)")
        return 0
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
        if not records:
            parser.error(no_requests(path))
        print(format_stats(path, trace_stats(records, args.block_size)))
    return 0


def _memory(args, parser) -> int:
    from kimilab import costs
    from kimilab.config import preset

    for line in costs.summary(preset(args.model), preset(args.baseline), costs.deployment(args.deployment)):
        print(line)
    return 0


def _html(args, parser) -> int:
    from kimilab import site

    return site.main()


def _classroom(args, parser) -> int:
    from kimilab import classroom

    return classroom.grade_main(args.submissions, args.out, args.timeout, args.jobs, args.limit) if args.command == "grade" \
        else classroom.main()


def _experiment(args, parser) -> int:
    from kimilab.experiment import results

    if args.spec_k is not None and args.part in ("b", "all"):  # refuse before minutes of other variants' runs
        from kimilab.costs import deployment
        from kimilab.experiment.variants import VARIANT_NAMES, variant

        names = results.part_b_arguments(args.scale).get("variants")
        dp = sorted({variant(n).deployment for n in (names or VARIANT_NAMES)
                     if deployment(variant(n).deployment).attention == "dp"})
        if dp:
            parser.error(f"--spec-k: speculation is not modelled under DP-attention ({', '.join(dp)}); --scale "
                         f"{args.scale} runs variants on it (use --scale book)")
    return results.run(args)


def _book(args, parser) -> int:
    from kimilab import book

    return book.main((["--only", *args.only] if args.only else []) + (["--no-html"] if args.no_html else [])
                     + (["--jobs", str(args.jobs)] if args.jobs else []))


# What the boundary turns into one line and exit 2: bad values and sizes, bad or unreadable paths,
# input too deep or too large to parse or hold. KIMILAB_DEBUG=1 re-raises them with a traceback.
INPUT_ERRORS = (ValueError, OSError, RecursionError, OverflowError, MemoryError)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command inside the one error boundary (:data:`INPUT_ERRORS`)."""
    import os

    parser = _parser()
    args = parser.parse_args(argv)
    sub = args.parser
    try:
        return args.func(args, sub)
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except INPUT_ERRORS as err:
        if os.environ.get("KIMILAB_DEBUG"):
            raise
        text = " ".join(str(err).split()) or type(err).__name__
        if isinstance(err, RecursionError):
            text = f"input nested too deeply to read ({text})"
        elif isinstance(err, MemoryError):
            text = "not enough memory for this input or these sizes"
        sub.exit(2, f"{sub.prog}: error: {text}\n")


if __name__ == "__main__":
    sys.exit(main())
