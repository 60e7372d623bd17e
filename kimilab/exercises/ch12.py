"""Chapter 12's checked exercises: the crossovers."""

from pathlib import Path

import numpy as np

from kimilab import costs
from kimilab.config import all_mla_27, kimi_linear_48b
from kimilab.costs import spec as spec_costs
from kimilab.exercises import exercise
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

DATA = Path(__file__).resolve().parent.parent.parent / "data"


@exercise("12.1", "the memory crossover",
          hint=("The hybrid pays a fixed state cost but grows KV slower; the crossover is where the two lines"
                 " meet.",
                "Find the smallest context at which the hybrid's bytes per request fall below the all-MLA "
                 "model's."))
def _():
    return costs.crossover_tokens(kimi_linear_48b, all_mla_27, costs.ONE_H200)


@exercise("12.2", "tokens per verify step at acceptance 0.69, k = 4", rtol=1e-9,
          hint=("Accepted drafts form a geometric series in the acceptance rate, plus the target's own token.",
                "Sum the series for k = 4 at the threshold's acceptance rate."))
def _():
    return spec_costs.expected_tokens_per_step(0.69, 4)


@exercise("12.3", "prompts that fit in one 8,192-token block", rtol=1e-9,
          hint=("A prompt shorter than one block never completes a block, so it cannot hit.",
                "Take the fraction of the real trace's requests whose input fits in 8,192 tokens."))
def _():
    lengths = np.array([r.input_length for r in load_trace(DATA / MOONCAKE_CONVERSATION, 512)])
    return float(np.mean(lengths <= 8192))
