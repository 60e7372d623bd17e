"""Chapter 2's checked exercises: the KDA state and its transition."""

import numpy as np

from kimilab import costs, kda
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise


@exercise("2.1", "KDA state bytes per layer", hint="a state is H x K x V numbers; times 4 bytes (fp32).")
def _():
    cfg = kimi_linear_48b
    return kda.state_bytes(cfg.n_heads, cfg.head_dim, cfg.head_dim, 4)


@exercise("2.2", "what survives 100 steps of forgetting", rtol=1e-9,
          hint="a constant forget gate alpha multiplies the state once per token: alpha ** steps.")
def _():
    return 0.99 ** 100


@exercise("2.3", "M of a do-nothing segment", atol=1e-12,
          hint="segment_transition of k [10, 1, 3], v [10, 1, 2], g = zeros [10, 1, 3], beta = zeros [10, 1]; "
               "take M of head 0.")
def _():
    return np.eye(3)


@exercise("2.5", "KV passes the KDA state on one TP8 device",
          hint="tensor parallelism splits the KDA heads over the devices, but MLA's latent is one head that every "
               "device keeps whole; find the first token count whose KV is strictly larger.")
def _():
    tp8 = costs.VLLM_TP8_H200
    return costs.kda_state_bytes(kimi_linear_48b, tp8) // costs.kv_bytes_per_token(kimi_linear_48b, tp8) + 1
