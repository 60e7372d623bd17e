"""What production turns on around the HBM cache in a Part B run: memory below it, or disaggregation.

Two tiers, as ratios to what a deployment already has:

* ``host_ratio``: each instance's own host DRAM tier (:class:`kimilab.prefix.host.HostTier`), that
  many times its HBM pool's bytes (SGLang's HiCache guide uses 2); what HBM evicts waits there.
* ``store_ratio``: one store the fleet's instances share (Mooncake Store pools the cluster's DRAM
  this way), that many times all their HBM pools together, on the cluster's RDMA links; every
  instance writes each block and state through to it as it is computed.

With either, ``overlap_loads`` loads layer by layer under each step's compute (SGLang's HiCache)
instead of before it (vLLM's LMCache and Mooncake connectors by default):
:meth:`kimilab.engine.InstanceMemory.step_seconds`.

``prefill``: that many of the instances only prefill and hand each request's context to the rest,
which only decode (:class:`kimilab.fleet.DisaggregatedFleet`, as Mooncake and SGLang's PD mode run).

``speculation``: every engine verifies drafts (:class:`kimilab.engine.Speculation`, given as the
dict of its fields so that a stored result's arguments stay plain data), and the pool shrinks by
the drafter's weights and KV.
"""

from __future__ import annotations

from kimilab import costs
from kimilab.engine.speculation import Speculation
from kimilab.validate import check_float, check_int

__all__ = ["check_ratios", "tier_keywords", "tier_note", "speculation_of", "spec_note"]


def check_ratios(host_ratio: float | None, store_ratio: float | None, overlap_loads: bool = False,
                 prefill: int | None = None) -> dict:
    """The options given, checked (each ratio >= 0, at most one of them, overlap only with one; ``prefill``
    >= 1 and without a tier), as keywords."""
    if prefill is not None:
        if host_ratio is not None or store_ratio is not None:
            raise ValueError("prefill: a tier under a disaggregated fleet is not modelled; expected no host_ratio "
                             "or store_ratio with it")
        return {"prefill": check_int("prefill", prefill, 1)}
    if host_ratio is not None and store_ratio is not None:
        raise ValueError("host_ratio, store_ratio: expected one tier under the cache, an instance's own or shared")
    out = {name: check_float(name, x, minimum=0.0)
           for name, x in (("host_ratio", host_ratio), ("store_ratio", store_ratio)) if x is not None}
    if overlap_loads:
        if not out:
            raise ValueError("overlap_loads: expected host_ratio or store_ratio (without a tier nothing is loaded)")
        out["overlap_loads"] = True
    return out


def tier_keywords(cfg, dep, capacity_tokens: int, instances: int, host_ratio: float | None = None,
                  store_ratio: float | None = None, overlap_loads: bool = False, prefill: int | None = None) -> dict:
    """The fleet's keywords for these options (``host_bytes`` or ``store_bytes``, bytes per device; ``prefill``)."""
    opts = check_ratios(host_ratio, store_ratio, overlap_loads, prefill)
    if prefill is not None:
        return opts
    pool = capacity_tokens * costs.kv_bytes_per_token(cfg, dep)  # one instance's HBM pool, on one device
    out = {"overlap_loads": True} if overlap_loads else {}
    if "host_ratio" in opts:
        out["host_bytes"] = opts["host_ratio"] * pool
    if "store_ratio" in opts:
        out["store_bytes"] = opts["store_ratio"] * instances * pool
    return out


def tier_note(host_ratio: float | None, store_ratio: float | None, overlap_loads: bool = False,
              prefill: int | None = None) -> dict:
    """What a result's ``config`` says about its tier or disaggregation (nothing without either)."""
    if prefill is not None:
        return {"disaggregation": f"{prefill} instance(s) prefill, the rest decode; each request's KV and states "
                                  "cross one 400 Gb/s NIC a GPU (kimilab.fleet.disagg)"}
    loads = ("each step loads layer by layer under its compute" if overlap_loads
             else "each step waits for the loads before it")
    if host_ratio is not None:
        return {"host_tier": f"host DRAM of {host_ratio:g}x each instance's HBM pool under its prefix cache "
                             f"(kimilab.prefix.host); {loads}"}
    if store_ratio is not None:
        return {"shared_store": f"one store of {store_ratio:g}x the instances' HBM pools together, shared by them "
                                f"over RDMA, written through (kimilab.prefix.host); {loads}"}
    return {}


def speculation_of(speculation: dict | None) -> Speculation | None:
    """The :class:`~kimilab.engine.Speculation` a result's ``speculation`` dict names (None: none)."""
    if speculation is None:
        return None
    if not isinstance(speculation, dict):
        raise ValueError(f"speculation={speculation!r}: expected a dict of Speculation's fields, e.g. "
                         "{'k': 3, 'alpha': 0.7}")
    fields = ("k", "alpha", "rollback", "drafter", "seed")
    bad = sorted(set(speculation) - set(fields))
    if bad:
        raise ValueError(f"speculation: unknown field(s) {bad}; expected some of {list(fields)}")
    return Speculation(**speculation)


def spec_note(speculation: dict | None) -> dict:
    """What a result's ``config`` says about speculation (nothing without it)."""
    spec = speculation_of(speculation)
    if spec is None:
        return {}
    return {"speculation": f"{spec.k} drafts a step, each accepted with probability {spec.alpha:g} (swept: the "
                           f"book's models are untrained); {spec.drafter} drafter; rollback "
                           f"{spec.rollback or 'the cheapest at the batch'} (kimilab.engine.speculation)"}
