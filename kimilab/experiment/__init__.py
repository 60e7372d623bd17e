"""The book's one reproducible experiment: what a second request saves, method by method.

* ``second``  Part A, real CPU work on the reduced model (one request at a time)
* ``scale``   Part B, the same ablation at Kimi-Linear-48B sizes: fleet simulator, real trace
* ``results`` running both, writing results/*.json and *.md
"""

from kimilab.experiment.scale import VARIANT_NAMES, VARIANTS, Variant, cost_per_m_output, run_part_b
from kimilab.experiment.second import CONFIGS, Session, TurnCost, second_request, sessions

__all__ = ["CONFIGS", "Session", "TurnCost", "second_request", "sessions", "VARIANTS", "VARIANT_NAMES",
           "Variant", "cost_per_m_output", "run_part_b"]
