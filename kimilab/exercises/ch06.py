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
          hint="a checkpoint's bytes on one device over one page's (256 tokens of KV on that device); round up.")
def _():
    return -(-costs.checkpoint_bytes(kimi_linear_48b, DEP) // (256 * costs.kv_bytes_per_token(kimi_linear_48b, DEP)))


@exercise("6.2", "fp32 checkpoints in 10 GB of one TP4 device",
          hint="whole checkpoints: the budget over one checkpoint's bytes on that device, rounded down.")
def _():
    return int(10e9 // costs.checkpoint_bytes(kimi_linear_48b, DEP))


@exercise("6.3", "ends at 40 GB per TP4 device on the conversation trace", rtol=2e-3,
          hint="replay the whole conversation trace with policy 'ends' at 40 GB per device of the default "
               "deployment and take its usable hit rate.")
def _():
    return replay(Replay(str(DATA / MOONCAKE_CONVERSATION), "ends", 40, DEP)).usable_hit_rate


@exercise("6.10", "bytes of one int8 checkpoint on a TP4 device",
          hint="per KDA layer: one byte per state element of the device's heads, one fp32 scale per (head, key "
               "channel), and the conv window at its own width; times the KDA layers.")
def _():
    from kimilab.prefix.precision import checkpoint_bytes

    return checkpoint_bytes(kimi_linear_48b, DEP, "int8")
