"""The live gateway over real HTTP on 127.0.0.1: streaming, routing, faults, Redis, load.

Backends here are TEST BACKENDS (:class:`Backend`), small aiohttp servers that speak
just enough of the OpenAI API (SSE chunks, /health) to exercise the gateway; they are
not engines and model no cache. Redis is a real redis-server started per test on a
free port (``--save '' --appendonly no``) and stopped by its PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvroute.live.gateway import Gateway

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server binary not found (apt-get install redis-server)")
TESTS = Path(__file__).resolve().parent


def run(coro, timeout: float = 60.0):
    """Run one async test body with a hard time bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- test backends -----------------------------------------------------------------


class Backend:
    """TEST BACKEND, not an engine: a tiny OpenAI-style server for the gateway tests.

    POST /v1/chat/completions and /v1/completions answer ``chunks`` SSE events
    (``data: {...}``, then ``data: [DONE]``) ``delay_s`` apart when ``stream`` is true,
    else one JSON object with a Content-Length. A body may override both with
    ``test_chunks`` / ``test_delay_s``. Every response carries ``X-Backend: <name>``.
    GET /health answers 200. It records each request's session header and body.
    """

    def __init__(self, name: str, chunks: int = 3, delay_s: float = 0.0) -> None:
        self.name = name
        self.chunks = chunks
        self.delay_s = delay_s
        self.seen: list[tuple[str | None, dict]] = []
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "test"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.headers.get("X-Session-ID"), body))
        n = int(body.get("test_chunks", self.chunks))
        delay = float(body.get("test_delay_s", self.delay_s))
        pad = "x" * int(body.get("test_pad", 0))  # bytes added to each event
        hdr = {"X-Backend": self.name}
        if not body.get("stream"):
            if delay:
                await asyncio.sleep(delay)
            return web.json_response(
                {"id": "x", "choices": [{"text": "tok " * n}], "backend": self.name,
                 "usage": {"prompt_tokens": 1, "completion_tokens": n}},
                headers=hdr,
            )
        resp = web.StreamResponse(headers={**hdr, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            if i and delay:
                await asyncio.sleep(delay)
            event = {"choices": [{"delta": {"content": f"t{i} {pad}"}}], "t": time.monotonic()}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def start(self, port: int = 0) -> Backend:
        self.runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def backend_main() -> None:
    """Run a :class:`Backend` as a process: ``NAME PORT CHUNKS DELAY_S`` (killed by tests)."""
    name, port, chunks, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])

    async def main():
        b = await Backend(name, chunks, delay).start(port)
        print(f"ready {b.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


class BackendProcess:
    """A TEST BACKEND in its own process, so a test can kill it like a crashed engine."""

    def __init__(self, name: str, chunks: int = 3, delay_s: float = 0.0, port: int | None = None) -> None:
        self.name, self.chunks, self.delay_s = name, chunks, delay_s
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> BackendProcess:
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_gateway import backend_main; backend_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, self.name, str(self.port), str(self.chunks), str(self.delay_s)],
            stdout=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), f"test backend {self.name} did not start: {line!r}"
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# -- redis ---------------------------------------------------------------------------


class RedisServer:
    """A real redis-server on a free port, stopped by its PID."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--loglevel", "warning", "--enable-debug-command", "local"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def command(self, *args: str, timeout: float = 5.0) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(("*%d\r\n" % len(args) + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)).encode())
            return s.recv(4096)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def redis_server():
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        servers.append(RedisServer().start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


# -- client helpers ------------------------------------------------------------------


def chat_body(messages: list[dict], stream: bool = True, **extra) -> dict:
    return {"model": "test", "messages": messages, "stream": stream, "max_tokens": 8, **extra}


async def send(client: aiohttp.ClientSession, url: str, body, session: str | None = None,
               path: str = "/v1/chat/completions") -> tuple[int, dict, bytes]:
    headers = {"X-Session-ID": session} if session else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with client.post(url + path, data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def conversation(seed: int, turns: int, system_chars: int = 2000) -> list[list[dict]]:
    """Message lists of each turn of one chat with a system prompt of its own."""
    msgs = [{"role": "system", "content": f"[system {seed}] " + "lorem ipsum " * (system_chars // 12)}]
    out = []
    for t in range(turns):
        msgs = msgs + [{"role": "user", "content": f"question {t} of chat {seed}: " + "why? " * 40}]
        out.append(msgs)
        msgs = msgs + [{"role": "assistant", "content": f"answer {t}: " + "because. " * 30}]
    return out


async def metric(client: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """Samples of one metric from GET /metrics, keyed by their label text."""
    async with client.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):]] = float(value)
    return out


async def started(backends, policy: str, **kw) -> Gateway:
    gw = Gateway([(b.name, b.url) for b in backends], policy, health_interval_s=kw.pop("health_interval_s", 0.2), **kw)
    await gw.start()
    return gw


# -- tests -----------------------------------------------------------------------------


def test_streaming_is_relayed_chunk_by_chunk():
    async def body():
        b = await Backend("b0", chunks=5, delay_s=0.2).start()
        gw = await started([b], "round_robin")
        try:
            async with aiohttp.ClientSession() as c:
                t0 = time.monotonic()
                arrivals = []
                async with c.post(gw.url + "/v1/chat/completions", json=chat_body([{"role": "user", "content": "hi"}])) as r:
                    assert r.status == 200
                    assert r.headers["X-Worker"] == "b0" and r.headers["X-Backend"] == "b0"
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    data = b""
                    lags = []
                    async for chunk in r.content.iter_any():
                        now = time.monotonic()
                        arrivals.append(now - t0)
                        data += chunk
                        for e in chunk.split(b"\n\n"):
                            if e.startswith(b"data: {"):
                                lags.append(now - json.loads(e[len(b"data: "):])["t"])
                events = [e for e in data.split(b"\n\n") if e]
                assert len(events) == 6 and events[-1] == b"data: [DONE]"
                # the first event reached the client long before the backend sent the last
                # (the backend sleeps 0.2 s between events: 0.8 s from first to last)
                assert arrivals[0] < 0.3, arrivals
                assert arrivals[-1] > 0.75, arrivals
                assert len(arrivals) >= 5, arrivals  # one read per event, not one at the end
                # each event reached the client soon after the backend wrote it
                # (one monotonic clock: same machine)
                assert len(lags) == 5 and max(lags) < 0.15, lags
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_x_worker_on_streamed_non_streamed_and_completions():
    async def body():
        bs = [await Backend(f"b{i}").start() for i in range(2)]
        gw = await started(bs, "round_robin")
        try:
            async with aiohttp.ClientSession() as c:
                msgs = [{"role": "user", "content": "hi"}]
                workers = []
                for stream in (True, False, True, False):
                    status, hdr, data = await send(c, gw.url, chat_body(msgs, stream=stream))
                    assert status == 200 and hdr["X-Worker"] == hdr["X-Backend"]
                    workers.append(hdr["X-Worker"])
                    if not stream:
                        assert json.loads(data)["backend"] == hdr["X-Worker"]
                assert workers == ["b0", "b1", "b0", "b1"]
                status, hdr, data = await send(c, gw.url, {"model": "t", "prompt": "once upon", "stream": True},
                                               path="/v1/completions")
                assert status == 200 and hdr["X-Worker"] in ("b0", "b1") and data.endswith(b"data: [DONE]\n\n")
                async with c.get(gw.url + "/v1/models") as r:
                    assert r.status == 200 and "X-Worker" in r.headers
        finally:
            await gw.stop()
            for b in bs:
                await b.stop()

    run(body())


def test_upstream_connections_are_kept_alive_and_reused():
    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "round_robin")
        try:
            async with aiohttp.ClientSession() as c:
                for i in range(20):
                    status, _, data = await send(c, gw.url, chat_body([{"role": "user", "content": "x"}], stream=i % 2 == 0))
                    assert status == 200 and data
            assert gw._pool.connections_made == 1
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_expect_continue_and_json_that_only_pythons_parser_reads():
    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "round_robin")
        try:
            async with aiohttp.ClientSession() as c:
                msgs = [{"role": "user", "content": "hi"}]
                async with c.post(gw.url + "/v1/chat/completions", json=chat_body(msgs), expect100=True) as r:
                    assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
                raw = json.dumps(chat_body(msgs, temperature=float("nan"))).encode()
                assert b"NaN" in raw  # Python's json reads it, orjson does not
                status, hdr, _ = await send(c, gw.url, raw)
                assert status == 200 and hdr["X-Worker"] == "b0"
                assert b.seen[-1][1]["messages"] == msgs
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_raw_http_pipelining_close_chunked_bodies_and_malformed_heads():
    """The fast front end serves plain POSTs itself and hands everything else to aiohttp."""

    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "round_robin")

        async def exchange(raw: bytes, until_close: bool = False, answers: int = 1) -> bytes:
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            writer.write(raw)
            await writer.drain()
            data = b""
            try:
                while True:
                    part = await asyncio.wait_for(reader.read(65536), 5)
                    if not part:
                        break
                    data += part
                    if not until_close and data.count(b"data: [DONE]") + data.count(b'"error"') >= answers:
                        break
            finally:
                writer.close()
            return data

        def post(body: dict, path: str = "/v1/chat/completions", extra: bytes = b"") -> bytes:
            raw = json.dumps(body).encode()
            return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
                    % (path.encode(), extra, len(raw)) + raw)

        try:
            msgs = [{"role": "user", "content": "hi"}]
            # two requests in one write: two answers, in order, on one connection
            data = await exchange(post(chat_body(msgs, test_chunks=1)) + post(chat_body(msgs, test_chunks=2)), answers=2)
            assert data.count(b"HTTP/1.1 200 OK") == 2 and data.count(b"X-Worker: b0") == 2
            assert data.index(b"t0 ") < data.index(b"HTTP/1.1 200", 10) < data.rindex(b"t1 ")
            # Connection: close is honoured
            data = await exchange(post(chat_body(msgs), extra=b"Connection: close\r\n"), until_close=True)
            assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"0\r\n\r\n")
            # a chunked request body (aiohttp's side reads it)
            raw = json.dumps(chat_body(msgs, stream=False)).encode()
            chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw), raw)
            data = await exchange(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                  b"Connection: close\r\n\r\n" + chunked, until_close=True)
            assert data.startswith(b"HTTP/1.1 200") and b'"backend": "b0"' in data
            # a header with a bare LF, and a GET on a proxied path: aiohttp's answers
            data = await exchange(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\nX-A: b\r\nContent-Length: 2\r\n\r\n{}",
                                  until_close=True)
            assert data.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
            data = await exchange(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                                  until_close=True)
            assert data.startswith(b"HTTP/1.1 405")
            # a body of most of a MiB (the test backend takes at most 1 MiB), arriving in many reads
            big = chat_body([{"role": "user", "content": "x" * 800_000}], stream=False, user="big")
            data = await exchange(post(big, extra=b"Connection: close\r\n"), until_close=True)
            assert data.startswith(b"HTTP/1.1 200") and b'"backend": "b0"' in data
            assert len(b.seen) == 5 and b.seen[-1][1] == big
        finally:
            await gw.stop()
            await b.stop()

    run(body())


@pytest.mark.parametrize("fast_front", [True, False])
def test_both_front_ends_relay_streams_errors_and_whole_bodies(fast_front):
    async def body():
        b = await Backend("b0", chunks=4, delay_s=0.01).start()
        gw = await started([b], "round_robin", fast_front=fast_front)
        try:
            async with aiohttp.ClientSession() as c:
                msgs = [{"role": "user", "content": "hi"}]
                status, hdr, data = await send(c, gw.url, chat_body(msgs))
                assert status == 200 and hdr["X-Worker"] == "b0" and hdr["Content-Type"].startswith("text/event-stream")
                assert data.count(b"data: ") == 5 and data.endswith(b"data: [DONE]\n\n")
                status, hdr, data = await send(c, gw.url, chat_body(msgs, stream=False))
                assert status == 200 and json.loads(data)["backend"] == "b0"
                assert hdr["Content-Length"] == str(len(data))
                status, _, data = await send(c, gw.url, b"{not json")
                assert status == 400 and "malformed JSON" in json.loads(data)["error"]["message"]
                counted = await metric(c, gw.url, "kvroute_gateway_requests_total")
                assert counted == {'{status="200",worker="b0"}': 2.0, '{status="400",worker=""}': 1.0}
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_bad_requests_get_400_naming_the_problem():
    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "round_robin")
        try:
            async with aiohttp.ClientSession() as c:
                cases = [
                    (b"", "missing request body"),
                    (b"{not json", "malformed JSON"),
                    (b"[1, 2]", "JSON object"),
                    (json.dumps({"model": "m"}).encode(), "'messages'"),
                ]
                for raw, needle in cases:
                    async with c.post(gw.url + "/v1/chat/completions", data=raw,
                                      headers={"Content-Type": "application/json"}) as r:
                        assert r.status == 400, raw
                        err = (await r.json())["error"]
                        assert needle in err["message"], (raw, err)
                async with c.post(gw.url + "/v1/completions", json={"model": "m"}) as r:
                    assert r.status == 400 and "'prompt'" in (await r.json())["error"]["message"]
                assert b.seen == []  # nothing malformed reached a worker
                assert (await metric(c, gw.url, "kvroute_gateway_requests_total"))['{status="400",worker=""}'] == 5
        finally:
            await gw.stop()
            await b.stop()

    run(body())


@pytest.mark.parametrize("policy", ["sticky", "consistent_hash"])
def test_sticky_keeps_each_session_on_one_worker_and_spreads_sessions(policy):
    async def body():
        bs = [await Backend(f"b{i}").start() for i in range(3)]
        gw = await started(bs, policy)
        try:
            async with aiohttp.ClientSession() as c:
                where = defaultdict(set)
                for turn in range(3):
                    for s in range(30):
                        msgs = [{"role": "user", "content": f"turn {turn}"}]
                        status, hdr, _ = await send(c, gw.url, chat_body(msgs, stream=turn % 2 == 0), session=f"s{s}")
                        assert status == 200
                        where[f"s{s}"].add(hdr["X-Worker"])
                # the body's `user` field is the session id when there is no header
                status, hdr, _ = await send(c, gw.url, chat_body([{"role": "user", "content": "x"}], user="s7"))
                where["s7"].add(hdr["X-Worker"])
            assert all(len(w) == 1 for w in where.values()), where
            load = Counter(next(iter(w)) for w in where.values())
            assert len(load) == 3 and min(load.values()) >= 4, load
            # the header is forwarded to the worker unchanged
            assert {sid for b in bs for sid, _ in b.seen} == {f"s{i}" for i in range(30)} | {None}
        finally:
            await gw.stop()
            for b in bs:
                await b.stop()

    run(body())


@pytest.mark.parametrize("policy", ["kv_aware", "prefix_approx", "vllm_cache_aware", "dynamo:overlap_weight=10",
                                    "cost_aware:alpha=0"])
def test_cache_aware_policies_keep_a_conversation_on_one_worker(policy):
    """No session header: only the approximate prefix index can keep the turns together.

    (dynamo and cost_aware at their defaults trade locality for load, and may move a
    chat when its worker is busier: that is their rule, so they run here weighted
    towards locality.)
    """

    async def body():
        bs = [await Backend(f"b{i}", chunks=2, delay_s=0.05).start() for i in range(3)]
        gw = await started(bs, policy)
        try:
            chats = [conversation(k, turns=4) for k in range(9)]
            where = defaultdict(list)
            async with aiohttp.ClientSession() as c:

                async def one_chat(k):
                    for msgs in chats[k]:
                        status, hdr, _ = await send(c, gw.url, chat_body(msgs))
                        assert status == 200
                        where[k].append(hdr["X-Worker"])

                await asyncio.gather(*(one_chat(k) for k in range(9)))
            assert all(len(set(w)) == 1 for w in where.values()), dict(where)
            load = Counter(w[0] for w in where.values())
            assert len(load) >= 2, load  # conversations spread over the workers
        finally:
            await gw.stop()
            for b in bs:
                await b.stop()

    run(body())


def test_a_killed_engine_loses_no_request_and_later_ones_go_elsewhere():
    procs = [BackendProcess(f"b{i}", chunks=4, delay_s=0.02).start() for i in range(2)]

    async def body():
        gw = await started(procs, "round_robin", health_interval_s=0.2)
        results = []
        try:
            async with aiohttp.ClientSession() as c:

                async def client(k):
                    for i in range(25):
                        msgs = [{"role": "user", "content": f"c{k} r{i}"}]
                        t = time.monotonic()
                        try:
                            async with c.post(gw.url + "/v1/chat/completions", json=chat_body(msgs)) as r:
                                data = await r.read()
                                ok = r.status == 200 and data.endswith(b"data: [DONE]\n\n")
                                results.append((t, r.headers.get("X-Worker"), "ok" if ok else f"http {r.status}"))
                        except aiohttp.ClientError as exc:  # an aborted stream
                            results.append((t, None, type(exc).__name__))

                async def killer():
                    await asyncio.sleep(0.4)
                    procs[0].kill()
                    return time.monotonic()

                tasks = [asyncio.create_task(client(k)) for k in range(8)]
                t_kill = await killer()
                await asyncio.gather(*tasks)
                assert len(results) == 8 * 25  # every request accounted for
                after = [r for r in results if r[0] > t_kill + 0.05]
                assert after and all(r[1] == "b1" and r[2] == "ok" for r in after), after[:5]
                assert sum(r[2] == "ok" for r in results) >= len(results) - 8  # only the in-flight ones may fail
                up = await metric(c, gw.url, "kvroute_gateway_worker_up")
                assert up == {'{worker="b0"}': 0.0, '{worker="b1"}': 1.0}
                async with c.get(gw.url + "/health") as r:
                    health = await r.json()
                assert health["workers"]["b0"]["up"] is False and health["workers"]["b0"]["in_flight"] == 0
                assert health["workers"]["b1"]["in_flight"] == 0
                # the engine comes back on its port: the probe notices, requests return
                procs[0].start()
                deadline = time.monotonic() + 5
                while not gw.view.is_up("b0") and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                seen = {(await send(c, gw.url, chat_body([{"role": "user", "content": "x"}])))[1]["X-Worker"] for _ in range(4)}
                assert seen == {"b0", "b1"}
        finally:
            await gw.stop()

    try:
        run(body())
    finally:
        for p in procs:
            p.kill()


def test_a_client_that_leaves_mid_stream_frees_its_slot():
    async def body():
        b = await Backend("b0", chunks=20, delay_s=0.05).start()
        gw = await started([b], "least_loaded")
        try:
            async with aiohttp.ClientSession() as c:
                async with c.post(gw.url + "/v1/chat/completions", json=chat_body([{"role": "user", "content": "x"}])) as r:
                    await r.content.readany()
                    assert gw.view.in_flight("b0") == 1
                    r.close()  # the client goes away after the first chunk
                deadline = time.monotonic() + 3
                while gw.view.in_flight("b0") and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert gw.view.in_flight("b0") == 0 and gw.view.active_blocks("b0") == 0
                counted = await metric(c, gw.url, "kvroute_gateway_requests_total")
                assert counted == {'{status="client_disconnected",worker="b0"}': 1.0}
                status, _, _ = await send(c, gw.url, chat_body([{"role": "user", "content": "y"}]))
                assert status == 200
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_a_slow_client_pauses_the_worker_and_gets_every_byte():
    """Relaying a long stream to a client that stops reading: the gateway stops reading
    the worker (nothing piles up in its memory), then relays the rest, in order."""

    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "round_robin")
        try:
            port = int(gw.url.rsplit(":", 1)[1])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=16384)  # reads stop at 32 KiB
            payload = json.dumps(chat_body([{"role": "user", "content": "x"}], test_chunks=400, test_pad=8000)).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            await writer.drain()
            paused = False
            deadline = time.monotonic() + 5
            while not paused and time.monotonic() < deadline:  # the client reads nothing meanwhile
                await asyncio.sleep(0.05)
                paused = any(c.upstream is not None and not c.upstream.transport.is_reading() for c in gw._conns)
            assert paused, "the worker was never paused while the client did not read"
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"Transfer-Encoding: chunked" in head and b"X-Worker: b0" in head
            data = b""
            while True:  # de-chunk the reply
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                data += (await reader.readexactly(size + 2))[:-2]
            events = [e for e in data.split(b"\n\n") if e]
            assert len(events) == 401 and events[-1] == b"data: [DONE]"
            assert [json.loads(e[6:])["choices"][0]["delta"]["content"].split()[0] for e in events[:-1]] == [
                f"t{i}" for i in range(400)]
            writer.close()
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_all_workers_down_answers_503_or_502():
    async def body():
        dead = BackendProcess("dead")  # never started: refuses connections
        gw = await started([dead], "least_loaded", health_interval_s=5)
        try:
            async with aiohttp.ClientSession() as c:
                status, hdr, data = await send(c, gw.url, chat_body([{"role": "user", "content": "x"}]))
                assert status == 502 and "failed before answering" in json.loads(data)["error"]["message"]
                status, _, data = await send(c, gw.url, chat_body([{"role": "user", "content": "x"}]))
                assert status == 503 and json.loads(data)["error"]["type"] == "no_worker_up"
                async with c.get(gw.url + "/health") as r:
                    assert r.status == 503
        finally:
            await gw.stop()

    run(body())


def test_slow_health_probes_mark_a_worker_down_only_after_several_in_a_row():
    """A busy engine answers /health late but is up: one or two timed-out probes keep it
    up; PROBE_TIMEOUTS_DOWN in a row mark it down; a prompt answer brings it back."""
    from kvroute.live.gateway import PROBE_TIMEOUTS_DOWN

    class SlowHealth(Backend):
        slow = True

        async def health(self, request):
            if self.slow:
                await asyncio.sleep(1.0)  # past the probe's timeout
            return web.Response(text="ok")

    async def body():
        b = await SlowHealth("slow").start()
        gw = await started([b], "least_loaded", health_interval_s=60, health_timeout_s=0.2)  # probed by hand
        try:
            for _ in range(PROBE_TIMEOUTS_DOWN - 1):
                await gw.probe_once()
                assert gw.view.is_up("slow")
            await gw.probe_once()
            assert not gw.view.is_up("slow")
            b.slow = False
            await gw.probe_once()
            assert gw.view.is_up("slow")
        finally:
            await gw.stop()
            await b.stop()

    run(body())


@needs_redis
def test_redis_killed_mid_run_routing_continues_from_memory(redis_server, caplog):
    redis = redis_server()

    async def body():
        bs = [await Backend(f"b{i}").start() for i in range(3)]
        gw = await started(bs, "hybrid_sticky:threshold_ms=100000", redis_url=redis.url,
                           session_kwargs={"probe_interval_s": 0.1})
        try:
            async with aiohttp.ClientSession() as c:
                assert (await metric(c, gw.url, "kvroute_gateway_redis_up")) == {"": 1.0}
                first = {}
                for s in range(20):
                    _, hdr, _ = await send(c, gw.url, chat_body([{"role": "user", "content": "a"}]), session=f"s{s}")
                    first[s] = hdr["X-Worker"]
                await gw.sessions.flush()
                assert redis.command("GET", "kvroute:session:s3").endswith(f"{first[3]}\r\n".encode())
                redis.stop()
                for turn in range(3):  # routing goes on, sessions still stick (memory)
                    for s in range(20):
                        status, hdr, _ = await send(c, gw.url, chat_body([{"role": "user", "content": "b"}]), session=f"s{s}")
                        assert status == 200 and hdr["X-Worker"] == first[s]
                assert (await metric(c, gw.url, "kvroute_gateway_redis_up")) == {"": 0.0}
                async with c.get(gw.url + "/health") as r:
                    assert (await r.json())["redis"] == "down"
                # a new session while Redis is down, then Redis returns on its port
                _, hdr, _ = await send(c, gw.url, chat_body([{"role": "user", "content": "c"}]), session="late")
                redis.start()
                deadline = time.monotonic() + 5
                while not gw.sessions.redis_up and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await gw.sessions.flush()
                assert (await metric(c, gw.url, "kvroute_gateway_redis_up")) == {"": 1.0}
                assert redis.command("GET", "kvroute:session:late").endswith(f"{hdr['X-Worker']}\r\n".encode())
        finally:
            await gw.stop()
            for b in bs:
                await b.stop()

    with caplog.at_level("INFO", logger="kvroute.live.sessions"):
        run(body())
    downs = [r for r in caplog.records if "is down" in r.getMessage()]
    ups = [r for r in caplog.records if "is up" in r.getMessage()]
    assert len(downs) == 1, [r.getMessage() for r in downs]  # once per transition
    assert len(ups) == 2  # at start and when it returned


@needs_redis
def test_a_frozen_redis_never_stalls_a_request(redis_server):
    """DEBUG SLEEP freezes redis-server: memory misses wait at most the read timeout."""
    redis = redis_server()

    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "hybrid_sticky", redis_url=redis.url,
                           session_kwargs={"read_timeout_s": 0.05, "probe_interval_s": 0.1})
        try:
            async with aiohttp.ClientSession() as c:
                await send(c, gw.url, chat_body([{"role": "user", "content": "warm"}]), session="warm")
                freeze = asyncio.create_task(asyncio.to_thread(redis.command, "DEBUG", "SLEEP", "1.5"))
                await asyncio.sleep(0.1)
                slowest = 0.0
                for s in range(10):  # new sessions: each misses memory and asks Redis
                    t = time.monotonic()
                    status, _, _ = await send(c, gw.url, chat_body([{"role": "user", "content": "x"}]), session=f"new{s}")
                    slowest = max(slowest, time.monotonic() - t)
                    assert status == 200
                await freeze
                assert slowest < 0.5, slowest
                deadline = time.monotonic() + 5
                while not gw.sessions.redis_up and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await gw.sessions.flush()
                assert redis.command("GET", "kvroute:session:new9").endswith(b"b0\r\n")
        finally:
            await gw.stop()
            await b.stop()

    run(body())


@needs_redis
def test_two_gateway_replicas_share_sessions_through_redis(redis_server):
    """Replica A routes first turns round-robin (scattering sessions off their hash-ring
    worker); replica B routes the next turns with hybrid_sticky, which follows the session
    table. B agrees with A on every session only if it reads A's table from Redis."""
    redis = redis_server()

    async def body():
        bs = [await Backend(f"b{i}").start() for i in range(3)]
        a = await started(bs, "round_robin", redis_url=redis.url)
        b = await started(bs, "hybrid_sticky:threshold_ms=100000", redis_url=redis.url)
        alone = await started(bs, "hybrid_sticky:threshold_ms=100000")  # no Redis: the control
        try:
            async with aiohttp.ClientSession() as c:
                first = {}
                for s in range(30):
                    _, hdr, _ = await send(c, a.url, chat_body([{"role": "user", "content": "1"}]), session=f"s{s}")
                    first[s] = hdr["X-Worker"]
                await a.sessions.flush()
                shared, control = {}, {}
                for s in range(30):
                    msgs = [{"role": "user", "content": "2"}]
                    shared[s] = (await send(c, b.url, chat_body(msgs), session=f"s{s}"))[1]["X-Worker"]
                    control[s] = (await send(c, alone.url, chat_body(msgs), session=f"s{s}"))[1]["X-Worker"]
            assert shared == first
            assert sum(control[s] != first[s] for s in first) >= 5  # without Redis they scatter
            assert b.sessions.redis_hits == 30
        finally:
            for gw in (a, b, alone):
                await gw.stop()
            for x in bs:
                await x.stop()

    run(body())


def test_two_thousand_requests_are_all_accounted_for():
    async def body():
        bs = [await Backend(f"b{i}", chunks=3).start() for i in range(3)]
        gw = await started(bs, "least_loaded")
        n, clients = 2000, 64
        outcomes = Counter()
        try:
            conn = aiohttp.TCPConnector(limit=clients)
            async with aiohttp.ClientSession(connector=conn) as c:
                queue = list(range(n))

                async def client():
                    while queue:
                        i = queue.pop()
                        msgs = [{"role": "user", "content": f"request {i}"}]
                        try:
                            status, hdr, data = await send(c, gw.url, chat_body(msgs, stream=i % 2 == 0), session=f"s{i % 200}")
                            complete = data.endswith(b"data: [DONE]\n\n") if i % 2 == 0 else b'"choices"' in data
                            outcomes["ok" if status == 200 and complete else f"http {status}"] += 1
                        except aiohttp.ClientError as exc:
                            outcomes[type(exc).__name__] += 1

                t = time.monotonic()
                await asyncio.gather(*(client() for _ in range(clients)))
                elapsed = time.monotonic() - t
                assert sum(outcomes.values()) == n
                assert outcomes["ok"] == n, outcomes
                counted = await metric(c, gw.url, "kvroute_gateway_requests_total")
                assert sum(counted.values()) == n
                assert sum(len(b.seen) for b in bs) == n
                in_flight = await metric(c, gw.url, "kvroute_gateway_in_flight")
                assert set(in_flight.values()) == {0.0}
                print(f"2000 requests through the gateway in {elapsed:.2f} s")
        finally:
            await gw.stop()
            for b in bs:
                await b.stop()

    run(body())


def test_metrics_expose_counters_histograms_and_gauges():
    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "kv_aware")
        try:
            async with aiohttp.ClientSession() as c:
                for stream in (True, False):
                    await send(c, gw.url, chat_body([{"role": "user", "content": "m"}], stream=stream))
                async with c.get(gw.url + "/metrics") as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    text = await r.text()
            for name in (
                'kvroute_gateway_requests_total{status="200",worker="b0"} 2.0',
                "kvroute_gateway_decision_seconds_count 2.0",
                "kvroute_gateway_added_latency_seconds_count 2.0",
                "kvroute_gateway_redis_up 0.0",
                'kvroute_gateway_worker_up{worker="b0"} 1.0',
                'kvroute_gateway_in_flight{worker="b0"} 0.0',
                'kvroute_gateway_index_blocks{worker="b0"}',
            ):
                assert name in text, name
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_decisions_are_logged_at_debug(caplog):
    async def body():
        b = await Backend("b0").start()
        gw = await started([b], "kv_aware")
        try:
            async with aiohttp.ClientSession() as c:
                await send(c, gw.url, chat_body([{"role": "user", "content": "m"}]), session="chat-9")
        finally:
            await gw.stop()
            await b.stop()

    with caplog.at_level("DEBUG", logger="kvroute.live.gateway"):
        run(body())
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("route ")]
    assert len(msgs) == 1 and "session=chat-9" in msgs[0] and "-> b0" in msgs[0]
    assert "matched=0/" in msgs[0] and "policy=kv_aware" in msgs[0]


def test_tcp_nodelay_on_both_sides():
    async def body():
        b = await Backend("b0").start()
        gw = Gateway([("b0", b.url)], "round_robin")

        async def nodelay(request):  # reads the accepted socket's option
            sock = request.transport.get_extra_info("socket")
            return web.json_response(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        gw.app.router.add_get("/_nodelay", nodelay)
        await gw.start()
        try:
            async with aiohttp.ClientSession() as c, c.get(gw.url + "/_nodelay") as r:
                assert await r.json() != 0  # client -> gateway connection, gateway side
            # the connections of the gateway's upstream pool (proxied requests), read
            # while a stream is open, and of its aiohttp client (probes, /v1/models)
            body = chat_body([{"role": "user", "content": "x"}], test_chunks=2, test_delay_s=0.1)
            async with aiohttp.ClientSession() as c, c.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.content.readany()
                conns = gw._pool.connections()
                assert conns
                for conn in conns:
                    sock = conn.transport.get_extra_info("socket")
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
                await r.read()
            async with gw._client.post(b.url + "/v1/chat/completions", json=body) as r:
                sock = r.connection.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            await gw.stop()
            await b.stop()

    run(body())


def test_gateway_command_runs_as_a_process():
    b = BackendProcess("b0").start()
    code = "from kvroute.live.gateway import gateway_command; gateway_command()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--policy", "kv_aware", "--worker", f"w0={b.url}", "--port", "0",
         "--max-body-mib", "0.125", "--header-timeout-s", "5", "--idle-timeout-s", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line and "uvloop" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split("listening on ")[1].split()[0]

        async def body():
            async with aiohttp.ClientSession() as c:
                status, hdr, data = await send(c, url, chat_body([{"role": "user", "content": "hi"}]))
                assert status == 200 and hdr["X-Worker"] == "w0"
                status, _, data = await send(c, url, chat_body([{"role": "user", "content": "x" * 2**17}]))
                assert status == 413 and "limit of 131072 bytes" in json.loads(data)["error"]["message"]

        run(body())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        b.kill()
    bad = subprocess.run([sys.executable, "-c", code, "--policy", "nope", "--worker", "http://127.0.0.1:1"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown policy 'nope'" in bad.stderr


def test_through_the_emulator_warm_turns_hit_the_cache():
    """Through kvroute's emulated engines (labelled emulated): prefix_approx keeps each chat
    on one worker by its approximate index, and the engines report the later turns'
    prompts as cached, so the gateway's character chunks agree with the engine's blocks."""
    emulator = pytest.importorskip("kvroute.live.emulator", reason="kvroute.live.emulator is not there")

    async def body():
        emus = [await emulator.start_emulator("cpu", i, time_scale=0.05) for i in range(2)]
        gw = Gateway([(f"w{i}", e.url) for i, e in enumerate(emus)], "prefix_approx", health_interval_s=0.5)
        await gw.start()
        where = defaultdict(set)
        cached = {}
        try:
            async with aiohttp.ClientSession() as c:
                for conv in range(4):
                    msgs = [{"role": "system", "content": f"chat {conv}: " + "alpha beta gamma " * 300}]
                    for t in range(3):
                        msgs.append({"role": "user", "content": f"question {t} " + "why " * 50})
                        body = {"model": emus[0].server.model_name, "messages": msgs, "stream": True,
                                "max_tokens": 8, "stream_options": {"include_usage": True}}
                        async with c.post(gw.url + "/v1/chat/completions", json=body) as r:
                            assert r.status == 200 and r.headers["X-Kvroute-Emulated"] == "true"
                            events = [json.loads(e[6:]) for e in (await r.text()).split("\n\n") if e.startswith("data: {")]
                        where[conv].add(r.headers["X-Worker"])
                        cached[(conv, t)] = events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
                        reply = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
                        msgs.append({"role": "assistant", "content": reply})
        finally:
            await gw.stop()
            for e in emus:
                await e.close()
        assert all(len(w) == 1 for w in where.values()), where
        assert len({next(iter(w)) for w in where.values()}) == 2  # chats spread over both workers
        assert all(cached[(conv, 0)] == 0 and cached[(conv, 1)] > 0 and cached[(conv, 2)] > 0 for conv in range(4)), cached

    run(body())
