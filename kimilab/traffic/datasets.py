"""The traces committed in data/: how each one is made, and one call that rewrites them all.

Every file in ``data/`` is generated (nothing comes from a real user), so the
registry below is the whole provenance: the file name, the call that makes
it (as text, for ``data/README.md``) and the call itself. :func:`regenerate`
writes them byte-identical on every machine; ``python -m kimilab traces
regenerate data/`` is the command-line form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kimilab.traffic.generators import agent_loops, chat_sessions, document_qa, mooncake_conversation_like
from kimilab.traffic.request import Request
from kimilab.traffic.trace import to_trace, write_trace

__all__ = ["DATASETS", "regenerate"]

# file name -> (how it is made, as text for data/README.md; the builder)
DATASETS: dict[str, tuple[str, Callable[[], list[Request]]]] = {
    "chat.jsonl": (
        "to_trace(chat_sessions(60, seed=1), block_size=512)",
        lambda: to_trace(chat_sessions(60, seed=1), 512),
    ),
    "agent.jsonl": (
        "to_trace(agent_loops(16, seed=2), block_size=512)",
        lambda: to_trace(agent_loops(16, seed=2), 512),
    ),
    "document.jsonl": (
        "to_trace(document_qa(300, seed=3), block_size=512)",
        lambda: to_trace(document_qa(300, seed=3), 512),
    ),
    "conversation_like.jsonl": (
        "mooncake_conversation_like(seed=0, block_size=512)",
        lambda: mooncake_conversation_like(seed=0, block_size=512),
    ),
}


def regenerate(directory) -> list[Path]:
    """Write every trace of ``DATASETS`` into ``directory`` (byte-identical on every machine)."""
    return [write_trace(Path(directory) / name, build()) for name, (_, build) in DATASETS.items()]
