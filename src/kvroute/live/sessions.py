"""The gateway's session table: session id -> worker of its previous turn.

Memory first, Redis behind it, so several gateway replicas share sessions
(per-replica tables scatter sessions when the router is replicated: dynamo issue
11035) while the request path never waits on a Redis write::

    set(sid, w) ──► memory (now) ──► pending {sid: w} ──► flusher task ──► Redis
                                      (latest write wins)   one pipeline of SET key w PX ttl
    get(sid)    ──► memory hit? ──► else Redis GET (short timeout) ──► memory

When Redis is down (a refused connection, an error or a timeout on a write) the store
keeps working from memory, logs the transition once, keeps the unsent writes (latest
per session, bounded) and a prober pings Redis every ``probe_interval_s``; when it
answers, the kept writes are flushed and reads resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from kvroute.live.aio import cancel_all

log = logging.getLogger(__name__)

KEY_PREFIX = "kvroute:session:"


class SessionStore:
    """Session table with an in-memory copy and an optional shared Redis.

    Args:
        redis_url: ``redis://host:port/db``; ``None`` keeps the table in memory only.
        ttl_s: a session is forgotten this long after its last write (memory and
            Redis ``PX``).
        read_timeout_s: longest wait for a Redis read on a memory miss; on timeout
            the read counts as a miss.
        write_timeout_s: longest wait for one pipelined batch of writes.
        probe_interval_s: how often Redis is pinged (detects it going and coming back).
        max_memory: sessions kept in memory (least recently written dropped first).
        max_pending: unsent writes kept while Redis is down (oldest dropped first).
        key_prefix: Redis key prefix; replicas that should share sessions use the same.
        clock: monotonic seconds (for tests).

    Call :meth:`start` inside the event loop before use and :meth:`close` at the end.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        ttl_s: float = 3600.0,
        read_timeout_s: float = 0.05,
        write_timeout_s: float = 0.5,
        probe_interval_s: float = 1.0,
        max_memory: int = 1_000_000,
        max_pending: int = 100_000,
        key_prefix: str = KEY_PREFIX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session ttl_s must be > 0, got {ttl_s}")
        self.redis_url = redis_url
        self.ttl_s = ttl_s
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.probe_interval_s = probe_interval_s
        self.max_memory = max_memory
        self.max_pending = max_pending
        self.key_prefix = key_prefix
        self.clock = clock
        self._memory: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._pending: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._redis = None
        self._tasks: list[asyncio.Task] = []
        self._redis_up: bool | None = None  # None until the first answer or failure
        #: counters: writes sent to Redis, dropped while it was down, Redis reads and hits
        self.writes_flushed = 0
        self.writes_dropped = 0
        self.redis_reads = 0
        self.redis_hits = 0

    # -- state ---------------------------------------------------------------------
    @property
    def redis_enabled(self) -> bool:
        return self.redis_url is not None

    @property
    def redis_up(self) -> bool:
        """True while Redis answers (False when disabled, down or not yet reached)."""
        return bool(self._redis_up)

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    def _set_up(self, up: bool, why: object = None) -> None:
        if up == self._redis_up:
            return
        first = self._redis_up is None
        self._redis_up = up
        if up:
            (log.info if first else log.warning)(
                "redis %s is up: sessions are shared and written through", self.redis_url
            )
            self._wake.set()  # flush what was kept while it was down
        else:
            log.warning(
                "redis %s is down (%r): routing from the in-memory session table; "
                "writes are kept and resume when it returns",
                self.redis_url,
                why,
            )

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Connect (if a URL was given) and start the flusher and the prober."""
        if not self.redis_enabled:
            return
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._redis = Redis.from_url(
            self.redis_url,
            socket_timeout=max(self.read_timeout_s, self.write_timeout_s),
            socket_connect_timeout=self.write_timeout_s,
            retry=Retry(NoBackoff(), 0),  # never retry on the caller's time; the prober does
        )
        await self._ping()
        self._tasks = [
            asyncio.create_task(self._flusher(), name="sessions-flusher"),
            asyncio.create_task(self._prober(), name="sessions-prober"),
        ]

    async def close(self, flush_timeout_s: float = 1.0) -> None:
        """Try to flush pending writes (bounded), then stop the tasks and disconnect."""
        if self._redis is None:
            return
        if self._pending and self.redis_up:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.flush(), flush_timeout_s)
        await cancel_all(self._tasks)
        self._tasks = []
        with contextlib.suppress(Exception):
            await self._redis.aclose()
        self._redis = None

    # -- reads ---------------------------------------------------------------------
    def peek(self, session_id: str) -> str | None:
        """The worker in memory for ``session_id`` (no I/O); ``None`` if unknown or expired."""
        entry = self._memory.get(session_id)
        if entry is None:
            return None
        if entry[1] < self.clock():
            del self._memory[session_id]
            return None
        return entry[0]

    async def get(self, session_id: str) -> str | None:
        """Memory first; on a miss, Redis (if up) with ``read_timeout_s``; errors -> ``None``."""
        worker = self.peek(session_id)
        if worker is not None or not self._redis_up:
            return worker
        self.redis_reads += 1
        try:
            value = await asyncio.wait_for(
                self._redis.get(self.key_prefix + session_id), self.read_timeout_s
            )
        except asyncio.TimeoutError:
            return None  # slow, not necessarily down: the prober decides
        except Exception as exc:  # redis.ConnectionError, OSError, ...
            self._set_up(False, exc)
            return None
        if value is None:
            return None
        worker = value.decode() if isinstance(value, bytes) else str(value)
        self.redis_hits += 1
        self._remember(session_id, worker)
        return worker

    # -- writes --------------------------------------------------------------------
    def set(self, session_id: str, worker: str) -> None:
        """Record ``worker`` for ``session_id``: memory now, Redis by the flusher. Never blocks."""
        self._remember(session_id, worker)
        if self._redis is None:
            return
        pending = self._pending
        pending.pop(session_id, None)  # re-insert: dict order is write order
        pending[session_id] = worker
        if len(pending) > self.max_pending:
            del pending[next(iter(pending))]
            self.writes_dropped += 1
        if self._redis_up:
            self._wake.set()

    async def flush(self) -> None:
        """Wait until every pending write has been sent (tests; shutdown)."""
        while self._pending and self.redis_up:
            self._wake.set()
            await asyncio.sleep(0.001)

    def _remember(self, session_id: str, worker: str) -> None:
        memory = self._memory
        memory[session_id] = (worker, self.clock() + self.ttl_s)
        memory.move_to_end(session_id)
        if len(memory) > self.max_memory:
            memory.popitem(last=False)

    # -- background tasks ----------------------------------------------------------
    async def _flusher(self) -> None:
        ttl_ms = max(1, int(self.ttl_s * 1000))
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending or not self._redis_up:
                continue
            batch, self._pending = self._pending, {}
            try:
                pipe = self._redis.pipeline(transaction=False)
                for sid, worker in batch.items():
                    pipe.set(self.key_prefix + sid, worker, px=ttl_ms)
                await asyncio.wait_for(pipe.execute(), self.write_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # keep them (writes made since are newer and win), bounded
                for sid, worker in batch.items():
                    self._pending.setdefault(sid, worker)
                while len(self._pending) > self.max_pending:
                    del self._pending[next(iter(self._pending))]
                    self.writes_dropped += 1
                self._set_up(False, exc)
            else:
                self.writes_flushed += len(batch)

    async def _ping(self) -> None:
        try:
            await asyncio.wait_for(self._redis.ping(), self.write_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._set_up(False, exc)
        else:
            self._set_up(True)

    async def _prober(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self._ping()
