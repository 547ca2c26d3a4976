"""A vLLM v1-style engine: continuous batching over a prefix-cached block pool.

Free of SimPy: the caller asks :meth:`Engine.plan` for the next batch of steps, waits
(simulated or real time) and calls :meth:`Engine.commit` with how many of those steps
ran. The simulator and the real-time emulator drive the same object.

Scheduling, as vLLM v1's scheduler does it (simplified to what moves latency):

* every step, running requests go first: a decoding request takes one token, a
  prefilling one the next chunk of its prompt, within ``max_num_batched_tokens``;
* then waiting requests are admitted in arrival order while the token budget, the
  ``max_num_seqs`` cap and free blocks allow; an admitted request first looks up
  the longest cached prefix of its prompt (full blocks; the last prompt token is
  always recomputed) and prefills only the rest;
* when a running request needs a block and none is free, the most recently admitted
  running request is preempted (recompute: its blocks are freed, it rejoins the
  head of the waiting queue);
* the step that computes a request's last prompt token also samples its first
  output token; a request finishes when it has sampled ``output_tokens`` tokens.

Fast path: while every running request is decoding and nothing can be admitted,
batch composition only changes when a request finishes, so :meth:`plan` returns
that whole run of steps at once (closed-form step times) instead of one per token.

Lazy decode accounting: a decoding request's only events are its finish and the
steps at which its context reaches a block boundary (the block just filled is
registered in the prefix cache and the next token needs a new block). Between events
all scheduled decoders advance in lockstep, one token a step, so the engine counts
steps (``_tick``) and a decoder stores its counts as of the tick it joined
(``num_computed``/``num_generated`` are properties that add the ticks since). The
decoders' total context is a running sum, their next events and finish ticks sit in
heaps, and those at a block boundary in a short list. :meth:`commit` thus touches only
the requests with an event, and :meth:`_schedule` only the prefilling requests and
those at a boundary, in batch order as vLLM's pass over the batch meets them: an
arrival (an interrupted decode run, a prefill step, a finish: about three commits)
costs O(events + log batch), not O(batch). Blocks are still taken, registered and
freed at the same steps and in the same order as a step-by-step pass would (the
eager engine in ``tests/eager_engine.py`` is the oracle), so eviction, and with it
every record, is unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from heapq import heappop, heappush
from operator import attrgetter

import numpy as np

from kvroute.costmodel import StepTimeModel
from kvroute.kvcache.pool import BlockPool

_by_seq = attrgetter("_seq")


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request inside an engine. ``hashes`` chains prompt + reply full blocks."""

    rid: int
    prompt_tokens: int
    output_tokens: int
    hashes: list[int]
    arrival_s: float = 0.0  # when the engine received it
    cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet admitted)
    num_cached_blocks: int = 0  # leading blocks already registered in the pool's map
    preemptions: int = 0
    start_s: float = -1.0  # first admission
    first_token_s: float = -1.0
    finish_s: float = -1.0
    # the blocks it holds (see ``blocks``): the prefix-cache hit at admission as matched,
    # an array kept as is (a multi-turn prompt's hit is most of its blocks, and admission
    # and release would otherwise convert it to a list and back every turn), its length,
    # and the blocks taken since
    prefix_ids: np.ndarray | None = field(default=None, repr=False)
    _npre: int = field(default=0, repr=False)
    _new: list[int] = field(default_factory=list, repr=False)
    # lazy accounting: tokens computed and generated as of tick _t0 of _eng (the engine
    # whose lockstep decoders it is among; None while waiting, prefilling or done, when
    # the counts are exact as stored)
    _computed: int = field(default=0, repr=False)
    _generated: int = field(default=0, repr=False)
    _eng: Engine | None = field(default=None, repr=False)
    _t0: int = field(default=0, repr=False)
    _seq: int = field(default=-1, repr=False)  # admission stamp while running (batch order), else -1
    _ev: int = field(default=-1, repr=False)  # tick of its next event (heap entries with another are stale)
    _need: bool = field(default=False, repr=False)  # at a block boundary: needs a block for its next token

    @property
    def blocks(self) -> list[int]:
        """Ids of the blocks it holds, in chain order (a new list)."""
        pre = self.prefix_ids
        return pre.tolist() + self._new if pre is not None else list(self._new)

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is in the cache."""
        e = self._eng
        return self._computed if e is None else self._computed + e._tick - self._t0

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far."""
        e = self._eng
        return self._generated if e is None else self._generated + e._tick - self._t0

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_tokens


@dataclass(slots=True)
class Plan:
    """The next ``len(ends)`` steps: who computes how many tokens in each."""

    reqs: list[EngineRequest]  # the first step's requests, in batch order
    ends: list[float]  # cumulative end time of each step, from the plan's start
    decode_only: bool  # every request decodes one token a step, in every step
    chunks: list[tuple[EngineRequest, int]]  # the prefilling requests among reqs and their tokens

    @property
    def sched(self) -> list[tuple[EngineRequest, int]]:
        """(request, tokens in the first step) in batch order; decoders take one."""
        chunk = {r: n for r, n in self.chunks}
        return [(r, chunk.get(r, 1)) for r in self.reqs]


class Engine:
    """One worker: a waiting queue, a running batch and a block pool."""

    def __init__(
        self,
        name: str,
        model: StepTimeModel,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.name = name
        self.model = model
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.budget = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # in admission order (``_seq`` increasing)
        self.share = 1.0  # set by the cluster when workers time-share a device
        self.now = 0.0  # set by the driver before each plan (stamps admissions)
        # lazy decode accounting (module docstring): lockstep steps so far, the running
        # decoders' count and sum of (_computed - _t0) (their context is that plus
        # count x tick), their next events and finish ticks as (tick, _seq, request)
        # heaps, those at a block boundary, and the running prefilling requests
        self._tick = 0
        self._n_lock = 0
        self._lock_sum = 0
        self._events: list[tuple[int, int, EngineRequest]] = []
        self._fins: list[tuple[int, int, EngineRequest]] = []
        self._needers: list[EngineRequest] = []
        self._prefilling: list[EngineRequest] = []
        self._next_seq = 0
        # set by _schedule for plan(): did the step include prompt tokens, the decoders'
        # count and total context, the prefill chunks (q, c) and (request, q)
        self._has_prefill = False
        self._n_dec = 0
        self._dec_ctx = 0
        self._prefills: list[tuple[int, int]] = []
        self._admissions = 0  # requests the step being planned admits (each costs admission_s)
        self._chunks: list[tuple[EngineRequest, int]] = []
        # counters, as vLLM's /metrics exposes them
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        self.busy_s = 0.0
        # batch sizes: the largest batch and sequence-seconds (a busy-time-weighted mean batch)
        self.max_batch = 0
        self.batch_seq_s = 0.0

    # -- interface ----------------------------------------------------------
    @property
    def steps(self) -> int:
        """Engine steps simulated so far (vLLM's iterations; the simulator's unit of work)."""
        return self._tick

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def abort(self, req: EngineRequest) -> bool:
        """Drop ``req`` (its client went away): out of the queue, or out of the batch with
        its blocks freed tail first. False if the engine does not hold it."""
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        if req._seq < 0 or req not in self.running:
            return False
        self.running.remove(req)
        self._leave(req)
        self.pool.free_blocks(self._held_ids(req)[::-1])
        req.prefix_ids, req._npre, req._new = None, 0, []
        return True

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed (waiting and running), a queue-delay proxy."""
        n = sum(r.prompt_tokens - r._computed for r in self.waiting)
        return n + sum(r.prompt_tokens - r._computed for r in self._prefilling)

    def queue_delay_s(self, extra_tokens: int = 0) -> float:
        """Estimated wait before a new request's prefill starts: the queued prefill
        work (plus ``extra_tokens`` on their way) at full chunks, plus the time for a
        sequence slot if the batch is full."""
        pending = self.pending_prefill_tokens() + extra_tokens
        n = len(self.running)
        delay = 0.0
        if pending:
            per_step = max(1, self.budget - n)
            steps = -(-pending // per_step)
            delay = steps * self.model.step_time(n, 0, [(min(pending, per_step), 0)], self.share)
        if n >= self.max_seqs:
            left = min(r.output_tokens - r.num_generated for r in self.running)
            delay += left * self.model.step_time(n, 0, (), self.share)
        return delay

    def plan(self) -> Plan | None:
        """Schedule the next step (and, on the fast path, the run of decode steps after it)."""
        if not self.waiting and not self.running:
            return None
        n = self._schedule()
        if not n:  # nothing fits (every block pinned by waiting admissions): should not happen
            raise RuntimeError(f"engine {self.name}: cannot schedule any request")
        reqs = self.running[:n]
        if not self._has_prefill and not self._can_admit():
            # every scheduled request decodes: a run of steps until the first finishes
            k = self._steps_with_blocks(reqs, self._min_left(n))  # blocks are taken in commit, for steps run
            ends = self.model.decode_steps(n, self._dec_ctx, k, self.share)
            return Plan(reqs, ends, True, [])
        t = self.model.step_time(self._n_dec, self._dec_ctx, self._prefills, self.share, self._admissions)
        return Plan(reqs, [t], False, self._chunks)

    def commit(self, plan: Plan, steps: int, start_s: float) -> tuple[list[EngineRequest], list[EngineRequest]]:
        """Apply the first ``steps`` steps of ``plan`` begun at ``start_s``.

        Returns (requests that produced their first token, requests that finished),
        each in batch order.
        """
        bs = self.block_size
        run_s = plan.ends[steps - 1]
        end_s = start_s + run_s
        self.busy_s += run_s
        nb = len(plan.reqs)
        self.batch_seq_s += nb * run_s
        if nb > self.max_batch:
            self.max_batch = nb
        t1 = self._tick + steps
        self._tick = t1
        running = self.running
        if len(plan.reqs) < len(running):
            # the budget ran out before the batch's tail, which did not move. FCFS admission
            # never puts a request behind a prompt still being prefilled, so only a batch
            # larger than the token budget gets here; kept so the accounting stays exact
            for r in running[len(plan.reqs):]:
                if r._eng is self:
                    r._t0 += steps
                    self._lock_sum -= steps
                    self._push_events(r, r._computed + t1 - r._t0, t1)
                    heappush(self._fins, (r._t0 + r.output_tokens - r._generated, r._seq, r))
        # who has an event: decoders whose context reached a block boundary or that
        # finish, and the prefilling requests of a mixed step; in batch order, as a
        # pass over the batch would meet them
        touched: list[EngineRequest] = []
        events = self._events
        while events and events[0][0] <= t1:
            e, seq, r = heappop(events)
            if r._eng is self and r._seq == seq and r._ev == e:
                touched.append(r)
        chunks = plan.chunks
        if chunks:
            touched.extend(r for r, _ in chunks)
            chunk = {r: n for r, n in chunks}
        if len(touched) > 1:
            touched.sort(key=_by_seq)
        first, done = [], []
        for r in touched:
            if r._eng is self:  # a decoder: at a block boundary, or finishing
                d = t1 - r._t0
                c = r._computed + d
                if c > (r._npre + len(r._new)) * bs:  # step 1's block was taken by _schedule; plan() checked the rest fit
                    self._grow(r, c)
                if c // bs > r.num_cached_blocks:
                    self._cache_blocks(r, bs, c)
                if r._generated + d >= r.output_tokens:
                    r.finish_s = end_s
                    done.append(r)
                    continue
                rem = c % bs
                if not rem and c == (r._npre + len(r._new)) * bs and not r._need:
                    r._need = True
                    self._needers.append(r)
                # _push_events, inlined (one call per block a decoder fills)
                fin = r._t0 + r.output_tokens - r._generated
                e = t1 + bs - rem
                if fin < e:
                    e = fin
                r._ev = e
                heappush(events, (e, r._seq, r))
            else:  # prefilling
                c = r._computed + chunk[r]
                r._computed = c
                if c >= r.prompt_tokens:  # this step computed the last prompt token
                    r._generated = 1
                    r.first_token_s = end_s
                    first.append(r)
                    self._prefilling.remove(r)
                if c // bs > r.num_cached_blocks:
                    self._cache_blocks(r, bs, c)
                if c >= r.prompt_tokens:
                    if r.output_tokens <= 1:
                        r.finish_s = end_s
                        done.append(r)
                    else:
                        self._join(r, c, 1)
                        if c == (r._npre + len(r._new)) * bs:
                            r._need = True
                            self._needers.append(r)
        for r in done:
            running.remove(r)
            self._leave(r)
            self._release(r)
        return first, done

    # -- lazy accounting ------------------------------------------------------
    def _join(self, r: EngineRequest, c: int, g: int) -> None:
        """``r`` (running, with ``c`` computed and ``g`` generated) starts decoding in lockstep."""
        t = self._tick
        r._computed, r._generated, r._t0, r._eng = c, g, t, self
        self._n_lock += 1
        self._lock_sum += c - t
        self._push_events(r, c, t)
        heappush(self._fins, (t + r.output_tokens - g, r._seq, r))

    def _push_events(self, r: EngineRequest, c: int, t: int) -> None:
        """File ``r``'s next event, as of tick ``t`` with ``c`` computed: the tick its
        context reaches the next multiple of block_size, or its finish if sooner."""
        fin = r._t0 + r.output_tokens - r._generated
        e = t + self.block_size - c % self.block_size
        if fin < e:
            e = fin
        r._ev = e
        heappush(self._events, (e, r._seq, r))

    def _leave(self, r: EngineRequest) -> None:
        """``r`` leaves the running batch: its counts become exact fields again."""
        if r._eng is self:
            d = self._tick - r._t0
            self._n_lock -= 1
            self._lock_sum -= r._computed - r._t0
            r._computed += d
            r._generated += d
            r._eng = None
            r._need = False  # _needers drops it lazily
        elif r._computed < r.prompt_tokens:
            self._prefilling.remove(r)
        r._seq = -1

    def _min_left(self, n: int) -> int:
        """Fewest tokens any of the first ``n`` running requests (all decoding) has left."""
        if n < len(self.running):  # a budget cut (more running than max_num_batched_tokens)
            return min(r.output_tokens - r.num_generated for r in self.running[:n])
        fins = self._fins
        while True:  # drop entries of requests that left or were shifted
            f, seq, r = fins[0]
            if r._eng is self and r._seq == seq and f == r._t0 + r.output_tokens - r._generated:
                return f - self._tick
            heappop(fins)

    # -- internals ----------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _cache_blocks(self, r: EngineRequest, bs: int, computed: int) -> None:
        full = computed // bs
        hashes, new, npre = r.hashes, r._new, r._npre
        if full > len(hashes):
            full = len(hashes)
        if full > npre + len(new):
            full = npre + len(new)
        a = r.num_cached_blocks  # >= npre: the hit was cached when matched
        if full == a + 1:  # a decode step filled one block: the common case, inlined
            pool = self.pool
            b, h = new[a - npre], hashes[a]
            if pool.block_hash[b] is None:
                if h in pool.cached:
                    pool.cache_full_block(b, h)
                else:
                    pool.block_hash[b] = h
                    pool.cached[h] = b
                    if pool.holders is not None:  # Holders.gain, inlined
                        mask = pool.holders.mask
                        mask[h] = mask.get(h, 0) | pool.holder_bit
            r.num_cached_blocks = full
        elif full > a:
            self.pool.cache_full_blocks(new[a - npre : full - npre], hashes[a:full])
            r.num_cached_blocks = full

    def _grow(self, r: EngineRequest, tokens_after: int) -> bool:
        """Make sure ``r`` holds blocks for ``tokens_after`` tokens; False if none free."""
        need = -(-tokens_after // self.block_size) - r._npre - len(r._new)
        if need <= 0:
            return True
        new = self.pool.get_new_blocks(need)
        if new is None:
            return False
        r._new.extend(new)
        return True

    @staticmethod
    def _held_ids(r: EngineRequest) -> np.ndarray:
        """``r.blocks`` as an array, converting only the blocks taken since admission."""
        new, npre = r._new, r._npre
        if not npre:
            return np.array(new, dtype=np.int64)
        if not new:
            return r.prefix_ids
        ids = np.empty(npre + len(new), dtype=np.int64)
        ids[:npre] = r.prefix_ids
        ids[npre:] = new
        return ids

    def _release(self, r: EngineRequest) -> None:
        """Free a request's blocks tail first, remembering its cached chain for the next turn."""
        ids = self._held_ids(r)
        m = r.num_cached_blocks
        if m:
            self.pool.remember_chain(ids[:m], r.hashes[m - 1])
        self.pool.free_blocks(ids[::-1])
        r.prefix_ids, r._npre, r._new = None, 0, []

    def _preempt(self, victim: EngineRequest) -> None:
        self.running.remove(victim)
        self._leave(victim)
        self._release(victim)
        victim.num_cached_blocks = 0
        victim._computed = 0
        victim._generated = 0
        victim.first_token_s = -1.0
        victim.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _schedule(self) -> int:
        """Schedule one step: returns how many running requests (a prefix of ``running``,
        admissions last) it takes; also gathers what :meth:`plan` prices it by.

        Decoders off a block boundary take one token and need nothing, so the pass
        visits only the prefilling requests and the decoders at a boundary, in batch
        order, counting the plain decoders between them against the token budget.
        """
        budget = self.budget
        bs = self.block_size
        tick = self._tick
        running = self.running
        specials = [r for r in self._needers if r._need]
        self._needers = specials
        if self._prefilling:
            specials = specials + self._prefilling
        if len(specials) > 1:
            specials.sort(key=_by_seq)
        prefills: list[tuple[int, int]] = []
        chunks: list[tuple[EngineRequest, int]] = []
        used = pos = 0  # tokens taken by running[:pos]
        preempted = False
        cut = -1
        for r in specials:
            if r._seq < 0:  # preempted earlier in this pass
                continue
            p = running.index(r)
            if used + p - pos >= budget:  # the plain decoders before r use up the budget
                cut = pos + budget - used
                break
            used += p - pos
            lock = r._eng is self
            if lock:
                c, n = r._computed + tick - r._t0, 1
            else:
                c = r._computed
                n = min(r.prompt_tokens - c, budget - used)
            if c + n > (r._npre + len(r._new)) * bs:  # needs a block: preempt from the tail until one is free
                victim = None
                while victim is not r and not self._grow(r, c + n):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted = True
                if victim is r:  # r was the tail: everything before it is scheduled
                    cut = len(running)
                    break
            if lock:
                r._need = False
            else:
                prefills.append((n, c))
                chunks.append((r, n))
            used += n
            pos = p + 1
            if used >= budget:
                cut = pos
                break
        if cut < 0:  # the plain decoders after the last special
            if used + len(running) - pos <= budget:
                used += len(running) - pos
                cut = len(running)
            else:
                cut = pos + budget - used
        self._needers = [r for r in self._needers if r._need]
        # the scheduled decoders: every lockstep decoder but those past the cut
        n_dec = self._n_lock
        dec_ctx = self._lock_sum + n_dec * (tick + 1)
        if cut < len(running):
            for r in running[cut:]:
                if r._eng is self:
                    n_dec -= 1
                    dec_ctx -= r._computed + tick - r._t0 + 1
        self._prefills = prefills
        self._chunks = chunks
        self._n_dec = n_dec
        self._dec_ctx = dec_ctx
        self._has_prefill = bool(prefills)
        self._admissions = 0
        if preempted or cut < len(running):
            return cut
        budget = self.budget - used  # every running request is scheduled
        pool = self.pool
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self.max_seqs:
            r = waiting[0]
            first = r.cached_tokens < 0  # a preempted request's re-admission is not a new one
            if r._computed == 0:
                hit_blocks = pool.match(r.hashes, (r.prompt_tokens - 1) // bs)
                hit = len(hit_blocks)
                hit_tokens = hit * bs
                need = self._blocks_for(hit_tokens + min(r.prompt_tokens - hit_tokens, budget)) - hit
                if not pool.touch_if_room(hit_blocks, need):
                    break  # FCFS: later requests wait behind this one, as in vLLM
                r.prefix_ids, r._npre, r._new = hit_blocks, hit, []
                r.num_cached_blocks = hit
                r._computed = hit_tokens
                if r.cached_tokens < 0:
                    r.start_s = self.now
                    r.cached_tokens = hit_tokens
                    self.prefix_queries += r.prompt_tokens
                    self.prefix_hits += hit_tokens
            c = r._computed
            n = min(r.prompt_tokens - c, budget)
            if not self._grow(r, c + n):
                break
            waiting.popleft()
            r._seq = self._next_seq
            self._next_seq += 1
            running.append(r)
            self._prefilling.append(r)
            chunks.append((r, n))
            prefills.append((n, c))
            self._has_prefill = True
            if first:
                self._admissions += 1
            budget -= n
        return len(running)

    def _can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_seqs

    def _steps_with_blocks(self, reqs: list[EngineRequest], k: int) -> int:
        """Largest run of decode steps (<= k) whose new blocks the free queue can supply.

        Nothing is allocated here: :meth:`commit` takes the blocks for the steps that
        actually ran, so an interrupted run evicts exactly what single steps would.
        """
        bs = self.block_size
        free = self.pool.num_free_blocks
        if len(reqs) * (k // bs + 1) <= free:  # cheap bound: each request crosses at most this many
            return k
        held = [(r.num_computed, r._npre + len(r._new)) for r in reqs]

        def need(steps: int) -> int:
            return sum(max(0, -(-(c + steps) // bs) - b) for c, b in held)

        if need(k) > free:
            lo, hi = 1, k  # step 1 is already covered by _schedule
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if need(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        return k
