"""The book's one reproducible experiment: what a second request saves, method by method.

* ``second``  Part A, real CPU work on the reduced model (one request at a time)
"""

from kimilab.experiment.second import CONFIGS, NoStates, Session, TurnCost, second_request, sessions

__all__ = ["CONFIGS", "NoStates", "Session", "TurnCost", "second_request", "sessions"]
