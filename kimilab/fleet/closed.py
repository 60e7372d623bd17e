"""Agent sessions replayed closed-loop: each request is sent when the reply it waited for is done.

The recorded Claude Code sessions (:func:`kimilab.traffic.load_sessions`) say when each
request was sent (``t_ms``) and how long the recording's server took to answer it
(``api_ms``); a request was sent after the latest reply it could have seen plus the
user's or tool's *think time*. A closed-loop replay keeps that causality and lets the
simulated server set the pace, as the sessions' own replay tool does
(kv-cache-tester's ``trace_replay_tester.py``, default ``--timing-strategy think-only``:
the next request fires a recorded think time after the previous reply, capped at
``--max-delay`` 60 s):

* a request *waits for* the latest earlier request of its session whose recorded reply
  had arrived by the time it was sent (1 s of slack for the recording's whole-second
  timestamps), or for the session's start if none had;
* its think time is the recorded gap between that reply and its sending, capped at 60 s
  (within 0.33 s, on average, of the think times the original files record).

Sub-agents are requests of the same session and wait by the same rule, so parallel
sub-agents run in parallel. ``concurrency`` sessions run at once: each of that many slots
plays sessions back to back (the tool's ``--recycle``), every replay of a session with
fresh block ids, slot starts spread over the first minute.

Time advances engine by engine: the one furthest behind runs until the next arrival, its
first finish, or ``lookahead_s`` (0.25 s) past the next engine's clock. A follow-up can
find the engine it is routed to already past its send time only if its think time is
shorter than that lookahead plus a step: 0.5% of the recorded think times are under 0.25 s.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from kimilab.engine import Live
from kimilab.traffic import Request
from kimilab.validate import check_float, check_int

__all__ = ["Turn", "MAX_THINK_S", "session_turns", "run_closed_loop"]

MAX_THINK_S = 60.0  # kv-cache-tester's --max-delay default
_SLACK_MS = 1000  # the recording's timestamps are whole seconds


@dataclass(frozen=True)
class Turn:
    """One request of a session: what it sends, and which earlier request (-1: the session's
    start) it waits for, plus its think time."""

    input_length: int
    output_length: int
    hash_ids: tuple
    after: int
    think_s: float


def session_turns(rows) -> list[list[Turn]]:
    """Every session of ``rows`` (:class:`kimilab.traffic.SessionRequest`) as turns, in recorded order."""
    by: dict = {}
    for r in rows:
        by.setdefault(r.session, []).append(r)
    out = []
    for s in sorted(by):
        reqs = sorted(by[s], key=lambda r: r.t_ms)  # stable: ties keep the file's order
        turns = []
        for j, r in enumerate(reqs):
            dep, done = -1, 0
            for i in range(j):
                d = reqs[i].t_ms + reqs[i].api_ms
                if d <= r.t_ms + _SLACK_MS and (dep < 0 or d >= done):
                    dep, done = i, d
            think = min(max(0.0, (r.t_ms - done) / 1000.0), MAX_THINK_S)
            turns.append(Turn(r.input_length, r.output_length, r.hash_ids, dep, think))
        out.append(turns)
    return out


def run_closed_loop(fleet, sessions: list[list[Turn]], *, concurrency: int, duration_s: float,
                    seed: int = 0, start_spread_s: float = 60.0, lookahead_s: float = 0.25,
                    guard=None):
    """Serve ``concurrency`` sessions at a time on ``fleet`` for ``duration_s`` simulated seconds (no
    request is sent after that; those in flight finish). Returns the fleet's result."""
    from kimilab.fleet.result import FleetResult
    import time

    concurrency = check_int("concurrency", concurrency, 1, unit="sessions")
    duration_s = check_float("duration_s", duration_s, minimum=0.0)
    lookahead_s = check_float("lookahead_s", lookahead_s, minimum=0.0)
    if not sessions:
        raise ValueError("sessions: expected at least one session")
    wall = time.perf_counter()
    order = np.random.default_rng(seed).permutation(len(sessions))
    id_span = 1 + max((max(t.hash_ids) for s in sessions for t in s if t.hash_ids), default=0)
    heap: list = []  # (due s, serial, slot, replay, turn index)
    serial = 0
    replays = 0
    state: dict = {}  # replay -> [turns, slot, turns finished, follow-ups by turn, id shift]
    next_id = 0

    def start(slot: int, t: float) -> None:
        nonlocal replays, serial
        k = replays
        replays += 1
        turns = sessions[order[k % len(sessions)]]
        followers: dict = {}
        for j, turn in enumerate(turns):
            followers.setdefault(turn.after, []).append(j)
        state[k] = [turns, slot, 0, followers, (k // len(sessions)) * id_span]
        for j in followers.get(-1, []):
            serial += 1
            heapq.heappush(heap, (t + turns[j].think_s, serial, k, j))

    for slot in range(concurrency):
        start(slot, start_spread_s * slot / concurrency)
    seen = [0] * len(fleet.instances)
    finished_ids: dict = {}

    def collect(now: float) -> None:
        nonlocal serial
        for e in fleet.instances:
            fin = e.finished
            for f in fin[seen[e.index]:]:
                k, j = finished_ids.pop(f.request_id)
                st = state[k]
                st[2] += 1
                for nxt in st[3].get(j, []):
                    serial += 1
                    heapq.heappush(heap, (f.finish_s + st[0][nxt].think_s, serial, k, nxt))
                if st[2] == len(st[0]):  # the session is over: its slot starts the next one
                    del state[k]
                    if now < duration_s:
                        start(st[1], now)
            seen[e.index] = len(fin)

    engines = fleet.instances
    handoffs = getattr(fleet, "next_handoff_s", None)  # a disaggregated fleet's contexts in flight
    while True:
        due = heap[0][0] if heap else math.inf
        hand = handoffs() if handoffs is not None else math.inf
        busy = [e for e in engines if e.alive and (e.running or len(e.queue))]
        if busy:
            # advance the engine furthest behind, no further than the next arrival (or hand-over) or
            # lookahead_s past the next-furthest-behind engine (whose finishes may send it a
            # follow-up), stopping at a finish
            busy.sort(key=lambda e: (e.clock, e.index))
            e = busy[0]
            nxt = min(due, hand)
            if e.clock < nxt:
                until = min(nxt, busy[1].clock + lookahead_s) if len(busy) > 1 else nxt
                e.advance(until if until > e.clock else e.clock + 1e-12, stop_on_finish=True)
                collect(e.clock)
                continue
        elif due >= duration_s and hand == math.inf:
            break
        if hand <= due:  # a prefilled context reaches the decode side before the next request
            for e in engines:
                if e.alive and e.clock < hand:
                    e.advance(hand)
            collect(hand)
            fleet.deliver_next()
            continue
        due, _, k, j = heapq.heappop(heap)
        for e in engines:  # idle engines wait at the arrival (busy ones are there already)
            if e.alive and e.clock < due:
                e.advance(due)
        collect(due)
        if due >= duration_s:
            continue  # the window is over: nothing more is sent
        turns, _, _, _, shift = state[k]
        turn = turns[j]
        req = Request(next_id, int(round(1000 * due)), turn.input_length, turn.output_length,
                      hash_ids=tuple(h + shift for h in turn.hash_ids), session=k, tenant="agent",
                      kind="agent")
        finished_ids[next_id] = (k, j)
        next_id += 1
        fleet._route(Live(req, due), due)
        if guard is not None and guard.check(fleet):
            res = FleetResult.of(fleet, next_id, time.perf_counter() - wall)
            res.aborted = True
            return res
    return FleetResult.of(fleet, next_id, time.perf_counter() - wall)
