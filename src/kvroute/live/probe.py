"""Probe running vLLM engines with requests of our own: the inputs of ``kvroute calibrate --probe``.

A calibration must never read the experiments it will predict, so this module times
the engines directly, on work it chooses, through their OpenAI API (streaming,
temperature 0, ``ignore_eos``, a fixed ``max_tokens``), and reads the engines' own
/metrics beside the client's clock. Every prompt is a single user message of words
from :mod:`kvroute.live.text` keyed by a per-probe name, so no two probes share a KV
block unless a phase repeats a prompt on purpose. The engines are started ``sessions``
times (each worker is then several engine processes). Per worker and session: two warm-up requests
whose timings are dropped (the first request allocates), ``warmup_repetitions`` untimed
repetitions (sent and dropped: the first stretch of probes after a start, or after a
measurement's load, runs slow), then ``repetitions`` times every kind of probe below (the
API probes spread over the repetitions), so that a repetition is one stretch of time:

* ``api``: minimal prompts (a few words, 2 tokens out). The API server's cost per
  request is the client's TTFT less the engine's own queue and prefill time (the
  ``vllm:request_queue_time_seconds`` and ``vllm:request_prefill_time_seconds``
  histograms, read as the change of their ``_sum`` across the one request).
* ``prefill``: prompts of each length, cold (a new prefix: nothing cached), then the
  same prompt again, warm (its full blocks cached). The engine's prefill time of each.
* ``decode``: ``B`` concurrent streams (1 to ``max_num_seqs``), each on a prefix of its
  own, short or long, that one request has cached before, and a few words after it: all
  ``B`` are admitted in a step or two of a few tokens each, then every step decodes ``B``
  sequences over distinct contexts, as a batch of chats does. The step's time is the
  engine's mean inter-token latency over the batch (``vllm:inter_token_latency_seconds``,
  engine-core timestamps): the client's
  gaps are not, because an API server starved of CPU by other jobs delivers a stream's
  tokens in bursts. For ``B = 1`` the client's mean gap less the engine's is the API
  server's cost per streamed token.
* ``api_busy``: an API probe (minimal, or a longer cold prompt) sent while
  ``max_num_seqs - 1`` streams of its own (``busy_background``) decode on the same engine:
  the API server then shares its core with a busy engine core, as under load. Its cost is
  measured as an ``api`` probe's; the engine must count only the probe over its window (no
  background stream ends in it), else the probe is kept as an error row.

The phases below follow a session's worker probes: every session's in ``kvroute calibrate
--probe`` (:func:`run_probe`; each row names its session, so their errors span engine
processes as the fitted terms' do), the split of :class:`BracketProbe` around a measurement.

* ``client`` (:func:`client_probe`): batches of single-turn chats
  of a few sizes routed through a kvroute gateway in this process, as ``kvroute measure``
  routes, with the process pinned as it pins it (``engine.client_worker``): the CPU time
  this process spends per request, per prompt token and per streamed token. On the CPU
  build that work runs on a worker's core, beside its engine.

* ``interference`` (:func:`interference_probe`): full batches of
  64-token chats through the same gateway with this process pinned to each worker's core in
  turn: each engine's inter-token latency with the client beside it and with the client on
  the other core, which says how much engine time a second of the client's CPU costs (more
  than the second itself where wake-ups and a shared cache cost the engine too).

* ``neighbour`` (:func:`neighbour_probe`): a full batch on each
  worker in turn, with the other worker idle and with it decoding batches of its own (this
  process pinned to the other worker's core): how much slower an engine runs while its
  neighbour on the same host runs. Every timed probe above ran beside idle neighbours (the
  workers are probed one at a time), so the simulator slows a worker by that much while
  another worker is busy.

* ``refused`` (:func:`refused_probe`): requests each idle worker
  answers without serving them, as vllm-router's cache_aware asks every worker to render
  each request before routing it (vLLM refuses); the CPU of the worker's process tree per
  such request, work that lands on the engine's core.

Every probe (a batch counts as one) waits for the engine's counters to count its
requests before the next is sent, so each histogram change is that probe's own.
The workers of a profile take turns within each repetition (:func:`probe_workers`): one
is probed while the others idle, with this process pinned to another worker's core where
the profile pins them, so the probed engine has its core and the host to itself and the
neighbour and client phases measure what sharing costs. The probes go through
:class:`~kvroute.live.engines.Engines`, so they run under whatever the profile pins.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import aiohttp

from kvroute.live import text
from kvroute.live.canary import canary, engine_cpus
from kvroute.live.engines import EngineError, pinned_process
from kvroute.live.metrics import parse_metrics

#: the histogram sums and counts read around every sequential probe
PROBE_SAMPLES: dict[str, str] = {
    "vllm:time_to_first_token_seconds_sum": "ttft_s",
    "vllm:request_queue_time_seconds_sum": "queue_s",
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_decode_time_seconds_sum": "decode_s",
    "vllm:inter_token_latency_seconds_sum": "itl_s",
    "vllm:inter_token_latency_seconds_count": "itl_tokens",
    "vllm:request_prefill_time_seconds_count": "requests",
}
_WANTED = tuple(f"{name}{{" for name in PROBE_SAMPLES) + tuple(f"{name} " for name in PROBE_SAMPLES)
#: counters, not seconds (left out of a row's ``engine_*_ms``)
COUNTS = ("requests", "itl_tokens")
REQUEST_TIMEOUT_S = 120.0
PHASES = ("api", "prefill", "decode")


@dataclass(frozen=True)
class ProbePlan:
    """What to send each worker; the defaults take about a minute on the ``cpu`` profile.

    Lengths are words of message content (one token each for the tiny model's
    tokenizer; the chat template adds about a dozen).
    """

    api_probes: int = 24
    api_words: int = 4
    prefill_words: tuple[int, ...] = (128, 384, 768, 1152, 1536, 2000, 2500, 3000)
    sessions: int = 2  # times the engines are started afresh (each worker a new engine process)
    repetitions: int = 2  # per session, of every probe kind; the API probes are spread over them
    # untimed repetitions first, per worker and session (sent and dropped): the first stretch
    # of probes after an engine starts, or after a measurement's load, runs slow
    warmup_repetitions: int = 1
    prefill_tokens: int = 4  # tokens out of a prefill probe (only its first token is timed)
    decode_batches: tuple[int, ...] | None = None  # default: 1 .. max_num_seqs
    decode_words: tuple[int, ...] = (128, 2000)
    decode_tokens: int = 40
    decode_suffix_words: int = 8  # each stream's own words after the shared prefix
    busy_probes: int = 8  # API probes sent while the engine decodes (per session; spread over repetitions)
    busy_words: tuple[int, ...] = (4, 1152)  # their lengths, in turn
    busy_tokens: int = 96  # tokens of each background stream: enough to outlast the probe
    # the client phase (after a session's worker probes): batches of single-turn chats through a kvroute gateway
    client_repetitions: int = 3  # times every kind of batch is sent (0: no client phase)
    client_requests: int = 16  # chats per batch
    client_concurrency: int | None = None  # chats in flight (default: every worker's max_num_seqs, a full batch)
    client_kinds: tuple[tuple[int, int], ...] = ((4, 2), (4, 64), (1000, 2))  # (words, tokens out) per batch kind
    # the interference phase (after a session's worker probes): full batches of (words, tokens) chats with the
    # client pinned beside each worker in turn (interference_probe)
    interference_repetitions: int = 4  # batches per placement (0: no interference phase)
    interference_kind: tuple[int, int] = (4, 64)
    # the neighbour phase (after a session's worker probes): a full batch of (words, tokens) chats on each
    # worker with its neighbour idle and busy, in alternating order (neighbour_probe)
    neighbour_repetitions: int = 4  # pairs of batches per worker (0: no neighbour phase)
    neighbour_kind: tuple[int, int] = (128, 64)
    # the refused phase (after a session's worker probes): requests each worker's API server answers without
    # serving them, as vllm-router's cache_aware sends every worker before routing (refused_probe)
    refused_repetitions: int = 4  # batches per worker (0: no refused phase)
    refused_requests: int = 200  # requests per batch (the process CPU clock ticks every 10 ms)

    def __post_init__(self) -> None:
        if self.api_probes < 3 or self.repetitions < 1 or self.sessions < 1 or self.warmup_repetitions < 0:
            raise ValueError("a probe plan needs at least 3 API probes, one session and one repetition "
                             "(and warmup_repetitions >= 0)")
        if self.busy_probes < 0 or self.busy_tokens < 8:
            raise ValueError("a probe plan's busy_probes must be >= 0 and busy_tokens >= 8")
        if self.decode_tokens < 8:
            raise ValueError(f"decode_tokens {self.decode_tokens}: a decode window needs at least 8 tokens")
        if any(n < 1 for n in (*self.prefill_words, *self.decode_words, *self.busy_words, self.api_words)):
            raise ValueError("probe lengths must be positive")
        if self.client_repetitions < 0 or self.client_requests < 1 or any(
                w < 1 or t < 1 for w, t in self.client_kinds):
            raise ValueError("a probe plan's client phase needs client_repetitions >= 0, client_requests >= 1 and "
                             "positive (words, tokens) kinds")
        if self.interference_repetitions < 0 or min(self.interference_kind) < 1 or self.interference_kind[1] < 8:
            raise ValueError("a probe plan's interference phase needs interference_repetitions >= 0 and a "
                             "(words, tokens) kind with at least 8 tokens out")
        if self.neighbour_repetitions < 0 or min(self.neighbour_kind) < 1 or self.neighbour_kind[1] < 8:
            raise ValueError("a probe plan's neighbour phase needs neighbour_repetitions >= 0 and a "
                             "(words, tokens) kind with at least 8 tokens out")
        if self.refused_repetitions < 0 or self.refused_requests < 1:
            raise ValueError("a probe plan's refused phase needs refused_repetitions >= 0 and refused_requests >= 1")

    def batches(self, max_num_seqs: int) -> tuple[int, ...]:
        b = self.decode_batches or tuple(range(1, max_num_seqs + 1))
        if any(not 1 <= x <= max_num_seqs for x in b):
            raise ValueError(f"decode batch sizes {b} must lie in 1..max_num_seqs ({max_num_seqs})")
        return b

    def count(self, max_num_seqs: int) -> int:
        """Requests per worker and session, warm-up included."""
        batches = self.batches(max_num_seqs)
        busy = self.busy_probes * max_num_seqs if max_num_seqs > 1 else 0  # each probe and its background
        return (2 + self.api_probes + 2 * self.repetitions * len(self.prefill_words)
                + self.repetitions * len(self.decode_words) * (sum(batches) + max(batches)) + busy)

    def to_dict(self, max_num_seqs: int) -> dict:
        d = asdict(self)
        d["decode_batches"] = list(self.batches(max_num_seqs))
        d["client_kinds"] = [list(k) for k in self.client_kinds]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


@dataclass
class ProbeRequest:
    """One probe as it ran: what was asked, the client's clock, the engine's counters."""

    worker: str
    phase: str  # warmup | api | prefill | decode_prefix | decode | api_busy | busy_background
    key: str
    words: int
    max_tokens: int
    prefix: str = ""  # key of the shared prefix of ``words`` words (decode); else the prompt is ``key``'s
    suffix_words: int = 0  # words of ``key``'s own after the shared prefix
    batch: int = 1  # concurrent streams it ran among (decode)
    group: int = -1  # the decode batch it belongs to
    rep: int = 0  # the repetition (a block of probes sent in one stretch of time)
    session: int = 0  # which start of the engines it ran on
    warm: bool = False  # a repeat of the previous prompt (prefill)
    sent_s: float = math.nan
    token_s: list[float] = field(default_factory=list)  # arrival of every streamed chunk with content (client clock)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    engine: dict[str, float] = field(default_factory=dict)  # histogram changes over the probe (a batch: on its first)
    error: str = ""

    @property
    def ttft_ms(self) -> float:
        return (self.token_s[0] - self.sent_s) * 1e3 if self.token_s else math.nan

    def row(self) -> dict:
        """A flat row for the observations table (the token times as one JSON list)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("token_s", "engine")}
        d["ttft_ms"] = self.ttft_ms
        d.update({f"engine_{k}_ms": v * 1e3 for k, v in self.engine.items() if k not in COUNTS})
        d.update({f"engine_{k}": v for k, v in self.engine.items() if k in COUNTS})
        d["token_ms"] = json.dumps([round((t - self.sent_s) * 1e3, 3) for t in self.token_s])
        return d

    @classmethod
    def from_row(cls, row: dict) -> ProbeRequest:
        """The request a :meth:`row` came from (times relative to its sending; to the
        microsecond): a saved probe table can be fitted again."""
        names = {f.name for f in fields(cls)} - {"token_s", "engine", "sent_s"}
        kw = {k: row[k] for k in names if k in row}
        for k in ("words", "max_tokens", "batch", "group", "rep", "session", "suffix_words", "prompt_tokens",
                  "cached_tokens", "output_tokens"):
            if k in kw:
                kw[k] = int(kw[k])
        kw["warm"] = str(kw.get("warm")).lower() == "true"
        kw["prefix"] = "" if kw.get("prefix") is None or kw.get("prefix") != kw.get("prefix") else str(kw["prefix"])
        kw["error"] = "" if kw.get("error") is None or kw.get("error") != kw.get("error") else str(kw["error"])
        engine = {}
        for k in PROBE_SAMPLES.values():
            col = f"engine_{k}" if k in COUNTS else f"engine_{k}_ms"
            v = row.get(col)
            if v is not None and v == v:
                engine[k] = float(v) if k in COUNTS else float(v) / 1e3
        return cls(**kw, sent_s=0.0, token_s=[t / 1e3 for t in json.loads(row["token_ms"])], engine=engine)


def _progress_disabled() -> bool:
    return bool(os.environ.get("CI")) or not sys.stderr.isatty()


class _Progress:
    """One line on stderr, rewritten: requests done of all, seconds so far (quiet under CI)."""

    def __init__(self, total: int, label: str = "probe", quiet: bool | None = None) -> None:
        self.total, self.done, self.t0, self.label = total, 0, time.monotonic(), label
        self.quiet = _progress_disabled() if quiet is None else quiet

    def step(self, n: int = 1) -> None:
        self.done += n
        if not self.quiet:
            print(f"\r{self.label}: {self.done}/{self.total} requests, {time.monotonic() - self.t0:.0f} s",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.quiet:
            print(file=sys.stderr, flush=True)


class WorkerProber:
    """Sends one worker's probe schedule (see the module docstring) and keeps every request."""

    def __init__(self, session: aiohttp.ClientSession, name: str, url: str, model: str, plan: ProbePlan,
                 max_num_seqs: int, nonce: str, progress: _Progress, engine_session: int = 0) -> None:
        self.session, self.name, self.url, self.model = session, name, url.rstrip("/"), model
        self.plan, self.max_num_seqs, self.nonce, self.progress = plan, max_num_seqs, nonce, progress
        self.requests: list[ProbeRequest] = []
        self.engine_session = engine_session
        self._groups = 0
        self._cached: set[str] = set()  # decode prefixes cached since the last reset
        self._last: dict[str, float] | None = None  # the counters after the previous probe

    async def run(self) -> list[ProbeRequest]:
        await self.start()
        for rep in range(self.plan.repetitions):
            await self.repetition(rep)
        return self.requests

    async def start(self) -> None:
        """Warm the engine up and empty its prefix cache."""
        for i in range(2):
            await self._sequential(ProbeRequest(self.name, "warmup", self._key("warmup", i), 64, 4))
        await self._reset_cache()

    async def warm_repetition(self, i: int = 0) -> None:
        """A repetition sent and dropped, under keys of its own: on a fresh engine the first
        stretch of prefill probes ran up to 3 times as long as the next, and after a
        measurement the first decode batches 14-37% longer (docs/costmodel.md)."""
        kept, nonce, progress = len(self.requests), self.nonce, self.progress
        self.nonce, self.progress = f"{nonce}-warm{i}", _Progress(0, "", quiet=True)
        try:
            await self.repetition(i % self.plan.repetitions)
        finally:
            self.nonce, self.progress = nonce, progress
            self._last = None
            del self.requests[kept:]

    async def repetition(self, rep: int) -> None:
        """Repetition ``rep``: one stretch of time holding every kind of probe, so a change of
        load during the calibration shows as a difference between repetitions."""
        p = self.plan
        for i in range(rep, p.api_probes, p.repetitions):
            await self._sequential(ProbeRequest(self.name, "api", self._key("api", i), p.api_words, 2, rep=rep))
        # a rotated order per repetition, so a drift in time does not line up with length
        k = rep % len(p.prefill_words)
        for n in p.prefill_words[k:] + p.prefill_words[:k]:
            key = self._key("prefill", f"{rep}:{n}")
            await self._sequential(ProbeRequest(self.name, "prefill", key, n, p.prefill_tokens, rep=rep))
            await self._sequential(ProbeRequest(self.name, "prefill", key, n, p.prefill_tokens, warm=True, rep=rep))
        for n in p.decode_words:
            for b in p.batches(self.max_num_seqs):
                await self._batch(n, b, rep)
        if self.max_num_seqs > 1:
            for i in range(rep, p.busy_probes, p.repetitions):
                await self._busy(i, p.busy_words[i % len(p.busy_words)], rep)

    def _key(self, phase: str, i: object) -> str:
        return f"probe:{self.nonce}:{self.name}:{phase}:{i}"

    async def _reset_cache(self) -> None:
        async with self.session.post(self.url + "/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise EngineError(f"{self.name}: POST /reset_prefix_cache answered {resp.status}")
        self._last = None
        self._cached.clear()

    async def _counters(self) -> dict[str, float]:
        async with self.session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            page = await resp.text()
        # only the wanted samples go through the parser: the whole page is large
        values = parse_metrics("\n".join(line for line in page.splitlines() if line.startswith(_WANTED)), PROBE_SAMPLES)
        missing = [k for k, v in PROBE_SAMPLES.items() if v not in values]
        if missing:
            raise EngineError(f"{self.name}: /metrics has no {', '.join(missing)}; the probe reads vLLM v1's "
                              f"request histograms to tell engine time from API-server time")
        return values

    async def _sequential(self, req: ProbeRequest) -> None:
        await self._together([req])

    async def _together(self, reqs: list[ProbeRequest]) -> None:
        """Send ``reqs`` at once; the engine's histogram changes over them go to the first."""
        before = self._last or await self._counters()
        await asyncio.gather(*(self._send(r) for r in reqs))
        # the histograms are updated as the last output is handled: wait until they count them
        deadline = time.monotonic() + 5.0
        after = await self._counters()
        while after["requests"] < before["requests"] + len(reqs) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            after = await self._counters()
        counted = after["requests"] - before["requests"]
        if counted != len(reqs):
            reqs[0].error = reqs[0].error or f"the engine counted {counted:g} requests, not {len(reqs)}"
        reqs[0].engine = {k: after[k] - before[k] for k in after}
        self._last = after
        for r in reqs:
            self._keep(r)

    async def _batch(self, words: int, b: int, rep: int) -> None:
        """``b`` streams decoding together, stream ``j`` on prefix ``j`` of this repetition and
        length, which one request caches before its first batch (later batches find it cached).

        A prefix of each stream's own, as a chat's history is its own: on the CPU build a batch
        of distinct prefixes took 1.10 times as long a step as one sharing a prefix at 600
        words and 1.35 at 2,000 (``benchmarks/decode_locality.py``: the shared KV stays in the
        core's cache), and a fit to shared prefixes predicted every measured decode 9-18% fast."""
        group = self._groups
        self._groups += 1
        prefixes = [self._key("decode", f"{rep}:{words}:p{j}") for j in range(b)]
        for prefix in prefixes:
            if prefix not in self._cached:
                await self._sequential(ProbeRequest(self.name, "decode_prefix", prefix, words, 1, group=group,
                                                    rep=rep))
                self._cached.add(prefix)
        await self._together([ProbeRequest(self.name, "decode", f"{prefixes[j]}:b{b}", words, self.plan.decode_tokens,
                                           prefix=prefixes[j], suffix_words=self.plan.decode_suffix_words, batch=b,
                                           group=group, rep=rep) for j in range(b)])

    async def _busy(self, i: int, words: int, rep: int) -> None:
        """API probe ``i`` of ``words`` words while ``max_num_seqs - 1`` streams decode."""
        key = self._key("busy", i)
        background = [ProbeRequest(self.name, "busy_background", f"{key}:bg{j}", 32, self.plan.busy_tokens, rep=rep,
                                   batch=self.max_num_seqs) for j in range(self.max_num_seqs - 1)]
        probe = ProbeRequest(self.name, "api_busy", key, words, 2, rep=rep, batch=self.max_num_seqs)
        tasks = [asyncio.create_task(self._send(r)) for r in background]
        try:
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while (not all(r.token_s or r.error for r in background) and time.monotonic() < deadline
                   and not all(t.done() for t in tasks)):
                await asyncio.sleep(0.002)
            if any(r.error or not r.token_s for r in background):
                probe.error = "the background streams did not all start"
                self._keep(probe)
            else:
                # counters read afresh with the background running; a background stream that
                # ends in the probe's window makes the engine count 2, an error row
                self._last = None
                await self._sequential(probe)
        finally:
            await asyncio.gather(*tasks)
        self._last = None  # the background's requests changed the counters since
        for r in background:
            self._keep(r)

    def _keep(self, req: ProbeRequest) -> None:
        req.session = self.engine_session
        self.requests.append(req)
        self.progress.step()

    def _prompt(self, req: ProbeRequest) -> list[dict]:
        content = text.words(req.prefix or req.key, req.words)
        if req.suffix_words:
            content += " " + text.words(req.key, req.suffix_words)
        return [{"role": "user", "content": content}]

    async def _send(self, req: ProbeRequest) -> None:
        body = {"model": self.model, "messages": self._prompt(req), "max_tokens": req.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        # No logprobs: the measured load asks for none, and on the CPU build asking for them
        # made every decode step about 10% longer (docs/costmodel.md). A chunk that carries
        # several tokens (the API server merges them when it falls behind the engine) gets one
        # arrival time; the count comes from the usage chunk.
        data = json.dumps(body).encode()
        req.sent_s = time.perf_counter()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async with self.session.post(self.url + "/v1/chat/completions", data=data,
                                             headers={"Content-Type": "application/json"}) as resp:
                    if resp.status != 200:
                        req.error = f"http {resp.status}: {(await resp.text())[:200]}"
                        return
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                            continue
                        chunk = json.loads(line[5:])
                        for c in chunk.get("choices") or ():
                            if (c.get("delta") or {}).get("content"):
                                req.token_s.append(time.perf_counter())
                        usage = chunk.get("usage")
                        if usage:
                            req.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                            req.output_tokens = int(usage.get("completion_tokens") or 0)
                            req.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            req.error = f"{type(exc).__name__}: {exc}"
        if not req.error and req.output_tokens != req.max_tokens:
            req.error = f"{req.output_tokens} tokens generated, asked for {req.max_tokens}"


async def probe_workers(names: Sequence[str], urls: Sequence[str], model: str, plan: ProbePlan,
                        max_num_seqs: int, nonce: str = "", session: int = 0,
                        cpus: Sequence[Sequence[int]] = ()) -> list[ProbeRequest]:
    """Run one session of ``plan`` on every worker, one worker at a time, the others idle;
    every request, in order per worker.

    Alone, so that the fitted family is an engine beside idle neighbours, which the simulator
    slows by ``neighbour_slowdown`` while a neighbour runs (the neighbour phase measures it).
    The workers take turns within each repetition, in an order rotated per repetition (and
    session), so a drift of the machine's speed is shared between them. Where ``cpus`` gives each worker's
    CPUs, this process (the client) is pinned to the next worker's while one is probed: off
    the probed engine's core, whose client costs ``client_interference`` accounts for.

    Raises:
        EngineError: a worker cannot be reached, or its /metrics lacks the histograms.
    """
    progress = _Progress(plan.count(max_num_seqs) * len(urls), f"probe session {session + 1}/{max(plan.sessions, session + 1)}")
    nonce = nonce or f"{time.time_ns():x}"
    connector = aiohttp.TCPConnector(limit=0)
    n = len(urls)
    cpus = list(cpus) if len(cpus) == n else [()] * n

    def off(i: int):  # this process pinned off worker i's core while it is probed: to the next worker's
        return pinned_process(list(cpus[(i + 1) % n]) if n > 1 else [])

    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
            probers = [WorkerProber(http, name, u, model, plan, max_num_seqs, nonce, progress, session)
                       for name, u in zip(names, urls)]
            for p in probers:
                await p.start()
            for i in range(plan.warmup_repetitions):
                for j, p in enumerate(probers):
                    with off(j):
                        await p.warm_repetition(i)
            for rep in range(plan.repetitions):
                turn = session * plan.repetitions + rep  # rotated across sessions too
                for i in [(turn + j) % n for j in range(n)]:
                    with off(i):
                        await probers[i].repetition(rep)
    except aiohttp.ClientError as exc:
        raise EngineError(f"probe: an engine could not be reached: {exc}") from exc
    finally:
        progress.close()
    return [r for p in probers for r in p.requests]


#: the client phase's gateway policy: both workers serve, as under the spreading policies
CLIENT_POLICY = "round_robin"


def client_probe(engines, hw, plan: ProbePlan, nonce: str = "") -> list[dict]:
    """The client phase: the CPU this process spends per request and per token as a kvroute
    gateway and the load generator (one process, as ``kvroute measure`` runs them) route
    and stream requests of its own to ``engines``.

    ``plan.client_repetitions`` times, a batch of each ``plan.client_kinds`` (words in, tokens
    out): ``plan.client_requests`` single-turn chats of that size, closed loop,
    ``plan.client_concurrency`` at a time (default ``max_num_seqs`` per worker: the streams
    arrive together as under load, when the client often reads several tokens at once),
    through a round-robin gateway. A row per batch: its requests, prompt and
    output tokens (as the engines reported them), errors, wall seconds and ``cpu_ms``, this
    process's CPU time over the replay alone (:attr:`~kvroute.live.loadgen.LoadResult.cpu_s`).
    :func:`kvroute.probefit.client_costs` fits the per-request, per-prompt-token and
    per-streamed-token costs to them.
    """
    from kvroute.live.measure import gateway_load

    nonce = nonce or f"{time.time_ns():x}"
    concurrency = plan.client_concurrency or len(engines.urls) * hw.engine.max_num_seqs
    rows: list[dict] = []
    for rep in range(plan.client_repetitions):
        for kind, (words, tokens) in enumerate(plan.client_kinds):
            trace = single_turn_chats(f"probe-client:{nonce}:{rep}:{kind}", plan.client_requests, words, tokens,
                                      concurrency)
            result = asyncio.run(gateway_load(engines, hw, trace, CLIENT_POLICY, seed=0, redis_url=None,
                                              progress_every_s=None))
            ok = [r for r in result.rows if r["status"] == "ok"]
            rows.append({"rep": rep, "words": words, "max_tokens": tokens, "requests": len(result.rows),
                         "prompt_tokens": sum(int(r["prompt_tokens"] or 0) for r in ok),
                         "output_tokens": sum(int(r["output_tokens"] or 0) for r in ok),
                         "errors": len(result.rows) - len(ok), "wall_s": round(result.wall_s, 3),
                         "cpu_ms": round(result.cpu_s * 1e3, 2)})
    return rows


def engine_itl(url: str) -> tuple[float, float]:
    """(seconds, tokens) of an engine's inter-token latency histogram so far (engine-core clock)."""
    import urllib.request

    wanted = {k: v for k, v in PROBE_SAMPLES.items() if v in ("itl_s", "itl_tokens")}
    page = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
    v = parse_metrics("\n".join(line for line in page.splitlines() if line.startswith(tuple(wanted))), wanted)
    if len(v) < len(wanted):
        raise EngineError(f"{url}: /metrics has no vllm:inter_token_latency_seconds histogram")
    return v["itl_s"], v["itl_tokens"]


def itl_between(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The mean inter-token latency (ms) between two :func:`engine_itl` readings; None when
    no token was streamed between them."""
    return round(1e3 * (after[0] - before[0]) / (after[1] - before[1]), 4) if after[1] > before[1] else None


def single_turn_chats(tag: str, n: int, words: int, tokens: int, concurrency: int):
    """A closed-loop trace of ``n`` single-turn chats of ``words`` words in and ``tokens``
    out, each named by ``tag`` (no two probes share a prompt), ``concurrency`` at a time."""
    from kvroute.workload.trace import Conversation, Trace, Turn

    convs = tuple(Conversation(f"{tag}:{i}", "", 0, (Turn(words, tokens),)) for i in range(n))
    return Trace(tag.split(":", 1)[0], "closed", convs, concurrency=concurrency)


def interference_probe(engines, hw, plan: ProbePlan, placements: dict[str, list[int]] | None = None,
                       nonce: str = "") -> list[dict]:
    """The interference phase: how much engine time the client's CPU costs the engine beside it.

    ``plan.interference_repetitions`` times, for each placement of this process (default:
    pinned to each worker's CPUs in turn, ``"w0"``, ``"w1"``, ...), ``plan.client_requests``
    single-turn chats of ``plan.interference_kind`` (words in, tokens out) through a
    round-robin kvroute gateway, a full batch on every engine at once. A row per batch:
    the placement, each engine's mean inter-token latency over it (``itl_ms``, from its
    /metrics histogram: engine-core timestamps), this process's CPU and wall seconds and
    failed requests. :func:`kvroute.probefit.client_interference` compares each engine
    with the client beside it against itself with the client on another core.
    """
    from kvroute.live.measure import gateway_load

    nonce = nonce or f"{time.time_ns():x}"
    if placements is None:
        placements = {name: list(spec.cpus) for name, spec in zip(engines.names, engines.specs)}
    concurrency = plan.client_concurrency or len(engines.urls) * hw.engine.max_num_seqs
    words, tokens = plan.interference_kind
    rows: list[dict] = []
    for rep in range(plan.interference_repetitions):
        for where, cpus in placements.items():
            trace = single_turn_chats(f"probe-interference:{nonce}:{rep}:{where}", plan.client_requests, words,
                                      tokens, concurrency)
            with pinned_process(cpus):
                before = [engine_itl(u) for u in engines.urls]
                result = asyncio.run(gateway_load(engines, hw, trace, CLIENT_POLICY, seed=0, redis_url=None,
                                                  progress_every_s=None))
                after = [engine_itl(u) for u in engines.urls]
            itl = [itl_between(b, a) for b, a in zip(before, after)]
            rows.append({"rep": rep, "client": where, "itl_ms": itl, "cpu_s": round(result.cpu_s, 4),
                         "wall_s": round(result.wall_s, 4),
                         "errors": sum(1 for r in result.rows if r["status"] != "ok")})
    return rows


def neighbour_probe(engines, hw, plan: ProbePlan, nonce: str = "") -> list[dict]:
    """The neighbour phase: how much slower an engine runs while another engine of the host runs.

    ``plan.neighbour_repetitions`` times, for each worker in turn and with this process
    pinned to another worker's CPUs (the client off the measured core): a full batch
    (``max_num_seqs`` chats of ``plan.neighbour_kind``, words in and tokens out, sent
    straight to the engine) with every other worker idle, and one while every other worker
    decodes full batches of its own, back to back; the order alternates between repetitions
    (against drift). A row per batch: worker, ``neighbour_busy``, the worker's mean
    inter-token latency over it (``itl_ms``, its /metrics histogram) and failed requests.
    :func:`kvroute.probefit.neighbour_slowdown` takes the ratio busy / idle.
    """
    from kvroute.live.engines import served_model_name
    from kvroute.live.loadgen import run_load

    nonce = nonce or f"{time.time_ns():x}"
    words, tokens = plan.neighbour_kind
    size = hw.engine.max_num_seqs
    model = served_model_name(hw)

    def trace(tag: str):
        return single_turn_chats(f"probe-neighbour:{nonce}:{tag}", size, words, tokens, size)

    async def one(e: int, busy: bool, tag: str) -> dict:
        stop = asyncio.Event()

        async def neighbours(j: int) -> None:
            k = 0
            while not stop.is_set():
                await run_load(trace(f"{tag}:n{j}:{k}"), engines.urls[j], model=model, progress_every_s=None)
                k += 1

        others = [asyncio.create_task(neighbours(j)) for j in range(len(engines.urls)) if j != e] if busy else []
        if others:
            await asyncio.sleep(0.3)  # the neighbours in their decode steps before the batch starts
        before = await asyncio.to_thread(engine_itl, engines.urls[e])
        result = await run_load(trace(tag), engines.urls[e], model=model, progress_every_s=None)
        after = await asyncio.to_thread(engine_itl, engines.urls[e])
        stop.set()
        await asyncio.gather(*others)
        return {"worker": engines.names[e], "neighbour_busy": busy, "itl_ms": itl_between(before, after),
                "errors": sum(1 for r in result.rows if r["status"] != "ok")}

    rows: list[dict] = []
    for rep in range(plan.neighbour_repetitions):
        for e in range(len(engines.urls)):
            other = engines.specs[(e + 1) % len(engines.specs)]
            with pinned_process(list(other.cpus)):
                for busy in ((False, True) if rep % 2 == 0 else (True, False)):
                    rows.append({"rep": rep} | asyncio.run(one(e, busy, f"{rep}:{e}:{int(busy)}")))
    return rows


#: what vllm-router's cache_aware asks every worker before it routes a request (its render
#: step); plain vLLM refuses it (403) unless started with --enable-scale-out (docs/live.md)
REFUSED_PATH = "/v1/chat/completions/render"


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and every live descendant."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def refused_probe(engines, model: str, plan: ProbePlan, words: int = 150) -> list[dict]:
    """The refused phase: the CPU a worker spends answering a request it does not serve.

    vllm-router's cache_aware posts every request to every worker's
    ``/v1/chat/completions/render`` before routing it; vLLM refuses (403) without
    ``--enable-scale-out``, yet each refusal is work on that worker's core, where its engine
    runs. Per repetition and worker (idle), ``plan.refused_requests`` such posts one after
    another (a chat of ``words`` words, as the router forwards the request); a row with the
    HTTP statuses, wall seconds and ``cpu_ms``, the CPU time of the worker's whole process
    tree over the batch. :func:`kvroute.probefit.refused_cost` takes the mean per request.
    """
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": " ".join(["probe"] * words)}],
                       "max_tokens": 8, "stream": True}).encode()

    def post(url: str) -> int:
        req = urllib.request.Request(url + REFUSED_PATH, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
                return r.status
        except urllib.error.HTTPError as e:
            e.read()
            return e.code
        except OSError:
            return 0

    rows = []
    for rep in range(plan.refused_repetitions):
        for name, url, pid in zip(engines.names, engines.urls, engines.pids):
            post(url)  # the connection and the route's first call
            c0, t0 = _tree_cpu_s(pid), time.perf_counter()
            codes = [post(url) for _ in range(plan.refused_requests)]
            c1, t1 = _tree_cpu_s(pid), time.perf_counter()
            rows.append({"worker": name, "rep": rep, "calls": len(codes),
                         "statuses": {str(c): codes.count(c) for c in sorted(set(codes))},
                         "errors": sum(1 for c in codes if c == 0 or c >= 500),
                         "wall_s": round(t1 - t0, 4), "cpu_ms": round((c1 - c0) * 1e3, 3)})
    return rows


#: the phases that follow a probe session's worker probes, in the order they run (:func:`probe_phases`)
PHASES = ("refused", "client", "interference", "neighbour")


def probe_phases(eng, hw, plan: ProbePlan, phases: Sequence[str] = PHASES, session: int = 0) -> dict:
    """Run ``phases`` of ``plan`` (those of :data:`PHASES` it asks for and ``hw`` allows) on the
    running engines ``eng``; their rows, keyed by phase and each marked with ``session``
    (``client_cpus`` too, with ``client``)."""
    from kvroute.live.engines import served_model_name

    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ValueError(f"unknown probe phases {unknown}; known: {', '.join(PHASES)}")
    facts: dict = {}
    client = eng.client_cpus(hw)
    for phase in (p for p in PHASES if p in phases):
        if phase == "refused" and plan.refused_repetitions:
            facts["refused"] = refused_probe(eng, served_model_name(hw), plan)
        elif phase == "client" and plan.client_repetitions:
            # pinned as kvroute measure pins its client (engine.client_worker), on fresh caches
            eng.reset_prefix_cache()
            with pinned_process(client) as cpus:
                facts["client_cpus"] = cpus
                facts["client"] = client_probe(eng, hw, plan)
        elif (phase == "interference" and plan.interference_repetitions and hw.engine.client_worker is not None
              and client):
            eng.reset_prefix_cache()
            facts["interference"] = interference_probe(eng, hw, plan)
        elif phase == "neighbour" and plan.neighbour_repetitions and len(eng.urls) > 1 and client:
            eng.reset_prefix_cache()
            facts["neighbour"] = neighbour_probe(eng, hw, plan)
    eng.reset_prefix_cache()
    for phase in PHASES:
        for row in facts.get(phase, ()):
            row["session"] = session
    return facts


def merge_phases(facts: dict, phases: dict) -> dict:
    """``facts`` with one session's :func:`probe_phases` added: a phase's rows after the
    earlier sessions' (each row names its session), anything else replaced."""
    for k, v in phases.items():
        facts[k] = [*facts.get(k, ()), *v] if k in PHASES else v
    return facts


def probe_session(eng, hw, plan: ProbePlan, session: int, phases: Sequence[str] = ()) -> tuple[list[ProbeRequest], dict]:
    """One session of ``plan`` on the running engines ``eng`` (every worker, one at a time,
    :func:`probe_workers`), then ``phases``; its requests and the phases' rows."""
    from kvroute.live.engines import served_model_name

    requests = asyncio.run(probe_workers(eng.names, eng.urls, served_model_name(hw), plan, hw.engine.max_num_seqs,
                                         session=session, cpus=[s.cpus for s in eng.specs]))
    return requests, probe_phases(eng, hw, plan, phases, session)


def run_probe(hw, run_dir, plan: ProbePlan | None = None, *, kind: str | None = None,
              model_dir=None, python: str | None = None) -> tuple[list[ProbeRequest], dict]:
    """Start ``hw``'s engines (only ours, on 127.0.0.1), probe them with ``plan``, stop them;
    ``plan.sessions`` times, each in a folder of ``run_dir``, so that every worker is several
    engine processes (what differs between processes differs between calibrations too).
    Every session ends with every phase (:data:`PHASES`), so that the phases' coefficients,
    like the fitted ones, state errors over engine processes, not one session's alone.

    Returns every probe request and the facts of the run (start-up and probe seconds per
    session, the machine's load average before and after: the cores may be shared).
    """
    from pathlib import Path

    from kvroute.live.engines import running_engines

    plan = plan or ProbePlan()
    kind = kind or hw.engine.kind
    if kind == "emulator":
        raise EngineError("the probe calibrates real engines; the emulator runs the simulator's own step times")
    facts: dict = {"load_average_before": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count(),
                   "startup_s": [], "probe_s": []}
    requests: list[ProbeRequest] = []
    for session in range(plan.sessions):
        t0 = time.monotonic()
        with running_engines(hw, run_dir=Path(run_dir) / f"session{session}", kind=kind, host="127.0.0.1",
                             model_dir=model_dir, python=python) as eng:
            t1 = time.monotonic()
            rows, phases = probe_session(eng, hw, plan, session, PHASES)
            requests += rows
            merge_phases(facts, phases)
            t2 = time.monotonic()
        facts["startup_s"].append(round(t1 - t0, 1))
        facts["probe_s"].append(round(t2 - t1, 1))
    facts["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return requests, facts


class BracketProbe:
    """The probe split around measurements, on the engines they measure: a session (every
    worker alone, then the refused and client phases) before the first measurement, one
    (then the interference and neighbour phases) after the last, and, between two
    measurements of one engine session, one with every phase, which closes the first's
    bracket and opens the next's. So the fit of each measurement is of the very engine
    processes it ran, at the machine's speed on either side of it.

    ``kvroute measure --probe OUT`` runs it (:func:`kvroute.live.measure.measure_experiments`):
    call :meth:`after` once after each of ``measurements`` measurements; :meth:`bracket`
    is measurement i's probe (sessions i and i + 1). The measurements' records are never
    its inputs: it sees only its own requests.
    """

    BEFORE = ("refused", "client")
    AFTER = ("interference", "neighbour")

    def __init__(self, hw, plan: ProbePlan | None = None, measurements: int = 1) -> None:
        self.hw = hw
        self.plan = plan or ProbePlan()
        if self.plan.sessions != 2:
            raise ValueError(f"a bracketing probe runs 2 sessions (before and after), not {self.plan.sessions}")
        if measurements < 1:
            raise ValueError(f"a bracketing probe brackets at least one measurement, not {measurements}")
        self.measurements = measurements
        # per session run: its requests, its phases' rows, and when and how long it ran
        self._sessions: list[tuple[list[ProbeRequest], dict, dict]] = []

    def phases(self, session: int) -> tuple[str, ...]:
        """Session ``session``'s phases: BEFORE first, AFTER last, both between measurements."""
        if session == 0:
            return self.BEFORE
        return self.AFTER if session == self.measurements else self.AFTER + self.BEFORE

    def _session(self, eng) -> None:
        k = len(self._sessions)
        if k > self.measurements:
            raise RuntimeError(f"the probe of {self.measurements} measurement(s) has run all its {k} sessions")
        meta = {"load_average_before": [round(x, 2) for x in os.getloadavg()]}
        meta["canary"] = [r | {"session": k, "when": "start"} for r in canary(engine_cpus(eng))]
        t0 = time.monotonic()
        rows, facts = probe_session(eng, self.hw, self.plan, k, self.phases(k))
        meta["probe_s"] = round(time.monotonic() - t0, 1)
        meta["canary"] += [r | {"session": k, "when": "end"} for r in canary(engine_cpus(eng))]
        meta["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        self._sessions.append((rows, facts, meta))

    def before(self, eng) -> None:
        """The session before the first measurement."""
        if self._sessions:
            raise RuntimeError("the probe's first session has run already")
        self._session(eng)

    def after(self, eng) -> None:
        """The session after the latest measurement (the next one's before, if any)."""
        if not self._sessions:
            raise RuntimeError("the probe's session after a measurement needs the one before it")
        self._session(eng)

    def bracket(self, i: int = 0) -> tuple[list[ProbeRequest], dict]:
        """Measurement ``i``'s probe requests and facts: sessions i (before it) and i + 1
        (after it), each row marked with its session."""
        if not 0 <= i < len(self._sessions) - 1:
            raise ValueError(f"measurement {i} has no closed bracket ({len(self._sessions)} sessions have run)")
        (rows0, f0, m0), (rows1, f1, m1) = self._sessions[i], self._sessions[i + 1]
        shared = f"; session {i} also closed measurement {i - 1}'s" if i else ""
        shared += f"; session {i + 1} also opens measurement {i + 1}'s" if i + 1 < self.measurements else ""
        facts: dict = {"load_average_before": m0["load_average_before"], "cores": os.cpu_count(),
                       "probe_s": [m0["probe_s"], m1["probe_s"]], "sessions": [i, i + 1],
                       "bracket": f"session {i} before the measurement, session {i + 1} after it, on the same "
                                  f"engines{shared}"}
        merge_phases(facts, f0)
        merge_phases(facts, f1)
        facts["load_average_after"] = m1["load_average_after"]
        facts["canary"] = m0["canary"] + m1["canary"]  # kvroute.live.canary: the machine's speed as probed
        return rows0 + rows1, facts

    @property
    def requests(self) -> list[ProbeRequest]:
        """The first measurement's probe requests (:meth:`bracket`)."""
        return self.bracket(0)[0]

    @property
    def facts(self) -> dict:
        """The first measurement's probe facts (:meth:`bracket`)."""
        return self.bracket(0)[1]


def write_probed(path, requests: Sequence[ProbeRequest], probed: dict) -> None:
    """``requests`` (their :meth:`~ProbeRequest.row`) and ``probed`` (the plan and the run's
    facts) to ``path``, atomically, as JSON: what `kvroute calibrate --probe --probed PATH`
    fits, with no engine running."""
    from pathlib import Path

    from kvroute.records import write_atomic

    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v

    rows = [{k: clean(v) for k, v in r.row().items()} for r in requests]
    text = json.dumps({"probed": probed, "requests": rows}, indent=None, allow_nan=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), lambda tmp: Path(tmp).write_text(text + "\n"))


def read_probed(path) -> tuple[list[ProbeRequest], dict]:
    """What :func:`write_probed` wrote: the requests and the ``probed`` facts.

    Raises:
        ValueError: ``path`` is not such a file (the message names what is missing).
    """
    from pathlib import Path

    try:
        d = json.loads(Path(path).read_text())
        return [ProbeRequest.from_row(r) for r in d["requests"]], dict(d["probed"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a probe file of `kvroute measure --probe` ({type(exc).__name__}: {exc})") from exc
