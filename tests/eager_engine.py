"""The eager engine: kvroute.sim.engine as it was before lazy decode accounting (a test oracle).

Every commit walks the whole running batch and updates each request's counts; the
lazy engine must plan the same steps, take, register and free the same blocks in the
same order and report the same first tokens and finishes (tests/test_engine.py's
``test_lazy_engine_equals_the_eager_one``). Not used by the package.

Its original description follows.

A vLLM v1-style engine: continuous batching over a prefix-cached block pool.

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
And while every running request decodes, :meth:`commit` hands the next step its
batch (contexts, tokens left, who crossed into a new block), so planning does not
walk the batch again: the per-step cost is one pass over the batch, in commit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvroute.costmodel import StepTimeModel
from kvroute.kvcache.pool import BlockPool


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request inside an engine. ``hashes`` chains prompt + reply full blocks."""

    rid: int
    prompt_tokens: int
    output_tokens: int
    hashes: list[int]
    arrival_s: float = 0.0  # when the engine received it
    num_computed: int = 0  # tokens whose KV is in the cache
    num_generated: int = 0
    cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet admitted)
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the pool's map
    preemptions: int = 0
    start_s: float = -1.0  # first admission
    first_token_s: float = -1.0
    finish_s: float = -1.0
    # ids of the prefix-cache hit at admission, as matched (``blocks`` starts with them):
    # releasing converts only the blocks added since, not the whole history
    prefix_ids: np.ndarray | None = field(default=None, repr=False)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_tokens


@dataclass(slots=True)
class Plan:
    """The next ``len(ends)`` steps: who computes how many tokens in each."""

    sched: list[tuple[EngineRequest, int]]  # tokens per request in the first step
    ends: list[float]  # cumulative end time of each step, from the plan's start
    decode_only: bool  # steps after the first repeat the first with one token each


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
        self.running: list[EngineRequest] = []
        self.share = 1.0  # set by the cluster when workers time-share a device
        self.now = 0.0  # set by the driver before each plan (stamps admissions)
        # set by _schedule for plan(): did the step include prompt tokens, the decoders'
        # count and total context, the prefill chunks (q, c), fewest tokens a decoder has left
        self._has_prefill = False
        self._n_dec = 0
        self._dec_ctx = 0
        self._prefills: list[tuple[int, int]] = []
        self._min_left = 0
        # set by commit: (the next step's decode batch, its context, fewest tokens left,
        # who needs a block for the next token) when every running request decodes on
        self._next: tuple[list[tuple[EngineRequest, int]], int, int, list[EngineRequest]] | None = None
        # counters, as vLLM's /metrics exposes them
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        self.busy_s = 0.0

    # -- interface ----------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed (waiting and running), a queue-delay proxy."""
        n = sum(r.prompt_tokens - r.num_computed for r in self.waiting)
        return n + sum(r.prompt_tokens - r.num_computed for r in self.running if r.prefilling)

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
        sched = self._schedule()
        if not sched:  # nothing fits (every block pinned by waiting admissions): should not happen
            raise RuntimeError(f"engine {self.name}: cannot schedule any request")
        if not self._has_prefill and not self._can_admit():
            # every scheduled request decodes: _schedule summed their contexts and
            # found the fewest tokens any has left
            k = self._steps_with_blocks(sched, self._min_left)  # blocks are taken in commit, for steps run
            ends = self.model.decode_steps(len(sched), self._dec_ctx, k, self.share)
            return Plan(sched, ends, True)
        t = self.model.step_time(self._n_dec, self._dec_ctx, self._prefills, self.share, self._admissions)
        return Plan(sched, [t], False)

    def commit(self, plan: Plan, steps: int, start_s: float) -> tuple[list[EngineRequest], list[EngineRequest]]:
        """Apply the first ``steps`` steps of ``plan`` begun at ``start_s``.

        Returns (requests that produced their first token, requests that finished).
        """
        bs = self.block_size
        run_s = plan.ends[steps - 1]
        end_s = start_s + run_s
        self.busy_s += run_s
        first, done = [], []
        sched = plan.sched
        # what the next step's pass over the running batch would find, gathered here
        # while every request is at hand: whether all keep decoding, their contexts,
        # the fewest tokens any has left and who needs a new block for its next token
        whole = len(sched) == len(self.running)
        ctx, min_left = 0, 1 << 62
        needers: list[EngineRequest] = []
        if plan.decode_only:
            for r, _ in sched:
                c = r.num_computed + steps
                if c > len(r.blocks) * bs:  # step 1's block was taken by _schedule; plan() checked the rest fit
                    self._grow(r, c)
                r.num_computed = c
                g = r.num_generated + steps
                r.num_generated = g
                if c // bs > r.num_cached_blocks:
                    self._cache_blocks(r, bs)
                left = r.output_tokens - g
                if left <= 0:
                    r.finish_s = end_s
                    done.append(r)
                elif whole:
                    ctx += c + 1
                    if left < min_left:
                        min_left = left
                    if c >= len(r.blocks) * bs:
                        needers.append(r)
        else:
            for r, n in sched:
                c = r.num_computed + n
                r.num_computed = c
                if c - n >= r.prompt_tokens:
                    r.num_generated += 1
                elif c >= r.prompt_tokens:  # this step computed the last prompt token
                    r.num_generated = 1
                    r.first_token_s = end_s
                    first.append(r)
                if c // bs > r.num_cached_blocks:
                    self._cache_blocks(r, bs)
                left = r.output_tokens - r.num_generated
                if left <= 0:
                    r.finish_s = end_s
                    done.append(r)
                elif whole:
                    ctx += c + 1
                    if left < min_left:
                        min_left = left
                    if c < r.prompt_tokens:
                        whole = False
                    elif c >= len(r.blocks) * bs:
                        needers.append(r)
        if done:
            running = self.running
            for r in done:
                running.remove(r)
                self._release(r)
        if whole and (done or not plan.decode_only):  # a step of one token each, for those left
            sched = [(r, 1) for r in self.running]
        self._next = (sched, ctx, min_left, needers) if whole else None
        return first, done

    # -- internals ----------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _cache_blocks(self, r: EngineRequest, bs: int) -> None:
        full = r.num_computed // bs
        hashes, blocks = r.hashes, r.blocks
        if full > len(hashes):
            full = len(hashes)
        if full > len(blocks):
            full = len(blocks)
        a = r.num_cached_blocks
        if full == a + 1:  # a decode step filled one block: the common case, inlined
            pool = self.pool
            b, h = blocks[a], hashes[a]
            if pool.block_hash[b] is None:
                if h in pool.cached:
                    pool.cache_full_block(b, h)
                else:
                    pool.block_hash[b] = h
                    pool.cached[h] = b
            r.num_cached_blocks = full
        elif full > a:
            self.pool.cache_full_blocks(blocks[a:full], hashes[a:full])
            r.num_cached_blocks = full

    def _grow(self, r: EngineRequest, tokens_after: int) -> bool:
        """Make sure ``r`` holds blocks for ``tokens_after`` tokens; False if none free."""
        need = -(-tokens_after // self.block_size) - len(r.blocks)
        if need <= 0:
            return True
        new = self.pool.get_new_blocks(need)
        if new is None:
            return False
        r.blocks.extend(new)
        return True

    def _release(self, r: EngineRequest) -> None:
        """Free a request's blocks tail first, remembering its cached chain for the next turn."""
        blocks, pre = r.blocks, r.prefix_ids
        if pre is None or not len(pre):
            ids = np.array(blocks, dtype=np.int64)
        elif len(blocks) == len(pre):
            ids = pre
        else:  # only the blocks added since admission are converted
            ids = np.concatenate((pre, np.array(blocks[len(pre):], dtype=np.int64)))
        m = r.num_cached_blocks
        if m:
            self.pool.remember_chain(ids[:m], r.hashes[m - 1])
        self.pool.free_blocks(ids[::-1])
        r.blocks = []
        r.prefix_ids = None

    def _preempt(self, victim: EngineRequest) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.num_cached_blocks = 0
        victim.num_computed = 0
        victim.num_generated = 0
        victim.first_token_s = -1.0
        victim.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _schedule(self) -> list[tuple[EngineRequest, int]]:
        """One step's batch; also gathers what :meth:`plan` prices it by (decoders,
        their total context, prefill chunks, fewest tokens a decoder has left)."""
        budget = self.budget
        bs = self.block_size
        sched: list[tuple[EngineRequest, int]] = []
        prefills: list[tuple[int, int]] = []
        n_dec = dec_ctx = 0
        min_left = 1 << 62
        preempted = False
        running = self.running
        i = 0
        nxt, self._next = self._next, None
        if nxt is not None and len(nxt[0]) == len(running) <= budget and all(self._grow(r, r.num_computed + 1) for r in nxt[3]):
            # the last commit saw every running request decode on (and nothing has
            # changed the batch since): once those at a block boundary got their block,
            # in batch order as the pass below takes them, it would find this. If one
            # cannot, the pass runs: it finds the others served and preempts as usual.
            sched = list(nxt[0])
            n_dec = i = len(sched)
            dec_ctx, min_left = nxt[1], nxt[2]
            budget -= n_dec
        while i < len(running) and budget > 0:
            r = running[i]
            c = r.num_computed
            n = r.prompt_tokens - c
            decoding = n <= 0
            if decoding:
                n = 1
            elif n > budget:
                n = budget
            if c + n > len(r.blocks) * bs:  # needs a block: preempt from the tail until one is free
                victim = None
                while victim is not r and not self._grow(r, c + n):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted = True
                if victim is r:
                    break
            sched.append((r, n))
            if decoding:
                n_dec += 1
                dec_ctx += c + 1
                left = r.output_tokens - r.num_generated
                if left < min_left:
                    min_left = left
            else:
                prefills.append((n, c))
            budget -= n
            i += 1
        self._prefills = prefills
        self._n_dec = n_dec
        self._dec_ctx = dec_ctx
        self._min_left = min_left
        self._has_prefill = bool(prefills)
        self._admissions = 0
        if preempted:
            return sched
        pool = self.pool
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self.max_seqs:
            r = waiting[0]
            first = r.cached_tokens < 0  # a preempted request's re-admission is not a new one
            if r.num_computed == 0:
                hashes = r.hashes[: (r.prompt_tokens - 1) // bs]
                hit_blocks = pool.match(hashes)
                hit = len(hit_blocks)
                hit_tokens = hit * bs
                need = self._blocks_for(hit_tokens + min(r.prompt_tokens - hit_tokens, budget)) - hit
                if not pool.touch_if_room(hit_blocks, need):
                    break  # FCFS: later requests wait behind this one, as in vLLM
                r.blocks = hit_blocks.tolist()
                r.prefix_ids = hit_blocks
                r.num_cached_blocks = hit
                r.num_computed = hit_tokens
                if r.cached_tokens < 0:
                    r.start_s = self.now
                    r.cached_tokens = r.num_computed
                    self.prefix_queries += r.prompt_tokens
                    self.prefix_hits += r.num_computed
            c = r.num_computed
            n = min(r.prompt_tokens - c, budget)
            if not self._grow(r, c + n):
                break
            waiting.popleft()
            running.append(r)
            sched.append((r, n))
            prefills.append((n, c))
            self._has_prefill = True
            if first:
                self._admissions += 1
            budget -= n
        return sched

    def _can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_seqs

    def _steps_with_blocks(self, sched: list[tuple[EngineRequest, int]], k: int) -> int:
        """Largest run of decode steps (<= k) whose new blocks the free queue can supply.

        Nothing is allocated here: :meth:`commit` takes the blocks for the steps that
        actually ran, so an interrupted run evicts exactly what single steps would.
        """
        bs = self.block_size

        def need(steps: int) -> int:
            return sum(max(0, -(-(r.num_computed + steps) // bs) - len(r.blocks)) for r, _ in sched)

        free = self.pool.num_free_blocks
        if len(sched) * (k // bs + 1) <= free:  # cheap bound: each request crosses at most this many
            return k
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
