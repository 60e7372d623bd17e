"""How long one step takes: ONE forward pass of a whole batch on a deployment.

A continuous-batching step runs every decoding request's next token and the prefill
chunks admitted beside them as one forward pass. On the busiest device it costs::

    overhead   layers x kernels.layer_overhead_s (launches, norms, routing, the host)
  + comm       the step's collectives over the deployment's link
  + weights    max(weight bytes read / (HBM bandwidth x kernels.bandwidth),
                   dense GEMM FLOPs / (peak x e(step tokens))
                   + routed-expert FLOPs / (peak x e(tokens per touched expert)))
  + mixers     max(cache bytes / (HBM bandwidth x kernels.bandwidth),
                   attention FLOPs / (peak x kernels.attention) + KDA FLOPs / (peak x kernels.kda))

The weights are read once per step -- the experts the step's tokens route to, their
union at the step's token count -- however many requests and chunks share it; each
request's KV is read once and its states read and written once. The two rooflines are
summed, not maxed: the weight matmuls and the attention/KDA kernels run one after the
other. ``e(m)`` is the GEMM efficiency at ``m`` tokens (:meth:`Kernels.gemm_efficiency`): an
expert in a mixture of experts sees only its share of the step's tokens, so its GEMMs run far
below the dense ones'. The efficiencies and the per-layer overhead are the calibrated ones of
:data:`~kimilab.costs.deployment.CALIBRATED` (chapter 3 shows each measurement and fit).

Under DP-attention the busiest device holds an even share of the requests, but a prefill
chunk stays whole on one device, so the busiest share is the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kimilab.config import ModelConfig
from kimilab.costs.cache_bytes import checkpoint_bytes, kv_bytes_per_token
from kimilab.costs.deployment import Deployment, Kernels
from kimilab.costs.flops import attention_decode_flops, attention_prefill_flops, kda_decode_flops, kda_prefill_flops
from kimilab.costs.hardware import weight_model
from kimilab.costs.parallel import device_linear_flops, device_weight_bytes_read
from kimilab.validate import check_int

__all__ = ["StepWork", "step_work", "linear_seconds", "step_seconds", "decode_step_seconds", "prefill_chunks", "prefill_seconds",
           "prefill_seconds_saved", "checkpoint_write_seconds", "StepTimer"]


@dataclass(frozen=True)
class StepWork:
    """What one step does on the busiest device of ``deployment``, before kernel efficiencies."""

    deployment: Deployment
    layers: int
    weight_bytes: float
    weight_flops: float
    cache_bytes: float
    attention_flops: float
    kda_flops: float
    comm_seconds: float
    expert_flops: float = 0.0  # the routed experts' share of weight_flops
    gemm_tokens: float = 0.0  # tokens each dense GEMM sees (the step's, or the busiest device's)
    expert_tokens: float = 0.0  # tokens each touched routed expert sees, on average

    def gemm_seconds(self, kernels: Kernels | None = None) -> float:
        """The weight matmuls at their FLOP rate: dense GEMMs at the step's tokens, experts at theirs."""
        k, dev = kernels or self.deployment.kernels, self.deployment.device
        dense = self.weight_flops - self.expert_flops
        t = dense / (dev.peak_flops * k.gemm_efficiency(self.gemm_tokens, dev)) if dense else 0.0
        if self.expert_flops:
            t += self.expert_flops / (dev.peak_flops * k.gemm_efficiency(self.expert_tokens, dev))
        return t

    def parts(self, kernels: Kernels | None = None) -> dict[str, float]:
        """Seconds of each term (``kernels``: the deployment's own unless given, for calibration)."""
        k = kernels or self.deployment.kernels
        dev = self.deployment.device
        bw = dev.hbm_bandwidth * k.bandwidth
        mixer_flops_s = (self.attention_flops / (dev.peak_flops * k.attention)
                         + self.kda_flops / (dev.peak_flops * k.kda))
        return {"overhead": self.layers * k.layer_overhead_s, "communication": self.comm_seconds,
                "weights": max(self.weight_bytes / bw, self.gemm_seconds(k)),
                "mixers": max(self.cache_bytes / bw, mixer_flops_s)}

    def seconds(self, kernels: Kernels | None = None) -> float:
        return sum(self.parts(kernels).values())


def _chunks(chunks) -> list[tuple[int, int]]:
    out = []
    for i, pair in enumerate(chunks):
        try:
            n_new, n_cached = pair
        except (TypeError, ValueError):
            raise ValueError(f"chunks[{i}]={pair!r}: expected (n_new, n_cached)") from None
        out.append((check_int(f"chunks[{i}] n_new", n_new, 1, unit="tokens"),
                    check_int(f"chunks[{i}] n_cached", n_cached, 0, unit="tokens")))
    return out


def _comm_seconds(cfg: ModelConfig, dep: Deployment, tokens: int, busiest_tokens: int) -> float:
    """The step's collectives: an all-reduce per layer after TP attention; after the MLP an
    all-reduce (experts split, or DP-attention's gather + scatter) or, under expert
    parallelism, an all-to-all out to the experts and one back."""
    n = dep.n_devices
    if n == 1 or tokens == 0:
        return 0.0
    link, layers = dep.link, cfg.n_layers
    acts = tokens * cfg.d_model * dep.act_bytes
    t = layers * link.all_reduce_seconds(acts, n) if dep.attention == "tp" else 0.0
    if dep.experts == "tp":
        return t + layers * link.all_reduce_seconds(acts, n)
    mine = -(-tokens // n) if dep.attention == "tp" else busiest_tokens
    k = weight_model(cfg).routed_top_k or 1
    return t + 2 * layers * link.all_to_all_seconds(mine * k * cfg.d_model * dep.act_bytes, n)


def step_work(cfg: ModelConfig, deployment: Deployment, *, decode: tuple[int, int] = (0, 0),
              chunks: Sequence[tuple[int, int]] = ()) -> StepWork:
    """The work of one step: ``decode = (requests, their context tokens summed)`` decoding one
    token each, plus prefill ``chunks`` of ``(n_new, n_cached)`` tokens."""
    n_dec = check_int("decode requests", decode[0], 0)
    ctx_sum = check_int("decode context_sum", decode[1], 0, unit="tokens")
    chunks = _chunks(chunks)
    tokens = n_dec + sum(c for c, _ in chunks)
    dep = deployment
    kv, state = kv_bytes_per_token(cfg, dep), checkpoint_bytes(cfg, dep)
    tp = dep.tp
    dec = (ctx_sum * kv + n_dec * (kv + 2 * state), attention_decode_flops(cfg, n_dec, ctx_sum) / tp,
           kda_decode_flops(cfg, n_dec) / tp)
    per_chunk = [((c + h) * kv + 2 * state, attention_prefill_flops(cfg, c, h) / tp, kda_prefill_flops(cfg, c) / tp)
                 for c, h in chunks]
    cache_bytes, attn, kda = (dec[i] + sum(w[i] for w in per_chunk) for i in range(3))
    busiest = tokens
    if dep.attention == "dp" and dep.n_devices > 1:  # requests dealt out; a chunk stays on one device
        n = dep.n_devices
        biggest = max(per_chunk, key=lambda w: w[1] + w[2], default=(0.0, 0.0, 0.0))
        if (attn + kda) / n >= biggest[1] + biggest[2]:
            cache_bytes, attn, kda = cache_bytes / n, attn / n, kda / n
        else:
            cache_bytes, attn, kda = biggest
        busiest = max(-(-tokens // n), max((c for c, _ in chunks), default=0))
    if tokens == 0:
        return StepWork(dep, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    w = weight_model(cfg)
    expert_flops, expert_tokens = 0.0, 0.0
    if w.n_routed_experts:
        frac = w.routed_top_k / w.n_routed_experts
        expert_flops = 2.0 * w.routed_params * frac * tokens / dep.n_devices
        touched = 1.0 - (1.0 - frac) ** tokens  # share of experts the step's tokens reach
        expert_tokens = tokens * frac / touched
    return StepWork(dep, cfg.n_layers, device_weight_bytes_read(cfg, dep, tokens),
                    device_linear_flops(cfg, dep, tokens, busiest), cache_bytes, attn, kda,
                    _comm_seconds(cfg, dep, tokens, busiest), expert_flops, float(busiest), expert_tokens)


def linear_seconds(cfg: ModelConfig, deployment: Deployment, tokens: int) -> float:
    """The weight matmuls of ``tokens`` tokens through the whole model on ONE device of ``deployment``
    at their FLOP rate (dense GEMMs at ``tokens``, experts at their share): what a context-parallel
    rank holding the whole model pays for its rows."""
    tokens = check_int("tokens", tokens, 1, unit="tokens")
    one = deployment.with_(n_devices=1, attention="tp", experts="tp")
    return step_work(cfg, one, decode=(tokens, 0)).gemm_seconds()


def step_seconds(cfg: ModelConfig, deployment: Deployment, *, decode: tuple[int, int] = (0, 0),
                 chunks: Sequence[tuple[int, int]] = ()) -> float:
    """Seconds of one step (see the module docstring); 0.0 for an empty step."""
    return step_work(cfg, deployment, decode=decode, chunks=chunks).seconds()


def decode_step_seconds(cfg: ModelConfig, deployment: Deployment, context_len: int, batch: int = 1) -> float:
    """One decode step of ``batch`` requests at ``context_len`` tokens each = each request's TPOT."""
    L = check_int("context_len", context_len, 0, unit="tokens")
    batch = check_int("batch", batch, 1)
    return step_seconds(cfg, deployment, decode=(batch, batch * L))


def prefill_chunks(deployment: Deployment, n_new: int, n_cached: int = 0) -> list[tuple[int, int]]:
    """How a lone prompt is cut into steps: chunks of ``deployment.max_batched_tokens``."""
    n_new = check_int("n_new", n_new, 0, unit="tokens")
    n_cached = check_int("n_cached", n_cached, 0, unit="tokens")
    size = deployment.max_batched_tokens
    return [(min(size, n_new - i), n_cached + i) for i in range(0, n_new, size)]


def prefill_seconds(cfg: ModelConfig, deployment: Deployment, n_new: int, n_cached: int = 0) -> float:
    """Time to prefill ``n_new`` tokens on top of ``n_cached`` cached ones, the request alone on the
    instance: one step per chunk of ``max_batched_tokens`` (its TTFT without queueing)."""
    return sum(step_seconds(cfg, deployment, chunks=[c]) for c in prefill_chunks(deployment, n_new, n_cached))


def prefill_seconds_saved(cfg: ModelConfig, deployment: Deployment, n_tokens: int, hit: int) -> float:
    """Prefill seconds a usable hit of ``hit`` tokens saves on an ``n_tokens`` prompt (TTFT saved)."""
    n_tokens = check_int("n_tokens", n_tokens, 0, unit="tokens")
    hit = check_int("hit", hit, 0, unit="tokens")
    if hit > n_tokens:
        raise ValueError(f"hit={hit}: expected at most n_tokens={n_tokens}")
    return prefill_seconds(cfg, deployment, n_tokens) - prefill_seconds(cfg, deployment, n_tokens - hit, hit)


def checkpoint_write_seconds(cfg: ModelConfig, deployment: Deployment) -> float:
    """Time to copy one state checkpoint in HBM: every byte on the busiest device read and written once."""
    dev, k = deployment.device, deployment.kernels
    return 2.0 * checkpoint_bytes(cfg, deployment) / (dev.hbm_bandwidth * k.bandwidth)


class StepTimer:
    """:func:`step_seconds` and :func:`prefill_seconds` for many steps of one model on one
    deployment: the same numbers (a test holds them equal), with the per-token-count parts
    memoised. A trace replay or an engine asks for millions of steps."""

    def __init__(self, cfg: ModelConfig, deployment: Deployment):
        self.cfg, self.deployment = cfg, deployment
        self._plain = deployment.attention == "tp" or deployment.n_devices == 1  # sums, no busiest-share max
        dev, k = deployment.device, deployment.kernels
        self._bw = dev.hbm_bandwidth * k.bandwidth
        self._attn_rate = dev.peak_flops * k.attention
        self._kda_rate = dev.peak_flops * k.kda
        self._kv, self._state = kv_bytes_per_token(cfg, deployment), checkpoint_bytes(cfg, deployment)
        self._tp = deployment.tp
        self._pair = attention_prefill_flops(cfg, 1, 1) - attention_prefill_flops(cfg, 1, 0)
        self._key = attention_decode_flops(cfg, 1, 1) - attention_decode_flops(cfg, 1, 0)
        self._dec_attn = attention_decode_flops(cfg, 1, 0)
        self._dec_kda = kda_decode_flops(cfg, 1)
        self._fixed: dict = {}  # tokens -> overhead + comm + weights seconds
        self._cold: dict = {}  # n_new -> (attention FLOPs on no cache, KDA FLOPs), whole model

    def _fixed_part(self, tokens: int) -> float:
        t = self._fixed.get(tokens)
        if t is None:
            parts = step_work(self.cfg, self.deployment, decode=(tokens, 0)).parts()
            t = self._fixed[tokens] = parts["overhead"] + parts["communication"] + parts["weights"]
        return t

    def step(self, n_decode: int, context_sum: int, chunks: Sequence[tuple[int, int]] = (),
             positions: int = 1) -> float:
        """:func:`step_seconds` with ``decode=(n_decode, context_sum)`` and ``chunks``. With
        ``positions`` > 1 each decoder is a speculative verify of that many positions: a chunk of
        ``positions`` tokens on its context (the step is then :func:`step_seconds` with those chunks
        added; a test holds the two equal)."""
        if not self._plain:
            if positions != 1:
                raise ValueError(f"positions={positions}: a verify step is timed under tensor parallelism only "
                                 f"(deployment={self.deployment.name!r})")
            return step_seconds(self.cfg, self.deployment, decode=(n_decode, context_sum), chunks=chunks)
        kv, state = self._kv, self._state
        if positions == 1:
            tokens = n_decode
            cache_bytes = context_sum * kv + n_decode * (kv + 2 * state)
            attn = n_decode * self._dec_attn + context_sum * self._key
            kda = n_decode * self._dec_kda
        else:  # n_decode chunks of ``positions`` tokens, their cached contexts summing to context_sum
            tokens = n_decode * positions
            cold = self._cold.get(positions)
            if cold is None:
                cold = self._cold[positions] = (attention_prefill_flops(self.cfg, positions, 0),
                                                kda_prefill_flops(self.cfg, positions))
            cache_bytes = (context_sum + n_decode * positions) * kv + n_decode * 2 * state
            attn = n_decode * cold[0] + positions * context_sum * self._pair
            kda = n_decode * cold[1]
        for c, h in chunks:
            tokens += c
            cold = self._cold.get(c)
            if cold is None:
                cold = self._cold[c] = (attention_prefill_flops(self.cfg, c, 0), kda_prefill_flops(self.cfg, c))
            attn += cold[0] + c * h * self._pair
            kda += cold[1]
            cache_bytes += (c + h) * kv + 2 * state
        if tokens == 0:
            return 0.0
        flops_s = (attn / self._attn_rate + kda / self._kda_rate) / self._tp
        return self._fixed_part(tokens) + max(cache_bytes / self._bw, flops_s)

    def prefill(self, n_new: int, n_cached: int = 0) -> float:
        """:func:`prefill_seconds`: the request alone, one step per chunk."""
        return sum(self.step(0, 0, ((c, h),)) for c, h in prefill_chunks(self.deployment, n_new, n_cached))

    def prefill_saved(self, n_tokens: int, hit: int) -> float:
        """:func:`prefill_seconds_saved`."""
        return self.prefill(n_tokens) - self.prefill(n_tokens - hit, hit) if hit else 0.0
