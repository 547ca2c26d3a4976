"""A prefix-cached KV block pool in vLLM v1's layers (block_pool.py, kv_cache_manager.py).

Blocks have an id, a reference count and, once full and cached, a chained hash.
The free queue holds every block with ``ref == 0``, least recently used first::

    free queue:  head -> [never used, by id][freed blocks, oldest first] <- tail
                 blocks freed by a finished request are appended tail-first
                 (its last block first), so a chain's suffix is evicted
                 before its prefix and prefixes outlive suffixes.

A freed block keeps its hash and stays findable in ``cached`` until it is taken from
the queue's head for a new allocation (eviction). Invariants (property-tested):
every block is either referenced or in the free queue, never both; ``cached`` maps
each hash to exactly one block that carries that hash; when two blocks carry the same
hash (computed concurrently) and the mapped one is evicted, the hash moves to the
survivor, so a hash is cached exactly while some block holds it.

Prefix closure: with chains freed tail-first and touched only as chain prefixes, a
cached block's whole prefix is cached too, so :meth:`num_cached_blocks` can
binary-search a chain, and a cluster's :class:`~kvroute.kvcache.holders.Holders`
(kept current here once :meth:`share_holders` is called) can answer a router's
question for every worker at once.

Speed: the free queue is lazy. Freeing appends blocks to a numpy buffer (recording
each block's position) and taking a reference only marks the block; entries whose
block was taken again (or freed again later) are skipped when the head is consumed.
Freeing and re-touching a conversation's blocks every turn thus costs an array write
and a counter, not a linked-list update, and an allocation finds its blocks with a
vectorised scan of the head; only the evicted hashes are touched one by one.

Matching a prompt looks up each of its cached blocks (a multi-turn prompt is mostly
history), so the pool remembers the block ids of chains its requests released
(:meth:`remember_chain`). When a new prompt's cached run ends where a remembered chain
ends, the remembered ids are returned if still exact: no block was reallocated since
(``_epoch``, so each still carries its hash) and none is a duplicate (``_dup``, so
each is the block ``cached`` maps its hash to): the ids the per-hash lookup would give.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvroute.kvcache.holders import Holders


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, dtype=np.int32)  # numpy: whole-request updates in C
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self._dups: dict[int, list[int]] = {}  # hash -> other blocks carrying it
        self.num_evictions = 0
        self._fresh = 0  # blocks [_fresh, num_blocks) were never allocated: the queue's head
        # freed blocks, oldest first (lazy: may hold stale entries). Live entries and the
        # blocks being freed are distinct blocks, so packing the live ones leaves room.
        self._queue = np.empty(2 * num_blocks, dtype=np.int64)
        self._len = 0  # entries in use in _queue
        self._base = 0  # global position of _queue[0]
        self._head = 0  # index in _queue of the next entry to consider
        self._pos = np.full(num_blocks, -1, dtype=np.int64)  # global position of each block's latest entry
        self._num_free = num_blocks
        self._epoch = np.zeros(num_blocks, dtype=np.int64)  # times each block was reallocated
        self._dup = np.zeros(num_blocks, dtype=bool)  # carries a hash that cached maps to another block
        self._num_dup = 0  # blocks flagged in _dup (usually none: match skips the check)
        self._chains: dict[int, tuple[np.ndarray, bytes]] = {}  # last hash -> (ids, their epochs' bytes)
        self._max_chains = max(64, num_blocks // 64)  # oldest forgotten first (a cache, exact either way)
        self.holders: Holders | None = None  # cluster-wide holders of each hash, when shared
        self.holder_bit = 0

    def share_holders(self, holders: Holders, bit: int) -> None:
        """From now on keep ``holders`` told, under ``bit``, which hashes this pool caches."""
        self.holders = holders
        self.holder_bit = bit
        holders.add(bit, self.cached)

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def free(self) -> list[int]:
        """The free queue, head (evicted first) to tail; O(queue), for inspection."""
        return list(self._iter_free())

    def _iter_free(self) -> Iterator[int]:
        yield from range(self._fresh, self.num_blocks)
        yield from self._queue[self._head + self._live(self._head, self._len)].tolist()

    def _live(self, lo: int, hi: int) -> np.ndarray:
        """Offsets from ``lo`` of the current (not stale) queue entries in ``[lo, hi)``."""
        q = self._queue[lo:hi]
        return np.flatnonzero((self.ref[q] == 0) & (self._pos[q] == np.arange(self._base + lo, self._base + hi)))

    def num_cached_blocks(self, hashes: Sequence[int], limit: int | None = None) -> int:
        """Leading blocks of a hash chain (of its first ``limit``, if given) present in
        the cache (no side effects).

        Binary search, valid by prefix closure (see the module docstring).
        """
        cached = self.cached
        lo, hi = 0, len(hashes)
        if limit is not None and limit < hi:
            hi = limit
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if hashes[mid - 1] in cached:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def match(self, hashes: Sequence[int], limit: int | None = None) -> np.ndarray:
        """Block ids of the cached leading run of a hash chain (of its first ``limit``
        blocks, if given: no slice to copy), as an array: the caller counts, touches and
        keeps them, converting once. Read-only."""
        n = self.num_cached_blocks(hashes, limit)
        if n:
            chain = self._chains.get(hashes[n - 1])
            if chain is not None:
                ids, epochs = chain
                # bytes equality: one memcmp, cheaper than a ufunc and a reduction
                if self._epoch[ids].tobytes() == epochs and not (self._num_dup and self._dup[ids].any()):
                    return ids
        return np.fromiter(map(self.cached.__getitem__, hashes[:n]), dtype=np.int64, count=n)

    def remember_chain(self, blocks: np.ndarray, last_hash: int) -> None:
        """Note that ``blocks`` carry a hash chain ending in ``last_hash``, for :meth:`match`."""
        chains = self._chains
        chains.pop(last_hash, None)
        chains[last_hash] = (blocks, self._epoch[blocks].tobytes())
        if len(chains) > self._max_chains:
            del chains[next(iter(chains))]

    def get_cached_block(self, h: int) -> int | None:
        return self.cached.get(h)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of cached hashes (each must be cached)."""
        cached = self.cached
        return [cached[h] for h in hashes]

    def num_idle(self, blocks: Sequence[int] | np.ndarray) -> int:
        """How many of ``blocks`` sit in the free queue (touching them uses free room)."""
        if not len(blocks):
            return 0
        return len(blocks) - int(np.count_nonzero(self.ref[np.asarray(blocks)]))

    # -- state changes -------------------------------------------------------
    def touch(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference on the cached blocks of a chain prefix; returns their ids."""
        ids = self.lookup(hashes)
        self.touch_blocks(ids)
        return ids

    def touch_blocks(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Take a reference on distinct blocks; idle ones leave the free queue (their entry goes stale)."""
        if not len(blocks):
            return
        idx = np.asarray(blocks)
        ref = self.ref
        self._num_free -= idx.size - int(np.count_nonzero(ref[idx]))
        ref[idx] += 1

    def touch_if_room(self, blocks: np.ndarray, extra: int) -> bool:
        """Take a reference on distinct ``blocks`` if the free queue can then still
        supply ``extra`` new blocks; else change nothing and return False.

        :meth:`num_idle` and :meth:`touch_blocks` in one pass over the blocks' counts
        (an admission's check and its touch)."""
        if not len(blocks):
            return extra <= self._num_free
        ref = self.ref
        counts = ref[blocks]
        idle = counts.size - int(np.count_nonzero(counts))  # counting the zeros would first build a mask
        if extra + idle > self._num_free:
            return False
        counts += 1
        ref[blocks] = counts
        self._num_free -= idle
        return True

    def get_new_blocks(self, n: int) -> list[int] | None:
        """Allocate ``n`` blocks from the free queue's head, evicting their hashes.

        Returns ``None`` (and changes nothing) when fewer than ``n`` are free, so the
        caller can preempt and retry.
        """
        if n > self._num_free:
            return None
        ref = self.ref
        if n == 1 and self._fresh < self.num_blocks:  # the common decode case
            b = self._fresh
            self._fresh += 1
            ref[b] = 1
            self._num_free -= 1
            return [b]
        take = min(n, self.num_blocks - self._fresh)
        out = list(range(self._fresh, self._fresh + take))
        ref[self._fresh : self._fresh + take] = 1
        self._fresh += take
        if take < n:
            out.extend(self._take_queued(n - take))
        self._num_free -= n
        return out

    def _take_queued(self, n: int) -> list[int]:
        """Take the first ``n`` live blocks of the queue (there are enough), evicting their hashes.

        A few blocks (a decode step's) are found entry by entry; many (a prefill's)
        with vectorised scans of the head, where numpy's per-call cost pays off.
        """
        q, ref, epoch = self._queue, self.ref, self._epoch
        got: list[int] = []
        i = self._head
        if n < 16:
            pos, base = self._pos, self._base
            while len(got) < n:
                b = int(q[i])
                if not ref[b] and pos[b] == base + i:
                    ref[b] = 1
                    epoch[b] += 1
                    got.append(b)
                i += 1
        else:
            while len(got) < n:
                want = n - len(got)
                hi = min(self._len, i + 2 * want + 64)  # stale entries are skipped: scan a little more
                live = self._live(i, hi)[:want]
                blocks = q[i + live]
                ref[blocks] = 1
                epoch[blocks] += 1
                got.extend(blocks.tolist())
                i = i + int(live[-1]) + 1 if len(live) == want else hi  # stop just past the last block taken
        self._head = i
        bh, cached, dups, hold = self.block_hash, self.cached, self._dups, self.holders
        evicted = 0
        for b in got:
            h = bh[b]
            if h is not None:
                if cached.get(h) == b and h not in dups:  # the common case, inlined
                    bh[b] = None
                    del cached[h]
                    evicted += 1
                    if hold is not None:
                        hold.drop(self.holder_bit, h)
                else:
                    self._evict(b)
        self.num_evictions += evicted
        return got

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        self.block_hash[b] = None
        self.num_evictions += 1
        others = self._dups.get(h)
        if self.cached.get(h) == b:
            if others:
                survivor = self.cached[h] = others.pop()
                self._dup[survivor] = False
                self._num_dup -= 1
            else:
                del self.cached[h]
                if self.holders is not None:
                    self.holders.drop(self.holder_bit, h)
        elif others:
            others.remove(b)
            self._dup[b] = False
            self._num_dup -= 1
        if others is not None and not others:
            del self._dups[h]

    def cache_full_block(self, block: int, h: int) -> None:
        """Mark a full block as holding chain hash ``h``; a block keeps its first hash."""
        if self.block_hash[block] is not None:
            return
        self.block_hash[block] = h
        if h in self.cached:
            self._dups.setdefault(h, []).append(block)
            self._dup[block] = True
            self._num_dup += 1
        else:
            self.cached[h] = block
            if self.holders is not None:
                self.holders.gain(self.holder_bit, h)

    def cache_full_blocks(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """:meth:`cache_full_block` for pairs of blocks and hashes."""
        bh, cached, hold = self.block_hash, self.cached, self.holders
        # Holders.gain, inlined for plain holders; a subclass (LaggingHolders) is told
        mask = hold.mask if type(hold) is Holders else None
        for b, h in zip(blocks, hashes):
            if bh[b] is None:
                if h in cached:
                    self.cache_full_block(b, h)
                else:
                    bh[b] = h
                    cached[h] = b
                    if mask is not None:
                        mask[h] = mask.get(h, 0) | self.holder_bit
                    elif hold is not None:
                        hold.gain(self.holder_bit, h)

    def free_blocks(self, ordered_blocks: Sequence[int] | np.ndarray) -> None:
        """Drop one reference on each of distinct blocks; those reaching zero join the
        queue's tail in the order given.

        Pass a request's blocks in reverse order (tail first) to get vLLM's eviction
        order.
        """
        if isinstance(ordered_blocks, np.ndarray):
            idx = ordered_blocks
        else:
            idx = np.array(ordered_blocks if isinstance(ordered_blocks, list) else list(ordered_blocks), dtype=np.int64)
        if not idx.size:
            return
        if self._len + idx.size > len(self._queue):
            self._rebuild()
        ref = self.ref
        counts = ref[idx]
        counts -= 1
        ref[idx] = counts
        zero = idx[counts == 0]
        if zero.size:
            p = self._len
            self._queue[p : p + zero.size] = zero
            self._pos[zero] = np.arange(self._base + p, self._base + p + zero.size)
            self._len += zero.size
            self._num_free += int(zero.size)

    def _rebuild(self) -> None:
        """Pack the live entries at the queue's front (consumed and stale ones go)."""
        live = self._queue[self._head + self._live(self._head, self._len)]
        self._base += self._len
        self._queue[: len(live)] = live
        self._pos[live] = np.arange(self._base, self._base + len(live))
        self._len = len(live)
        self._head = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only allowed when no block is in use, as in vLLM)."""
        if self.num_used_blocks:
            return False
        if self.holders is not None:
            for h in self.cached:
                self.holders.drop(self.holder_bit, h)
        self.cached.clear()
        self._dups.clear()
        self._dup[:] = False
        self._num_dup = 0
        self._chains.clear()
        self.block_hash = [None] * self.num_blocks
        return True
