"""A trace re-keyed for an engine whose block is not the trace's: vLLM's 480-token blocks at TP4.

A Mooncake trace knows prefixes at its own block resolution (512 tokens): one id per
block, naming the whole prefix up to it. An engine block that ends at token ``e`` is keyed
by the trace block holding token ``e - 1``: two prompts share it when they share that whole
trace block. So a hit is counted only where the trace proves it, never more than the
engine's real hit -- for coarser blocks (vLLM's 1,888 under DP-attention) and finer ones
(480 at TP4, 240 at TP8) alike. The ids still name whole prefixes; with finer blocks two
consecutive engine blocks may share an id (both end inside one trace block), which a radix
tree keyed per parent handles.
"""

from __future__ import annotations

from typing import Sequence

from kimilab.traffic import Request
from kimilab.validate import check_int

__all__ = ["rekey"]


def rekey(records: Sequence[Request], block_size: int, new_block_size: int) -> list[Request]:
    """``records`` (ids per ``block_size`` tokens) keyed per ``new_block_size`` tokens instead."""
    block_size = check_int("block_size", block_size, 1, unit="tokens")
    new_block_size = check_int("new_block_size", new_block_size, 1, unit="tokens")
    out = []
    for i, r in enumerate(records):
        if r.hash_ids is None:
            raise ValueError(f"records[{i}].hash_ids=None: expected trace records with block ids")
        ids, n = r.hash_ids, r.input_length
        last = len(ids) - 1
        keys = tuple(ids[min((end - 1) // block_size, last)] for end in range(new_block_size, n + new_block_size,
                                                                                  new_block_size))
        out.append(Request(r.request_id, r.arrival_ms, n, r.output_length, hash_ids=keys, session=r.session,
                           tenant=r.tenant, kind=r.kind))
    return out
