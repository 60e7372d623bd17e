"""Parity of kimilab.kda with flash-linear-attention's pure-PyTorch KDA reference.

The reference (PyPI ``fla-core`` 0.6.0) lives in ``fla/ops/kda/naive.py``
(``naive_recurrent_kda``, ``naive_chunk_kda``) and ``fla/ops/kda/gate.py``
(``naive_kda_gate``, ``naive_kda_lowerbound_gate``). It computes in float32, so
the bound is a relative error of 1e-5. Run with ``make parity`` (needs the
``parity`` extra: a CPU build of torch + fla-core); without it every test here
skips with the reason.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os

import numpy as np
import pytest

from kimilab import kda
from kimilab.kda.testing import random_inputs

pytestmark = pytest.mark.parity

torch = pytest.importorskip("torch", reason="parity extra not installed: needs torch (CPU build) and fla-core")
pytest.importorskip("einops", reason="parity extra not installed: fla's naive KDA needs einops")
_FLA_SPEC = importlib.util.find_spec("fla")
if _FLA_SPEC is None or not _FLA_SPEC.submodule_search_locations:
    pytest.skip("parity extra not installed: needs fla-core (pip install 'kimilab[parity]')", allow_module_level=True)
_FLA_DIR = list(_FLA_SPEC.submodule_search_locations)[0]


def _load_naive_module():
    """fla/ops/kda/naive.py imports only torch and einops, so load it by file path.

    ``import fla.ops`` would pull in triton (not available on a CPU machine).
    """
    path = os.path.join(_FLA_DIR, "ops", "kda", "naive.py")
    spec = importlib.util.spec_from_file_location("fla_kda_naive_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_naive_gates():
    """Pull only the two pure-torch gate functions out of fla/ops/kda/gate.py.

    That file imports triton (and triton kernels) at module level, so it cannot be
    imported here. Its naive functions use nothing but ``torch`` and
    ``torch.nn.functional as F``; we parse the file with ``ast``, keep just those
    two function definitions, and exec them in a namespace holding torch and F.
    The reference's own code runs unchanged; nothing is copied into this repo.
    """
    path = os.path.join(_FLA_DIR, "ops", "kda", "gate.py")
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    keep = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    missing = wanted - {node.name for node in keep}
    if missing:
        pytest.fail(f"{path} no longer defines {sorted(missing)}")
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), namespace)
    return namespace["naive_kda_gate"], namespace["naive_kda_lowerbound_gate"]


naive = _load_naive_module()
naive_kda_gate, naive_kda_lowerbound_gate = _load_naive_gates()

RTOL = 1e-5


def rel_err(ours: np.ndarray, ref) -> float:
    ref = ref.detach().cpu().numpy().astype(np.float64) if hasattr(ref, "detach") else np.asarray(ref, np.float64)
    ours = np.asarray(ours, np.float64)
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def fla_inputs(seed, B, T, H, K, V, gate="logsigmoid"):
    """float32 inputs in fla's [B, T, H, ...] layout from the shared generator; S0 halved."""
    (q, k, v, g, beta), S0 = random_inputs(T, H, K, V, seed=seed, gate=gate, dtype=np.float32, batch=B)
    return q, k, v, g, beta, np.float32(0.5) * S0


def torchify(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


CASES = [
    # seed, B, T, H, K, V, gate, with_state
    (0, 1, 64, 2, 16, 16, "logsigmoid", False),
    (1, 2, 128, 3, 32, 16, "logsigmoid", True),
    (2, 1, 100, 2, 16, 8, "kimi-init", True),  # ragged: 100 = 64 + 36
    (3, 1, 37, 1, 8, 24, "logsigmoid", True),  # shorter than one chunk
    (4, 2, 192, 2, 64, 64, "kimi-init", False),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[2]}-H{c[3]}-K{c[4]}-V{c[5]}-{c[6]}-S0{int(c[7])}")
def test_recurrent_and_chunk_match_naive_recurrent(case, dtype):
    seed, B, T, H, K, V, gate, with_state = case
    q, k, v, g, beta, S0 = fla_inputs(seed, B, T, H, K, V, gate)
    init = S0 if with_state else None
    o_ref, s_ref = naive.naive_recurrent_kda(
        *torchify(q, k, v, g, beta), initial_state=torchify(S0)[0] if with_state else None, output_final_state=True
    )
    cast = [x.astype(dtype) for x in (q, k, v, g, beta)]
    init_cast = None if init is None else init.astype(dtype)
    for fn in (kda.recurrent_kda, kda.chunk_kda):
        o, s = fn(*cast, initial_state=init_cast)
        assert o.dtype == dtype
        assert rel_err(o, o_ref) <= RTOL, fn.__name__
        assert rel_err(s, s_ref) <= RTOL, fn.__name__


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("case", [c for c in CASES if c[2] % 64 == 0], ids=lambda c: f"T{c[2]}-H{c[3]}-K{c[4]}")
def test_chunk_matches_naive_chunk(case, chunk):
    """fla's naive_chunk_kda needs T % chunk == 0; ragged lengths are covered above."""
    seed, B, T, H, K, V, gate, with_state = case
    q, k, v, g, beta, S0 = fla_inputs(seed, B, T, H, K, V, gate)
    o_ref, s_ref = naive.naive_chunk_kda(
        *torchify(q, k, v, g, beta),
        initial_state=torchify(S0)[0] if with_state else None,
        output_final_state=True,
        chunk_size=chunk,
    )
    o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=S0 if with_state else None, chunk_size=chunk)
    assert rel_err(o, o_ref) <= RTOL
    assert rel_err(s, s_ref) <= RTOL


def test_unbatched_layout_equals_batch_of_one():
    q, k, v, g, beta, S0 = fla_inputs(9, 1, 80, 2, 16, 16)
    o_ref, s_ref = naive.naive_recurrent_kda(*torchify(q, k, v, g, beta), initial_state=torchify(S0)[0],
                                             output_final_state=True)
    o, s = kda.chunk_kda(q[0], k[0], v[0], g[0], beta[0], initial_state=S0[0])
    assert rel_err(o, o_ref[0]) <= RTOL and rel_err(s, s_ref[0]) <= RTOL


@pytest.mark.parametrize("with_bias", [True, False])
def test_softplus_gate_matches_naive_kda_gate(with_bias):
    rng = np.random.default_rng(5)
    H, K = 4, 16
    raw = (rng.standard_normal((2, 7, H, K)) * 5).astype(np.float32)  # includes softplus' linear regime
    A_log = rng.standard_normal(H).astype(np.float32)
    dt_bias = rng.standard_normal(H * K).astype(np.float32) if with_bias else None
    ref = naive_kda_gate(torch.from_numpy(raw), torch.from_numpy(A_log), None if dt_bias is None else torch.from_numpy(dt_bias))
    for dtype in (np.float32, np.float64):
        ours = kda.kda_gate(raw.astype(dtype), A_log, dt_bias)
        assert rel_err(ours, ref) <= RTOL


@pytest.mark.parametrize("lower_bound", [-5.0, -1.0])
@pytest.mark.parametrize("with_A", [True, False])
def test_lowerbound_gate_matches_naive(lower_bound, with_A):
    rng = np.random.default_rng(6)
    H, K = 3, 8
    raw = (rng.standard_normal((5, H, K)) * 3).astype(np.float32)
    A_log = rng.standard_normal(H).astype(np.float32) if with_A else None
    dt_bias = rng.standard_normal(H * K).astype(np.float32)
    ref = naive_kda_lowerbound_gate(
        torch.from_numpy(raw), None if A_log is None else torch.from_numpy(A_log), torch.from_numpy(dt_bias), lower_bound
    )
    ours = kda.kda_gate_lowerbound(raw, A_log, dt_bias, lower_bound)
    assert rel_err(ours, ref) <= RTOL


def test_gated_pipeline_end_to_end():
    """Gate from raw projections, then the kernel: both sides from the same raw numbers."""
    rng = np.random.default_rng(8)
    B, T, H, K, V = 1, 96, 2, 16, 16
    raw = (rng.standard_normal((B, T, H, K)) * 0.5).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = np.log(np.expm1(np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), H * K)))).astype(np.float32)
    q, k, v, _, beta, _ = fla_inputs(8, B, T, H, K, V)
    g_ref = naive_kda_gate(torch.from_numpy(raw), torch.from_numpy(A_log), torch.from_numpy(dt_bias))
    o_ref, s_ref = naive.naive_recurrent_kda(*torchify(q, k, v), g_ref, torchify(beta)[0], output_final_state=True)
    g = kda.kda_gate(raw, A_log, dt_bias)
    o, s = kda.chunk_kda(q, k, v, g, beta)
    assert rel_err(o, o_ref) <= RTOL and rel_err(s, s_ref) <= RTOL
