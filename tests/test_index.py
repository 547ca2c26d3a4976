"""The router-side approximate prefix index: prefix match, TTL, LRU, workers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.kvcache.hashing import chain_hashes
from kvroute.kvcache.index import ApproxPrefixIndex


def chain(*blocks: int) -> list[int]:
    return chain_hashes((b,) for b in blocks)


def test_match_counts_leading_blocks_only():
    idx = ApproxPrefixIndex(["a", "b"], block_size=16)
    turn1 = chain(1, 2, 3)
    idx.record("a", turn1, now_s=0.0)
    assert idx.match("a", turn1, 1.0) == 3
    assert idx.match("a", chain(1, 2, 3, 4, 5), 1.0) == 3  # the next turn extends it
    assert idx.match("a", chain(1, 9, 3), 1.0) == 1  # diverges after block 0
    assert idx.match("a", chain(7, 2, 3), 1.0) == 0
    assert idx.match("b", turn1, 1.0) == 0
    assert idx.match_tokens("a", turn1, 1.0) == 48
    assert idx.match("a", [], 1.0) == 0
    assert idx.match("unknown", turn1, 1.0) == 0


def test_a_hole_in_the_chain_stops_the_match():
    idx = ApproxPrefixIndex(["a"], block_size=16, capacity_blocks_per_worker=4)
    hashes = chain(1, 2, 3, 4)
    idx.record("a", hashes[1:], 0.0)  # block 0 never recorded
    assert idx.match("a", hashes, 0.0) == 0


def test_ttl_expires_entries_and_record_refreshes_them():
    idx = ApproxPrefixIndex(["a"], block_size=16, ttl_s=120.0)
    system, history = chain(1, 2), chain(1, 2, 3, 4)
    idx.record("a", history, 0.0)
    assert idx.match("a", history, 120.0) == 4  # age == ttl still counts
    assert idx.match("a", history, 120.001) == 0
    idx.record("a", system, 100.0)  # another conversation reuses the system prompt
    assert idx.match("a", history, 200.0) == 2
    assert idx.match("a", history, 220.5) == 0
    idx.record("a", chain(9), 300.0)  # expiry happens on record
    assert idx.size("a") == 1


def test_match_is_read_only():
    idx = ApproxPrefixIndex(["a"], block_size=16, ttl_s=10.0)
    hashes = chain(1, 2)
    idx.record("a", hashes, 0.0)
    for t in range(1, 10):
        idx.match("a", hashes, float(t))
    assert idx.match("a", hashes, 10.5) == 0


def test_lru_evicts_tails_of_old_chains_first():
    idx = ApproxPrefixIndex(["a"], block_size=16, capacity_blocks_per_worker=5)
    old = chain(1, 2, 3)
    new = chain(1, 7, 8)  # shares block 0 with old
    idx.record("a", old, 0.0)
    idx.record("a", new, 1.0)  # 5 distinct hashes: fits
    assert idx.size("a") == 5
    idx.record("a", chain(1, 7, 8, 9), 2.0)  # one more: evict old's tail (block 2)
    assert idx.size("a") == 5
    assert idx.match("a", old, 2.0) == 2
    assert idx.match("a", chain(1, 7, 8, 9), 2.0) == 4
    idx.record("a", chain(5, 6, 7, 8), 3.0)  # four more: evicts old's block 1 and 7, 8, 9
    assert idx.size("a") == 5
    assert idx.match("a", chain(5, 6, 7, 8), 3.0) == 4
    assert idx.match("a", old, 3.0) == 1  # shared head survives longest


@settings(max_examples=50, deadline=None)
@given(
    cap=st.integers(1, 20),
    ops=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), max_size=8)),
                 max_size=30),
)
def test_capacity_bounds_size_and_a_fresh_record_always_matches_in_full(cap, ops):
    idx = ApproxPrefixIndex(["w0", "w1", "w2"], block_size=16, capacity_blocks_per_worker=cap)
    for t, (w, blocks) in enumerate(ops):
        hashes = chain(*blocks)
        idx.record(f"w{w}", hashes, float(t))
        assert idx.size(f"w{w}") <= cap
        assert idx.match(f"w{w}", hashes, float(t)) == min(len(hashes), cap)


def test_workers_come_and_go():
    idx = ApproxPrefixIndex(["a", "b"], block_size=16)
    hashes = chain(1, 2)
    idx.record("a", hashes, 0.0)
    idx.record("b", hashes, 0.0)
    idx.remove_worker("a")
    assert idx.workers == ("b",)
    assert idx.match("a", hashes, 0.0) == 0 and idx.size("a") == 0
    with pytest.raises(KeyError, match="not tracked"):
        idx.record("a", hashes, 1.0)
    idx.add_worker("a")
    assert idx.match("a", hashes, 1.0) == 0  # came back with a cold cache
    idx.clear()
    assert idx.size("b") == 0 and idx.workers == ("b", "a")


def test_expire_and_validation():
    idx = ApproxPrefixIndex(["a"], block_size=16, ttl_s=5.0)
    idx.record("a", chain(1, 2, 3), 0.0)
    idx.expire(4.0)
    assert idx.size("a") == 3
    idx.expire(6.0)
    assert idx.size("a") == 0
    idx.record("a", chain(1), 6.0)
    with pytest.raises(ValueError, match="backwards"):
        idx.record("a", chain(1), 5.0)
    for bad in [dict(block_size=0), dict(block_size=16, ttl_s=0),
                dict(block_size=16, capacity_blocks_per_worker=0)]:
        with pytest.raises(ValueError):
            ApproxPrefixIndex(["a"], **bad)
