"""Chapter 6's checked exercises: checkpoints in the pool, and a replay of the real trace."""

from pathlib import Path

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise
from kimilab.sim import Replay, replay
from kimilab.traffic import MOONCAKE_CONVERSATION

DATA = Path(__file__).resolve().parent.parent.parent / "data"


@exercise("6.1", "checkpoint pages at 256-token blocks",
          hint=("A checkpoint is stored in pool pages, and a page holds one block of KV.",
                "Divide a checkpoint's bytes by one 256-token KV page's bytes, rounding up."))
def _():
    return -(-costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200) // (256 * costs.kv_bytes_per_token(kimi_linear_48b, costs.ONE_H200)))


@exercise("6.2", "checkpoints in 10 GB",
          hint=("Only whole checkpoints count, and GB here is decimal: 10 GB is 10 x 10^9 bytes.",
                "Divide the budget by one 48B checkpoint's bytes and round down."))
def _():
    return int(10e9 // costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200))


@exercise("6.3", "ends at 20 GB on the real trace", rtol=2e-3,
          hint=("A usable hit needs a KV hit and a state checkpoint at the same place.",
                "Replay the whole real trace once with the ends policy at a 20 GB budget and read its usable "
                 "hit rate."))
def _():
    return replay(Replay(str(DATA / MOONCAKE_CONVERSATION), "ends", 20, costs.ONE_H200)).usable_hit_rate
