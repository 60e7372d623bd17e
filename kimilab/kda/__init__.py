"""Kimi Delta Attention (KDA): the linear-attention layer whose whole memory is a K x V state per head.

One concept per module, in the order chapter 2 builds them:

- :mod:`~kimilab.kda.gate`: the per-channel decay ``g`` and write strength ``beta``;
- :mod:`~kimilab.kda.recurrent`: the token-by-token reference and the one-token decode step;
- :mod:`~kimilab.kda.naive`: the chunkwise algorithm written out plainly (one head, loops);
- :mod:`~kimilab.kda.chunk`: the chunkwise (UT-transform) form, same result as matrix products;
- :mod:`~kimilab.kda.transition`: a segment's affine map ``S_out = M S_in + C``;
- :mod:`~kimilab.kda.affine`: one chunk pass whose outputs stay affine in the entering state;
- :mod:`~kimilab.kda.prepared`: the chunk pass split into its shared preparation and two state
  passes (flash-linear-attention's context-parallel shape);
- :mod:`~kimilab.kda.testing`: seeded random inputs for tests, benchmarks and the book.

Layouts follow flash-linear-attention: q, k, g ``[T, H, K]``; v ``[T, H, V]``; beta
``[T, H]``; state ``[H, K, V]``; an optional leading batch axis ``B`` on all of them.
The public functions are re-exported here: ``from kimilab import kda; kda.chunk_kda(...)``.
"""

from kimilab.kda.affine import apply_affine_outputs, chunk_kda_affine
from kimilab.kda.chunk import chunk_kda, chunk_kda_flops
from kimilab.kda.gate import beta_from_logits, kda_gate, kda_gate_lowerbound, l2_normalize, sigmoid, softplus
from kimilab.kda.naive import naive_chunk_kda
from kimilab.kda.prepared import PreparedKDA, prepare_kda, prepared_transition, run_prepared
from kimilab.kda.recurrent import kda_step, kda_update, recurrent_kda, recurrent_kda_flops, state_bytes
from kimilab.kda.transition import (
    apply_transition, compose_transitions, identity_transition, linear_attention_state, segment_transition,
)

__all__ = [
    # gate
    "l2_normalize", "softplus", "sigmoid", "kda_gate", "kda_gate_lowerbound", "beta_from_logits",
    # recurrent
    "kda_update", "recurrent_kda", "kda_step", "recurrent_kda_flops", "state_bytes",
    # chunk
    "naive_chunk_kda", "chunk_kda", "chunk_kda_flops",
    # transition
    "segment_transition", "apply_transition", "compose_transitions", "identity_transition",
    "linear_attention_state",
    # affine
    "chunk_kda_affine", "apply_affine_outputs",
    # prepared
    "PreparedKDA", "prepare_kda", "prepared_transition", "run_prepared",
]
