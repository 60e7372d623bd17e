"""Part B's variants: a factorial of prefix policy x router on the hybrid, and the transformer beside it.

* prefix policy: ``none`` (no prefix reuse at all: every block of every request gets an id
  nobody else uses), ``ends`` (a state at each request's end, LRU), ``dual`` (ends + branch
  points + FLOP-aware eviction), and ``kv-only``: the hybrid as if its states were free,
  every cached KV token usable -- the impossible reference no hybrid can reach;
* router: ``least-work`` (token-weighted load), ``prefix-affinity`` (SGLang's cache-aware
  rule) and ``state-aware`` (that rule scored in prefill seconds saved by usable hits).

The strong baseline is ``ends`` + ``prefix-affinity``: request-end states and the cache-aware
router SGLang ships. Beside the twelve hybrid variants stands the all-MLA transformer of the
same size (``all_mla_27``: Kimi-Linear-48B with every layer MLA) on the same trace, fleet and
HBM, its KV in bf16 and in fp8, served tensor-parallel like the hybrid and DP-attention with
expert parallelism on the same four devices (how MLA models are usually served): a
transformer's prefix cache needs no state, so it runs the ``kv-only`` policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig, all_mla_27, preset

__all__ = ["Variant", "POLICIES_B", "ROUTERS_B", "BASELINE", "VARIANTS", "VARIANT_NAMES", "variant", "model_of"]

POLICIES_B = ("none", "ends", "dual", "kv-only")
ROUTERS_B = ("least-work", "prefix-affinity", "state-aware")
FP8 = "all_mla_27_fp8kv"


@dataclass(frozen=True)
class Variant:
    """One cell of Part B: a model, a prefix policy (``none``: no reuse), a router, a deployment."""

    name: str
    model: str
    policy: str
    router: str
    deployment: str
    family: str  # "hybrid" or "transformer"


def model_of(name: str) -> ModelConfig:
    """A model by name: the presets, plus all-MLA with its KV in fp8 (one byte per element)."""
    if name == FP8:
        return all_mla_27.with_(name=FP8, kv_bytes=1, notes="all-MLA with fp8 KV (one byte per cached element)")
    return preset(name)


def _name(policy: str, router: str) -> str:
    return f"{policy} + {router}"


BASELINE = _name("ends", "prefix-affinity")
_HYBRID = tuple(Variant(_name(p, r), "kimi_linear_48b", p, r, "vllm-tp4-h200", "hybrid")
                for p in POLICIES_B for r in ROUTERS_B)
_TRANSFORMER = tuple(
    Variant(f"all-MLA {kv} {split}", model, "kv-only", "prefix-affinity", dep, "transformer")
    for split, dep in (("TP4", "vllm-tp4-h200"), ("DP4-EP4", "dp4-ep4-h200"))
    for kv, model in (("bf16", "all_mla_27"), ("fp8", FP8)))
VARIANTS = _HYBRID + _TRANSFORMER
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"variant={name!r}: expected one of {list(VARIANT_NAMES)}")
