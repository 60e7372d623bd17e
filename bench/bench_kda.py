"""KDA kernels: chunked vs recurrent, achieved GFLOP/s, the UT-transform solve, and fla's reference.

Everything is timed side by side in this one process (best of N); on a shared
machine absolute times are noise, ratios are the result.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time

import numpy as np

from kimilab import kda

T, H, K, V, CHUNK = 4096, 4, 64, 64, 64


def best_ms(fn, repeat: int) -> float:
    """Best wall-clock time of ``repeat`` calls, in milliseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def inputs(gate: str, seed: int = 0, dtype=np.float32):
    """float32 KDA inputs at the benchmark shape. ``gate``: 'kimi-init' or 'logsigmoid'."""
    rng = np.random.default_rng(seed)
    q = kda.l2_normalize(rng.standard_normal((T, H, K)))
    k = kda.l2_normalize(rng.standard_normal((T, H, K)))
    v = rng.standard_normal((T, H, V))
    if gate == "kimi-init":  # A = exp(A_log) in [1, 16], softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), H * K))
        g = kda.kda_gate(0.5 * rng.standard_normal((T, H, K)), np.log(rng.uniform(1, 16, H)), np.log(np.expm1(dt)))
    else:  # the gate flash-linear-attention's own KDA tests draw
        g = np.log(kda.sigmoid(rng.standard_normal((T, H, K))))
    beta = kda.sigmoid(rng.standard_normal((T, H)))
    return [np.ascontiguousarray(x, dtype=dtype) for x in (q, k, v, g, beta)]


def matmul_gflops() -> float:
    """This machine's np.matmul float32 GFLOP/s on a 1024^3 product (best of 5)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1024, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 1024)).astype(np.float32)
    a @ b
    return 2 * 1024**3 / (best_ms(lambda: a @ b, 5) * 1e-3) / 1e9


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


def solve_by_inverse(L, R):
    """Form (I + L)^-1 by block doubling (kda.unit_lower_inverse), then one product."""
    return np.matmul(kda.unit_lower_inverse(L), R)


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
        "block forward substitution (kda._unit_lower_solve)": kda._unit_lower_solve,
    }
    times = {}
    for name, fn in candidates.items():
        err = float(np.abs(fn(L, R) - reference).max())
        times[name] = best_ms(lambda fn=fn: fn(L, R), 5)
        print(f"  unit-lower solve [{F} x {CHUNK} x {CHUNK}] @ [{CHUNK} x {K + V}] {name}: "
              f"{times[name]:.2f} ms (max|err| {err:.1e})")
    chosen = times["block forward substitution (kda._unit_lower_solve)"]
    print(f"kda_solve_blocked_vs_linalg: ratio={times['np.linalg.solve'] / chosen:.1f}x "
          f"(np.linalg.solve={times['np.linalg.solve']:.2f} ms, blocked={chosen:.2f} ms)")


# ----------------------------------------------------------------------------- stages


def stage_profile(args, repeat: int = 5) -> str:
    """Where chunk_kda's time goes: each stage timed on its own with perf_counter (best of 5)."""
    q, k, v, g, beta = (x[None] for x in args)
    scale, decaying = K**-0.5, bool(g.max() <= 0)
    G = kda._chunk_cumsum(g, CHUNK)

    def prepare_all():
        for c0, c1 in kda._slabs(T // CHUNK, H):
            kda._prepare_slab(q, k, v, G, beta, c0, c1, CHUNK, scale, decaying, need_output=True)

    cumsum = best_ms(lambda: kda._chunk_cumsum(g, CHUNK), repeat)
    prepare = best_ms(prepare_all, repeat)
    total = best_ms(lambda: kda.chunk_kda(*args), repeat)
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
        ref_ms = best_ms(lambda: naive.naive_chunk_kda(*tensors, output_final_state=True, chunk_size=CHUNK), 2)
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
        args = inputs(gate)
        kda.chunk_kda(*args)  # warm up
        rec, chk = [], []
        for _ in range(3):  # interleave so both see the same machine load
            rec.append(best_ms(lambda: kda.recurrent_kda(*args), 1))
            chk.append(best_ms(lambda: kda.chunk_kda(*args, chunk_size=CHUNK), 3))
        rec_ms, chunk_ms = min(rec), min(chk)
        G = kda._chunk_cumsum(args[3][None], CHUNK)
        blocks = [int(kda._block_sizes(kda._slab(G, c0, c1, CHUNK), CHUNK, decaying=True).min())
                  for c0, c1 in kda._slabs(T // CHUNK, H)]
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
