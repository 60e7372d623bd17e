"""The memory below the HBM cache in a Part B run: a host tier per instance, or a store they share.

Two options a production deployment turns on, as ratios to what it already has:

* ``host_ratio``: each instance's own host DRAM tier (:class:`kimilab.prefix.host.HostTier`), that
  many times its HBM pool's bytes (SGLang's HiCache guide uses 2); what HBM evicts waits there.
* ``store_ratio``: one store the fleet's instances share (Mooncake Store pools the cluster's DRAM
  this way), that many times all their HBM pools together, on the cluster's RDMA links; every
  instance writes each block and state through to it as it is computed.
"""

from __future__ import annotations

from kimilab import costs
from kimilab.validate import check_float

__all__ = ["check_ratios", "tier_keywords", "tier_note"]


def check_ratios(host_ratio: float | None, store_ratio: float | None) -> dict:
    """The ratios given, checked (each >= 0, at most one of them), as keywords."""
    if host_ratio is not None and store_ratio is not None:
        raise ValueError("host_ratio, store_ratio: expected one tier under the cache, an instance's own or shared")
    return {name: check_float(name, x, minimum=0.0)
            for name, x in (("host_ratio", host_ratio), ("store_ratio", store_ratio)) if x is not None}


def tier_keywords(cfg, dep, capacity_tokens: int, instances: int, host_ratio: float | None = None,
                  store_ratio: float | None = None) -> dict:
    """The fleet's keywords for these tiers (``host_bytes`` or ``store_bytes``, bytes per device)."""
    ratios = check_ratios(host_ratio, store_ratio)
    pool = capacity_tokens * costs.kv_bytes_per_token(cfg, dep)  # one instance's HBM pool, on one device
    if "host_ratio" in ratios:
        return {"host_bytes": ratios["host_ratio"] * pool}
    if "store_ratio" in ratios:
        return {"store_bytes": ratios["store_ratio"] * instances * pool}
    return {}


def tier_note(host_ratio: float | None, store_ratio: float | None) -> dict:
    """What a result's ``config`` says about its tier (nothing without one)."""
    if host_ratio is not None:
        return {"host_tier": f"host DRAM of {host_ratio:g}x each instance's HBM pool under its prefix cache "
                             "(kimilab.prefix.host); each step waits for the loads before it"}
    if store_ratio is not None:
        return {"shared_store": f"one store of {store_ratio:g}x the instances' HBM pools together, shared by them "
                                "over RDMA, written through (kimilab.prefix.host); each step waits for its loads"}
    return {}
