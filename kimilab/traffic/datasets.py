"""The traces committed in data/: one real, the rest generated, and one call that rewrites those.

``REAL_TRACES`` is real traffic shipped as published (with its licence beside it):
Moonshot AI's Mooncake conversation trace, 12,031 requests from one hour of Kimi.
Every chapter's claim about real serving is measured on it.

``DATASETS`` is every generated file: the file name, the call that makes it (as
text, for ``data/README.md``) and the call itself. The generators supply what the
real trace lacks (agent loops with forks, long shared documents, small chat
sessions one can read). :func:`regenerate` writes them byte-identical on every
machine; ``python -m kimilab traces regenerate data/`` is the command-line form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kimilab.traffic.generators import agent_loops, chat_sessions, document_qa, mooncake_conversation_like
from kimilab.traffic.request import Request
from kimilab.traffic.trace import to_trace, write_trace

__all__ = ["REAL_TRACES", "MOONCAKE_CONVERSATION", "DATASETS", "regenerate"]

MOONCAKE_CONVERSATION = "mooncake_conversation.jsonl"

# file name -> where it comes from (checked by tests/test_traffic.py and listed in data/README.md)
REAL_TRACES: dict[str, dict] = {
    MOONCAKE_CONVERSATION: {
        "source": "https://github.com/kvcache-ai/Mooncake",
        "path": "FAST25-release/traces/conversation_trace.jsonl",
        "commit": "3b5a594133958449a1feaf1c9e0fc1b553e34a28",
        "licence": "Apache-2.0 (data/LICENSE-mooncake-APACHE)",
        "sha256": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        "bytes": 3_029_533,
        "requests": 12_031,
    },
}

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
