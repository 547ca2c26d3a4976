"""A prefix-cached KV block pool in vLLM v1's layers (block_pool.py, kv_cache_manager.py).

Blocks have an id, a reference count and, once full and cached, a chained hash.
The free queue holds every block with ``ref == 0``, least recently used first::

    free queue:  head -> [evict first ........................ evict last] <- tail
                 blocks freed by a finished request are appended tail-first
                 (its last block first), so a chain's suffix is evicted
                 before its prefix and prefixes outlive suffixes.

A freed block keeps its hash and stays findable in ``cached`` until it is taken from
the queue's head for a new allocation (eviction). Invariants (property-tested):
every block is either referenced or in the free queue, never both; ``cached`` maps
each hash to exactly one block that carries that hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_evictions = 0

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def num_cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a hash chain present in the cache (no side effects)."""
        cached = self.cached
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def get_cached_block(self, h: int) -> int | None:
        return self.cached.get(h)

    # -- state changes -------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of cached hashes (each must be cached)."""
        cached = self.cached
        return [cached[h] for h in hashes]

    def num_idle(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them uses free room)."""
        ref = self.ref
        return sum(1 for b in blocks if not ref[b])

    def touch(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference on the cached blocks of a chain prefix; returns their ids."""
        ids = self.lookup(hashes)
        self.touch_blocks(ids)
        return ids

    def touch_blocks(self, blocks: Sequence[int]) -> None:
        """Take a reference on blocks, pulling idle ones out of the free queue."""
        ref, free = self.ref, self.free
        for b in blocks:
            if not ref[b]:
                del free[b]
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int] | None:
        """Allocate ``n`` blocks from the free queue's head, evicting their hashes.

        Returns ``None`` (and changes nothing) when fewer than ``n`` are free, so the
        caller can preempt and retry.
        """
        if n > len(self.free):
            return None
        out = []
        free, ref, bh, cached = self.free, self.ref, self.block_hash, self.cached
        for _ in range(n):
            b, _ = free.popitem(last=False)
            h = bh[b]
            if h is not None:
                bh[b] = None
                if cached.get(h) == b:
                    del cached[h]
                self.num_evictions += 1
            ref[b] = 1
            out.append(b)
        return out

    def cache_full_block(self, block: int, h: int) -> None:
        """Mark a full block as holding chain hash ``h`` (first writer wins, as in vLLM)."""
        if self.block_hash[block] is not None:
            return
        self.block_hash[block] = h
        self.cached.setdefault(h, block)

    def free_blocks(self, ordered_blocks: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the queue's tail.

        Pass a request's blocks in reverse order (tail first) to get vLLM's eviction
        order.
        """
        ref = self.ref
        zero = []
        for b in ordered_blocks:
            ref[b] -= 1
            if not ref[b]:
                zero.append(b)
        self.free.update(dict.fromkeys(zero))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only allowed when no block is in use, as in vLLM)."""
        if self.num_used_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True
