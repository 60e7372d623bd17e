"""RunPrefixCache (runs of blocks) is the exact twin of HybridPrefixCache (one node per block)."""

from contextlib import contextmanager

import pytest
from hypothesis import example, given, settings, strategies as st
from fuzzing import examples
from prefix_traffic import conversations, requests_from

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.costs import ONE_H200
from kimilab.prefix import POLICIES, Ends, HybridPrefixCache, RunPrefixCache, make_policy
from kimilab.sim import simulate
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

CFG = kimi_linear_48b
BS = 512  # a checkpoint is 11 pages here, so small pools hold a few and must evict them


TURNS = conversations(shorts=(0, 0, 1, BS - 1))  # a prompt may end anywhere in its last block


def _requests(turns):
    return requests_from(turns, BS)


POLICY_CHOICES = st.sampled_from(sorted(POLICIES) + ["align-2", "dual-50", "dual-interval", "deep-first"])


class DeepFirst(Ends):
    """A leaf's rank grows with its depth even without a checkpoint: no one-step tail eviction."""

    name = "deep-first"
    lru_leaves = False

    def kv_priority(self, cache, last_access, end, has_checkpoint):
        return last_access - end * 1e-7


def _policy(choice):
    if choice == "deep-first":
        return DeepFirst()
    options = {"align-2": ("align", {"interval": 2 * BS}), "dual-50": ("dual", {"alpha": 50.0}),
               "dual-interval": ("dual", {"interval": 3 * BS, "alpha": 1.0})}
    name, kwargs = options.get(choice, (choice, {}))
    return make_policy(name, **kwargs)


def _both(choice, capacity_tokens):
    """The block tree and its run twin, under one policy and budget."""
    kw = dict(deployment=ONE_H200, block_size=BS, capacity_tokens=capacity_tokens)
    return HybridPrefixCache.for_budget(CFG, _policy(choice), **kw), RunPrefixCache(CFG, _policy(choice), **kw)


# a trace on which queue order alone (not rank) once decided which checkpoint went first
TIE_TURNS = [([1, 1, 0, 0, 0, 0], 0), ([1, 0], 0), ([1, 1, 0, 0, 0, 0, 0], 0)] + [([0], 0)] * 18 + [([0, 0], 0)]


def _results(cache, turns):
    """Per request: the outcome, pages held, checkpoints admitted and evicted, blocks evicted."""
    evicted = (lambda: cache.tree.n_evicted) if hasattr(cache, "tree") else (lambda: cache.n_evicted)
    return [(cache.serve(r.hash_ids, r.input_length), cache.kv_pages, cache.checkpoint_pages_used,
             cache.checkpoints_admitted, cache.checkpoints_evicted, evicted()) for r in _requests(turns)]


@pytest.mark.parametrize("choice", ["dual", "ends", "every-block"])
def test_when_stale_entries_are_swept_decides_nothing(choice):
    """The eviction order is total (rank, then the request that used it last, then depth), so sweeping
    stale queue entries out -- at every push, or never -- changes no result, in either twin. Before,
    ties between equal ranks went in queue order, and sweeping (which forgets pinned checkpoints)
    changed which checkpoint stayed on this trace."""
    by_slack = {}
    for slack in (-10**9, 10**9):
        with _compact_slack(slack):
            blocks, twin = _both(choice, 52 * BS)
            by_slack[slack] = _results(blocks, TIE_TURNS)
            assert _results(twin, TIE_TURNS) == by_slack[slack]
            twin.check_invariants()
            blocks.check_invariants()
    assert by_slack[-10**9] == by_slack[10**9]


@settings(max_examples=examples(150), deadline=None)
@given(TURNS, st.integers(1, 90), POLICY_CHOICES, st.sampled_from([None, 0, 2, -10**9]))
# a trimmed run whose next tail holds a checkpoint ranked by FLOPs must be compared again (make fuzz found it)
@example(turns=[([0] * 8, 0)] + [([0], 0)] * 14, capacity_blocks=30, choice="dual-interval", slack=None)
def test_every_outcome_and_page_count_equals_the_block_tree(turns, capacity_blocks, choice, slack):
    """``slack``: how often both sweep stale entries out of their queues (None: as shipped)."""
    with _compact_slack(slack):
        _replay_both(turns, capacity_blocks, choice)


@contextmanager
def _compact_slack(slack):
    from kimilab.prefix import hybrid, radix, runs

    modules = (hybrid, radix, runs)
    before = [m.COMPACT_SLACK for m in modules]
    for m in modules:
        m.COMPACT_SLACK = before[0] if slack is None else slack
    try:
        yield
    finally:
        for m, value in zip(modules, before):
            m.COMPACT_SLACK = value


def _replay_both(turns, capacity_blocks, choice):
    blocks, runs = _both(choice, capacity_blocks * BS)
    for r in _requests(turns):
        assert runs.serve(r.hash_ids, r.input_length) == blocks.serve(r.hash_ids, r.input_length)
        assert (runs.kv_pages, runs.checkpoint_pages_used, runs.pages_admitted, runs.checkpoints_admitted,
                runs.checkpoints_evicted, runs.n_evicted) == \
               (blocks.kv_pages, blocks.checkpoint_pages_used, blocks.pages_admitted, blocks.checkpoints_admitted,
                blocks.checkpoints_evicted, blocks.tree.n_evicted)
        runs.check_invariants()
        blocks.check_invariants()
    assert (runs.checkpoints_admitted, runs.checkpoints_evicted, runs.n_evicted) == \
           (blocks.checkpoints_admitted, blocks.checkpoints_evicted, blocks.tree.n_evicted)
    assert runs.n_runs <= blocks.tree.n_nodes == runs.n_blocks


@pytest.mark.parametrize("choice, gb", [("ends", 10), ("dual", 40), ("every-block", 160), ("kv-only", 40)])
def test_the_real_trace_replays_identically(data_dir, choice, gb):
    """The first 4,000 requests of the Mooncake hour: every request's hits and checkpoints agree."""
    trace = load_trace(data_dir / MOONCAKE_CONVERSATION)[:4000]
    capacity = int(gb * 1e9 // costs.kv_bytes_per_token(CFG, ONE_H200))
    results = [simulate(trace, cache=cache, keep_per_request=True) for cache in _both(choice, capacity)]
    assert results[0].per_request == results[1].per_request
    assert results[0].as_dict() | {"run_wall_s": 0} == results[1].as_dict() | {"run_wall_s": 0}


@given(st.floats(0, 1e6), st.integers(1, 10**6), st.integers(1, 10**6))
def test_built_in_policies_rank_leaves_without_checkpoints_by_last_use(t, end, blocks):
    """RunPrefixCache trims a run's tail in one pass, and skips computing ranks, only for policies that
    promise this: leaves without a checkpoint rank by last use (``lru_leaves``), and so do checkpoints
    and leaves with one (``lru_checkpoints``)."""
    cache = RunPrefixCache(CFG, make_policy("dual"), deployment=ONE_H200, block_size=BS, capacity_tokens=blocks * BS)
    for name in POLICIES:
        policy = make_policy(name)
        assert policy.lru_leaves and policy.kv_priority(cache, t, end, False) == t
        if policy.lru_checkpoints:
            assert policy.checkpoint_priority(cache, t, end) == policy.kv_priority(cache, t, end, True) == t


def test_bad_arguments_name_what_is_expected():
    with pytest.raises(ValueError, match="capacity_tokens"):
        RunPrefixCache(CFG, make_policy("dual"), deployment=ONE_H200, block_size=BS, capacity_tokens=BS - 1)
    with pytest.raises(ValueError, match="policy"):
        RunPrefixCache(CFG, "dual", deployment=ONE_H200, block_size=BS, capacity_tokens=10 * BS)
    cache = RunPrefixCache(CFG, make_policy("ends"), deployment=ONE_H200, block_size=BS, capacity_tokens=10 * BS)
    with pytest.raises(ValueError, match="tokens"):
        cache.serve(tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="n_tokens"):
        cache.serve([1], 0)


@settings(max_examples=examples(40), deadline=None)
@given(TURNS, st.sampled_from([512, 1024, 1888, 5000]))
def test_coarser_blocks_only_round_hits_down(turns, new_block):
    """Keyed at a larger block, a hit is whole large blocks and never more than the trace proves is shared."""
    from kimilab.traffic import coarser_blocks

    fine = _requests(turns)
    coarse = coarser_blocks(fine, BS, new_block)
    assert [r.input_length for r in coarse] == [r.input_length for r in fine]
    a = RunPrefixCache(CFG, make_policy("kv-only"), deployment=ONE_H200, block_size=BS, capacity_tokens=None)
    b = RunPrefixCache(CFG, make_policy("kv-only"), deployment=ONE_H200, block_size=new_block, capacity_tokens=None)
    longest = {}  # block id -> longest earlier prompt that holds it (equal ids: equal prefixes)
    for f, c in zip(fine, coarse):
        n = f.input_length
        proven = max([min((j + 1) * BS, n, longest[h]) for j, h in enumerate(f.hash_ids) if h in longest] + [0])
        hit_fine, hit_coarse = a.serve(f.hash_ids, n).kv_hit, b.serve(c.hash_ids, n).kv_hit
        assert hit_coarse <= min(proven, n - 1)
        assert hit_coarse % new_block == 0 or hit_coarse == n - 1
        if new_block == BS:
            assert hit_coarse == hit_fine
        for h in f.hash_ids:
            longest[h] = max(longest.get(h, 0), n)
