"""KDA kernels: chunked vs recurrent, achieved GFLOP/s, the UT-transform solve, and fla's reference.

Everything is timed side by side in this one process (best of N); on a shared
machine absolute times are noise, ratios are the result.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from kimilab import kda
from kimilab.kda import chunk
from kimilab.kda.testing import random_inputs
from kimilab.timing import best_seconds

T, H, K, V, CHUNK = 4096, 4, 64, 64, 64


def matmul_gflops() -> float:
    """This machine's np.matmul float32 GFLOP/s on a 1024^3 product (best of 5)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1024, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 1024)).astype(np.float32)
    a @ b
    return 2 * 1024**3 / best_seconds(lambda: a @ b, 5) / 1e9


# ----------------------------------------------------------------------------- UT-transform solve candidates


def solve_by_linalg(L, R):
    eye = np.broadcast_to(np.eye(L.shape[-1], dtype=L.dtype), L.shape)
    return np.linalg.solve(eye + L, R)


def solve_by_rows(L, R):
    """Forward substitution, one row at a time, vectorised over the batch."""
    X = np.empty_like(R)
    for i in range(L.shape[-1]):
        X[:, i] = R[:, i] - np.matmul(L[:, i : i + 1, :i], X[:, :i])[:, 0]
    return X


def unit_lower_inverse(L: np.ndarray) -> np.ndarray:
    """``(I + L)^-1`` for strictly lower-triangular ``L [..., n, n]``, batched.

    Bottom-up block doubling, in place: the inverse of [[A, 0], [B, D]] is
    [[A^-1, 0], [-D^-1 B A^-1, D^-1]]. Starting from 1x1 diagonal blocks (ones),
    each level fills the lower-left quarter of every 2b x 2b diagonal block with
    two batched matmuls, so the whole inverse is ~2 log2(n) numpy calls and
    ~n^3/3 multiply-adds. n is padded to a power of two with zeros (identity rows),
    which does not change the top-left n x n block of the inverse.
    ``chunk_kda`` never forms the inverse: it solves with ``_unit_lower_solve``, which
    ``bench_solve`` shows is faster. ``tests/test_kda.py`` checks this candidate too.
    """
    L = np.asarray(L)
    if L.ndim < 2 or L.shape[-1] != L.shape[-2]:
        raise ValueError(f"L: expected [..., n, n], got shape {L.shape}")
    n = L.shape[-1]
    lead = L.shape[:-2]
    m = 1 << max(0, (n - 1).bit_length())
    F = int(np.prod(lead, dtype=np.int64))
    if m == n:
        Lp = np.ascontiguousarray(L).reshape(F, n, n)
    else:
        Lp = np.zeros((F, m, m), L.dtype)
        Lp[:, :n, :n] = L.reshape(F, n, n)
    X = np.zeros((F, m, m), L.dtype)
    X.reshape(F, m * m)[:, :: m + 1] = 1
    b = 1
    while b < m:
        w = 2 * b

        def diag_blocks(a, writeable=False):
            fs, rs, cs = a.strides
            return np.lib.stride_tricks.as_strided(
                a, shape=(F, m // w, w, w), strides=(fs, w * (rs + cs), rs, cs), writeable=writeable
            )

        Xd = diag_blocks(X, writeable=True)
        lower = np.matmul(diag_blocks(Lp)[:, :, b:, :b], Xd[:, :, :b, :b])
        np.negative(np.matmul(Xd[:, :, b:, b:], lower), out=lower)
        Xd[:, :, b:, :b] = lower
        b = w
    return X.reshape(lead + (m, m))[..., :n, :n]


def solve_by_inverse(L, R):
    """Form (I + L)^-1 by block doubling (unit_lower_inverse above), then one product."""
    return np.matmul(unit_lower_inverse(L), R)


def bench_solve() -> None:
    """X = (I + L)^-1 [beta exp(G) K | beta V] for every chunk and head, as chunk_kda needs it."""
    rng = np.random.default_rng(2)
    F = T // CHUNK * H
    L = np.tril(rng.standard_normal((F, CHUNK, CHUNK)) * 0.05, -1).astype(np.float32)
    R = rng.standard_normal((F, CHUNK, K + V)).astype(np.float32)
    reference = solve_by_linalg(L.astype(np.float64), R.astype(np.float64))
    candidates = {
        "np.linalg.solve": solve_by_linalg,
        "row forward substitution": solve_by_rows,
        "block-doubling inverse, then matmul": solve_by_inverse,
        "block forward substitution (kda.chunk._unit_lower_solve)": chunk._unit_lower_solve,
    }
    times = {}
    for name, fn in candidates.items():
        err = float(np.abs(fn(L, R) - reference).max())
        times[name] = 1e3 * best_seconds(lambda fn=fn: fn(L, R), 5)
        print(f"  unit-lower solve [{F} x {CHUNK} x {CHUNK}] @ [{CHUNK} x {K + V}] {name}: "
              f"{times[name]:.2f} ms (max|err| {err:.1e})")
    chosen = times["block forward substitution (kda.chunk._unit_lower_solve)"]
    print(f"kda_solve_blocked_vs_linalg: ratio={times['np.linalg.solve'] / chosen:.1f}x "
          f"(np.linalg.solve={times['np.linalg.solve']:.2f} ms, blocked={chosen:.2f} ms)")


# ----------------------------------------------------------------------------- stages


def stage_profile(args, repeat: int = 5) -> str:
    """Where chunk_kda's time goes: each stage timed on its own with perf_counter (best of 5)."""
    q, k, v, g, beta = (x[None] for x in args)
    scale, decaying = K**-0.5, bool(g.max() <= 0)
    G = chunk._chunk_cumsum(g, CHUNK)

    def prepare_all():
        work = {}  # the buffers chunk_kda shares between its slabs
        for c0, c1 in chunk._slabs(T // CHUNK, H):
            chunk._prepare_slab(q, k, v, G, beta, c0, c1, CHUNK, scale, decaying, need_output=True, work=work)

    cumsum = 1e3 * best_seconds(lambda: chunk._chunk_cumsum(g, CHUNK), repeat)
    prepare = 1e3 * best_seconds(prepare_all, repeat)
    total = 1e3 * best_seconds(lambda: kda.chunk_kda(*args), repeat)
    return (f"cumsum {cumsum:.1f} ms, state-independent slabs {prepare:.1f} ms, "
            f"state pass + output {max(0.0, total - cumsum - prepare):.1f} ms (of {total:.1f} ms)")


# ----------------------------------------------------------------------------- fla reference


def load_fla_naive():
    """fla/ops/kda/naive.py by file path (importing fla.ops needs triton). None if absent."""
    try:
        import einops  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return None
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive_reference", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def bench_fla(ours_ms: float, args) -> None:
    naive = load_fla_naive()
    if naive is None:
        print("kda_chunk_vs_fla_naive_chunk: SKIPPED (torch + fla-core not installed; `pip install -e '.[parity]'`)")
        return
    import torch

    torch.set_num_threads(2)
    tensors = [torch.from_numpy(x[None]) for x in args]  # fla layout [B, T, H, ...]
    with torch.no_grad():
        ref_ms = 1e3 * best_seconds(
            lambda: naive.naive_chunk_kda(*tensors, output_final_state=True, chunk_size=CHUNK), 2)
        o_ref, _ = naive.naive_chunk_kda(*tensors, output_final_state=True, chunk_size=CHUNK)
    o, _ = kda.chunk_kda(*args, chunk_size=CHUNK)
    rel = float(np.abs(o - o_ref[0].numpy()).max() / np.abs(o_ref.numpy()).max())
    print(f"kda_chunk_vs_fla_naive_chunk: ratio={ref_ms / ours_ms:.1f}x (fla naive_chunk_kda={ref_ms:.1f} ms, "
          f"kimilab chunk_kda={ours_ms:.1f} ms; torch threads=2; rel err {rel:.1e})")


def main() -> None:
    print(f"# KDA at T={T}, H={H}, K=V={K}, chunk={CHUNK}, float32")
    peak = matmul_gflops()
    flops = kda.chunk_kda_flops(T, H, K, V, CHUNK)
    main_args = None
    main_chunk_ms = None
    for gate in ("kimi-init", "logsigmoid"):
        args, _ = random_inputs(T, H, K, V, seed=0, gate=gate, dtype=np.float32)
        kda.chunk_kda(*args)  # warm up
        rec, chk = [], []
        for _ in range(3):  # interleave so both see the same machine load
            rec.append(1e3 * best_seconds(lambda: kda.recurrent_kda(*args), 1))
            chk.append(1e3 * best_seconds(lambda: kda.chunk_kda(*args, chunk_size=CHUNK), 3))
        rec_ms, chunk_ms = min(rec), min(chk)
        G = chunk._chunk_cumsum(args[3][None], CHUNK)[0]  # [N, C, H, K]
        blocks = [int(chunk._block_sizes(G[c0:c1].reshape(c1 - c0, CHUNK, H * K), CHUNK, decaying=True).min())
                  for c0, c1 in chunk._slabs(T // CHUNK, H)]
        print(f"kda_chunk_vs_recurrent[{gate} gates]: ratio={rec_ms / chunk_ms:.1f}x "
              f"(recurrent={rec_ms:.1f} ms, chunked={chunk_ms:.1f} ms; in-chunk block size per slab {blocks})")
        print(f"  chunk_kda stages [{gate}]: {stage_profile(args)}")
        if main_args is None:
            main_args, main_chunk_ms = args, chunk_ms
    achieved = flops / (main_chunk_ms * 1e-3) / 1e9
    print(f"kda_chunk_gflops: {achieved:.1f} GFLOP/s = {100 * achieved / peak:.0f}% of np.matmul "
          f"({peak:.1f} GFLOP/s on 1024^3 float32; {flops / 1e9:.2f} GFLOP counted by kda.chunk_kda_flops)")
    bench_solve()
    bench_fla(main_chunk_ms, main_args)


if __name__ == "__main__":
    main()
