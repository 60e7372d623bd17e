"""Many independent trace replays, spread over processes: a budget x policy sweep.

Each replay of a trace through a prefix cache is independent of the others, so a
sweep is embarrassingly parallel. :func:`replay_many` runs a dict of
:class:`Replay` jobs on a process pool (each worker reads the trace once) and
returns their :class:`~kimilab.sim.result.SimResult`\\ s under the same keys. The
numbers do not depend on which process ran a job or in what order; only
``wall_seconds`` does. ``workers=1`` runs everything here, in order.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kimilab.config import preset
from kimilab.costs import Deployment, kv_bytes_per_token
from kimilab.prefix import RunPrefixCache, make_policy
from kimilab.sim.loop import simulate
from kimilab.sim.result import SimResult
from kimilab.traffic import coarser_blocks, load_trace
from kimilab.validate import check_float, check_int

__all__ = ["Replay", "replay", "replay_many"]


@dataclass(frozen=True)
class Replay:
    """One replay: a Mooncake-format trace, a policy, and a memory size in GB per device of
    ``deployment`` (what the cache may hold on each device; its pages are per-device KV blocks).

    ``block_size`` is the cache's block; when it is larger than the trace's own
    (``trace_block``, Mooncake's 512), the trace is re-keyed with
    :func:`~kimilab.traffic.coarser_blocks` (a serving engine with larger blocks).
    """

    trace: str
    policy: str
    gb: float
    deployment: Deployment
    options: tuple = field(default=())  # policy keyword arguments as (name, value) pairs
    block_size: int = 512
    trace_block: int = 512
    model: str = "kimi_linear_48b"

    def capacity_tokens(self) -> int:
        return int(self.gb * 1e9 // kv_bytes_per_token(preset(self.model), self.deployment))


_TRACES: dict = {}  # (path, trace block, cache block) -> records, per process


def _records(job: Replay) -> list:
    key = (str(Path(job.trace).resolve()), job.trace_block, job.block_size)
    records = _TRACES.get(key)
    if records is None:
        records = load_trace(job.trace, job.trace_block)
        if job.block_size != job.trace_block:
            records = coarser_blocks(records, job.trace_block, job.block_size)
        records = _TRACES[key] = records
    return records


def replay(job: Replay) -> SimResult:
    """Run one :class:`Replay` through :class:`~kimilab.prefix.RunPrefixCache` (here, in this process)."""
    check_float("gb", job.gb, minimum=0.0)
    check_int("block_size", job.block_size, 1)
    cache = RunPrefixCache(preset(job.model), make_policy(job.policy, **dict(job.options)),
                           deployment=job.deployment, block_size=job.block_size,
                           capacity_tokens=job.capacity_tokens())
    return simulate(_records(job), cache=cache, label=job.policy)


def replay_many(jobs: dict, *, workers: int | None = None) -> dict:
    """``{key: Replay}`` -> ``{key: SimResult}``, on ``workers`` processes (default: up to 2, one per core)."""
    for key, job in jobs.items():
        if not isinstance(job, Replay):
            raise ValueError(f"jobs[{key!r}]: expected a kimilab.sim.Replay, got {type(job).__name__}")
    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    workers = check_int("workers", workers, 1)
    keys = list(jobs)
    if workers == 1 or len(keys) < 2:
        return {key: replay(jobs[key]) for key in keys}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = pool.map(replay, [jobs[key] for key in keys], chunksize=1)
        return dict(zip(keys, results))
