"""Replay a trace against OpenAI-compatible endpoints, streaming, and record every request.

::

    trace ──► chats (closed: C slots; open: arrivals) ──► POST /v1/chat/completions ──► endpoint
                 │  text: live.text, sized to the trace's token counts     (SSE, X-Session-ID)
                 └─ per request: send, first token, finish, usage ─► rows ─► records_for ─► parquet

Modes (the trace's ``mode``, as the simulator replays it):

* closed: ``trace.concurrency`` chats at once; a chat sends its next turn when the
  previous reply has ended plus the turn's ``think_s``; when a chat ends the slot takes
  the next conversation of the trace, not before its ``arrival_s``.
* open: conversation ``c`` sends turn 0 at ``c.arrival_s``; later turns as above.
* replay (a recorded trace, Mooncake's): every turn is sent at its own ``arrival_s``,
  open loop, whether or not its conversation's previous reply has ended.

A turn with ``hash_ids`` (an explicit prompt, as replay traces have) is sent as it is,
without history: by default a completions request (``explicit_api="completions"``,
POST /v1/completions) whose prompt is :func:`kvroute.live.text.explicit_prompt`, one
chunk of the id's own words per hash id, so equal leading ids are equal leading tokens
on the engine, and no chat template comes before them: the engine sees the trace's
blocks at the trace's offsets, as the simulator hashes them. ``explicit_api="chat"``
sends the same text as a single user message instead (the template's tokens then
precede it, the same for every request, so prefix equality is kept; the blocks are
shifted by them). A replay trace whose turns build their prompts from history is refused:
its later prompts would need replies that may not have come yet.

Otherwise a turn's prompt is the system prompt (if the trace has one) + every earlier user and
assistant message + the new user message, with text from :mod:`kvroute.live.text` of
exactly the trace's token counts (so the emulator sees the trace's sizes plus the chat
template's 3 tokens a message and 2 for the reply's head). The assistant messages are
the replies as streamed. Every request asks for ``output_tokens`` tokens with
``ignore_eos`` and streams with ``stream_options.include_usage``.

Accounting: every request sent becomes exactly one row. Status is ``ok`` or an error
kind: ``error:connect`` (refused or dropped before a response), ``error:http_<code>``,
``error:timeout`` (``request_timeout_s``), ``error:stream`` (the reply broke off or
came back malformed), ``error:time_limit`` (still running when ``time_limit_s`` ended
the run), ``error:client`` (an unexpected exception in the load generator, logged).
An error row's ``prompt_tokens`` is the expected count, ``cached_tokens`` 0 and
``output_tokens`` the tokens received. A conversation whose turn failed goes on with
its next turn, with a placeholder reply of the asked length in its history (so later
prompts keep the trace's sizes, and a router can send them elsewhere). Requests never sent, because
``max_requests`` or ``time_limit_s`` stopped the run first, are not rows.

Connections: one :class:`aiohttp.ClientSession`, kept-alive connections, no pool limit by
default (a pool wait would count as time to first token). aiohttp sets TCP_NODELAY on
every connection it opens (``aiohttp.base_protocol.BaseProtocol.connection_made``;
tests/test_loadgen.py checks it on a live socket).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import click
import pandas as pd

from kvroute.live import metrics as engine_metrics
from kvroute.live import text
from kvroute.records import REQUEST_COLUMNS, requests_table, summarize, write_atomic, write_csv, write_requests
from kvroute.workload.trace import Conversation, Trace, Turn

log = logging.getLogger(__name__)

SOURCES = ("live", "emulated")
#: how an explicit prompt (``hash_ids``) is sent: a raw completions prompt or one user message
EXPLICIT_APIS = ("completions", "chat")
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
SESSION_HEADER = "X-Session-ID"
WORKER_HEADER = "X-Worker"
#: body field naming the serving worker (kvroute's emulator sets it in every completion and
#: chunk): ``replay(worker_field=...)`` reads it when no ``X-Worker`` header came back
WORKER_FIELD = "kvroute_worker"


def _endpoints(endpoint_url: str | Sequence[str]) -> list[str]:
    urls = [endpoint_url] if isinstance(endpoint_url, str) else list(endpoint_url)
    if not urls:
        raise ValueError("at least one endpoint URL is needed")
    out = []
    for u in urls:
        u = u.rstrip("/")
        out.append(u[: -len("/v1")] if u.endswith("/v1") else u)  # a base URL, with or without /v1
    return out


def _is_ci() -> bool:
    return bool(os.environ.get("CI"))


@dataclass
class _Outcome:
    status: str = "ok"
    worker: str | None = None
    first: float = math.nan
    finish: float = math.nan
    chunks: int = 0
    usage: dict | None = None
    reply: list[str] = field(default_factory=list)
    error: str = ""


class Replayer:
    """One replay of a trace (see :func:`replay`); holds the run's counters."""

    def __init__(
        self,
        trace: Trace,
        endpoints: list[str],
        session: aiohttp.ClientSession,
        *,
        model: str | None,
        session_header: str | None,
        max_requests: int | None,
        time_limit_s: float | None,
        request_timeout_s: float,
        stream: bool,
        progress_every_s: float | None,
        worker_field: str | None = None,
        explicit_api: str = "completions",
    ):
        self.trace = trace
        self.endpoints = endpoints
        self.session = session
        self.model = model
        self.session_header = session_header
        self.max_requests = max_requests
        self.time_limit_s = time_limit_s
        self.request_timeout_s = request_timeout_s
        self.stream = stream
        self.progress_every_s = progress_every_s
        self.worker_field = worker_field
        self.explicit_api = explicit_api
        self.rows: list[dict] = []
        self.sent = 0
        self.in_flight = 0
        self.errors = 0
        self.t0 = 0.0
        self.deadline = math.inf  # loop time

    # -- clock and bounds -----------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the run started (the records' time origin)."""
        return time.perf_counter() - self.t0

    def _time_left(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()

    def _may_send(self) -> bool:
        if self.max_requests is not None and self.sent >= self.max_requests:
            return False
        return self._time_left() > 0

    async def _sleep_until(self, t_run: float) -> bool:
        """Sleep until run time ``t_run``; False if the time limit comes first."""
        delay = t_run - self.now()
        if delay > 0:
            if delay >= self._time_left():
                await asyncio.sleep(max(0.0, self._time_left()))
                return False
            await asyncio.sleep(delay)
        return self._time_left() > 0

    # -- the run ----------------------------------------------------------------------------
    async def warm_up(self, per_endpoint: int) -> None:
        """Open ``per_endpoint`` kept-alive connections to each endpoint (GET /health)
        before the clock starts, so the first turns do not pay for TCP setup."""

        async def one(url: str) -> None:
            try:
                async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                pass

        await asyncio.gather(*(one(u) for u in self.endpoints for _ in range(per_endpoint)))

    async def run(self) -> list[dict]:
        loop = asyncio.get_running_loop()
        self.t0 = time.perf_counter()
        if self.time_limit_s is not None:
            self.deadline = loop.time() + self.time_limit_s
        convs = list(enumerate(self.trace.conversations))
        progress = None
        if self.progress_every_s and not _is_ci():
            progress = asyncio.create_task(self._progress())
        try:
            if self.trace.mode == "closed":
                queue = deque(convs)
                slots = min(self.trace.concurrency or len(convs), len(convs))
                await asyncio.gather(*(self._closed_slot(queue) for _ in range(slots)))
            elif self.trace.mode == "replay":
                await self._replay(convs)
            else:
                await asyncio.gather(*(self._open_conversation(i, c) for i, c in convs))
        finally:
            if progress is not None:
                progress.cancel()
        self._log_progress(final=True)
        return sorted(self.rows, key=lambda r: (r["arrival_s"], r["conversation"], r["turn"]))

    async def _closed_slot(self, queue: deque) -> None:
        while queue and self._may_send():
            index, conv = queue.popleft()
            if not await self._sleep_until(conv.arrival_s):
                return
            await self._conversation(index, conv)

    async def _open_conversation(self, index: int, conv: Conversation) -> None:
        if await self._sleep_until(conv.arrival_s):
            await self._conversation(index, conv)

    async def _replay(self, convs: list[tuple[int, Conversation]]) -> None:
        """Replay mode: each turn at its own ``arrival_s`` in (time, conversation, turn)
        order, each in a task of its own (open loop: no turn waits for a reply); the
        first ``max_requests`` of that order are sent."""
        order = sorted((t.arrival_s, i, k) for i, c in convs for k, t in enumerate(c.turns))
        tasks: list[asyncio.Task] = []
        try:
            for n, (at, i, k) in enumerate(order):
                if self.max_requests is not None and n >= self.max_requests:
                    break
                if not await self._sleep_until(at):
                    break
                tasks.append(asyncio.create_task(self._explicit_turn(i, convs[i][1], k)))
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # only when the run itself was cancelled
                t.cancel()

    def _endpoint(self, index: int) -> str:
        return self.endpoints[index % len(self.endpoints)]

    async def _explicit_turn(self, index: int, conv: Conversation, k: int) -> None:
        """Send turn ``k``'s explicit prompt (``hash_ids``) as it is, without history."""
        turn = conv.turns[k]
        data, path, expected = self._explicit_request(turn)
        row, _ = await self._request(conv, k, self._endpoint(index), data, path, expected)
        self.rows.append(row)

    def _explicit_request(self, turn: Turn) -> tuple[bytes, str, int]:
        """Body, path and expected prompt tokens (here and on the tiny model) of an explicit turn."""
        prompt = text.explicit_prompt(turn.hash_ids, turn.user_tokens, self.trace.block_tokens)
        if self.explicit_api == "completions":
            return self._completion_body(prompt, turn.output_tokens), COMPLETIONS_PATH, turn.user_tokens
        messages = [{"role": "user", "content": prompt}]
        return self._chat_body(messages, turn.output_tokens), CHAT_PATH, text.chat_prompt_tokens(turn.user_tokens, 1)

    async def _conversation(self, index: int, conv: Conversation) -> None:
        endpoint = self._endpoint(index)
        if conv.turns[0].explicit:  # prompts as blocks: each turn sent as it is, paced as the mode says
            for k, turn in enumerate(conv.turns):
                if k and turn.think_s > 0 and not await self._sleep_until(self.now() + turn.think_s):
                    return
                if not self._may_send():
                    return
                await self._explicit_turn(index, conv, k)
            return
        messages: list[dict] = []
        if conv.system_tokens > 0:
            messages.append({"role": "system", "content": text.system_text(conv.system_id, conv.system_tokens)})
        content_tokens = conv.system_tokens
        for k, turn in enumerate(conv.turns):
            if k and turn.think_s > 0 and not await self._sleep_until(self.now() + turn.think_s):
                return
            if not self._may_send():
                return
            messages.append({"role": "user", "content": text.user_text(conv.id, k, turn.user_tokens)})
            content_tokens += turn.user_tokens
            expected_prompt = text.chat_prompt_tokens(content_tokens, len(messages))
            data = self._chat_body(messages, turn.output_tokens)
            row, reply = await self._request(conv, k, endpoint, data, CHAT_PATH, expected_prompt)
            self.rows.append(row)
            if row["status"] != "ok" or not reply.strip():
                reply = text.placeholder_reply(conv.id, k, turn.output_tokens)
            messages.append({"role": "assistant", "content": reply})
            content_tokens += turn.output_tokens

    # -- one request ------------------------------------------------------------------------
    def _body(self, body: dict, max_tokens: int) -> bytes:
        body.update(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, stream=self.stream)
        if self.model:
            body["model"] = self.model
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body).encode()

    def _chat_body(self, messages: list[dict], max_tokens: int) -> bytes:
        return self._body({"messages": messages}, max_tokens)

    def _completion_body(self, prompt: str, max_tokens: int) -> bytes:
        return self._body({"prompt": prompt}, max_tokens)

    async def _request(self, conv: Conversation, turn: int, endpoint: str, data: bytes, path: str,
                       expected_prompt: int) -> tuple[dict, str]:
        headers = {"Content-Type": "application/json"}
        if self.session_header:
            headers[self.session_header] = conv.id
        url = endpoint + path
        self.sent += 1
        self.in_flight += 1
        o = _Outcome()
        arrival = self.now()
        timeout = min(self.request_timeout_s, self._time_left())
        got_headers = False
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(url, data=data, headers=headers) as resp:
                    got_headers = True
                    o.worker = resp.headers.get(WORKER_HEADER)
                    if resp.status != 200:
                        o.status = f"error:http_{resp.status}"
                        o.error = (await resp.text())[:300]
                    elif self.stream:
                        await self._read_stream(resp, o)
                    else:
                        await self._read_json(resp, o)
        except TimeoutError:
            o.status = "error:time_limit" if self._time_left() <= 0 else "error:timeout"
            o.error = f"no complete reply within {timeout:.3g} s"
        except aiohttp.ClientConnectorError as exc:
            o.status, o.error = "error:connect", str(exc)
        except (aiohttp.ClientError, ConnectionError) as exc:
            # dropped before a response (a dead kept-alive peer) or in the middle of one
            o.status = "error:stream" if got_headers else "error:connect"
            o.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # never lose the row, even to a surprise; say so loudly
            log.warning("%s turn %d on %s: unexpected %r", conv.id, turn, endpoint, exc, exc_info=True)
            o.status, o.error = "error:client", f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
        o.finish = self.now()
        if o.status == "ok" and o.chunks == 0:
            o.status, o.error = "error:stream", "the reply carried no token"
        if o.status != "ok":
            self.errors += 1
            log.debug("%s turn %d on %s: %s %s", conv.id, turn, endpoint, o.status, o.error)
        usage = o.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        row = {
            "conversation": conv.id,
            "turn": turn,
            "worker": o.worker or endpoint,
            "endpoint": endpoint,
            "arrival_s": arrival,
            "first_token_s": o.first,
            "finish_s": o.finish,
            "ttft_ms": (o.first - arrival) * 1e3,
            "e2e_ms": (o.finish - arrival) * 1e3,
            "prompt_tokens": int(usage.get("prompt_tokens", expected_prompt)),
            "cached_tokens": int(cached) if cached is not None else (0 if o.status != "ok" else None),
            "output_tokens": int(usage.get("completion_tokens", o.chunks)),
            "status": o.status,
            "error": o.error,
        }
        return row, "".join(o.reply)

    async def _read_stream(self, resp: aiohttp.ClientResponse, o: _Outcome) -> None:
        done = False
        async for raw in resp.content:  # one SSE line at a time; read to EOF to keep the connection
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                o.status, o.error = "error:stream", f"malformed chunk: {payload[:100]!r}"
                continue
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                o.status, o.error = "error:stream", str(chunk["error"])[:300]
                continue
            for c in chunk.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                if piece:
                    if o.chunks == 0:
                        o.first = self.now()
                    o.chunks += 1
                    o.reply.append(piece)
            if o.worker is None and self.worker_field and isinstance(chunk.get(self.worker_field), str):
                o.worker = chunk[self.worker_field]
            if chunk.get("usage"):
                o.usage = chunk["usage"]
        if o.status == "ok" and not done:
            o.status, o.error = "error:stream", "the stream ended without [DONE]"

    async def _read_json(self, resp: aiohttp.ClientResponse, o: _Outcome) -> None:
        try:
            body = await resp.json(content_type=None)
            choice = body["choices"][0]
            content = (choice["message"]["content"] if "message" in choice else choice["text"]) or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            o.status, o.error = "error:stream", f"malformed reply: {exc}"
            return
        o.first = self.now()  # without streaming the first token arrives with the last
        o.chunks = 1 if content else 0
        o.reply.append(content)
        o.usage = body.get("usage")
        if o.worker is None and self.worker_field and isinstance(body.get(self.worker_field), str):
            o.worker = body[self.worker_field]

    # -- progress -----------------------------------------------------------------------------
    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.progress_every_s)
            self._log_progress()

    def _log_progress(self, final: bool = False) -> None:
        log.info("loadgen %s: %d sent, %d done (%d errors), %d in flight, %.1f s",
                 "finished" if final else "running", self.sent, len(self.rows), self.errors, self.in_flight,
                 self.now())


async def discover_model(session: aiohttp.ClientSession, endpoint: str, timeout_s: float = 10.0) -> str | None:
    """The first model GET /v1/models lists, or None when the endpoint does not say."""
    try:
        async with session.get(endpoint + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status == 200:
                data = (await resp.json(content_type=None)).get("data") or []
                if data and isinstance(data[0], dict):
                    return data[0].get("id")
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        pass
    return None


def make_session(limit: int = 0, limit_per_host: int = 0, keepalive_timeout_s: float = 60.0) -> aiohttp.ClientSession:
    """A client session with kept-alive connections (no total timeout: requests set their own).

    Idle connections are dropped after 60 s, before the gateway's 75 s idle timeout closes
    them, so a request is never sent on a connection the gateway is closing."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit_per_host, keepalive_timeout=keepalive_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 auto_decompress=False)


async def replay(
    trace: Trace,
    endpoint_url: str | Sequence[str],
    *,
    model: str | None = None,
    session_header: str | None = SESSION_HEADER,
    max_requests: int | None = None,
    time_limit_s: float | None = None,
    request_timeout_s: float = 600.0,
    limit: int = 0,
    limit_per_host: int = 0,
    stream: bool = True,
    progress_every_s: float | None = 10.0,
    warm_connections: bool = True,
    session: aiohttp.ClientSession | None = None,
    worker_field: str | None = None,
    explicit_api: str = "completions",
) -> list[dict]:
    """Replay ``trace`` and return one row per request sent, ordered by send time.

    Args:
        trace: the workload (its ``mode`` and ``concurrency`` decide the pacing; replay
            mode sends every turn at its own ``arrival_s``).
        endpoint_url: base URL (``http://host:port``) of a gateway or engine; with
            several, conversation ``i`` of the trace goes to ``endpoint_url[i % n]``.
        model: model name to ask for; default the first of GET /v1/models, else none.
        session_header: header carrying the conversation id (None: send none).
        max_requests: send at most this many requests.
        time_limit_s: send nothing after this many seconds; requests still running
            then are cut and recorded as ``error:time_limit``.
        request_timeout_s: one request's limit (``error:timeout``).
        limit, limit_per_host: connection-pool limits (0: none).
        stream: stream replies (time to first token is then measured).
        progress_every_s: log a status line this often (never when ``$CI`` is set).
        warm_connections: before the clock starts, open as many kept-alive connections
            to each endpoint as chats may use it at once (GET /health, at most 256), so
            the first turns' times do not include TCP connection setup.
        session: an aiohttp session to use (default: a fresh one, closed after).
        worker_field: a reply-body field naming the worker (``kvroute_worker``, which
            the emulator sets), read when no ``X-Worker`` header came back: behind a
            production router, which drops that header (default: not read).
        explicit_api: how a turn with ``hash_ids`` is sent: ``completions`` (a raw
            prompt, no chat template: the engine sees the trace's blocks as the
            simulator does) or ``chat`` (one user message).
    Returns:
        rows with ``conversation``, ``turn``, ``worker`` (the ``X-Worker`` response
        header, else the reply body's ``worker_field``, else the endpoint URL),
        ``endpoint``, ``arrival_s``, ``first_token_s``,
        ``finish_s`` (seconds since the run started), ``ttft_ms``, ``e2e_ms``,
        ``prompt_tokens``, ``cached_tokens``, ``output_tokens`` (from ``usage``),
        ``status`` and ``error`` (a message; empty when ok).
    """
    trace.validate()
    if trace.mode == "replay" and not all(c.turns[0].explicit for c in trace.conversations):
        raise ValueError(
            f"trace {trace.name!r}: replay mode sends every turn at its own time, so a prompt built from "
            "the conversation's history would need replies that may not have come yet; the live load "
            "generator replays recorded traces whose turns carry their prompts (hash_ids)"
        )
    if explicit_api not in EXPLICIT_APIS:
        raise ValueError(f"explicit_api must be one of {', '.join(EXPLICIT_APIS)}, got {explicit_api!r}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    endpoints = _endpoints(endpoint_url)
    own = session is None
    sess = session or make_session(limit, limit_per_host)
    try:
        if model is None:
            model = await discover_model(sess, endpoints[0])
            if model is None:
                log.warning("%s/v1/models names no model: requests go without one", endpoints[0])
        r = Replayer(trace, endpoints, sess, model=model, session_header=session_header,
                     max_requests=max_requests, time_limit_s=time_limit_s, request_timeout_s=request_timeout_s,
                     stream=stream, progress_every_s=progress_every_s, worker_field=worker_field,
                     explicit_api=explicit_api)
        if warm_connections:
            n = trace.concurrency if trace.mode == "closed" else len(trace.conversations)
            n = -(-min(n, max_requests if max_requests is not None else n) // len(endpoints))
            if limit_per_host:
                n = min(n, limit_per_host)
            await r.warm_up(min(n, 256))
        return await r.run()
    finally:
        if own:
            await sess.close()


# -- with the engines' own counters --------------------------------------------------------------


@dataclass
class LoadResult:
    """A replay's rows and each engine's /metrics counters around it."""

    rows: list[dict]
    metrics_before: dict[str, dict | None]
    metrics_after: dict[str, dict | None]
    wall_s: float
    #: this process's CPU seconds over the replay alone (load generator, and a gateway run in
    #: this process), not the scrapes around it: what the probe's client phase measures
    cpu_s: float = float("nan")

    @property
    def deltas(self) -> dict[str, dict[str, float]]:
        """Per engine URL: increase of each vLLM counter during the load (NaN if unreadable)."""
        return {u: engine_metrics.delta(self.metrics_before.get(u), self.metrics_after.get(u))
                for u in self.metrics_before}

    def cross_check(self) -> dict[str, float]:
        """Cache hits two ways: the engines' hit counters and the replies' cached tokens.

        Equal when the engines' /metrics were scraped around an otherwise idle run and
        every reply reported usage (an error row's unseen hits make them differ).
        """
        hits = sum(d["prefix_cache_hits"] for d in self.deltas.values())
        queries = sum(d["prefix_cache_queries"] for d in self.deltas.values())
        rows = [r for r in self.rows if r["status"] == "ok" and r["cached_tokens"] is not None]
        return {
            "metrics_hits": hits,
            "metrics_queries": queries,
            "usage_cached_tokens": float(sum(r["cached_tokens"] for r in rows)),
            "usage_prompt_tokens": float(sum(r["prompt_tokens"] for r in rows)),
        }


async def run_load(
    trace: Trace,
    endpoint_url: str | Sequence[str],
    *,
    metrics_urls: Iterable[str] | None = None,
    limit: int = 0,
    limit_per_host: int = 0,
    **replay_kwargs,
) -> LoadResult:
    """:func:`replay`, with every engine's /metrics scraped before and after.

    ``metrics_urls`` are the engines' base URLs (default: the endpoints themselves,
    right when the load goes straight to engines; behind a gateway pass the engines).
    """
    endpoints = _endpoints(endpoint_url)
    murls = [u.rstrip("/") for u in (metrics_urls if metrics_urls is not None else endpoints)]
    async with make_session(limit, limit_per_host) as sess:
        before = await engine_metrics.scrape_all(sess, murls)
        t, cpu = time.perf_counter(), time.process_time()
        rows = await replay(trace, endpoints, session=sess, **replay_kwargs)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        after = await engine_metrics.scrape_all(sess, murls)
    return LoadResult(rows, before, after, wall, cpu)


# -- records ----------------------------------------------------------------------------------------


def records_for(
    rows: Iterable[dict],
    *,
    source: str,
    experiment: str,
    hardware: str,
    policy: str,
    round: int,  # noqa: A002 - the contract's column name
    seed: int | None = None,
    view: str | None = None,
    load_signal: str | None = None,
    load_param: str | None = None,
    load: float | None = None,
    scaling: str | None = None,
) -> list[dict]:
    """Rows of :func:`replay` as :mod:`kvroute.records` rows.

    Args:
        source: ``live`` against real engines, ``emulated`` against the emulator
            (the caller knows which it started).
        scaling: how the trace was scaled to the engines (its ``meta["scaling"]``),
            written into every row, error rows included.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)} for a measurement, got {source!r}")
    common = {"source": source, "experiment": experiment, "hardware": hardware, "policy": policy,
              "round": int(round), "seed": seed, "view": view,
              "load_signal": load_signal, "load_param": load_param, "load": load, "scaling": scaling}
    out = []
    for r in rows:
        rec = {**common, **{k: r.get(k) for k in REQUEST_COLUMNS if k in r}}
        out.append(rec)
    return sorted(out, key=lambda r: (r["arrival_s"], r["conversation"], r["turn"]))


def write_results(records: Sequence[dict], out: str | os.PathLike, workers: dict[tuple, Sequence[str]] | None = None,
                  extra: dict | None = None) -> pd.DataFrame:
    """Write ``out``/requests.parquet and ``out``/summary.csv (and load.json with ``extra``).

    ``workers`` maps (experiment, hardware, policy, round) to every worker name, so an
    idle worker counts in the imbalance.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_requests(requests_table(records), out / "requests.parquet")
    summary = summarize(pd.DataFrame(list(records), columns=list(REQUEST_COLUMNS)), workers)
    write_csv(summary, out / "summary.csv")
    if extra is not None:
        write_atomic(out / "load.json", lambda tmp: Path(tmp).write_text(json.dumps(extra, indent=1, default=str)))
    return summary


# -- command line -----------------------------------------------------------------------------------


@click.command("loadgen")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", "endpoints", multiple=True, required=True,
              help="Base URL of a gateway or engine (repeatable: conversations alternate).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for requests.parquet, summary.csv and load.json.")
@click.option("--source", type=click.Choice(SOURCES), required=True, help="live (real engines) or emulated.")
@click.option("--experiment", required=True, help="Experiment name for the records.")
@click.option("--hardware", required=True, help="Hardware profile name for the records.")
@click.option("--policy", required=True, help="Policy (or router) name for the records.")
@click.option("--round", "round_", type=click.IntRange(min=0), default=0, show_default=True, help="Round for the records.")
@click.option("--metrics-url", "metrics_urls", multiple=True, help="Engine base URL to scrape /metrics from (repeatable; default the endpoints).")
@click.option("--model", help="Model name (default: the first of GET /v1/models).")
@click.option("--max-requests", type=click.IntRange(min=0), help="Send at most this many requests.")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), help="Stop after this many seconds.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True)
def loadgen(trace_path: Path, endpoints: tuple[str, ...], out: Path, source: str, experiment: str, hardware: str,
            policy: str, round_: int, metrics_urls: tuple[str, ...], model: str | None, max_requests: int | None,
            time_limit: float | None, request_timeout: float) -> None:
    """Replay TRACE (from `kvroute workload`) against ENDPOINTs and write the records."""
    from kvroute.workload import read_trace

    try:
        trace = read_trace(trace_path)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    result = asyncio.run(run_load(trace, list(endpoints), metrics_urls=list(metrics_urls) or None, model=model,
                                  max_requests=max_requests, time_limit_s=time_limit,
                                  request_timeout_s=request_timeout))
    recs = records_for(result.rows, source=source, experiment=experiment, hardware=hardware, policy=policy,
                       round=round_, scaling=trace.meta.get("scaling"))
    extra = {"metrics_before": result.metrics_before, "metrics_after": result.metrics_after,
             "deltas": result.deltas, "cross_check": result.cross_check(), "wall_s": result.wall_s}
    summary = write_results(recs, out, extra=extra)
    cols = ["policy", "requests", "errors", "ttft_p50_ms", "later_ttft_mean_ms", "hit_rate", "imbalance"]
    click.echo(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
