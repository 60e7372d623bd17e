"""The dual-granularity prefix cache holding the runnable model's real KV and states, in ONE pool.

Requests and the prefix cache share one :class:`~kimilab.pool.PagePool`. A page
holds one block of one global layer's KV (``block_size`` token rows), so a block
of the prompt is one page per global layer, and a tree node owns exactly those
pages. When a request starts, the cache registers the prompt's whole blocks in
its radix tree (:meth:`HybridPrefixCache.begin`); the request's paged cache then
*adopts* those pages as its own blocks and writes its KV straight into them. So
when the request ends and frees its cache, nothing is copied and nothing is lost:
its prompt's pages simply stay, owned by the tree, as cached prefix — the way
vLLM's block manager and SGLang's radix cache keep a finished request's blocks.

A state is different: every token overwrites it, so it is never shared. At the
positions the policy chooses, the request's KDA and conv states are *copied* into
checkpoint pages of the same pool; a later request copies them back into its own
state pages. Blocks the request cannot share are its own: the span it recomputes
after the usable hit (its KV may already be cached, but a request never writes
into pages someone else reads), and a partial last block (copy-on-write).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kimilab.costs import LOCAL, CacheCosts
from kimilab.model.cache import StateCheckpoint
from kimilab.pool.pages import PagePool
from kimilab.pool.paged_cache import PagedHybridCache
from kimilab.prefix.hybrid import HybridPrefixCache, Outcome
from kimilab.prefix.policies import Policy, make_policy
from kimilab.validate import check_int

__all__ = ["ModelPrefixCache", "write_state", "read_state"]


def write_state(pool: PagePool, alloc, ckpt: StateCheckpoint) -> None:
    """Lay every KDA state, then every conv state, of ``ckpt`` into ``alloc``'s pages (a copy)."""
    parts = [ckpt.kda_states[i] for i in sorted(ckpt.kda_states)]
    parts += [ckpt.conv_states[i] for i in sorted(ckpt.conv_states)]
    raw = np.concatenate([np.ascontiguousarray(a).reshape(-1) for a in parts]).view(np.uint8)
    pages = pool.arena()[alloc.pages].reshape(-1)
    if raw.size > pages.size:
        raise ValueError(f"alloc: {pages.size} bytes cannot hold a {raw.size}-byte checkpoint")
    pool.arena()[alloc.pages] = np.concatenate([raw, pages[raw.size:]]).reshape(alloc.n_pages, -1)


def read_state(pool: PagePool, alloc, config, seq_len: int) -> StateCheckpoint:
    """The StateCheckpoint that :func:`write_state` laid into ``alloc`` (copies of the pages' bytes)."""
    dtype = np.dtype(config.dtype)
    H, K = config.n_heads, config.head_dim
    state_shape, conv_shape = (H, K, K), (config.conv_kernel - 1, config.conv_channels)
    flat = pool.arena()[alloc.pages].reshape(-1).view(dtype)
    layers = config.kda_layers
    n_state, n_conv = int(np.prod(state_shape)), int(np.prod(conv_shape))
    kda, conv, at = {}, {}, 0
    for i in layers:
        kda[i] = flat[at:at + n_state].reshape(state_shape).copy()
        at += n_state
    for i in layers:
        conv[i] = flat[at:at + n_conv].reshape(conv_shape).copy()
        at += n_conv
    return StateCheckpoint(config=config, seq_len=seq_len, kda_states=kda, conv_states=conv)


class ModelPrefixCache:
    """A HybridPrefixCache whose pages are the pages the model's requests run on.

    ``capacity_tokens`` sizes the one pool (tokens of the model's KV, all global
    layers); running requests, cached KV and checkpoints all come out of it, and
    the cache evicts to make room for a request. :meth:`prefill` serves a prompt
    from the deepest usable hit and returns the request's
    :class:`~kimilab.pool.PagedHybridCache`; free it when the request is done.
    """

    def __init__(self, model, policy: Policy | str, *, block_size: int, capacity_tokens: int,
                 partial_blocks: bool = False):
        if isinstance(policy, str):
            policy = make_policy(policy)
        if policy.free_states:
            raise ValueError("policy='kv-only' keeps no states, so a hybrid model cannot resume from it; "
                             "use every-block, align or dual")
        cfg = model.config
        block_size = check_int("block_size", block_size, 1, unit="tokens")
        capacity_tokens = check_int("capacity_tokens", capacity_tokens, block_size, unit="tokens")
        costs = CacheCosts.of(cfg, LOCAL)  # the reduced model's own arrays: one device
        n_attn = len(cfg.attn_layers)
        if n_attn == 0:
            raise ValueError(f"model.config={cfg.name!r} has no global layer: nothing to page per block")
        self.model, self.config, self.block_size = model, cfg, block_size
        page_bytes = block_size * costs.kv_bytes_per_token // n_attn  # one block of one global layer
        self.pool = PagePool(capacity_tokens // block_size * n_attn, page_bytes, name="model-prefix")
        self.cache = HybridPrefixCache(self.pool, block_size, policy, costs, partial_blocks=partial_blocks,
                                       allocs_per_node=n_attn)
        self.pool.reclaim = self.cache.make_room  # a running request's pages come before cached prefix
        self._owners = 0

    def shared_blocks(self, path, usable: int, n_matched: int) -> list[bool]:
        """Which of a request's blocks it shares with the tree (see the module docstring)."""
        return [(node.n_tokens == self.block_size and node.end <= usable) or j >= n_matched
                for j, node in enumerate(path)]

    def _blocks(self, path, shared: list[bool], usable: int, owner) -> dict[int, list]:
        """Each global layer's block list for a request: the tree's pages where shared, fresh ones where not.

        A partial block inside the usable hit is copied into the fresh page (copy-on-write);
        a cached block past the hit gets an empty page, which the request recomputes.
        """
        cfg, pool = self.config, self.pool
        blocks: dict[int, list] = {i: [] for i in cfg.attn_layers}
        for node, share in zip(path, shared):
            for layer, alloc in zip(cfg.attn_layers, node.alloc):
                if share:
                    blocks[layer].append(alloc)
                    continue
                own = pool.allocate("kv", 1, owner=owner)
                if node.end <= usable:
                    pool.arena()[own.pages] = pool.arena()[alloc.pages]
                blocks[layer].append(own)
        return blocks

    def _state_pages(self) -> int:
        cfg, pool = self.config, self.pool
        item = np.dtype(cfg.dtype).itemsize
        per_layer = (pool.pages_for_bytes(cfg.kda_state_elems_layer * item)
                     + pool.pages_for_bytes(cfg.conv_state_elems_layer * item))
        return len(cfg.kda_layers) * per_layer

    def prefill(self, tokens) -> tuple[np.ndarray, PagedHybridCache, Outcome]:
        """``(logits [n - usable, vocab], the request's PagedHybridCache, Outcome)`` for one prompt.

        The request's own state pages are taken first (the cache evicts to make room: a
        running request comes before cached prefix); then the prompt meets the tree.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"tokens: expected a non-empty 1-D array of token ids, got shape {tokens.shape}")
        cache, cfg, pool = self.cache, self.config, self.pool
        self._owners += 1
        owner = f"request {self._owners}"
        kv = PagedHybridCache(cfg, pool, block_tokens=self.block_size, owner=owner)
        own: list = []
        try:
            outcome, path, usable_node, added = cache.begin(tokens=tokens)
            try:
                shared = self.shared_blocks(path, outcome.usable_hit, outcome.matched_blocks)
                # its own KV pages come before the checkpoints begin() admitted for its path: those
                # are pinned with it, so if the rest of the pool cannot hold its pages, the deepest go
                need = len(cfg.attn_layers) * (-(-len(tokens) // self.block_size) - sum(shared))
                if added and not cache.make_room(need):
                    while added and not cache.make_room(need):
                        cache.withdraw(added.pop())
                    outcome = replace(outcome, checkpoints_added=len(added),
                                      checkpoint_positions=tuple(node.end for node in added))
                blocks = self._blocks(path, shared, outcome.usable_hit, owner)
                own = [a for layer in blocks.values() for a, keep in zip(layer, shared) if not keep]
                state = None
                if usable_node is not None:
                    state = read_state(pool, usable_node.payload.alloc, cfg, outcome.usable_hit)
                kv.adopt(blocks, state)
                for alloc in own:  # the request's cache holds its own handle to each now
                    pool.free(alloc)
                own = []
                pos = outcome.usable_hit
                wanted = {node.end: node for node in added}
                pieces = []
                for cut in sorted(wanted) + [len(tokens)]:
                    if cut > pos:
                        pieces.append(self.model.prefill(tokens[pos:cut], kv))
                        pos = cut
                    if cut in wanted:
                        write_state(pool, wanted[cut].payload.alloc, kv.checkpoint())
            finally:
                cache.finish(path)
        except BaseException:
            for alloc in own:
                pool.free(alloc)
            kv.free()
            raise
        logits = np.concatenate(pieces) if pieces else np.zeros((0, cfg.vocab_size))
        return logits, kv, outcome
