"""Chapter 6's checked exercises: checkpoints in the pool, and a replay of the real trace."""

from pathlib import Path

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise
from kimilab.sim import Replay, replay
from kimilab.traffic import MOONCAKE_CONVERSATION

DATA = Path(__file__).resolve().parent.parent.parent / "data"


DEP = costs.DEFAULT_DEPLOYMENT  # per device of vLLM's TP4 recipe


@exercise("6.1", "checkpoint pages at 256-token blocks, per TP4 device",
          hint=("A checkpoint is stored in pool pages, and a page holds one block of KV, both on one device.",
                "Divide a checkpoint's bytes on one device by one 256-token KV page's bytes there, rounding up."))
def _():
    return -(-costs.checkpoint_bytes(kimi_linear_48b, DEP) // (256 * costs.kv_bytes_per_token(kimi_linear_48b, DEP)))


@exercise("6.2", "fp32 checkpoints in 10 GB of one TP4 device",
          hint=("Only whole checkpoints count, and GB here is decimal: 10 GB is 10 x 10^9 bytes.",
                "Divide the budget by one 48B checkpoint's bytes on that device and round down."))
def _():
    return int(10e9 // costs.checkpoint_bytes(kimi_linear_48b, DEP))


@exercise("6.3", "ends at 25 GB per TP4 device on the conversation trace", rtol=2e-3,
          hint=("A usable hit needs a KV hit and a state checkpoint at the same place.",
                "Replay the whole conversation trace once with checkpoints only at request ends, at 25 GB per "
                "device of the default deployment, and read its usable hit rate."))
def _():
    return replay(Replay(str(DATA / MOONCAKE_CONVERSATION), "ends", 25, DEP)).usable_hit_rate


@exercise("6.10", "bytes of one int8 checkpoint on a TP4 device",
          hint=("An int8 checkpoint stores one byte per state element plus the scales that undo the rounding; "
                "the conv window keeps its own width.",
                "Per KDA layer on one device: its heads' state elements, one fp32 scale per (head, key channel), "
                "the conv window; then count the KDA layers."))
def _():
    from kimilab.prefix.precision import checkpoint_bytes

    return checkpoint_bytes(kimi_linear_48b, DEP, "int8")
