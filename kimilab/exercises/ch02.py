"""Chapter 2's checked exercises: the KDA state and its transition."""

import numpy as np

from kimilab import costs, kda
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise


@exercise("2.1", "KDA state bytes per layer",
          hint=("A KDA state is one K x V matrix per head, whatever the context length.",
                "Count the numbers in all heads' matrices and multiply by the bytes of fp32."))
def _():
    cfg = kimi_linear_48b
    return kda.state_bytes(cfg.n_heads, cfg.head_dim, cfg.head_dim, 4)


@exercise("2.2", "what survives 100 steps of forgetting", rtol=1e-9,
          hint=("With no writes, each token only multiplies the state by the forget gate.",
                "The factors compound: what is left after n tokens is a product of n equal factors."))
def _():
    return 0.99 ** 100


@exercise("2.3", "M of a do-nothing segment", atol=1e-12,
          hint=("A segment's transition maps the state before it to the state after it: S -> M S + C.",
                "If the segment neither forgets nor writes, the state after it equals the state before it."))
def _():
    return np.eye(3)


@exercise("2.5", "KV passes the KDA state on one TP8 device",
          hint=("Tensor parallelism splits the KDA heads over the devices, but MLA's latent is one head every "
                "device keeps whole.",
                "Find the first token count whose KV on one device is strictly larger than its share of the states."))
def _():
    tp8 = costs.VLLM_TP8_H200
    return costs.kda_state_bytes(kimi_linear_48b, tp8) // costs.kv_bytes_per_token(kimi_linear_48b, tp8) + 1
