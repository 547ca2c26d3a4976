"""Which workers' pools hold each cached block hash: one cluster-wide bitmask per hash.

Why: an exact cache-aware router asks every worker for its longest cached prefix of
every request. Asked pool by pool that is one binary search of the chain per worker,
so tenfold workers and tenfold requests cost a hundredfold in routing (the simulator
benchmark's forty-worker case). Each pool's cached set is closed under prefixes (see
:mod:`kvroute.kvcache.pool`), so along a request's chain the sets of holders shrink and
never grow: block k+1's holders are a subset of block k's. All the workers' answers
then come from one binary search per distinct holder set along the chain (usually two
or three: the shared system prompt's, the conversation's, nobody's).

The pools keep it current (:meth:`BlockPool.share_holders`): a hash gains a worker's bit
when that pool first caches it and loses it when the pool evicts its last block with
that hash. Exact, like the pools; no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Holders:
    """``mask[h]``: bit i set while worker i's pool holds hash ``h`` (absent: nobody)."""

    def __init__(self) -> None:
        self.mask: dict[int, int] = {}

    def add(self, bit: int, hashes: Iterable[int]) -> None:
        mask = self.mask
        get = mask.get
        for h in hashes:
            mask[h] = get(h, 0) | bit

    def gain(self, bit: int, h: int) -> None:
        self.mask[h] = self.mask.get(h, 0) | bit

    def drop(self, bit: int, h: int) -> None:
        m = self.mask[h] & ~bit
        if m:
            self.mask[h] = m
        else:
            del self.mask[h]

    def matched_blocks(self, hashes: Sequence[int], workers: int) -> list[int]:
        """Leading blocks of ``hashes`` each of ``workers`` workers holds, by worker index."""
        out = [0] * workers
        get = self.mask.get
        n = len(hashes)
        lo = 0
        m = get(hashes[0], 0) if n else 0
        while m:
            # last a >= lo whose holders are exactly m (they are m at lo; nested after)
            a, b = lo, n - 1
            while a < b:
                mid = (a + b + 1) >> 1
                if get(hashes[mid], 0) == m:
                    a = mid
                else:
                    b = mid - 1
            lo = a + 1
            nxt = get(hashes[lo], 0) if lo < n else 0
            gone = m & ~nxt  # these workers' runs end at block a
            while gone:
                low = gone & -gone
                out[low.bit_length() - 1] = lo
                gone ^= low
            m = nxt
        return out
