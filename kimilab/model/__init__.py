"""The reduced hybrid model: public layers, one layer loop, and the cache protocol."""

from kimilab.model.cache import HybridCache, StateCheckpoint, check_runnable_config
from kimilab.model.model import CAPTURE_KEYS, Model

__all__ = ["Model", "CAPTURE_KEYS", "HybridCache", "StateCheckpoint", "check_runnable_config"]
