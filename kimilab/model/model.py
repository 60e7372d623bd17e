"""A reduced, untrained Kimi-Linear-style hybrid model: 3 KDA layers : 1 global layer.

Every mechanism is the real one — KDA layers with a short conv, L2-normalised
q/k, a per-channel forget gate, a delta-rule beta, gated RMSNorm; global layers
with causal softmax attention and no positional encoding (NoPE, as Kimi
Linear's MLA layers). The weights are seeded random numbers, so the text it
writes is meaningless; what matters is that prefill, decode and a from-scratch
forward pass agree to rounding error. The MLP is dense SwiGLU (Kimi Linear's
MoE is not modelled); global layers use per-head MHA/GQA K and V (MLA's latent
KV appears only in the analytic cost model, :mod:`kimilab.costs`).

Three ways to run the same function, all through ONE layer loop (:meth:`Model.run_layers`)
that differs only in the KDA kernel and whether a cache is involved:

* :meth:`Model.forward` — whole sequence, no cache, recurrent KDA and full attention.
* :meth:`Model.prefill` — a piece of the prompt on top of a cache, chunked KDA.
* :meth:`Model.decode` — one token on top of a cache, the recurrent KDA step.

The layers themselves are public objects (:mod:`kimilab.model.layers`).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model.cache import CacheProtocol, HybridCache, check_runnable_config
from kimilab.model.layers import MLP, AttentionLayer, KDALayer, linear_weight, norm_weight, rms_norm
from kimilab.validate import check_int

__all__ = ["Model"]


class Model:
    """Seeded random weights for ``config``, its layers, and the three ways to run them.

    ``layers[i]`` is layer i's mixer (:class:`KDALayer` or :class:`AttentionLayer`),
    ``mlps[i]`` its MLP; ``weights`` holds every array (``weights["layers"][i]`` is
    the dict both of layer i's objects read).
    """

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        check_runnable_config(config)
        self.config = config
        self.seed = check_int("seed", seed, 0)
        self.dtype = np.dtype(config.dtype)
        self.weights = self._init_weights(np.random.default_rng(self.seed))
        mixers = {"K": KDALayer, "A": AttentionLayer}
        self.layers = [mixers[w["kind"]](config, i, w) for i, w in enumerate(self.weights["layers"])]
        self.mlps = [MLP(w) for w in self.weights["layers"]]

    # ----- weights ---------------------------------------------------------
    def _init_weights(self, rng: np.random.Generator) -> dict:
        """Draw every matrix in a fixed order (so a seed means the same model everywhere).

        Linear maps are N(0, 1/fan_in); residual-branch outputs get an extra
        1/sqrt(2 * n_layers) so the residual stream stays O(1) through depth.
        """
        c = self.config
        w: dict = {"embed": rng.standard_normal((c.vocab_size, c.d_model)), "layers": []}
        for kind in c.layer_pattern:
            layer = {"kind": kind, "mix_norm": norm_weight(rng, c.d_model), "mlp_norm": norm_weight(rng, c.d_model)}
            layer.update((KDALayer if kind == "K" else AttentionLayer).draw(c, rng))
            layer.update(MLP.draw(c, rng))
            w["layers"].append(layer)
        w["final_norm"] = norm_weight(rng, c.d_model)
        w["lm_head"] = linear_weight(rng, c.d_model, c.vocab_size)
        return self._cast(w)

    def _cast(self, obj):
        if isinstance(obj, np.ndarray):
            return obj.astype(self.dtype)
        if isinstance(obj, dict):
            return {k: self._cast(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._cast(v) for v in obj]
        return obj

    @property
    def n_params(self) -> int:
        def count(obj):
            if isinstance(obj, np.ndarray):
                return obj.size
            if isinstance(obj, dict):
                return sum(count(v) for v in obj.values())
            if isinstance(obj, list):
                return sum(count(v) for v in obj)
            return 0
        return int(count(self.weights))

    # ----- input checks ----------------------------------------------------
    def _tokens(self, tokens, name: str = "tokens") -> np.ndarray:
        arr = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
        if arr.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {list(arr.shape)}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.config.vocab_size)
        if bad.any():
            pos = int(np.argmax(bad))
            raise ValueError(f"{name}[{pos}]={int(arr[pos])} outside the vocabulary "
                             f"0..{self.config.vocab_size - 1} (config.vocab_size)")
        return arr.astype(np.int64)

    def _check_cache(self, cache) -> None:
        if not isinstance(cache, CacheProtocol):
            raise ValueError(f"cache: expected a kimilab.model.CacheProtocol (HybridCache, PagedHybridCache), "
                             f"got {type(cache).__name__}")
        if cache.config != self.config:
            raise ValueError(f"cache: built for config {cache.config.name!r}, model has {self.config.name!r}")

    # ----- the one layer loop ------------------------------------------------
    def run_layers(self, tokens: np.ndarray, cache, capture, kernel: str) -> np.ndarray:
        """Every layer over ``tokens``: the loop behind forward, prefill and decode.

        ``kernel`` is the KDA algorithm: "recurrent" (forward, no cache), "chunk"
        (prefill) or "step" (decode: one token, the residual stream h is [d]).
        With a cache, each layer reads and updates its part and ``advance`` runs once.
        ``tokens`` must already be a checked int array (forward/prefill/decode check them).
        """
        step = kernel == "step"
        h = self.weights["embed"][tokens[0] if step else tokens]  # [T, d], or [d] for one step
        for layer, mlp in zip(self.layers, self.mlps):
            x = rms_norm(h, layer.norm)
            h = h + layer(x, cache, kernel=kernel, capture=capture)
            h = h + mlp(h)
        if cache is not None:
            cache.advance(len(tokens))
        return rms_norm(h, self.weights["final_norm"]) @ self.weights["lm_head"]

    # ----- the three entry points -------------------------------------------
    def forward(self, tokens: Iterable[int], capture: dict | None = None) -> np.ndarray:
        """Logits [T, vocab] of a whole sequence from scratch: no cache, recurrent KDA, full attention.

        ``capture`` (a dict) receives, per KDA layer index, a :class:`KDACapture` of the
        layer's projected inputs; calls concatenate onto what it holds.
        """
        tokens = self._tokens(tokens)
        if tokens.size == 0:
            raise ValueError("tokens: expected at least one token id for forward()")
        return self.run_layers(tokens, None, capture, "recurrent")

    def prefill(self, tokens: Iterable[int], cache, capture: dict | None = None) -> np.ndarray:
        """Absorb ``tokens`` into ``cache`` (chunked KDA); logits [T, vocab] for each of them.

        Any split of a prompt into pieces gives the same logits and final cache
        as one call. An empty piece returns [0, vocab] and leaves the cache alone.
        """
        tokens = self._tokens(tokens)
        self._check_cache(cache)
        if tokens.size == 0:
            return np.zeros((0, self.config.vocab_size), dtype=self.dtype)
        return self.run_layers(tokens, cache, capture, "chunk")

    def decode(self, token: int, cache, capture: dict | None = None) -> np.ndarray:
        """Absorb one token into ``cache`` with the recurrent KDA step; logits [vocab] after it."""
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise ValueError(f"token={token!r}: expected one int token id (use prefill for a sequence)")
        tok = self._tokens([int(token)], name="token")
        self._check_cache(cache)
        return self.run_layers(tok, cache, capture, "step")

    def new_cache(self) -> HybridCache:
        """An empty contiguous cache for one request of this model."""
        return HybridCache(self.config)

    def generate(self, prompt_tokens: Iterable[int], max_new_tokens: int, cache=None,
                 eos_id: int | None = None) -> list[int]:
        """Greedy decoding: the ``max_new_tokens`` new token ids (stops early after ``eos_id``).

        The prompt is prefilled into ``cache`` (a fresh HybridCache if None), then each
        new token except the last is decoded into it, so afterwards
        ``cache.seq_len == len(prompt) + max(len(result) - 1, 0)``.
        """
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
        prompt = self._tokens(prompt_tokens, name="prompt_tokens")
        if prompt.size == 0:
            raise ValueError("prompt_tokens: expected at least one token id")
        cache = self.new_cache() if cache is None else cache
        logits = self.prefill(prompt, cache)[-1]
        if max_new_tokens == 0:
            return []
        out: list[int] = []
        while True:
            t = int(np.argmax(logits))
            out.append(t)
            if len(out) == max_new_tokens or (eos_id is not None and t == eos_id):
                return out
            logits = self.decode(t, cache)

    def __repr__(self) -> str:
        return f"Model(config={self.config.name!r}, seed={self.seed}, params={self.n_params})"
