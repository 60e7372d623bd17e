"""Operators with no cache policy of their own: causal softmax attention (+ its KV cache) and the short conv."""
