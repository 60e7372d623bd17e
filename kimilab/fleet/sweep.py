"""Independent fleet runs spread over processes (a sweep of routers x rates is embarrassingly parallel)."""

from __future__ import annotations

from kimilab.config import preset
from kimilab.fleet.fleet import run_fleet
from kimilab.parallel import default_workers, pool_map

__all__ = ["run_many"]


def _one(job: tuple) -> object:
    requests, model, kwargs = job
    kwargs = dict(kwargs)
    requests = kwargs.pop("requests", requests)
    result = run_fleet(requests, preset(model), **kwargs)
    result.wall_seconds = 0.0  # a wall clock inside a worker is not the sweep's
    return result


def run_many(requests, jobs: list[dict], *, model: str = "kimi_linear_48b", workers: int | None = None) -> list:
    """``run_fleet(requests, preset(model), **job)`` for each job, in order; results are deterministic.
    A job may carry its own ``requests`` (another tenant mix, say) in place of the shared ones."""
    workers = workers or default_workers(len(jobs), cap=4)
    return pool_map(_one, [(requests, model, job) for job in jobs], workers)
