"""Speculative decoding on a hybrid model, and the ways to undo a verify (chapters 7 and 8).

One concept per module, in the order the chapters build them:

* ``drafters``  Drafter: n-gram prompt lookup, a draft model, the controlled drafter
* ``verify``    VerifyView, verify (one chunked forward), greedy_accept, the replay step
* ``scratch``   SlotLayout, ScratchSlots: typed slots on a pool's scratch pages
* ``rollback``  Rollback interface, TrimOnly (the broken trim), SnapshotRollback
* ``replay``    ReplayRollback (projection replay), RingRollback (the ring buffer)
* ``loop``      speculative_generate: draft -> verify -> accept -> roll back
* ``measure``   rollback wall-clock time on the reduced model
"""

from kimilab.speculative.drafters import ControlledDrafter, Drafter, DraftModelDrafter, NgramDrafter
from kimilab.speculative.loop import ROLLBACKS, SpecResult, StepStats, make_rollback, speculative_generate
from kimilab.speculative.measure import rollback_timings
from kimilab.speculative.replay import ReplayRollback, RingRollback
from kimilab.speculative.rollback import Rollback, SnapshotRollback, TrimOnly, checkpoint_at
from kimilab.speculative.scratch import ScratchSlots, SlotLayout, checkpoint_layout, conv_row_layout, record_layout
from kimilab.speculative.verify import VerifyView, conv_after, greedy_accept, state_steps, verify

__all__ = [
    "Drafter", "NgramDrafter", "DraftModelDrafter", "ControlledDrafter",
    "VerifyView", "verify", "greedy_accept", "state_steps", "conv_after",
    "SlotLayout", "ScratchSlots", "checkpoint_layout", "record_layout", "conv_row_layout",
    "Rollback", "TrimOnly", "SnapshotRollback", "ReplayRollback", "RingRollback", "checkpoint_at",
    "ROLLBACKS", "StepStats", "SpecResult", "make_rollback", "speculative_generate", "rollback_timings",
]
