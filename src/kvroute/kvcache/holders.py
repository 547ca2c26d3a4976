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

from collections import deque
from collections.abc import Callable, Iterable, Sequence


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


class LaggingHolders(Holders):
    """:class:`Holders` as a router learns them from KV events that arrive ``delay_s`` late.

    The pools report each change as it happens (``gain``/``drop``/``add``, as to plain
    holders); the change is queued with the ``clock`` time and reaches ``mask`` only at
    :meth:`catch_up` once ``delay_s`` has passed, in the order the pools made them. So
    ``matched_blocks`` answers what the caches held ``delay_s`` ago: blocks cached since
    are unknown, blocks evicted since still count. Per worker bit and hash, the pools
    report gain and drop alternately, so applying them in order keeps ``mask`` and
    ``sizes`` consistent. The pools must not write ``mask`` themselves
    (:meth:`BlockPool.cache_full_blocks` inlines that only for plain :class:`Holders`).
    """

    def __init__(self, clock: Callable[[], float], delay_s: float) -> None:
        super().__init__()
        self.clock = clock
        self.delay_s = delay_s
        self.sizes: dict[int, int] = {}  # worker bit -> hashes it holds, as the router knows
        self._pending: deque[tuple[float, int, int]] = deque()  # (time, +bit gain | -bit drop, hash)

    def add(self, bit: int, hashes: Iterable[int]) -> None:
        t = self.clock()
        self._pending.extend((t, bit, h) for h in hashes)

    def gain(self, bit: int, h: int) -> None:
        self._pending.append((self.clock(), bit, h))

    def drop(self, bit: int, h: int) -> None:
        self._pending.append((self.clock(), -bit, h))

    def catch_up(self) -> None:
        """Apply every change at least ``delay_s`` old."""
        pending = self._pending
        if not pending:
            return
        cutoff = self.clock() - self.delay_s
        mask, sizes = self.mask, self.sizes
        while pending and pending[0][0] <= cutoff:
            _, bit, h = pending.popleft()
            if bit > 0:
                mask[h] = mask.get(h, 0) | bit
                sizes[bit] = sizes.get(bit, 0) + 1
            else:
                Holders.drop(self, -bit, h)
                sizes[-bit] -= 1
