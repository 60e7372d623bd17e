"""Chapter 6's checked exercises: checkpoints in the pool, and a replay of the real trace."""

from pathlib import Path

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise
from kimilab.sim import Replay, replay
from kimilab.traffic import MOONCAKE_CONVERSATION

DATA = Path(__file__).resolve().parent.parent.parent / "data"


@exercise("6.1", "checkpoint pages at 256-token blocks",
          hint="ceil(checkpoint_bytes / (256 x kv_bytes_per_token)); smaller pages, more of them.")
def _():
    return -(-costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200) // (256 * costs.kv_bytes_per_token(kimi_linear_48b, costs.ONE_H200)))


@exercise("6.2", "checkpoints in 10 GB", hint="10e9 // costs.checkpoint_bytes(kimi_linear_48b): whole checkpoints.")
def _():
    return int(10e9 // costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200))


@exercise("6.3", "ends at 20 GB on the real trace", rtol=2e-3,
          hint="replay the whole real trace with policy 'ends' at 20 GB (sim.Replay / sim.replay, or the chapter's "
               "runs) and take usable_hit_rate.")
def _():
    return replay(Replay(str(DATA / MOONCAKE_CONVERSATION), "ends", 20, costs.ONE_H200)).usable_hit_rate
