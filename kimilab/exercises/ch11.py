"""Chapter 11's checked exercises: the experiment's numbers."""

from kimilab import costs
from kimilab.config import tiny
from kimilab.exercises import exercise
from kimilab.experiment import second_request, sessions
from kimilab.model import Model


@exercise("11.1", "FLOPs of a cold 1,112-token prefill", hint="costs.prefill_flops(tiny, 1112): nothing cached.")
def _():
    return costs.prefill_flops(tiny, 1112)


@exercise("11.2", "snapshot scratch at k = 4",
          hint="k + 1 verified positions, one checkpoint (every KDA and conv state) each: costs.checkpoint_bytes.")
def _():
    return 5 * costs.checkpoint_bytes(tiny, costs.LOCAL)


@exercise("11.3", "tokens turn 2 computes under dual (agent)",
          hint="the chapter's rows['agent', 'prefix:dual']['prefill_tokens']: turn 2, minus the hits.")
def _():
    cost, _ = second_request(Model(tiny, seed=0), "prefix:dual", sessions("agent", 1, 0, tiny.vocab_size), n_out=12)
    return cost.prefill_tokens


@exercise("11.4", "a fleet's cost per million output tokens at the SLO",
          hint="accelerator-hours rented in that hour, times the price, over the million output tokens served in it.")
def _():
    from kimilab.experiment import cost_per_m_output

    return cost_per_m_output(8 * 4 * 3600.0, 2.0, 8 * 2_000_000)
