"""Chapter 8's checked exercises: what a replay record weighs, how small a ring can be, replay FLOPs,
and when a lazy ring writes its state back."""

from kimilab.config import kimi_linear_48b
from kimilab.costs import ONE_H200, spec as spec_costs
from kimilab.exercises import exercise


@exercise("8.1", "bytes of a raw record per token at 48B, bf16",
          hint=("A raw record keeps what replay needs to recompute k and v, not k and v themselves.",
                "Per token and layer: the conv inputs of q, k and v, the gate g and beta; in bf16, over all "
                "KDA layers."))
def _():
    return spec_costs.record_bytes_per_token(kimi_linear_48b, ONE_H200, "raw", 2)


@exercise("8.2", "smallest ring window for k=6",
          hint=("A verify step must be able to roll back to any verified position.",
                "Count the positions one verify step holds before acceptance is known."))
def _():
    return 7


@exercise("8.3", "GFLOP to replay 5 positions at 48B", rtol=1e-3,
          hint=("Replay re-runs only the recurrent state update: the outputs were read in the verify.",
                "Per head and token: the recurrent step's FLOPs minus its output read (2 K V + K); times "
                "32 heads, 20 KDA layers and 5 positions, in GFLOP."))
def _():
    return spec_costs.replay_flops(kimi_linear_48b, 5) / 1e9


@exercise("8.4", "lazy-ring write-backs per step: ring 16, k=3, 2 tokens per step", rtol=1e-6,
          hint=("A write-back empties the ring; the ring then fills by the tokens each step keeps, until the "
                "next verify would not fit.",
                "After a write-back the cursor runs 2, 4, ...; count the steps until cursor + 4 > 16."))
def _():
    return spec_costs.lazy_cycle(4, 16, 2.0)[1]
