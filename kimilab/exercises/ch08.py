"""Chapter 8's checked exercises: what a replay record weighs, how small a ring can be, replay FLOPs."""

from kimilab.config import kimi_linear_48b
from kimilab.costs import ONE_H200, spec as spec_costs
from kimilab.exercises import exercise


@exercise("8.1", "bytes of a raw record per token at 48B, bf16",
          hint="per layer: raw conv inputs (3 x H x K) + g (H x K) + beta (H); times 20 KDA layers and 2 bytes.")
def _():
    return spec_costs.record_bytes_per_token(kimi_linear_48b, ONE_H200, "raw", 2)


@exercise("8.2", "smallest ring window for k=6", hint="a verify holds the last committed token and k drafts.")
def _():
    return 7


@exercise("8.3", "GFLOP to replay 5 positions at 48B", rtol=1e-3,
          hint="kda.recurrent_kda_flops(5, H, K, V) per KDA layer, times the 20 KDA layers, / 1e9.")
def _():
    return spec_costs.replay_flops(kimi_linear_48b, 5) / 1e9
