"""Sharing statistics of a trace, the generated family with a knob for each, and the rule that reads the
policy map (chapter 6)."""

from __future__ import annotations

import pytest

from kimilab.sim.policy_map import CLAIRVOYANT, ONLINE, choose_policy, reach_minutes
from kimilab.traffic import Request
from kimilab.traffic.sharing import COMMON_BRANCHES, sharing_stats, sharing_traffic

B = 512


def req(i, ids, tokens=None, t=None):
    n = len(ids) * B if tokens is None else tokens
    return Request(i, 1000 * i if t is None else t, n, 10, hash_ids=tuple(ids))


def test_stats_by_hand():
    records = [req(0, [1, 2]),  # opens a session
               req(1, [1, 2, 3]),  # continues it: reuse ends at request 0's end
               req(2, [1, 4]),  # forks inside request 1's prompt: block 1 is reused past no request end
               req(3, [9])]  # a new session with its own first block
    s = sharing_stats(records, B)
    assert s["requests"] == 4
    assert s["reuse"] == pytest.approx(3 / 8)  # blocks 1, 2 of request 1 and block 1 of request 2
    assert s["mid"] == pytest.approx(1 / 3)  # request 2's block 1: no earlier request ends there
    assert s["turns"] == pytest.approx(4 / 3)  # sessions: {0, 1}, {2}, {3}
    assert s["common"] == 0.0  # block 1 is followed by two different second blocks only
    assert s["prompt"] == pytest.approx(8 * B / 4)
    assert s["fresh_per_min"] == 5 * B  # every request arrives in the first minute; 5 new blocks


def test_common_prefix_is_a_first_block_many_conversations_go_on_from():
    system = [req(i, [1, 100 + i, 200 + i]) for i in range(COMMON_BRANCHES)]  # one opening, 8 ways on
    own = [req(COMMON_BRANCHES + i, [2, 300, 400 + i]) for i in range(5)]  # one session's forks
    s = sharing_stats(system + own, B)
    assert s["common"] == pytest.approx(COMMON_BRANCHES / (COMMON_BRANCHES + 5))
    assert sharing_stats(system[:-1] + own, B)["common"] == 0.0  # seven ways on: not yet common


def test_request_end_is_its_last_whole_block():
    """A prompt ending inside a block: the next turn can only resume at its last whole block."""
    records = [req(0, [1, 2], tokens=B + 100), req(1, [1, 3, 4])]
    s = sharing_stats(records, B)
    assert s["mid"] == 0.0 and s["reuse"] == pytest.approx(B / (B + 100 + 3 * B))


def test_stats_refuse_an_empty_trace():
    with pytest.raises(ValueError, match="records"):
        sharing_stats([])


def test_generated_family_knobs_move_their_statistics():
    base = sharing_traffic(3, duration_s=300)
    assert base == sharing_traffic(3, duration_s=300)  # seeded
    alone = sharing_stats(sharing_traffic(3, common=0.0, duration_s=300))
    shared = sharing_stats(sharing_traffic(3, common=1.0, duration_s=300))
    assert alone["common"] == 0.0 and shared["common"] == 1.0
    still = sharing_stats(sharing_traffic(3, fork=0.0, duration_s=300))
    forking = sharing_stats(sharing_traffic(3, fork=0.8, duration_s=300))
    assert forking["mid"] > still["mid"] + 0.3
    assert forking["turns"] < still["turns"]  # a fork starts a new chain of turns


@pytest.mark.parametrize("name,value", [("common", 1.5), ("fork", -0.1), ("duration_s", 1e9), ("mean_turns", 0.5)])
def test_generated_family_names_a_bad_knob(name, value):
    with pytest.raises(ValueError, match=name):
        sharing_traffic(0, **{name: value})


def _point(shape, common, mid, turns, prompt, hits_by_reach):
    at = [{"reach": r, "capacity_tokens": int(r * 1000), "hits": {n: hits.get(n, 0.0) for n in ONLINE + (CLAIRVOYANT,)}}
          for r, hits in hits_by_reach]
    return {"shape": shape, "stats": {"common": common, "mid": mid, "turns": turns, "prompt": prompt,
                                      "fresh_per_min": 1000.0}, "at": at}


def test_rule_reads_the_nearest_shape_reach_and_points():
    ends_wins = {"ends": 0.5, "vllm-align": 0.4}
    align_wins = {"ends": 0.3, "vllm-align": 0.4}
    points = [_point("chat", c, m, 2.0, 10_000, [(1.0, ends_wins if m < 0.3 else align_wins), (9.0, ends_wins)])
              for c in (0.0, 1.0) for m in (0.0, 0.1, 0.5, 0.6)]
    points += [_point("agent", c, m, 30.0, 100_000, [(1.0, align_wins), (9.0, align_wins)])
               for c in (0.0, 1.0) for m in (0.0, 0.5)]
    chat = {"common": 0.9, "mid": 0.55, "turns": 2.2, "prompt": 12_000, "fresh_per_min": 1000.0}
    assert choose_policy(chat, 1000, points)[0] == "vllm-align"  # near the forking chat points, reach 1
    assert choose_policy(chat, 20_000, points)[0] == "ends"  # reach 20 min: the 9-minute panel
    assert choose_policy({**chat, "mid": 0.02}, 1000, points)[0] == "ends"
    agent = {**chat, "mid": 0.02, "turns": 25.0, "prompt": 120_000}
    policy, why = choose_policy(agent, 1000, points)
    assert policy == "vllm-align" and "agent" in why and "reach 1" in why
    assert reach_minutes(3000, chat) == 3.0
