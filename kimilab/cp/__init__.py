"""Context parallelism: one long prompt split across P ranks (chapter 9).

- :mod:`~kimilab.cp.comm`: the communicator, in-process (threads, counts bytes) or MPI;
- :mod:`~kimilab.cp.split`: where to cut the prompt (even, or balanced);
- :mod:`~kimilab.cp.kda_cp`: KDA's ordered composition of slice transitions, three schemes;
- :mod:`~kimilab.cp.ring`: ring attention with the log-sum-exp merge, for contrast;
- :mod:`~kimilab.cp.prefill`: the whole model's context-parallel prefill (conv halo included);
- :mod:`~kimilab.cp.costs`: bytes, messages and critical-path steps; a GPU-cluster prediction;
- :mod:`~kimilab.cp.launch`: real processes under ``mpiexec`` (the ``cp`` command).
"""

from kimilab.cp.comm import LocalComm, MPIComm, payload_bytes, run_local
from kimilab.cp.kda_cp import SCHEMES, check_agreement, context_parallel_kda, cp_kda_rank, fold_states
from kimilab.cp.costs import predicted_speedup, ring_attention_bytes, scheme_costs
from kimilab.cp.prefill import context_parallel_prefill, cp_prefill_rank
from kimilab.cp.ring import merge_partials, partial_attention, ring_attention_rank
from kimilab.cp.split import balanced_weights, cut_points, slices, split_bounds

__all__ = [
    "LocalComm", "MPIComm", "payload_bytes", "run_local",
    "SCHEMES", "check_agreement", "context_parallel_kda", "cp_kda_rank", "fold_states",
    "balanced_weights", "cut_points", "slices", "split_bounds",
    "predicted_speedup", "ring_attention_bytes", "scheme_costs",
    "merge_partials", "partial_attention", "ring_attention_rank",
    "context_parallel_prefill", "cp_prefill_rank",
]
