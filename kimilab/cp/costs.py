"""What each way of passing KDA state costs, and what P ranks would buy on a GPU cluster.

Counted, not measured: bytes each rank sends, messages, and critical-path steps (the
longest chain of messages one rank must wait for) for the schemes of
:data:`~kimilab.cp.kda_cp.SCHEMES`; ring attention's bytes for contrast (a test holds the
counts against the bytes MPI actually carried). The GPU prediction for one KDA layer
takes its device, link and KDA kernel efficiency from a :class:`~kimilab.costs.Deployment`
(the calibrated one, chapter 3) and names its regime (:func:`kda_layer_verdict`); nothing
here ran on a GPU. The whole model's CP time is :mod:`~kimilab.cp.model_costs`'.
"""

from __future__ import annotations

import math

from kimilab.costs import Deployment
from kimilab.kda import chunk_kda_flops
from kimilab.validate import check_int

__all__ = ["scheme_costs", "ring_attention_bytes", "predicted_speedup", "kda_layer_verdict", "cp_link"]

_SCHEMES = ("sequential", "allgather", "tree", "needed", "relay")


def scheme_costs(P: int, H: int, K: int, V: int, itemsize: int = 4, *, flushed: bool = False) -> dict[str, dict[str, int]]:
    """Per scheme: payload bytes the busiest rank sends, its messages, and critical-path steps.

    A state is H K V values, a transition (M, C) H K (K + V). sequential and relay: one
    state per rank, P - 1 steps in a chain (the relay also computes in that chain).
    allgather (recursive doubling): the P - 1 other ranks' transitions arrive in
    ceil(log2 P) steps. tree: ceil(log2 P) rounds of one transition, then one state
    shifted to the next rank. needed: a one-flag all-gather, then each rank sends its C
    (and M, if alive) to every later rank up to the first whose M has flushed: with every
    M alive (``flushed=False``) rank 0 sends P - 1 states and rank 1 P - 2 transitions;
    once every M has flushed (``flushed=True``) each rank sends one state, to its neighbour.
    """
    P, H, K, V = (check_int(n, x, 1) for n, x in (("P", P), ("H", H), ("K", K), ("V", V)))
    state, trans = H * K * V * itemsize, H * K * (K + V) * itemsize
    lg = math.ceil(math.log2(P)) if P > 1 else 0
    if P == 1:
        return {s: {"bytes": 0, "messages": 0, "steps": 0} for s in _SCHEMES}
    flags = 8 * (P - 1)  # one flag to each other rank
    needed = ({"bytes": flags + state, "messages": lg + 1, "steps": lg + 1} if flushed else
              {"bytes": flags + max((P - 1) * state, (P - 2) * trans), "messages": lg + P - 1, "steps": lg + 1})
    return {
        "sequential": {"bytes": state, "messages": 1, "steps": P - 1},
        "allgather": {"bytes": (P - 1) * trans, "messages": lg, "steps": lg},
        "tree": {"bytes": lg * trans + state, "messages": lg + 1, "steps": lg + 1},
        "needed": needed,
        "relay": {"bytes": state, "messages": 1, "steps": P - 1},
    }


def ring_attention_bytes(T: int, P: int, kv_bytes_per_token: int) -> int:
    """Bytes one rank sends in ring attention: its KV block (T / P tokens) for P - 1 steps."""
    T, P = check_int("T", T, 1), check_int("P", P, 1)
    return math.ceil(T / P) * (P - 1) * int(kv_bytes_per_token)


def cp_link(deployment: Deployment, P: int):
    """The link P context-parallel devices of ``deployment`` talk over: NVLink-class within a
    node, the inter-node link once P passes ``devices_per_node``."""
    P = check_int("P", P, 1)
    return deployment.intra_link if P <= deployment.devices_per_node else deployment.inter_link


def predicted_speedup(P: int, T: int, H: int, K: int, V: int, *, deployment: Deployment,
                      affine_cost: float = 1.25, itemsize: int = 4) -> float:
    """One device's KDA prefill time over P devices' (balanced slices, all-gather), for devices, link
    and KDA kernel efficiency as in ``deployment`` (the link between nodes once P passes a node).

    Rank 0 runs the plain pass, the others the affine pass at ``affine_cost`` times the
    work per token; slices are balanced so all finish together; then one all-gather of
    (M, C) in ``itemsize`` bytes (fp32 by default: flash-linear-attention keeps the chain in fp32).
    """
    P = check_int("P", P, 1)
    if not 1.0 <= affine_cost < float("inf"):
        raise ValueError(f"affine_cost={affine_cost!r}: expected a finite number >= 1 (the affine pass does "
                         "at least the plain pass's work)")
    rate = deployment.device.peak_flops * deployment.kernels.kda
    link = cp_link(deployment, P)
    one = chunk_kda_flops(T, H, K, V) / rate
    share = T / (1 + (P - 1) / affine_cost)  # rank 0's tokens when w0 = affine_cost * w_r
    compute = chunk_kda_flops(max(1, round(share)), H, K, V) / rate
    c = scheme_costs(P, H, K, V, itemsize)["allgather"]
    comm = c["steps"] * link.latency + c["bytes"] / link.bandwidth if P > 1 else 0.0
    return one / (compute + comm)


def kda_layer_verdict(P: int, T: int, H: int, K: int, V: int, *, deployment: Deployment,
                      affine_cost: float = 1.25) -> dict:
    """:func:`predicted_speedup` with its regime named: scope, deployment, link, P, T, the affine
    cost assumed, the speedup and the device efficiency (speedup / P)."""
    speedup = predicted_speedup(P, T, H, K, V, deployment=deployment, affine_cost=affine_cost)
    return {"scope": f"one KDA layer ({H} heads, K = {K}, V = {V})", "deployment": deployment.name,
            "device": deployment.device.name, "link": cp_link(deployment, P).name, "P": P, "T": T,
            "affine_cost": affine_cost, "speedup": speedup, "efficiency": speedup / P}
