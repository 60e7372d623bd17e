"""Real agent traffic: 80 Claude Code sessions, converted to the book's 512-token block form.

The sessions (``kv-cache-tester``'s ``traces/``, Apache-2.0; see ``data/README.md``) record
real coding-agent work: long contexts that grow turn by turn, tool calls, nested
sub-agents. Their block ids are 64-token, chained, and local to one session.
:func:`convert` turns them into one compact file, ``data/claude_code_sessions.jsonl.gz``
(byte for byte the same on every machine):

- ids become global (scoped to their session, numbered in order of first use);
- 64-token blocks become 512-token blocks only where all eight are present: a full
  512-token block is named by the id of its eighth 64-token block (a chained id names its
  whole prefix); a trailing partial block gets an id of its own that nothing else shares;
- a sub-agent's requests keep its parent's id space, with times made relative to the
  session's start.

Each line is one request: ``session``, ``agent`` (0: the main agent, k: the k-th sub-agent),
``t_ms`` (since the session's first request), ``api_ms`` (the time the recording's server
took to answer it), ``input_length``, ``output_length``, ``hash_ids``. The sessions carry no
absolute start times, so *when* they arrive is a modelling choice, made explicit by
:func:`agent_requests` (sessions starting as a Poisson process).
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kimilab.traffic.request import Request
from kimilab.validate import check_float, check_int

__all__ = ["CLAUDE_CODE", "CLAUDE_CODE_SOURCE", "SessionRequest", "convert", "write_sessions", "load_sessions",
           "agent_requests"]

CLAUDE_CODE = "claude_code_sessions.jsonl.gz"
# where the sessions come from, and what the converted file must be (tests/test_traffic.py checks)
CLAUDE_CODE_SOURCE = {
    "source": "https://github.com/callanjfox/kv-cache-tester",
    "path": "traces/ (80 of its 739 sessions, drawn at random with a fixed seed by the workplace)",
    "commit": "94f6046",
    "licence": "Apache-2.0 (data/LICENSE-claude-code-APACHE)",
    "sessions": 80,
    "requests": 5_668,
    "sha256": "4b28bd0db1db31b851bf4d0b1d6625d5b14484fdc0eb86dde4f150ef3fc06ea1",
}
_FINE, _COARSE = 64, 512


@dataclass(frozen=True)
class SessionRequest:
    """One request of one agent session, times relative to the session's start."""

    session: int
    agent: int
    t_ms: int
    api_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple


def _flatten(requests: list, offset_s: float, agent: int, out: list, counter: list) -> None:
    for r in requests:
        if r.get("type") == "subagent":
            counter[0] += 1
            _flatten(r["requests"], offset_s + float(r["t"]), counter[0], out, counter)
        else:
            out.append((offset_s + float(r["t"]), agent, r))


def convert(source_dir) -> list[SessionRequest]:
    """Every request of every ``trace_*.json.gz`` in ``source_dir`` (sessions in file-name order)."""
    files = sorted(Path(source_dir).glob("trace_*.json.gz"))
    if not files:
        raise ValueError(f"source_dir={str(source_dir)!r}: no trace_*.json.gz files")
    ids: dict = {}
    out = []
    for s, path in enumerate(files):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            session = json.load(f)
        if session.get("block_size") != _FINE:
            raise ValueError(f"{path.name}: block_size={session.get('block_size')!r}, expected {_FINE}")
        flat: list = []
        _flatten(session["requests"], 0.0, 0, flat, [0])
        flat.sort(key=lambda x: x[0])  # a stable sort: ties keep the recording's order
        t0 = flat[0][0] if flat else 0.0
        for t, agent, r in flat:
            n, fine = int(r["in"]), r["hash_ids"]
            coarse = []
            for j in range(-(-n // _COARSE)):
                full = _COARSE * (j + 1) <= n and len(fine) >= 8 * (j + 1)  # all eight 64-token blocks
                key = (s, fine[8 * j + 7]) if full else (s, "partial", len(out), j)
                coarse.append(ids.setdefault(key, len(ids)))
            api_ms = int(round(1000 * float(r.get("api_time", 0))))
            out.append(SessionRequest(s, agent, int(round(1000 * (t - t0))), api_ms, n, int(r["out"]), tuple(coarse)))
    return out


def write_sessions(rows: list[SessionRequest], path) -> Path:
    """One JSON object a line, gzip-compressed with no timestamp (so the bytes are reproducible)."""
    path = Path(path)
    text = "".join(json.dumps({"session": r.session, "agent": r.agent, "t_ms": r.t_ms, "api_ms": r.api_ms,
                               "input_length": r.input_length, "output_length": r.output_length,
                               "hash_ids": list(r.hash_ids)}, separators=(",", ":")) + "\n" for r in rows)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as f:
        f.write(text.encode("utf-8"))
    path.write_bytes(buf.getvalue())
    return path


def load_sessions(path) -> list[SessionRequest]:
    """The converted sessions back, each line checked (one id per 512 tokens); errors name the line.
    The file may be gzip-compressed (as :func:`write_sessions` writes it) or plain jsonl."""
    rows = []
    with open(path, "rb") as raw:
        packed = raw.read(2) == b"\x1f\x8b"  # gzip's magic number
    with (gzip.open(path, "rt", encoding="utf-8") if packed else open(path, encoding="utf-8")) as f:
        for lineno, text in enumerate(f, start=1):
            try:
                d = json.loads(text)
                row = SessionRequest(int(d["session"]), int(d["agent"]), int(d["t_ms"]), int(d["api_ms"]),
                                     int(d["input_length"]), int(d["output_length"]), tuple(d["hash_ids"]))
            except KeyError as err:
                raise ValueError(f"{path}: line {lineno}: field {err} missing; expected session, agent, t_ms, "
                                 "api_ms, input_length, output_length, hash_ids") from None
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}: line {lineno}: {err}") from None
            except RecursionError:
                raise ValueError(f"{path}: line {lineno}: JSON nested too deeply to read") from None
            if row.input_length < 1 or len(row.hash_ids) != -(-row.input_length // _COARSE):
                raise ValueError(f"{path}: line {lineno}: expected input_length >= 1 and one id per 512 tokens")
            rows.append(row)
    return rows


def agent_requests(rows: list[SessionRequest], sessions_per_s: float, *, seed: int = 0, n_sessions: int | None = None,
                   tenant: str = "agent") -> list[Request]:
    """Put the sessions on one timeline: session starts form a Poisson process of ``sessions_per_s``
    (sessions in a seeded random order, the first ``n_sessions`` of it, repeated if more are asked
    for, with fresh block ids per repeat); each request arrives at its session's start plus its
    recorded ``t_ms`` (open loop: the recorded pacing, whatever the server's speed)."""
    rate = check_float("sessions_per_s", sessions_per_s, minimum=0.0)
    if rate <= 0:
        raise ValueError(f"sessions_per_s={sessions_per_s!r}: expected a positive rate")
    by_session: dict = {}
    for r in rows:
        by_session.setdefault(r.session, []).append(r)
    rng = np.random.default_rng(check_int("seed", seed, 0))
    order = [list(by_session)[i] for i in rng.permutation(len(by_session))]
    n = len(order) if n_sessions is None else check_int("n_sessions", n_sessions, 1)
    starts = np.cumsum(rng.exponential(1.0 / rate, size=n))
    id_span = 1 + max((max(r.hash_ids) for r in rows if r.hash_ids), default=0)
    out = []
    for k in range(n):
        s = order[k % len(order)]
        shift = (k // len(order)) * id_span  # a repeat of a session shares nothing with the original
        for r in by_session[s]:
            out.append(Request(0, int(round(1000 * starts[k])) + r.t_ms, r.input_length, r.output_length,
                               hash_ids=tuple(h + shift for h in r.hash_ids), session=k, tenant=tenant,
                               kind="agent"))
    out.sort(key=lambda q: (q.arrival_ms, q.session))
    return [replace(q, request_id=i) for i, q in enumerate(out)]
