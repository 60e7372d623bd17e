"""Prefix caching, one concept per module:

* ``blocks``    how a prompt is cut into block keys (hash ids or token blocks)
* ``nodes``     a cached block (Node) and a lookup's result (Match)
* ``radix``     RadixTree: KV blocks of an attention model, pinned while used, evicted leaf-first
* ``policies``  where a hybrid cache keeps state checkpoints, and what it evicts first
* ``hybrid``    HybridPrefixCache: KV blocks + state checkpoints in one page pool (accounting)
* ``runs``      RunPrefixCache: the same cache over runs of blocks, the fast twin for trace replays
* ``segments``  SegmentCache: a tree of segments that end at states (Marconi's, SGLang's), with
  pluggable eviction: ``marconi`` (as published), ``oracle`` (clairvoyant), SGLang's LRU lists
* ``precision`` cheaper checkpoints (bf16, SGLang's int8) and ``fidelity``: what a hit from one costs
* ``offload``   a DRAM/SSD tier: load time against recompute
* ``host``      TieredPrefixCache: the block tree over host DRAM that keeps what HBM evicts (import it
  from ``kimilab.prefix.host``)
* ``tensors``   the same cache holding the runnable model's real KV and states
"""

from kimilab.prefix.blocks import block_token_counts, split_prompt
from kimilab.prefix.hybrid import Checkpoint, HybridPrefixCache, Outcome
from kimilab.prefix.policies import (POLICIES, Align, ChunkEnds, Dual, Ends, EndsBranch, EveryBlock, KVOnly, NoStates,
                                     Periodic, Placement, Policy, check_interval, make_policy)
from kimilab.prefix.nodes import Match, Node
from kimilab.prefix.radix import RadixTree
from kimilab.prefix.runs import RunPrefixCache
from kimilab.prefix.segments import LRUScorer, SegmentCache
from kimilab.prefix.tensors import ModelPrefixCache

__all__ = [
    "block_token_counts", "split_prompt", "Match", "Node", "RadixTree", "Placement", "Policy", "KVOnly",
    "NoStates", "EveryBlock", "Align", "Ends", "EndsBranch", "Dual", "ChunkEnds", "Periodic", "POLICIES",
    "make_policy", "check_interval", "Checkpoint", "Outcome", "HybridPrefixCache", "RunPrefixCache",
    "SegmentCache", "LRUScorer", "ModelPrefixCache",
]
