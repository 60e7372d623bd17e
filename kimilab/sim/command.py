"""The ``prefix`` command: replay a trace through any cache chapter 6 compares; print one JSON object.

``python -m kimilab prefix TRACE --policy NAME --capacity-tokens N`` runs the cache ``NAME`` (one of
:data:`~kimilab.sim.sweep.CACHES`: the checkpoint policies and the designs that ship, and the
clairvoyant ``oracle``) on a Mooncake-format trace or on converted Claude Code sessions
(``*.jsonl.gz``). The trace and the cache come from :func:`~kimilab.sim.sweep.load_records` and
:func:`~kimilab.sim.sweep.build_cache`, the two functions a :class:`~kimilab.sim.sweep.Replay` uses, so
the command prints the numbers ``replay`` gives for the same trace, cache and memory. A bad argument
is ``parser.error``: one line naming it, exit status 2.
"""

from __future__ import annotations

import json
import math
import sys

__all__ = ["run", "no_requests"]


def no_requests(path: str) -> str:
    """The one message every command gives for a trace without a request."""
    return f"{path}: holds no requests; expected one JSON object per line"


def _takers(option: str) -> list[str]:
    """The caches that take ``option`` (:func:`~kimilab.sim.sweep.cache_options`)."""
    from kimilab.sim.sweep import CACHES, cache_options

    return [name for name in CACHES if option in cache_options(name)]


def _records(args, parser, block: int) -> list:
    """The trace keyed per ``block`` tokens; a bad or empty trace is ``parser.error``."""
    from kimilab.sim.sweep import SESSIONS_PER_S, load_records

    try:
        records = load_records(args.trace, block, trace_block=args.block_size,
                               sessions_per_s=SESSIONS_PER_S if args.sessions_per_s is None else args.sessions_per_s,
                               seed=0 if args.seed is None else args.seed)
    except ValueError as err:  # names the trace
        parser.error(str(err))
    except OSError as err:
        parser.error(f"{args.trace}: {err}")
    if not records:
        parser.error(no_requests(args.trace))
    return records


def _auto(args, parser) -> tuple[str, dict]:
    """``--policy auto``: the trace's sharing statistics, and the policy chapter 6's map picks for them."""
    from kimilab.sim.policy_map import choose_policy, shipped_map
    from kimilab.traffic.sharing import sharing_stats

    stats = sharing_stats(_records(args, parser, args.block_size), args.block_size)
    capacity = math.inf if args.capacity_tokens is None else args.capacity_tokens
    policy, why = choose_policy(stats, capacity, shipped_map())
    print(f"auto: {policy}: {why}", file=sys.stderr)
    return policy, {"chose": policy, "why": why, "stats": stats}


def run(args, parser) -> int:
    """Check the arguments, replay the trace through the cache ``args.policy``, print one JSON object:
    :meth:`~kimilab.sim.result.SimResult.as_dict` (``policy`` the cache's name) and ``policy_detail``."""
    from kimilab.config import preset
    from kimilab.costs import deployment
    from kimilab.prefix import HybridPrefixCache, make_policy
    from kimilab.prefix.policies import POLICIES
    from kimilab.sim.loop import simulate
    from kimilab.sim.sweep import build_cache, cache_block, is_sessions

    name, sessions = args.policy, is_sessions(args.trace)
    if name == "auto" and args.partial_blocks:
        parser.error("--partial-blocks: --policy auto picks among whole-block caches; name a checkpoint policy")
    for flag, option, given in (("--interval", "interval", args.interval), ("--alpha", "alpha", args.alpha)):
        if given is not None and name not in _takers(option):
            parser.error(f"{flag}: only {', '.join(_takers(option))} take an {option}, not {name}")
    for flag, given in (("--sessions-per-s", args.sessions_per_s), ("--seed", args.seed)):
        if given is not None and not sessions:
            parser.error(f"{flag}: only for converted Claude Code sessions (a TRACE ending in .jsonl.gz); "
                         f"{args.trace} is read as a Mooncake-format trace")
    if args.sessions_per_s is not None and not math.isfinite(1e9 / args.sessions_per_s):
        parser.error(f"--sessions-per-s={args.sessions_per_s}: too small a rate (the session start times in ms "
                     "would overflow)")
    if args.partial_blocks and name not in POLICIES:
        parser.error(f"--partial-blocks: {name} caches whole blocks only, as its engine does; expected one of the "
                     f"checkpoint policies ({', '.join(POLICIES)}), which run on the block tree that caches them")
    config, dep = preset(args.model), deployment(args.deployment)
    reason = None
    if name == "auto":
        name, reason = _auto(args, parser)
    block = cache_block(name, config, dep, args.block_size)
    if args.capacity_tokens is not None and args.capacity_tokens < block:
        which = f"vLLM's {block}-token block on {dep.name}" if name == "vllm-align" else f"--block-size={block}"
        parser.error(f"--capacity-tokens={args.capacity_tokens}: expected at least one block ({which})")
    options = {k: v for k, v in (("interval", args.interval), ("alpha", args.alpha)) if v is not None}
    records = _records(args, parser, block)
    tokens = any(r.tokens is not None for r in records)
    if tokens and name not in POLICIES:
        parser.error(f"{args.trace}: its requests carry tokens, which only the block tree caches; expected one of "
                     f"the checkpoint policies ({', '.join(POLICIES)})")
    host = getattr(args, "host_gb", None)
    if host is not None and (name not in POLICIES or args.partial_blocks or tokens):
        parser.error(f"--host-gb: the host tier runs under the block tree of the checkpoint policies, whole blocks "
                     f"keyed by hash ids; expected one of {', '.join(POLICIES)} without --partial-blocks"
                     + (f" ({args.trace} carries tokens)" if tokens else ""))
    try:
        if host is not None:
            from kimilab.prefix.host import TieredPrefixCache

            cache = TieredPrefixCache.for_budget(config, make_policy(name, **options), deployment=dep,
                                                 block_size=block, capacity_tokens=args.capacity_tokens,
                                                 host_bytes=host * 1e9)
        elif args.partial_blocks or tokens:
            cache = HybridPrefixCache.for_budget(config, make_policy(name, **options), deployment=dep,
                                                 block_size=block, capacity_tokens=args.capacity_tokens,
                                                 partial_blocks=args.partial_blocks)
        else:  # whole blocks keyed by hash ids: for the checkpoint policies the run-length twin, faster
            cache = build_cache(name, records, config, dep, block_size=args.block_size,
                                capacity_tokens=args.capacity_tokens, options=options)
    except ValueError as err:
        parser.error(str(err))
    try:
        result = simulate(records, cache=cache, label=name)
    except ValueError as err:  # e.g. a partial block's id seen with two lengths: the trace contradicts itself
        parser.error(f"{args.trace}: {err}; expected each block id to stand for the same tokens throughout")
    out = result.as_dict()
    out["policy"] = name  # the cache that ran, by the name it was asked for (oracle's own label: oracle/oracle)
    out["policy_detail"] = result.policy_detail
    if reason is not None:
        out["auto"] = reason
    if host is not None:
        out["host_tier"] = cache.host_summary()
    print(json.dumps(out))
    return 0
