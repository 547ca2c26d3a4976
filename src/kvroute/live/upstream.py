"""The gateway's upstream client: HTTP/1.1 over kept-alive connections, and little else.

The gateway sends one kind of request (a POST with a body it already holds) and relays
what comes back, so it needs far less than a general client: no redirects, cookies,
proxies, TLS, compression, auth, tracing or per-request timers. aiohttp's
``ClientSession.request`` did all of that on every request and cost more CPU than the
rest of the gateway's request path together (its routing, parsing and hashing
included); this client writes the request head and body in one send on a pooled
connection and parses the response in one small protocol object::

    request(worker, head, body) ─► idle connection of that worker (or a new one, TCP_NODELAY)
                                    one transport.write(head + body)
                                 ◄─ status line + headers parsed (1xx skipped)
    read() ─► body bytes as they arrive (Content-Length, chunked, or until close),
              chunked framing removed; b"" at the end
    first(cb), relay(sink) ─► the same bytes handed on from the protocol's own
              data_received: a streamed reply's events go out without a task switch,
              future or timer per read (the gateway's streaming path)
    release() ─► back to the pool when the response ended cleanly and keeps alive

Failures raise :class:`UpstreamError` (an ``OSError``) with ``kind`` ``connect``
(``refused`` when the worker refused or could not be reached), ``send`` or ``read``,
and timeouts raise ``asyncio.TimeoutError``. A kept-alive connection the worker closed
while it sat idle is noticed by its ``connection_lost`` and dropped; one that closes
just as a request is written (before any response byte) is retried once on a new
connection, as browsers and Go's http.Transport do.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable

#: connection states
_IDLE, _HEAD, _BODY, _DONE = range(4)
_MAX_HEAD = 64 * 1024  # longest response head accepted
_HIGH_WATER = 256 * 1024  # buffered body bytes before the worker's socket is paused


class UpstreamError(ConnectionError):
    """An upstream connection failed: ``kind`` is ``connect``, ``send`` or ``read``."""

    def __init__(self, kind: str, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.refused = refused


class Upstream(asyncio.Protocol):
    """One connection to a worker, and the response being read on it.

    After :meth:`UpstreamPool.request` returns, ``status`` and ``headers`` (``(name,
    value)`` str pairs as sent) hold the response head; :meth:`read` returns the body.
    """

    __slots__ = (
        "pool", "key", "transport", "state", "status", "headers", "content_type",
        "has_length", "_loop", "_head", "_remaining", "_chunked", "_cbuf", "_chunks",
        "_buffered", "_waiter", "_exc", "_keep_alive", "_closed", "_paused",
        "_got_bytes", "_timeout", "_timer", "_sink", "_done", "_last", "_held", "_first",
    )

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.key = key
        self._loop = pool._loop
        self._timeout = pool.read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.state = _IDLE
        self._closed = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._timer = None
        self._paused = False
        self._sink = None  # relay mode (:meth:`relay`): body bytes go here as they arrive
        self._done: asyncio.Future | None = None  # relay mode: resolved at the body's end
        self._last = 0.0  # relay mode: loop time of the last bytes received
        self._held = False  # paused by the caller (:meth:`pause`), not by the buffer mark
        self._first = None  # :meth:`first`'s callback, until the first body bytes came
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self._held = False
        self.headers: list[tuple[str, str]] = []
        self.content_type = ""
        self.has_length = False
        self._head = b""
        self._remaining = -1  # body bytes left (Content-Length); -1: chunked or until close
        self._chunked = False
        self._cbuf = b""  # chunked framing not yet parsed
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._keep_alive = True
        self._got_bytes = False

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc: BaseException | None) -> None:
        self._closed = True
        self.pool._lost(self)
        if self.state == _BODY and self._remaining < 0 and not self._chunked:
            self._finish()  # a body delimited by the connection's end
            self._wake()
            return
        if self.state in (_HEAD, _BODY):
            got = "after" if self._got_bytes else "before"
            self._exc = UpstreamError(
                "read", f"worker closed the connection {got} the response ended: {exc!r}"
            )
        self._wake()

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        if self.state == _BODY:
            self._body(data)
            if self._sink is not None:
                self._last = self._loop.time()
                self._to_sink()
            elif self._first is not None:
                self._hand_first()
        elif self.state == _HEAD:
            self._parse_head(data)
        else:  # bytes nobody asked for: the connection is out of step
            self._keep_alive = False
            self.transport.close()

    def pause_writing(self) -> None:  # the request is written once; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- parsing -------------------------------------------------------------------
    def _parse_head(self, data: bytes) -> None:
        head = self._head + data if self._head else data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > _MAX_HEAD:
                self._fail(UpstreamError("read", "response head too long"))
            else:
                self._head = head
            return
        self._head = b""
        lines = head[:end].decode("latin-1").split("\r\n")
        try:
            version, code = lines[0].split(" ", 2)[:2]
            status = int(code)
        except ValueError:
            self._fail(UpstreamError("read", f"bad status line {lines[0][:100]!r}"))
            return
        rest = head[end + 4 :]
        if 100 <= status < 200:  # 100 Continue and friends: the real head follows
            if rest:
                self._parse_head(rest)
            return
        headers = []
        length = -1
        chunked = False
        keep_alive = version == "HTTP/1.1"
        ctype = ""
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                continue
            value = value.strip()
            headers.append((name, value))
            n = name.lower()
            if n == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._fail(UpstreamError("read", f"bad Content-Length {value!r}"))
                    return
            elif n == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif n == "connection":
                v = value.lower()
                if "close" in v:
                    keep_alive = False
                elif "keep-alive" in v:
                    keep_alive = True
            elif n == "content-type":
                ctype = value
        self.status = status
        self.headers = headers
        self.content_type = ctype
        self._keep_alive = keep_alive
        if chunked:
            self._chunked = True
        elif length >= 0:
            self._remaining = length
            self.has_length = True
        elif status in (204, 304):
            self._remaining = 0
            self.has_length = True
        else:
            self._keep_alive = False  # delimited by the connection's end
        self.state = _BODY
        if self._remaining == 0:
            self._finish()
            if rest:
                self._keep_alive = False
        elif rest:
            self._body(rest)
        self._wake()

    def _body(self, data: bytes) -> None:
        if self._chunked:
            self._dechunk(data)
        elif self._remaining >= 0:
            n = len(data)
            if n >= self._remaining:
                if n > self._remaining:
                    data = data[: self._remaining]
                    self._keep_alive = False
                self._remaining = 0
                self._push(data)
                self._finish()
            else:
                self._remaining -= n
                self._push(data)
        else:
            self._push(data)
        self._wake()

    def _dechunk(self, data: bytes) -> None:
        buf = self._cbuf + data if self._cbuf else data
        pos = 0
        n = len(buf)
        remaining = self._remaining  # bytes of the current chunk's data still to come
        while pos < n:
            if remaining > 0:  # inside a chunk's data
                take = min(remaining, n - pos)
                self._push(buf[pos : pos + take] if (pos or take < n) else buf)
                pos += take
                remaining -= take
                if remaining == 0:
                    remaining = -2  # its CRLF comes next
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            if remaining == -2:  # the CRLF after a chunk's data
                if eol != pos:
                    self._fail(UpstreamError("read", "bad chunked encoding"))
                    return
                pos = eol + 2
                remaining = -1
                continue
            if remaining == -3:  # trailers after the last chunk, up to an empty line
                empty = eol == pos
                pos = eol + 2
                if empty:
                    self._end_chunked(pos < n)
                    return
                continue
            try:
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
            except ValueError:
                self._fail(UpstreamError("read", "bad chunk size"))
                return
            pos = eol + 2
            if size == 0:
                remaining = -3  # trailers (usually none: an empty line) end the message
            else:
                remaining = size
        self._remaining = remaining
        self._cbuf = buf[pos:] if pos < n else b""

    def _end_chunked(self, extra: bool) -> None:
        self._remaining = 0
        self._cbuf = b""
        if extra:  # bytes after the message: the connection is out of step
            self._keep_alive = False
        self._finish()

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if (self._buffered > _HIGH_WATER and not self._paused and self._sink is None
                and self.transport is not None):  # (a relay hands each read on at once)
            self._paused = True
            self.transport.pause_reading()

    def _finish(self) -> None:
        self.state = _DONE

    def _fail(self, exc: BaseException) -> None:
        self._exc = exc
        self._keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)
        d = self._done
        if d is not None and (self._exc is not None or self._closed) and not d.done():
            self._to_sink()  # what arrived before the end or the failure (settles d at the end)
            if d.done():
                pass
            elif self._exc is not None:
                d.set_exception(self._exc)
            elif self.state == _DONE:
                d.set_result(None)
            else:
                d.set_exception(UpstreamError("read", "worker closed the connection"))

    def _take(self) -> bytes:
        """The body bytes parsed and not yet handed on (b"" if none), no longer buffered."""
        chunks = self._chunks
        if not chunks:
            return b""
        self._chunks = []
        self._buffered = 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _to_sink(self) -> None:
        """Relay mode: hand the body bytes parsed so far to the sink, with the end if it came."""
        end = self.state == _DONE
        if not self._chunks and not end:
            return
        self._sink(self._take(), end)
        if end:
            d = self._done
            self._sink = None
            if d is not None and not d.done():
                d.set_result(None)

    def _idle_check(self) -> None:
        """Relay mode's read timeout: one timer per response, not one per read."""
        d = self._done
        if d is None or d.done():
            return
        idle = self._loop.time() - self._last
        if idle >= self._timeout:
            self._sink = None
            d.set_exception(asyncio.TimeoutError())
        else:
            self._timer = self._loop.call_later(self._timeout - idle, self._idle_check)

    def _on_timeout(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            self._waiter = None
            w.set_exception(asyncio.TimeoutError())

    async def _wait(self) -> None:
        w = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(self._timeout, self._on_timeout) if self._timeout else None
        try:
            await w
        finally:
            if timer is not None:
                timer.cancel()

    # -- the response ----------------------------------------------------------------
    def at_eof(self) -> bool:
        """True when the whole body has been read."""
        return self.state == _DONE and not self._chunks

    async def read(self) -> bytes:
        """The body bytes that arrived since the last call (waits for some); b"" at the end."""
        while True:
            if self._chunks:
                data = self._take()
                if self._paused and not self._closed:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.state == _DONE:
                return b""
            if self._exc is not None:
                raise self._exc
            if self._closed:
                raise UpstreamError("read", "worker closed the connection")
            await self._wait()

    def _hand_first(self) -> None:
        """Give :meth:`first`'s callback the body bytes parsed so far (if any, or the end)."""
        end = self.state == _DONE
        if not self._chunks and not end:
            return
        data = self._take()
        if self._paused and not self._held and not self._closed:
            self._paused = False
            self.transport.resume_reading()
        f, self._first = self._first, None
        f(data, end)

    async def first(self, on_first) -> None:
        """Wait for the body's first bytes and call ``on_first(data, end)`` with them from
        :meth:`data_received` itself, so they can go on before this coroutine runs again
        (when many responses' bytes arrive at once, a woken task runs only after all of
        their callbacks). ``end``: the body ended with them. Raises like :meth:`read`,
        without having called ``on_first``."""
        self._first = on_first
        try:
            while self._first is not None:
                if self._chunks or self.state == _DONE:
                    self._hand_first()
                    break
                if self._exc is not None:
                    raise self._exc
                if self._closed:
                    raise UpstreamError("read", "worker closed the connection")
                await self._wait()
        finally:
            self._first = None

    async def relay(self, sink) -> None:
        """Hand the rest of the body to ``sink(data, end)`` as it arrives; return at its end.

        The bytes go to the sink from :meth:`data_received` itself: no task switch, future
        or timer per read, which is what a streamed reply's many small events cost through
        :meth:`read`. ``end`` is True on the call that carries the body's last bytes (or
        none). Raises like :meth:`read` (``UpstreamError``, ``asyncio.TimeoutError`` after
        ``read_timeout_s`` without a byte); the sink has then had what arrived before.
        Flow control is the caller's: :meth:`pause` and :meth:`resume` while its own
        writes are paused.
        """
        loop = self._loop
        done = self._done = loop.create_future()
        self._sink = sink
        self._last = loop.time()
        try:
            if self.state == _DONE:
                self._to_sink()  # the whole body is already here: hand it on, settle
            elif self._exc is not None or self._closed:
                self._wake()  # already failed: settle now
            else:
                self._to_sink()  # what was buffered before relaying began
                if self._paused and not self._held:  # paused at the buffer mark: nothing buffered now
                    self._paused = False
                    self.transport.resume_reading()
                if self._timeout and not done.done():
                    self._timer = loop.call_later(self._timeout, self._idle_check)
            await done
        finally:
            self._sink = None
            self._done = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def pause(self) -> None:
        """Stop reading from the worker (the relay's client is not keeping up)."""
        self._held = True
        if not self._paused and not self._closed and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        self._held = False
        if self._paused and not self._closed:
            self._paused = False
            self.transport.resume_reading()

    async def read_all(self) -> bytes:
        """The rest of the body."""
        parts = []
        while True:
            data = await self.read()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if it can."""
        if (self.state == _DONE and self._keep_alive and not self._closed and not self._chunks
                and not self._paused):
            self.state = _IDLE
            self._reset()
            self.pool._idle_push(self)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection (the worker sees it close and aborts the request)."""
        self._keep_alive = False
        if self.transport is not None and not self._closed:
            self.transport.close()
        self._closed = True
        self.pool._lost(self)


class UpstreamPool:
    """Kept-alive connections to the workers, by ``(host, port, tls)``.

    Args:
        connect_timeout_s: longest wait for a new connection.
        read_timeout_s: longest silence from a worker (head or body) before
            ``asyncio.TimeoutError``; ``None`` waits forever.
        max_idle_per_host: idle connections kept per worker (extra ones are closed).
    """

    def __init__(
        self, connect_timeout_s: float = 2.0, read_timeout_s: float | None = 600.0,
        max_idle_per_host: int = 1024,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, int, bool], list[Upstream]] = {}
        self._all: set[Upstream] = set()
        self.connections_made = 0

    async def request(self, host: str, port: int, data: bytes, tls: bool = False) -> Upstream:
        """Send ``data`` (a whole request: head and body) and wait for the response head."""
        key = (host, port, tls)
        idle = self._idle.get(key)
        conn = None
        while idle:
            c = idle.pop()
            if not c._closed:
                conn = c
                break
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except UpstreamError as exc:
                if conn._got_bytes or exc.kind == "connect":
                    raise
                # a kept-alive connection that the worker closed as we wrote: once more, anew
        conn = await self._connect(key)
        return await self._exchange(conn, data)

    async def _connect(self, key: tuple[str, int, bool]) -> Upstream:
        try:
            _, conn = await asyncio.wait_for(
                self._loop.create_connection(
                    lambda: Upstream(self, key), key[0], key[1], ssl=key[2] or None
                ),
                self.connect_timeout_s,
            )
        except asyncio.TimeoutError as exc:
            raise UpstreamError("connect", f"connect to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {key[0]}:{key[1]}: {exc}", refused=True) from exc
        self._all.add(conn)
        self.connections_made += 1
        return conn

    async def _exchange(self, conn: Upstream, data: bytes) -> Upstream:
        conn.state = _HEAD
        try:
            conn.transport.write(data)
        except (OSError, RuntimeError) as exc:
            conn.close()
            raise UpstreamError("send", f"cannot send: {exc!r}") from exc
        try:
            while conn.state == _HEAD:
                if conn._exc is not None:
                    raise conn._exc
                if conn._closed:
                    raise UpstreamError("read", "worker closed the connection before answering")
                await conn._wait()
        except BaseException:
            conn.close()
            raise
        return conn

    def _idle_push(self, conn: Upstream) -> None:
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = []
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        idle.append(conn)

    def _lost(self, conn: Upstream) -> None:
        self._all.discard(conn)

    def idle(self, host: str, port: int, tls: bool = False) -> int:
        """Idle connections kept for ``host:port`` (tests)."""
        return sum(not c._closed for c in self._idle.get((host, port, tls), ()))

    def connections(self) -> Iterable[Upstream]:
        return tuple(self._all)

    def close(self) -> None:
        """Close every connection, idle or busy."""
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
