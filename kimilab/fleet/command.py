"""``python -m kimilab fleet``: serve traces on a fleet of simulated engines, print one JSON object.

Its options (:func:`add_arguments`) and what it runs (:func:`run`): each trace file is a tenant,
and the fleet's router, isolation, failures, the memory below each cache (a host tier of its
own, or a store the instances share), disaggregation (``--prefill``) and speculation (``--spec-k``) are the options of
:func:`kimilab.fleet.open_fleet`.
"""

from __future__ import annotations

import argparse
import json

from kimilab.validate import (ALPHA_HELP, DRAFTER_HELP, HOST_GB_HELP, SPEC_HELP, gb_or_inf_arg, positive_float_arg,
                              positive_int_arg, probability_arg, tokens_or_inf_arg)

__all__ = ["add_arguments", "add_spec_arguments", "spec_fields", "failure_arg", "run"]


def add_arguments(parser) -> None:
    """The fleet command's options (the deployment's is added by the caller)."""
    from kimilab.config import PRESETS
    from kimilab.fleet.routers import ROUTERS

    parser.add_argument("traces", nargs="+", metavar="TRACE.jsonl", help="Mooncake jsonl traces, one tenant each")
    parser.add_argument("--instances", type=positive_int_arg, required=True, help="engine instances")
    parser.add_argument("--router", required=True, choices=sorted(ROUTERS), help="how arrivals pick an instance")
    parser.add_argument("--isolation", default="none", choices=["none", "quota"],
                        help="quota: per-tenant reserved cache share and fair (virtual token counter) admission")
    parser.add_argument("--capacity-tokens", type=tokens_or_inf_arg, required=True, metavar="N|inf",
                        help="each instance's pool in tokens of KV (running requests + prefix cache); 'inf' for no "
                             "limit")
    parser.add_argument("--model", default="kimi_linear_48b", choices=sorted(PRESETS),
                        help="config preset served (a preset without KDA layers caches KV only)")
    parser.add_argument("--rate-scale", type=positive_float_arg, default=1.0, help="divide arrival times by X")
    parser.add_argument("--fail", action="append", default=[], type=failure_arg, metavar="INSTANCE@SECONDS",
                        help="instance INSTANCE fails at SECONDS of simulated time (repeatable)")
    tiers = parser.add_mutually_exclusive_group()  # one tier under each cache: the instance's own, or shared
    tiers.add_argument("--host-gb", type=gb_or_inf_arg, default=None, metavar="GB|inf",
                       help=HOST_GB_HELP + "; each step waits for the loads admitted before it")
    tiers.add_argument("--store-gb", type=gb_or_inf_arg, default=None, metavar="GB|inf",
                       help="instead, GB per device of one store the instances share (as Mooncake Store pools the "
                            "cluster's DRAM): every block and state is written through to it as it is computed, "
                            "and a hit there is loaded over RDMA when that beats recomputing (kimilab.prefix.host)")
    parser.add_argument("--overlap-loads", action="store_true",
                        help="with --host-gb or --store-gb: load layer by layer under the step's compute, as "
                             "SGLang's HiCache does, instead of before it")
    parser.add_argument("--prefill", type=positive_int_arg, default=None, metavar="N",
                        help="disaggregate: N of the --instances only prefill (behind --router) and hand each "
                             "request's KV and states over a 400 Gb/s NIC a GPU to the rest, which only decode "
                             "(kimilab.fleet.disagg)")
    add_spec_arguments(parser)


def add_spec_arguments(parser) -> None:
    """``--spec-k``, ``--spec-alpha``, ``--drafter`` (the fleet and experiment commands)."""
    parser.add_argument("--spec-k", type=positive_int_arg, default=None, metavar="K", help=SPEC_HELP)
    parser.add_argument("--spec-alpha", type=probability_arg, default=0.7, metavar="A", help=ALPHA_HELP)
    parser.add_argument("--drafter", default="mtp", choices=["mtp", "ngram"], help=DRAFTER_HELP)


def spec_fields(args, parser) -> dict | None:
    """The fields of the :class:`~kimilab.engine.Speculation` the flags ask for (None: no --spec-k)."""
    if args.spec_k is None:
        for flag, given in (("--spec-alpha", args.spec_alpha != 0.7), ("--drafter", args.drafter != "mtp")):
            if given:
                parser.error(f"{flag}: expected --spec-k with it (speculation is off without a draft length)")
        return None
    return {"k": args.spec_k, "alpha": args.spec_alpha, "drafter": args.drafter}


def failure_arg(text: str) -> tuple[int, float]:
    """argparse type: ``INSTANCE@SECONDS``, an instance that fails at that simulated time."""
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


def run(args, parser) -> int:
    """Serve the traces and print the summary; a bad argument or an empty result is a one-line error."""
    from kimilab.config import preset
    from kimilab.costs import deployment
    from kimilab.fleet import run_fleet
    from kimilab.fleet.tenants import load_tenants
    from kimilab.sim.command import no_requests

    for i, _ in args.fail:
        if i >= args.instances:
            parser.error(f"--fail {i}@...: expected an instance below --instances={args.instances}")
    if args.capacity_tokens is not None and args.capacity_tokens < 512:
        parser.error(f"--capacity-tokens={args.capacity_tokens}: expected at least one 512-token block")
    tier = {} if args.host_gb is None else {"host_bytes": args.host_gb * 1e9}
    if args.store_gb is not None:
        tier = {"store_bytes": args.store_gb * 1e9}
    if tier and args.isolation == "quota":
        parser.error(f"--{next(iter(tier)).split('_')[0]}-gb: a tier sits under each instance's one shared cache; "
                     "expected --isolation none with it")
    if args.overlap_loads:
        if not tier:
            parser.error("--overlap-loads: expected --host-gb or --store-gb (there is nothing to load without one)")
        tier["overlap_loads"] = True
    if args.prefill is not None:
        if args.prefill >= args.instances:
            parser.error(f"--prefill={args.prefill}: expected fewer than --instances={args.instances} (the rest decode)")
        for flag, given in (("--fail", args.fail), ("--host-gb", args.host_gb is not None),
                            ("--store-gb", args.store_gb is not None), ("--isolation quota", args.isolation == "quota")):
            if given:
                parser.error(f"--prefill: {flag} is not modelled with disaggregation; expected one or the other")
        tier["prefill"] = args.prefill
    fields = spec_fields(args, parser)
    if fields is not None:
        from kimilab.engine import Speculation

        tier["speculation"] = Speculation(**fields)
    try:
        requests = load_tenants(args.traces)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    if not requests:
        parser.error(no_requests(", ".join(args.traces)))
    try:
        result = run_fleet(requests, preset(args.model), deployment=deployment(args.deployment),
                           instances=args.instances, router=args.router,
                           capacity_tokens=args.capacity_tokens, isolation=args.isolation,
                           rate_scale=args.rate_scale, fails=args.fail, **tier)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    print(json.dumps(result.summary()))
    if not result.finished and result.refused:
        parser.error(f"--capacity-tokens={args.capacity_tokens}: no request finished; {result.refused} were "
                     f"refused, since they do not fit an instance's pool alone (prompt, output and states)")
    if not result.finished:
        parser.error("no request finished (see the JSON object above)")
    return 0
