"""Mooncake trace files: export, read and validate, and the statistics of a trace.

The Mooncake trace format (one JSON object a line) is what Moonshot published
for Kimi's serving platform (FAST'25)::

    {"timestamp": 0, "input_length": 1203, "output_length": 52, "hash_ids": [0, 1, 2]}

``hash_ids[j]`` names the whole prompt prefix up to and including block ``j``
(blocks of ``block_size`` tokens, the last one may be partial); ids are
assigned 0, 1, 2, ... in order of first appearance, so two requests share
``hash_ids[j]`` exactly when their first ``j + 1`` blocks are identical.

A trace line is a :class:`~kimilab.traffic.request.Request` with ``hash_ids``
and only the line's fields: ``request_id`` is its 0-based line number,
``arrival_ms`` its ``timestamp``. :func:`to_trace` of token-level requests and
:func:`load_trace` of the file :func:`write_trace` wrote give equal lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from kimilab.traffic.request import DEFAULT_BLOCK_SIZE, Request
from kimilab.traffic.sharing import sharing_stats
from kimilab.validate import check_int

__all__ = ["to_trace", "trace_to_jsonl", "write_trace", "parse_line", "load_trace", "check_chain",
           "coarser_blocks", "reuse_upper_bound", "trace_stats", "format_stats"]


def to_trace(requests: Iterable[Request], block_size: int = DEFAULT_BLOCK_SIZE) -> list[Request]:
    """Trace lines for token-level requests (chained ids, order of first appearance).

    Block ``j``'s id is looked up by (id of block ``j - 1``, the block's exact
    tokens), so equal ids mean equal prefixes with no hash collisions possible.
    Requests must come in non-decreasing arrival order.
    """
    block_size = check_int("block_size", block_size, 1)
    table: dict[tuple[int, bytes], int] = {}
    records = []
    last = 0
    for i, req in enumerate(requests):
        if req.arrival_ms < last:
            raise ValueError(
                f"requests[{i}].arrival_ms={req.arrival_ms} < previous {last}: expected "
                "requests in non-decreasing arrival order"
            )
        if req.tokens is None:
            raise ValueError(f"requests[{i}].tokens=None: expected token-level requests")
        last = req.arrival_ms
        tokens = req.tokens
        parent = -1
        ids = []
        for start in range(0, tokens.size, block_size):
            key = (parent, tokens[start:start + block_size].tobytes())
            parent = table.setdefault(key, len(table))
            ids.append(parent)
        records.append(Request(i, req.arrival_ms, req.input_length, req.output_length,
                               hash_ids=tuple(ids)))
    return records


def trace_to_jsonl(records: Iterable[Request]) -> str:
    """The exact text ``write_trace`` writes (one JSON object a line, '\\n' endings)."""
    return "".join(r.to_json() + "\n" for r in records)


def write_trace(path, records: Iterable[Request]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(trace_to_jsonl(records))
    return path


_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def parse_line(text: str, lineno: int = 1, block_size: int = DEFAULT_BLOCK_SIZE) -> Request:
    """One validated trace line; ValueError messages start with ``line {lineno}:``."""
    where = f"line {lineno}"
    if not text.strip():
        raise ValueError(f"{where}: empty line; expected one JSON object per line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to read; expected one flat object") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in _FIELDS:
        if name not in obj:
            raise ValueError(f"{where}: field '{name}' missing; required fields are {list(_FIELDS)}")
    values = {}
    for name in _FIELDS[:3]:
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: field '{name}'={v!r}: expected a non-negative int")
        if v < 0:
            raise ValueError(f"{where}: field '{name}'={v!r}: expected a non-negative int")
        values[name] = v
    if values["input_length"] == 0:
        raise ValueError(f"{where}: field 'input_length'=0: expected a prompt of at least one token")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"{where}: field 'hash_ids'={ids!r}: expected a list of non-negative ints")
    for j, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(
                f"{where}: field 'hash_ids'[{j}]={h!r}: expected a non-negative int"
            )
    expected = -(-values["input_length"] // block_size)
    if len(ids) != expected:
        raise ValueError(
            f"{where}: field 'hash_ids' has {len(ids)} ids; expected ceil(input_length="
            f"{values['input_length']} / block_size={block_size}) = {expected}"
        )
    return Request(lineno - 1, values["timestamp"], values["input_length"], values["output_length"],
                   hash_ids=tuple(ids))


def load_trace(path, block_size: int = DEFAULT_BLOCK_SIZE, *, require_sorted: bool = True,
               chained: bool = True) -> list[Request]:
    """Read and validate a Mooncake jsonl trace; any bad line raises ValueError naming it.

    Checks per line: valid JSON object, the four fields present, non-negative
    ints, ``len(hash_ids) == ceil(input_length / block_size)``, and (with
    ``require_sorted``) timestamps non-decreasing. Extra fields are ignored.
    With ``chained`` (the default, so every command that reads a trace judges it
    alike) also :func:`check_chain`: an id names one whole prefix, so a duplicate id
    in a request or an id under two parents is an error. Nothing is returned unless
    every line passed.
    """
    block_size = check_int("block_size", block_size, 1)
    records = []
    last = None
    with open(path, "r", encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            record = parse_line(text, lineno, block_size)
            if require_sorted and last is not None and record.arrival_ms < last:
                raise ValueError(
                    f"line {lineno}: field 'timestamp'={record.arrival_ms} < {last} on the "
                    "previous line; expected non-decreasing timestamps (require_sorted=False "
                    "to allow)"
                )
            last = record.arrival_ms
            records.append(record)
    if chained:
        check_chain(records)
    return records


def check_chain(records: Sequence[Request]) -> None:
    """Raise ValueError (naming the line) if an id ever has two different parents.

    In a chained trace an id stands for one whole prefix, so it always sits at
    the same block position behind the same parent id.
    """
    parent_of: dict[int, int] = {}
    where = lambda p: "at the start" if p == -1 else f"after {p}"  # noqa: E731
    for lineno, record in enumerate(records, start=1):
        parent = -1
        mine: set = set()
        for j, h in enumerate(record.hash_ids):
            if h in mine:
                raise ValueError(f"line {lineno}: field 'hash_ids'[{j}]={h} repeats an id of the same request; "
                                 "expected chained prefix ids (each names a different prefix)")
            mine.add(h)
            seen = parent_of.setdefault(h, parent)
            if seen != parent:
                raise ValueError(
                    f"line {lineno}: field 'hash_ids'[{j}]={h} is {where(parent)}, but an earlier "
                    f"line has it {where(seen)}; expected chained prefix ids"
                )
            parent = h
    return None


def coarser_blocks(records: Sequence[Request], block_size: int, new_block_size: int) -> list[Request]:
    """The same trace keyed in blocks of ``new_block_size`` tokens (a serving engine with larger blocks).

    A trace only knows prefixes at ``block_size`` resolution, so a coarse block that
    ends at token ``e`` is keyed by the fine block holding token ``e - 1``: two prompts
    share it when they share that whole fine block. A hit is counted only where the
    trace proves it, so it is never more than the engine's real hit (and can be one
    coarse block less). Ids still name whole prefixes, so siblings never collide.
    """
    block_size = check_int("block_size", block_size, 1, unit="tokens")
    new_block_size = check_int("new_block_size", new_block_size, block_size, unit="tokens (>= block_size)")
    out = []
    for i, r in enumerate(records):
        if r.hash_ids is None:
            raise ValueError(f"records[{i}].hash_ids=None: expected trace records with block ids")
        ids, n = r.hash_ids, r.input_length
        last = len(ids) - 1
        keys = tuple(ids[min((end - 1) // block_size, last)]
                     for end in range(new_block_size, n + new_block_size, new_block_size))
        out.append(Request(r.request_id, r.arrival_ms, n, r.output_length, hash_ids=keys,
                           session=r.session, tenant=r.tenant, kind=r.kind))
    return out


def reuse_upper_bound(records: Sequence[Request], block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Token-weighted hit rate of an infinite block cache (a workload property, not a cache).

    A block hits if its id appeared in any earlier request. Because ids are
    chained, a hit block's whole prefix hits too, so this is a prefix match.
    """
    seen: set[int] = set()
    hit = total = 0
    for r in records:
        for h, n in zip(r.hash_ids, r.block_lengths(block_size)):
            if h in seen:
                hit += int(n)
            total += int(n)
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def trace_stats(records: Sequence[Request], block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """Summary numbers of a trace: counts, length percentiles, shared first block, reuse bound, and its
    sharing structure (:func:`~kimilab.traffic.sharing.sharing_stats`: common, mid, turns, fresh_per_min)."""

    if not records:
        raise ValueError("records: expected a non-empty trace")
    inp = np.array([r.input_length for r in records], dtype=np.float64)
    out = np.array([r.output_length for r in records], dtype=np.float64)
    firsts = [r.hash_ids[0] for r in records if r.hash_ids]
    common = max(set(firsts), key=firsts.count) if firsts else None
    return {
        "requests": len(records),
        "duration_s": (records[-1].arrival_ms - records[0].arrival_ms) / 1000.0,
        "input_mean": float(inp.mean()),
        "input_p50": float(np.percentile(inp, 50)),
        "input_p99": float(np.percentile(inp, 99)),
        "input_max": int(inp.max()),
        "output_mean": float(out.mean()),
        "prompt_tokens": int(inp.sum()),
        "distinct_blocks": len({h for r in records for h in r.hash_ids}),
        "share_first_block": firsts.count(common) / len(records) if firsts else 0.0,
        "reuse_upper_bound": reuse_upper_bound(records, block_size),
        **{k: v for k, v in sharing_stats(records, block_size).items() if k in ("common", "mid", "turns",
                                                                                "fresh_per_min")},
    }


def format_stats(name: str, s: dict) -> str:
    """One line of ``trace_stats`` numbers, as ``python -m kimilab traces stats`` prints it."""
    return (
        f"{name}: requests={s['requests']} duration_s={s['duration_s']:.1f} "
        f"input mean={s['input_mean']:.0f} p50={s['input_p50']:.0f} p99={s['input_p99']:.0f} "
        f"max={s['input_max']} output mean={s['output_mean']:.1f} "
        f"prompt_tokens={s['prompt_tokens']} distinct_blocks={s['distinct_blocks']} "
        f"share_first_block={s['share_first_block']:.3f} "
        f"reuse_upper_bound={s['reuse_upper_bound']:.3f} "
        f"common={s['common']:.3f} mid={s['mid']:.3f} turns={s['turns']:.2f} "
        f"fresh_per_min={s['fresh_per_min']:.0f}"
    )
