"""The one argument check the cost model adds to :mod:`kimilab.validate`: is it a config?"""

from __future__ import annotations

from kimilab.config import ModelConfig


def check_config(cfg) -> ModelConfig:
    """``cfg`` if it is a :class:`~kimilab.config.ModelConfig`, else ValueError naming it."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a kimilab.config.ModelConfig, got {type(cfg).__name__}")
    return cfg
