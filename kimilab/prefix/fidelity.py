"""What a hit from a compressed checkpoint costs in quality, measured on the runnable model.

A prefix cache that stores its states at a lower precision (:mod:`kimilab.prefix.precision`)
hands a request a rounded state on a hit. :func:`hit_chain_errors` replays a conversation on
the model: request 1 prefills the first ``hits[0]`` tokens cold and leaves a checkpoint;
request k resumes from request k-1's *rounded* checkpoint and the KV request k-1 computed,
prefills up to ``hits[k]`` and leaves its own rounded checkpoint -- so after c hits a state
has been rounded c times, each rounding feeding the next. The last request finishes the
prompt and decodes ``decode`` tokens, teacher-forced on the exact model's greedy tokens.
Against a cold prefill of the whole sequence it reports the largest logit error (absolute,
and over the reference logits' spread) and how often the greedy token agrees.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kimilab.model.cache import HybridCache, StateCheckpoint
from kimilab.prefix.precision import round_state
from kimilab.validate import check_int

__all__ = ["rounded", "hit_chain_errors"]


def rounded(ckpt: StateCheckpoint, precision: str) -> StateCheckpoint:
    """``ckpt`` as a cache at ``precision`` gives it back on a hit: KDA states rounded, conv windows kept."""
    return StateCheckpoint(ckpt.config, ckpt.seq_len,
                           {i: round_state(s, precision) for i, s in ckpt.kda_states.items()},
                           dict(ckpt.conv_states))


def hit_chain_errors(model, tokens: Sequence[int], hits: Sequence[int], precisions: Sequence[str],
                     decode: int = 16) -> list[dict]:
    """For each precision and each c = 1..len(hits): the logit error and greedy agreement of a request
    that finishes the prompt after c hits in a row, the k-th at ``hits[k - 1]`` (see the module doc).
    One cold reference and one chain per precision serve every c."""
    tokens = np.asarray(tokens, dtype=np.int64)
    hits = [check_int("hits", h, 1, unit="tokens") for h in hits]
    if not hits or any(b <= a for a, b in zip(hits, hits[1:])) or hits[-1] >= len(tokens):
        raise ValueError(f"hits={hits}: expected increasing positions inside the {len(tokens)}-token prompt")
    decode = check_int("decode", decode, 0)
    cfg = model.config
    ref_cache = HybridCache(cfg)
    ref = [model.prefill(tokens, ref_cache)]
    greedy = []
    for _ in range(decode):
        greedy.append(int(np.argmax(ref[-1][-1])))
        ref.append(model.decode(greedy[-1], ref_cache)[None, :])
    rows = []
    for precision in precisions:
        cache = HybridCache(cfg)
        model.prefill(tokens[: hits[0]], cache)
        for c, start in enumerate(hits, start=1):
            ckpt = rounded(cache.checkpoint(), precision)
            kv = {i: tuple(a[:start] for a in cache.kv(i)) for i in cfg.attn_layers}
            last = HybridCache.from_checkpoint(cfg, ckpt, kv=kv)  # the request that finishes the prompt
            got = np.concatenate([model.prefill(tokens[start:], last)] +
                                 [model.decode(t, last)[None, :] for t in greedy])
            want = np.concatenate([ref[0][start:]] + ref[1:])
            err = np.abs(got - want)
            rows.append({"precision": precision, "hits": c, "max_abs": float(err.max()),
                         "max_rel": float(err.max() / want.std()),
                         "agree": float(np.mean(got.argmax(-1) == want.argmax(-1)))})
            if c < len(hits):  # the chain goes on: this request stops at the next hit and leaves its state
                cache = HybridCache.from_checkpoint(cfg, ckpt, kv=kv)
                model.prefill(tokens[start: hits[c]], cache)
    return rows
