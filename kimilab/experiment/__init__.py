"""The book's one reproducible experiment: what a second request saves, and what each method is worth.

* ``second``   Part A, real CPU work on the reduced model (one request at a time)
* ``variants`` Part B's factorial: prefix policy x router on the hybrid, and the all-MLA transformer
* ``scale``    Part B: each variant's goodput at an SLO, on real chat and agent traffic, and its price
* ``tables``   Part B's assumptions and headline table
* ``capacity`` Part B on your own traffic (``python -m kimilab capacity``), and the two-halves self-check
* ``tuning``   tune: the grid search that gives each variant its best step budget and batch cap
* ``results``  running both, writing results/*.json and *.md
"""

from kimilab.experiment.capacity import measure_capacity, two_halves
from kimilab.experiment.scale import (Spread, agent_capacity, arrival_order, compare, conversation_goodput,
                                      cost_per_m_output, run_part_b)
from kimilab.experiment.second import CONFIGS, Session, TurnCost, second_request, sessions
from kimilab.experiment.tuning import Tuned, tune
from kimilab.experiment.variants import BASELINE, VARIANT_NAMES, VARIANTS, Variant, model_of, variant

__all__ = ["CONFIGS", "Session", "TurnCost", "second_request", "sessions", "VARIANTS", "VARIANT_NAMES",
           "Variant", "BASELINE", "variant", "model_of", "cost_per_m_output", "run_part_b", "conversation_goodput",
           "agent_capacity", "Tuned", "tune", "Spread", "compare", "arrival_order", "measure_capacity",
           "two_halves"]
