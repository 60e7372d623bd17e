"""vLLM's hybrid page layout for a KDA + attention model, derived from per-layer bytes.

vLLM keeps ONE pool whose pages all have the same size, and makes that work for a
hybrid model in two steps (sources in ``chapters/references.md#vllm``):

1. **Page equality, per layer** (``HybridAttentionMambaModelConfig.verify_and_update_config``
   in ``vllm/model_executor/models/config.py``; later versions moved it to the platform
   layer): the attention block size is raised to the smallest multiple of the kernel
   alignment (16 tokens there) whose page -- block tokens x one layer's KV bytes per
   token -- holds one KDA layer's state (recurrent state + conv state); the state page is
   then padded up to that size.
2. **Layer groups** (``_get_kv_cache_groups_uniform_page_size`` in
   ``vllm/v1/core/kv_cache_utils.py``): layers are grouped by type into groups of equal
   size -- the layer count of the smallest type, or of the largest when it is under 1.5x
   the smallest -- padding the last group of a type. A block id names one page in every
   layer of one group, so every block costs group_size pages.

For Kimi-Linear-48B (1,152 B of MLA latent per token and layer, 2,170,880 B of fp32 state
+ bf16 conv state per KDA layer) that gives 1,888-token blocks and groups of 7: one MLA
group and 20 KDA layers in 3 groups (one layer padded). A request's state then takes one
block in each KDA group -- 3 blocks, the price of 3 KV blocks -- where a whole-model
checkpoint measured in 512-token KV blocks of all 7 MLA layers is 10.5 blocks.

Sizes are per device of a :class:`~kimilab.costs.deployment.Deployment`. Under tensor
parallelism vLLM divides the KDA heads (and conv channels) by the TP size but keeps MLA's
single latent head whole, so the block shrinks with TP: ~1,888 tokens at TP1 or under
DP-attention, 480 at TP4, 240 at TP8.

The alignment is version- and backend-dependent: the commit cited aligns every backend to
16 tokens (1,888 for Kimi-Linear-48B). Later versions (vLLM PR #24486, e.g. commit
``1936cf3841edb9781b06c50fc4daf4bac9d3b23e`` of the same file) align MLA models to 64
tokens (128 for the CUTLASS MLA backend), and with prefix caching round up to the state
kernel's chunk size; for this model each of those gives 1,920-token blocks
(``align_tokens=64``). Everything else here is unchanged by it.

The page pool (:class:`kimilab.pool.VllmPaddedPages`) takes its layout from here: call
:func:`vllm_pages_of` with a :class:`~kimilab.costs.CacheShapes` (already per device).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.cache_bytes import CacheShapes
from kimilab.costs.deployment import Deployment
from kimilab.validate import check_int

__all__ = ["VllmHybridPages", "vllm_hybrid_pages", "vllm_pages_of"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class VllmHybridPages:
    """vLLM's page layout for one hybrid model (all byte counts per device)."""

    align_tokens: int  # attention kernel's block-size multiple
    tensor_parallel: int  # attention TP size of the deployment
    kv_token_bytes: int  # one attention layer, one token
    state_bytes: int  # one KDA layer's recurrent + conv state, unpadded
    block_tokens: int  # attention block size vLLM picks
    page_bytes: int  # one layer's page (= block_tokens x kv_token_bytes; state page padded to it)
    n_attn_layers: int
    n_kda_layers: int
    group_size: int  # layers per group (every group the same)
    attn_groups: int
    kda_groups: int
    padded_layers: int  # empty layer slots added to fill the last groups

    @property
    def state_padding_bytes(self) -> int:
        """Bytes a state page wastes to match the attention page."""
        return self.page_bytes - self.state_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes behind one block id: one page in each of a group's layers."""
        return self.group_size * self.page_bytes

    @property
    def checkpoint_blocks(self) -> int:
        """Blocks one whole-model state (every KDA layer) takes: one per KDA group."""
        return self.kda_groups

    @property
    def checkpoint_page_bytes(self) -> int:
        """Bytes one state checkpoint occupies in the pool, padding included."""
        return self.checkpoint_blocks * self.block_bytes

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes one whole-model state really holds (every KDA layer, no padding)."""
        return self.n_kda_layers * self.state_bytes

    @property
    def kda_padded_slots(self) -> int:
        """Empty layer slots in the KDA groups: a page each, behind every state block id."""
        return self.kda_groups * self.group_size - self.n_kda_layers

    @property
    def checkpoint_padding_bytes(self) -> int:
        """Bytes one state wastes in the pool: every state page's padding plus the padded layer slots."""
        return self.checkpoint_page_bytes - self.checkpoint_bytes

    @property
    def state_to_kv_blocks(self) -> float:
        """Blocks of one checkpoint per block of ``block_tokens`` tokens of KV (all attention layers)."""
        return self.kda_groups / self.attn_groups

    def kv_blocks(self, n_tokens: int) -> int:
        """Blocks the KV of ``n_tokens`` tokens takes (every attention group, rounded up to blocks)."""
        n = check_int("n_tokens", n_tokens, 0, unit="tokens")
        return self.attn_groups * _cdiv(n, self.block_tokens)

    def request_blocks(self, n_tokens: int) -> int:
        """Blocks a running request of ``n_tokens`` tokens holds: its KV plus one live state."""
        return self.kv_blocks(n_tokens) + self.checkpoint_blocks


def vllm_hybrid_pages(cfg: ModelConfig, deployment: Deployment, align_tokens: int = 16) -> VllmHybridPages:
    """Derive vLLM's hybrid page layout for ``cfg`` on one device of ``deployment`` (see the module doc).

    ``align_tokens``: the attention backend's block multiple (16 in the version cited; MLA
    backends of later versions need 64, which gives 1,920-token blocks for Kimi-Linear-48B at
    TP1). KDA heads must divide by the TP size. ValueError for a model without both layer kinds.
    """
    check_config(cfg)
    if not isinstance(deployment, Deployment):
        raise ValueError(f"deployment: expected a kimilab.costs.Deployment for cfg={cfg.name!r}, got {deployment!r}")
    tp = deployment.tp
    if cfg.kda_layers and cfg.n_heads % tp:
        raise ValueError(f"deployment={deployment.name!r}: TP{tp} does not divide the {cfg.n_heads} KDA heads")
    return vllm_pages_of(CacheShapes.from_config(cfg, deployment), align_tokens)


def vllm_pages_of(shapes: CacheShapes, align_tokens: int = 16) -> VllmHybridPages:
    """The same derivation from :class:`~kimilab.costs.CacheShapes` (already per device of one deployment)."""
    if not isinstance(shapes, CacheShapes):
        raise ValueError(f"shapes: expected a kimilab.costs.CacheShapes, got {type(shapes).__name__}")
    align = check_int("align_tokens", align_tokens, 1, unit="tokens")
    return _derive(shapes.name, shapes.kv_token_bytes, shapes.state_bytes + shapes.conv_bytes,
                   shapes.n_attn_layers, shapes.n_kda_layers, align, shapes.tensor_parallel)


@lru_cache(maxsize=256)
def _derive(name: str, kv_token: int, state: int, n_attn: int, n_kda: int, align: int, tp: int) -> VllmHybridPages:
    """The derivation itself, from per-rank bytes of one layer (cached: the page pool asks often)."""
    if not n_attn or not n_kda:
        raise ValueError(f"cfg={name!r}: vLLM's hybrid layout needs both KDA and attention layers "
                         f"(has {n_kda} KDA, {n_attn} attention)")
    block = align * _cdiv(state, align * kv_token)  # page equality, per layer
    lo, hi = min(n_attn, n_kda), max(n_attn, n_kda)  # layer groups of one size
    group = hi if hi < 1.5 * lo else lo
    attn_groups, kda_groups = _cdiv(n_attn, group), _cdiv(n_kda, group)
    padded = (attn_groups + kda_groups) * group - n_attn - n_kda
    return VllmHybridPages(align, tp, kv_token, state, block, block * kv_token, n_attn, n_kda,
                           group, attn_groups, kda_groups, padded)
