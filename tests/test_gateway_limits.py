"""The gateway's request-body limit and client timers, over real sockets on 127.0.0.1.

Each test runs on both front ends: the fast one (:class:`_ClientConnection`) and aiohttp's
(``fast_front=False``, which also serves what the fast one hands over). The limit and the
timeouts are set small here (a 4 KiB body, 0.3-0.5 s timers) so the tests are quick; the
backends are the TEST BACKENDS of ``test_gateway`` (not engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from kvroute.live.gateway import Gateway
from test_gateway import Backend, chat_body, run

LIMIT = 4096
HEADER_S = 0.3
IDLE_S = 0.5
FRONTS = pytest.mark.parametrize("fast_front", [True, False], ids=["fast", "aiohttp"])


@contextlib.asynccontextmanager
async def served(fast_front: bool):
    """A test backend and a gateway in front of it, with this module's limit and timers."""
    b = await Backend("b0").start()
    gw = Gateway([(b.name, b.url)], "round_robin", health_interval_s=5.0, fast_front=fast_front,
                 max_body_bytes=LIMIT, header_timeout_s=HEADER_S, idle_timeout_s=IDLE_S)
    await gw.start()
    try:
        yield b, gw
    finally:
        await gw.stop()
        await b.stop()


def head(length: int | None = None, extra: bytes = b"") -> bytes:
    """A proxied POST's head (Content-Length ``length``, unless None)."""
    cl = b"" if length is None else b"Content-Length: %d\r\n" % length
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%s%s\r\n" % (cl, extra)


def body_of(size: int, stream: bool = False) -> bytes:
    """A chat body of exactly ``size`` bytes (its message padded)."""
    base = json.dumps(chat_body([{"role": "user", "content": ""}], stream=stream)).encode()
    pad = size - len(base)
    assert pad >= 0
    raw = json.dumps(chat_body([{"role": "user", "content": "x" * pad}], stream=stream)).encode()
    assert len(raw) == size
    return raw


async def read_response(reader: asyncio.StreamReader, timeout: float = 5.0) -> tuple[int, bytes, bytes]:
    """One response: (status, head, body), its body framed by Content-Length or chunked."""
    raw_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    status = int(raw_head.split(b" ", 2)[1])
    lower = raw_head.lower()
    if b"transfer-encoding: chunked" in lower:
        data = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout))[:-2], 16)
            data += (await asyncio.wait_for(reader.readexactly(size + 2), timeout))[:-2]
            if size == 0:
                return status, raw_head, data
    length = int(lower.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]) if b"content-length: " in lower else 0
    return status, raw_head, await asyncio.wait_for(reader.readexactly(length), timeout)


async def closed_after(reader: asyncio.StreamReader, timeout: float = 5.0) -> float:
    """Seconds until the gateway ends the connection (EOF or reset), reading nothing else."""
    t0 = time.monotonic()
    try:
        extra = await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:
        extra = b""
    assert extra == b"", f"unexpected bytes before the close: {extra[:200]!r}"
    return time.monotonic() - t0


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


async def refused(gw: Gateway, raw: bytes, status: int = 413) -> dict:
    """Send ``raw`` on a new connection: the answer must be ``status`` with
    ``Connection: close``, and then the close; returns the answer's error object."""
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    try:
        writer.write(raw)
        got, raw_head, data = await read_response(reader)  # the first thing the gateway says
        assert got == status, raw_head
        assert b"connection: close" in raw_head.lower()
        await closed_after(reader)
    finally:
        writer.close()
    err = error_of(data)
    assert err["code"] == status
    return err


# -- the body limit ----------------------------------------------------------------------


@FRONTS
def test_an_oversized_content_length_gets_413_from_the_head_alone(fast_front):
    """Only the head is sent: the answer cannot have waited for the body."""

    async def body():
        async with served(fast_front) as (b, gw):
            for declared in (LIMIT + 1, 64 * 2**20):
                err = await refused(gw, head(declared))
                assert err["type"] == "request_too_large"
                assert f"{declared} bytes" in err["message"] and f"limit of {LIMIT} bytes" in err["message"]
            assert b.seen == [] and gw._requests == {("", "413"): 2}

    run(body())


@FRONTS
def test_an_oversized_chunked_body_gets_413_before_it_ends(fast_front):
    """Chunks past the limit, and no last chunk: the refusal comes without the body's end."""

    async def body():
        async with served(fast_front) as (b, gw):
            piece = b"x" * 1024
            chunks = b"%x\r\n%s\r\n" % (len(piece), piece) * (LIMIT // len(piece) + 2)
            err = await refused(gw, head(None, b"Transfer-Encoding: chunked\r\n") + chunks)
            assert err["message"].startswith("chunked request body is over") and f"{LIMIT} bytes" in err["message"]
            # a chunked body within the limit is served
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            raw = body_of(LIMIT)
            writer.write(head(None, b"Transfer-Encoding: chunked\r\n") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw), raw))
            status, _, data = await read_response(reader)
            assert status == 200 and json.loads(data)["backend"] == "b0"
            writer.close()
            assert len(b.seen) == 1

    run(body())


@FRONTS
def test_expect_100_continue_over_the_limit_gets_413_and_no_continue(fast_front):
    async def body():
        async with served(fast_front) as (b, gw):
            err = await refused(gw, head(LIMIT + 1, b"Expect: 100-continue\r\n"))  # not 100 Continue
            assert f"limit of {LIMIT} bytes" in err["message"]
            # within the limit: 100 Continue, then the body, then the answer
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            raw = body_of(LIMIT)
            writer.write(head(len(raw), b"Expect: 100-continue\r\n"))
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(raw)
            status, _, data = await read_response(reader)
            assert status == 200 and json.loads(data)["backend"] == "b0"
            writer.close()

    run(body())


@FRONTS
def test_a_body_at_the_limit_is_taken_and_one_byte_more_is_not(fast_front):
    async def body():
        async with served(fast_front) as (b, gw):
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            for stream in (False, True):  # two requests on one kept-alive connection
                raw = body_of(LIMIT, stream=stream)
                writer.write(head(len(raw)) + raw)
                status, _, data = await read_response(reader)
                assert status == 200, data
                assert data.endswith(b"data: [DONE]\n\n") if stream else json.loads(data)["backend"] == "b0"
            raw = body_of(LIMIT + 1)
            writer.write(head(len(raw)) + raw)
            status, _, data = await read_response(reader)
            assert status == 413 and f"request body of {LIMIT + 1} bytes" in error_of(data)["message"]
            await closed_after(reader)
            writer.close()
            assert [len(json.dumps(s)) for _, s in b.seen] == [LIMIT, LIMIT]

    run(body())


@FRONTS
def test_a_content_length_lie_never_grows_the_body_past_what_was_declared(fast_front):
    """A small declared length followed by many times the limit, in one write: the body
    is what was declared, the surplus is read as the next request's head and refused
    (400), and the connection is closed; nothing of the surplus reaches a worker. (The
    fast front end serves the declared request first; aiohttp's parser refuses the
    whole read, the valid request with it.)"""

    async def body():
        async with served(fast_front) as (b, gw):
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            raw = body_of(200)
            writer.write(head(len(raw)) + raw + b"x" * (32 * LIMIT))  # 128 KiB: past the 64 KiB head bound
            if fast_front:
                status, _, data = await read_response(reader)
                assert status == 200 and json.loads(data)["backend"] == "b0"
            status, raw_head, _ = await read_response(reader)
            assert status == 400, raw_head
            await closed_after(reader)
            writer.close()
            assert [json.dumps(s).encode() for _, s in b.seen] == ([raw] if fast_front else [])

    run(body())


# -- timers ---------------------------------------------------------------------------------


@FRONTS
def test_no_request_or_a_partial_head_is_closed_after_the_header_timeout(fast_front):
    """Nothing sent, a partial head, and a head dribbled a byte at a time (progress does
    not extend its deadline): each connection is closed, none before its timer.
    aiohttp has no header timeout: there the idle timeout closes them."""

    async def body():
        async with served(fast_front) as (b, gw):
            timer = HEADER_S if fast_front else IDLE_S

            async def trickle(writer: asyncio.StreamWriter) -> None:
                for byte in head(10)[:-2]:
                    writer.write(bytes([byte]))
                    await asyncio.sleep(HEADER_S / 10)

            for partial in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n", None):
                reader, writer = await asyncio.open_connection(gw.host, gw.port)
                t0 = time.monotonic()
                feeder = None
                if partial is None:
                    feeder = asyncio.create_task(trickle(writer))
                else:
                    writer.write(partial)
                await closed_after(reader)
                assert time.monotonic() - t0 >= timer * 0.95
                if feeder is not None:
                    assert not feeder.done(), "the trickled head ended before the timer"
                    feeder.cancel()
                writer.close()
            if fast_front:
                assert gw._closed == {"header_timeout": 3}
            assert b.seen == []

    run(body())


@FRONTS
def test_a_body_that_stops_arriving_gets_408(fast_front):
    async def body():
        async with served(fast_front) as (b, gw):
            raw = body_of(1000)
            t0 = time.monotonic()
            # the declared length is a lie: half of it comes
            err = await refused(gw, head(len(raw)) + raw[:500], status=408)
            assert time.monotonic() - t0 >= HEADER_S * 0.95
            assert err["type"] == "request_timeout" and "header_timeout_s" in err["message"]
            if fast_front:
                assert gw._closed == {"body_timeout": 1}
            assert b.seen == []

    run(body())


@FRONTS
def test_a_kept_alive_connection_is_closed_after_the_idle_timeout(fast_front):
    async def body():
        async with served(fast_front) as (b, gw):
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            for _ in range(2):  # kept alive between requests sent within the timeout
                raw = body_of(300)
                writer.write(head(len(raw)) + raw)
                status, _, _ = await read_response(reader)
                assert status == 200
                await asyncio.sleep(IDLE_S / 3)
            t0 = time.monotonic() - IDLE_S / 3
            await closed_after(reader)
            # the idle timer, not the (shorter) header timer
            assert time.monotonic() - t0 >= IDLE_S * 0.95
            writer.close()
            if fast_front:
                assert gw._closed == {"idle_timeout": 1}
            assert len(b.seen) == 2

    run(body())


@FRONTS
def test_a_reply_longer_than_both_timeouts_is_not_cut(fast_front):
    """Gaps between events longer than either timer, a non-streamed reply slower than
    both: a request in flight is never idle. The connection stays usable after."""

    async def body():
        async with served(fast_front) as (b, gw):
            gap = max(HEADER_S, IDLE_S) * 1.2
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            raw = json.dumps(chat_body([{"role": "user", "content": "hi"}], test_chunks=4, test_delay_s=gap)).encode()
            t0 = time.monotonic()
            writer.write(head(len(raw)) + raw)
            status, _, data = await read_response(reader, timeout=10)
            assert status == 200 and time.monotonic() - t0 >= 3 * gap
            events = [e for e in data.split(b"\n\n") if e]
            assert len(events) == 5 and events[-1] == b"data: [DONE]"
            raw = json.dumps(chat_body([{"role": "user", "content": "hi"}], stream=False, test_delay_s=gap)).encode()
            writer.write(head(len(raw)) + raw)
            status, _, data = await read_response(reader, timeout=10)
            assert status == 200 and json.loads(data)["backend"] == "b0"
            writer.close()
            if fast_front:
                assert gw._closed == {}

    run(body())


def test_bad_limits_are_refused_by_name():
    for kw, name in (({"max_body_bytes": 0}, "max_body_bytes"), ({"max_body_bytes": 1.5}, "max_body_bytes"),
                     ({"header_timeout_s": 0}, "header_timeout_s"), ({"idle_timeout_s": -1}, "idle_timeout_s")):
        with pytest.raises(ValueError, match=name):
            Gateway(["http://127.0.0.1:1"], "round_robin", **kw)
