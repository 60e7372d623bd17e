"""Chapter 12's checked exercises: net-loss regimes, recall, and context parallelism's efficiency."""

from kimilab import costs, cp, recall
from kimilab.config import all_mla_27, kimi_linear_48b
from kimilab.costs import spec as spec_costs
from kimilab.exercises import exercise


@exercise("12.1", "decode-step crossover at batch 8 under DP-attention",
          hint=("Under DP-attention each device holds whole requests, and a decode step reads every request's "
                "cache once: the hybrid's fixed states against all-MLA's KV, which grows with the context.",
                "Find the smallest context at which a step of 8 hybrid requests takes no longer than a step of "
                "8 all-MLA requests on that deployment."))
def _():
    return costs.decode_crossover_tokens(kimi_linear_48b, all_mla_27, costs.DP4_EP4_H200, 8)


@exercise("12.2", "break-even acceptance, k = 3 at batch 32 on TP4", rtol=2e-3,
          hint=("Speculation pays where the expected tokens of one verify step, over that step's time, beat one "
                "token per plain decode step of the same batch.",
                "Expected tokens per step grow with the acceptance rate; search the rate at which the two "
                "throughputs are equal."))
def _():
    return spec_costs.break_even_acceptance(kimi_linear_48b, costs.DEFAULT_DEPLOYMENT, 4096, 3, batch=32)


@exercise("12.3", "KDA recall of 96 pairs", rtol=1e-9,
          hint=("Write the pairs into the gated state in order, read every key back, and decode each read-back "
                "to its nearest vocabulary entry.",
                "Average the fraction decoded right over the eight seeds."))
def _():
    return recall.recall("kda", 96, seeds=range(8)).mean


@exercise("12.4", "whole-model CP efficiency, 16 devices, 64k tokens", rtol=1e-6,
          hint=("Device efficiency is the speedup over one device divided by the number of devices.",
                "Sixteen devices span two nodes, so the exchange crosses the slower link; the whole model "
                "counts its expert and attention layers as well as KDA."))
def _():
    return cp.model_cp_prefill(kimi_linear_48b, 65536, 16, deployment=costs.VLLM_TP8_H200, affine_cost=1.25,
                               layout="zigzag")["efficiency"]
