"""Several traces as one stream of tenants: each file is a tenant, its hash ids kept apart.

A Mooncake trace's hash ids only mean something inside its file, so two files
must never share a block by accident: each file's ids are offset into their own
range. Requests are merged by timestamp (ties by file order, then line) and
renumbered.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

__all__ = ["merge_tenants", "label_tenant", "load_tenants"]

_ID_SPACE = 1 << 40  # hash ids per tenant file


def label_tenant(requests: Sequence, tenant: str, slot: int) -> list:
    """The requests as tenant ``tenant``, their hash ids moved into range ``slot``."""
    out = []
    for r in requests:
        ids = None if r.hash_ids is None else tuple(slot * _ID_SPACE + h for h in r.hash_ids)
        if ids is not None and any(h >= _ID_SPACE for h in r.hash_ids):
            raise ValueError(f"request {r.request_id}: hash id >= 2**40")
        out.append(dataclasses.replace(r, tenant=tenant, hash_ids=ids))
    return out


def merge_tenants(streams: Sequence[tuple[str, Sequence]]) -> list:
    """[(tenant, requests)] -> one list in arrival order, ids renumbered 0..n-1."""
    names = [t for t, _ in streams]
    if len(set(names)) != len(names):
        raise ValueError(f"tenants {names}: expected distinct names (file stems)")
    tagged = []
    for slot, (tenant, reqs) in enumerate(streams):
        for line, r in enumerate(label_tenant(reqs, tenant, slot)):
            tagged.append((r.arrival_ms, slot, line, r))
    tagged.sort(key=lambda x: x[:3])
    return [dataclasses.replace(r, request_id=i) for i, (_, _, _, r) in enumerate(tagged)]


def load_tenants(paths: Sequence, block_size: int = 512) -> list:
    """Load trace files, one tenant each (named by file stem), merged."""
    from kimilab.traffic import load_trace

    streams = []
    for p in paths:
        try:
            streams.append((Path(p).stem, load_trace(p, block_size)))
        except ValueError as err:
            raise ValueError(f"{p}: {err}") from None
    return merge_tenants(streams)

