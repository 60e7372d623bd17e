"""A second tier for the prefix cache: host DRAM or SSD, and when loading a hit beats recomputing it.

Mooncake (Kimi's serving platform, FAST'25) keeps cached KV far beyond HBM: in the CPU
DRAM and SSDs of the cluster, moved over RDMA, so a prefix that fell out of HBM is loaded
instead of recomputed. For a hybrid model a hit of h tokens moves the KV of h tokens and
one state checkpoint; recomputing it costs the prefill those tokens would take. Per device
of a deployment both are priced here: a transfer at the tier's bandwidth (plus a fixed
latency), against :func:`kimilab.costs.prefill_seconds_saved`.

The tiers are what one device can pull on its own link, stated with where the number comes
from; they are assumptions of this module, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, kv_bytes_per_token, prefill_seconds_saved
from kimilab.prefix.precision import checkpoint_bytes
from kimilab.validate import check_int

__all__ = ["Tier", "HOST_DRAM", "NVME_SSD", "CLUSTER_RDMA", "TIERS", "load_seconds", "break_even_tokens"]


@dataclass(frozen=True)
class Tier:
    """A memory a device loads cached bytes from: bytes per second and a fixed latency per load."""

    name: str
    bandwidth: float
    latency_s: float
    source: str = ""


# PCIe 5.0 x16: 32 GT/s per lane, 128b/130b coding, 16 lanes = 63 GB/s one way (the link each H200 has to the host).
HOST_DRAM = Tier("host DRAM over PCIe 5.0 x16", 63e9, 10e-6,
                 source="PCIe 5.0 x16 line rate: 32 GT/s x 16 lanes x 128/130 / 8 bits")
# One NVMe SSD on PCIe 5.0 x4 reads sequentially at about 14 GB/s at best; ~100 us to first byte.
NVME_SSD = Tier("one NVMe SSD (PCIe 5.0 x4)", 14e9, 100e-6,
                source="PCIe 5.0 x4 NVMe sequential read, the fastest datacenter drives' datasheet class")
# A pool in the DRAM of the whole cluster (Mooncake Store): each GPU of an HGX H100/H200 node has its own
# 400 Gb/s NIC (50 GB/s); the latency, a lookup at the store's master and the RDMA set-up, is assumed.
CLUSTER_RDMA = Tier("cluster DRAM over RDMA (one 400 Gb/s NIC a GPU)", 50e9, 100e-6,
                    source="ConnectX-7 400 Gb/s line rate per GPU; 100 us per load assumed")
TIERS = (HOST_DRAM, NVME_SSD)  # one device's own tiers (chapter 6)


def load_seconds(cfg: ModelConfig, deployment: Deployment, tier: Tier, hit: int, precision: str = "native") -> float:
    """Seconds one device takes to load a hit of ``hit`` tokens: its share of their KV plus one checkpoint."""
    hit = check_int("hit", hit, 0, unit="tokens")
    nbytes = hit * kv_bytes_per_token(cfg, deployment) + (checkpoint_bytes(cfg, deployment, precision) if hit else 0)
    return tier.latency_s + nbytes / tier.bandwidth if hit else 0.0


def break_even_tokens(cfg: ModelConfig, deployment: Deployment, tier: Tier, n_tokens: int,
                      precision: str = "native") -> int | None:
    """Smallest hit (a multiple of 512 tokens) on an ``n_tokens`` prompt that is faster to load from
    ``tier`` than to recompute; None if none is."""
    n = check_int("n_tokens", n_tokens, 2, unit="tokens")
    for hit in range(512, n, 512):
        if load_seconds(cfg, deployment, tier, hit, precision) < prefill_seconds_saved(cfg, deployment, n, hit):
            return hit
    return None
