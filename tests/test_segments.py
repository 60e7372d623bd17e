"""Segment caches (Marconi, the oracle, SGLang's pools) equal a slow block-by-block twin, and keep their books."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples
import prefix_traffic as traffic
from prefix_traffic import requests_from

from kimilab.config import kimi_linear_48b
from kimilab.costs import ONE_H200, VLLM_TP4_H200, CacheCosts
from kimilab.prefix import Placement, make_policy
from kimilab.prefix.blocks import split_prompt
from kimilab.prefix.marconi import ALPHA_GRID, marconi_cache, normalise
from kimilab.prefix.oracle import FutureIndex, OraclePolicy, oracle_cache
from kimilab.prefix.precision import checkpoint_bytes
from kimilab.prefix.segments import LRUScorer, SegmentCache

CFG = kimi_linear_48b
BS = 512
DEP = VLLM_TP4_H200  # a checkpoint is 3 pages of 512 tokens here


def _requests(turns):
    return requests_from(turns, BS)


def conversations():
    return traffic.conversations(max_turns=35, max_fresh=8, max_new=6)


class SlowTwin:
    """The same cache, one dict entry per block and a plain loop over every unit for each eviction."""

    def __init__(self, kind, *, capacity_blocks, alpha=0.0, prompts=None, share=None, policy=None):
        self.kind, self.alpha = kind, alpha
        self.costs = CacheCosts.of(CFG, DEP)
        self.ck = checkpoint_bytes(CFG, DEP)
        self.page = BS * self.costs.kv_bytes_per_token
        if share is None:
            self.kv_free, self.states_free, self.ck_pages = capacity_blocks, None, -(-self.ck // self.page)
        else:
            total = capacity_blocks * BS * self.costs.kv_bytes_per_token
            self.kv_free, self.ck_pages = int(total * (1 - share) // self.page), 0
            self.states_free = int(total * share // self.ck)
        self.future = FutureIndex(prompts) if prompts is not None else None
        self.policy = policy or (OraclePolicy(self.future) if kind == "oracle" else make_policy("ends+branch"))
        self.blocks = {}  # path tuple of keys -> {"state": bool, "last": float, "serial": int}
        self.tick, self.clock, self.serial = 0.0, 0, 0

    def children(self, p):
        return [q for q in self.blocks if len(q) == len(p) + 1 and q[:-1] == p]

    def start(self, p):
        q = p[:-1]
        while q and not self.blocks[q]["state"] and len(self.children(q)) < 2:
            q = q[:-1]
        return len(q)

    def flops(self, d):
        return float(self.costs.prefill_flops(d * BS))

    def victim(self, kind, pinned):
        cands = []  # (block, its record, FLOP efficiency)
        for p, b in self.blocks.items():
            if not b["state"] or p in pinned:
                continue
            nch = len(self.children(p))
            if (self.kind in ("marconi", "oracle") and nch > 1) or (kind == "kv" and nch):
                continue
            d = len(p)
            cands.append((p, b, (self.flops(d) - self.flops(self.start(p))) / (self.ck + self.page * d)))
        if not cands:
            return None
        if self.kind == "marconi":
            eff = normalise(np.array([c[2] for c in cands]))
            rec = normalise(np.array([1.0 / max(self.tick - c[1]["last"], 1e-9) for c in cands]))
            score = list(self.alpha * eff + rec)
        elif self.kind == "oracle":
            now = self.clock - 1
            nxt = [self.future.next_after(c[0][-1], now) for c in cands]
            score = [0.0 if t == float("inf") else c[2] / max(t - now, 1) for c, t in zip(cands, nxt)]
        else:
            score = [c[1]["last"] for c in cands]
        i = min(range(len(cands)), key=lambda i: (score[i], cands[i][1]["last"], cands[i][1]["serial"]))
        return cands[i][0]

    def evict(self, p, pinned=()):
        b = self.blocks[p]
        b["state"] = False
        self.give()
        if self.children(p):
            if self.kind == "marconi" and len(self.children(p)) == 1:
                q = self.children(p)[0]
                while not self.blocks[q]["state"] and len(self.children(q)) == 1:
                    q = self.children(q)[0]
                if self.blocks[q]["state"]:
                    self.blocks[q]["last"] = max(self.blocks[q]["last"], b["last"])
            return
        self.prune(p, pinned)

    def prune(self, p, pinned=()):
        """Delete stateless leaves upward (a pinned block waits until its request is done)."""
        while p and p in self.blocks and p not in pinned and not self.blocks[p]["state"] and not self.children(p):
            del self.blocks[p]
            self.kv_free += 1
            p = p[:-1]

    def give(self):
        if self.states_free is None:
            self.kv_free += self.ck_pages
        else:
            self.states_free += 1

    def reclaim(self, blocks, states, pinned):
        """Evict for the request; then how many blocks and states fit (all, unless everything else is pinned)."""
        split = self.states_free is not None
        need_kv = blocks + (0 if split else states * self.ck_pages)
        if self.kv_free < need_kv or (split and self.states_free < states):
            self.tick += 1
        while self.kv_free < need_kv and (p := self.victim("kv" if split else "any", pinned)) is not None:
            self.evict(p, pinned)
        while split and self.states_free < states and (p := self.victim("state", pinned)) is not None:
            self.evict(p, pinned)
        got = min(blocks, self.kv_free)
        return got, min(states, self.states_free if split else (self.kv_free - got) // self.ck_pages)

    def serve(self, ids, n):
        keys, _, _ = split_prompt(ids, n, None, BS, False)
        self.clock += 1
        self.tick += 1
        if self.kind == "oracle":
            self.policy.begin(self.clock - 1, keys)
        m = 0
        while m < len(keys) and tuple(keys[: m + 1]) in self.blocks:
            m += 1
        limit = n - 1
        usable = max([d for d in range(1, m + 1) if self.blocks[tuple(keys[:d])]["state"] and d * BS <= limit],
                     default=0)
        if usable and self.kind == "marconi":
            self.blocks[tuple(keys[:usable])]["last"] = self.tick
        branch = 0 < m < len(keys) and bool(self.children(tuple(keys[:m])))
        wanted = [i + 1 for i in self.policy.positions(Placement(range(BS, (len(keys) + 1) * BS, BS), m,
                                                                  usable * BS, n, branch))
                  if i + 1 > usable and not (i + 1 <= m and self.blocks[tuple(keys[: i + 1])]["state"])]
        pinned = {tuple(keys[:d]) for d in range(1, m + 1)}
        q = tuple(keys[:m])  # the rest of the segment the match stops inside
        while q and not self.blocks[q]["state"] and len(self.children(q)) == 1:
            q = self.children(q)[0]
            pinned.add(q)
        self.tick += 2
        new = max([d for d in wanted if d > m], default=m) - m
        got, n_states = self.reclaim(new, len(wanted), pinned)
        if got < new or n_states < len(wanted):
            wanted = [d for d in wanted[:n_states] if d <= m + got]
            new = max([d for d in wanted if d > m], default=m) - m
        for d in range(m + 1, m + new + 1):
            self.blocks[tuple(keys[:d])] = {"state": False, "last": 0.0, "serial": 0}
            self.kv_free -= 1
        for d in wanted:
            self.serial += 1
            self.blocks[tuple(keys[:d])].update(state=True, last=self.tick, serial=self.serial)
            if self.states_free is None:
                self.kv_free -= self.ck_pages
            else:
                self.states_free -= 1
        if self.kind == "sglang":
            for d in range(1, m + new + 1):
                b = self.blocks[tuple(keys[:d])]
                b["last"] = self.tick + d * 1e-9
        for q in sorted(pinned, key=len, reverse=True):
            self.prune(q)
        return m, usable * BS, tuple(d * BS for d in wanted)


def _fast(kind, capacity_blocks, alpha=0.0, prompts=None, share=None, policy=None):
    common = dict(deployment=DEP, block_size=BS, capacity_tokens=capacity_blocks * BS)
    if kind == "marconi":
        return marconi_cache(CFG, alpha=alpha, **common)
    if kind == "oracle":
        return oracle_cache(CFG, prompts, **common)
    return SegmentCache(CFG, policy, LRUScorer(), state_share=share, **common)


CASES = ["marconi-0", "marconi-1", "marconi-2", "oracle", "sglang-no", "sglang-extra"]


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=examples(60), deadline=None)
@given(turns=conversations(), capacity_blocks=st.integers(8, 120))
def test_every_outcome_equals_the_slow_twin(case, turns, capacity_blocks):
    records = _requests(turns)
    prompts = [split_prompt(r.hash_ids, r.input_length, None, BS, False)[0] for r in records]
    kind, alpha, share, policy = case.split("-")[0], 0.0, None, None
    if kind == "marconi":
        alpha = float(case.split("-")[1])
    if kind == "sglang":
        share = 0.9 / 1.9
        policy = make_policy("chunk-ends", interval=4 * BS, kv_boundary=case.endswith("extra"))
    fast = _fast(kind, capacity_blocks, alpha, prompts, share, policy)
    slow = SlowTwin(kind, capacity_blocks=capacity_blocks, alpha=alpha, prompts=prompts, share=share,
                    policy=make_policy("chunk-ends", interval=4 * BS, kv_boundary=case.endswith("extra"))
                    if kind == "sglang" else None)
    for r in records:
        out = fast.serve(r.hash_ids, r.input_length)
        assert (out.matched_blocks, out.usable_hit, out.checkpoint_positions) == slow.serve(r.hash_ids, r.input_length)
        fast.check_invariants()
        assert fast.kv_free == slow.kv_free and fast.n_checkpoints == sum(b["state"] for b in slow.blocks.values())


def test_sglang_pools_split_memory_at_its_ratio():
    cache = SegmentCache(CFG, make_policy("chunk-ends"), LRUScorer(), deployment=DEP, block_size=BS,
                         capacity_tokens=10**6, state_share=0.9 / 1.9)
    total = 10**6 * cache.costs.kv_bytes_per_token
    assert cache.state_slots == int(total * 0.9 / 1.9 // checkpoint_bytes(CFG, DEP))
    assert cache.n_pages == int(total / 1.9 // (BS * cache.costs.kv_bytes_per_token))
    int8 = SegmentCache(CFG, make_policy("chunk-ends"), LRUScorer(), deployment=DEP, block_size=BS,
                        capacity_tokens=10**6, state_share=0.9 / 1.9, precision="int8")
    assert int8.state_slots > 3 * cache.state_slots  # int8 states are 3.5x smaller than fp32 ones


def test_the_oracle_keeps_only_states_someone_will_resume_from():
    records = _requests([([0, 1, 2], 0), ([0, 1, 5], 0), ([7, 7], 0), ([0, 1, 2, 3], 0)])
    prompts = [list(r.hash_ids) for r in records]
    cache = oracle_cache(CFG, prompts, deployment=DEP, block_size=BS, capacity_tokens=10**6)
    outs = [cache.serve(r.hash_ids, r.input_length) for r in records]
    assert outs[0].checkpoint_positions == (2 * BS, 3 * BS)  # request 1 leaves [0, 1] there; request 3 resumes at 3
    assert outs[1].usable_hit == 2 * BS and outs[2].checkpoint_positions == ()  # nobody comes back to [7, 7]
    assert outs[3].usable_hit == 3 * BS


def test_marconi_tunes_alpha_once_its_bootstrap_window_closes():
    rng = np.random.default_rng(0)
    turns = [([int(x) for x in rng.integers(0, 3, rng.integers(2, 9))], 0) for _ in range(300)]
    records = _requests(turns)
    cache = marconi_cache(CFG, deployment=ONE_H200, block_size=BS, capacity_tokens=60 * BS, tuning_interval=50)
    for r in records:
        cache.serve(r.hash_ids, r.input_length)
    s = cache.scorer
    assert s.first_eviction_at is not None and s.tuned["at"] == 5 * s.first_eviction_at
    assert set(s.tuned["flops_saved"]) == set(ALPHA_GRID)
    best = max(s.tuned["flops_saved"].values())
    assert s.alpha == min(a for a, v in s.tuned["flops_saved"].items() if v == best)
    # the replay behind alpha=0.3 is a fresh cache at that alpha over the same window
    twin = marconi_cache(CFG, deployment=ONE_H200, block_size=BS, capacity_tokens=60 * BS, alpha=0.3)
    window = records[: s.tuned["at"]]
    outs = [twin.serve(r.hash_ids, r.input_length) for r in window]
    saved = sum(twin.costs.flops_saved(r.input_length, o.usable_hit) for r, o in zip(window[-50:], outs[-50:]))
    assert saved == s.tuned["flops_saved"][0.3]


def test_bad_arguments_name_what_is_expected():
    with pytest.raises(ValueError, match="state_share"):
        SegmentCache(CFG, make_policy("ends"), LRUScorer(), deployment=DEP, block_size=BS, capacity_tokens=10**6,
                     state_share=1.5)
    with pytest.raises(ValueError, match="policy"):
        SegmentCache(CFG, make_policy("kv-only"), LRUScorer(), deployment=DEP, block_size=BS, capacity_tokens=10**6)
    with pytest.raises(ValueError, match="precision"):
        marconi_cache(CFG, deployment=DEP, block_size=BS, capacity_tokens=10**6, precision="fp8")
    with pytest.raises(ValueError, match="alpha"):
        marconi_cache(CFG, deployment=DEP, block_size=BS, capacity_tokens=10**6, alpha=-1.0)
