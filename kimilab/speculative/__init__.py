"""Speculative decoding on a hybrid model, and five exact ways to undo a verify (chapters 7 and 8).

One concept per module, in the order the chapters build them:

* ``drafters``     Drafter: n-gram prompt lookup, a draft model, the controlled drafter (chains, trees)
* ``tree``         DraftTree, Window (the ancestor mask), greedy acceptance on a tree
* ``verify``       VerifyView, verify (one chunked forward), greedy_accept, state_steps
* ``tree_kda``     KDA over a tree: the chunked form with an ancestor mask, its twin, the fold
* ``tree_verify``  verify_tree: a token tree through the model in one pass
* ``scratch``      SlotLayout, ScratchSlots: typed slots on a pool's scratch pages
* ``rollback``     Rollback interface, TrimOnly (the broken trim), StepSlotsRollback (scratch slots per
                   verify), SnapshotRollback (SGLang's copy-back)
* ``slots``        SlotRollback (vLLM's slot selection: nothing copied back)
* ``replay``       ReplayRollback (projection replay), RingRollback (the ring buffer), ConvRing
* ``lazy``         LazyRingRollback (ReplaySSM: a lazy checkpoint, a ring of updates, a cursor)
* ``loop``         speculative_generate: draft -> verify -> accept -> roll back
* ``sampling``     speculative sampling: the acceptance rule that keeps the target's distribution
* ``measure``      rollback wall-clock time on the reduced model
* ``reference``    GreedyReference (plain decoding's tokens and states, per length), predicted_moved
"""

from kimilab.speculative.drafters import ControlledDrafter, Drafter, DraftModelDrafter, NgramDrafter
from kimilab.speculative.lazy import DEFAULT_RING, LazyRingRollback, entry_layout
from kimilab.speculative.loop import (
    EXACT_ROLLBACKS, ROLLBACKS, SpecResult, StepStats, make_rollback, speculative_generate,
)
from kimilab.speculative.measure import rollback_timings
from kimilab.speculative.reference import GreedyReference, predicted_moved
from kimilab.speculative.replay import ConvRing, ReplayRollback, RingRollback
from kimilab.speculative.rollback import (
    Rollback, SnapshotRollback, StateView, StepSlotsRollback, TrimOnly, checkpoint_at,
)
from kimilab.speculative.sampling import accept_sampled, speculative_sample
from kimilab.speculative.scratch import ScratchSlots, SlotLayout, checkpoint_layout, conv_row_layout, record_layout
from kimilab.speculative.slots import SlotRollback
from kimilab.speculative.tree import DraftTree, Window, greedy_accept_tree
from kimilab.speculative.tree_kda import fold, node_states, tree_kda, tree_kda_recurrent
from kimilab.speculative.tree_verify import tree_attention, verify_tree
from kimilab.speculative.verify import VerifyView, conv_after, greedy_accept, state_steps, verify

__all__ = [
    "Drafter", "NgramDrafter", "DraftModelDrafter", "ControlledDrafter",
    "DraftTree", "Window", "greedy_accept_tree",
    "VerifyView", "verify", "greedy_accept", "state_steps", "conv_after",
    "tree_kda", "tree_kda_recurrent", "node_states", "fold", "tree_attention", "verify_tree",
    "SlotLayout", "ScratchSlots", "checkpoint_layout", "record_layout", "conv_row_layout",
    "Rollback", "StepSlotsRollback", "TrimOnly", "SnapshotRollback", "SlotRollback", "ReplayRollback", "RingRollback", "ConvRing",
    "LazyRingRollback", "entry_layout", "DEFAULT_RING", "StateView", "checkpoint_at",
    "ROLLBACKS", "EXACT_ROLLBACKS", "StepStats", "SpecResult", "make_rollback", "speculative_generate",
    "rollback_timings", "accept_sampled", "speculative_sample", "GreedyReference", "predicted_moved",
]
