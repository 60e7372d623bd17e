"""Which checkpoint policy wins for which sharing structure: a map over generated traffic, and a
rule that reads it (``prefix --policy auto``).

Chapter 6's ranking of checkpoint policies belongs to a trace's sharing structure
(:func:`~kimilab.traffic.sharing.sharing_stats`), not to the policies. :func:`policy_map`
replays every online cache the chapter compares (:data:`ONLINE`) and the clairvoyant
reference over a grid of :func:`~kimilab.traffic.sharing.sharing_traffic` knobs -- how many sessions
open with a common system prompt (:data:`COMMONS`) and how often a turn forks from inside
its previous prompt (:data:`FORKS`) -- in two session shapes (:data:`SHAPES`: chat, and
long agent sessions), each at three cache sizes given as *reach* (:data:`REACHES`): the
cache's tokens over the trace's new prefix tokens in a busy minute. Reach, not GB, so that
a trace of any volume finds its place on the map.

:func:`choose_policy` is the rule: measure a trace's statistics, find the mapped traces
nearest in all four, and pick the policy with the smallest mean gap to the best online
policy there, at the trace's reach. :func:`held_out` checks it on generated traffic the map
has not seen.
"""

from __future__ import annotations

import math

import numpy as np

from kimilab.config import preset
from kimilab.costs import deployment as named_deployment
from kimilab.parallel import default_workers, pool_map
from kimilab.sim.loop import simulate
from kimilab.sim.rekey import rekey
from kimilab.sim.sweep import build_cache, cache_block
from kimilab.traffic.sharing import sharing_stats, sharing_traffic
from kimilab.validate import check_choice, check_int

__all__ = ["ONLINE", "CLAIRVOYANT", "SHAPES", "REACHES", "COMMONS", "FORKS", "MAP_ARGS", "map_point",
           "policy_map", "shipped_map", "choose_policy", "held_out", "reach_minutes", "regime", "TIE", "BRANCH",
           "BOUNDARY", "grid_cells", "mean_hits", "ends_gap", "seed_spread", "cell_summary"]

ONLINE = ("ends", "ends+branch", "dual", "marconi", "vllm-align", "sglang-no-buffer", "sglang-extra-buffer")
CLAIRVOYANT = "oracle"
SHAPES = {  # knobs of sharing_traffic besides common and fork
    "chat": {"mean_turns": 2.0},  # the Kimi conversation trace's turns and prompts (chapter 6)
    # tool loops on long contexts: the Claude Code sessions' turns and prompts
    "agent": {"mean_turns": 60.0, "opening_median": 25_000.0, "user_len": 3000.0, "reply_len": 300.0,
              "think_ms": 3000.0, "requests_per_s": 5.0, "document_prob": 0.0,
              "max_input": 400_000, "fork_returns": True},
}
REACHES = (1.0, 3.0, 9.0)  # minutes of busy-minute new prefix tokens the cache holds
COMMONS = (0.0, 0.25, 0.5, 0.75, 1.0)
FORKS = (0.0, 0.1, 0.25, 0.5, 0.8)
MAP_ARGS = {"shapes": list(SHAPES), "commons": list(COMMONS), "forks": list(FORKS), "reaches": list(REACHES),
            "seeds": [0, 1], "duration_s": 1200.0, "deployment": "vllm-tp4-h200", "model": "kimi_linear_48b"}
NEIGHBOURS = 4  # mapped traces the rule averages over
TIE = 0.01  # usable-hit difference the map calls a tie (or a cell's seed spread, where larger: see regime)
BRANCH = ("ends+branch", "dual", "marconi")  # states at request ends and at branch points
BOUNDARY = ("vllm-align", "sglang-no-buffer", "sglang-extra-buffer")  # states at prefill-chunk boundaries too


def reach_minutes(capacity_tokens: float, stats: dict) -> float:
    """How many busy minutes of new prefixes a cache of ``capacity_tokens`` holds."""
    return capacity_tokens / max(stats["fresh_per_min"], 1.0)


def _hit(records, name: str, capacity_tokens: int, deployment, config) -> float:
    block = cache_block(name, config, deployment, 512)
    cache_records = records if block == 512 else rekey(records, 512, block)
    cache = build_cache(name, cache_records, config, deployment, block_size=512, capacity_tokens=capacity_tokens)
    return simulate(cache_records, cache=cache).usable_hit_rate


def map_point(shape: str, common: float, fork: float, reaches, *, seed: int = 0, duration_s: float = 1200.0,
              deployment: str = MAP_ARGS["deployment"], model: str = MAP_ARGS["model"], knobs=None) -> dict:
    """One generated trace's statistics and every cache's usable hit at each reach (a map point)."""
    check_choice("shape", shape, tuple(SHAPES))
    records = sharing_traffic(seed, common=common, fork=fork, duration_s=duration_s,
                              **{**SHAPES[shape], **dict(knobs or {})})
    stats = sharing_stats(records)
    dep = named_deployment(deployment)
    rows = []
    for reach in reaches:
        capacity = int(reach * stats["fresh_per_min"])
        hits = {name: round(_hit(records, name, capacity, dep, preset(model)), 6) for name in ONLINE + (CLAIRVOYANT,)}
        rows.append({"reach": reach, "capacity_tokens": capacity, "hits": hits})
    return {"shape": shape, "common_knob": common, "fork_knob": fork, "seed": seed, "knobs": dict(knobs or {}),
            "stats": {k: round(float(v), 6) for k, v in stats.items()}, "at": rows}


def _run(args) -> dict:
    kwargs = dict(args)
    return map_point(kwargs.pop("shape"), kwargs.pop("common"), kwargs.pop("fork"), kwargs.pop("reaches"), **kwargs)


def _pool_map(jobs: list[dict], workers: int | None) -> list[dict]:
    workers = check_int("workers", default_workers(len(jobs)) if workers is None else workers, 1)
    return pool_map(_run, jobs, workers)


def policy_map(shapes, commons, forks, reaches, *, seeds=(0,), duration_s: float = 1200.0,
               deployment: str = MAP_ARGS["deployment"], model: str = MAP_ARGS["model"],
               workers: int | None = None) -> list[dict]:
    """Every (shape, common, fork, seed) grid point's :func:`map_point`, on up to two processes."""
    jobs = [{"shape": s, "common": c, "fork": f, "reaches": list(reaches), "seed": seed, "duration_s": duration_s,
             "deployment": deployment, "model": model} for s in shapes for c in commons for f in forks
            for seed in seeds]
    return _pool_map(jobs, workers)


def shipped_map() -> list[dict]:
    """The map chapter 6 draws, read from ``data/results`` when current (:mod:`kimilab.stored`)."""
    from kimilab.stored import stored

    return stored("ch6_policy_map", policy_map, **MAP_ARGS)


def _best(hits: dict) -> float:
    return max(hits[name] for name in ONLINE)


def grid_cells(points: list[dict]) -> dict:
    """The map's points by grid cell: ``{(shape, common knob, fork knob): [one point per seed]}``."""
    cells: dict = {}
    for p in points:
        cells.setdefault((p["shape"], p["common_knob"], p["fork_knob"]), []).append(p)
    return cells


def mean_hits(group: list[dict], i: int) -> dict:
    """Usable hit per cache at the ``i``-th mapped reach, averaged over a cell's seeds."""
    return {name: float(np.mean([p["at"][i]["hits"][name] for p in group])) for name in ONLINE + (CLAIRVOYANT,)}


def ends_gap(hits: dict) -> float:
    """How far request-end states alone fall below the best online policy (usable hit)."""
    return _best(hits) - hits["ends"]


def seed_spread(group: list[dict], i: int) -> float:
    """How much :func:`ends_gap` differs between a cell's seeds: below it, a difference is a tie."""
    gaps = [ends_gap(p["at"][i]["hits"]) for p in group]
    return max(gaps) - min(gaps)


def regime(group: list[dict], i: int) -> str:
    """``ends`` where request-end states alone are within the tie (:data:`TIE`, or the cell's seed
    spread if larger) of the best online policy, else ``branch`` where a branch-point policy is,
    else ``boundary``: only states at chunk boundaries reach the reuse."""
    hits, tie = mean_hits(group, i), max(TIE, seed_spread(group, i))
    if ends_gap(hits) <= tie:
        return "ends"
    return "branch" if max(hits[name] for name in BRANCH) >= _best(hits) - tie else "boundary"


def cell_summary(points: list[dict]) -> list[dict]:
    """One row per grid cell and mapped reach, seeds averaged: where the cell lies (mean ``common`` and
    ``mid``), the best online policy, the :func:`regime`, :func:`ends_gap`, the best online policy's
    share of the clairvoyant cache's hits, and the :func:`seed_spread`."""
    rows = []
    for (shape, common, fork), group in grid_cells(points).items():
        for i, at in enumerate(group[0]["at"]):
            hits = mean_hits(group, i)
            rows.append({"shape": shape, "common_knob": common, "fork_knob": fork, "reach": at["reach"],
                         "common": float(np.mean([p["stats"]["common"] for p in group])),
                         "mid": float(np.mean([p["stats"]["mid"] for p in group])),
                         "best": max(ONLINE, key=lambda name: (hits[name], -ONLINE.index(name))),
                         "regime": regime(group, i), "ends_gap": ends_gap(hits),
                         "of_clairvoyant": _best(hits) / hits[CLAIRVOYANT], "spread": seed_spread(group, i)})
    return rows


def _panel_weights(reach: float, reaches: list[float]) -> list[tuple[int, float]]:
    """Interpolation weights over the map's reaches, linear in log reach, clamped to its ends."""
    order = sorted(range(len(reaches)), key=lambda i: reaches[i])
    r = min(max(reach, reaches[order[0]]), reaches[order[-1]])
    for lo, hi in zip(order, order[1:]):
        if reaches[lo] <= r <= reaches[hi]:
            w = math.log(r / reaches[lo]) / math.log(reaches[hi] / reaches[lo])
            return [(lo, 1.0 - w), (hi, w)]
    return [(order[0], 1.0)]


def _features(stats: dict) -> np.ndarray:
    return np.array([stats["common"], stats["mid"], math.log(max(stats["turns"], 1e-9)),
                     math.log(max(stats["prompt"], 1e-9))])


def choose_policy(stats: dict, capacity_tokens: float, points: list[dict]) -> tuple[str, str]:
    """The online policy the map says wins for a trace with ``stats`` and a cache of ``capacity_tokens``,
    and one sentence saying why.

    The mapped traces nearest to the trace are the :data:`NEIGHBOURS` closest in (common, mid, log
    turns, log prompt), each scaled by its spread over the map; their gaps to the best online policy
    are interpolated in log reach between the two nearest mapped reaches, and the policy with the
    smallest mean gap wins. (Chosen by leave-one-out on the map's own cells; chapter 6 tests it on
    held-out traffic.)
    """
    table = np.array([_features(p["stats"]) for p in points])
    spread = table.std(axis=0)
    spread[spread == 0] = 1.0
    distance = np.sqrt((((table - _features(stats)) / spread) ** 2).sum(axis=1))
    near = [points[i] for i in np.argsort(distance, kind="stable")[:NEIGHBOURS]]
    reach = reach_minutes(capacity_tokens, stats)
    reaches = [row["reach"] for row in near[0]["at"]]
    weights = _panel_weights(reach, reaches)
    gaps = {name: float(np.mean([sum(w * (_best(p["at"][i]["hits"]) - p["at"][i]["hits"][name])
                                     for i, w in weights) for p in near])) for name in ONLINE}
    policy = min(ONLINE, key=lambda name: (gaps[name], ONLINE.index(name)))
    where = " and ".join(f"{reaches[i]:g}" for i, w in weights if w > 0)
    shapes = ", ".join(f"{n} {s}" for s in SHAPES for n in [sum(p["shape"] == s for p in near)] if n)
    why = (f"common {stats['common']:.2f}, mid {stats['mid']:.2f}, turns {stats['turns']:.1f}, prompt "
           f"{stats['prompt']:,.0f} tokens, reach {reach:.2f} min -> at the {len(near)} nearest mapped traces "
           f"({shapes}) at reach {where} min, {policy} is {gaps[policy]:.3f} below the best online policy on "
           f"average (ends: {gaps['ends']:.3f})")
    return policy, why


def held_out(n: int = 12, *, seed: int = 1, duration_s: float = 1200.0,
             deployment: str = MAP_ARGS["deployment"], model: str = MAP_ARGS["model"],
             workers: int | None = None, points: list[dict] | None = None) -> list[dict]:
    """``n`` generated points off the map's grid (every knob drawn at random, other seeds and reaches):
    the rule's choice at each (read from ``points``, default :func:`shipped_map`), its usable hit and
    the best online policy's."""
    points = shipped_map() if points is None else points
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        shape = list(SHAPES)[i % len(SHAPES)]
        base = SHAPES[shape]
        knobs = {"mean_turns": float(base["mean_turns"] * rng.uniform(0.7, 1.5)),
                 "opening_median": float(base.get("opening_median", 4100.0) * rng.uniform(0.6, 1.6))}
        jobs.append({"shape": shape, "common": float(rng.uniform(0, 1)), "fork": float(rng.uniform(0, 0.8)),
                     "reaches": [float(np.exp(rng.uniform(np.log(0.8), np.log(12.0))))],
                     "seed": 1000 + i, "duration_s": duration_s, "deployment": deployment, "model": model,
                     "knobs": knobs})
    out = []
    for point in _pool_map(jobs, workers):
        row = point["at"][0]
        policy, why = choose_policy(point["stats"], row["capacity_tokens"], points)
        hits = row["hits"]
        best = max(ONLINE, key=lambda name: hits[name])
        out.append({**{k: point[k] for k in ("shape", "common_knob", "fork_knob", "knobs", "stats")},
                    "reach": row["reach"], "chosen": policy, "chosen_hit": hits[policy], "best": best,
                    "best_hit": hits[best], "gap": round(hits[best] - hits[policy], 6), "why": why, "hits": hits})
    return out
