"""The book's one reproducible experiment: what a second request saves, and what each method is worth.

* ``second``   Part A, real CPU work on the reduced model (one request at a time)
* ``variants`` Part B's factorial: prefix policy x router on the hybrid, and the all-MLA transformer
* ``scale``    Part B: each variant's goodput at an SLO, on real chat and agent traffic, and its price
* ``tables``   Part B's assumptions and headline table
* ``results``  running both, writing results/*.json and *.md
"""

from kimilab.experiment.scale import agent_capacity, conversation_goodput, cost_per_m_output, run_part_b
from kimilab.experiment.second import CONFIGS, Session, TurnCost, second_request, sessions
from kimilab.experiment.variants import BASELINE, VARIANT_NAMES, VARIANTS, Variant, model_of, variant

__all__ = ["CONFIGS", "Session", "TurnCost", "second_request", "sessions", "VARIANTS", "VARIANT_NAMES",
           "Variant", "BASELINE", "variant", "model_of", "cost_per_m_output", "run_part_b", "conversation_goodput",
           "agent_capacity"]
