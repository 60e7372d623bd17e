"""Associative recall: how many (key, value) pairs a memory gives back, and how recall ages.

Write N pairs into a memory, then query every key and decode the read-back to the closest
entry (cosine similarity) of a vocabulary of ``vocab`` value embeddings, as a language model
decodes a token (multi-query associative recall, MQAR): accuracy is the fraction decoded
right. Keys are random unit vectors (they overlap, as real keys do), values are vocabulary
entries (random Gaussian embeddings). Four memories:

- ``"softmax"``: a KV cache read by softmax attention -- every pair is kept; the logits are
  ``sharpness * (q . k)`` (an attention layer that has learnt to attend sharply), in float32;
- ``"linear"``: plain linear attention, ``S = sum_i k_i v_i^T`` (an additive state);
- ``"delta"``: the delta rule with beta = 1 and no decay -- KDA with the gate at zero;
- ``"kda"``: KDA with a forget gate (``gate``, one of :data:`kimilab.kda.testing.GATES`'s
  decaying gates), so old pairs also fade.

The state memories run through :func:`kimilab.kda.recurrent_kda` itself (the book's
reference kernel), batched over seeds. A fixed-size K x V state can hold about K
independent directions; a KV cache grows with N. That is the quality side of the
memory the hybrid saves (chapter 12), and why its global layers matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kimilab.kda import kda_gate, l2_normalize, recurrent_kda
from kimilab.validate import check_choice, check_float, check_int

__all__ = ["MEMORIES", "RecallResult", "read_back", "recall", "rebinding", "capacity", "half_capacities", "recall_sweep"]

MEMORIES = ("softmax", "linear", "delta", "kda")


def _inputs(n_pairs: int, d_k: int, d_v: int, vocab: int, seeds, gate_strength: float):
    """Per seed: keys [N, K], value ids [N], the vocabulary [vocab, V], KDA gates [N, K] (float64)."""
    keys, ids, vocabs, gates = [], [], [], []
    for seed in seeds:
        r = np.random.default_rng(check_int("seed", seed, 0))
        keys.append(l2_normalize(r.standard_normal((n_pairs, d_k))))
        vocabs.append(r.standard_normal((vocab, d_v)))
        ids.append(r.integers(0, vocab, n_pairs))
        # Kimi's gate at initialisation: per-channel decays from ~e^-0.001 to ~e^-0.1 a step
        dt = np.geomspace(1e-3, 1e-1, d_k)
        raw = 0.5 * r.standard_normal((n_pairs, 1, d_k))
        gates.append(gate_strength * kda_gate(raw, np.zeros(1), np.log(np.expm1(dt)))[:, 0])
    return np.stack(keys), np.stack(ids), np.stack(vocabs), np.stack(gates)


def read_back(memory: str, keys: np.ndarray, values: np.ndarray, *, gates: np.ndarray | None = None,
              sharpness: float = 16.0) -> np.ndarray:
    """Write ``keys`` [S, N, K] -> ``values`` [S, N, V] in order, then read every key back: [S, N, V]."""
    check_choice("memory", memory, MEMORIES)
    S_, N, K = keys.shape
    if memory == "softmax":  # in float32, as attention kernels run it (and 6x faster than float64 here)
        k32 = keys.astype(np.float32)
        w = np.matmul(k32, k32.transpose(0, 2, 1))
        w *= sharpness
        w -= w.max(axis=-1, keepdims=True)
        np.exp(w, out=w)
        w /= w.sum(axis=-1, keepdims=True)
        return np.matmul(w, values.astype(np.float32)).astype(np.float64)
    if memory == "linear":
        state = np.matmul(keys.transpose(0, 2, 1), values)
    else:
        g = np.zeros_like(keys) if memory == "delta" else gates
        beta = np.ones((S_, N, 1))
        _, state = recurrent_kda(keys[:, :, None], keys[:, :, None], values[:, :, None], g[:, :, None], beta,
                                 scale=1.0)
        state = state[:, 0]
    return np.matmul(keys, state)


@dataclass(frozen=True)
class RecallResult:
    """Accuracy over seeds: its mean and standard deviation, and per distance (pairs written since)."""

    memory: str
    n_pairs: int
    mean: float
    std: float
    by_distance: np.ndarray  # [N] mean accuracy of the pair written ``distance`` pairs before the end


def _decode(out: np.ndarray, vocabs: np.ndarray) -> np.ndarray:
    """The vocabulary entry each read-back is closest to (cosine): [S, N] ids."""
    unit = (vocabs / np.linalg.norm(vocabs, axis=-1, keepdims=True)).astype(np.float32)
    return np.matmul(out.astype(np.float32), unit.transpose(0, 2, 1)).argmax(axis=-1)  # fp32: ranks, not sums


def recall(memory: str, n_pairs: int, *, d_k: int = 128, d_v: int = 128, vocab: int = 2048, seeds=range(20),
           gate_strength: float = 1.0, sharpness: float = 16.0) -> RecallResult:
    """Store ``n_pairs`` and query each: the fraction whose read-back decodes to its own value."""
    n = check_int("n_pairs", n_pairs, 1)
    d_k, d_v, vocab = check_int("d_k", d_k, 1), check_int("d_v", d_v, 1), check_int("vocab", vocab, 2)
    check_float("gate_strength", gate_strength, minimum=0.0)
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds: expected at least one seed")
    keys, ids, vocabs, gates = _inputs(n, d_k, d_v, vocab, seeds, gate_strength)
    values = np.take_along_axis(vocabs, ids[..., None], axis=1)
    out = read_back(memory, keys, values, gates=gates, sharpness=sharpness)
    right = (_decode(out, vocabs) == ids).astype(float)  # [S, N]
    per_seed = right.mean(axis=1)
    return RecallResult(memory, n, float(per_seed.mean()), float(per_seed.std()), right.mean(axis=0)[::-1])


def rebinding(memory: str, n_keys: int, *, d_k: int = 128, d_v: int = 128, vocab: int = 2048, seeds=range(20),
              gate_strength: float = 1.0, sharpness: float = 16.0) -> tuple[float, float]:
    """Write ``n_keys`` pairs, then the same keys again with new values (a variable reassigned):
    (mean, std over seeds) of the fraction whose read-back decodes to the NEW value."""
    n = check_int("n_keys", n_keys, 1)
    seeds = list(seeds)
    keys, ids, vocabs, gates = _inputs(2 * n, d_k, d_v, vocab, seeds, gate_strength)
    keys = np.concatenate([keys[:, :n], keys[:, :n]], axis=1)  # the second half re-uses the first half's keys
    values = np.take_along_axis(vocabs, ids[..., None], axis=1)
    out = read_back(memory, keys, values, gates=gates, sharpness=sharpness)[:, n:]
    per_seed = (_decode(out, vocabs) == ids[:, n:]).mean(axis=1)
    return float(per_seed.mean()), float(per_seed.std())


def capacity(memory: str, threshold: float = 0.5, *, lo: int = 1, hi: int = 4096, **kw) -> int | None:
    """The largest N whose mean accuracy is at least ``threshold`` (bisection; accuracy falls with
    N), or None if it is still above it at ``hi`` ("holds everywhere in the sweep")."""
    check_float("threshold", threshold, minimum=0.0)
    if recall(memory, hi, **kw).mean >= threshold:
        return None
    if recall(memory, lo, **kw).mean < threshold:
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if recall(memory, mid, **kw).mean >= threshold:
            lo = mid
        else:
            hi = mid
    return lo


def half_capacities(memories, groups, *, lo: int = 16, hi: int = 4096, grid: int = 9) -> dict:
    """Per memory, per group of seeds: where mean recall falls through one half as N grows
    (:func:`kimilab.verdict.crossover` over [lo, hi], its fields as a dict): a capacity with its band."""
    import dataclasses

    from kimilab.verdict import crossover

    return {m: [dataclasses.asdict(crossover(lambda n: recall(m, int(n), seeds=g).mean - 0.5, lo, hi, integer=True,
                                             grid=grid)) for g in groups] for m in memories}


def recall_sweep(memories, pairs, seeds) -> dict:
    """Per memory, ``[mean, std]`` of :func:`recall` over ``seeds`` at each N of ``pairs``."""
    return {m: [[(r := recall(m, int(n), seeds=seeds)).mean, r.std] for n in pairs] for m in memories}
