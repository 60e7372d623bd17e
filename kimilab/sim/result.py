"""The one result type of a simulation: cache totals per request, and the engine's timeline.

A run fills what its parts measured: the prefix-cache columns when requests met a
cache, the timeline when they were admitted onto a memory budget. Rates and
savings are derived properties, so nothing is stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["SimResult"]

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class SimResult:
    """What one simulated run measured (simulated time; byte figures are pool pages x page bytes)."""

    label: str
    # ----- the prefix cache (zero when the run had none) -----
    policy: str = ""  # checkpoint policy of the prefix cache ("" = none)
    policy_detail: str = ""  # the policy with its options (Marconi: the alpha it tuned)
    model: str = ""
    deployment: str = ""  # the deployment every byte (per device) and second is priced on
    block_size: int = 0
    capacity_tokens: int | None = 0  # None: unbounded
    capacity_pages: int | None = 0
    checkpoint_pages: int = 0
    kv_bytes_per_token: int = 0
    checkpoint_bytes_each: int = 0  # one checkpoint's real bytes (it is charged checkpoint_pages pages)
    requests: int = 0
    prompt_tokens: int = 0
    kv_hit_tokens: int = 0
    usable_hit_tokens: int = 0
    prefill_flops_cold: int = 0
    prefill_flops: int = 0
    prefill_seconds_cold: float = 0.0  # prefill time of every prompt from scratch, alone (costs.StepTimer)
    prefill_seconds: float = 0.0  # ... and from each request's usable hit
    checkpoints_admitted: int = 0
    checkpoints_evicted: int = 0
    kv_bytes_peak: int = 0
    checkpoint_bytes_peak: int = 0
    kv_bytes_mean: float = 0.0
    checkpoint_bytes_mean: float = 0.0
    per_request: list = field(default_factory=list, repr=False)
    # ----- the engine on a memory budget (empty when the run had none) -----
    layout: str = ""  # page layout of the memory the requests ran on ("" = none)
    capacity_bytes: int = 0
    time_ms: np.ndarray = field(default_factory=lambda: _EMPTY, repr=False)  # per engine step
    running: np.ndarray = field(default_factory=lambda: _EMPTY, repr=False)
    waiting: np.ndarray = field(default_factory=lambda: _EMPTY, repr=False)
    requested_bytes: np.ndarray = field(default_factory=lambda: _EMPTY, repr=False)  # really held
    reserved_bytes: np.ndarray = field(default_factory=lambda: _EMPTY, repr=False)  # pages held
    completed: int = 0
    refused: int = 0
    preemptions: int = 0
    preempted_tokens: int = 0  # tokens re-prefilled after preemptions
    makespan_ms: int = 0
    wait_ms: np.ndarray = field(default_factory=lambda: _EMPTY, repr=False)  # arrival -> first admission
    refused_ids: list = field(default_factory=list, repr=False)
    wall_seconds: float = 0.0

    # ----- cache view -----
    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens the model had to compute (not served from the cache)."""
        return self.prompt_tokens - self.usable_hit_tokens

    @property
    def kv_hit_rate(self) -> float:
        return self.kv_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def usable_hit_rate(self) -> float:
        return self.usable_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_flops_saved(self) -> int:
        return self.prefill_flops_cold - self.prefill_flops

    @property
    def prefill_ms_saved_per_request(self) -> float:
        """Mean prefill (TTFT) milliseconds the usable hits saved per request, on the cache's deployment."""
        return 1e3 * (self.prefill_seconds_cold - self.prefill_seconds) / self.requests if self.requests else 0.0

    def record(self) -> dict:
        """Every number and label of the run (the per-step arrays and per-request list left out)."""
        return {f: v.item() if isinstance(v, np.generic) else v for f in self.__dataclass_fields__
                if not isinstance(v := getattr(self, f), (np.ndarray, list))}

    @classmethod
    def from_record(cls, record: dict) -> "SimResult":
        """A result rebuilt from :meth:`record` (its arrays empty)."""
        return cls(**record)

    def as_dict(self) -> dict:
        """The prefix CLI's JSON object (fixed key order)."""
        cold = self.prefill_flops_cold
        unbounded = self.capacity_tokens is None
        return {
            "policy": self.policy,
            "model": self.model,
            "deployment": self.deployment,
            "block_size": self.block_size,
            "capacity_tokens": "inf" if unbounded else self.capacity_tokens,
            "capacity_pages": "inf" if unbounded else self.capacity_pages,
            "checkpoint_pages": self.checkpoint_pages,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "checkpoint_bytes_each": self.checkpoint_bytes_each,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "kv_hit_tokens": self.kv_hit_tokens,
            "usable_hit_tokens": self.usable_hit_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "kv_hit_rate": round(self.kv_hit_rate, 6),
            "usable_hit_rate": round(self.usable_hit_rate, 6),
            "checkpoints_admitted": self.checkpoints_admitted,
            "checkpoints_evicted": self.checkpoints_evicted,
            "kv_bytes_peak": self.kv_bytes_peak,
            "checkpoint_bytes_peak": self.checkpoint_bytes_peak,
            "kv_bytes_mean": round(self.kv_bytes_mean),
            "checkpoint_bytes_mean": round(self.checkpoint_bytes_mean),
            "prefill_flops_cold": cold,
            "prefill_flops_saved": self.prefill_flops_saved,
            "prefill_flops_saved_fraction": round(self.prefill_flops_saved / cold, 6) if cold else 0.0,
            "prefill_ms_cold_per_request": round(1e3 * self.prefill_seconds_cold / max(self.requests, 1), 4),
            "prefill_ms_saved_per_request": round(self.prefill_ms_saved_per_request, 4),
            "run_wall_s": round(self.wall_seconds, 3),
        }

    # ----- engine view -----
    @property
    def padding_bytes(self) -> np.ndarray:
        return self.reserved_bytes - self.requested_bytes

    @property
    def utilisation(self) -> np.ndarray:
        """Fraction of the budget holding real cache bytes, per step."""
        return self.requested_bytes / self.capacity_bytes

    def summary(self) -> dict:
        """The engine's headline numbers (means over the steps where anything ran)."""
        busy = self.running > 0
        return {
            "policy": self.label,
            "completed": self.completed,
            "refused": self.refused,
            "preemptions": self.preemptions,
            "peak_running": int(self.running.max(initial=0)),
            "mean_running": float(self.running[busy].mean()) if busy.any() else 0.0,
            "mean_utilisation": float(self.utilisation[busy].mean()) if busy.any() else 0.0,
            "mean_padding_MiB": float(self.padding_bytes[busy].mean() / 2**20) if busy.any() else 0.0,
            "makespan_s": self.makespan_ms / 1000.0,
            "mean_wait_s": float(self.wait_ms.mean() / 1000.0) if self.wait_ms.size else 0.0,
        }

    def phase_means(self, windows: dict[str, tuple[int, int]]) -> dict[str, float]:
        """Mean number of running requests inside each named time window [start, end) ms."""
        out = {}
        for name, (lo, hi) in windows.items():
            mask = (self.time_ms > lo) & (self.time_ms <= hi)
            out[name] = float(self.running[mask].mean()) if mask.any() else 0.0
        return out
