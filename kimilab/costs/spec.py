"""Speculative-decoding rollback on one deployment: what each strategy holds and moves per device,
and what a verify step costs a whole batch.

A verify pass pushes n positions (a chain: the last committed token and k drafts, n = k+1;
a tree: its nodes) through every KDA state; rejecting drafts means going back. Five exact
ways (chapters 7 and 8; :mod:`kimilab.speculative` implements each):

* ``"snapshot"``  -- SGLang's copy-back: a state per position in scratch, the accepted one
  copied back into the request's state;
* ``"slot"``      -- vLLM's slot selection: a state per position in the request's own slots,
  the next verify starts from the accepted slot, nothing is copied;
* ``"replay"``    -- the committed state plus a *record* per position of the projected KDA
  inputs; the accepted path is replayed from the committed state;
* ``"ring"``      -- the replay records in a fixed ring reused every step, the conv state a
  pointer into a ring of raw conv rows;
* ``"lazy-ring"`` -- ReplaySSM: the state slot holds a lazily updated checkpoint, a ring of
  ``ring_len`` entries (update vector d, key k, gate g per position) holds the rest; a
  rollback moves a cursor, and the state is written back when the ring is full.

What a record holds decides its size (:data:`RECORD_KEEPS`): ``"post-conv"`` (k, v, g, beta and
the raw conv inputs: what :mod:`kimilab.speculative` stores), ``"raw"`` (raw conv inputs, g,
beta), ``"low-rank"`` (raw conv inputs, beta, the gate's low-rank input). States count
``cfg.state_bytes`` / ``cfg.conv_bytes`` per element; records and ring entries ``act_bytes``
(default ``cfg.conv_bytes``, bf16 at 48B), the ring's gates ``cfg.state_bytes`` (fp32, as
vLLM's ``g_cache``). Everything is per device: states, records and entries shard by KDA head.

**Bytes moved** per request and step (:func:`moved_bytes`) count every state, snapshot, record
and entry byte read or written, the verify's read of the committed state included; plain
decoding moves two states. The CPU strategies count the same bytes as they run, and the
tests hold the two equal. The step-time model charges every forward pass one state read
and one write per request, so a strategy's extra time (:func:`rollback_seconds`) is its
moved bytes beyond those two -- negative for the lazy ring, which writes the state only at
a flush -- plus its replay arithmetic at ``kernels.replay``. Bytes live in
:mod:`~kimilab.costs.spec_bytes`, time in :mod:`~kimilab.costs.spec_time`; both are re-exported here.
"""

from kimilab.costs.spec_bytes import (
    DEFAULT_RING, RECORD_KEEPS, ROLLBACK_STRATEGIES, conv_row_bytes, lazy_cycle, lazy_entry_bytes, lazy_flops,
    lazy_steps, mean_moved_bytes, moved_bytes, record_bytes_per_token, record_elems_per_layer, replay_flops,
    reverify_flops, rollback_bytes,
)
from kimilab.costs.spec_time import (
    accepted_fraction, alpha_from_accepted_fraction, break_even_acceptance, expected_tokens_per_step,
    expected_tokens_per_step_tree, rollback_seconds, rollback_share, spec_tokens_per_second,
    verify_step_seconds,
)

__all__ = ["ROLLBACK_STRATEGIES", "RECORD_KEEPS", "DEFAULT_RING", "record_elems_per_layer", "record_bytes_per_token",
           "conv_row_bytes", "lazy_entry_bytes", "rollback_bytes", "moved_bytes", "mean_moved_bytes", "replay_flops",
           "lazy_flops", "lazy_steps",
           "reverify_flops", "expected_tokens_per_step", "expected_tokens_per_step_tree", "accepted_fraction",
           "alpha_from_accepted_fraction", "lazy_cycle", "rollback_seconds", "verify_step_seconds", "rollback_share",
           "spec_tokens_per_second", "break_even_acceptance"]
