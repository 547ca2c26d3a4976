"""An OpenAI-compatible engine that runs the simulator's engine model in real time.

``python -m kvroute.live.emulator --hardware NAME --worker-index I --port P`` (or
``kvroute emulate``) serves one worker of a hardware profile. It is the simulator's
:class:`~kvroute.sim.engine.Engine` (continuous batching over the prefix-cached block
pool, step times from the profile's cost model) driven by the wall clock instead of
SimPy, behind the HTTP surface of a vLLM server::

    POST /v1/chat/completions, /v1/completions ─► tokenize (live.text) ─► API delay
         ─► Engine.waiting ──► driver: plan() → sleep(step × time_scale) → commit()
         ◄─ SSE: one chunk per token, at its step's end ◄──────────────┘
    GET /health, /v1/models, /metrics (vLLM names)    POST /reset_prefix_cache

The driver mirrors :class:`kvroute.sim.cluster.WorkerDriver`: a single step is slept
whole; a fast-path run of decode steps is slept step by step (each step's tokens are
streamed at its end) and cut at the next step boundary when a request arrives (or a
client goes away), then re-planned. Sleeps aim at absolute deadlines, so timer
overshoot does not accumulate. ``--time-scale`` multiplies every modelled duration
(0: as fast as possible).

Prompts are tokenized by :mod:`kvroute.live.text`'s word tokenizer and ChatML-like
template; block hashes chain over token ids (prompt, then the reply's tokens), so a
conversation's next turn hits the blocks of its history and conversations sharing a
system prompt share its blocks. Replies are vocabulary words fixed by the prompt, and
every request generates exactly ``max_tokens`` tokens (vLLM's ``ignore_eos``).

Everything it serves says it is emulated: the header ``X-Kvroute-Emulated: true`` on
every response and ``"system_fingerprint": "kvroute-emulator"`` in every completion.
Every completion body (and every streamed chunk) also names the worker that served it,
``"kvroute_worker": "w0"`` (:data:`WORKER_FIELD`), so a client behind a router that
drops response headers (the production routers) can still attribute each request.

KV cache events: with ``--kv-events-config`` (vLLM's flag and JSON) the worker publishes
its block pool's changes in vLLM's format over ZMQ (:class:`~kvroute.live.kv_events.
KVEventPublisher`): after every step that changed the pool, one batch of
``BlockRemoved`` for the hashes that left it and ``BlockStored`` (one block each,
parents first) for those that entered, and ``AllBlocksCleared`` on a reset. The pool
is compared with the previous step's (skipped when neither its size nor its eviction
count moved), so the pool's own code is not touched. The block hashes it sends are
its own (kvroute's chain hashes over its word tokenizer's ids); a subscriber keys them
by their token ids anyway, as it must for vLLM.

Not modelled: workers that time-share one device (each emulator process runs with the
device to itself), sampling parameters (ignored), and stop strings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import click
import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvroute.costmodel import StepTimeModel
from kvroute.hardware import Hardware, load_hardware
from kvroute.live import text
from kvroute.live.engines import max_model_len as default_max_model_len
from kvroute.live.engines import served_model_name
from kvroute.live.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from kvroute.sim.engine import Engine, EngineRequest

log = logging.getLogger(__name__)

FINGERPRINT = "kvroute-emulator"
EMULATED_HEADER = "X-Kvroute-Emulated"
#: body field of every completion and chunk naming the serving worker
WORKER_FIELD = "kvroute_worker"
DEFAULT_MAX_TOKENS = 16


class Job:
    """One request's life in the emulator: what the HTTP handler waits on."""

    __slots__ = ("req", "reply_ids", "emitted", "event", "finished", "cancelled", "received")

    def __init__(self, req: EngineRequest, reply_ids: list[int]):
        self.req = req
        self.reply_ids = reply_ids
        self.emitted = 0  # tokens generated so far (streamable)
        self.event = asyncio.Event()  # set whenever emitted or finished changes
        self.finished = False
        self.cancelled = False
        self.received = time.perf_counter()

    @property
    def cached_tokens(self) -> int:
        return max(0, self.req.cached_tokens)


class EmulatedWorker:
    """One engine and the task that drives it in real time."""

    def __init__(self, hw: Hardware, worker_index: int, time_scale: float = 1.0, seed: int = 0,
                 kv_events: KVEventPublisher | None = None):
        if not 0 <= worker_index < hw.workers:
            raise ValueError(f"worker index {worker_index} out of range: {hw.name!r} has {hw.workers} workers")
        if not (time_scale >= 0 and math.isfinite(time_scale)):
            raise ValueError(f"time scale must be a finite number >= 0, got {time_scale!r}")
        self.hw = hw
        self.name = hw.worker_names[worker_index]
        self.time_scale = float(time_scale)
        self.model = StepTimeModel.from_hardware(hw)
        e = hw.engine
        self.engine = Engine(self.name, self.model, hw.num_blocks, e.block_size,
                             e.max_num_batched_tokens, e.max_num_seqs)
        self.block_size = e.block_size
        self.rng = np.random.default_rng([seed, worker_index])
        c = hw.coefficients
        self._api_lo = max(0.0, c.api_overhead_ms - c.api_jitter_ms) * 1e-3
        self._api_hi = (c.api_overhead_ms + c.api_jitter_ms) * 1e-3
        self.jobs: dict[int, Job] = {}
        self._next_rid = 0
        self._in_transit = 0  # accepted, not yet in the engine's queue (API delay)
        self._wake = asyncio.Event()
        self._arrived = False
        self._aborts: list[Job] = []
        self._origin = time.perf_counter()
        self._task: asyncio.Task | None = None
        self.failure: BaseException | None = None
        # counters vLLM exposes beside the engine's prefix-cache counters
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success_total = 0
        # KV events: the pool's hashes at the last publication, and each hash's parent and tokens
        self.kv_events = kv_events
        self._published: set[int] = set()
        self._pool_mark: tuple[int, int] = (0, 0)
        self._block_info: dict[int, tuple[int | None, tuple[int, ...], int]] = {}

    # -- requests -------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], max_tokens: int) -> Job:
        """Accept a request; it reaches the engine's queue after the API-server delay."""
        if self.failure is not None:
            raise RuntimeError(f"engine failed: {self.failure!r}")
        reply = text.reply_token_ids(prompt_ids, max_tokens)
        hashes = text.block_hashes(prompt_ids + reply, self.block_size)
        if self.kv_events is not None:
            self._note_blocks(prompt_ids + reply, hashes)
        rid = self._next_rid
        self._next_rid += 1
        job = Job(EngineRequest(rid, len(prompt_ids), max_tokens, hashes), reply)
        self.jobs[rid] = job
        self._in_transit += 1
        c = self.hw.coefficients
        delay = c.api_work_s(float(self.rng.uniform(self._api_lo, self._api_hi)), len(prompt_ids))
        if not self.engine.idle:  # stretched as a whole, beside the engine it finds running (no re-timing)
            delay *= c.api_busy_factor
        delay *= self.time_scale
        asyncio.get_running_loop().call_later(delay, self._deliver, job)
        return job

    def _deliver(self, job: Job) -> None:
        self._in_transit -= 1
        if job.cancelled:
            self.jobs.pop(job.req.rid, None)
            return
        job.req.arrival_s = self.engine_time()
        self.engine.add(job.req)
        self._arrived = True
        self._wake.set()

    def abort(self, job: Job) -> None:
        """The client went away: drop the request at the next step boundary."""
        if job.finished or job.cancelled:
            return
        job.cancelled = True
        self._aborts.append(job)
        self._wake.set()

    def _apply_aborts(self) -> None:
        eng = self.engine
        for job in self._aborts:
            r = job.req
            if not eng.abort(r):
                continue  # still in transit: _deliver drops it
            self.jobs.pop(r.rid, None)
        self._aborts.clear()

    # -- state ----------------------------------------------------------------------
    def engine_time(self) -> float:
        """Model seconds since start (wall time divided by the time scale)."""
        wall = time.perf_counter() - self._origin
        return wall / self.time_scale if self.time_scale > 0 else wall

    @property
    def num_running(self) -> int:
        return len(self.engine.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.waiting) + self._in_transit

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False while requests hold blocks, as in vLLM)."""
        if not self.engine.idle or self._in_transit:
            return False
        ok = self.engine.pool.reset_prefix_cache()
        if ok and self.kv_events is not None:
            self._published = set()
            self._pool_mark = (0, self._evictions())
            self.kv_events.publish([AllBlocksCleared()])
        return ok

    # -- KV events ------------------------------------------------------------------
    def _note_blocks(self, ids: list[int], hashes: list[int]) -> None:
        """Remember each block's parent, tokens and depth, to describe it when it is cached."""
        info, bs = self._block_info, self.block_size
        parent = None
        for i, h in enumerate(hashes):
            if h not in info:
                info[h] = (parent, tuple(ids[i * bs : (i + 1) * bs]), i)
            parent = h
        if len(info) > 4 * self.hw.num_blocks + 4096:  # forget blocks neither cached nor wanted
            keep = set(self.engine.pool.cached)
            for job in self.jobs.values():
                keep.update(job.req.hashes)
            keep.update(hashes)
            self._block_info = {h: v for h, v in info.items() if h in keep}

    def _evictions(self) -> int:
        return getattr(self.engine.pool, "num_evictions", -1)

    def _publish_kv(self) -> None:
        """Publish what entered and left the pool since the last call (one batch)."""
        cached = self.engine.pool.cached
        mark = (len(cached), self._evictions())
        if mark == self._pool_mark and mark[1] >= 0:
            return  # nothing entered without growing the pool, nothing left without an eviction
        self._pool_mark = mark
        prev = self._published
        removed = [h for h in prev if h not in cached]
        added = [h for h in cached if h not in prev]
        if not removed and not added:
            return
        self._published = set(cached)
        events: list = [BlockRemoved(block_hashes=removed, medium="GPU")] if removed else []
        info = self._block_info
        added.sort(key=lambda h: info[h][2] if h in info else 0)
        for h in added:
            parent, tokens, _depth = info[h]
            events.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=list(tokens),
                                      block_size=self.block_size, medium="GPU"))
        self.kv_events.publish(events)

    # -- the driver -----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"emulator-{self.name}")
        if self.kv_events is not None:
            self.kv_events.start()

    async def stop(self) -> None:
        """Stop the driver; requests still open fail at once (their streams are dropped)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # already logged by _run
                pass
            self._task = None
        if self.failure is None:
            self.failure = RuntimeError("the emulator is shutting down")
        self._fail_open_jobs()
        if self.kv_events is not None:
            pub, self.kv_events = self.kv_events, None
            await pub.close()

    def _fail_open_jobs(self) -> None:
        for job in self.jobs.values():
            job.finished = True
            job.event.set()

    async def _run(self) -> None:
        try:
            await self._drive()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a model bug must not leave clients hanging
            log.exception("emulator engine %s failed", self.name)
            self.failure = exc
            self._fail_open_jobs()
            raise

    async def _sleep_until(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        delay = deadline - loop.time()
        await asyncio.sleep(delay if delay > 0 else 0)

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        eng = self.engine
        scale = self.time_scale
        while True:
            if self._aborts:
                self._apply_aborts()
            if eng.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._arrived = False
            eng.now = self.engine_time()
            plan = eng.plan()
            t0 = loop.time()
            start = eng.now
            ends = plan.ends
            k = len(ends)
            if k == 1:  # new arrivals join at the next step boundary anyway
                await self._sleep_until(loop, t0 + float(ends[0]) * scale)
                steps = 1
            else:
                # a run of pure decode steps: stream each step's tokens at its end, and
                # cut the run at the step boundary after an arrival or an abort
                steps = 0
                sched = plan.sched
                while steps < k:
                    await self._sleep_until(loop, t0 + float(ends[steps]) * scale)
                    steps += 1
                    if steps < k:
                        for r, _ in sched:
                            job = self.jobs[r.rid]
                            n = r.num_generated + steps
                            if n > job.emitted:
                                job.emitted = n
                                job.event.set()
                    if self._arrived or self._aborts:
                        break
            _first, done = eng.commit(plan, steps, start)
            if self.kv_events is not None:
                self._publish_kv()
            for r, _ in plan.sched:
                job = self.jobs[r.rid]
                if r.num_generated > job.emitted:
                    if job.emitted == 0:
                        self.prompt_tokens_total += r.prompt_tokens
                    job.emitted = r.num_generated
                    job.event.set()
            for r in done:
                job = self.jobs.pop(r.rid)
                job.finished = True
                job.event.set()
                self.generation_tokens_total += r.output_tokens
                self.request_success_total += 1


# -- metrics ----------------------------------------------------------------------------


class _EngineCollector:
    """Reads the worker's counters at scrape time, under vLLM's metric names."""

    def __init__(self, worker: EmulatedWorker, model_name: str):
        self.w = worker
        self.labels = ["model_name", "engine"]
        self.values = [model_name, "0"]

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        m = CounterMetricFamily(name, doc, labels=self.labels)
        m.add_metric(self.values, value)
        return m

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        m = GaugeMetricFamily(name, doc, labels=self.labels)
        m.add_metric(self.values, value)
        return m

    def collect(self):
        w, eng = self.w, self.w.engine
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", eng.prefix_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", eng.prefix_hits)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", w.prompt_tokens_total)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", w.generation_tokens_total)
        yield self._counter("vllm:request_success", "Count of successfully processed requests.", w.request_success_total)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemptions.", eng.num_preemptions)
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.", w.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", w.num_waiting)
        pool = eng.pool
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          pool.num_used_blocks / pool.num_blocks)


# -- HTTP -------------------------------------------------------------------------------


class BadRequest(Exception):
    """A client error, answered with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def error_response(message: str, status: int = 400, kind: str = "BadRequestError") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


@dataclass
class _Params:
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool


class EmulatorServer:
    """The aiohttp application around one :class:`EmulatedWorker`."""

    def __init__(self, worker: EmulatedWorker, model_name: str, max_model_len: int):
        self.worker = worker
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(worker, model_name))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            ["model_name", "engine"], registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
        ).labels(model_name, "0")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.on_response_prepare.append(self._label)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self.worker.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.worker.stop()

    @staticmethod
    async def _label(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers[EMULATED_HEADER] = "true"

    # -- plain endpoints --------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        if self.worker.failure is not None:
            return error_response(f"engine failed: {self.worker.failure!r}", 500, "InternalServerError")
        return web.Response(status=200)

    async def models(self, _request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvroute",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, _request: web.Request) -> web.Response:
        if not self.worker.reset_prefix_cache():
            return error_response("cannot reset the prefix cache while requests are running", 409, "ConflictError")
        return web.Response(status=200)

    # -- completions ------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list")
            add_gen = body.get("add_generation_prompt", True)
            try:
                ids = text.chat_token_ids(messages, add_generation_prompt=bool(add_gen))
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            params = self._params(body, ids)
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.kind)
        return await self._generate(request, params, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = text.tokenize(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                ids = list(prompt)
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
            params = self._params(body, ids)
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.kind)
        return await self._generate(request, params, chat=False)

    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        if not raw:
            raise BadRequest("request body is empty; expected a JSON object")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        return body

    def _params(self, body: Mapping, ids: list[int]) -> _Params:
        if not ids:
            raise BadRequest("the prompt is empty")
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("only n=1 is supported")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        total = len(ids) + max_tokens
        if total > self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(ids)} in the messages, {max_tokens} in the completion)."
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise BadRequest("'stream_options' must be an object")
        return _Params(ids, max_tokens, stream, bool(opts.get("include_usage", False)))

    def _usage(self, job: Job) -> dict:
        p, c = job.req.prompt_tokens, job.emitted
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c,
                "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}

    async def _generate(self, request: web.Request, params: _Params, chat: bool) -> web.StreamResponse:
        try:
            job = self.worker.submit(params.prompt_ids, params.max_tokens)
        except RuntimeError as exc:
            return error_response(str(exc), 500, "InternalServerError")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            if params.stream:
                return await self._stream(request, job, rid, chat, params.include_usage)
            while not job.finished:
                await job.event.wait()
                job.event.clear()
        except BaseException:  # client gone (reset or handler cancelled)
            self.worker.abort(job)
            raise
        if self.worker.failure is not None:
            return error_response(f"engine failed: {self.worker.failure!r}", 500, "InternalServerError")
        self.ttft.observe(time.perf_counter() - job.received)
        reply = " ".join(text.word_of(t) for t in job.reply_ids)
        base = {"id": rid, "created": int(time.time()), "model": self.model_name, "system_fingerprint": FINGERPRINT,
                WORKER_FIELD: self.worker.name}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": reply}, "logprobs": None,
                      "finish_reason": "length"}
            body = {**base, "object": "chat.completion", "choices": [choice]}
        else:
            choice = {"index": 0, "text": reply, "logprobs": None, "finish_reason": "length"}
            body = {**base, "object": "text_completion", "choices": [choice]}
        body["usage"] = self._usage(job)
        return web.json_response(body)

    async def _stream(self, request: web.Request, job: Job, rid: str, chat: bool, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": self.model_name, "system_fingerprint": FINGERPRINT,
                           WORKER_FIELD: self.worker.name})[:-1]
        # vocabulary words need no JSON escaping: each chunk is a template fill
        if chat:
            tok = head + ',"choices":[{"index":0,"delta":{"content":"%s"},"logprobs":null,"finish_reason":%s}]}'
        else:
            tok = head + ',"choices":[{"index":0,"text":"%s","logprobs":null,"finish_reason":%s,"stop_reason":null}]}'
        out = job.reply_ids
        total = len(out)
        sent = 0
        while True:
            await job.event.wait()
            job.event.clear()
            if self.worker.failure is not None:
                # drop the connection mid-stream: the client sees a broken reply, as from a dead server
                if request.transport is not None:
                    request.transport.abort()
                return resp
            n = min(job.emitted, total)
            if n > sent:
                parts = []
                if sent == 0:
                    self.ttft.observe(time.perf_counter() - job.received)
                    if chat:
                        parts.append("data: " + head + ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                                     '"logprobs":null,"finish_reason":null}]}\n\n')
                for i in range(sent, n):
                    word = text.word_of(out[i]) if i == 0 else " " + text.word_of(out[i])
                    parts.append("data: " + tok % (word, '"length"' if i == total - 1 else "null") + "\n\n")
                await resp.write("".join(parts).encode())
                sent = n
            if job.finished and sent >= total:
                break
        tail = []
        if include_usage:
            tail.append("data: " + head + ',"choices":[],"usage":' + json.dumps(self._usage(job)) + "}\n\n")
        tail.append("data: [DONE]\n\n")
        await resp.write("".join(tail).encode())
        await resp.write_eof()
        return resp


# -- running it --------------------------------------------------------------------------


class RunningEmulator:
    """An emulator serving in the current event loop (tests, in-process use)."""

    def __init__(self, server: EmulatorServer, runner: web.AppRunner, host: str, port: int):
        self.server = server
        self.runner = runner
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def worker(self) -> EmulatedWorker:
        return self.server.worker

    async def close(self) -> None:
        await self.server.worker.stop()  # open requests fail now, so shutdown does not wait for them
        await self.runner.cleanup()

    async def __aenter__(self) -> RunningEmulator:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def start_emulator(
    hardware: str | Hardware,
    worker_index: int = 0,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    time_scale: float = 1.0,
    model_name: str | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
    kv_events_config: str | dict | None = None,
) -> RunningEmulator:
    """Serve one emulated worker in the running loop; ``port=0`` picks a free port.

    ``kv_events_config``: vLLM's ``--kv-events-config`` (JSON or a dict): publish the
    block pool's KV events over ZMQ.
    """
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    pub = KVEventPublisher.from_config(kv_events_config) if kv_events_config else None
    worker = EmulatedWorker(hw, worker_index, time_scale, seed, kv_events=pub)
    server = EmulatorServer(worker, model_name or served_model_name(hw), max_model_len or default_max_model_len(hw))
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    return RunningEmulator(server, runner, host, bound)


async def _serve(hardware: str, worker_index: int, host: str, port: int, time_scale: float,
                 model_name: str | None, max_model_len: int | None, seed: int,
                 on_ready: Callable[[RunningEmulator], None] | None = None,
                 kv_events_config: str | None = None) -> None:
    emu = await start_emulator(hardware, worker_index, host=host, port=port, time_scale=time_scale,
                               model_name=model_name, max_model_len=max_model_len, seed=seed,
                               kv_events_config=kv_events_config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if on_ready is not None:
            on_ready(emu)
        await stop.wait()
    finally:
        await emu.close()


def run_emulator(hardware: str, worker_index: int = 0, host: str = "127.0.0.1", port: int = 8000,
                 time_scale: float = 1.0, model_name: str | None = None, max_model_len: int | None = None,
                 seed: int = 0, kv_events_config: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM (uvloop where available)."""

    def ready(emu: RunningEmulator) -> None:
        w = emu.worker
        kv = f", KV events to {w.kv_events.endpoint}" if w.kv_events is not None else ""
        print(f"kvroute emulator (EMULATED) {w.name} of {w.hw.name} serving {emu.server.model_name!r} "
              f"on {emu.url} (time scale {w.time_scale:g}, {w.hw.num_blocks} blocks of {w.block_size}{kv})", flush=True)

    coro = _serve(hardware, worker_index, host, port, time_scale, model_name, max_model_len, seed, ready,
                  kv_events_config)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(coro)
    else:
        uvloop.run(coro)


@click.command("emulate")
@click.option("--hardware", required=True, help="Hardware profile whose worker to emulate (hardware/NAME.yaml).")
@click.option("--worker-index", type=click.IntRange(min=0), default=0, show_default=True, help="Which worker of the profile (0-based).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port (0: any free port).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--time-scale", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Multiply every modelled duration (0: as fast as possible).")
@click.option("--model-name", help="Served model name (default: from the profile's model).")
@click.option("--max-model-len", type=click.IntRange(min=1), help="Longest prompt + reply accepted (default: from the profile).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the API-delay jitter.")
@click.option("--kv-events-config", default=None,
              help="vLLM's flag: JSON with enable_kv_cache_events, endpoint (tcp://127.0.0.1:P connects, as vLLM "
                   "does), topic, replay_endpoint; publishes the block pool's KV events over ZMQ.")
def emulate(hardware: str, worker_index: int, port: int, host: str, time_scale: float,
            model_name: str | None, max_model_len: int | None, seed: int, kv_events_config: str | None) -> None:
    """Serve one EMULATED worker of a hardware profile (OpenAI-compatible, vLLM metrics)."""
    try:
        hw = load_hardware(hardware)
        if worker_index >= hw.workers:
            raise ValueError(f"--worker-index {worker_index} out of range: {hardware!r} has {hw.workers} workers")
        if kv_events_config is not None:
            json.loads(kv_events_config)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        run_emulator(hardware, worker_index, host, port, time_scale, model_name, max_model_len, seed,
                     kv_events_config)
    except OSError as exc:  # port in use, bad address
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc}") from exc


if __name__ == "__main__":
    emulate(prog_name="python -m kvroute.live.emulator")
