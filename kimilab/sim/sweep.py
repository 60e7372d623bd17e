"""Many independent trace replays, spread over processes: a budget x policy sweep.

Each replay of a trace through a prefix cache is independent of the others, so a
sweep is embarrassingly parallel. :func:`replay_many` runs a dict of
:class:`Replay` jobs on a process pool (each worker reads a trace once) and
returns their :class:`~kimilab.sim.result.SimResult`\\ s under the same keys. The
numbers do not depend on which process ran a job or in what order; only
``wall_seconds`` does. ``workers=1`` runs everything here, in order.

A job names its cache by policy (:data:`CACHES` lists them): the checkpoint policies of
:mod:`kimilab.prefix.policies` run in :class:`~kimilab.prefix.RunPrefixCache`; the designs
that ship run as their engines store them -- ``vllm-align`` at vLLM's own block for the
deployment, Marconi, SGLang's two strategies on its split pools -- and ``oracle`` reads the
trace's future. :func:`build_cache` builds any of them and :func:`load_records` reads a trace of
either kind, for a :class:`Replay` and for ``python -m kimilab prefix`` alike.
"""

from __future__ import annotations

import gzip
import inspect
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from kimilab.config import preset
from kimilab.costs import Deployment, kv_bytes_per_token, vllm_hybrid_pages
from kimilab.parallel import default_workers, pool_map
from kimilab.pool import RequestAllocator
from kimilab.prefix import POLICIES, RunPrefixCache, make_policy
from kimilab.prefix.blocks import split_prompt
from kimilab.prefix.marconi import MarconiScorer, marconi_cache
from kimilab.prefix.oracle import oracle_cache
from kimilab.prefix.policies import ChunkEnds
from kimilab.prefix.segments import LRUScorer, SegmentCache
from kimilab.sim.loop import simulate
from kimilab.sim.rekey import rekey
from kimilab.sim.result import SimResult
from kimilab.traffic import agent_requests, check_chain, load_sessions, load_trace
from kimilab.validate import check_choice, check_float, check_int

__all__ = ["SGLANG_RATIO", "CACHES", "SESSIONS_PER_S", "Replay", "replay", "replay_many", "vllm_align_interval",
           "simulate_many", "cache_block", "cache_options", "build_cache", "load_records", "is_sessions"]

SGLANG_RATIO = 0.9  # SGLang's --mamba-full-memory-ratio default: states get r / (1 + r) of the memory
CACHES = tuple(POLICIES) + ("vllm-align", "marconi", "oracle", "sglang-no-buffer", "sglang-extra-buffer")
SESSIONS_PER_S = 0.05  # Poisson session starts per second the agent sessions are replayed at (chapter 6)
SESSION_BLOCK = 512  # tokens per id of the converted Claude Code sessions (kimilab.traffic.claude_code)


def vllm_align_interval(deployment: Deployment, block: int) -> int:
    """Tokens between vLLM ``align``'s states in a long prefill: ``max_num_batched_tokens`` rounded
    down to whole blocks (the scheduler splits chunks on the block grid)."""
    return max(block, deployment.max_batched_tokens // block * block)


@dataclass(frozen=True)
class Replay:
    """One replay: a trace, a cache (``policy``, one of :data:`CACHES`), and a memory size in GB per
    device of ``deployment`` (what the cache may hold on each device).

    ``trace`` is a Mooncake-format jsonl, or the converted Claude Code sessions
    (``*.jsonl.gz``) put on one timeline by :func:`~kimilab.traffic.agent_requests` with
    Poisson session starts at ``sessions_per_s`` (``seed``). ``block_size`` is the cache's
    block; when it differs from the trace's own (``trace_block`` for a Mooncake trace, 512 for
    the sessions) the trace is re-keyed (:func:`load_records`). ``vllm-align`` always uses vLLM's
    block for the deployment. ``precision`` is the checkpoints' (:mod:`kimilab.prefix.precision`).
    The cache is :func:`build_cache`'s, as ``python -m kimilab prefix`` builds it.
    """

    trace: str
    policy: str
    gb: float
    deployment: Deployment
    options: tuple = field(default=())  # policy keyword arguments as (name, value) pairs
    block_size: int = 512
    trace_block: int = 512
    model: str = "kimi_linear_48b"
    precision: str = "native"
    sessions_per_s: float = SESSIONS_PER_S
    seed: int = 0

    def capacity_tokens(self) -> int:
        return int(self.gb * 1e9 // kv_bytes_per_token(preset(self.model), self.deployment))

    def cache_block(self) -> int:
        return cache_block(self.policy, preset(self.model), self.deployment, self.block_size)


def cache_block(name: str, config, deployment: Deployment, block_size: int) -> int:
    """Tokens per block of cache ``name``: ``block_size``, except ``vllm-align``'s, which is vLLM's own
    for the model on ``deployment`` (:func:`~kimilab.costs.vllm_hybrid_pages`)."""
    if name == "vllm-align":
        return vllm_hybrid_pages(config, deployment).block_tokens
    return block_size


def cache_options(name: str) -> tuple:
    """The options (keyword arguments, as :class:`Replay`'s ``options``) cache ``name`` takes."""
    check_choice("policy", name, CACHES)
    if name in POLICIES:
        return tuple(inspect.signature(POLICIES[name]).parameters)
    if name == "marconi":
        return tuple(inspect.signature(MarconiScorer).parameters)
    return {"vllm-align": ("kv_boundary",), "oracle": ()}.get(name, ("interval", "ratio"))  # SGLang's


def is_sessions(path) -> bool:
    """Whether :func:`load_records` reads ``path`` as converted Claude Code sessions (a name ending in
    ``.jsonl.gz``) rather than as a Mooncake-format trace."""
    return str(path).endswith(".jsonl.gz")


def load_records(path, block_size: int = 512, *, trace_block: int = 512, sessions_per_s: float = SESSIONS_PER_S,
                 seed: int = 0) -> list:
    """A trace of either kind, keyed per ``block_size`` tokens (:func:`~kimilab.sim.rekey.rekey` when its own
    block differs). A Mooncake-format jsonl has an id per ``trace_block`` tokens; converted Claude Code sessions
    (``*.jsonl.gz``, an id per 512 tokens) are put on one timeline by :func:`~kimilab.traffic.agent_requests`
    with Poisson session starts at ``sessions_per_s`` (``seed``). Both have chained ids. A file that cannot be
    read as its kind is a ValueError that starts with ``path``; a missing one, an OSError."""
    path = str(path)
    try:
        if is_sessions(path):
            rows = load_sessions(path)  # its errors name the path
            _check_ids(rows)
            check_chain(rows)
            records, trace_block = agent_requests(rows, sessions_per_s, seed=seed), SESSION_BLOCK
        else:
            with open(path, "rb") as f:
                if f.read(2) == b"\x1f\x8b":
                    raise ValueError("a gzip file; expected a plain-text Mooncake jsonl trace (converted Claude "
                                     "Code sessions are read from a name ending in .jsonl.gz)")
            records = load_trace(path, trace_block)
    except OverflowError as err:  # e.g. 1e999 where an int belongs
        raise ValueError(f"{path}: a number out of range ({err}); expected ints") from None
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as err:  # not what its name says
        kind = "gzip-compressed Claude Code sessions" if is_sessions(path) else "UTF-8 text"
        raise ValueError(f"{path}: not readable as {kind} ({' '.join(str(err).split()) or type(err).__name__})") \
            from None
    except ValueError as err:
        raise ValueError(str(err) if str(err).startswith(path) else f"{path}: {err}") from None
    if block_size != trace_block:
        records = rekey(records, trace_block, block_size)
    return records


def _check_ids(rows) -> None:
    """Each session line's ids are ints >= 0, as a Mooncake trace line's are (:func:`~kimilab.traffic.parse_line`)."""
    for lineno, row in enumerate(rows, start=1):
        if not all(type(h) is int and h >= 0 for h in row.hash_ids):
            j, h = next((j, h) for j, h in enumerate(row.hash_ids) if type(h) is not int or h < 0)
            raise ValueError(f"line {lineno}: field 'hash_ids'[{j}]={h!r}: expected a non-negative int")


def build_cache(name: str, records: list, config, deployment: Deployment, *, block_size: int,
                capacity_tokens: int | None, options=(), precision: str = "native"):
    """The cache ``name`` (one of :data:`CACHES`), empty, for replaying ``records`` (only ``oracle`` reads
    them: their future). ``block_size`` is the block asked for (``vllm-align``: vLLM's own instead, see
    :func:`cache_block`); ``capacity_tokens`` its memory per device in tokens of KV (None: no limit);
    ``options`` keyword arguments as ``(name, value)`` pairs or a dict (:func:`cache_options`);
    ``precision`` the checkpoints' (:mod:`kimilab.prefix.precision`)."""
    check_choice("policy", name, CACHES)
    options = dict(options)
    unknown = sorted(set(options) - set(cache_options(name)))
    if unknown:
        raise ValueError(f"options: {name} takes {list(cache_options(name))}, not {unknown}")
    dep = deployment
    common = dict(deployment=dep, block_size=cache_block(name, config, dep, block_size), capacity_tokens=capacity_tokens)
    if name in POLICIES:
        return RunPrefixCache(config, make_policy(name, **options), precision=precision, **common)
    if name == "vllm-align":
        policy = ChunkEnds(vllm_align_interval(dep, common["block_size"]), kv_boundary=options.get("kv_boundary", True))
        cache = RunPrefixCache(config, policy, precision=precision, **common)
        cache.policy_name = name
        return cache
    if name == "marconi":
        return marconi_cache(config, precision=precision, **common, **options)
    if name == "oracle":
        order = sorted(range(len(records)), key=lambda i: (records[i].arrival_ms, i))
        prompts = [split_prompt(records[i].hash_ids, records[i].input_length, None, common["block_size"], False)[0]
                   for i in order]
        return oracle_cache(config, prompts, precision=precision, **common)
    # SGLang: its scheduler strategies on a KV pool and a state pool split at r : 1
    ratio = options.pop("ratio", SGLANG_RATIO)
    policy = ChunkEnds(options.pop("interval", dep.max_batched_tokens), kv_boundary=name == "sglang-extra-buffer")
    cache = SegmentCache(config, policy, LRUScorer(), state_share=ratio / (1 + ratio), precision=precision, **common)
    cache.policy_name = name
    return cache


_TRACES: dict = {}  # (path, rate, seed, trace block, cache block) -> records, per process


def _records(job: Replay) -> list:
    block = job.cache_block()
    agent = is_sessions(job.trace)
    key = (str(Path(job.trace).resolve()), job.sessions_per_s if agent else None, job.seed if agent else None,
           job.trace_block, block)
    records = _TRACES.get(key)
    if records is None:
        records = _TRACES[key] = load_records(job.trace, block, trace_block=job.trace_block,
                                              sessions_per_s=job.sessions_per_s, seed=job.seed)
    return records


def _cache(job: Replay, records: list):
    return build_cache(job.policy, records, preset(job.model), job.deployment, block_size=job.block_size,
                       capacity_tokens=job.capacity_tokens(), options=job.options, precision=job.precision)


def replay(job: Replay) -> SimResult:
    """Run one :class:`Replay` (here, in this process)."""
    check_float("gb", job.gb, minimum=0.0)
    check_int("block_size", job.block_size, 1)
    check_choice("policy", job.policy, CACHES)
    records = _records(job)
    return simulate(records, cache=_cache(job, records), label=job.policy)


def replay_many(jobs: dict, *, workers: int | None = None) -> dict:
    """``{key: Replay}`` -> ``{key: SimResult}``, on ``workers`` processes (default: up to 2, one per core)."""
    for key, job in jobs.items():
        if not isinstance(job, Replay):
            raise ValueError(f"jobs[{key!r}]: expected a kimilab.sim.Replay, got {type(job).__name__}")
    workers = check_int("workers", default_workers(len(jobs)) if workers is None else workers, 1)
    # the slowest first, so the last job to start is a short one
    order = sorted(jobs, key=lambda k: -_weight(jobs[k]))
    results = dict(zip(order, pool_map(replay, [jobs[key] for key in order], workers)))
    return {key: results[key] for key in jobs}


DATA = Path(__file__).resolve().parent.parent.parent / "data"


def replay_spec(job: Replay) -> dict:
    """``job`` in JSON: its fields, the deployment by name and a shipped trace by its file name."""
    spec = {f: getattr(job, f) for f in job.__dataclass_fields__}
    spec["deployment"] = job.deployment.name
    spec["options"] = [list(o) for o in job.options]
    if Path(job.trace).resolve().parent == DATA:
        spec["trace"] = Path(job.trace).name
    return spec


def replay_records(jobs: list[dict], workers: int | None = None) -> list[dict]:
    """Replays described by :func:`replay_spec` -> each result's numbers (:meth:`SimResult.record`), so a
    chapter's sweep can be stored (:mod:`kimilab.stored`) and read back with :meth:`SimResult.from_record`."""
    from kimilab.costs import deployment

    built = {}
    for i, spec in enumerate(jobs):
        trace = spec["trace"] if Path(spec["trace"]).is_absolute() else str(DATA / spec["trace"])
        built[i] = Replay(**dict(spec, trace=trace, deployment=deployment(spec["deployment"]),
                                 options=tuple(tuple(o) for o in spec.get("options", ()))))
    results = replay_many(built, workers=workers)
    return [results[i].record() for i in range(len(jobs))]


def _serve(job) -> SimResult:
    requests, layout, shapes, budget, prefill = job
    return simulate(requests, memory=RequestAllocator(layout, shapes, int(budget)), prefill_tokens_per_step=prefill,
                    label=layout.key)


def simulate_many(jobs: dict, *, workers: int | None = None) -> dict:
    """Many independent memory-budget runs (chapter 4's layouts) spread over processes, as :func:`replay_many`:
    ``{key: (requests, layout, shapes, budget_bytes, prefill_tokens_per_step)}`` -> ``{key: SimResult}``."""
    for key, job in jobs.items():
        if not (isinstance(job, tuple) and len(job) == 5):
            raise ValueError(f"jobs[{key!r}]: expected (requests, layout, shapes, budget_bytes, prefill_tokens_per_step)")
    workers = check_int("workers", default_workers(len(jobs)) if workers is None else workers, 1)
    return dict(zip(jobs, pool_map(_serve, list(jobs.values()), workers)))


def _weight(job: Replay) -> float:
    """A rough cost, for ordering: Marconi's tuning replays its window 21 times."""
    return (20.0 if job.policy == "marconi" else 1.0) * (1.0 + job.gb / 40.0)
