"""The reduced hybrid model: public layers, one layer loop, and the cache protocol.

* ``layers``  KDALayer / AttentionLayer / MLP (project -> mix -> output), KDACapture
* ``model``   Model: seeded weights; forward / prefill / decode through one layer loop
* ``cache``   CacheProtocol (the checks every cache shares, truncate), HybridCache, StateCheckpoint
"""

from kimilab.model.cache import CacheProtocol, HybridCache, StateCheckpoint, check_runnable_config
from kimilab.model.layers import (CAPTURE_KEYS, KDA_KERNELS, MLP, AttentionLayer, KDACapture, KDALayer, rms_norm,
                                  silu)
from kimilab.model.model import Model

__all__ = ["Model", "KDALayer", "AttentionLayer", "MLP", "KDACapture", "CAPTURE_KEYS", "KDA_KERNELS",
           "rms_norm", "silu", "CacheProtocol", "HybridCache", "StateCheckpoint", "check_runnable_config"]
