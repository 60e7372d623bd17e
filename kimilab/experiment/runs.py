"""Fleet runs described in JSON, so a chapter's sweep can be stored and recomputed by name (:mod:`kimilab.stored`).

A run is a dict of :func:`kimilab.fleet.run_fleet`'s arguments with names in place of objects:
``deployment`` (a name), ``kernels`` (an index into :func:`kimilab.costs.members`; absent: the
central set), ``model`` (default ``"kimi_linear_48b"``; its pool on the deployment is the
capacity), ``instances``, ``router``, and optionally ``rate_scale``, ``policy``, ``isolation``,
``store_ratio`` (a store the instances share, :class:`kimilab.fleet.Fleet`'s ``store_bytes``, of
that many times all their HBM pools together: 2 is each instance adding twice its pool in DRAM) and
``store_bandwidth`` (its link's bytes per second a device, in place of the RDMA line rate).
Its ``requests`` say where the traffic comes from:

- ``{"trace": FILE, "start": i, "n": n}``: ``n`` requests of a shipped Mooncake trace from
  request ``i`` (``"no_reuse": true`` gives every block a fresh id: no prefix can hit);
- ``{"zipf": {...}}``: :func:`kimilab.traffic.zipf_prefixes` with these keyword arguments;
- ``{"trace": ..., "start": ..., "n": ..., "flood": per_s}``: that chat window beside a
  neighbour's 24,576-token documents at ``per_s`` a second (two tenants, ``chat`` and ``flood``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kimilab import costs
from kimilab.config import preset

__all__ = ["fleet_summaries", "requests_of", "with_flood", "prefill_ends"]

DATA = Path(__file__).resolve().parent.parent.parent / "data"
FLOOD_BLOCKS = 48  # a neighbour's document: 48 blocks of 512 tokens


@lru_cache(maxsize=4)
def _trace(name: str) -> tuple:
    from kimilab.traffic import load_trace

    return tuple(load_trace(DATA / name, 512))


def with_flood(chat: list, per_s: float) -> list:
    """``chat`` beside a neighbour sending 24,576-token documents (64 output tokens) evenly at ``per_s``."""
    from kimilab.fleet.tenants import merge_tenants
    from kimilab.traffic import Request

    t0, span = chat[0].arrival_ms, chat[-1].arrival_ms - chat[0].arrival_ms
    n, b = max(1, int(per_s * span / 1000)), FLOOD_BLOCKS
    docs = [Request(i, int(t0 + i * span / n), b * 512, 64, hash_ids=tuple(range(10**9 + b * i, 10**9 + b * i + b)))
            for i in range(n)]
    return merge_tenants([("chat", chat), ("flood", docs)])


def requests_of(spec: dict) -> list:
    """The request list a run's ``requests`` describes."""
    if "zipf" in spec:
        from kimilab.traffic import zipf_prefixes

        return zipf_prefixes(**spec["zipf"])
    trace = _trace(spec["trace"])
    if not 0 <= spec["start"] and spec["start"] + spec["n"] <= len(trace):
        raise ValueError(f"requests={spec!r}: expected a window inside the trace's {len(trace):,} requests")
    window = list(trace[spec["start"]:spec["start"] + spec["n"]])
    if spec.get("no_reuse"):
        from kimilab.experiment.scale import no_reuse

        return no_reuse(window)
    return with_flood(window, spec["flood"]) if "flood" in spec else window


def _job(run: dict) -> dict:
    dep = costs.deployment(run["deployment"])
    if run.get("kernels") is not None:
        dep = dep.with_(kernels=costs.members()[run["kernels"]].kernels)
    drop = ("deployment", "kernels", "model", "requests", "store_ratio", "store_bandwidth")
    job = {k: v for k, v in run.items() if k not in drop}
    cfg = preset(run.get("model", "kimi_linear_48b"))
    capacity = costs.capacity_tokens(cfg, costs.deployment(run["deployment"]))
    if run.get("store_ratio") is not None:  # bytes per device: the fleet's pools' KV bytes, times the ratio
        job["store_bytes"] = run["store_ratio"] * run["instances"] * capacity * costs.kv_bytes_per_token(cfg, dep)
    if run.get("store_bandwidth") is not None:
        from dataclasses import replace

        from kimilab.prefix.offload import CLUSTER_RDMA

        bw = run["store_bandwidth"]
        job["store_link"] = replace(CLUSTER_RDMA, name=f"cluster DRAM at {bw / 1e9:g} GB/s a device", bandwidth=bw)
    return dict(job, deployment=dep, requests=requests_of(run["requests"]), capacity_tokens=capacity)


def fleet_summaries(runs: list[dict], workers: int | None = None) -> list[dict]:
    """Each run's :meth:`~kimilab.fleet.FleetResult.summary`, in order (spread over ``workers`` processes)."""
    from kimilab.fleet.sweep import run_many

    return [r.summary() for r in run_many(None, [_job(r) for r in runs], workers=workers)]


def prefill_ends(deployment: str | None = None, tokens: int = 8192) -> dict:
    """The kernel sets (indices into :func:`kimilab.costs.members`) under which a ``tokens``-token prefill of
    the hybrid is fastest and slowest on ``deployment``: a TTFT is mostly prefill, so a fleet verdict's band
    is taken at these two ends."""
    from kimilab.config import kimi_linear_48b

    dep = costs.deployment(deployment or costs.DEFAULT_DEPLOYMENT.name)
    pre = [costs.prefill_seconds(kimi_linear_48b, dep.with_(kernels=m.kernels), tokens) for m in costs.members()]
    return {"fastest": pre.index(min(pre)), "slowest": pre.index(max(pre))}
