"""BlockPool: ref counts, the LRU free queue and the hash -> block map.

The stateful test drives a small pool with random operations and checks it, after
every step, against a plain reference model (a list for the free queue, dicts for
refs and hashes), so the eviction order is checked exactly, not just its counts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvroute.kvcache.hashing import chain_hashes
from kvroute.kvcache.holders import Holders
from kvroute.kvcache.pool import BlockPool


def chain(*blocks: int) -> list[int]:
    return chain_hashes((b,) for b in blocks)


def check_pool_invariants(pool: BlockPool) -> None:
    """Structural invariants that hold for any reachable pool state.

    Shared with tests/test_engine.py (imported from there).
    """
    n = pool.num_blocks
    assert len(pool.ref) == n and len(pool.block_hash) == n
    assert all(r >= 0 for r in pool.ref), "negative ref count"
    free = set(pool.free)
    assert len(free) == len(pool.free)
    assert free <= set(range(n))
    for b in range(n):
        # every block is either referenced or in the free queue, never both
        assert (pool.ref[b] > 0) != (b in free), f"block {b}: ref={pool.ref[b]}, free={b in free}"
    assert pool.num_free_blocks + pool.num_used_blocks == n
    assert pool.num_used_blocks == sum(1 for r in pool.ref if r > 0)
    for h, b in pool.cached.items():
        assert 0 <= b < n
        assert pool.block_hash[b] == h, f"cached[{h}] -> block {b} carries {pool.block_hash[b]}"
    for b in range(n):  # what match() trusts when it reuses a remembered chain
        h = pool.block_hash[b]
        assert pool._dup[b] == (h is not None and pool.cached.get(h) != b), f"block {b}: stale duplicate flag"
    assert pool._num_dup == int(pool._dup.sum()), "duplicate count out of step with the flags"


# -- reference model ---------------------------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / free / touch / reset sequences against a model.

    A "request" is a list of block ids it holds (in chain order). Freeing releases
    them tail first, as the engine does.
    """

    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(4, 32))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, block_size=4)
        self.holders = Holders()  # kept current by the pool, as in a simulated cluster
        self.pool.share_holders(self.holders, 1 << 3)
        self.n = num_blocks
        # reference model
        self.m_free: list[int] = list(range(num_blocks))  # head first
        self.m_ref = [0] * num_blocks
        self.m_hash: list[int | None] = [None] * num_blocks
        self.m_cached: dict[int, int] = {}
        self.m_dups: dict[int, list[int]] = {}  # hash -> other blocks carrying it, in caching order
        self.live: dict[int, list[int]] = {}  # request id -> blocks
        self.m_evictions = 0
        self.next_id = 0

    # -- helpers -------------------------------------------------------------
    def _snapshot(self):
        p = self.pool
        return (list(p.ref), list(p.block_hash), dict(p.cached), list(p.free), p.num_evictions)

    def _new_request(self, blocks: list[int]) -> int:
        rid = self.next_id
        self.next_id += 1
        self.live[rid] = blocks
        return rid

    # -- rules ---------------------------------------------------------------
    @rule(target=requests, n=st.one_of(st.integers(0, 12), st.integers(16, 32)))
    def allocate(self, n: int):
        """get_new_blocks takes the n LRU blocks (queue head) or, if too few, nothing.
        (The pool finds a few blocks one by one and many with vectorised scans: both sizes.)"""
        before = self._snapshot()
        got = self.pool.get_new_blocks(n)
        if n > len(self.m_free):
            assert got is None
            assert self._snapshot() == before, "a failed allocation changed the pool"
            return self._new_request([])  # an empty request keeps the bundle simple
        expected = self.m_free[:n]
        assert got == expected, "allocation is not least-recently-used first"
        del self.m_free[:n]
        evicted = []
        for b in got:
            h = self.m_hash[b]
            if h is not None:  # eviction: the hash leaves the map, or moves to a survivor
                evicted.append(h)
                self.m_hash[b] = None
                dups = self.m_dups.get(h, [])
                if self.m_cached.get(h) == b:
                    if dups:
                        self.m_cached[h] = dups.pop()
                    else:
                        del self.m_cached[h]
                else:
                    dups.remove(b)
                if not dups:
                    self.m_dups.pop(h, None)
            self.m_ref[b] = 1
        for h in evicted:  # an evicted block is no longer findable through its hash
            assert self.pool.num_cached_blocks([h]) == (1 if h in self.m_cached else 0)
        assert self.pool.num_evictions == self.m_evictions + len(evicted)
        self.m_evictions += len(evicted)
        return self._new_request(list(got))

    @rule(req=requests, data=st.data(), h=st.integers(0, 15))
    def cache_full_block(self, req: int, data, h: int):
        """First writer wins: a hash already mapped keeps its block (the newcomer is a
        duplicate holder); a hashed block keeps its hash."""
        blocks = self.live.get(req)
        if not blocks:
            return
        b = data.draw(st.sampled_from(blocks), label="block")
        self.pool.cache_full_block(b, h)
        if self.m_hash[b] is None:
            self.m_hash[b] = h
            if h in self.m_cached:
                self.m_dups.setdefault(h, []).append(b)
            else:
                self.m_cached[h] = b
        assert self.pool.get_cached_block(h) == self.m_cached.get(h)

    @rule(req=consumes(requests))
    def free_request(self, req: int):
        """Freeing tail first appends the request's blocks to the queue's tail, last block first."""
        blocks = self.live.pop(req, None)
        if blocks is None:
            return
        self.pool.free_blocks(list(reversed(blocks)))
        for b in reversed(blocks):
            self.m_ref[b] -= 1
            if self.m_ref[b] == 0:
                self.m_free.append(b)
                # a freed block stays findable through its hash until evicted
                h = self.m_hash[b]
                if h is not None and self.m_cached.get(h) == b:
                    assert self.pool.num_cached_blocks([h]) == 1

    @precondition(lambda self: bool(self.m_cached))
    @rule(target=requests, data=st.data())
    def touch(self, data):
        """Touching cached blocks takes a reference; free ones leave the free queue."""
        hashes = data.draw(
            st.lists(st.sampled_from(sorted(self.m_cached)), min_size=1, max_size=4, unique=True),
            label="hashes",
        )
        ids = self.pool.touch(hashes)
        assert ids == [self.m_cached[h] for h in hashes]
        for b in ids:
            if self.m_ref[b] == 0:
                self.m_free.remove(b)
                assert b not in self.pool.free
            self.m_ref[b] += 1
        return self._new_request(list(ids))

    @rule()
    def reset_prefix_cache(self):
        """reset_prefix_cache refuses (and changes nothing) while blocks are in use."""
        before = self._snapshot()
        in_use = any(r > 0 for r in self.m_ref)
        ok = self.pool.reset_prefix_cache()
        assert ok == (not in_use)
        if in_use:
            assert self._snapshot() == before
        else:
            self.m_cached.clear()
            self.m_dups.clear()
            self.m_hash = [None] * self.n
            assert self.pool.cached == {}
            assert all(h is None for h in self.pool.block_hash)

    # -- invariants ----------------------------------------------------------
    @invariant()
    def structure(self):
        if not hasattr(self, "pool"):
            return
        check_pool_invariants(self.pool)

    @invariant()
    def matches_model(self):
        if not hasattr(self, "pool"):
            return
        p = self.pool
        assert list(p.free) == self.m_free, "free queue order differs from the LRU model"
        assert list(p.ref) == self.m_ref
        assert p.block_hash == self.m_hash
        assert p.cached == self.m_cached
        held = sorted(b for blocks in self.live.values() for b in blocks)
        assert held == sorted(b for b in range(self.n) for _ in range(self.m_ref[b]))
        # the cluster-wide holders know exactly the hashes this pool caches
        assert self.holders.mask == {h: 1 << 3 for h in self.m_cached}


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolStateMachine = PoolMachine.TestCase


# -- plain tests -------------------------------------------------------------------


def test_num_cached_blocks_counts_leading_run_only():
    """num_cached_blocks counts the leading run of a chain and stops at the first miss."""
    pool = BlockPool(8, 4)
    hs = chain(1, 2, 3, 4)
    blocks = pool.get_new_blocks(4)
    for b, h in zip(blocks, hs):
        pool.cache_full_block(b, h)
    assert pool.num_cached_blocks(hs) == 4
    assert pool.num_cached_blocks(hs + chain(1, 2, 3, 4, 5)[4:]) == 4
    assert pool.num_cached_blocks([hs[0], 12345, hs[2], hs[3]]) == 1  # a miss: later hits do not count
    # (the count is a binary search, valid because cached chains are prefix-closed; the
    # engine tests check it against a linear scan on every step)
    assert pool.num_cached_blocks(hs[1:]) == 3  # the map is flat; chaining gives prefix semantics
    assert pool.num_cached_blocks(chain(9, 2, 3)) == 0
    assert pool.num_cached_blocks([]) == 0
    before = (list(pool.ref), list(pool.free), dict(pool.cached))
    pool.num_cached_blocks(hs)
    assert (list(pool.ref), list(pool.free), dict(pool.cached)) == before  # no side effects


def test_match_reuses_a_remembered_chain_only_while_exact():
    """match() returns a remembered chain's ids only while the per-hash lookup would
    give the same ids: not after its tail was evicted, nor after its hashes were
    recomputed into other blocks, nor for a duplicate that cached does not map to."""

    def lookup(hs: list[int]) -> list[int]:
        return [pool.cached[h] for h in hs[: pool.num_cached_blocks(hs)]]

    pool = BlockPool(8, 4)
    hs = chain(1, 2, 3, 4)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, hs)
    ids = np.array(a)
    pool.remember_chain(ids, hs[-1])
    pool.free_blocks(ids[::-1])
    assert pool.match(hs) is ids
    pool.get_new_blocks(5)  # 4 fresh blocks, then a's last block (freed first) is evicted
    assert pool.num_cached_blocks(hs) == 3
    assert pool.match(hs).tolist() == lookup(hs) == a[:3]

    pool = BlockPool(8, 4)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, hs)
    ids = np.array(a)
    pool.remember_chain(ids, hs[-1])
    pool.free_blocks(ids[::-1])
    b = pool.get_new_blocks(8)  # every block reallocated, a's hashes evicted
    pool.cache_full_blocks(b[4:][::-1], hs)  # the same chain recomputed in other blocks
    assert pool.match(hs).tolist() == lookup(hs) == b[4:][::-1]
    check_pool_invariants(pool)

    pool = BlockPool(8, 4)
    a, b = pool.get_new_blocks(4), pool.get_new_blocks(4)
    pool.cache_full_blocks(a, hs)
    pool.cache_full_blocks(b, hs)  # computed concurrently: b's blocks are duplicates
    pool.remember_chain(np.array(b), hs[-1])
    assert pool.match(hs).tolist() == lookup(hs) == a
    check_pool_invariants(pool)


def test_tail_first_free_evicts_suffix_before_prefix():
    """A request freed tail first loses its last block first; earlier-freed requests go before it."""
    pool = BlockPool(6, 4)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(3)
    ha, hb = chain(1, 2, 3), chain(7, 8, 9)
    for blk, h in zip(a, ha):
        pool.cache_full_block(blk, h)
    for blk, h in zip(b, hb):
        pool.cache_full_block(blk, h)
    pool.free_blocks(reversed(a))  # freed first -> evicted first
    pool.free_blocks(reversed(b))
    assert list(pool.free) == a[::-1] + b[::-1]
    assert pool.num_cached_blocks(ha) == 3 and pool.num_cached_blocks(hb) == 3
    got = pool.get_new_blocks(1)
    assert got == [a[2]]
    assert pool.num_cached_blocks(ha) == 2  # the suffix went, the prefix survives
    pool.get_new_blocks(2)
    assert pool.num_cached_blocks(ha) == 0
    assert pool.num_cached_blocks(hb) == 3
    assert pool.num_evictions == 3


def test_touch_refreshes_lru_position():
    """Touching a free cached block removes it from the queue; freeing it again puts it at the tail."""
    pool = BlockPool(4, 4)
    blocks = pool.get_new_blocks(2)
    hs = chain(1, 2)
    for blk, h in zip(blocks, hs):
        pool.cache_full_block(blk, h)
    pool.free_blocks(reversed(blocks))
    assert list(pool.free) == [2, 3, blocks[1], blocks[0]]
    ids = pool.touch(hs[:1])
    assert ids == [blocks[0]] and blocks[0] not in pool.free and pool.ref[blocks[0]] == 1
    pool.free_blocks(ids)
    assert list(pool.free)[-1] == blocks[0]
    check_pool_invariants(pool)


def test_failed_allocation_changes_nothing():
    """get_new_blocks(n) with fewer than n free returns None and leaves the pool as it was."""
    pool = BlockPool(4, 4)
    got = pool.get_new_blocks(3)
    pool.cache_full_block(got[0], 42)
    pool.free_blocks([got[0]])
    before = (list(pool.ref), list(pool.free), dict(pool.cached), list(pool.block_hash), pool.num_evictions)
    assert pool.get_new_blocks(3) is None
    assert (list(pool.ref), list(pool.free), dict(pool.cached), list(pool.block_hash), pool.num_evictions) == before


def test_reset_prefix_cache():
    """reset_prefix_cache refuses while a block is in use, and clears every hash otherwise."""
    pool = BlockPool(4, 4)
    got = pool.get_new_blocks(2)
    for blk, h in zip(got, chain(1, 2)):
        pool.cache_full_block(blk, h)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached) == 2
    pool.free_blocks(reversed(got))
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(h is None for h in pool.block_hash)
    assert pool.num_free_blocks == 4
    check_pool_invariants(pool)


def test_constructor_rejects_empty_pool():
    """A pool needs at least one block of at least one token."""
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
