"""Fixtures shared across the test files: the seeded tiny model, the shipped traces, 48B shapes.

Session-scoped where building the object costs time and nothing mutates it (tests that
need a model to change build their own).
"""

from pathlib import Path

import pytest
from hypothesis import settings

from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import ONE_H200, CacheShapes
from kimilab.model import Model
from kimilab.traffic import load_trace

DATA = Path(__file__).resolve().parent.parent / "data"

# Property tests: `make test` explores the same examples on every machine (derandomised, no
# example database), so a fresh clone's result depends only on the code; `make fuzz` passes
# --hypothesis-profile=fuzz with a random --hypothesis-seed, which it prints.
settings.register_profile("repro", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, database=None, print_blob=True)
settings.load_profile("repro")


@pytest.fixture(scope="session")
def tiny_model() -> Model:
    """The book's reduced model, seed 0 (the weights every chapter uses)."""
    return Model(tiny, seed=0)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The repository's data/ folder (the committed traces)."""
    return DATA


@pytest.fixture(scope="session")
def agent_trace():
    """data/agent.jsonl as Requests with 512-token block ids (small: ~700 requests)."""
    return load_trace(DATA / "agent.jsonl")


@pytest.fixture(scope="session")
def shapes_48b() -> CacheShapes:
    """Per-request cache sizes of Kimi-Linear-48B, whole model (one device)."""
    return CacheShapes.from_config(kimi_linear_48b, ONE_H200)
