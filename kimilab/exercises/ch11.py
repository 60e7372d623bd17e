"""Chapter 11's checked exercises: the experiment's numbers, and speculation at a higher corruption."""

from kimilab import costs
from kimilab.config import tiny
from kimilab.exercises import exercise
from kimilab.experiment import second_request, sessions
from kimilab.model import Model


@exercise("11.1", "FLOPs of a cold 1,112-token prefill",
          hint=("With nothing cached, every prompt token is prefilled through every layer.",
                "Count the reduced model's prefill FLOPs for all 1,112 tokens."))
def _():
    return costs.prefill_flops(tiny, 1112)


@exercise("11.2", "snapshot scratch at k = 4",
          hint=("The snapshot rollback keeps one full checkpoint per verified position.",
                "Verified positions are k + 1; multiply by the tiny model's checkpoint bytes."))
def _():
    return 5 * costs.checkpoint_bytes(tiny, costs.LOCAL)


@exercise("11.3", "tokens turn 2 computes under dual (agent)",
          hint=("After a usable hit, turn 2 prefills only the tokens past the last checkpoint it matched.",
                "Read it off the chapter's Part A table for the agent workload under the dual prefix cache."))
def _():
    cost, _ = second_request(Model(tiny, seed=0), "prefix:dual", sessions("agent", 1, 0, tiny.vocab_size), n_out=12)
    return cost.prefill_tokens


@exercise("11.4", "a fleet's cost per million output tokens at the SLO",
          hint=("Rent is paid per accelerator-hour, whether busy or idle.",
                "The accelerator-hours rented in that hour times the price, over the million output tokens served."))
def _():
    from kimilab.experiment import cost_per_m_output

    return cost_per_m_output(8 * 4 * 3600.0, 2.0, 8 * 2_000_000)


@exercise("11.6", "target passes at corruption 0.6",
          hint=("Each verify step is one pass of the target: it keeps the accepted drafts and adds one token of its "
                "own, so the more drafts are corrupted, the more steps the same tokens take.",
                "Draft the reduced model's own continuation of the agent session's first prompt with 60% of drafts "
                "corrupted, decode 12 tokens four drafts at a time with the snapshot rollback, and count the "
                "steps the result records."))
def _():
    from kimilab.speculative import ControlledDrafter, speculative_generate

    model = Model(tiny, seed=0)
    prompt = list(sessions("agent", 1, 0, tiny.vocab_size)[0].first)
    drafter = ControlledDrafter(model, prompt, 12 + 8, corruption=0.6, seed=0)
    return len(speculative_generate(model, prompt, 12, drafter, k=4, rollback="snapshot").steps)
