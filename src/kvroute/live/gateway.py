"""The live gateway: an asyncio HTTP proxy that routes with kvroute's policies.

::

    client ──POST /v1/chat/completions──► Gateway ──(same bytes)──► worker (engine)
             ◄── chunks as they arrive ──   │  ◄── SSE chunks ──────
                 + X-Worker                 │
                    parse JSON, digest text (prefix.py) ─► RouteRequest
                    sessions.get (memory, then Redis) ─► view (view.py)
                    policy.choose(request, view)   (synchronous, no I/O)
                    record: session table (queued Redis write), approximate index

The policy objects are those of :mod:`kvroute.policies` (``make_policy(spec, rng)``
once per gateway); the gateway fills their :class:`~kvroute.live.view.GatewayView`
from its own counters. The view's prefix matches come from an approximate index of
the request text it routed, or, with ``kv_events`` (one ZMQ endpoint per worker), from
the engines' KV cache events (:mod:`kvroute.live.kv_events`): the gateway then
tokenizes each request as the engine does (the model's chat template and tokenizer, or
the emulator's) and the view is exact. Responses are relayed as they arrive (``iter_any``: each chunk
written to the client as soon as it is read), non-streamed responses whole.

Failures: a worker that refuses a connection is marked down (new requests avoid it)
and the request is retried once on another up worker, as is any request that failed
before a byte reached the client; a background probe (GET /health every
``health_interval_s``) marks workers down and up. A failure after bytes reached the
client aborts the client's connection, so the client sees an incomplete response,
never a truncated one that looks whole. Redis being down only costs the sharing of
sessions (see :mod:`kvroute.live.sessions`).

Front end: the listening socket is served by :class:`_ClientConnection`, which parses
plain proxied POSTs itself (request line, headers, a Content-Length body) and writes
the relayed response straight to the transport; any other request (GET /health,
/metrics, /v1/models, chunked bodies, ``Expect``, malformed heads) hands its
connection to aiohttp's request handler, which serves it with the application's
routes (``fast_front=False`` serves everything through aiohttp). Per request, aiohttp's
server machinery (its Request and StreamResponse objects, per-connection task loop)
cost about a quarter of the gateway's CPU.

Limits (docs/live.md, "Request limits and client timeouts"): a body over
``max_body_bytes`` gets 413 without being read (from its declared length, before
``100 Continue``; a chunked one once past the limit); a connection is closed when its
request head is not complete ``header_timeout_s`` after it began, when its body stops
arriving that long (408), or when it is kept alive ``idle_timeout_s`` with no request.
A request in flight has no timer.

Upstream requests go through :mod:`kvroute.live.upstream` (a lean HTTP/1.1 client on
kept-alive connections: the request head and body in one send, the response parsed
in one small protocol object), not aiohttp's ``ClientSession``, whose per-request
machinery cost more CPU than the rest of the request path. The client's raw request
headers are forwarded as bytes (hop-by-hop ones dropped); the body is forwarded as
received, never re-serialised. aiohttp's client remains for the health probe and
GET /v1/models.

Sockets: TCP_NODELAY on every connection both ways: aiohttp sets it on accepted
connections (``BaseProtocol.connection_made``), the gateway on its listening socket
(accepted sockets inherit it on Linux), on its upstream connections
(``Upstream.connection_made``) and through the aiohttp client's ``socket_factory``.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
import signal
import socket
import sys
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from time import monotonic, perf_counter

import aiohttp
import click
import numpy as np
from aiohttp import web
from aiohttp.hdrs import EXPECT
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString
from yarl import URL

from kvroute.live.aio import cancel_all
from kvroute.live.kv_events import (
    ChatTokenizer,
    ExactPrefixIndex,
    KVEventSubscriber,
    chain_hashes_of,
    make_tokenizer,
    request_ids,
)
from kvroute.live.prefix import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DEFAULT_BLOCK_CHARS,
    DEFAULT_CHARS_PER_TOKEN,
    PrefixHasher,
    PromptError,
    chat_text,
    completion_text,
)
from kvroute.live.metrics import scrape_load
from kvroute.live.sessions import SessionStore
from kvroute.live.upstream import Upstream, UpstreamPool
from kvroute.live.view import (
    DEFAULT_DECODE_S_PER_RUNNING,
    DEFAULT_PREFILL_S_PER_TOKEN,
    ExcludingView,
    Flight,
    GatewayView,
)
from kvroute.loadsignal import ROUTER, SOURCES, LoadSignal
from kvroute.policies import NoWorkerUpError, make_policy
from kvroute.policies.base import RouteRequest

log = logging.getLogger(__name__)

WORKER_HEADER = "X-Worker"
_PROXIED = frozenset((CHAT_PATH, COMPLETIONS_PATH))
SESSION_HEADER = "X-Session-ID"
# hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp recomputes
_DROP_REQUEST = frozenset(
    h.lower()
    for h in ("Host", "Content-Length", "Connection", "Keep-Alive", "Transfer-Encoding",
              "TE", "Trailer", "Upgrade", "Proxy-Authorization", "Proxy-Connection")
)
#: the same, as the lower-case bytes of the client's raw headers (and Expect: the
#: gateway has read the whole body before it sends, so 100-continue means nothing upstream)
_DROP_REQUEST_RAW = frozenset(h.encode() for h in _DROP_REQUEST) | {b"expect"}
_DROP_RESPONSE = frozenset(
    h.lower()
    for h in ("Content-Length", "Connection", "Keep-Alive", "Transfer-Encoding", "TE",
              "Trailer", "Upgrade", "Date", "Server")
)
#: the fast front end forwards the worker's Date (it adds none of its own, unlike aiohttp)
_DROP_RESPONSE_FAST = _DROP_RESPONSE - {"date"}
_PROXIED_RAW = {CHAT_PATH.encode(): CHAT_PATH, COMPLETIONS_PATH.encode(): COMPLETIONS_PATH}
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_NO_BODY_STATUS = frozenset((204, 304))
_MAX_REQUEST_HEAD = 64 * 1024
#: consecutive timed-out health probes that mark a worker down (a refusal or a 5xx: one)
PROBE_TIMEOUTS_DOWN = 3
#: the request-body limit (Gateway's ``max_body_bytes``; why 8 MiB: see Gateway)
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
#: how long a request head may take from its first byte (and a body between two reads)
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: how long a kept-alive client connection may wait for its next request
DEFAULT_IDLE_TIMEOUT_S = 75.0
_LATENCY_BUCKETS = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0
)


def _loads(body: bytes):
    """Parse a request body: orjson (a few times faster), Python's json for what it refuses.

    orjson rejects a few things Python's json accepts (NaN and Infinity literals,
    UTF-16 and UTF-32); those bodies are parsed again by ``json.loads``, and errors
    carry json's message. (It reads integers beyond 64 bits as floats; the gateway
    reads only the prompt, ``stream`` and ``user``, and forwards the body unchanged.)
    Without orjson (an engine's environment that installs kvroute without its
    dependencies) it is ``json.loads``.
    """
    try:
        return _orjson_loads(body)
    except _OrjsonError:
        return json.loads(body)


try:
    from orjson import JSONDecodeError as _OrjsonError
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - the engine environments
    _loads = json.loads  # noqa: F811


def parse_worker(spec: str) -> tuple[str, str]:
    """``URL`` or ``NAME=URL`` -> ``(name, url)``; the name defaults to the URL.

    Raises ValueError for a URL that is not ``http://host:port``-like.
    """
    name, eq, url = spec.partition("=")
    if not eq:
        name, url = spec, spec
    url = url.strip().rstrip("/")
    name = name.strip().rstrip("/") if eq else url
    if not url.startswith(("http://", "https://")) or "//" not in url or not name:
        raise ValueError(f"worker {spec!r}: expected URL or NAME=URL with an http(s):// URL")
    return name, url


def _nodelay_socket(addr_info) -> socket.socket:
    """Client socket factory for the connector: TCP_NODELAY set explicitly."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with TCP_NODELAY (inherited by accepted sockets on Linux)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(addr)
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _RelayResponse(web.StreamResponse):
    """A StreamResponse whose head is sent with its first chunk (one write, not two).

    aiohttp's ``StreamResponse`` sends the head at ``prepare``; ``Response`` buffers it
    (``_send_headers_immediately``). The relay prepares only once the first chunk is
    in hand, so buffering delays nothing and saves a send per response.
    """

    _send_headers_immediately = False


def _chunk(data: bytes, end: bool) -> bytes:
    """``data`` as one chunk of a chunked body (none if empty), with the body's end if ``end``."""
    framed = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
    return framed + b"0\r\n\r\n" if end else framed


class _UpstreamFailed(Exception):
    """An attempt failed before any byte reached the client (so it may be retried)."""

    def __init__(self, kind: str, cause: BaseException, refused: bool) -> None:
        super().__init__(f"{kind}: {cause!r}")
        self.kind = kind
        self.refused = refused


@dataclass(slots=True)
class _Target:
    """Where a worker's requests go: its address and the start of each request's head."""

    host: str
    port: int
    tls: bool
    heads: dict[str, bytes]  # path -> request line + Host header


def _target(url: str) -> _Target:
    u = URL(url)
    tls = u.scheme == "https"
    port = u.port or (443 if tls else 80)
    host_header = u.host if u.is_default_port() else f"{u.host}:{port}"
    if ":" in (u.host or "") and not host_header.startswith("["):  # IPv6 literal
        host_header = f"[{u.host}]" + ("" if u.is_default_port() else f":{port}")
    base = u.raw_path.rstrip("/")
    heads = {
        path: f"POST {base}{path} HTTP/1.1\r\nHost: {host_header}\r\n".encode("latin-1")
        for path in (CHAT_PATH, COMPLETIONS_PATH)
    }
    return _Target(u.host, port, tls, heads)


@dataclass(slots=True)
class _Failure:
    """A request answered by the gateway itself (400, 502, 503)."""

    status: int
    message: str
    kind: str
    worker: str | None = None


def _too_large(limit: int, size: int | None) -> _Failure:
    """The 413 for a body over ``limit`` bytes (``size``: as declared; None: a chunked
    body, refused once more than the limit arrived)."""
    what = f"request body of {size} bytes" if size is not None else "chunked request body"
    return _Failure(413, f"{what} is over the gateway's limit of {limit} bytes "
                    f"({limit / 2**20:g} MiB: max_body_bytes, kvroute gateway --max-body-mib)",
                    "request_too_large")


@dataclass(slots=True)
class _Attempt:
    response: Upstream
    streaming: bool
    first: bytes | None  # streaming: the first chunk read (None: given to on_first); else the body
    t_headers: float


class _Histogram:
    """A histogram as a list of bucket counts (exposed by :class:`_StateCollector`)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            total += n
            cumulative.append((bound, total))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


class _StateCollector:
    """The gateway's counters, histograms and gauges, read at scrape time (no request-path cost)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def describe(self):
        return []

    def collect(self):
        gw = self.gw
        requests = CounterMetricFamily(
            "kvroute_gateway_requests", "requests answered, by worker and status "
            "(HTTP status, or upstream_aborted / client_disconnected)", labels=["worker", "status"],
        )
        for (worker, status), n in sorted(gw._requests.items()):
            requests.add_metric([worker, status], float(n))
        yield requests
        failures = CounterMetricFamily(
            "kvroute_gateway_upstream_failures", "attempts that failed before a byte reached the "
            "client (connect, send, read), by worker; the first of a request is retried elsewhere",
            labels=["worker", "kind"],
        )
        for (worker, kind), n in sorted(gw._failures.items()):
            failures.add_metric([worker, kind], float(n))
        yield failures
        closed = CounterMetricFamily(
            "kvroute_gateway_client_timeouts", "client connections the fast front end closed with no "
            "request in flight: header_timeout (no complete head in time), body_timeout (a body "
            "stopped arriving; answered 408), idle_timeout (kept alive, no next request)",
            labels=["reason"],
        )
        for reason, n in sorted(gw._closed.items()):
            closed.add_metric([reason], float(n))
        yield closed
        yield gw._decision.family(
            "kvroute_gateway_decision_seconds", "time of one routing decision "
            "(view snapshot, policy.choose, recording)",
        )
        yield gw._added.family(
            "kvroute_gateway_added_latency_seconds", "gateway time on a request's path "
            "outside the upstream exchange: parsing, session lookup, decision, bookkeeping "
            "before the upstream request, plus relaying the response head (and first chunk)",
        )
        redis = GaugeMetricFamily(
            "kvroute_gateway_redis_up", "1 while the shared session store (Redis) answers; "
            "0 when it is down or not configured (routing from memory)"
        )
        redis.add_metric([], 1.0 if gw.sessions.redis_up else 0.0)
        yield redis
        families = {
            "worker_up": ("1 while the worker is up (answers connections / health)", lambda s: s.up),
            "in_flight": ("requests routed to the worker and not finished", lambda s: s.in_flight),
            "waiting": ("in-flight requests with no response byte yet", lambda s: s.in_flight - s.running),
            "active_blocks": ("estimated KV blocks of in-flight requests", lambda s: s.active_blocks),
            "index_blocks": ("blocks in the worker's prefix index (the KV-event index when exact)",
                             lambda s: gw.view.index_size(s.name)),
        }
        for name, (doc, get) in families.items():
            fam = GaugeMetricFamily(f"kvroute_gateway_{name}", doc, labels=["worker"])
            for s in gw.view.state.values():
                fam.add_metric([s.name], float(get(s)))
            yield fam
        ex = gw.exact_index
        if ex is not None:
            for key, doc in (("events", "KV cache events applied"), ("batches", "KV event batches received"),
                             ("gaps", "KV event batches lost (sequence gaps not replayed)"),
                             ("orphans", "stored blocks whose parent the index did not know")):
                fam = CounterMetricFamily(f"kvroute_gateway_kv_{key}", doc, labels=["worker"])
                for w in gw.view.workers:
                    fam.add_metric([w], float(getattr(ex.workers[w], key)))
                yield fam


class _ClientConnection(asyncio.Protocol):
    """The fast front end: one client connection, its proxied POSTs parsed and answered here.

    A request that is a ``POST`` of a proxied path over HTTP/1.1 with a
    ``Content-Length`` body (what the load generator, the OpenAI clients and the
    benchmarks send) is routed by :meth:`Gateway._route` and relayed straight to the
    transport: the response head and the first chunk in one write, chunked encoding
    for streams, ``Content-Length`` otherwise. A declared body over the gateway's
    ``max_body_bytes`` is answered 413 from the head alone (``Expect: 100-continue``
    or not) and the connection closed (:class:`_Lingering`). Anything else (another
    method or path, ``Transfer-Encoding``, ``Expect`` within the limit, a malformed or
    oversized head, an empty body) hands the connection, with the bytes not yet
    consumed, to aiohttp's ``RequestHandler`` for good, so /health, /metrics,
    /v1/models, errors and every HTTP corner behave as aiohttp makes them. Requests on
    a connection are served one at a time, in order.

    Timers: ``deadline`` is when the connection is closed unless a request is being
    served (``busy``); :meth:`Gateway._sweep` checks it. It is set to
    ``header_timeout_s`` after the connection opens and after a request's first byte,
    re-armed by each read of a body still arriving, and set to ``idle_timeout_s``
    after a response when nothing of the next request has arrived. A request in
    flight (a long stream included) has no timer.
    """

    __slots__ = (
        "gw", "transport", "buf", "busy", "closed", "task", "upstream", "write_paused",
        "read_paused", "deadline", "idle", "keep", "first_at", "first_events", "first_end",
    )

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False
        self.closed = False
        self.task: asyncio.Task | None = None
        self.upstream: Upstream | None = None
        self.write_paused = False
        self.read_paused = False
        self.deadline = monotonic() + gw.header_timeout_s  # the first request is due
        self.idle = False  # the deadline is idle_timeout_s's (kept alive after a response)
        self.keep = True  # the request being served keeps the connection alive
        self.first_at = 0.0  # when its first chunk went out (by _send_first)
        self.first_events = 0  # SSE events in that chunk
        self.first_end = False  # the chunk ended the body

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.gw._conns.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.gw._conns.discard(self)
        if self.upstream is not None:
            self.upstream.close()  # the relay stops; the worker sees the request dropped

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.upstream is not None:  # relaying: stop reading the worker until we drain
            self.upstream.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.upstream is not None:
            self.upstream.resume()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if not buf:
            self.buf = data
            if not self.busy:  # a request's first bytes: its head is due
                self.deadline = monotonic() + self.gw.header_timeout_s
                self.idle = False
        elif type(buf) is bytearray:
            buf += data
        elif len(buf) + len(data) > _MAX_REQUEST_HEAD:  # a large body: append in place
            self.buf = bytearray(buf)
            self.buf += data
        else:
            self.buf = buf + data
        if not self.busy:
            self._next()
        elif len(self.buf) > _MAX_REQUEST_HEAD and not self.read_paused:
            self.read_paused = True  # a client sending ahead: wait for the current answer
            self.transport.pause_reading()

    # -- requests ------------------------------------------------------------------
    def _next(self) -> None:
        """Start the buffered request if it is complete (or hand over what is not ours)."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0 or end > _MAX_REQUEST_HEAD:
            if len(buf) > _MAX_REQUEST_HEAD:
                self._handover()
            return
        head = bytes(buf[:end]) if type(buf) is bytearray else buf[:end]
        lines = head.split(b"\r\n")
        if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1:
            self._handover()  # a bare CR or LF: aiohttp answers 400
            return
        request_line = lines[0].split(b" ")
        if len(request_line) != 3 or request_line[0] != b"POST" or request_line[2] != b"HTTP/1.1":
            self._handover()
            return
        path = _PROXIED_RAW.get(request_line[1])
        if path is None:
            self._handover()
            return
        length = -1
        sid = None
        keep_alive = True
        expect = False
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name[-1] in b" \t" or name[0] in b" \t":
                self._handover()
                return
            value = value.strip(b" \t")
            n = name.lower()
            if n == b"content-length":
                if length >= 0 or not value.isdigit():
                    self._handover()
                    return
                length = int(value)
            elif n in (b"transfer-encoding", b"upgrade"):
                self._handover()
                return
            elif n == b"expect":
                expect = True  # aiohttp answers it, unless the body is too large
            elif n == b"connection":
                if b"close" in value.lower():
                    keep_alive = False
            elif n == b"x-session-id" and sid is None:
                sid = value.decode("utf-8", "surrogateescape")
            headers.append((name, value))
        if length > self.gw.max_body_bytes:
            self._refuse(_too_large(self.gw.max_body_bytes, length))
            return
        if length <= 0 or expect:
            self._handover()  # aiohttp answers a missing body, and Expect
            return
        total = end + 4 + length
        if len(buf) < total:  # the rest of the body is on its way: each read re-arms the timer
            self.deadline = monotonic() + self.gw.header_timeout_s
            return
        body = bytes(buf[end + 4 : total])
        self.buf = buf[total:] if total < len(buf) else b""
        self.busy = True
        self.task = asyncio.get_running_loop().create_task(
            self._serve(path, headers, body, sid, keep_alive, perf_counter())
        )

    def _refuse(self, f: _Failure) -> None:
        """Answer ``f`` before reading the body, then discard what follows and close."""
        self._fail(f, keep_alive=False)
        self.gw._conns.discard(self)
        self.buf = b""
        _Lingering(self.gw, self.transport)

    def timed_out(self) -> None:
        """Past the deadline with no request in flight: a body that stopped arriving
        gets 408; a missing or partial head, or an idle connection, is just closed."""
        gw = self.gw
        gw._conns.discard(self)
        if self.buf.find(b"\r\n\r\n") >= 0:
            reason = "body_timeout"
            self._fail(_Failure(408, f"request body stalled: no byte for header_timeout_s "
                                f"({gw.header_timeout_s:g} s)", "request_timeout"), keep_alive=False)
        else:
            reason = "idle_timeout" if self.idle else "header_timeout"
        gw._closed[reason] = gw._closed.get(reason, 0) + 1
        self.transport.close()

    def _handover(self) -> None:
        """Give the connection (and the bytes not consumed) to aiohttp for good."""
        self.gw._conns.discard(self)
        server = self.gw._runner.server if self.gw._runner is not None else None
        transport = self.transport
        if server is None or self.closed:
            transport.close()
            return
        handler = server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        buf, self.buf = self.buf, b""
        if buf:
            handler.data_received(bytes(buf))

    async def _serve(self, path: str, headers: list, body: bytes, sid: str | None,
                     keep_alive: bool, t0: float) -> None:
        gw = self.gw
        try:
            self.keep = keep_alive
            r = await gw._route(path, headers, body, sid, t0, self._send_first)
            if type(r) is _Failure:
                self._fail(r, keep_alive)
            else:
                attempt, worker, flight, t_pre = r
                try:
                    keep_alive = await self._relay(attempt, worker, flight, t_pre, keep_alive) and keep_alive
                finally:
                    gw.view.finish(flight)
        except asyncio.CancelledError:
            keep_alive = False
            raise
        except Exception:
            log.exception("request on %s failed in the gateway", path)
            keep_alive = False
        finally:
            self.busy = False
            self.task = None
            # idle until the next request's first byte; one already here: its head is due
            self.idle = not self.buf
            self.deadline = monotonic() + (self.gw.idle_timeout_s if self.idle else self.gw.header_timeout_s)
            if not self.closed:
                if not keep_alive:
                    self.transport.close()
                else:
                    if self.read_paused:
                        self.read_paused = False
                        self.transport.resume_reading()
                    if self.buf:
                        self._next()

    def _fail(self, f: _Failure, keep_alive: bool) -> None:
        self.gw._count(f.worker or "", str(f.status))
        if self.closed:
            return
        body = json.dumps({"error": {"message": f.message, "type": f.kind, "code": f.status}}).encode()
        head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n" % (
            f.status, _REASONS.get(f.status, b"Error"), len(body))
        if f.worker:
            head += f"{WORKER_HEADER}: {f.worker}\r\n".encode("utf-8", "surrogateescape")
        if not keep_alive:
            head += b"Connection: close\r\n"
        self.transport.write(head + b"\r\n" + body)

    def _head(self, up: Upstream, worker: str, keep_alive: bool) -> list[bytes]:
        """The response head for the client, less its framing header and blank line."""
        code = up.status
        head = [b"HTTP/1.1 %d %s\r\n" % (code, _REASONS.get(code, b"Unknown"))]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in up.headers if k.lower() not in _DROP_RESPONSE_FAST]
        head.append(self.gw._worker_header[worker])
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        return head

    def _send_first(self, worker: str, up: Upstream, chunk: bytes, end: bool) -> None:
        """A stream's head and first chunk, in one write, from the worker's read callback:
        the first token does not wait for the other streams' bytes that arrived with it."""
        self.first_at = perf_counter()
        self.first_events = chunk.count(b"data:")
        self.first_end = end
        if self.closed or self.transport.is_closing():
            return
        head = self._head(up, worker, self.keep)
        head += (b"Transfer-Encoding: chunked\r\n\r\n", _chunk(chunk, end))
        self.transport.write(b"".join(head))

    async def _relay(self, a: _Attempt, worker: str, flight: Flight, t_pre: float, keep_alive: bool) -> bool:
        """Relay the answered attempt; False when the connection cannot be kept."""
        gw = self.gw
        up = a.response
        view = gw.view
        view.first_byte(flight)
        status = str(up.status)
        transport = self.transport
        if not a.streaming:
            head = self._head(up, worker, keep_alive)
            code = up.status
            up.release()  # (which clears the response's head)
            body = a.first
            if code not in _NO_BODY_STATUS:
                head.append(b"Content-Length: %d\r\n" % len(body))
            if self.closed:
                gw._count(worker, "client_disconnected")
                return False
            head.append(b"\r\n")
            head.append(body)
            transport.write(b"".join(head))  # head and body: one write
            gw._added.observe(t_pre + perf_counter() - a.t_headers)
            gw._count(worker, status)
            return True
        # the head and the first chunk went out from the worker's callback (_send_first)
        gw._added.observe(t_pre + self.first_at - a.t_headers)
        view.add_output(flight, self.first_events)
        if self.closed:
            gw._count(worker, "client_disconnected")
            up.close()  # the worker aborts the request
            return False
        if self.first_end:
            up.release()
            gw._count(worker, status)
            return True

        def sink(data: bytes, end: bool) -> None:
            """Each read from the worker, re-framed, straight to the client (see Upstream.relay)."""
            if self.closed or transport.is_closing():  # (the client left; its loss is on its way)
                return
            transport.write(_chunk(data, end))
            if data:
                view.add_output(flight, data.count(b"data:"))

        self.upstream = up
        if self.write_paused:  # the first write filled the client's socket
            up.pause()
        try:
            await up.relay(sink)
        except (asyncio.TimeoutError, OSError) as exc:
            up.close()
            if self.closed:
                gw._count(worker, "client_disconnected")
                return False
            # bytes already reached the client: abort its connection so it sees an
            # incomplete response, not a clean end
            log.warning("worker %s failed mid-response on %s: %r", worker, "the stream", exc)
            gw._count(worker, "upstream_aborted")
            transport.abort()
            return False
        except BaseException:
            up.close()
            raise
        finally:
            self.upstream = None
        if self.closed:
            gw._count(worker, "client_disconnected")
            up.close()
            return False
        up.release()
        gw._count(worker, status)
        return True


class _Lingering(asyncio.Protocol):
    """A refused connection's last state: discard what the client still sends, close at
    its end or after ``header_timeout_s``.

    Closing a socket with unread bytes makes the kernel send a reset, which can reach
    the client before it has read the answer; reading the rest away (nginx's and
    aiohttp's "lingering close") lets it read the answer. The write side is shut after
    the answer, so a client that stopped sending sees the end at once.
    """

    __slots__ = ("gw", "transport", "timer")

    def __init__(self, gw: Gateway, transport: asyncio.Transport) -> None:
        self.gw = gw
        self.transport = transport
        gw._lingering.add(self)
        transport.set_protocol(self)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(gw.header_timeout_s, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: BaseException | None) -> None:
        self.timer.cancel()
        self.gw._lingering.discard(self)


class Gateway:
    """One gateway: policy, view, session store, HTTP server and client.

    Args:
        workers: worker specs (``URL`` or ``NAME=URL``) or ``(name, url)`` pairs.
        policy: policy spec (``kvroute.policies.make_policy``).
        seed: seed of the policy's rng.
        redis_url: shared session store; ``None`` keeps sessions in memory only.
        session_ttl_s: session table TTL.
        block_chars / chars_per_token: the prefix hasher (see :mod:`kvroute.live.prefix`).
        prefill_s_per_token / decode_s_per_running: the view's delay estimates.
        max_num_seqs / decode_step_s: the engines' batch cap and full-batch decode step,
            for the view's slot wait (:class:`~kvroute.live.view.GatewayView`).
        health_interval_s: period of the workers' GET /health probe.
        health_timeout_s: how long a probe waits (default: the period, within 0.5-5 s).
        connect_timeout_s: upstream connect timeout (a refused connect fails at once).
        read_timeout_s: longest silence from an upstream before the request fails.
        index_ttl_s / index_capacity_blocks: the approximate prefix index's bounds.
        kv_events: worker name -> ZMQ endpoint of its ``--kv-events-config`` (or one
            endpoint per worker, in order): the view becomes exact, filled from the
            engines' KV events; needs ``tokenizer`` and ``kv_block_size``.
        tokenizer: ``emulator``, a model folder (chat template + tokenizer.json) or a
            :class:`~kvroute.live.kv_events.ChatTokenizer`.
        kv_block_size: the engines' KV block size in tokens (KV events; the view's
            ``kv_usage`` under the ``router`` load signal).
        kv_topic / kv_replay: the engines' topic and replay endpoints (worker -> endpoint).
        kv_connect_timeout_s: how long ``start`` waits for every engine's publisher.
        load_signal: where the view's load comes from (:mod:`kvroute.loadsignal`):
            ``router`` (its own counters), ``scraped`` (each worker's /metrics every
            ``interval_ms``, by a background task per worker) or ``events`` (KV events
            applied ``delay_ms`` late; needs ``kv_events``).
        kv_capacity_blocks: the engines' KV cache in blocks (scraped KV usage -> blocks).
        session_kwargs: extra :class:`SessionStore` arguments (tests).
        fast_front: serve proxied POSTs with :class:`_ClientConnection` (False: aiohttp
            serves every request, as the gateway's own handler; tests compare both).
        max_body_bytes: the largest request body taken; a larger one gets 413 with a
            JSON error naming the limit, from its ``Content-Length`` alone (before any
            of it is read, before ``100 Continue``) or, chunked, once more than the limit
            has arrived, and the connection is closed. The default, 8 MiB, holds any
            real prompt with margin: chat JSON is about 4 bytes a token for English
            text and at most about 12 where every character is a six-byte ``\\u`` escape,
            so a full 128k-token context is 0.5-1.5 MiB and a 1M-token English prompt
            about 4 MiB. (aiohttp's default, 64 MiB, which the gateway had before,
            let a 64 MB body be read whole and parsed.)
        header_timeout_s: a connection that sends no complete request head within this
            long of opening or of the head's first byte is closed, as is one whose body
            stops arriving for this long (408); also how long a refused connection's
            remaining bytes are read away. Default 10 s: a real client sends its head in
            one round trip.
        idle_timeout_s: a kept-alive connection with no request for this long after its
            last response is closed. Default 75 s (nginx's keepalive_timeout; clients'
            pools close theirs sooner: aiohttp 15 s, httpx 5 s). A request in flight,
            however long its stream, is never cut by either timer. On the aiohttp path
            (``fast_front=False``, or a connection handed over) this is aiohttp's
            ``keepalive_timeout``, and aiohttp has no header timeout of its own: a
            missing or partial head there waits ``idle_timeout_s``.

    Use ``await start(host, port)`` / ``await stop()`` inside a running loop, or
    :func:`run_gateway` from a command line.
    """

    def __init__(
        self,
        workers: Sequence[str | tuple[str, str]],
        policy: str,
        *,
        seed: int = 0,
        redis_url: str | None = None,
        session_ttl_s: float = 3600.0,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
        prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
        decode_s_per_running: float = DEFAULT_DECODE_S_PER_RUNNING,
        max_num_seqs: int | None = None,
        decode_step_s: float = 0.0,
        health_interval_s: float = 1.0,
        health_timeout_s: float | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float | None = 600.0,
        index_ttl_s: float = 120.0,
        index_capacity_blocks: int | None = None,
        session_kwargs: dict | None = None,
        fast_front: bool = True,
        kv_events: dict[str, str] | Sequence[str] | None = None,
        tokenizer: str | ChatTokenizer | None = None,
        kv_block_size: int | None = None,
        kv_topic: str | dict[str, str] = "",
        kv_replay: dict[str, str] | None = None,
        kv_connect_timeout_s: float = 5.0,
        load_signal: LoadSignal = ROUTER,
        kv_capacity_blocks: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        for name, value in (("header_timeout_s", header_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        pairs = [parse_worker(w) if isinstance(w, str) else tuple(w) for w in workers]
        if load_signal.source == "events" and not kv_events:
            raise ValueError("load_signal events delays the engines' KV events: give the gateway kv_events "
                             "(kvroute measure starts the engines with them)")
        self.load_signal = load_signal
        self.policy = make_policy(policy, np.random.default_rng(seed))
        self.hasher = PrefixHasher(block_chars, chars_per_token)
        self.exact_index: ExactPrefixIndex | None = None
        self.kv_subscriber: KVEventSubscriber | None = None
        self.tokenizer: ChatTokenizer | None = None
        self.kv_connect_timeout_s = kv_connect_timeout_s
        if kv_events:
            names = [n for n, _ in pairs]
            if not isinstance(kv_events, dict):
                if len(kv_events) != len(names):
                    raise ValueError(f"{len(kv_events)} KV-event endpoints for {len(names)} workers")
                kv_events = dict(zip(names, kv_events))
            if tokenizer is None or not kv_block_size:
                raise ValueError("KV events need the engines' tokenizer and KV block size")
            self.tokenizer = make_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
            self.exact_index = ExactPrefixIndex(names, kv_block_size)
            self.kv_subscriber = KVEventSubscriber(self.exact_index, kv_events, kv_topic, kv_replay,
                                                   delay_s=load_signal.delay_s)
        self.sessions = SessionStore(redis_url, ttl_s=session_ttl_s, **(session_kwargs or {}))
        self.view = GatewayView(
            pairs,
            self.hasher.block_tokens,
            self.sessions.peek,
            prefill_s_per_token=prefill_s_per_token,
            decode_s_per_running=decode_s_per_running,
            max_num_seqs=max_num_seqs,
            decode_step_s=decode_step_s,
            index_ttl_s=index_ttl_s,
            index_capacity_blocks=index_capacity_blocks,
            exact_index=self.exact_index,
            load_signal=load_signal,
            kv_capacity_blocks=kv_capacity_blocks,
            kv_block_size=kv_block_size,
        )
        self.view.record_on_finish = self.policy.index_on_finish
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s or max(0.5, min(5.0, health_interval_s))
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._ids = itertools.count()
        self._targets = {s.name: _target(s.url) for s in self.view.state.values()}
        self._client: aiohttp.ClientSession | None = None  # health probes, /v1/models
        self._pool: UpstreamPool | None = None  # the proxied requests
        self.fast_front = fast_front
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = float(header_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self._server: asyncio.AbstractServer | None = None  # the fast front end's listener
        self._conns: set[_ClientConnection] = set()
        self._lingering: set[_Lingering] = set()  # refused connections reading their rest away
        self._closed: dict[str, int] = {}  # fast front end: connections closed by a timer, by reason
        self._answered: dict[str, float] = {}  # worker -> perf_counter of its latest response head
        self._probe_timeouts: dict[str, int] = {}  # worker -> health probes timed out in a row
        self._worker_header = {
            name: f"{WORKER_HEADER}: {name}\r\n".encode("utf-8", "surrogateescape") for name in self.view.state
        }
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self.host: str | None = None
        self.port: int | None = None

        # Metrics on the request path are plain ints and lists read at scrape time
        # (_StateCollector): prometheus_client's Counter and Histogram take a lock and
        # cost microseconds per call, which the request path need not pay.
        self.registry = CollectorRegistry()
        self._requests: dict[tuple[str, str], int] = {}  # (worker, status) -> count
        self._failures: dict[tuple[str, str], int] = {}  # (worker, kind) -> count
        self._decision = _Histogram(_LATENCY_BUCKETS)
        self._added = _Histogram(_LATENCY_BUCKETS)
        self.registry.register(_StateCollector(self))

        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.router.add_post(CHAT_PATH, self._proxy, expect_handler=self._expect)
        self.app.router.add_post(COMPLETIONS_PATH, self._proxy, expect_handler=self._expect)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/models", self._models)

    # -- lifecycle -------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Connect the session store, start the probe and listen on ``host:port``."""
        await self.sessions.start()
        if self.kv_subscriber is not None:
            await self.kv_subscriber.start()
            late = await self.kv_subscriber.wait_connected(self.kv_connect_timeout_s)
            if late:
                log.warning("KV events: no publisher connected yet for %s (their blocks cached before "
                            "they connect stay unknown)", late)
        self._pool = UpstreamPool(self.connect_timeout_s, self.read_timeout_s)
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=60.0,
            socket_factory=_nodelay_socket, ttl_dns_cache=None,
        )
        self._client = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        # aiohttp's keepalive_timeout closes a connection with no complete request in
        # hand (idle, nothing sent, a partial head); lingering_time bounds the reading
        # away of a refused body
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0,
                                     keepalive_timeout=self.idle_timeout_s,
                                     lingering_time=self.header_timeout_s)
        await self._runner.setup()
        server = self._runner.server
        if server is not None and getattr(server, "request_handler", None) == self.app._handle:
            # the proxied paths skip the application's router and middleware chain
            self._app_handle = server.request_handler
            server.request_handler = self._dispatch
        sock = listen_socket(host, port)
        self.host, self.port = host, sock.getsockname()[1]
        if self.fast_front:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(lambda: _ClientConnection(self), sock=sock)
        else:
            await web.SockSite(self._runner, sock).start()
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="gateway-health-probe"))
        if self.fast_front:
            self._tasks.append(asyncio.create_task(self._sweep_loop(), name="gateway-client-timers"))
        if self.view.scraped:
            for name in self.view.workers:
                self._tasks.append(asyncio.create_task(self._scrape_loop(name), name=f"gateway-scrape-{name}"))
        log.info(
            "gateway on %s: policy %s, workers %s, redis %s",
            self.url, self.policy.spec, [s.url for s in self.view.state.values()],
            self.sessions.redis_url or "off",
        )

    async def stop(self) -> None:
        """Stop listening, the probe, the client and the session store."""
        await cancel_all(self._tasks)
        self._tasks = []
        if self._server is not None:
            self._server.close()
            self._server = None
        conns, self._conns = list(self._conns), set()
        for conn in conns:
            conn.transport.close()
        for lingering in list(self._lingering):
            lingering.transport.close()
        await cancel_all([c.task for c in conns if c.task is not None])
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self.kv_subscriber is not None:
            await self.kv_subscriber.stop()
        await self.sessions.close()

    # -- helpers ---------------------------------------------------------------------
    def _count(self, worker: str, status: str) -> None:
        key = (worker, status)
        self._requests[key] = self._requests.get(key, 0) + 1

    def _error(self, status: int, message: str, kind: str, worker: str | None = None) -> web.Response:
        self._count(worker or "", str(status))
        headers = {WORKER_HEADER: worker} if worker else None
        resp = web.json_response(
            {"error": {"message": message, "type": kind, "code": status}},
            status=status, headers=headers,
        )
        if status in (408, 413):  # the body was not read to its end: the connection cannot be kept
            resp.force_close()
        return resp

    def _decide(self, req: RouteRequest, known_session: bool, view=None) -> tuple[str, int]:
        """Choose a worker and record the decision; returns ``(worker, matched tokens)``."""
        t = perf_counter()
        gv = self.view
        gv.snapshot()
        worker = self.policy.choose(req, view or gv)
        matched = gv.matched_tokens(worker, req)
        gv.record(worker, req)
        if known_session:
            self.sessions.set(req.session_id, worker)
        self._decision.observe(perf_counter() - t)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s session=%s turn=%d -> %s matched=%d/%d policy=%s",
                req.request_id, req.session_id, req.turn, worker, matched,
                req.prompt_tokens, self.policy.spec,
            )
        return worker, matched

    def _mark_down(self, worker: str, why: object) -> None:
        if self.view.mark_down(worker):
            log.warning("worker %s is down (%s): new requests go elsewhere", worker, why)

    def _mark_up(self, worker: str) -> None:
        if self.view.mark_up(worker):
            log.warning("worker %s is up again", worker)

    async def _attempt(self, worker: str, path: str, data: bytes, stream_hint: bool,
                       on_first=None) -> _Attempt:
        """Send the request; read the head and the first chunk (or the whole body).

        ``data`` is the request after its request line and Host header (the forwarded
        headers, Content-Length and the body). A stream's first chunk goes to
        ``on_first(worker, response, data, end)``, when given, as it arrives (see
        :meth:`Upstream.first`). Raises :class:`_UpstreamFailed` for any failure before
        a byte is relayed.
        """
        t = self._targets[worker]
        try:
            resp = await self._pool.request(t.host, t.port, t.heads[path] + data, t.tls)
        except OSError as exc:  # UpstreamError: connect (refused), send or read
            kind = getattr(exc, "kind", "send")
            raise _UpstreamFailed(kind, exc, refused=getattr(exc, "refused", False)) from exc
        except asyncio.TimeoutError as exc:
            raise _UpstreamFailed("read", exc, refused=False) from exc
        t_headers = self._answered[worker] = perf_counter()
        streaming = resp.content_type.startswith("text/event-stream") or (
            stream_hint and not resp.has_length
        )
        try:
            if streaming and on_first is not None:
                await resp.first(lambda chunk, end: on_first(worker, resp, chunk, end))
                first = None
            else:
                first = await (resp.read() if streaming else resp.read_all())
        except (asyncio.TimeoutError, OSError) as exc:
            resp.close()
            raise _UpstreamFailed("read", exc, refused=False) from exc
        return _Attempt(resp, streaming, first, t_headers)

    # -- handlers --------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        """POSTs to the proxied paths go straight to :meth:`_proxy`; the rest to the app.

        (An ``Expect: 100-continue`` request goes through the app, which answers it.)
        """
        if request.method == "POST" and request.path in _PROXIED and EXPECT not in request.headers:
            return await self._proxy(request)
        return await self._app_handle(request)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect`` on a proxied path: 413 for a declared body over the limit, before
        the client sends it (no ``100 Continue``); else what aiohttp's default handler
        does (``100 Continue`` for HTTP/1.1 ``100-continue``, 417 for anything else)."""
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            f = _too_large(self.max_body_bytes, size)
            return self._error(f.status, f.message, f.kind)
        if request.version == aiohttp.HttpVersion11:
            expect = request.headers.get(EXPECT, "")
            if expect.lower() != "100-continue":
                raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # (as aiohttp's: the response has not begun)
        return None

    async def _read_body(self, request: web.Request) -> bytes | _Failure:
        """The aiohttp path's body, at most ``max_body_bytes`` of it (413 past that: a
        declared size at once, a chunked body once the limit is passed) and with at most
        ``header_timeout_s`` between reads (408), which aiohttp itself does not bound."""
        limit = self.max_body_bytes
        size = request.content_length
        if size is not None and size > limit:
            return _too_large(limit, size)
        content = request.content
        body = bytearray()
        while True:
            try:
                async with asyncio.timeout(self.header_timeout_s):
                    chunk = await content.readany()
            except TimeoutError:
                return _Failure(408, f"request body stalled: no byte for header_timeout_s "
                                f"({self.header_timeout_s:g} s)", "request_timeout")
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > limit:
                return _too_large(limit, None)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        """The aiohttp front end of :meth:`_route` (the fast one is :class:`_ClientConnection`)."""
        t0 = perf_counter()
        body = await self._read_body(request)
        if type(body) is _Failure:
            return self._error(body.status, body.message, body.kind)
        r = await self._route(request.path, request.raw_headers, body, request.headers.get(SESSION_HEADER), t0)
        if type(r) is _Failure:
            return self._error(r.status, r.message, r.kind, r.worker)
        attempt, worker, flight, t_pre = r
        try:
            return await self._relay(request, attempt, worker, flight, t_pre)
        finally:
            self.view.finish(flight)

    async def _route(
        self, path: str, raw_headers: Sequence[tuple[bytes, bytes]], body: bytes,
        sid: str | None, t0: float, on_first=None,
    ) -> _Failure | tuple[_Attempt, str, Flight, float]:
        """Parse, route and send a request; returns the answered attempt or a failure.

        The caller relays the attempt and then calls ``view.finish(flight)``. ``on_first``:
        see :meth:`_attempt`.
        """
        if not body:
            return _Failure(400, "missing request body: send a JSON object", "missing_body")
        try:
            payload = _loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return _Failure(400, f"malformed JSON in request body: {exc}", "malformed_json")
        if not isinstance(payload, dict):
            return _Failure(
                400, f"request body must be a JSON object, got {type(payload).__name__}",
                "invalid_request_error",
            )
        if self.tokenizer is not None:
            try:
                text, turn = chat_text(payload) if path == CHAT_PATH else (completion_text(payload), 0)
                ids = request_ids(self.tokenizer, path, payload)
            except Exception as exc:  # noqa: BLE001 - what the template or tokenizer refuses, the engine would
                return _Failure(400, f"cannot tokenize the request: {exc}", "invalid_request_error")
            bs = self.exact_index.block_size
            n = len(ids)
            prompt_tokens, hashes = n, chain_hashes_of(ids, bs, limit_blocks=(n - 1) // bs)
        else:
            try:
                digest = self.hasher.digest(path, payload)
            except PromptError as exc:
                return _Failure(400, str(exc), "invalid_request_error")
            text, turn, prompt_tokens, hashes = digest.text, digest.turn, digest.prompt_tokens, digest.block_hashes
        if not sid:
            user = payload.get("user")
            sid = user if isinstance(user, str) and user else None
        rid = f"g{next(self._ids)}"
        known = sid is not None
        if known:
            await self.sessions.get(sid)  # memory, else Redis: fills what view.session_worker reads
        else:
            sid = f"anon-{rid}"  # the policy sees a fresh session per request
        req = RouteRequest(rid, sid, turn, prompt_tokens, hashes, text)
        try:
            worker, matched = self._decide(req, known)
        except NoWorkerUpError as exc:
            return _Failure(503, str(exc), "no_worker_up")

        data = b"".join([
            *[k + b": " + v + b"\r\n" for k, v in raw_headers if k.lower() not in _DROP_REQUEST_RAW],
            b"Content-Length: %d\r\n\r\n" % len(body), body,
        ])
        stream_hint = payload.get("stream") is True
        flight = self.view.begin(worker, req, matched)
        t_pre = perf_counter() - t0
        tried: list[str] = []
        attempt: _Attempt | None = None
        while attempt is None:
            try:
                attempt = await self._attempt(worker, path, data, stream_hint, on_first)
            except _UpstreamFailed as exc:
                self.view.finish(flight)
                tried.append(worker)
                key = (worker, exc.kind)
                self._failures[key] = self._failures.get(key, 0) + 1
                if exc.refused:
                    self._mark_down(worker, exc)
                if len(tried) == 2:
                    return _Failure(
                        502, f"workers {tried} failed before answering (last: {exc})",
                        "upstream_failed", worker,
                    )
                try:
                    worker, matched = self._decide(req, known, ExcludingView(self.view, tried))
                except NoWorkerUpError:
                    return _Failure(
                        502, f"worker {worker} failed before answering ({exc}) and no other "
                        "worker is up", "upstream_failed", worker,
                    )
                log.info("retrying %s on %s after %s", rid, worker, exc)
                flight = self.view.begin(worker, req, matched)
            except BaseException:
                self.view.finish(flight)
                raise
        return attempt, worker, flight, t_pre

    async def _relay(
        self, request: web.Request, a: _Attempt, worker: str, flight: Flight, t_pre: float
    ) -> web.StreamResponse:
        up = a.response
        self.view.first_byte(flight)
        headers = [(k, v) for k, v in up.headers if k.lower() not in _DROP_RESPONSE]
        headers.append((WORKER_HEADER, worker))
        code = up.status
        status = str(code)
        if not a.streaming:
            up.release()
            resp = web.Response(body=a.first, status=code, headers=headers)
            self._added.observe(t_pre + perf_counter() - a.t_headers)
            self._count(worker, status)
            return resp
        resp = _RelayResponse(status=code, headers=headers)
        view = self.view
        chunk = a.first
        first = True
        try:
            await resp.prepare(request)  # the head goes out with the first chunk
            while True:
                if not chunk:  # upstream's end
                    await resp.write_eof()
                    break
                last = up.at_eof()  # upstream already ended: one write with the end
                if last:
                    await resp.write_eof(chunk)
                else:
                    await resp.write(chunk)
                if first:
                    self._added.observe(t_pre + perf_counter() - a.t_headers)
                    first = False
                view.add_output(flight, chunk.count(b"data:"))
                if last:
                    break
                try:
                    chunk = await up.read()
                except (asyncio.TimeoutError, OSError) as exc:
                    # bytes already reached the client: abort its connection so it
                    # sees an incomplete response, not a clean end
                    log.warning("worker %s failed mid-response on %s: %r", worker, request.path, exc)
                    self._count(worker, "upstream_aborted")
                    up.close()
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
        except ConnectionResetError:
            self._count(worker, "client_disconnected")
            up.close()  # drop the upstream connection: the engine aborts the request
            return resp
        except asyncio.CancelledError:
            self._count(worker, "client_disconnected")
            up.close()
            raise
        except BaseException:
            up.close()
            raise
        up.release()
        self._count(worker, status)
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        v = self.view
        workers = {
            s.name: {
                "url": s.url,
                "up": s.up,
                "in_flight": s.in_flight,
                "waiting": s.in_flight - s.running,
                "active_blocks": s.active_blocks,
                "queue_delay_s": v.queue_delay_s(s.name),
                "index_blocks": v.index_size(s.name),
                "routed": s.routed,
            }
            for s in v.state.values()
        }
        if self.exact_index is not None:
            for name, w in workers.items():
                w["kv_events"] = self.exact_index.stats(name)
        if v.scraped:
            for s in v.state.values():
                workers[s.name]["scraped"] = {
                    "num_requests_running": s.scraped_running, "num_requests_waiting": s.scraped_waiting,
                    "kv_cache_usage_perc": s.scraped_kv_usage, "scrapes": s.scrapes, "errors": s.scrape_errors,
                    "age_s": None if s.scraped_at is None else v.clock() - s.scraped_at,
                }
        up = any(s.up for s in v.state.values())
        body = {
            "status": "ok" if up else "no_worker_up",
            "policy": self.policy.spec,
            "redis": (
                ("up" if self.sessions.redis_up else "down") if self.sessions.redis_enabled else "off"
            ),
            "view": "exact" if self.view.exact else "approx",
            "load_signal": self.load_signal.label,
            "workers": workers,
        }
        return web.json_response(body, status=200 if up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/models from the first up worker (clients discover the model name)."""
        for s in self.view.state.values():
            if not s.up:
                continue
            try:
                async with self._client.get(s.url + "/v1/models") as resp:
                    data = await resp.read()
                    headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
                    headers[WORKER_HEADER] = s.name
                    return web.Response(body=data, status=resp.status, headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
        return self._error(503, "no worker answered GET /v1/models", "no_worker_up")

    # -- health probe ----------------------------------------------------------------
    async def probe_once(self) -> None:
        """GET /health on every worker; up iff it answers with a status below 500.

        A refused connection or a 5xx marks the worker down at once. A probe that only
        times out marks it down after ``PROBE_TIMEOUTS_DOWN`` in a row, and never while
        the worker answered a proxied request since the probe began: a busy engine (a
        CPU worker deep in a long prefill, on a loaded machine) answers slowly but is up.
        """
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)

        async def one(name: str, url: str) -> None:
            t = perf_counter()
            try:
                async with self._client.get(url + "/health", timeout=timeout) as resp:
                    await resp.read()
                    ok = resp.status < 500
                    why = f"GET /health answered {resp.status}"
            except asyncio.TimeoutError as exc:
                slow = 0 if self._answered.get(name, -1.0) >= t else self._probe_timeouts.get(name, 0) + 1
                self._probe_timeouts[name] = slow
                if slow < PROBE_TIMEOUTS_DOWN:
                    return  # no verdict yet: the state stays as it was
                ok, why = False, f"{slow} health probes in a row timed out ({exc!r})"
            except (aiohttp.ClientError, OSError) as exc:
                ok, why = False, repr(exc)
            if ok:
                self._probe_timeouts[name] = 0
                self._mark_up(name)
            else:
                self._mark_down(name, why)

        await asyncio.gather(*(one(s.name, s.url) for s in self.view.state.values()))

    # -- scraped load (load_signal scraped) ----------------------------------------------
    async def scrape_once(self, worker: str) -> bool:
        """GET the worker's /metrics and hand its load gauges to the view; False (the
        view keeps the last scrape) when the page cannot be read."""
        s = self.view.state[worker]
        timeout = max(0.5, min(5.0, self.load_signal.interval_s))
        try:
            gauges = await scrape_load(self._client, s.url, timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            s.scrape_errors += 1
            if s.scrape_errors == 1 or s.scrape_errors % 100 == 0:
                log.warning("cannot scrape %s/metrics (%d failures): %r; its load stays as last scraped",
                            s.url, s.scrape_errors, exc)
            return False
        self.view.apply_scrape(worker, gauges)
        return True

    async def _scrape_loop(self, worker: str) -> None:
        """Scrape one worker every ``interval_ms``, on a fixed grid (a slow scrape does not
        shift the later ones), from start on."""
        loop = asyncio.get_running_loop()
        period = self.load_signal.interval_s
        due = loop.time()
        while True:
            try:
                await self.scrape_once(worker)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the scraper die
                log.exception("scraping %s failed", worker)
            due += period
            now = loop.time()
            if due < now:  # fell behind: skip the missed ticks
                due += -(-(now - due) // period) * period
            await asyncio.sleep(due - now)

    # -- client connection timers (fast front end) ----------------------------------------
    def _sweep(self) -> None:
        """Close the fast front end's connections past their deadline with no request in
        flight (see :class:`_ClientConnection`): one scan, no timer per request."""
        now = monotonic()
        for conn in [c for c in self._conns if not c.busy and c.deadline < now]:
            conn.timed_out()

    async def _sweep_loop(self) -> None:
        """:meth:`_sweep` every second, or every quarter of the shorter timeout when that
        is less: a connection is closed at most that much after its deadline."""
        period = min(1.0, self.header_timeout_s / 4, self.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self._sweep()
            except Exception:  # never let the timers die
                log.exception("closing timed-out client connections failed")

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.probe_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the probe die
                log.exception("health probe failed")


def _install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def run_gateway(host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Run a :class:`Gateway` until SIGINT/SIGTERM (uvloop where available).

    Prints one line ``kvroute gateway listening on http://HOST:PORT`` once it accepts
    connections (with ``port=0``, the port the system chose).
    """
    uv = _install_uvloop()

    async def main() -> None:
        gw = Gateway(**kwargs)
        await gw.start(host, port)
        # What start-up made (modules, app, policy) lives as long as the process: move it
        # out of the cyclic collector's reach, whose full passes otherwise walk all of it
        # while requests wait (about 13% of the gateway's CPU under streaming load, perf).
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if sys.platform != "win32":  # asyncio's signal handlers are Unix-only; on Windows
            for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C stops it via KeyboardInterrupt
                loop.add_signal_handler(sig, stop.set)
        click.echo(
            f"kvroute gateway listening on {gw.url} (policy {gw.policy.spec}, "
            f"{len(gw.view.workers)} workers, {'uvloop' if uv else 'asyncio'})",
        )
        try:
            await stop.wait()
        finally:
            await gw.stop()

    asyncio.run(main())


@click.command("gateway")
@click.option("--policy", required=True, help="Policy spec, e.g. kv_aware or hybrid_sticky:threshold_ms=500.")
@click.option("--worker", "workers", multiple=True, required=True,
              help="Worker URL or NAME=URL (repeatable); NAME goes in X-Worker (default: the URL).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port, printed at start).")
@click.option("--redis", "redis_url", default=None,
              help="Redis URL of the shared session table (redis://127.0.0.1:6379/0); memory only if absent.")
@click.option("--session-ttl-s", default=3600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Forget a session this long after its last turn.")
@click.option("--block-chars", default=DEFAULT_BLOCK_CHARS, show_default=True, type=click.IntRange(min=1),
              help="Characters per hashed chunk of the approximate prefix index.")
@click.option("--chars-per-token", default=DEFAULT_CHARS_PER_TOKEN, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Characters per estimated token.")
@click.option("--prefill-ms-per-token", default=DEFAULT_PREFILL_S_PER_TOKEN * 1e3, show_default=True,
              type=click.FloatRange(min=0), help="Per-token prefill estimate of the view (queue delay, cost_aware).")
@click.option("--decode-ms-per-running", default=DEFAULT_DECODE_S_PER_RUNNING * 1e3, show_default=True,
              type=click.FloatRange(min=0), help="Queue-delay share of each running request.")
@click.option("--max-num-seqs", default=None, type=click.IntRange(min=1),
              help="The engines' batch cap: a full batch adds a slot wait to the queue delay (default: none).")
@click.option("--decode-step-ms", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="One decode step with a full batch, for that slot wait.")
@click.option("--health-interval-s", default=1.0, show_default=True, type=click.FloatRange(min=0.05),
              help="Period of the workers' GET /health probe.")
@click.option("--index-ttl-s", default=120.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="TTL of the approximate prefix index (Dynamo's approximate indexer: 120 s).")
@click.option("--index-capacity-blocks", default=None, type=click.IntRange(min=1),
              help="Bound of each worker's approximate index in chunks (default: TTL only).")
@click.option("--read-timeout-s", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Longest silence from a worker before its request fails.")
@click.option("--max-body-mib", default=DEFAULT_MAX_BODY_BYTES / 2**20, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Largest request body in MiB; a larger one gets 413 before it is read.")
@click.option("--header-timeout-s", default=DEFAULT_HEADER_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Close a client connection whose request head is not complete this long after it "
                   "began (or whose body stops arriving this long: 408).")
@click.option("--idle-timeout-s", default=DEFAULT_IDLE_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Close a kept-alive client connection with no request for this long (never one in flight).")
@click.option("--kv-events", "kv_events", multiple=True,
              help="ZMQ endpoint of a worker's KV events (its --kv-events-config endpoint), NAME=ENDPOINT or one "
                   "per --worker in order; makes the view exact. tcp://127.0.0.1:P is bound here (the engine connects).")
@click.option("--tokenizer", default=None,
              help="With --kv-events: the model folder (chat template + tokenizer.json) or 'emulator'.")
@click.option("--kv-block-size", default=None, type=click.IntRange(min=1),
              help="The engines' KV block size in tokens (vLLM: 16 on GPU, 128 on the CPU build); needed with "
                   "--kv-events, and turns the gateway's own token count into KV usage.")
@click.option("--kv-topic", default="", help="With --kv-events: the engines' event topic.")
@click.option("--load-signal", "load_source", default="router", show_default=True,
              type=click.Choice(SOURCES), help="Where the view's load comes from: the gateway's own counters, "
              "each worker's /metrics scraped every --scrape-interval-ms, or KV events applied --events-delay-ms "
              "late (with --kv-events).")
@click.option("--scrape-interval-ms", default=None, type=click.FloatRange(min=0, min_open=True),
              help="With --load-signal scraped: the period of each worker's /metrics scrape.")
@click.option("--events-delay-ms", default=None, type=click.FloatRange(min=0),
              help="With --load-signal events: how late KV events reach the view.")
@click.option("--kv-capacity-blocks", default=None, type=click.IntRange(min=1),
              help="The engines' KV cache in blocks: with --load-signal scraped, kv_cache_usage_perc -> active "
                   "blocks (default: the gateway's own block count); otherwise the KV usage the view reads is its "
                   "own token count over this capacity (without it, 0).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the policy's rng.")
@click.option("--log-level", default="WARNING", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="DEBUG logs every routing decision.")
def gateway_command(
    policy: str, workers: tuple[str, ...], host: str, port: int, redis_url: str | None,
    session_ttl_s: float, block_chars: int, chars_per_token: float, prefill_ms_per_token: float,
    decode_ms_per_running: float, max_num_seqs: int | None, decode_step_ms: float, health_interval_s: float,
    index_ttl_s: float,
    index_capacity_blocks: int | None, read_timeout_s: float, max_body_mib: float, header_timeout_s: float,
    idle_timeout_s: float, kv_events: tuple[str, ...], tokenizer: str | None,
    kv_block_size: int | None, kv_topic: str, load_source: str, scrape_interval_ms: float | None,
    events_delay_ms: float | None, kv_capacity_blocks: int | None, seed: int, log_level: str,
) -> None:
    """Route OpenAI-compatible requests to WORKERs with a kvroute policy.

    Proxies POST /v1/chat/completions and /v1/completions (streaming passed through),
    adds X-Worker to every response, serves GET /health and GET /metrics. The session id
    is the X-Session-ID header, else the body's `user`.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvroute").setLevel(log_level.upper())  # also under `kvroute -v gateway`
    try:
        pairs = [parse_worker(w) for w in workers]
        make_policy(policy, np.random.default_rng(seed))  # fail before listening
        PrefixHasher(block_chars, chars_per_token)
        kv = _kv_endpoints(kv_events, [n for n, _ in pairs])
        if kv and (tokenizer is None or kv_block_size is None):
            raise ValueError("--kv-events needs --tokenizer (model folder or 'emulator') and --kv-block-size")
        if kv:
            make_tokenizer(tokenizer)  # a bad folder fails here, not on the first request
        for flag, value, source in (("--scrape-interval-ms", scrape_interval_ms, "scraped"),
                                    ("--events-delay-ms", events_delay_ms, "events")):
            if (value is None) == (load_source == source):
                raise ValueError(f"--load-signal {source} needs {flag}" if value is None
                                 else f"{flag} applies to --load-signal {source} only")
        signal = LoadSignal(load_source, interval_ms=scrape_interval_ms, delay_ms=events_delay_ms)
        if signal.source == "events" and not kv:
            raise ValueError("--load-signal events needs --kv-events")
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    run_gateway(
        host, port, workers=pairs, policy=policy, seed=seed, redis_url=redis_url,
        session_ttl_s=session_ttl_s, block_chars=block_chars, chars_per_token=chars_per_token,
        prefill_s_per_token=prefill_ms_per_token / 1e3,
        decode_s_per_running=decode_ms_per_running / 1e3,
        max_num_seqs=max_num_seqs, decode_step_s=decode_step_ms / 1e3,
        health_interval_s=health_interval_s, index_ttl_s=index_ttl_s,
        index_capacity_blocks=index_capacity_blocks, read_timeout_s=read_timeout_s,
        max_body_bytes=max(1, int(max_body_mib * 2**20)), header_timeout_s=header_timeout_s,
        idle_timeout_s=idle_timeout_s,
        kv_events=kv or None, tokenizer=tokenizer, kv_block_size=kv_block_size, kv_topic=kv_topic,
        load_signal=signal, kv_capacity_blocks=kv_capacity_blocks,
    )


def _kv_endpoints(specs: Sequence[str], names: list[str]) -> dict[str, str]:
    """``--kv-events`` values -> worker name -> endpoint (NAME=ENDPOINT, or in worker order)."""
    if not specs:
        return {}
    named = [s.partition("=") for s in specs]
    if all(eq for _, eq, _ in named):
        out = {n: ep for n, _, ep in named}
        if set(out) != set(names):
            raise ValueError(f"--kv-events names {sorted(out)} do not match the workers {names}")
        return out
    if any(eq for _, eq, _ in named) or len(specs) != len(names):
        raise ValueError(f"--kv-events: give NAME=ENDPOINT for every worker, or one endpoint per --worker "
                         f"in order ({len(names)} workers, {len(specs)} endpoints)")
    return dict(zip(names, specs))
