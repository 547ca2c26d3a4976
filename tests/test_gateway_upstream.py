"""The gateway's upstream client (kvroute.live.upstream) against raw TCP servers on 127.0.0.1.

The servers here are TEST SERVERS: asyncio servers that answer each request with bytes
the test chose (split as the test chose), so framing, keep-alive and failures can be
exercised exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.live.upstream import UpstreamError, UpstreamPool


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class RawServer:
    """TEST SERVER: reads one request (head + Content-Length body), writes ``replies`` pieces.

    ``replies`` is a list (one entry per request on a connection, the last repeated) of
    lists of byte pieces, written with a short pause between them so they arrive apart.
    ``close_after`` closes each connection after that many responses.
    """

    def __init__(self, replies, close_after: int | None = None, pause_s: float = 0.002) -> None:
        self.replies = replies
        self.close_after = close_after
        self.pause_s = pause_s
        self.connections = 0
        self.requests: list[bytes] = []
        self.server = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                pieces = self.replies[min(served, len(self.replies) - 1)]
                for i, piece in enumerate(pieces):
                    if i and self.pause_s:
                        await asyncio.sleep(self.pause_s)
                    writer.write(piece)
                    await writer.drain()
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> RawServer:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.server.close()


@contextlib.asynccontextmanager
async def serving(replies: list[list[bytes]], pool: UpstreamPool | None = None, **server):
    """A started RawServer (``server``: its keywords) and a pool (a fresh one unless
    given), both closed when the block ends."""
    srv = await RawServer(replies, **server).start()
    pool = pool or UpstreamPool()
    try:
        yield srv, pool
    finally:
        pool.close()
        await srv.stop()


def request(body: bytes = b'{"x": 1}') -> bytes:
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailer + b"\r\n"


def split(raw: bytes, cuts: list[int]) -> list[bytes]:
    """``raw`` cut into pieces of the given lengths (the rest, if any, as a last piece)."""
    pieces, pos = [], 0
    for c in cuts:
        if pos >= len(raw):
            break
        pieces.append(raw[pos : pos + c])
        pos += c
    if pos < len(raw):
        pieces.append(raw[pos:])
    return pieces


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nX-Backend: b0\r\n\r\n"
EVENTS = [b"data: {\"t\": %d}\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]


def one_piece_per_event(events: list[bytes]) -> list[bytes]:
    """An SSE response as pieces to send apart: the head, one chunk per event, the end."""
    return [SSE_HEAD] + [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]


async def exchange(pool: UpstreamPool, srv: RawServer) -> tuple[int, list[tuple[str, str]], bytes, int]:
    """One request: status, headers, the whole body, and how many reads it took."""
    resp = await pool.request("127.0.0.1", srv.port, request())
    reads, parts = 0, []
    while True:
        data = await resp.read()
        if not data:
            break
        reads += 1
        parts.append(data)
    status, headers = resp.status, resp.headers
    resp.release()
    return status, headers, b"".join(parts), reads


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.binary(min_size=0, max_size=3))
def test_chunked_bodies_decode_however_the_bytes_are_split(cuts, trailer_junk):
    """The whole response (head, chunk framing, trailers) cut at arbitrary points."""
    trailer = b"X-Trailer: 1\r\n" if trailer_junk else b""
    pieces = split(SSE_HEAD + chunked(*EVENTS, trailer=trailer), cuts)

    async def body():
        async with serving([pieces], pause_s=0.0005, pool=UpstreamPool(read_timeout_s=5)) as (srv, pool):
            for _ in range(2):  # the second on the same, kept-alive connection
                status, headers, data, _ = await exchange(pool, srv)
                assert status == 200 and ("X-Backend", "b0") in headers
                assert data == b"".join(EVENTS)
            assert srv.connections == 1 and pool.connections_made == 1

    run(body())


def test_events_arrive_one_read_each_when_sent_apart():
    async def body():
        pieces = one_piece_per_event(EVENTS)
        async with serving([pieces], pause_s=0.02) as (srv, pool):
            _, _, data, reads = await exchange(pool, srv)
            assert data == b"".join(EVENTS) and reads == len(EVENTS)

    run(body())


def test_content_length_bodies_and_status_codes():
    async def body():
        ok = b'{"choices": []}'
        replies = [
            [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n" % len(ok), ok[:5], ok[5:]],
            [b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nnope"],
            [b"HTTP/1.1 204 No Content\r\n\r\n"],
        ]
        async with serving(replies) as (srv, pool):
            got = [await exchange(pool, srv) for _ in range(3)]
            assert [(g[0], g[2]) for g in got] == [(200, ok), (404, b"nope"), (204, b"")]
            assert srv.connections == 1  # all three on one kept-alive connection

    run(body())


def test_a_body_delimited_by_the_connection_end():
    async def body():
        reply = [b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n", b"abc", b"def"]
        async with serving([reply], close_after=1) as (srv, pool):
            for _ in range(2):  # not reused: the next request opens a new connection
                status, _, data, _ = await exchange(pool, srv)
                assert status == 200 and data == b"abcdef"
            assert srv.connections == 2

    run(body())


def test_connection_close_is_honoured_and_a_stale_kept_alive_connection_is_retried():
    async def body():
        reply = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
        async with serving([reply], close_after=1) as (srv, pool):  # keeps alive in words, closes in deed
            for _ in range(3):
                status, _, data, _ = await exchange(pool, srv)
                assert (status, data) == (200, b"ok")
            assert srv.connections == 3

    run(body())


def test_failures_name_their_kind():
    async def body():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pool = UpstreamPool(connect_timeout_s=1)
        with pytest.raises(UpstreamError) as err:
            await pool.request("127.0.0.1", port, request())
        assert err.value.kind == "connect" and err.value.refused
        # the worker dies halfway through a body
        srv = await RawServer([[b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", b"abc"]], close_after=1).start()
        resp = await pool.request("127.0.0.1", srv.port, request())
        assert await resp.read() == b"abc"
        with pytest.raises(UpstreamError) as err:
            await resp.read()
        assert err.value.kind == "read" and not err.value.refused
        resp.close()
        # a worker that never answers: the read timeout
        silent = await RawServer([[]]).start()
        slow = UpstreamPool(read_timeout_s=0.2)
        with pytest.raises(asyncio.TimeoutError):
            await slow.request("127.0.0.1", silent.port, request())
        # a malformed head
        bad = await RawServer([[b"HTTP/1.1 abc\r\n\r\n"]]).start()
        with pytest.raises(UpstreamError):
            await pool.request("127.0.0.1", bad.port, request())
        for x in (srv, silent, bad):
            await x.stop()
        pool.close()
        slow.close()

    run(body())


def test_requests_are_sent_as_given_and_connections_set_tcp_nodelay():
    async def body():
        async with serving([[b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]]) as (srv, pool):
            resp = await pool.request("127.0.0.1", srv.port, request(b'{"a": "b"}'))
            sock = resp.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            resp.release()
            assert srv.requests == [request(b'{"a": "b"}')]
            assert pool.idle("127.0.0.1", srv.port) == 1

    run(body())


def test_large_bodies_pause_and_resume_the_worker_socket():
    async def body():
        big = bytes(range(256)) * 8192  # 2 MiB, far past the pause mark
        replies = [[b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big), big],
                   [SSE_HEAD, chunked(big[:1_000_000], big[1_000_000:])]]
        async with serving(replies) as (srv, pool):
            for _ in range(2):
                resp = await pool.request("127.0.0.1", srv.port, request())
                await asyncio.sleep(0.2)  # let it buffer (and pause) before reading
                assert await resp.read_all() == big
                resp.release()
            assert srv.connections == 1

    run(body())


async def relayed(pool: UpstreamPool, srv: RawServer, first_read: bool = True) -> tuple[bytes, list[bool], object]:
    """One request relayed: the body as the sink got it, the sink's ``end`` flags, the
    response (released). ``first_read``: one read() first, as the gateway does."""
    resp = await pool.request("127.0.0.1", srv.port, request())
    parts, ends = [], []
    if first_read:
        parts.append(await resp.read())

    def sink(data: bytes, end: bool) -> None:
        assert not ends or not ends[-1], "the sink was called after the end"
        parts.append(data)
        ends.append(end)

    await resp.relay(sink)
    resp.release()
    return b"".join(parts), ends, resp


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.booleans())
def test_relay_hands_on_the_same_body_however_the_bytes_are_split(cuts, first_read):
    """Relay mode gives the sink exactly what read() would give, ends once, keeps alive."""
    pieces = split(SSE_HEAD + chunked(*EVENTS), cuts)

    async def body():
        async with serving([pieces], pause_s=0.0005, pool=UpstreamPool(read_timeout_s=5)) as (srv, pool):
            for _ in range(2):
                data, ends, _ = await relayed(pool, srv, first_read)
                assert data == b"".join(EVENTS)
                assert ends[-1] and ends.count(True) == 1
            assert srv.connections == 1 and pool.idle("127.0.0.1", srv.port) == 1

    run(body())


def test_relay_sends_each_event_from_its_own_read_and_fails_like_read():
    async def body():
        pieces = one_piece_per_event(EVENTS)
        async with serving([pieces], pause_s=0.02) as (srv, pool):
            data, ends, _ = await relayed(pool, srv)
            assert data == b"".join(EVENTS)
            assert len(ends) >= len(EVENTS) - 1  # one sink call per event sent apart
        # the worker dies halfway: the sink had what came, relay raises a read error
        dying = await RawServer([[SSE_HEAD, chunked(EVENTS[0])[:-5], b"5\r\nab"]], close_after=1).start()
        pool = UpstreamPool()
        got = []
        resp = await pool.request("127.0.0.1", dying.port, request())
        with pytest.raises(UpstreamError) as err:
            await resp.relay(lambda data, end: got.append((data, end)))
        assert err.value.kind == "read"
        assert b"".join(d for d, _ in got) in (EVENTS[0], EVENTS[0] + b"ab") and not any(e for _, e in got)
        resp.close()
        pool.close()
        await dying.stop()

    run(body())


def test_relay_times_out_on_silence_not_on_a_long_steady_stream():
    async def body():
        # a stream of 1.2 s made of events 0.1 s apart, under a 0.5 s read timeout: no timeout
        events = [b"data: {\"t\": %d}\n\n" % i for i in range(12)]
        pieces = one_piece_per_event(events)
        steady = await RawServer([pieces], pause_s=0.1).start()
        pool = UpstreamPool(read_timeout_s=0.5)
        try:
            data, ends, _ = await relayed(pool, steady)
            assert data == b"".join(events) and ends[-1]
        finally:
            await steady.stop()
        # a worker that stops after the first event: TimeoutError after about 0.5 s
        stalled = await RawServer([[SSE_HEAD, chunked(EVENTS[0])[:-5]]], pause_s=0).start()
        resp = await pool.request("127.0.0.1", stalled.port, request())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await resp.relay(lambda data, end: None)
        assert 0.45 <= loop.time() - t0 < 5.0
        resp.close()
        pool.close()
        await stalled.stop()

    run(body())


def test_a_paused_relay_stops_reading_the_worker_and_loses_nothing():
    async def body():
        big = bytes(range(256)) * 8192  # 2 MiB
        async with serving([[SSE_HEAD, chunked(big[:1_000_000], big[1_000_000:])]]) as (srv, pool):
            resp = await pool.request("127.0.0.1", srv.port, request())
            parts = []
            resp.pause()  # as the gateway does while its client's socket is full
            task = asyncio.ensure_future(resp.relay(lambda data, end: parts.append(data)))
            await asyncio.sleep(0.2)
            held = sum(map(len, parts))
            assert held < len(big) and not resp.transport.is_reading()
            resp.resume()
            await task
            assert b"".join(parts) == big
            resp.release()
            assert pool.idle("127.0.0.1", srv.port) == 1

    run(body())


def test_first_hands_over_the_first_bytes_then_relay_the_rest():
    async def body():
        pieces = one_piece_per_event(EVENTS)
        async with serving([pieces], pause_s=0.02) as (srv, pool):
            resp = await pool.request("127.0.0.1", srv.port, request())
            got = []
            await resp.first(lambda data, end: got.append((data, end)))
            assert got == [(EVENTS[0], False)]
            await resp.relay(lambda data, end: got.append((data, end)))
            assert b"".join(d for d, _ in got) == b"".join(EVENTS) and got[-1][1]
            resp.release()
        # a worker that closes after the head: first() raises and never calls back
        mute = await RawServer([[SSE_HEAD]], close_after=1).start()
        pool = UpstreamPool()
        resp = await pool.request("127.0.0.1", mute.port, request())
        called = []
        with pytest.raises(UpstreamError):
            await resp.first(lambda data, end: called.append(data))
        assert not called
        resp.close()
        pool.close()
        await mute.stop()

    run(body())
