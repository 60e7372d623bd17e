"""KDA over a token tree: the chunked form with an ancestor mask, its node-by-node twin, and the fold.

The chunked KDA of chapter 2 works on one chain. A verify window that is a *tree* needs
two substitutions, and nothing else (the derivation SGLang's ``chunk_tree_verify.py``
states for the gated delta rule; KDA's gate is per key channel, so G is a vector):

* the cumulative gate runs along each node's root path: ``G_i = g_i + G_parent(i)``;
* "j before i" (the lower triangle) becomes "j is an ancestor of i" (the ancestor mask).

Powers of the masked matrix only connect nodes on one ancestor chain, so on every
root-to-leaf path the result is exactly that path's chain computation. The kernel
returns the outputs and each node's *update vector* d_i (the corrected value V' of the
chunk form), with which the state after node i is

    S_i = diag(exp(g_i)) S_parent(i) + k_i d_i^T .

So the state after any path is ``diag(exp(G_T)) S_0 + sum_i diag(exp(G_T - G_i)) k_i d_i^T``
(:func:`fold`): what a lazy ring (ReplaySSM) keeps per token instead of a state.
:func:`tree_kda_recurrent` is the slow twin (each node one recurrent step from its
parent's state, as vLLM's ``IS_EAGLE_TREE`` kernel walks a tree).
"""

from __future__ import annotations

import numpy as np

from kimilab.kda import kda_update
from kimilab.speculative.tree import Window

__all__ = ["tree_kda", "tree_kda_recurrent", "fold", "node_states"]


def _window(tree, n: int) -> Window:
    w = tree if isinstance(tree, Window) else Window.chain(n) if tree is None else Window(tree)
    if len(w) != n:
        raise ValueError(f"tree: {len(w)} nodes for {n} tokens")
    return w


def tree_kda(q, k, v, g, beta, tree, state, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """Outputs o [n, H, V] and update vectors d [n, H, V] of the window ``tree`` (a Window,
    parents, or None for a chain) of n nodes from ``state`` [H, K, V], all at once.

    q, k, g [n, H, K]; v [n, H, V]; beta [n, H]. One matrix solve per head (n is a
    verify window: a few to a few dozen nodes).
    """
    n, H, K = k.shape
    win = _window(tree, n)
    scale = K ** -0.5 if scale is None else float(scale)
    anc = win.ancestors
    strict = anc & ~np.eye(n, dtype=bool)
    G = np.einsum("ij,jhk->ihk", anc.astype(g.dtype), g)  # path cumsum [n, H, K]
    diff = G[:, None] - G[None, :]  # [i, j, H, K]; masked BEFORE exp (off-path entries may be > 0)
    E_strict = np.exp(np.where(strict[:, :, None, None], diff, -np.inf))
    E_anc = np.exp(np.where(anc[:, :, None, None], diff, -np.inf))
    # beta_i k_i.k_j decayed
    A = np.einsum("ihd,jhd,ijhd->hij", k, k, E_strict) * beta.T[:, :, None]
    eye = np.eye(n, dtype=k.dtype)
    # (I + A)^-1 diag(beta)
    T = np.linalg.solve(eye + A, np.broadcast_to(eye, A.shape)) * beta.T[:, None, :]
    eG = np.exp(G)
    W = T @ (eG * k).transpose(1, 0, 2)  # [H, n, K]
    U = T @ v.transpose(1, 0, 2)  # [H, n, V]
    d = U - W @ state  # [H, n, V]
    qs = q * scale
    Aqk = np.einsum("ihd,jhd,ijhd->hij", qs, k, E_anc)
    o = (eG * qs).transpose(1, 0, 2) @ state + Aqk @ d
    return o.transpose(1, 0, 2), d.transpose(1, 0, 2)


def tree_kda_recurrent(q, k, v, g, beta, tree, state, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """The slow twin: outputs o [n, H, V] and every node's state [n, H, K, V], node by node,
    each one recurrent KDA step from its parent's state (the root's parent: ``state``)."""
    n, H, K = k.shape
    win = _window(tree, n)
    scale = K ** -0.5 if scale is None else float(scale)
    states = np.empty((n,) + state.shape, dtype=np.result_type(state, k))
    o = np.empty((n, H, v.shape[2]), dtype=states.dtype)
    for i, p in enumerate(win.parents):
        S = np.array(state if p < 0 else states[p], dtype=states.dtype)[None]
        o[i] = kda_update(S, q[i][None], k[i][None], v[i][None], np.exp(g[i])[None], beta[i][None], scale)[0]
        states[i] = S[0]
    return o, states


def node_states(state, k, v, g, beta, tree) -> np.ndarray:
    """Every node's state [n, H, K, V] (what a snapshot keeps per node), node by node.

    The state half of the update (no output read), each node from its parent's state.
    """
    n = k.shape[0]
    win = _window(tree, n)
    out = np.empty((n,) + state.shape, dtype=np.result_type(state, k))
    decay = np.exp(g)
    for i, p in enumerate(win.parents):
        S = np.array(state if p < 0 else out[p], dtype=out.dtype)
        S *= decay[i][:, :, None]
        kS = np.matmul(k[i][:, None, :], S)[:, 0, :]
        S += (beta[i][:, None] * k[i])[:, :, None] * (v[i] - kS)[:, None, :]
        out[i] = S
    return out


def fold(state, d, k, g) -> np.ndarray:
    """The state after a chain of entries (d, k, g ``[m, H, *]``) from ``state`` [H, K, V]:
    diag(exp(G_m)) S + sum_i diag(exp(G_m - G_i)) k_i d_i^T, with G the running sum of g.

    One product over all m entries -- the write-back (flush) of a lazy ring; m = 0 returns
    a copy of ``state``.
    """
    state = np.asarray(state)
    if len(d) == 0:
        return state.copy()
    G = np.cumsum(g, axis=0)  # [m, H, K]
    weights = np.exp(G[-1][None] - G) * k  # [m, H, K]
    return np.exp(G[-1])[:, :, None] * state + np.einsum("mhk,mhv->hkv", weights, d)
