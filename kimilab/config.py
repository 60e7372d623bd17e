"""Model configurations: the shapes every other module reads.

A config is plain data. It says which layers are KDA ("K") and which keep
global attention ("A"), and the sizes of every cache a request will hold.
Real-model presets (``kimi_linear_48b`` and its baselines) are *shapes only*:
they feed the analytic memory model, never a weight matrix, and carry their
parameter counts as a :class:`WeightModel` (``cfg.weights``), so a renamed or
edited copy keeps them. ``tiny`` is the reduced model the book actually runs on
a CPU.

Sources for the 48B shapes: the public ``config.json`` of
moonshotai/Kimi-Linear-48B-A3B-Instruct on Hugging Face and the Kimi Linear
tech report (arXiv:2510.26692); see ``chapters/references.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kimilab.validate import check_int

__all__ = ["CACHE_KINDS", "PAGE_KINDS", "WeightModel", "ModelConfig", "PRESETS", "preset", "tiny", "kimi_linear_48b",
           "all_mla_27", "gqa_8b", "qwen3_next_80b"]

# The kinds of memory, named once for the whole package. A request holds the three
# CACHE_KINDS; a pool page can also hold a prefix cache's state checkpoint or
# speculative-decoding scratch.
CACHE_KINDS = ("kv", "kda_state", "conv_state")
PAGE_KINDS = CACHE_KINDS + ("checkpoint", "scratch")

_ATTN_KINDS = ("mha", "gqa", "mla")
_GATES = ("softplus", "lowerbound")
_DTYPES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_RUNNABLE_DTYPES = ("float64", "float32")  # numpy has no bfloat16: only shapes-only configs may say it


@dataclass(frozen=True)
class WeightModel:
    """Parameter counts that decide how many weight bytes a model holds and a step reads.

    A mixture-of-experts model activates ``active_params`` per token; its routed experts
    (``n_routed_experts``, ``routed_top_k`` per token) hold the rest. With B tokens in a
    step, each routed expert is touched with probability 1 - (1 - k/E)^B (uniform routing,
    an assumption), so the bytes read grow from the active count at B = 1 towards all
    parameters at large B. Dense models (E = 0) read everything every step.
    """

    total_params: float
    active_params: float
    n_routed_experts: int = 0
    routed_top_k: int = 0
    bytes_per_param: int = 2
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.active_params <= self.total_params:
            raise ValueError(f"WeightModel.active_params={self.active_params!r}: expected 0 < active <= total")
        if self.n_routed_experts and not 0 < self.routed_top_k < self.n_routed_experts:
            raise ValueError(f"WeightModel.routed_top_k={self.routed_top_k!r}: expected 0 < k < n_routed_experts")
        if self.bytes_per_param not in (1, 2, 4, 8):
            raise ValueError(f"WeightModel.bytes_per_param={self.bytes_per_param!r}: expected 1, 2, 4 or 8")

    @property
    def routed_params(self) -> float:
        """Parameters inside routed experts, from total = dense + R, active = dense + R k/E."""
        if not self.n_routed_experts:
            return 0.0
        frac = self.routed_top_k / self.n_routed_experts
        return (self.total_params - self.active_params) / (1.0 - frac)

    @property
    def dense_params(self) -> float:
        return self.total_params - self.routed_params

    def params_read(self, batch: int) -> float:
        """Expected distinct parameters one decode step over ``batch`` tokens touches."""
        batch = check_int("batch", batch, 1)
        if not self.n_routed_experts:
            return self.total_params
        miss = (1.0 - self.routed_top_k / self.n_routed_experts) ** batch
        return self.dense_params + self.routed_params * (1.0 - miss)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a hybrid model. ``layer_pattern`` has one letter per layer.

    ``K`` = Kimi Delta Attention layer (fixed-size recurrent state + conv state),
    ``A`` = global softmax attention layer (KV cache that grows with the context).
    Byte widths (``kv_bytes``, ``state_bytes``, ``conv_bytes``) are what a
    serving engine stores; for the runnable ``tiny`` model they equal the
    compute dtype's width so measured and analytic bytes agree.
    """

    name: str
    layer_pattern: str
    d_model: int
    n_heads: int  # KDA heads
    head_dim: int  # KDA key dim K = value dim V
    vocab_size: int
    mlp_hidden: int
    attn_kind: str = "mha"  # global layers: "mha", "gqa" or "mla"
    attn_heads: int = 0  # query heads of a global layer (0 -> n_heads)
    attn_kv_heads: int = 0  # KV heads of a global layer (0 -> attn_heads)
    attn_head_dim: int = 0  # head dim of a global layer (0 -> head_dim)
    kv_lora_rank: int = 0  # MLA latent width (attn_kind == "mla")
    # MLA's decoupled key part, cached beside the latent (the public config's own name). In
    # DeepSeek-style MLA these dims carry RoPE; Kimi Linear sets ``mla_use_nope: true``, so
    # they are NOT rotated -- but they are still computed, cached and enter the scores.
    qk_rope_head_dim: int = 0
    conv_kernel: int = 4
    gate: str = "softplus"  # KDA forget gate: "softplus" or "lowerbound"
    gate_lower_bound: float = -5.0  # used when gate == "lowerbound"; in [-5, 0)
    chunk_size: int = 64  # chunked-KDA chunk length for prefill
    # Element type: the compute dtype of a runnable model ("float64"/"float32"), or the
    # served weight dtype of a shapes-only preset (e.g. "bfloat16").
    dtype: str = "float64"
    kv_bytes: int = 8  # bytes per stored KV element
    state_bytes: int = 8  # bytes per stored KDA state element
    conv_bytes: int = 8  # bytes per stored conv-state element
    shapes_only: bool = False  # True for real-model presets (no weights can be built)
    weights: WeightModel | None = None  # parameter counts; required for shapes-only cost models
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        def bad(fieldname: str, expected: str) -> None:
            raise ValueError(
                f"ModelConfig.{fieldname}={getattr(self, fieldname)!r}: expected {expected}"
            )

        if not self.layer_pattern or set(self.layer_pattern) - {"K", "A"}:
            bad("layer_pattern", "a non-empty string of 'K' (KDA) and 'A' (global attention)")
        for name in ("d_model", "n_heads", "head_dim", "vocab_size", "mlp_hidden", "chunk_size", "conv_kernel"):
            check_int(f"ModelConfig.{name}", getattr(self, name), 1)
        for name in ("attn_heads", "attn_kv_heads", "attn_head_dim", "kv_lora_rank", "qk_rope_head_dim"):
            check_int(f"ModelConfig.{name}", getattr(self, name), 0, unit="0 means 'same as the KDA value'")
        if self.attn_kind not in _ATTN_KINDS:
            bad("attn_kind", f"one of {_ATTN_KINDS}")
        if self.gate not in _GATES:
            bad("gate", f"one of {_GATES}")
        if not -5.0 <= self.gate_lower_bound < 0.0:
            bad("gate_lower_bound", "a float in [-5, 0)")
        if self.dtype not in (_DTYPES if self.shapes_only else _RUNNABLE_DTYPES):
            bad("dtype", f"one of {_RUNNABLE_DTYPES} (a runnable model computes in numpy)"
                if not self.shapes_only else f"one of {tuple(_DTYPES)}")
        if self.weights is not None and not isinstance(self.weights, WeightModel):
            bad("weights", "a kimilab.config.WeightModel or None")
        for name in ("kv_bytes", "state_bytes", "conv_bytes"):
            if getattr(self, name) not in (1, 2, 4, 8):
                bad(name, "1, 2, 4 or 8 bytes per element")
        if self.attn_kind == "mla" and self.kv_lora_rank <= 0:
            bad("kv_lora_rank", "a positive latent width when attn_kind == 'mla'")
        if self.attn_kind != "mla" and self.attn_heads_eff % self.attn_kv_heads_eff:
            bad("attn_kv_heads", f"a divisor of attn_heads ({self.attn_heads_eff})")
        if self.attn_kind == "mha" and self.attn_kv_heads_eff != self.attn_heads_eff:
            bad("attn_kv_heads", "equal to attn_heads for 'mha' (use attn_kind='gqa')")

    # ----- derived shapes -------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based indices of the KDA layers."""
        return tuple(i for i, c in enumerate(self.layer_pattern) if c == "K")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """0-based indices of the global-attention layers."""
        return tuple(i for i, c in enumerate(self.layer_pattern) if c == "A")

    @property
    def attn_heads_eff(self) -> int:
        return self.attn_heads or self.n_heads

    @property
    def attn_kv_heads_eff(self) -> int:
        return self.attn_kv_heads or self.attn_heads_eff

    @property
    def attn_head_dim_eff(self) -> int:
        return self.attn_head_dim or self.head_dim

    @property
    def kv_elems_per_token_layer(self) -> int:
        """Elements one global layer stores per token (K and V, or MLA latent + decoupled key part)."""
        if self.attn_kind == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.attn_kv_heads_eff * self.attn_head_dim_eff

    @property
    def kda_state_elems_layer(self) -> int:
        """Elements of one KDA layer's recurrent state: H x K x V."""
        return self.n_heads * self.head_dim * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of a KDA layer's short convolution (q, k and v, each H*K wide)."""
        return 3 * self.n_heads * self.head_dim

    @property
    def conv_state_elems_layer(self) -> int:
        """Elements of one KDA layer's conv state: the last (kernel - 1) inputs."""
        return (self.conv_kernel - 1) * self.conv_channels

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype`` (compute width, or served weight width if shapes only)."""
        return _DTYPES[self.dtype]

    def with_(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _pattern_from_attn_layers(n_layers: int, attn_1based: tuple[int, ...]) -> str:
    return "".join("A" if (i + 1) in attn_1based else "K" for i in range(n_layers))


# The reduced model the book runs: 8 layers, 3 KDA : 1 global, float64.
tiny = ModelConfig(
    name="tiny",
    layer_pattern="KKKA" * 2,
    d_model=128,
    n_heads=4,
    head_dim=32,
    vocab_size=260,
    mlp_hidden=256,
    attn_kind="mha",
    attn_heads=4,
    attn_kv_heads=4,
    attn_head_dim=32,
    notes="runnable reduced model: seeded random weights, untrained",
)

# Kimi-Linear-48B-A3B: ~48B total, ~3B activated (tech report, abstract); 256 routed experts,
# 8 per token (public config: num_experts, num_experts_per_token); bf16 weights.
KIMI_LINEAR_48B_WEIGHTS = WeightModel(
    48e9, 3e9, n_routed_experts=256, routed_top_k=8, bytes_per_param=2,
    source="Kimi-Linear-48B-A3B: ~48B total, ~3B activated (tech report, abstract); 8 of 256 "
           "routed experts per token (public config); bf16",
)

# Kimi-Linear-48B-A3B shapes (public config.json): MLA at 1-based layers 4, 8, 12, 16, 20,
# 24, 27 (20 KDA : 7 MLA); MLA caches kv_lora_rank 512 + qk_rope_head_dim 64 per token
# (with mla_use_nope: true the 64 dims are an unrotated decoupled key part); bf16 KV and conv
# state; fp32 KDA state (vLLM's choice for KDA: MambaStateDtypeCalculator.kda_state_dtype).
kimi_linear_48b = ModelConfig(
    name="kimi_linear_48b",
    layer_pattern=_pattern_from_attn_layers(27, (4, 8, 12, 16, 20, 24, 27)),
    d_model=2304,
    n_heads=32,
    head_dim=128,
    vocab_size=163840,
    mlp_hidden=1024,
    attn_kind="mla",
    attn_heads=32,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    dtype="bfloat16",
    kv_bytes=2,
    state_bytes=4,
    conv_bytes=2,
    shapes_only=True,
    weights=KIMI_LINEAR_48B_WEIGHTS,
    notes="shapes only; MoE MLP modelled by its parameter counts (weights), not its shapes",
)

# The same 27 layers, all MLA: the full-attention baseline of the tech report. Its weights
# are assumed equal to the hybrid's (the report compares models of similar size).
all_mla_27 = kimi_linear_48b.with_(
    name="all_mla_27", layer_pattern="A" * 27, notes="shapes only; all-MLA baseline (weights assumed equal)"
)

# A GQA model for contrast (Llama-3-8B-like shapes: 32 layers, 8 KV heads of 128, bf16).
gqa_8b = ModelConfig(
    name="gqa_8b",
    layer_pattern="A" * 32,
    d_model=4096,
    n_heads=32,
    head_dim=128,
    vocab_size=128256,
    mlp_hidden=14336,
    attn_kind="gqa",
    attn_heads=32,
    attn_kv_heads=8,
    attn_head_dim=128,
    dtype="bfloat16",
    kv_bytes=2,
    state_bytes=4,
    conv_bytes=2,
    shapes_only=True,
    weights=WeightModel(8.03e9, 8.03e9, bytes_per_param=2, source="Llama-3-8B-like dense, bf16"),
    notes="shapes only; GQA contrast",
)

# Qwen3-Next-80B-A3B: the closest public peer with published serving measurements (chapter 3
# calibrates against them). 48 layers, every 4th full (gated GQA) attention: 16 query heads,
# 2 KV heads of 256; 36 Gated DeltaNet layers whose state is 32 value heads of 128 x 128
# (modelled as KDA-shaped: the same state bytes); 512 routed experts, 10 per token, plus one
# shared expert. Parameter counts as published for the same architecture (Qwen3-Coder-Next:
# 79,674,391,296 total, 3,874,929,408 active); bf16 weights, fp32 state (mamba_ssm_dtype).
qwen3_next_80b = ModelConfig(
    name="qwen3_next_80b",
    layer_pattern="KKKA" * 12,
    d_model=2048,
    n_heads=32,
    head_dim=128,
    vocab_size=151936,
    mlp_hidden=512,
    attn_kind="gqa",
    attn_heads=16,
    attn_kv_heads=2,
    attn_head_dim=256,
    dtype="bfloat16",
    kv_bytes=2,
    state_bytes=4,
    conv_bytes=2,
    shapes_only=True,
    weights=WeightModel(79.674e9, 3.875e9, n_routed_experts=512, routed_top_k=10, bytes_per_param=2,
                        source="Qwen3-Next-80B-A3B architecture: 79.7B total, 3.9B active; 10 of 512 routed "
                               "experts per token; bf16"),
    notes="shapes only; a peer for calibration (Gated DeltaNet modelled with KDA's state shape)",
)

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (tiny, kimi_linear_48b, all_mla_27, gqa_8b, qwen3_next_80b)
}


def preset(name: str) -> ModelConfig:
    """Look a preset up by name; the error lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset name={name!r}: expected one of {sorted(PRESETS)}") from None
