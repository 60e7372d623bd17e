"""Verify a token tree in one forward pass of the model: every layer sees each node's own root path.

Three places of the model look back in time, and each gets the tree's ancestor mask:

* the short conv of a KDA layer: node i convolves over the raw inputs of its ancestors
  (and, above the root, the committed conv state) -- SGLang's tree conv does the same;
* the KDA recurrence: :func:`~kimilab.speculative.tree_kda.tree_kda`, chunked with the mask;
* global attention: node i attends to every committed key and to its ancestors' keys.

Everything else (projections, norms, MLPs, the output head) is per token. So on every
root-to-leaf path the logits equal those of verifying that path as a chain, which the
tests check. As in :func:`~kimilab.speculative.verify`, the window's KV goes into the
request's cache (rows of every node, in node order) and no state is written: the tree
kernel is output-only; a rollback strategy decides which path's state to keep.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kimilab.model import CacheProtocol, Model
from kimilab.model.layers import KDACapture, rms_norm
from kimilab.speculative.tree import Window
from kimilab.speculative.tree_kda import tree_kda
from kimilab.speculative.verify import VerifyView

__all__ = ["verify_tree", "tree_attention", "tree_project"]


def tree_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: Window) -> np.ndarray:
    """Attention of the window's n queries q [n, H, D] over keys k, v [L, Hkv, D]: the last n
    keys are the window's nodes; node i sees the L - n committed keys and its ancestors."""
    n, H, D = q.shape
    L, Hkv, _ = k.shape
    group = H // Hkv
    visible = np.concatenate([np.ones((n, L - n), dtype=bool), window.ancestors], axis=1)  # [n, L]
    kh = np.repeat(k, group, axis=1).transpose(1, 2, 0)  # [H, D, L]
    vh = np.repeat(v, group, axis=1).transpose(1, 0, 2)  # [H, L, D]
    scores = (q.transpose(1, 0, 2) * D ** -0.5) @ kh  # [H, n, L]
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ vh).transpose(1, 0, 2)


def tree_project(layer, x: np.ndarray, conv_state: np.ndarray, window: Window) -> KDACapture:
    """A KDA layer's per-node inputs: node i projected exactly as the last token of its root
    path would be in a chain verify (the layer's own ``project`` over that path)."""
    if window.is_chain:
        return layer.project(x, conv_state)[0]
    rows = [layer.project(x[window.path(i)], conv_state)[0][-1:] for i in range(len(window))]
    out = rows[0]
    for r in rows[1:]:
        out = out.concat(r)
    return out


def verify_tree(model: Model, window_tokens: Sequence[int], window: Window,
                cache: CacheProtocol) -> tuple[np.ndarray, dict, VerifyView]:
    """Run the tree ``window`` (node 0 = the last committed token) through ``model`` in one pass.

    Returns (logits [n, vocab], {KDA layer: KDACapture of the n nodes}, the view). The cache
    gains the window's KV (n rows, node order); its KDA and conv states stay committed.
    """
    if not isinstance(window, Window):
        raise ValueError(f"window: expected a kimilab.speculative.Window, got {type(window).__name__}")
    tokens = model._tokens(window_tokens, name="window_tokens")
    if len(tokens) != len(window):
        raise ValueError(f"window_tokens: {len(tokens)} tokens for a window of {len(window)} nodes")
    view = VerifyView(cache)
    captures: dict = {}
    h = model.weights["embed"][tokens]
    for layer, mlp in zip(model.layers, model.mlps):
        x = rms_norm(h, layer.norm)
        i = layer.index
        if layer.kind == "K":
            cap = tree_project(layer, x, view.conv_state(i), window)
            captures[i] = cap
            o, _ = tree_kda(*cap.kernel_inputs(), window, view.kda_state(i))
            h = h + layer.output(x, o)
        else:
            q, k, v = layer.project(x)
            view.append_kv(i, k, v)
            h = h + layer.output(tree_attention(q, *view.kv(i), window))
        h = h + mlp(h)
    view.advance(len(tokens))
    return rms_norm(h, model.weights["final_norm"]) @ model.weights["lm_head"], captures, view
