"""The simulated cluster: SimPy processes around the engines, the router and the clients.

::

    client ──turn──► Router.route ──(API-server overhead)──► Engine.waiting
       ▲              policy.choose(view)                      │ WorkerDriver: plan, wait, commit
       └──────────── reply finished ◄──────────────────────────┘

Only this module knows SimPy. Engines (``kvroute.sim.engine``) and policies
(``kvroute.policies``) are plain objects the live emulator and gateway reuse.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import simpy

from kvroute.costmodel import StepTimeModel
from kvroute.hardware import Hardware
from kvroute.kvcache.holders import Holders, LaggingHolders
from kvroute.kvcache.index import ApproxPrefixIndex
from kvroute.loadsignal import ROUTER, DelayModel, LoadSignal
from kvroute.policies.base import Policy, RouteRequest
from kvroute.sim.engine import Engine, EngineRequest
from kvroute.sim.stream import ConversationStream
from kvroute.workload.trace import Conversation, Trace


class WorkerDriver:
    """Runs one engine in simulated time; wakes on arrivals and co-located load changes."""

    def __init__(self, env: simpy.Environment, engine: Engine, cluster: SimCluster, gpu: int):
        self.env = env
        self.engine = engine
        self.cluster = cluster
        self.gpu = gpu
        self.index = 0  # its worker's position (set by the cluster)
        self.busy = False
        self._wake: simpy.Event | None = None
        self.process = env.process(self._run())

    def wake(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.cluster.device_load_changed(self)
            if self.cluster.api_shares_core:
                self.cluster.engine_busy_changed(self.index)

    def _run(self):
        env, eng = self.env, self.engine
        while True:
            if not eng.running and not eng.waiting:  # idle
                self._set_busy(False)
                self._wake = env.event()
                yield self._wake
                self.cluster.core_debt_s[self.index] = 0.0  # work owed meanwhile ran on an idle core
                continue
            if not self.busy:
                self._set_busy(True)
            eng.now = env.now
            plan = eng.plan()
            start = env.now
            ends = plan.ends
            k = len(ends)
            if k == 1:  # new arrivals join at the next step boundary anyway
                yield env.timeout(ends[0])
                steps = 1
            else:
                # one event, succeeded by the run's end or by a wake (an arrival or a
                # co-located worker's load change), whichever comes first
                ev = self._wake = env.event()
                total = ends[-1]
                env.timeout(total).callbacks.append(lambda _t, ev=ev: ev.triggered or ev.succeed())
                yield ev
                steps = k
                if env.now < start + total:
                    # finish the step in progress, then re-plan with the newcomer
                    done = bisect_right(ends, env.now - start)
                    steps = min(done + 1, k)
                    rest = start + ends[steps - 1] - env.now
                    if rest > 0:
                        yield env.timeout(rest)
            # work owed by this engine's core (the client's, refused requests') since the run
            # began (and during that work) delays the run, as if it had started that much later
            charged = 0.0
            debts = self.cluster.core_debt_s
            while debts[self.index] > 1e-9:
                debt, debts[self.index] = debts[self.index], 0.0
                charged += debt
                yield env.timeout(debt)
            first, finished = eng.commit(plan, steps, start + charged)
            if self.cluster.client_core is not None:
                # tokens streamed to the client: one per sequence and step of a decode run; in a
                # step with prefill chunks, one per decoder and per request whose prompt completed
                n = len(plan.reqs)
                self.cluster.client_streamed(n * steps if plan.decode_only else n - len(plan.chunks) + len(first))
            if self.cluster.gateway_counters:
                for r in first:
                    self.cluster.first_token(r)
            for r in finished:
                self.cluster.finished(self, r)


def api_delays(trace: Trace, lo: float, hi: float, common: np.random.Generator) -> list[list[float]]:
    """Every request's API-server delay, ``[conversation index][turn]``: ``lo + (hi - lo) * u``.

    One uniform ``u`` per request, drawn from ``common`` in trace order (conversation by
    conversation, turn by turn) in one numpy call. The draw belongs to the request, not
    to the order in which a policy's run happens to route it: two policies that route
    alike wait alike, and one that routes differently still gives each request the
    same delay (common random numbers).
    """
    counts = [len(c.turns) for c in trace.conversations]
    flat = (lo + (hi - lo) * common.random(sum(counts))).tolist()
    out: list[list[float]] = []
    start = 0
    for n in counts:
        out.append(flat[start : start + n])
        start += n
    return out


@dataclass(slots=True)
class ApiJob:
    """A request in its API server (when the server shares its engine's core): ``left_s`` of
    work at idle speed, done at ``rate`` (1, or 1/f beside the running engine) since ``since``;
    ``token`` tells a stale completion event from the current one."""

    ereq: EngineRequest
    left_s: float
    rate: float
    since: float
    token: int = 0


@dataclass(slots=True)
class Pending:
    """Router-side bookkeeping of one routed request."""

    conversation: Conversation
    turn: int
    worker: int
    arrival_s: float
    done: simpy.Event
    block_hashes: list[int] | None = None  # recorded in the approximate index when it finishes
    uncached: int = 0  # prompt tokens the approximate index did not match when it was routed
    running: bool = False  # its first token is back (the gateway's counters)


#: From this many workers on, the exact view answers from a cluster-wide holders index
#: (kvroute.kvcache.holders) instead of searching each worker's pool. Keeping the index
#: costs a dict update per cached block: on four workers that made note2-20turn's
#: kv_aware run about 8% slower; on forty (tenfold chats) it runs about 1.2 times
#: faster than the per-pool search (README, "Speed").
HOLDERS_MIN_WORKERS = 8


class SimView:
    """The :class:`~kvroute.policies.base.ClusterView` of the simulated cluster."""

    def __init__(self, cluster: SimCluster, exact: bool):
        self.c = cluster
        self.exact = exact
        self.block_size = cluster.hw.engine.block_size
        self._index = cluster.worker_index
        self.workers: Sequence[str] = cluster.workers  # fixed for the run
        self._holders: Holders | None = None  # shared by the pools once a policy asks for matches
        self._asked: RouteRequest | None = None  # the request whose matches are in _matched
        self._matched: list[int] = []

    def is_up(self, worker: str) -> bool:
        return True

    def in_flight(self, worker: str) -> int:
        return self.c.in_flight[self._index[worker]]

    def waiting(self, worker: str) -> int:
        i = self._index[worker]
        return self.c.in_flight[i] - len(self.c.engines[i].running)

    def active_blocks(self, worker: str) -> int:
        return self.c.engines[self._index[worker]].pool.num_used_blocks

    def kv_usage(self, worker: str) -> float:
        # active_blocks as this view sees them (a subclass's scrape), over the pool's size
        return self.active_blocks(worker) / self.c.engines[self._index[worker]].pool.num_blocks

    def queue_delay_s(self, worker: str) -> float:
        i = self._index[worker]
        c = self.c
        if not self.exact:  # the gateway's estimate over the gateway's counters
            return c.delays.queue_delay_s(c.waiting_uncached[i], c.router_running[i], c.in_flight[i],
                                          c.finished_requests[i], c.finished_output[i])
        return c.engines[i].queue_delay_s(c.in_transit_tokens[i])

    def matched_tokens(self, worker: str, request: RouteRequest) -> int:
        if not self.exact:
            return self.c.index.match(worker, request.block_hashes, self.c.env.now) * self.block_size
        if len(self.workers) < HOLDERS_MIN_WORKERS:
            return self.c.engines[self._index[worker]].pool.num_cached_blocks(request.block_hashes) * self.block_size
        if request is not self._asked:  # every worker's match at once (policies ask them all)
            if self._holders is None:
                self._holders = Holders()
                for i, e in enumerate(self.c.engines):
                    e.pool.share_holders(self._holders, 1 << i)
            self._matched = self._holders.matched_blocks(request.block_hashes, len(self.workers))
            self._asked = request
        return self._matched[self._index[worker]] * self.block_size

    def forget_request(self) -> None:
        """Drop the remembered matches: the caches change once the request is routed."""
        self._asked = None

    def index_size(self, worker: str) -> int:
        if self.exact:
            return len(self.c.engines[self._index[worker]].pool.cached)
        return self.c.index.size(worker)

    def prefill_time_s(self, worker: str, tokens: int) -> float:
        if not self.exact:
            return self.c.delays.prefill_time_s(tokens)
        return self.c.model.prefill_time(tokens)

    def session_worker(self, session_id: str) -> str | None:
        return self.c.sessions.get(session_id)


class Scrape:
    """Each worker's /metrics gauges as of its last scrape (``load_signal`` scraped).

    ``in_flight`` is ``num_requests_running + num_requests_waiting`` as the emulator
    (the same engine in real time) exposes them: a request counts from the moment the
    API server accepts it, its API-server delay included, as the router's own counter
    does; ``used_blocks`` is ``kv_cache_usage_perc`` times the pool's blocks;
    ``queue_delay_s`` is the engine's estimate (:meth:`Engine.queue_delay_s`) then, which the
    exact view reads; the approximate view (the gateway's) computes the gateway's formula over
    the scraped counts instead, as :class:`~kvroute.live.view.GatewayView` does.
    """

    __slots__ = ("in_flight", "running", "used_blocks", "queue_delay_s")

    def __init__(self, n: int) -> None:
        self.in_flight = [0] * n
        self.running = [0] * n
        self.used_blocks = [0] * n
        self.queue_delay_s = [0.0] * n


class ScrapedSimView(SimView):
    """The view of a router that reads load from scraped engine metrics.

    ``in_flight``, ``waiting``, ``active_blocks`` (so ``kv_usage``) and ``queue_delay_s``
    answer from the last :class:`Scrape` of the worker, so every decision between two scrapes sees the
    same, stale load; prefixes and sessions are as in :class:`SimView`.
    """

    def __init__(self, cluster: SimCluster, exact: bool, scrape: Scrape):
        super().__init__(cluster, exact)
        self.scrape = scrape

    def in_flight(self, worker: str) -> int:
        return self.scrape.in_flight[self._index[worker]]

    def waiting(self, worker: str) -> int:
        i = self._index[worker]
        return self.scrape.in_flight[i] - self.scrape.running[i]

    def active_blocks(self, worker: str) -> int:
        return self.scrape.used_blocks[self._index[worker]]

    def queue_delay_s(self, worker: str) -> float:
        i = self._index[worker]
        if not self.exact:  # the gateway's formula over the scraped counts (kvroute.live.view)
            c, sc = self.c, self.scrape
            return c.delays.scraped_queue_delay_s(sc.running[i], sc.in_flight[i] - sc.running[i], c.routed[i],
                                                  c.uncached_routed[i], c.finished_requests[i], c.finished_output[i])
        return self.scrape.queue_delay_s[i]


class EventsSimView(SimView):
    """The exact view of a router fed by KV events that arrive ``delay_ms`` late.

    ``matched_tokens`` and ``index_size`` read :class:`LaggingHolders`, which the pools
    tell of every change as it happens and which applies it ``delay_s`` later; load
    (``in_flight``, ``waiting``, ``active_blocks``, ``queue_delay_s``) is as in
    :class:`SimView`: KV events carry blocks, not queues.
    """

    def __init__(self, cluster: SimCluster, holders: LaggingHolders):
        super().__init__(cluster, exact=True)
        self.lagging = holders

    def matched_tokens(self, worker: str, request: RouteRequest) -> int:
        if request is not self._asked:
            self.lagging.catch_up()
            self._matched = self.lagging.matched_blocks(request.block_hashes, len(self.workers))
            self._asked = request
        return self._matched[self._index[worker]] * self.block_size

    def index_size(self, worker: str) -> int:
        self.lagging.catch_up()
        return self.lagging.sizes.get(1 << self._index[worker], 0)


class SimCluster:
    """One simulated run: a trace replayed through one policy on one hardware profile."""

    def __init__(
        self,
        trace: Trace,
        hw: Hardware,
        policy: Policy,
        common: np.random.Generator,
        exact: bool,
        load_signal: LoadSignal = ROUTER,
    ) -> None:
        """``common`` is the round's common stream (``kvroute.sim.run.common_rng``): not
        the policy's, so that every policy run on ``trace`` sees the same draws. It is
        read once, here, in trace order (then, with a scraped ``load_signal``, one scrape
        phase per worker); nothing draws from it while the run routes."""
        self.env = simpy.Environment()
        self.trace = trace
        self.hw = hw
        self.policy = policy
        self.model = StepTimeModel.from_hardware(hw)
        self.workers = hw.worker_names
        self.engines = [
            Engine(w, self.model, hw.num_blocks, hw.engine.block_size,
                   hw.engine.max_num_batched_tokens, hw.engine.max_num_seqs)
            for w in self.workers
        ]
        self.drivers = [WorkerDriver(self.env, e, self, hw.gpu_of(i)) for i, e in enumerate(self.engines)]
        for i, d in enumerate(self.drivers):
            d.index = i
        self._peers = {d.gpu: [p for p in self.drivers if p.gpu == d.gpu] for d in self.drivers}
        self.worker_index = {w: i for i, w in enumerate(self.workers)}  # worker name -> position
        self.in_flight = [0] * len(self.workers)
        self.in_transit_tokens = [0] * len(self.workers)
        self.sessions: dict[str, str] = {}
        self.index = ApproxPrefixIndex(self.workers, hw.engine.block_size, capacity_blocks_per_worker=hw.num_blocks)
        self.load_signal = load_signal
        self.scrape: Scrape | None = None
        self.scrape_phase_s: list[float] = []
        if load_signal.source == "scraped":
            self.scrape = Scrape(len(self.workers))
            self.view: SimView = ScrapedSimView(self, exact, self.scrape)
        elif load_signal.source == "events":
            if not exact:
                raise ValueError("load_signal events delays the engines' KV events, which only the exact view reads")
            lag = LaggingHolders(lambda: self.env.now, load_signal.delay_s)
            for i, e in enumerate(self.engines):
                e.pool.share_holders(lag, 1 << i)
            self.view = EventsSimView(self, lag)
        else:
            self.view = SimView(self, exact)
        # The approximate view is the gateway's (kvroute.live.view): its delay estimates come
        # from the gateway's own counters (routed, first byte back, finished) through the
        # gateway's formula with the parameters kvroute measure gives it, not from the engines
        self.gateway_counters = not exact
        self.delays = DelayModel.from_hardware(hw)
        n = len(self.workers)
        self.router_running = [0] * n
        self.waiting_uncached = [0] * n
        self.finished_requests = [0] * n
        self.finished_output = [0] * n
        self.routed = [0] * n  # requests routed to each worker, and their uncached prompt tokens
        self.uncached_routed = [0] * n
        self.pending: dict[int, Pending] = {}
        self.rows: list[dict] = []
        self._next_rid = 0
        c = self.coefficients = hw.coefficients
        lo = max(0.0, c.api_overhead_ms - c.api_jitter_ms) * 1e-3
        hi = (c.api_overhead_ms + c.api_jitter_ms) * 1e-3
        #: API-server delay of every request, ``[conversation index][turn]``, in seconds
        self.api_delay_s = api_delays(trace, lo, hi, common)
        # The CPU build's API server shares its worker's core with the engine: the probes measure
        # its work taking api_busy_factor f times as long beside a running engine. Two runnable
        # processes on one core share it fairly, each at half speed, so the part of the API
        # delay that is work on that core is c = f - 1 (at most all of it) and the engine loses
        # that much time: while the engine runs, a request's API work proceeds at 1/f of its
        # idle speed (processor sharing, re-timed whenever the engine starts or stops), and the
        # engine, while any API work is in progress, runs its steps f/(f-c) times as long (f
        # itself up to f = 2). f = 1 (GPU families: a host core of their own) changes nothing.
        f = c.api_busy_factor
        self.api_shares_core = f > 1.0
        self._api_engine_share = f / (f - min(1.0, f - 1.0)) if self.api_shares_core else 1.0
        self._api_rate_busy = 1.0 / f if self.api_shares_core else 1.0
        #: per worker: requests in its API server (only when it shares the engine's core)
        self.api_jobs: list[list[ApiJob]] = [[] for _ in self.workers]
        self._device_share = [1.0] * len(self.workers)
        # The CPU build's engines slow each other: the probes time every term with the other
        # workers idle and measure how much slower an engine runs beside busy ones
        # (neighbour_slowdown s), so a worker runs its steps s times as long while any other
        # worker of the host is busy, re-timed whenever one starts or stops (s = 1: every GPU family)
        self._neighbour_slowdown = c.neighbour_slowdown if c.neighbour_slowdown > 0 else 1.0
        self._host_share = [1.0] * len(self.workers)
        if self.scrape is not None:  # unsynchronised scrapers: worker i's first scrape at phase i
            self.scrape_phase_s = (common.random(len(self.workers)) * load_signal.interval_s).tolist()
        # The client (the gateway and the load generator, one process) pinned to the core of
        # worker client_core (engine.client_worker; kvroute measure pins it there): its CPU per
        # request routed and per token streamed, from any worker, as the probe measured it. It
        # runs as soon as it is woken (the kernel favours a sleeper over the engine's long
        # compute), so that engine loses that time times client_interference (the probe's
        # measure of what each second of it costs the engine: wake-ups, a shared cache) while
        # it is busy; on an idle core the work costs no engine anything. Charged as a debt the
        # engine pays at its run's end.
        self.client_core: int | None = None
        #: per worker: CPU seconds other work owes that worker's core, paid by its engine at its
        #: run's end (the client's, and the refused requests of a policy that asks every worker)
        self.core_debt_s = [0.0] * len(self.workers)
        #: a request a policy sends every worker before routing (vllm-router's render, refused):
        #: each worker's CPU for it, where the probes measured one (0: nothing to charge)
        self._refused_s = (c.api_refused_request_ms * 1e-3
                           if self.policy.asks_every_worker and self.api_shares_core else 0.0)
        self._client_token_s = c.client_charge_s(c.client_cpu_per_token_ms * 1e-3)
        if hw.engine.client_worker is not None and (c.client_cpu_per_request_ms > 0 or self._client_token_s > 0
                                                    or c.client_cpu_per_prompt_token_ms > 0):
            self.client_core = hw.engine.client_worker

    def client_streamed(self, tokens: int) -> None:
        """``tokens`` streamed back through the client: their CPU, owed by the client's core."""
        self.core_debt_s[self.client_core] += tokens * self._client_token_s

    # -- device sharing -----------------------------------------------------------
    def device_load_changed(self, driver: WorkerDriver) -> None:
        if self._neighbour_slowdown != 1.0 and len(self.drivers) > 1:
            self._neighbours_changed(driver)
        peers = self._peers[driver.gpu]
        if len(peers) == 1:
            return
        share = float(max(1, sum(d.busy for d in peers)))
        for d in peers:
            self._device_share[d.index] = share
            self._set_share(d.index)
            if d is not driver:
                d.wake()

    def _neighbours_changed(self, driver: WorkerDriver) -> None:
        """``driver``'s engine started or stopped: every other busy worker whose neighbours
        are now all idle (or no longer) runs at its new speed from its next step."""
        busy = sum(d.busy for d in self.drivers)
        for d in self.drivers:
            share = self._neighbour_slowdown if busy - d.busy > 0 else 1.0
            if share != self._host_share[d.index]:
                self._host_share[d.index] = share
                self._set_share(d.index)
                if d is not driver and d.busy:
                    d.wake()  # the step in progress ends, the next ones run at the new speed

    def _set_share(self, i: int) -> None:
        """Worker ``i``'s engine's time share: its device's, its neighbours' on the host, and
        its API server's beside it."""
        self.engines[i].share = (self._device_share[i] * self._host_share[i]
                                 * (self._api_engine_share if self.api_jobs[i] else 1.0))

    # -- the API server beside the engine (api_busy_factor > 1) ---------------------
    def _api_rate(self, i: int) -> float:
        return 1.0 if self.engines[i].idle else self._api_rate_busy

    def _api_schedule(self, i: int, job: ApiJob) -> None:
        job.token += 1
        token = job.token
        self.env.timeout(job.left_s / job.rate).callbacks.append(lambda _ev: self._api_done(i, job, token))

    def _api_done(self, i: int, job: ApiJob, token: int) -> None:
        if token != job.token:  # re-timed since: a later event finishes it
            return
        self.api_jobs[i].remove(job)
        self._set_share(i)
        self._deliver(i, job.ereq)

    def engine_busy_changed(self, i: int) -> None:
        """Worker ``i``'s engine started or stopped: its API jobs change speed from now on."""
        jobs = self.api_jobs[i]
        if not jobs:
            return
        now, rate = self.env.now, self._api_rate(i)
        for job in jobs:
            job.left_s = max(0.0, job.left_s - (now - job.since) * job.rate)
            job.since = now
            if rate != job.rate:
                job.rate = rate
                self._api_schedule(i, job)

    # -- routing ------------------------------------------------------------------
    def route(
        self, conv: Conversation, index: int, turn: int, stream: ConversationStream, prompt: int, output: int
    ) -> simpy.Event:
        """Route turn ``turn`` of conversation ``index`` of the trace (``conv``); the
        returned event fires when its reply has finished."""
        env = self.env
        rid = self._next_rid
        self._next_rid += 1
        hashes = stream.chain(prompt + output)
        bs = self.hw.engine.block_size
        req = RouteRequest(f"r{rid}", conv.id, turn, prompt, hashes[: prompt // bs])
        if self._refused_s:  # asked of every worker first, answered on each one's core
            for j in range(len(self.core_debt_s)):
                self.core_debt_s[j] += self._refused_s
        worker = self.policy.choose(req, self.view)
        self.view.forget_request()
        i = self.worker_index[worker]
        self.sessions[conv.id] = worker
        later = None
        uncached = 0
        if not self.view.exact:  # the exact view reads the engines; no index to keep
            uncached = prompt - min(self.index.match(worker, req.block_hashes, env.now) * bs, prompt)
            self.waiting_uncached[i] += uncached
            self.routed[i] += 1
            self.uncached_routed[i] += uncached
            if self.policy.index_on_finish:
                later = req.block_hashes  # the index learns the decision when the request ends
            else:
                self.index.record(worker, req.block_hashes, env.now)
        self.in_flight[i] += 1
        self.in_transit_tokens[i] += prompt
        done = env.event()
        self.pending[rid] = Pending(conv, turn, i, env.now, done, later, uncached)
        ereq = EngineRequest(rid, prompt, output, hashes)
        if self.client_core is not None:  # routing and sending it
            c = self.coefficients
            self.core_debt_s[self.client_core] += c.client_charge_s(c.client_request_s(prompt))
        work = self.coefficients.api_work_s(self.api_delay_s[index][turn], prompt)
        if not self.api_shares_core:
            env.timeout(work).callbacks.append(lambda _ev: self._deliver(i, ereq))  # cheaper than a process
            return done
        job = ApiJob(ereq, work, self._api_rate(i), env.now)
        self.api_jobs[i].append(job)
        self._api_schedule(i, job)
        if len(self.api_jobs[i]) == 1:
            self._set_share(i)
            if not self.engines[i].idle:
                self.drivers[i].wake()  # the step in progress ends, the next ones run slower
        return done

    def _deliver(self, i: int, ereq: EngineRequest) -> None:
        """The API server hands the request to the engine's queue."""
        ereq.arrival_s = self.env.now
        self.in_transit_tokens[i] -= ereq.prompt_tokens
        self.engines[i].add(ereq)
        self.drivers[i].wake()

    def first_token(self, r: EngineRequest) -> None:
        """The gateway sees the request's first byte: running, its prefill no longer queued."""
        p = self.pending[r.rid]
        if not p.running:
            p.running = True
            self.router_running[p.worker] += 1
            self.waiting_uncached[p.worker] -= p.uncached

    def finished(self, driver: WorkerDriver, r: EngineRequest) -> None:
        p = self.pending.pop(r.rid)
        self.in_flight[p.worker] -= 1
        if self.gateway_counters:
            w = p.worker
            if p.running:
                self.router_running[w] -= 1
            else:
                self.waiting_uncached[w] -= p.uncached
            self.finished_requests[w] += 1
            self.finished_output[w] += r.output_tokens
        if p.block_hashes is not None:
            self.index.record(self.workers[p.worker], p.block_hashes, self.env.now)
        self.rows.append(
            {
                "conversation": p.conversation.id,
                "turn": p.turn,
                "worker": self.workers[p.worker],
                "arrival_s": p.arrival_s,
                "first_token_s": r.first_token_s,
                "finish_s": r.finish_s,
                "ttft_ms": (r.first_token_s - p.arrival_s) * 1e3,
                "e2e_ms": (r.finish_s - p.arrival_s) * 1e3,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "output_tokens": r.output_tokens,
                "status": "ok",
                "queue_ms": (r.start_s - r.arrival_s) * 1e3,
                "preemptions": r.preemptions,
            }
        )
        p.done.succeed()

    # -- scraped load -----------------------------------------------------------------
    def _scraper(self, i: int, total: int):
        """Sample worker ``i``'s gauges every ``interval_ms`` from its phase on, until
        every request of the trace has finished (then the run can end)."""
        env, eng, s, rows = self.env, self.engines[i], self.scrape, self.rows
        period = self.load_signal.interval_s
        yield env.timeout(self.scrape_phase_s[i])
        while len(rows) < total:
            s.in_flight[i] = self.in_flight[i]
            s.running[i] = len(eng.running)
            s.used_blocks[i] = eng.pool.num_used_blocks
            s.queue_delay_s[i] = eng.queue_delay_s(self.in_transit_tokens[i])
            yield env.timeout(period)

    # -- clients --------------------------------------------------------------------
    def _stream(self, conv: Conversation) -> ConversationStream:
        return ConversationStream(conv.system_id, conv.system_tokens, self.hw.engine.block_size,
                                  self.hw.model.chat_template)

    def _send(self, conv: Conversation, index: int, k: int, stream: ConversationStream) -> tuple[ConversationStream, simpy.Event]:
        """Turn ``k``'s prompt and reply onto the conversation's stream (an explicit
        prompt, ``hash_ids``, starts a stream of its own), then route it; returns the
        stream the next turn continues and the reply's event."""
        turn = conv.turns[k]
        if turn.hash_ids is not None:  # the recorded prompt as the engine saw it: no template added
            stream = ConversationStream("", 0, self.hw.engine.block_size)
            stream.add_blocks(turn.hash_ids, turn.user_tokens, self.trace.block_tokens)
        else:
            stream.add_user(index, k, turn.user_tokens)
        prompt = stream.length
        output = max(1, turn.output_tokens)
        stream.add_assistant(index, k, output)
        return stream, self.route(conv, index, k, stream, prompt, output)

    def _conversation(self, conv: Conversation, index: int):
        stream = self._stream(conv)
        for k, turn in enumerate(conv.turns):
            if k and turn.think_s > 0:
                yield self.env.timeout(turn.think_s)
            stream, done = self._send(conv, index, k, stream)
            yield done

    def _replay(self, convs: list[tuple[int, Conversation]]):
        """Replay mode: every turn at its own ``arrival_s``, in (time, conversation,
        turn) order, not waiting for any reply (open loop, request by request)."""
        env = self.env
        order = sorted((t.arrival_s, i, k) for i, c in convs for k, t in enumerate(c.turns))
        streams: dict[int, ConversationStream] = {}
        for at, i, k in order:
            if at > env.now:
                yield env.timeout(at - env.now)
            conv = self.trace.conversations[i]
            stream = streams.get(i) or self._stream(conv)
            stream, _ = self._send(conv, i, k, stream)
            if k + 1 < len(conv.turns):  # the next turn continues this one's stream
                streams[i] = stream
            else:
                streams.pop(i, None)

    def _closed_slot(self, queue: list[tuple[int, Conversation]]):
        while queue:
            index, conv = queue.pop()
            if conv.arrival_s > self.env.now:  # ramp-up: a chat does not start before its arrival
                yield self.env.timeout(conv.arrival_s - self.env.now)
            yield from self._conversation(conv, index)

    def _open_arrival(self, conv: Conversation, index: int):
        yield self.env.timeout(conv.arrival_s)
        yield from self._conversation(conv, index)

    def run(self) -> list[dict]:
        convs = list(enumerate(self.trace.conversations))
        if self.trace.mode == "closed":
            queue = convs[::-1]  # pop() from the end keeps trace order
            slots = self.trace.concurrency or len(convs)
            for _ in range(min(slots, len(convs))):
                self.env.process(self._closed_slot(queue))
        elif self.trace.mode == "replay":
            self.env.process(self._replay(convs))
        else:
            for index, conv in convs:
                self.env.process(self._open_arrival(conv, index))
        if self.scrape is not None:
            total = sum(len(c.turns) for c in self.trace.conversations)
            for i in range(len(self.workers)):
                self.env.process(self._scraper(i, total))
        self.env.run()
        if self.pending:
            raise RuntimeError(f"simulation ended with {len(self.pending)} requests unfinished")
        return self.rows

    def worker_stats(self) -> dict[str, dict]:
        """Per-worker counters, as an engine's /metrics would show them."""
        return {
            e.name: {
                "prefix_queries": e.prefix_queries,
                "prefix_hits": e.prefix_hits,
                "preemptions": e.num_preemptions,
                "evictions": e.pool.num_evictions,
                "busy_s": e.busy_s,
                "steps": e.steps,
                "max_batch": e.max_batch,
                "batch_seq_s": e.batch_seq_s,
            }
            for e in self.engines
        }
