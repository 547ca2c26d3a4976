"""The gateway's :class:`~kvroute.policies.base.ClusterView`, filled from its own counters.

The gateway sees only HTTP: which worker it sent each request to, when the first byte
and the last byte came back, and the request text. From that it keeps per worker:

* ``in_flight``: routed and not finished (the response not fully relayed).
* ``waiting``: in flight with no byte of the response yet. A streamed reply's first
  byte is its first token, so the gateway counts a request as running from then on
  (it does not scrape the engines' ``num_requests_running``). A non-streamed request
  counts as waiting until its whole reply arrives.
* ``active_blocks``: sum over in-flight requests of ``ceil((prompt + output so far) /
  block_size)``, with output tokens counted as streamed SSE events (``data:`` lines).
* ``kv_usage``: the same in-flight tokens over the engines' KV cache,
  ``kv_capacity_blocks * kv_block_size`` tokens, at most 1 (0 without a capacity). Unlike
  the engine's count, a prefix that several requests share counts once per request.
* ``queue_delay_s``: ``prefill_s_per_token * (uncached prompt tokens of the waiting
  requests) + decode_s_per_running * (running requests) + slot wait``. The first term
  is the prefill still queued ahead of a new request, "uncached" meaning prompt minus
  what the approximate index matched when the request was routed; the second is the
  decode share: every running request adds a decode token to each step that the
  queued prefill shares. The slot wait counts when the engine's batch is full
  (``max_num_seqs``, when given): a new request then waits for running ones to
  finish, ``ceil((in_flight + 1 - max_num_seqs) / max_num_seqs)`` replies of the
  worker's mean length so far (output tokens of its finished requests) at
  ``decode_step_s`` a token. Without that term a full batch looks free to a request
  whose prompt is cached, and cost-aware routing piles every chat onto one worker.
* ``matched_tokens``: leading chunks of the request's text found in the worker's
  :class:`~kvroute.kvcache.index.ApproxPrefixIndex` (what the gateway sent there
  within the TTL), times ``block_size`` tokens, capped at the prompt's estimate.
* ``index_size``: chunks in that index; ``prefill_time_s``: ``tokens *
  prefill_s_per_token``; ``session_worker``: the session table's memory.

``exact`` is False: matches come from routing history, not from the engines. With an
:class:`~kvroute.live.kv_events.ExactPrefixIndex` (the gateway's ``--kv-events``),
``exact`` is True: ``matched_tokens`` is the leading blocks of the request's *token*
hashes that the engine's KV events say it caches, at most ``(prompt - 1) // block_size``
of them (vLLM always computes the last prompt token), times ``block_size``, the engines'
KV block; ``index_size`` is that worker's cached blocks; the approximate index is not kept.
The view is mutated only by the gateway between decisions (single event loop), so a
policy always reads a consistent snapshot during ``choose``.

Load signal (``load_signal``, :mod:`kvroute.loadsignal`): the counters above are
``router``, the default. With ``scraped``, the gateway GETs each worker's /metrics every
``interval_ms`` and hands the gauges to :meth:`GatewayView.apply_scrape`; until the next
scrape ``in_flight`` is ``num_requests_running + num_requests_waiting``, ``waiting`` is
``num_requests_waiting``, ``active_blocks`` is ``kv_cache_usage_perc`` times
``kv_capacity_blocks`` (the engines' KV blocks; without it, the gateway's own count) and
``kv_usage`` is ``kv_cache_usage_perc`` itself (before the first scrape, the count above).
``queue_delay_s`` is the formula above over the scraped counts, the waiting requests'
uncached tokens taken as ``num_requests_waiting`` times the mean uncached prompt of the
requests routed to the worker (the gauges carry no token counts). Before a worker's
first scrape its load reads 0. With ``events``, load stays the gateway's counters; only
the KV events reach the exact index ``delay_ms`` late (:class:`KVEventSubscriber`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvroute.kvcache.index import ApproxPrefixIndex
from kvroute.live.kv_events import ExactPrefixIndex
from kvroute.loadsignal import DEFAULT_DECODE_S_PER_RUNNING, DEFAULT_PREFILL_S_PER_TOKEN, ROUTER, DelayModel, LoadSignal
from kvroute.policies.base import RouteRequest



@dataclass(slots=True)
class WorkerState:
    """Counters of one worker, as the gateway sees it."""

    name: str
    url: str
    up: bool = True
    in_flight: int = 0
    running: int = 0  # in flight with a first byte back
    waiting_uncached_tokens: int = 0  # uncached prompt tokens of in-flight, not yet running
    active_blocks: int = 0
    active_tokens: int = 0  # prompt + output so far of the in-flight requests (kv_usage)
    routed: int = 0  # requests routed here since start
    finished: int = 0  # requests over, and their output tokens (the mean reply length)
    output_tokens: int = 0
    uncached_routed: int = 0  # uncached prompt tokens of every request routed here (their mean)
    down_since: float | None = None
    # the last scrape of the worker's /metrics (load_signal scraped)
    scraped_running: int = 0
    scraped_waiting: int = 0
    scraped_kv_usage: float | None = None
    scraped_at: float | None = None  # clock time of the last successful scrape
    scrapes: int = 0
    scrape_errors: int = 0


@dataclass(slots=True)
class Flight:
    """One routed request, from decision to the last byte relayed."""

    worker: WorkerState
    prompt_tokens: int
    uncached_tokens: int
    tokens: int  # prompt + output tokens seen so far
    blocks: int
    running: bool = False
    done: bool = False
    output_tokens: int = 0
    block_hashes: Sequence[int] | None = None  # recorded in the index when it finishes (index_on_finish)


class GatewayView:
    """ClusterView over the gateway's counters and approximate prefix index.

    Args:
        workers: ``(name, url)`` pairs in a fixed order.
        block_size: tokens per index block (the prefix hasher's ``block_tokens``).
        session_lookup: memory-only session lookup (``SessionStore.peek``).
        prefill_s_per_token: per-token prefill estimate (s).
        decode_s_per_running: queue-delay share of one running request (s).
        max_num_seqs: the engines' batch cap (``None``: no slot wait is estimated).
        decode_step_s: one decode step with a full batch (s), for the slot wait.
        index_ttl_s: the approximate index's TTL (Dynamo's approximate indexer: 120 s).
        index_capacity_blocks: per-worker bound of the index (``None``: TTL only).
        clock: monotonic seconds.
        exact_index: the engines' KV-event index; makes the view exact (``block_size``
            is then the index's, the engines' KV block).
        load_signal: where load comes from (module docstring); with ``scraped`` the
            gateway calls :meth:`apply_scrape`.
        kv_capacity_blocks: the engines' KV cache in blocks, to turn a scraped
            ``kv_cache_usage_perc`` into ``active_blocks``, and the gateway's own token
            count into ``kv_usage``.
        kv_block_size: the engines' KV block in tokens, for that ``kv_usage`` (default:
            the view's ``block_size``).
    """

    exact = False

    def __init__(
        self,
        workers: Iterable[tuple[str, str]],
        block_size: int,
        session_lookup: Callable[[str], str | None] = lambda _sid: None,
        *,
        prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
        decode_s_per_running: float = DEFAULT_DECODE_S_PER_RUNNING,
        max_num_seqs: int | None = None,
        decode_step_s: float = 0.0,
        index_ttl_s: float = 120.0,
        index_capacity_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        exact_index: ExactPrefixIndex | None = None,
        load_signal: LoadSignal = ROUTER,
        kv_capacity_blocks: int | None = None,
        kv_block_size: int | None = None,
    ) -> None:
        self.state: dict[str, WorkerState] = {}
        for name, url in workers:
            if name in self.state:
                raise ValueError(f"worker name {name!r} given twice")
            self.state[name] = WorkerState(name, url)
        if not self.state:
            raise ValueError("the gateway needs at least one worker")
        self._workers = tuple(self.state)
        self.block_size = block_size
        self.delays = DelayModel(prefill_s_per_token, decode_s_per_running, max_num_seqs, decode_step_s)
        self.index = ApproxPrefixIndex(self._workers, block_size, index_capacity_blocks, index_ttl_s)
        self.exact_index = exact_index
        #: the policy's ``index_on_finish``: the approximate index learns a decision when
        #: its request finishes, not when it is routed (set by the gateway)
        self.record_on_finish = False
        if exact_index is not None:
            missing = set(self._workers) - set(exact_index.workers)
            if missing:
                raise ValueError(f"the KV-event index lacks workers {sorted(missing)}")
            self.exact = True  # the instance's truth; the class says approximate
            self.block_size = exact_index.block_size
        self.load_signal = load_signal
        self.scraped = load_signal.source == "scraped"
        self.kv_capacity_blocks = kv_capacity_blocks
        self.kv_block_size = kv_block_size or self.block_size
        self.session_lookup = session_lookup
        self.clock = clock
        self.now = clock()  # the decision time the index is read at; set by `snapshot`
        # matches of the request being decided, per worker (a policy asks for each
        # worker, the gateway again for the chosen one); emptied by snapshot and record
        self._match_request: RouteRequest | None = None
        self._matches: dict[str, int] = {}

    # -- the ClusterView protocol --------------------------------------------------
    @property
    def workers(self) -> Sequence[str]:
        return self._workers

    def is_up(self, worker: str) -> bool:
        return self.state[worker].up

    def in_flight(self, worker: str) -> int:
        s = self.state[worker]
        if self.scraped:
            return s.scraped_running + s.scraped_waiting
        return s.in_flight

    def waiting(self, worker: str) -> int:
        s = self.state[worker]
        if self.scraped:
            return s.scraped_waiting
        return s.in_flight - s.running

    def active_blocks(self, worker: str) -> int:
        s = self.state[worker]
        if self.scraped and s.scraped_kv_usage is not None and self.kv_capacity_blocks:
            return round(s.scraped_kv_usage * self.kv_capacity_blocks)
        return s.active_blocks

    def kv_usage(self, worker: str) -> float:
        s = self.state[worker]
        if self.scraped and s.scraped_kv_usage is not None:
            return min(1.0, max(0.0, s.scraped_kv_usage))
        if not self.kv_capacity_blocks:
            return 0.0  # no capacity to divide by: every worker reads empty
        return min(1.0, s.active_tokens / (self.kv_capacity_blocks * self.kv_block_size))

    def queue_delay_s(self, worker: str) -> float:
        s = self.state[worker]
        if self.scraped:
            return self.delays.scraped_queue_delay_s(s.scraped_running, s.scraped_waiting, s.routed, s.uncached_routed,
                                                     s.finished, s.output_tokens)
        return self.delays.queue_delay_s(s.waiting_uncached_tokens, s.running, s.in_flight, s.finished, s.output_tokens)

    def matched_tokens(self, worker: str, request: RouteRequest) -> int:
        if request is self._match_request:
            n = self._matches.get(worker)
            if n is not None:
                return n
        else:
            self._match_request = request
            self._matches = {}
        ex = self.exact_index
        if ex is not None:
            blocks = min(ex.match(worker, request.block_hashes), (request.prompt_tokens - 1) // self.block_size)
            n = self._matches[worker] = max(0, blocks) * self.block_size
            return n
        n = self._matches[worker] = min(
            self.index.match(worker, request.block_hashes, self.now) * self.block_size,
            request.prompt_tokens,
        )
        return n

    def index_size(self, worker: str) -> int:
        if self.exact_index is not None:
            return self.exact_index.size(worker)
        return self.index.size(worker)

    def prefill_time_s(self, worker: str, tokens: int) -> float:
        return self.delays.prefill_time_s(tokens)

    def session_worker(self, session_id: str) -> str | None:
        return self.session_lookup(session_id)

    # -- bookkeeping (the gateway only) ----------------------------------------------
    def snapshot(self) -> None:
        """Fix the time the next decision reads the index at (call before ``choose``)."""
        self.now = self.clock()
        self._match_request = None

    def record(self, worker: str, request: RouteRequest) -> None:
        """Record a decision in the approximate index (at the decision's time); the exact
        view learns from the engines instead."""
        self._match_request = None
        if self.exact_index is None and not self.record_on_finish:
            self.index.record(worker, request.block_hashes, self.now)

    def apply_scrape(self, worker: str, gauges: dict[str, float]) -> None:
        """Take a worker's load from one scrape of its /metrics (``metrics.parse_load``);
        a gauge the page lacks keeps its last value."""
        s = self.state[worker]
        s.scraped_running = int(gauges.get("num_requests_running", s.scraped_running))
        s.scraped_waiting = int(gauges.get("num_requests_waiting", s.scraped_waiting))
        s.scraped_kv_usage = gauges.get("kv_cache_usage_perc", s.scraped_kv_usage)
        s.scraped_at = self.clock()
        s.scrapes += 1

    def begin(self, worker: str, request: RouteRequest, matched_tokens: int) -> Flight:
        """Count a request routed to ``worker``; returns its :class:`Flight`."""
        s = self.state[worker]
        uncached = max(0, request.prompt_tokens - matched_tokens)
        tokens = request.prompt_tokens
        blocks = -(-tokens // self.block_size)
        s.in_flight += 1
        s.routed += 1
        s.uncached_routed += uncached
        s.waiting_uncached_tokens += uncached
        s.active_blocks += blocks
        s.active_tokens += tokens
        later = request.block_hashes if self.record_on_finish and self.exact_index is None else None
        return Flight(s, request.prompt_tokens, uncached, tokens, blocks, block_hashes=later)

    def first_byte(self, f: Flight) -> None:
        """The worker started answering: the request is running (prefill done)."""
        if not f.running and not f.done:
            f.running = True
            f.worker.running += 1
            f.worker.waiting_uncached_tokens -= f.uncached_tokens

    def add_output(self, f: Flight, tokens: int) -> None:
        """``tokens`` more output tokens streamed back: grow the request's blocks."""
        if f.done or tokens <= 0:
            return
        f.output_tokens += tokens
        f.tokens += tokens
        f.worker.active_tokens += tokens
        blocks = -(-f.tokens // self.block_size)
        if blocks != f.blocks:
            f.worker.active_blocks += blocks - f.blocks
            f.blocks = blocks

    def finish(self, f: Flight) -> None:
        """The request is over (ok, error or cancelled); idempotent."""
        if f.done:
            return
        f.done = True
        s = f.worker
        if f.block_hashes is not None:
            self.index.record(s.name, f.block_hashes, self.clock())
        s.in_flight -= 1
        s.finished += 1
        s.output_tokens += f.output_tokens
        s.active_blocks -= f.blocks
        s.active_tokens -= f.tokens
        if f.running:
            s.running -= 1
        else:
            s.waiting_uncached_tokens -= f.uncached_tokens

    def mark_down(self, worker: str) -> bool:
        """Mark a worker down (refused connections); True if it was up.

        Its approximate index is emptied: a worker that went away lost its cache
        (or is about to be restarted with an empty one).
        """
        s = self.state[worker]
        if not s.up:
            return False
        s.up = False
        s.down_since = self.clock()
        self.index.remove_worker(worker)
        self.index.add_worker(worker)
        self._match_request = None
        return True

    def mark_up(self, worker: str) -> bool:
        """Mark a worker up again (its health probe answered); True if it was down."""
        s = self.state[worker]
        if s.up:
            return False
        s.up = True
        s.down_since = None
        return True


class ExcludingView:
    """``view`` with some workers reported down: picks a retry's other worker."""

    def __init__(self, view: GatewayView, excluded: Iterable[str]) -> None:
        self._view = view
        self._excluded = frozenset(excluded)

    def is_up(self, worker: str) -> bool:
        return worker not in self._excluded and self._view.is_up(worker)

    def __getattr__(self, name: str):
        return getattr(self._view, name)
