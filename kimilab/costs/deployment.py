"""The ONE object behind every byte and every second: a named :class:`Deployment`.

A deployment is how one serving instance runs the model: how many devices, which
accelerator, how attention and experts are split over them, the links between them,
the kernels' efficiencies, a fixed cost per layer per step, and how much of each
device's memory the cache may use. Every byte count in :mod:`kimilab.costs` is *per
device* of a deployment, and every time comes from the same deployment, so no number
mixes a whole-replica byte count with a tensor-parallel step time.

Attention (``attention``):

- ``"tp"``: tensor parallelism over all ``n_devices`` (vLLM's and SGLang's default).
  KDA states, conv states and GQA/MHA KV shard by head (vLLM keeps at least one KV head
  per device); MLA has ONE latent KV head, so every device holds the whole latent of
  every request. One all-reduce per layer after attention.
- ``"dp"``: data-parallel attention: each device runs attention for its own requests and
  holds their whole caches; the mixer weights are replicated on every device.

Experts (``experts``): ``"tp"`` splits every expert over the devices (an all-reduce after
the MLP); ``"ep"`` places whole experts on devices (expert parallelism: an all-to-all to
send each token to its experts and one to bring it back).

Named deployments (:data:`DEPLOYMENTS`): the default is what users run, vLLM's published
Kimi-Linear recipe (one node, ``--tensor-parallel-size 4``; H200 is among its verified
GPUs); the second is DP-attention with expert parallelism on the same four devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kimilab.costs.hardware import CPU, H200, H800, LOOPBACK, NVLINK_H100, INFINIBAND_NDR, Accelerator, Link
from kimilab.validate import check_choice, check_int

__all__ = ["Kernels", "CALIBRATED", "REPORT_KERNELS", "Deployment", "VLLM_TP4_H200", "VLLM_TP8_H200", "DP4_EP4_H200", "ONE_H200",
           "REPORT_TP4_H800", "LOCAL", "DEFAULT_DEPLOYMENT", "DEPLOYMENTS", "deployment"]


@dataclass(frozen=True)
class Kernels:
    """How close real kernels come to the device's peaks, and what a step costs regardless.

    ``gemm``: fraction of peak FLOP/s of the weight matmuls (projections, experts, head); with
    ``gemm_half_ridge`` > 0 it is the asymptote of a curve in the tokens ``m`` a GEMM sees,
    ``gemm x m / (m + h)`` with ``h = gemm_half_ridge x`` the device's ridge point (peak FLOP/s
    over HBM bytes/s): few tokens leave the tensor cores idle, and a device with more FLOPs per
    byte needs more tokens to fill them (:mod:`kimilab.costs.operators` fits it to measured GEMMs).
    ``attention``: fraction of peak FLOP/s of softmax attention over the sequence.
    ``kda``: fraction of peak FLOP/s of the KDA (chunked or recurrent) and conv kernels.
    ``bandwidth``: fraction of HBM bandwidth when reading weights and caches.
    ``replay``: fraction of peak FLOP/s of a token-by-token state replay (speculative rollback).
    ``layer_overhead_s``: fixed seconds per layer per step (kernel launches, norms, routing,
    the host's share), whatever the batch.
    """

    gemm: float
    attention: float
    kda: float
    bandwidth: float
    replay: float
    layer_overhead_s: float
    source: str = ""
    gemm_half_ridge: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gemm", "attention", "kda", "bandwidth", "replay"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"Kernels.{name}={value!r}: expected a fraction of the peak in (0, 1]")
        if not 0.0 <= self.gemm_half_ridge < 100.0:
            raise ValueError(f"Kernels.gemm_half_ridge={self.gemm_half_ridge!r}: expected a multiple of the "
                             "ridge point in [0, 100)")
        if not 0.0 <= self.layer_overhead_s < 1.0:
            raise ValueError(f"Kernels.layer_overhead_s={self.layer_overhead_s!r}: expected seconds in [0, 1)")

    def gemm_efficiency(self, tokens: float, device: Accelerator) -> float:
        """Fraction of ``device``'s peak a GEMM over ``tokens`` tokens reaches (``gemm`` when there is no curve)."""
        if not self.gemm_half_ridge:
            return self.gemm
        half = self.gemm_half_ridge * device.peak_flops / device.hbm_bandwidth
        return self.gemm * tokens / (tokens + half)


# The kernels every serving number uses, built operator by operator (chapter 3 shows each step;
# tests refit every value):
# - gemm, gemm_half_ridge: Vidur's measured H100 GEMMs (kimilab.costs.operators.fit_gemm);
# - kda: FlashKDA's H20 benchmark carried to an H100 (operators.KDA_ON_H100["central"]);
# - attention, bandwidth: fitted to the Kimi Linear report's Figure 7 on REPORT_TP4_H800, attention
#   within the published FlashAttention-2..3 range (it lands on FlashAttention-3's 75%);
# - layer_overhead_s: CUDA-graph execution, 12 small kernels per layer at Vidur's 4 us floor (what
#   vLLM and SGLang ship for decode). REPORT_KERNELS keeps the eager overhead the report's rows fit.
# ``replay`` stays our assumption: nothing published measures it.
CALIBRATED = Kernels(gemm=0.739, attention=0.75, kda=0.110, bandwidth=0.726, replay=0.05, layer_overhead_s=4.8e-05,
                     gemm_half_ridge=0.789,
                     source="per-operator calibration (Vidur GEMMs, FlashKDA, FlashAttention-3), remainder fitted "
                            "to the Kimi Linear report; CUDA-graph overhead (chapter 3)")
REPORT_KERNELS = dataclasses.replace(CALIBRATED, layer_overhead_s=1.17e-04,
                                     source="CALIBRATED with the eager per-layer overhead the report's rows fit")

_MODES = ("tp", "dp")
_EXPERTS = ("tp", "ep")


@dataclass(frozen=True)
class Deployment:
    """One serving instance: ``n_devices`` of ``device``, split as ``attention`` and ``experts`` say.

    ``memory_utilization`` is the share of each device's HBM the engine may use (vLLM's
    ``--gpu-memory-utilization``); ``activation_reserve_bytes`` is kept free of cache for a
    step's activations; ``max_batched_tokens`` is the token budget of one step (vLLM's
    ``--max-num-batched-tokens``), which also cuts a long prefill into chunks;
    ``max_num_seqs`` is the most requests running at once (vLLM's ``--max-num-seqs``). The
    engine takes both from here unless told otherwise, so a tuned deployment is one object.
    Under DP-attention both hold per device, as each vLLM DP rank schedules on its own.

    Their defaults: vLLM's ``EngineArgs._set_default_args`` (vllm/engine/arg_utils.py @99d7eb5, V1) gives
    ``vllm serve`` 8,192 tokens and 1,024 sequences on GPUs of 70 GiB or more other than A100
    (H100, H200), and 2,048 and 256 elsewhere (``SchedulerConfig`` alone falls back to 128).
    Both follow the H100/H200 values, what a user of the recipe's deployments gets; a tuned
    comparison searches both (:func:`kimilab.experiment.tuning.tune`).
    """

    name: str
    device: Accelerator
    n_devices: int = 1
    attention: str = "tp"
    experts: str = "tp"
    devices_per_node: int = 8
    intra_link: Link = NVLINK_H100
    inter_link: Link = INFINIBAND_NDR
    kernels: Kernels = CALIBRATED
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 4e9
    max_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    act_bytes: int = 2
    source: str = ""

    def __post_init__(self) -> None:
        check_int("Deployment.n_devices", self.n_devices, 1)
        check_int("Deployment.devices_per_node", self.devices_per_node, 1)
        check_int("Deployment.max_batched_tokens", self.max_batched_tokens, 1, unit="tokens per step")
        check_int("Deployment.max_num_seqs", self.max_num_seqs, 1, unit="requests per step")
        check_choice("Deployment.attention", self.attention, _MODES)
        check_choice("Deployment.experts", self.experts, _EXPERTS)
        if not isinstance(self.device, Accelerator) or not isinstance(self.kernels, Kernels):
            raise ValueError("Deployment.device / .kernels: expected an Accelerator and a Kernels")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"Deployment.memory_utilization={self.memory_utilization!r}: expected a fraction in (0, 1]")

    @property
    def tp(self) -> int:
        """Devices one request's attention is split over (1 under DP-attention)."""
        return self.n_devices if self.attention == "tp" else 1

    @property
    def nodes(self) -> int:
        return -(-self.n_devices // self.devices_per_node)

    @property
    def link(self) -> Link:
        """The link a collective over every device goes through (the slowest one it crosses)."""
        if self.n_devices == 1:
            return LOOPBACK
        return self.intra_link if self.nodes == 1 else self.inter_link

    def with_(self, **changes) -> "Deployment":
        """A copy with some fields changed (name it, if the result is a different deployment)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line: what a printed number was computed for."""
        split = (f"TP{self.n_devices}" if self.attention == "tp" else f"DP-attention x{self.n_devices}")
        experts = "" if self.n_devices == 1 else (", experts EP" if self.experts == "ep" else ", experts TP")
        return (f"{self.name}: {self.n_devices} x {self.device.name} ({self.device.hbm_bytes / 1e9:.0f} GB, "
                f"{self.device.hbm_bandwidth / 1e12:.2f} TB/s), {split}{experts}")


_RECIPE = ("vLLM recipe for Kimi-Linear-48B-A3B (github.com/vllm-project/recipes, moonshotai/Kimi-Linear.md "
           "@a89de46: one node, --tensor-parallel-size 4 or 8; H200 listed as verified)")
VLLM_TP4_H200 = Deployment("vllm-tp4-h200", H200, 4, "tp", "tp", source=_RECIPE)
VLLM_TP8_H200 = Deployment("vllm-tp8-h200", H200, 8, "tp", "tp", source=_RECIPE)
DP4_EP4_H200 = Deployment("dp4-ep4-h200", H200, 4, "dp", "ep",
                          source="DP-attention with expert parallelism on the recipe's four devices "
                                 "(vLLM --data-parallel-size 4 --enable-expert-parallel)")
# The whole model on one device (its 96 GB of bf16 weights fit an H200): per-device bytes are the
# model's own, the view a single-replica byte count takes.
ONE_H200 = Deployment("one-h200", H200, 1, source="one device: every byte of the model on it")
# What we assume the Kimi Linear report measured Figure 7 on: the report names no hardware. Of
# the alternatives chapter 3 fits (2, 4 or 8 H800s; 4 or 8 H20s), four H800-class devices at TP4
# fit best, with eight close behind; both stay in the ensemble that gives every verdict its band.
REPORT_TP4_H800 = Deployment("report-tp4-h800 (assumed)", H800, 4, "tp", "tp", kernels=REPORT_KERNELS,
                             source="our assumption: the report does not state its hardware")
# The reduced model on this CPU: one device, so per-device bytes are the model's own.
LOCAL = Deployment("local-cpu", CPU, 1, kernels=CALIBRATED, memory_utilization=1.0, activation_reserve_bytes=0.0,
                   source="the book's reduced model in numpy")

DEFAULT_DEPLOYMENT = VLLM_TP4_H200
DEPLOYMENTS: dict[str, Deployment] = {d.name: d for d in (VLLM_TP4_H200, VLLM_TP8_H200, DP4_EP4_H200, ONE_H200)}


def deployment(name: str) -> Deployment:
    """A named deployment (the CLI's ``--deployment``); the error lists the names."""
    try:
        return DEPLOYMENTS[name]
    except KeyError:
        raise ValueError(f"deployment={name!r}: expected one of {sorted(DEPLOYMENTS)}") from None
