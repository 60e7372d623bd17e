"""A reduced, untrained Kimi-Linear-style hybrid model: 3 KDA layers : 1 global layer.

Every mechanism is the real one — KDA layers with a short conv, L2-normalised
q/k, a per-channel forget gate, a delta-rule beta, gated RMSNorm; global layers
with causal softmax attention and no positional encoding (NoPE, as Kimi
Linear's MLA layers). The weights are seeded random numbers, so the text it
writes is meaningless; what matters is that prefill, decode and a from-scratch
forward pass agree to rounding error. The MLP is dense SwiGLU (Kimi Linear's
MoE is not modelled); global layers use per-head MHA/GQA K and V (MLA's latent
KV appears only in the analytic memory model).

Three ways to run the same function:

* :meth:`Model.forward` — whole sequence, no cache, recurrent KDA and full attention.
* :meth:`Model.prefill` — a piece of the prompt on top of a cache, chunked KDA.
* :meth:`Model.decode` — one token on top of a cache, the recurrent KDA step.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kimilab import kda
from kimilab.ops import attention
from kimilab.model.cache import HybridCache, check_runnable_config
from kimilab.config import ModelConfig
from kimilab.ops.conv import causal_conv1d, causal_conv1d_step

__all__ = ["Model", "rms_norm", "silu", "CAPTURE_KEYS"]

# What `capture` receives per KDA layer, each with a leading token axis:
# conv inputs q_in/k_in/v_in [T, H*K] (before the conv; the conv state is the
# last W-1 rows of their concatenation) and the kernel inputs q, k [T, H, K],
# v [T, H, V], g [T, H, K] (log gate), beta [T, H].
CAPTURE_KEYS = ("q_in", "k_in", "v_in", "q", "k", "v", "g", "beta")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _inverse_softplus(y: np.ndarray) -> np.ndarray:
    return y + np.log(-np.expm1(-y))


class Model:
    """Seeded random weights for ``config`` and the three ways to run them."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        check_runnable_config(config)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed={seed!r}: expected a non-negative int")
        self.config = config
        self.seed = int(seed)
        self.dtype = np.dtype(config.dtype)
        self.weights = self._init_weights(np.random.default_rng(self.seed))

    # ----- weights ---------------------------------------------------------
    def _init_weights(self, rng: np.random.Generator) -> dict:
        """Draw every matrix in a fixed order (so a seed means the same model everywhere).

        Linear maps are N(0, 1/fan_in); residual-branch outputs get an extra
        1/sqrt(2 * n_layers) so the residual stream stays O(1) through depth.
        """
        c = self.config
        d, H, K = c.d_model, c.n_heads, c.head_dim
        Ha, Hkv, D = c.attn_heads_eff, c.attn_kv_heads_eff, c.attn_head_dim_eff
        W = c.conv_kernel
        out_scale = 1.0 / np.sqrt(2 * c.n_layers)

        def lin(fan_in, fan_out, scale=1.0):
            return rng.standard_normal((fan_in, fan_out)) * (scale / np.sqrt(fan_in))

        def norm_w(n):
            return 1.0 + 0.1 * rng.standard_normal(n)

        w: dict = {"embed": rng.standard_normal((c.vocab_size, d)), "layers": []}
        for kind in c.layer_pattern:
            layer = {"kind": kind, "mix_norm": norm_w(d), "mlp_norm": norm_w(d)}
            if kind == "K":
                dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=(H, K)))
                layer.update(
                    w_qkv=lin(d, 3 * H * K),                 # q | k | v projections, side by side
                    conv=rng.standard_normal((3 * H * K, W)) / np.sqrt(W),
                    f_a=lin(d, K),                           # low-rank gate: d -> head_dim
                    f_b=lin(K, H * K, scale=0.5),            # head_dim -> H*K
                    A_log=np.log(rng.uniform(1.0, 16.0, size=H)),
                    dt_bias=_inverse_softplus(dt),           # softplus(dt_bias) in [1e-3, 1e-1]
                    b_proj=lin(d, H),
                    w_out_gate=lin(d, H * K),
                    o_norm=norm_w(K),
                    o_proj=lin(H * K, d, out_scale),
                )
            else:
                layer.update(
                    w_q=lin(d, Ha * D), w_k=lin(d, Hkv * D), w_v=lin(d, Hkv * D),
                    w_o=lin(Ha * D, d, out_scale),
                )
            layer.update(w_gate=lin(d, c.mlp_hidden), w_up=lin(d, c.mlp_hidden),
                         w_down=lin(c.mlp_hidden, d, out_scale))
            w["layers"].append(layer)
        w["final_norm"] = norm_w(d)
        w["lm_head"] = lin(d, c.vocab_size)
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
        if getattr(cache, "config", None) != self.config:
            got = getattr(getattr(cache, "config", None), "name", type(cache).__name__)
            raise ValueError(f"cache: built for config {got!r}, model has {self.config.name!r}")

    # ----- KDA layer pieces --------------------------------------------------
    def _kda_inputs(self, layer: dict, x: np.ndarray, conv_state):
        """Projections -> conv -> SiLU -> L2 norm, gate, beta for tokens x [T, d].

        Returns (captured inputs dict, new conv state). Works for T >= 1 tokens,
        or for one token when x is [d] (decode; uses the conv step twin).
        """
        c = self.config
        H, K = c.n_heads, c.head_dim
        step = x.ndim == 1
        xs = x[None, :] if step else x
        conv_in = xs @ layer["w_qkv"]  # [T, 3HK]
        if step:
            conv_out, new_conv = causal_conv1d_step(conv_in[0], layer["conv"], conv_state)
            conv_out = conv_out[None, :]
        else:
            conv_out, new_conv = causal_conv1d(conv_in, layer["conv"], conv_state)
        act = silu(conv_out).reshape(len(xs), 3, H, K)
        q = kda.l2_normalize(act[:, 0])
        k = kda.l2_normalize(act[:, 1])
        v = act[:, 2]
        raw = ((xs @ layer["f_a"]) @ layer["f_b"]).reshape(len(xs), H, K)
        if c.gate == "lowerbound":
            g = kda.kda_gate_lowerbound(raw, layer["A_log"], layer["dt_bias"], c.gate_lower_bound)
        else:
            g = kda.kda_gate(raw, layer["A_log"], layer["dt_bias"])
        beta = kda.beta_from_logits(xs @ layer["b_proj"])
        HK = H * K
        inputs = {"q_in": conv_in[:, :HK], "k_in": conv_in[:, HK:2 * HK], "v_in": conv_in[:, 2 * HK:],
                  "q": q, "k": k, "v": v, "g": np.asarray(g, dtype=self.dtype),
                  "beta": np.asarray(beta, dtype=self.dtype)}
        return inputs, new_conv

    def _kda_output(self, layer: dict, x: np.ndarray, o: np.ndarray) -> np.ndarray:
        """Per-head RMSNorm * sigmoid(output gate), then o_proj. o [T, H, V] -> [T, d]."""
        T = o.shape[0]
        gate = _sigmoid(x @ layer["w_out_gate"]).reshape(o.shape)
        y = rms_norm(o, layer["o_norm"], eps=1e-5) * gate
        return y.reshape(T, -1) @ layer["o_proj"]

    def _mlp(self, layer: dict, h: np.ndarray) -> np.ndarray:
        x = rms_norm(h, layer["mlp_norm"])
        return (silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]

    def _attn_qkv(self, layer: dict, x: np.ndarray):
        c = self.config
        T = x.shape[0]
        D = c.attn_head_dim_eff
        q = (x @ layer["w_q"]).reshape(T, c.attn_heads_eff, D)
        k = (x @ layer["w_k"]).reshape(T, c.attn_kv_heads_eff, D)
        v = (x @ layer["w_v"]).reshape(T, c.attn_kv_heads_eff, D)
        return q, k, v

    def _logits(self, h: np.ndarray) -> np.ndarray:
        return rms_norm(h, self.weights["final_norm"]) @ self.weights["lm_head"]

    @staticmethod
    def _record(capture, i: int, inputs: dict) -> None:
        if capture is None:
            return
        if i not in capture:
            capture[i] = {k: np.array(inputs[k]) for k in CAPTURE_KEYS}
        else:
            capture[i] = {k: np.concatenate([capture[i][k], inputs[k]]) for k in CAPTURE_KEYS}

    # ----- the three entry points -------------------------------------------
    def _run(self, tokens: np.ndarray, cache, capture, mode: str) -> np.ndarray:
        """Shared layer loop for 'forward' (no cache, recurrent KDA) and 'prefill' (cache, chunked)."""
        c = self.config
        h = self.weights["embed"][tokens]  # [T, d]
        for i, layer in enumerate(self.weights["layers"]):
            x = rms_norm(h, layer["mix_norm"])
            if layer["kind"] == "K":
                conv_state = None if cache is None else cache.conv_state(i)
                inp, new_conv = self._kda_inputs(layer, x, conv_state)
                self._record(capture, i, inp)
                args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
                if mode == "forward":
                    o, _ = kda.recurrent_kda(*args)
                else:
                    o, S = kda.chunk_kda(*args, initial_state=cache.kda_state(i), chunk_size=c.chunk_size)
                    cache.set_kda_state(i, S)
                    cache.set_conv_state(i, new_conv)
                h = h + self._kda_output(layer, x, o)
            else:
                q, k, v = self._attn_qkv(layer, x)
                if cache is None:
                    K_all, V_all = k, v
                else:
                    cache.append_kv(i, k, v)
                    K_all, V_all = cache.kv(i)
                o = attention.causal_attention(q, K_all, V_all)
                h = h + o.reshape(len(tokens), -1) @ layer["w_o"]
            h = h + self._mlp(layer, h)
        if cache is not None:
            cache.advance(len(tokens))
        return self._logits(h)

    def forward(self, tokens: Iterable[int], capture: dict | None = None) -> np.ndarray:
        """Logits [T, vocab] of a whole sequence from scratch: no cache, recurrent KDA, full attention."""
        tokens = self._tokens(tokens)
        if tokens.size == 0:
            raise ValueError("tokens: expected at least one token id for forward()")
        return self._run(tokens, None, capture, "forward")

    def prefill(self, tokens: Iterable[int], cache, capture: dict | None = None) -> np.ndarray:
        """Absorb ``tokens`` into ``cache`` (chunked KDA); logits [T, vocab] for each of them.

        Any split of a prompt into pieces gives the same logits and final cache
        as one call. An empty piece returns [0, vocab] and leaves the cache alone.
        """
        tokens = self._tokens(tokens)
        self._check_cache(cache)
        if tokens.size == 0:
            return np.zeros((0, self.config.vocab_size), dtype=self.dtype)
        return self._run(tokens, cache, capture, "prefill")

    def decode(self, token: int, cache, capture: dict | None = None) -> np.ndarray:
        """Absorb one token into ``cache`` with the recurrent KDA step; logits [vocab] after it."""
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise ValueError(f"token={token!r}: expected one int token id (use prefill for a sequence)")
        tok = self._tokens([int(token)], name="token")
        self._check_cache(cache)
        h = self.weights["embed"][tok[0]]  # [d]
        for i, layer in enumerate(self.weights["layers"]):
            x = rms_norm(h, layer["mix_norm"])
            if layer["kind"] == "K":
                inp, new_conv = self._kda_inputs(layer, x, cache.conv_state(i))
                self._record(capture, i, inp)
                o, S = kda.kda_step(inp["q"][0], inp["k"][0], inp["v"][0], inp["g"][0], inp["beta"][0],
                                    cache.kda_state(i))
                cache.set_kda_state(i, S)
                cache.set_conv_state(i, new_conv)
                h = h + self._kda_output(layer, x[None, :], o[None])[0]
            else:
                q, k, v = self._attn_qkv(layer, x[None, :])
                cache.append_kv(i, k, v)
                K_all, V_all = cache.kv(i)
                o = attention.causal_attention(q, K_all, V_all)  # the query is the last position
                h = h + o.reshape(-1) @ layer["w_o"]
            h = h + self._mlp(layer, h)
        cache.advance(1)
        return self._logits(h)

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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected a non-negative int")
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
