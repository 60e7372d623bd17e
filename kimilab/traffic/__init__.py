"""Traffic: the one Request, seeded generators, Mooncake trace I/O and statistics, the committed traces.

Modules, in the order data flows:

* :mod:`~kimilab.traffic.request`    — :class:`Request` (tokens and/or hash ids, arrival, lengths, tenant)
* :mod:`~kimilab.traffic.segments`   — prompts as (uid, length) segments; tokens or block ids from them
* :mod:`~kimilab.traffic.generators` — chat, agent, document, Mooncake-like, mixed and Zipf-prefix workloads
* :mod:`~kimilab.traffic.sharing`    — sharing structure: measured statistics, and generated traffic
  with a knob for each
* :mod:`~kimilab.traffic.trace`      — Mooncake jsonl export / load / validation, trace statistics
* :mod:`~kimilab.traffic.datasets`   — the traces in ``data/``: the real one (``REAL_TRACES``), the
  generated ones (``DATASETS``) and :func:`regenerate`
* :mod:`~kimilab.traffic.claude_code` — real agent sessions (Claude Code) in 512-token blocks, and the
  arrival process that puts them on one timeline
"""

from kimilab.traffic.claude_code import (CLAUDE_CODE, CLAUDE_CODE_SOURCE, SessionRequest, agent_requests,
                                         load_sessions)
from kimilab.traffic.datasets import DATASETS, MOONCAKE_CONVERSATION, REAL_TRACES, regenerate
from kimilab.traffic.generators import (agent_loops, chat_sessions, document_qa, mixed_workload,
                                        mooncake_conversation_like, zipf_prefixes)
from kimilab.traffic.request import DEFAULT_BLOCK_SIZE, Request
from kimilab.traffic.sharing import sharing_stats, sharing_traffic
from kimilab.traffic.trace import (check_chain, coarser_blocks, format_stats, load_trace, parse_line,
                                   reuse_upper_bound, to_trace, trace_stats, trace_to_jsonl, write_trace)

__all__ = [
    "Request",
    "DEFAULT_BLOCK_SIZE",
    "chat_sessions",
    "agent_loops",
    "document_qa",
    "mooncake_conversation_like",
    "mixed_workload",
    "zipf_prefixes",
    "sharing_stats", "sharing_traffic",
    "to_trace",
    "trace_to_jsonl",
    "write_trace",
    "parse_line",
    "load_trace",
    "check_chain", "coarser_blocks",
    "reuse_upper_bound",
    "trace_stats",
    "format_stats",
    "DATASETS",
    "REAL_TRACES",
    "MOONCAKE_CONVERSATION",
    "regenerate",
    "CLAUDE_CODE", "CLAUDE_CODE_SOURCE", "SessionRequest", "agent_requests", "load_sessions",
]
