"""Router-side approximate prefix index: what the router *believes* each worker caches.

Built only from the router's own decisions: when it routes a request to a worker it
records the prompt's chained full-block hashes there, assuming the engine will cache
them. It never sees the engine's evictions, so it is approximate, as SGLang's
per-worker radix tree and Dynamo's ``ApproxKvIndexer`` (120 s TTL) are. Staleness is
bounded by a TTL and the size by an LRU capacity per worker.

Per worker, an ``OrderedDict`` maps block hash -> last time recorded, oldest first::

    LRU end (evicted first)                         MRU end
    [ tail blocks of old chains ... heads of the newest chain ]

A chain is recorded tail first, so its head (the shared system prompt, the early
turns) is the most recent entry and is evicted last, like vLLM freeing a request's
blocks tail first. A match counts leading blocks only: block k of a chain is believed
cached only if blocks 0..k-1 are (they are its prefix).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class ApproxPrefixIndex:
    """Per-worker LRU sets of block hashes with a time-to-live.

    Args:
        workers: initial worker names.
        block_size: tokens per block (to convert a block match into tokens).
        capacity_blocks_per_worker: most hashes kept per worker before LRU eviction;
            ``None`` for no bound (TTL only, as Dynamo's approximate indexer). Pass
            the engine's KV capacity in blocks to mirror its pool.
        ttl_s: an entry recorded more than ``ttl_s`` ago is expired (age == ttl_s
            still counts).

    Times are the caller's clock (simulated or ``time.monotonic()``) and must not
    go backwards across :meth:`record` calls. Deterministic: no clocks, no hashing
    of its own, no randomness.
    """

    def __init__(
        self,
        workers: Iterable[str],
        block_size: int,
        capacity_blocks_per_worker: int | None = None,
        ttl_s: float = 120.0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if capacity_blocks_per_worker is not None and capacity_blocks_per_worker <= 0:
            raise ValueError(
                f"capacity_blocks_per_worker must be > 0 or None, got {capacity_blocks_per_worker}"
            )
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.block_size = block_size
        self.capacity = capacity_blocks_per_worker
        self.ttl_s = ttl_s
        self._blocks: dict[str, OrderedDict[int, float]] = {w: OrderedDict() for w in workers}
        self._last_s = float("-inf")

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._blocks)

    def add_worker(self, worker: str) -> None:
        """Start tracking a (new or returning) worker with an empty index."""
        self._blocks.setdefault(worker, OrderedDict())

    def remove_worker(self, worker: str) -> None:
        """Forget a worker (it went down: its cache is gone). Unknown names are ignored."""
        self._blocks.pop(worker, None)

    def clear(self) -> None:
        """Forget every entry (all engines reset their prefix caches); workers stay."""
        for blocks in self._blocks.values():
            blocks.clear()

    def record(self, worker: str, block_hashes: Sequence[int], now_s: float) -> None:
        """Note that ``worker`` was sent a prompt whose full blocks hash to ``block_hashes``.

        Refreshes the entries' time, expires entries older than ``ttl_s`` and evicts
        the least recently recorded beyond capacity. KeyError for an untracked worker.
        """
        if now_s < self._last_s:
            raise ValueError(f"time went backwards: {now_s} < {self._last_s}")
        self._last_s = now_s
        try:
            blocks = self._blocks[worker]
        except KeyError:
            raise KeyError(f"worker {worker!r} is not tracked; add_worker it first") from None
        for h in reversed(block_hashes):
            blocks[h] = now_s
            blocks.move_to_end(h)
        self._expire(blocks, now_s)
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)

    def match(self, worker: str, block_hashes: Sequence[int], now_s: float) -> int:
        """Leading blocks of ``block_hashes`` believed cached on ``worker`` at ``now_s``.

        Read-only (a match is not a use: the request may go elsewhere). 0 for an
        untracked worker.
        """
        blocks = self._blocks.get(worker)
        if not blocks:
            return 0
        oldest = now_s - self.ttl_s
        for n, h in enumerate(block_hashes):
            seen = blocks.get(h)
            if seen is None or seen < oldest:
                return n
        return len(block_hashes)

    def match_tokens(self, worker: str, block_hashes: Sequence[int], now_s: float) -> int:
        """:meth:`match` in tokens (``blocks * block_size``)."""
        return self.match(worker, block_hashes, now_s) * self.block_size

    def size(self, worker: str) -> int:
        """Hashes held for ``worker`` (expired ones are dropped at its next record)."""
        blocks = self._blocks.get(worker)
        return len(blocks) if blocks is not None else 0

    def expire(self, now_s: float) -> None:
        """Drop every worker's entries older than ``ttl_s`` (e.g. before reading sizes)."""
        for blocks in self._blocks.values():
            self._expire(blocks, now_s)

    def _expire(self, blocks: OrderedDict[int, float], now_s: float) -> None:
        # Entries are in record order and times never go backwards, so expired
        # entries sit at the LRU end.
        oldest = now_s - self.ttl_s
        while blocks:
            h, seen = next(iter(blocks.items()))
            if seen >= oldest:
                break
            del blocks[h]
