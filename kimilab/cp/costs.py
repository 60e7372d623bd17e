"""What each way of passing KDA state costs, and what P ranks would buy on a GPU cluster.

Counted, not measured: bytes each rank sends, messages, and critical-path steps (the
longest chain of messages one rank must wait for) for the three schemes of
:data:`~kimilab.cp.kda_cp.SCHEMES`; ring attention's bytes for contrast. The GPU
prediction is a roofline-style model on ASSUMED hardware (``kimilab.costs.hardware``
device, an assumed link); nothing here ran on a GPU.
"""

from __future__ import annotations

import math

from kimilab.costs.hardware import H800_CLASS, Accelerator
from kimilab.kda import chunk_kda_flops
from kimilab.validate import check_int

__all__ = ["scheme_costs", "ring_attention_bytes", "predicted_speedup", "LINK_BYTES_PER_S", "LINK_LATENCY_S",
           "KERNEL_EFFICIENCY"]

LINK_BYTES_PER_S = 450e9 / 2  # ASSUMED: one direction of an NVLink-class link
LINK_LATENCY_S = 10e-6  # ASSUMED: one message's fixed cost between devices
KERNEL_EFFICIENCY = 0.3  # ASSUMED: share of peak FLOP/s a chunked KDA kernel reaches


def scheme_costs(P: int, H: int, K: int, V: int, itemsize: int = 4) -> dict[str, dict[str, int]]:
    """Per scheme: bytes the busiest rank sends, its messages, and critical-path steps.

    A state is H K V values, a transition (M, C) H K (K + V). sequential: one state per
    rank, P - 1 steps in a chain. allgather (recursive doubling): the P - 1 other ranks'
    transitions arrive in ceil(log2 P) steps. tree: ceil(log2 P) rounds of one transition,
    then one state shifted to the next rank.
    """
    P, H, K, V = (check_int(n, x, 1) for n, x in (("P", P), ("H", H), ("K", K), ("V", V)))
    state, trans = H * K * V * itemsize, H * K * (K + V) * itemsize
    lg = math.ceil(math.log2(P)) if P > 1 else 0
    if P == 1:
        return {s: {"bytes": 0, "messages": 0, "steps": 0} for s in ("sequential", "allgather", "tree")}
    return {
        "sequential": {"bytes": state, "messages": 1, "steps": P - 1},
        "allgather": {"bytes": (P - 1) * trans, "messages": lg, "steps": lg},
        "tree": {"bytes": lg * trans + state, "messages": lg + 1, "steps": lg + 1},
    }


def ring_attention_bytes(T: int, P: int, kv_bytes_per_token: int) -> int:
    """Bytes one rank sends in ring attention: its KV block (T / P tokens) for P - 1 steps."""
    T, P = check_int("T", T, 1), check_int("P", P, 1)
    return math.ceil(T / P) * (P - 1) * int(kv_bytes_per_token)


def predicted_speedup(P: int, T: int, H: int, K: int, V: int, *, affine_cost: float = 1.25,
                      device: Accelerator = H800_CLASS, itemsize: int = 2) -> float:
    """One device's KDA prefill time over P devices' (balanced slices, all-gather), on assumed hardware.

    Rank 0 runs the plain pass, the others the affine pass at ``affine_cost`` times the
    work per token; slices are balanced so all finish together; then one all-gather.
    """
    P = check_int("P", P, 1)
    rate = device.peak_flops * KERNEL_EFFICIENCY
    one = chunk_kda_flops(T, H, K, V) / rate
    share = T / (1 + (P - 1) / affine_cost)  # rank 0's tokens when w0 = affine_cost * w_r
    compute = chunk_kda_flops(max(1, round(share)), H, K, V) / rate
    c = scheme_costs(P, H, K, V, itemsize)["allgather"]
    comm = c["steps"] * LINK_LATENCY_S + c["bytes"] / LINK_BYTES_PER_S
    return one / (compute + comm)
