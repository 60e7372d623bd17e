"""The layers of the reduced hybrid model as public objects: KDA, global attention, MLP.

Each mixer is three public steps, so every way of running the model — and later
chapters that cut a sequence into slices (context parallelism) or verify draft
tokens — calls the same code:

* ``project``  per-token work: the projections (for KDA also the short conv, SiLU,
               L2 norm, forget gate and beta). Only the conv looks back, W-1 raw
               inputs, which its conv state carries across a cut.
* ``mix``      the sequence mixing: the KDA recurrence on a state (token by token,
               chunked, or one decode step — the same function), or causal softmax
               attention over every key the cache holds.
* ``output``   per-token again: gated per-head RMSNorm (KDA) and the output projection.

Calling a layer, ``layer(x, cache, kernel=...)``, runs the three against the cache
protocol of :mod:`kimilab.model.cache`. A layer's weights are a plain dict of numpy
arrays (the model's ``weights["layers"][i]``), drawn by ``draw`` in a fixed order so
that a seed means the same model everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kimilab import kda
from kimilab.config import ModelConfig
from kimilab.ops import attention
from kimilab.ops.conv import causal_conv1d, causal_conv1d_step
from kimilab.validate import check_choice

__all__ = ["KDACapture", "CAPTURE_KEYS", "KDA_KERNELS", "KDALayer", "AttentionLayer", "MLP",
           "rms_norm", "silu", "linear_weight", "norm_weight"]

KDA_KERNELS = ("recurrent", "chunk", "step")  # forward, prefill, decode


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _inverse_softplus(y: np.ndarray) -> np.ndarray:
    return y + np.log(-np.expm1(-y))


def linear_weight(rng: np.random.Generator, fan_in: int, fan_out: int, scale: float = 1.0) -> np.ndarray:
    """A [fan_in, fan_out] matrix of N(0, scale^2 / fan_in) entries."""
    return rng.standard_normal((fan_in, fan_out)) * (scale / np.sqrt(fan_in))


def norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    """An RMSNorm gain near 1."""
    return 1.0 + 0.1 * rng.standard_normal(n)


# ----- the capture record ------------------------------------------------------

@dataclass(frozen=True, eq=False)
class KDACapture:
    """Per-token projected inputs of one KDA layer, each with a leading token axis.

    ``q_in, k_in, v_in [T, H*K]`` are the raw conv inputs (the conv state is the last
    W-1 rows of :attr:`conv_inputs`); ``q, k [T, H, K]``, ``v [T, H, V]``,
    ``g [T, H, K]`` (log forget gate) and ``beta [T, H]`` are what the KDA kernel
    reads. Slicing (``cap[a:b]``) selects tokens; :meth:`concat` appends a later call's.
    """

    q_in: np.ndarray
    k_in: np.ndarray
    v_in: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray

    __iter__ = None  # not a sequence of tokens: read the fields

    def __len__(self) -> int:
        return int(self.q.shape[0])

    def __repr__(self) -> str:
        T, H, K = self.q.shape
        return f"KDACapture(tokens={T}, heads={H}, head_dim={K}, dtype={self.q.dtype})"

    def __getitem__(self, tokens: slice) -> "KDACapture":
        if not isinstance(tokens, slice):
            raise ValueError(f"tokens={tokens!r}: expected a slice (the record keeps its token axis)")
        return KDACapture(**{name: getattr(self, name)[tokens] for name in CAPTURE_KEYS})

    @property
    def conv_inputs(self) -> np.ndarray:
        """The raw conv inputs q | k | v side by side, [T, 3*H*K]."""
        return np.concatenate([self.q_in, self.k_in, self.v_in], axis=1)

    def kernel_inputs(self) -> tuple[np.ndarray, ...]:
        """(q, k, v, g, beta), the arguments of every KDA kernel."""
        return self.q, self.k, self.v, self.g, self.beta

    def copy(self) -> "KDACapture":
        return KDACapture(**{name: np.array(getattr(self, name)) for name in CAPTURE_KEYS})

    def concat(self, later: "KDACapture") -> "KDACapture":
        """This record followed by ``later``'s tokens."""
        return KDACapture(**{name: np.concatenate([getattr(self, name), getattr(later, name)])
                             for name in CAPTURE_KEYS})


CAPTURE_KEYS = tuple(f.name for f in fields(KDACapture))


def _record(capture: dict | None, i: int, cap: KDACapture) -> None:
    """Add layer ``i``'s record to the caller's ``capture`` dict (concatenating across calls)."""
    if capture is not None:
        capture[i] = cap.copy() if i not in capture else capture[i].concat(cap)


def _check_x(x, config: ModelConfig) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim not in (1, 2) or x.shape[-1] != config.d_model:
        raise ValueError(f"x: expected [T, d_model={config.d_model}] or one token [d_model], "
                         f"got shape {list(x.shape)}")
    return x


# ----- the layers -----------------------------------------------------------------

class KDALayer:
    """Kimi Delta Attention layer ``index`` of a model: project -> mix -> output.

    ``weights`` is the layer's dict (``mix_norm`` and the KDA matrices; the MLP's
    entries in the same dict belong to :class:`MLP`).
    """

    kind = "K"

    def __init__(self, config: ModelConfig, index: int, weights: dict) -> None:
        self.config, self.index, self.weights = config, index, weights
        self.dtype = np.dtype(config.dtype)

    @staticmethod
    def draw(config: ModelConfig, rng: np.random.Generator) -> dict:
        """The layer's matrices (float64), drawn from ``rng`` in a fixed order."""
        d, H, K, W = config.d_model, config.n_heads, config.head_dim, config.conv_kernel
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=(H, K)))
        return dict(
            w_qkv=linear_weight(rng, d, 3 * H * K),              # q | k | v projections, side by side
            conv=rng.standard_normal((3 * H * K, W)) / np.sqrt(W),
            f_a=linear_weight(rng, d, K),                         # low-rank gate: d -> head_dim
            f_b=linear_weight(rng, K, H * K, scale=0.5),          # head_dim -> H*K
            A_log=np.log(rng.uniform(1.0, 16.0, size=H)),
            dt_bias=_inverse_softplus(dt),                        # softplus(dt_bias) in [1e-3, 1e-1]
            b_proj=linear_weight(rng, d, H),
            w_out_gate=linear_weight(rng, d, H * K),
            o_norm=norm_weight(rng, K),
            o_proj=linear_weight(rng, H * K, d, 1.0 / np.sqrt(2 * config.n_layers)),
        )

    @property
    def norm(self) -> np.ndarray:
        """Gain of the pre-mixer RMSNorm."""
        return self.weights["mix_norm"]

    def project(self, x: np.ndarray,
                conv_state: np.ndarray | None = None) -> tuple[KDACapture, np.ndarray]:
        """Projections -> conv -> SiLU -> L2 norm, gate, beta for tokens x [T, d].

        Returns (the capture record, the new conv state). Works for T >= 1 tokens,
        or for one token when x is [d] (decode; uses the conv step twin).
        ``conv_state`` (the W-1 raw inputs before x; zeros if None) makes a slice
        of a sequence project exactly as it would inside the whole.
        """
        c, w = self.config, self.weights
        H, K = c.n_heads, c.head_dim
        x = _check_x(x, c)
        step = x.ndim == 1
        xs = x[None, :] if step else x
        conv_in = xs @ w["w_qkv"]  # [T, 3HK]
        if step:
            conv_out, new_conv = causal_conv1d_step(conv_in[0], w["conv"], conv_state)
            conv_out = conv_out[None, :]
        else:
            conv_out, new_conv = causal_conv1d(conv_in, w["conv"], conv_state)
        act = silu(conv_out).reshape(len(xs), 3, H, K)
        q = kda.l2_normalize(act[:, 0])
        k = kda.l2_normalize(act[:, 1])
        v = act[:, 2]
        raw = ((xs @ w["f_a"]) @ w["f_b"]).reshape(len(xs), H, K)
        if c.gate == "lowerbound":
            g = kda.kda_gate_lowerbound(raw, w["A_log"], w["dt_bias"], c.gate_lower_bound)
        else:
            g = kda.kda_gate(raw, w["A_log"], w["dt_bias"])
        beta = kda.beta_from_logits(xs @ w["b_proj"])
        HK = H * K
        cap = KDACapture(q_in=conv_in[:, :HK], k_in=conv_in[:, HK:2 * HK], v_in=conv_in[:, 2 * HK:],
                         q=q, k=k, v=v, g=np.asarray(g, dtype=self.dtype),
                         beta=np.asarray(beta, dtype=self.dtype))
        return cap, new_conv

    def mix(self, cap: KDACapture, state: np.ndarray | None = None, *,
            kernel: str = "chunk") -> tuple[np.ndarray, np.ndarray]:
        """The KDA recurrence over ``cap``'s tokens from ``state`` [H, K, V] (zeros if None).

        ``kernel`` picks the algorithm, all computing the same function:
        ``"recurrent"`` (token by token, forward), ``"chunk"`` (chunked, prefill) or
        ``"step"`` (one token, decode). Returns (o [T, H, V], the state after them).
        """
        check_choice("kernel", kernel, KDA_KERNELS)
        args = cap.kernel_inputs()
        if kernel == "recurrent":
            return kda.recurrent_kda(*args, initial_state=state)
        if kernel == "chunk":
            return kda.chunk_kda(*args, initial_state=state, chunk_size=self.config.chunk_size)
        if len(cap) != 1:
            raise ValueError(f"cap: kernel='step' takes one token, got {len(cap)}")
        if state is None:
            H, K = self.config.n_heads, self.config.head_dim
            state = np.zeros((H, K, K), dtype=self.dtype)
        o, new_state = kda.kda_step(*(a[0] for a in args), state)
        return o[None], new_state

    def output(self, x: np.ndarray, o: np.ndarray) -> np.ndarray:
        """Per-head RMSNorm * sigmoid(output gate), then o_proj. o [T, H, V] -> [T, d] (or [H, V] -> [d])."""
        w = self.weights
        step = x.ndim == 1
        xs, os = (x[None, :], o[None]) if step else (x, o)
        gate = _sigmoid(xs @ w["w_out_gate"]).reshape(os.shape)
        y = rms_norm(os, w["o_norm"], eps=1e-5) * gate
        out = y.reshape(os.shape[0], -1) @ w["o_proj"]
        return out[0] if step else out

    def __call__(self, x: np.ndarray, cache=None, *, kernel: str = "chunk",
                 capture: dict | None = None) -> np.ndarray:
        """The mixer's contribution for normed x [T, d] (or [d]); reads and updates ``cache``'s states."""
        i = self.index
        cap, new_conv = self.project(x, None if cache is None else cache.conv_state(i))
        _record(capture, i, cap)
        o, state = self.mix(cap, None if cache is None else cache.kda_state(i), kernel=kernel)
        if cache is not None:
            cache.set_kda_state(i, state)
            cache.set_conv_state(i, new_conv)
        return self.output(x, o[0] if x.ndim == 1 else o)

    def __repr__(self) -> str:
        return f"KDALayer(index={self.index}, heads={self.config.n_heads}x{self.config.head_dim})"


class AttentionLayer:
    """Global causal softmax attention layer ``index`` (NoPE): project -> mix -> output."""

    kind = "A"

    def __init__(self, config: ModelConfig, index: int, weights: dict) -> None:
        self.config, self.index, self.weights = config, index, weights

    @staticmethod
    def draw(config: ModelConfig, rng: np.random.Generator) -> dict:
        """The layer's matrices (float64), drawn from ``rng`` in a fixed order."""
        d, Ha, Hkv, D = config.d_model, config.attn_heads_eff, config.attn_kv_heads_eff, config.attn_head_dim_eff
        return dict(w_q=linear_weight(rng, d, Ha * D), w_k=linear_weight(rng, d, Hkv * D),
                    w_v=linear_weight(rng, d, Hkv * D),
                    w_o=linear_weight(rng, Ha * D, d, 1.0 / np.sqrt(2 * config.n_layers)))

    @property
    def norm(self) -> np.ndarray:
        return self.weights["mix_norm"]

    def project(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q [T, Ha, D], k [T, Hkv, D], v [T, Hkv, D] for tokens x [T, d]."""
        c, w = self.config, self.weights
        x = _check_x(x, c)
        lead = x.shape[:-1]
        D = c.attn_head_dim_eff
        q = (x @ w["w_q"]).reshape(lead + (c.attn_heads_eff, D))
        k = (x @ w["w_k"]).reshape(lead + (c.attn_kv_heads_eff, D))
        v = (x @ w["w_v"]).reshape(lead + (c.attn_kv_heads_eff, D))
        return q, k, v

    def mix(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Causal attention of the T queries (the last T positions) over all L keys: o [T, Ha, D]."""
        return attention.causal_attention(q, k, v)

    def output(self, o: np.ndarray) -> np.ndarray:
        """The output projection: o [T, Ha, D] -> [T, d] (or one token [Ha, D] -> [d])."""
        return o.reshape(o.shape[:-2] + (-1,)) @ self.weights["w_o"]

    def __call__(self, x: np.ndarray, cache=None, *, kernel: str = "chunk",
                 capture: dict | None = None) -> np.ndarray:
        """The mixer's contribution for normed x [T, d] (or [d]); appends to ``cache``'s KV."""
        step = x.ndim == 1
        q, k, v = self.project(x[None, :] if step else x)
        if cache is None:
            keys, values = k, v
        else:
            cache.append_kv(self.index, k, v)
            keys, values = cache.kv(self.index)
        o = self.mix(q, keys, values)
        return self.output(o[0] if step else o)

    def __repr__(self) -> str:
        c = self.config
        return f"AttentionLayer(index={self.index}, {c.attn_kind}, q_heads={c.attn_heads_eff}, kv_heads={c.attn_kv_heads_eff})"


class MLP:
    """Dense SwiGLU MLP with its own pre-norm (Kimi Linear's MoE is not modelled)."""

    def __init__(self, weights: dict) -> None:
        self.weights = weights

    @staticmethod
    def draw(config: ModelConfig, rng: np.random.Generator) -> dict:
        d, hidden = config.d_model, config.mlp_hidden
        return dict(w_gate=linear_weight(rng, d, hidden), w_up=linear_weight(rng, d, hidden),
                    w_down=linear_weight(rng, hidden, d, 1.0 / np.sqrt(2 * config.n_layers)))

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """The residual branch for the stream h [T, d] (or [d])."""
        w = self.weights
        x = rms_norm(h, w["mlp_norm"])
        return (silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]
