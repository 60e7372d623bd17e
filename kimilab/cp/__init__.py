"""Context parallelism: one long prompt split across P ranks (chapter 9).

- :mod:`~kimilab.cp.comm`: the communicator, in-process (threads, counts bytes) or MPI (counts
  the pickled buffers it hands to MPI, too);
- :mod:`~kimilab.cp.split`: where to cut the prompt (even, or balanced);
- :mod:`~kimilab.cp.ladder`: from LASP-2's additive state to KDA's dense M, rung by rung;
- :mod:`~kimilab.cp.kda_cp`: KDA's ordered composition of slice transitions: schemes and methods;
- :mod:`~kimilab.cp.regimes`: inputs where M flushes and where it lives, and M's lifetime;
- :mod:`~kimilab.cp.ring`: ring attention with the log-sum-exp merge, for contrast;
- :mod:`~kimilab.cp.zigzag`: the contiguous and zigzag layouts, and the all-to-all between them;
- :mod:`~kimilab.cp.prefill`: the whole model's context-parallel prefill (conv halo included);
- :mod:`~kimilab.cp.costs`: bytes, messages and critical-path steps; one KDA layer on a GPU cluster;
- :mod:`~kimilab.cp.model_costs`: the whole model's CP prefill time, by schedule, layout and cut;
- :mod:`~kimilab.cp.launch`: real processes under ``mpiexec`` (the ``cp`` command).
"""

from kimilab.cp.comm import LocalComm, MPIComm, payload_bytes, run_local
from kimilab.cp.kda_cp import (METHODS, SCHEMES, check_agreement, context_parallel_kda, cp_kda_rank, fold_states,
                               worst_cp_difference)
from kimilab.cp.costs import cp_link, kda_layer_verdict, predicted_speedup, ring_attention_bytes, scheme_costs
from kimilab.cp.ladder import RUNGS, ladder_cp, ladder_reference
from kimilab.cp.model_costs import SCHEDULES, model_cp_prefill
from kimilab.cp.prefill import context_parallel_prefill, cp_prefill_rank
from kimilab.cp.regimes import REGIMES, lifetime_tokens, m_lifetime, regime_inputs, regime_lifetimes
from kimilab.cp.ring import merge_partials, partial_attention, ring_attention_rank
from kimilab.cp.split import balanced_weights, cut_points, slices, split_bounds
from kimilab.cp.zigzag import LAYOUTS, causal_work, contiguous_layout, relayout, zigzag_layout

__all__ = [
    "LocalComm", "MPIComm", "payload_bytes", "run_local",
    "SCHEMES", "METHODS", "check_agreement", "context_parallel_kda", "cp_kda_rank", "fold_states",
    "worst_cp_difference",
    "balanced_weights", "cut_points", "slices", "split_bounds",
    "predicted_speedup", "kda_layer_verdict", "cp_link", "ring_attention_bytes", "scheme_costs",
    "SCHEDULES", "model_cp_prefill",
    "RUNGS", "ladder_cp", "ladder_reference",
    "REGIMES", "regime_inputs", "m_lifetime", "lifetime_tokens", "regime_lifetimes",
    "merge_partials", "partial_attention", "ring_attention_rank",
    "LAYOUTS", "contiguous_layout", "zigzag_layout", "relayout", "causal_work",
    "context_parallel_prefill", "cp_prefill_rank",
]
