"""Context-parallel prefill of the whole hybrid model: one prompt across P ranks, same logits.

Per layer, each rank works on its slice of the residual stream. A KDA layer needs two
things from earlier ranks: the conv's halo (the last W-1 raw conv inputs before the
slice, all-gathered as each rank's tail) and the state entering the slice
(:func:`~kimilab.cp.kda_cp.cp_kda_rank`). A global-attention layer runs ring attention
(:func:`~kimilab.cp.ring.ring_attention_rank`), on the contiguous slices or, with
``layout="zigzag"``, on the balanced zigzag layout: its input is re-dealt to zigzag and its
output back (:func:`~kimilab.cp.zigzag.relayout`). Everything else is per token. The final
cache is the last rank's KDA and conv states plus every rank's keys and values.
"""

from __future__ import annotations

import numpy as np

from kimilab.cp.comm import run_local
from kimilab.cp.kda_cp import cp_kda_rank
from kimilab.cp.ring import ring_attention_rank
from kimilab.cp.split import cut_points, slices
from kimilab.cp.zigzag import LAYOUTS, contiguous_layout, layout_positions, relayout, zigzag_layout
from kimilab.model import HybridCache
from kimilab.validate import check_choice
from kimilab.model.layers import rms_norm

__all__ = ["cp_prefill_rank", "context_parallel_prefill"]


def _conv_halo(comm, layer, x, W: int):
    """The W-1 raw conv inputs before this rank's slice (zeros before the prompt's start)."""
    _, tail = layer.project(x[-(W - 1):])  # the last W-1 raw inputs of this slice (zero-padded)
    tails = comm.allgather(tail[-min(len(x), W - 1):])
    earlier = [np.zeros_like(tail)] + tails[:comm.rank]
    return np.concatenate(earlier, axis=0)[-(W - 1):]


def _attention(comm, layer, x, start: int, layout: str, stats):
    """A global-attention layer on this rank's contiguous rows ``x``: (output rows, (k, v, positions))."""
    if layout == "contiguous":
        q, k, v = layer.project(x)
        pos = np.arange(start, start + len(x))
        return layer.output(ring_attention_rank(comm, q, k, v, positions=pos, stats=stats)), (k, v, pos)
    ends = comm.allgather((start, start + len(x)))  # every rank's slice: the two layouts need them all
    home = contiguous_layout([a for a, _ in ends] + [ends[-1][1]])
    zig = zigzag_layout(ends[-1][1], comm.size)
    q, k, v = layer.project(relayout(comm, x, home, zig))
    pos = layout_positions(zig[comm.rank])
    out = layer.output(ring_attention_rank(comm, q, k, v, positions=pos, stats=stats))
    return relayout(comm, out, zig, home), (k, v, pos)


def cp_prefill_rank(comm, model, tokens, start: int, *, layout: str = "contiguous",
                    stats: dict | None = None) -> tuple[np.ndarray, dict]:
    """This rank's logits for its slice (global positions start..), and its part of the cache.

    The cache part: per KDA layer (state after the slice, conv state after it), per
    attention layer (k, v, positions) of the rows this rank attended for. ``layout``
    (:data:`~kimilab.cp.zigzag.LAYOUTS`) is the global-attention layers' layout; ``stats``
    (a dict) collects the attention scores computed (``score_entries``).
    """
    check_choice("layout", layout, LAYOUTS)
    cfg = model.config
    h = model.weights["embed"][np.asarray(tokens)]
    part = {}
    for layer, mlp in zip(model.layers, model.mlps):
        x = rms_norm(h, layer.norm)
        if layer.kind == "A":
            out, part[layer.index] = _attention(comm, layer, x, start, layout, stats)
        else:
            cap, conv = layer.project(x, _conv_halo(comm, layer, x, cfg.conv_kernel))
            o, S = cp_kda_rank(comm, *cap.kernel_inputs(), chunk_size=cfg.chunk_size)
            out = layer.output(x, o)
            part[layer.index] = (S, conv)
        h = h + out
        h = h + mlp(h)
    return rms_norm(h, model.weights["final_norm"]) @ model.weights["lm_head"], part


def context_parallel_prefill(model, tokens, ranks: int | None = None, bounds=None, *, layout: str = "contiguous",
                             stats: list | None = None) -> tuple[np.ndarray, HybridCache]:
    """Prefill ``tokens`` across in-process ranks: (logits [T, vocab], a filled HybridCache).

    Cut evenly into ``ranks`` slices, or at ``bounds`` (P + 1 increasing cut points);
    ``layout`` is the global-attention layers'. ``stats`` (a list) receives one dict per
    rank (the attention scores it computed).
    """
    check_choice("layout", layout, LAYOUTS)
    tokens = np.asarray(tokens, dtype=np.int64)
    bounds = cut_points(len(tokens), ranks, bounds)
    ranks = len(bounds) - 1
    parts = [(tokens[s], s.start) for s in slices(bounds)]
    dicts = [{} for _ in range(ranks)]
    results, _ = run_local(ranks, lambda comm: cp_prefill_rank(comm, model, *parts[comm.rank], layout=layout,
                                                                  stats=dicts[comm.rank]))
    if stats is not None:
        stats.extend(dicts)
    cache = HybridCache(model.config)
    for layer in model.layers:
        i = layer.index
        if layer.kind == "A":
            k, v, pos = (np.concatenate(x) for x in zip(*(part[i] for _, part in results)))
            order = np.argsort(pos)
            cache.append_kv(i, k[order], v[order])
        else:
            S, conv = results[-1][1][i]
            cache.set_kda_state(i, S)
            cache.set_conv_state(i, conv)
    cache.advance(len(tokens))
    return np.concatenate([logits for logits, _ in results], axis=0), cache
