"""The page pool: accounting, errors that leave it unchanged, policies, and a hypothesis
state machine holding every invariant across random allocate / share / free / exhaust runs."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule
from fuzzing import examples

from kimilab import config
from kimilab.config import PAGE_KINDS
from kimilab.costs import ONE_H200, CacheShapes
from kimilab.pool import (
    UNBOUNDED_PAGES, DoubleFree, ForeignHandle, JengaHandle, JengaPages, LcmPagePool, PagePool, PoolExhausted,
    RequestAllocator, SplitPools, UnifiedPages, VllmPaddedPages,
)


def _fingerprint(pool: PagePool):
    """Everything about a pool except history (high-water mark) and arena bytes."""
    s = pool.stats()
    return (s.n_free, s.pages_by_kind, s.requested_bytes_by_kind, s.n_allocations, s.n_handles,
            pool.page_map().tolist(), pool.free_pages().tolist())


# ----- unit tests -------------------------------------------------------------

def test_allocate_free_roundtrip_and_stats():
    pool = PagePool(10, 64)
    fresh = _fingerprint(pool)
    a = pool.allocate("kv", 3, nbytes=150)
    b = pool.allocate("kda_state", 2)
    assert a.pages.tolist() == [0, 1, 2] and b.pages.tolist() == [3, 4]
    s = pool.stats()
    assert (s.n_free, s.n_used, s.high_water_pages) == (5, 5, 5)
    assert s.pages_by_kind["kv"] == 3 and s.requested_bytes_by_kind["kv"] == 150
    assert s.waste_bytes == 3 * 64 - 150 and s.waste_bytes_by_kind["kv"] == 42
    assert pool.page_map().tolist()[:6] == [0, 0, 0, 1, 1, -1]
    pool.free(a)
    pool.free(b)
    assert _fingerprint(pool) == fresh
    assert pool.stats().high_water_pages == 5
    pool.check_invariants()


def test_share_keeps_pages_until_last_handle():
    pool = PagePool(4, 32)
    a = pool.allocate("checkpoint", 2)
    b = pool.share(a)
    assert b is not a and a.refcount == 2 and b.pages.tolist() == a.pages.tolist()
    pool.free(a)
    assert pool.n_free == 2 and b.refcount == 1 and b.live and not a.live
    pool.free(b)
    assert pool.n_free == 4
    pool.check_invariants()


def test_misuse_raises_clearly():
    pool, other = PagePool(4, 32, name="mine"), PagePool(4, 32, name="other")
    a = pool.allocate("kv", 1)
    with pytest.raises(ForeignHandle, match="another pool"):
        other.free(a)
    with pytest.raises(ForeignHandle, match="Allocation"):
        pool.free("not a handle")
    pool.free(a)
    with pytest.raises(DoubleFree, match="already freed"):
        pool.free(a)
    with pytest.raises(DoubleFree):
        pool.share(a)
    with pytest.raises(ValueError, match="kind='weights'"):
        pool.allocate("weights", 1)
    with pytest.raises(ValueError, match="n_pages=0"):
        pool.allocate("kv", 0)
    with pytest.raises(ValueError, match="nbytes=99"):
        pool.allocate("kv", 1, nbytes=99)
    with pytest.raises(ValueError, match="multiple of 8"):
        PagePool(4, 12)
    pool.check_invariants()


def test_exhaustion_message_and_no_change():
    pool = PagePool(8, 96, name="p")
    pool.allocate("kv", 5)
    pool.allocate("kda_state", 2)
    before = _fingerprint(pool)
    with pytest.raises(PoolExhausted) as err:
        pool.allocate("conv_state", 3)
    e = err.value
    assert (e.kind, e.requested_pages, e.n_free, e.n_pages) == ("conv_state", 3, 1, 8)
    assert e.used_by_kind["kv"] == 5
    msg = str(e)
    assert "3 'conv_state' page(s)" in msg and "only 1 of 8 pages free" in msg
    assert "kv=5" in msg and "kda_state=2" in msg
    assert _fingerprint(pool) == before


def test_backed_views_write_into_the_arena():
    pool = PagePool(6, 64)
    a = pool.allocate("scratch", 2, zero=True)
    view = pool.buffer(a)
    assert view.shape == (2, 64) and np.shares_memory(view, pool.arena())
    view[:] = 7
    assert np.all(pool.arena()[a.pages] == 7)
    assert [v[0] for v in pool.page_views(a)] == [7, 7]
    b = pool.allocate("kv", 1)
    pool.free(a)  # pages 0,1 back on top; next allocation takes 0 then 1, then 3
    c = pool.allocate("kv", 3)
    assert c.pages.tolist() == [0, 1, 3] and not pool.is_contiguous(c)
    with pytest.raises(Exception, match="not consecutive"):
        pool.buffer(c)
    pool.free(b), pool.free(c)
    with pytest.raises(Exception, match="accounting only"):
        PagePool(2, 8, backed=False).arena()


def test_allocation_cost_is_independent_of_pool_size():
    """Free-list pops: allocating 2 pages from a 1M-page pool touches 2 pages."""
    big = PagePool(1_000_000, 8, backed=False)
    for _ in range(1000):
        big.free(big.allocate("kv", 2))
    assert big.n_free == 1_000_000


def test_owners_hand_pages_over_without_moving_them():
    """A finished request's pages become another owner's: share to the new owner, free the old handle."""
    pool = PagePool(8, 64)
    mine = pool.allocate("kv", 3, owner="request 1")
    pool.arena()[mine.pages] = 7
    theirs = pool.share(mine, owner="prefix")
    pool.free(mine)
    assert theirs.owner == "prefix" and theirs.refcount == 1 and pool.n_used == 3
    assert (pool.arena()[theirs.pages] == 7).all()
    assert "owner='prefix'" in repr(theirs)
    pool.free(theirs)
    assert pool.n_used == 0
    pool.check_invariants()


def test_an_unbounded_accounting_pool_costs_memory_for_what_it_holds():
    """A pool of 2^62 pages (the CLI's --capacity-tokens inf) allocates like any other."""
    pool = PagePool(UNBOUNDED_PAGES, 4096, backed=False, name="unbounded")
    handles = [pool.allocate("kv", 3) for _ in range(1000)]
    assert pool.n_used == 3000 and len(pool._page_kind) == 3000  # bookkeeping for pages used, not 2^62
    for h in handles:
        pool.free(h)
    assert pool.n_used == 0 and pool.capacity_bytes == UNBOUNDED_PAGES * 4096


def test_policy_page_sizes_48b():
    s = CacheShapes.from_config(config.kimi_linear_48b, ONE_H200)
    v = VllmPaddedPages()
    assert v.block_tokens(s) % 16 == 0
    layer_page = v.pages(s).page_bytes  # one layer's page; the pool's page is a block of 7 of them
    assert layer_page >= s.state_bytes + s.conv_bytes
    assert layer_page - (s.state_bytes + s.conv_bytes) < 16 * s.kv_token_bytes
    assert v.page_bytes(s)["main"] == 7 * layer_page
    j = JengaPages()
    large = j.page_bytes(s)["main"]
    assert all(large % b == 0 for b in j.small_bytes(s).values())
    for policy in (UnifiedPages(), v, j, SplitPools(0.9)):
        for n in (0, 1, 17, 5000):
            fp = policy.footprint(s, n)
            assert fp.requested_bytes == s.request_bytes(n)
            assert fp.reserved_bytes >= fp.requested_bytes
    # big vLLM blocks pad short prompts
    assert v.footprint(s, 100).waste_bytes > 10 * UnifiedPages().footprint(s, 100).waste_bytes


@pytest.mark.parametrize("policy", [UnifiedPages(), VllmPaddedPages(), JengaPages(), SplitPools(0.5)],
                         ids=lambda p: p.key)
def test_request_allocator_is_all_or_nothing(policy):
    s = CacheShapes.from_config(config.kimi_linear_48b, ONE_H200)
    alloc = RequestAllocator(policy, s, 2 * 2**30)
    admitted = []
    for rid in range(200):
        try:
            alloc.admit(rid, 3000)
            admitted.append(rid)
        except PoolExhausted:
            break
    assert admitted and alloc.reserved_bytes <= alloc.capacity_bytes
    reserved = alloc.reserved_bytes
    with pytest.raises(PoolExhausted):
        alloc.admit("too-big", 10**7)
    assert alloc.reserved_bytes == reserved
    for rid in admitted:
        alloc.grow(rid, 3001)
        alloc.release(rid)
    assert alloc.reserved_bytes == 0 and alloc.requested_bytes == 0
    for pool in alloc.pools.values():
        pool.check_invariants()
        assert pool.reserved_bytes == 0


def test_lcm_pool_returns_large_pages():
    pool = LcmPagePool(4, {"kv": 6, "kda_state": 4})
    assert pool.large_bytes == 12 and pool.per_large == {"kv": 2, "kda_state": 3}
    t1 = pool.allocate("kv", 3, owner="r1")  # 2 large pages, one slot spare
    assert isinstance(t1, JengaHandle) and t1.owner == "r1" and t1.n_pages == 3
    t2 = pool.allocate("kv", 1)  # fills the spare slot
    assert pool.large.n_used == 2
    t3 = pool.allocate("kda_state", 4)  # 2 more large pages
    assert not pool.fits({"kv": 1})
    with pytest.raises(PoolExhausted):
        pool.allocate("kv", 1)
    pool.free(t1)
    assert pool.large.n_used == 3  # the large page shared with t2 stays
    with pytest.raises(DoubleFree):
        pool.free(t1)
    pool.check_invariants()
    pool.free(t2), pool.free(t3)
    assert pool.large.n_used == 0 and pool.reserved_bytes == 0
    pool.check_invariants()


# ----- property test: a random life of a pool ----------------------------------

class PoolMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.pool = PagePool(24, 16)
        self.fresh = _fingerprint(self.pool)
        self.model: dict[int, int] = {}  # block id -> live handles (the obvious twin)
        self.block_pages: dict[int, int] = {}
        self.live: dict[int, object] = {}  # handle id -> handle

    @rule(target=handles, kind=st.sampled_from(PAGE_KINDS), n=st.integers(1, 8), data=st.data())
    def allocate(self, kind, n, data):
        before = _fingerprint(self.pool)
        if n > self.pool.n_free:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(kind, n)
            assert _fingerprint(self.pool) == before  # exhaustion changes nothing
            return consumes_nothing()
        nbytes = data.draw(st.integers(0, n * 16))
        a = self.pool.allocate(kind, n, nbytes=nbytes)
        self.model[a.block_id] = 1
        self.block_pages[a.block_id] = n
        self.live[a.handle_id] = a
        return a

    @rule(target=handles, a=handles)
    def share(self, a):
        if a is None or not a.live:
            return None
        b = self.pool.share(a)
        self.model[a.block_id] += 1
        self.live[b.handle_id] = b
        return b

    @rule(a=consumes(handles))
    def free(self, a):
        if a is None:
            return
        if not a.live:
            with pytest.raises(DoubleFree):
                self.pool.free(a)
            return
        self.pool.free(a)
        del self.live[a.handle_id]
        self.model[a.block_id] -= 1
        if self.model[a.block_id] == 0:
            del self.model[a.block_id]
            del self.block_pages[a.block_id]
        with pytest.raises(DoubleFree):  # the same handle never frees twice
            self.pool.free(a)

    @precondition(lambda self: self.pool.n_free > 0)
    @rule()
    def exhaust(self):
        before = _fingerprint(self.pool)
        with pytest.raises(PoolExhausted):
            self.pool.allocate("scratch", self.pool.n_free + 1)
        assert _fingerprint(self.pool) == before

    @invariant()
    def accounting(self):
        self.pool.check_invariants()
        s = self.pool.stats()
        assert s.n_free + s.n_used == s.n_pages
        assert s.n_used == sum(self.block_pages.values())
        assert s.n_allocations == len(self.model)
        assert s.n_handles == sum(self.model.values())
        assert all(v >= 1 for v in self.model.values())
        assert s.waste_bytes >= 0 and sum(s.pages_by_kind.values()) == s.n_used

    def teardown(self):
        # free every live handle: the pool must be exactly as it started
        for a in list(self.live.values()):
            self.pool.free(a)
        assert _fingerprint(self.pool) == self.fresh
        self.pool.check_invariants()


def consumes_nothing():
    return None


PoolMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "each", "free"]), st.integers(0, 6)), max_size=40))
def test_allocate_each_is_count_single_page_allocations(ops):
    """allocate_each(kind, n) hands out the same pages, block and handle ids as n calls of
    allocate(kind, 1), from any history of allocations and frees; stats agree too."""
    a, b = PagePool(24, 64, backed=False), PagePool(24, 64, backed=False)
    held_a, held_b = [], []
    for op, n in ops:
        if op == "free" and held_a:
            i = n % len(held_a)
            a.free(held_a.pop(i))
            b.free(held_b.pop(i))
            continue
        pages = n if op == "each" else 1
        if pages > a.n_free:
            with pytest.raises(PoolExhausted):
                a.allocate_each("kv", pages)
            continue
        got = a.allocate_each("kv", pages)
        want = [b.allocate("kv", 1) for _ in range(pages)]
        assert [(x.pages.tolist(), x.handle_id, x._block.block_id) for x in got] == \
               [(x.pages.tolist(), x.handle_id, x._block.block_id) for x in want]
        held_a += got
        held_b += want
        assert a.stats() == b.stats()
    assert a.allocate_each("kv", 0) == []
    with pytest.raises(ValueError, match="count"):
        a.allocate_each("kv", -1)
