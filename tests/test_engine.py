"""Engine: continuous batching, chunked prefill, prefix hits, preemption, the fast path.

The engine is driven directly (no SimPy) by :func:`drive`, a small loop that mirrors
``kvroute.sim.cluster.WorkerDriver``: plan, commit, advance the clock; a fast-path
run is cut short at the step in progress when a request arrives. Every plan and
every commit is checked against the scheduling limits and the block accounting.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from kvroute.costmodel import StepTimeModel
from kvroute.hardware import load_hardware
from kvroute.kvcache.hashing import chain_hashes
from kvroute.sim.engine import Engine, EngineRequest
from kvroute.sim.stream import ConversationStream

from eager_engine import Engine as EagerEngine
from eager_engine import EngineRequest as EagerRequest
from test_pool import check_pool_invariants

# with an admission cost (the CPU build's; 0 on the GPU families), so every step that admits is priced apart
MODEL = replace(StepTimeModel.from_hardware(load_hardware("a6000x4")), admission_s=2e-3)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def blocks_for(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def make_request(rid: int, prompt: int, output: int, bs: int, family: int | None = None, shared: int = 0) -> EngineRequest:
    """A request whose first ``shared`` tokens are common to its ``family``; the rest is unique.

    Hashes cover prompt + reply full blocks, as the simulator builds them.
    """
    contents = []
    for i in range((prompt + output) // bs):
        if family is not None and (i + 1) * bs <= shared:
            contents.append((family, i))
        else:
            contents.append((1000 + rid, i))
    return EngineRequest(rid, prompt, output, chain_hashes(contents))


def linear_match(pool, hashes) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in pool.cached:
        n += 1
    return n


def check_blocks(eng: Engine, extra=()) -> None:
    """Block accounting between steps: pool refs are exactly the requests' holdings;
    cached chains are prefix-closed, so the pool's binary-search match is exact."""
    check_pool_invariants(eng.pool)
    for r in [*eng.running, *eng.waiting, *extra]:
        assert eng.pool.num_cached_blocks(r.hashes) == linear_match(eng.pool, r.hashes), "cached chain has a gap"
    bs = eng.block_size
    held = Counter(b for r in eng.running for b in r.blocks)
    for r in eng.waiting:
        assert r.blocks == [], f"waiting request {r.rid} holds blocks"
    assert held == Counter({b: n for b, n in enumerate(eng.pool.ref) if n > 0}), "pool refs != request holdings"
    for r in eng.running:
        # enough blocks for the computed tokens, at most one step ahead (nothing leaked
        # from a fast-path reservation)
        assert blocks_for(r.num_computed, bs) <= len(r.blocks) <= max(1, blocks_for(r.num_computed + 1, bs)), (
            r.rid, r.num_computed, len(r.blocks))
        assert len(set(r.blocks)) == len(r.blocks)
        # registered blocks carry the request's own chain hashes
        for i in range(r.num_cached_blocks):
            assert eng.pool.block_hash[r.blocks[i]] == r.hashes[i]


def check_plan(eng: Engine, plan) -> None:
    """Scheduling limits of one plan: token budget, sequence cap, sane step times."""
    toks = [n for _, n in plan.sched]
    assert plan.sched, "empty plan"
    assert all(n >= 1 for n in toks)
    assert sum(toks) <= eng.budget, f"{sum(toks)} tokens > max_num_batched_tokens={eng.budget}"
    assert len(eng.running) <= eng.max_seqs, f"{len(eng.running)} running > max_num_seqs={eng.max_seqs}"
    ids = [id(r) for r, _ in plan.sched]
    assert len(set(ids)) == len(ids), "a request scheduled twice in one step"
    assert all(any(r is x for x in eng.running) for r, _ in plan.sched)
    for r, n in plan.sched:
        assert r.num_computed + n <= r.prompt_tokens + r.output_tokens - 1
        assert len(r.blocks) >= blocks_for(r.num_computed + n, eng.block_size)
    ends = plan.ends
    assert len(ends) >= 1 and ends[0] > 0 and np.all(np.diff(ends) > 0), "time goes backwards"
    if len(ends) > 1:
        assert plan.decode_only and all(n == 1 for n in toks)
        need = 0
        for r, _ in plan.sched:  # the free queue can supply every step of the run
            need += max(0, blocks_for(r.num_computed + len(ends), eng.block_size) - len(r.blocks))
            assert r.output_tokens - r.num_generated >= len(ends)
        assert need <= eng.pool.num_free_blocks


@dataclass
class Trace:
    finished: list[EngineRequest] = field(default_factory=list)
    first: list[EngineRequest] = field(default_factory=list)
    plans: int = 0
    fast_plans: int = 0
    interrupts: int = 0
    end_s: float = 0.0


def drive(eng: Engine, arrivals: list[tuple[float, EngineRequest]], cut=None, max_plans: int = 100_000) -> Trace:
    """Run ``eng`` until every request has arrived and the engine is idle.

    ``cut(plan) -> steps`` optionally interrupts a multi-step plan early; otherwise a
    fast-path run is cut at an arrival (as the cluster driver does).
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    tr = Trace()
    t = 0.0
    while pending or not eng.idle:
        while pending and pending[0][0] <= t:
            a, r = pending.pop(0)
            r.arrival_s = a
            eng.add(r)
        if eng.idle:
            t = pending[0][0]
            continue
        eng.now = t
        plan = eng.plan()
        tr.plans += 1
        assert tr.plans < max_plans, "engine does not make progress"
        check_plan(eng, plan)
        k = len(plan.ends)
        tr.fast_plans += k > 1
        steps = k
        if k > 1 and cut is not None:
            steps = cut(plan)
        elif k > 1 and pending and pending[0][0] < t + float(plan.ends[-1]):
            done = int(np.searchsorted(plan.ends, pending[0][0] - t, side="right"))
            steps = min(done + 1, k)
        assert 1 <= steps <= k
        tr.interrupts += steps < k
        first, done = eng.commit(plan, steps, t)
        t_new = t + float(plan.ends[steps - 1])
        assert t_new > t
        t = t_new
        for r in first:
            assert r.first_token_s == t
        for r in done:
            assert r.finish_s == t
            assert all(r is not x for x in eng.running)
            assert r.blocks == []
        tr.first += first
        tr.finished += done
        check_blocks(eng)
    tr.end_s = t
    return tr


def check_finished(eng: Engine, reqs: list[EngineRequest], tr: Trace) -> None:
    """End-of-run properties: each request finished once, complete, consistent times, pool empty."""
    bs = eng.block_size
    counts = Counter(r.rid for r in tr.finished)
    assert counts == Counter(r.rid for r in reqs), "not every request finished exactly once"
    for r in reqs:
        assert r.num_generated == r.output_tokens
        assert r.num_computed == r.prompt_tokens + r.output_tokens - 1
        assert 0 <= r.cached_tokens < r.prompt_tokens, "at least one prompt token is recomputed"
        assert r.cached_tokens % bs == 0
        assert r.arrival_s <= r.start_s <= r.first_token_s <= r.finish_s <= tr.end_s
        assert r.first_token_s > r.arrival_s
    check_blocks(eng, extra=reqs)  # finished chains, some partly evicted, stay prefix-closed
    assert eng.pool.num_used_blocks == 0
    assert all(n == 0 for n in eng.pool.ref)
    check_pool_invariants(eng.pool)
    assert eng.idle
    assert eng.prefix_hits == sum(r.cached_tokens for r in reqs)
    assert eng.prefix_queries == sum(r.prompt_tokens for r in reqs)


# -- strategies -----------------------------------------------------------------


@st.composite
def scenarios(draw, min_blocks: int = 2, max_blocks: int = 64):
    """A small engine and a request set in which every request fits the pool on its own."""
    bs = draw(st.sampled_from([4, 16]))
    num_blocks = draw(st.integers(min_blocks, max_blocks))
    budget = draw(st.integers(4, 256))
    max_seqs = draw(st.integers(1, 8))
    n = draw(st.integers(1, 8))
    cap = num_blocks * bs  # tokens a single request may hold
    reqs, arrivals = [], []
    for rid in range(n):
        prompt = draw(st.integers(1, min(200, cap)))
        output = draw(st.integers(1, min(40, cap - prompt + 1)))
        family = draw(st.one_of(st.none(), st.integers(0, 1)))
        shared = draw(st.integers(0, prompt))
        r = make_request(rid, prompt, output, bs, family, shared)
        assert blocks_for(prompt + output - 1, bs) <= num_blocks
        reqs.append(r)
        arrivals.append((draw(st.floats(0.0, 0.3)), r))
    return (bs, num_blocks, budget, max_seqs), arrivals


def engine(bs: int, num_blocks: int, budget: int, max_seqs: int) -> Engine:
    return Engine("e", MODEL, num_blocks, bs, budget, max_seqs)


# -- properties -----------------------------------------------------------------


@FAST
@given(scenarios())
def test_every_request_finishes_once_with_consistent_accounting(sc):
    """Random request sets on small pools/budgets: every request finishes exactly once
    with all its tokens, cached tokens are whole blocks below the prompt length,
    time only moves forward, the limits hold in every plan and the pool ends empty."""
    cfg, arrivals = sc
    eng = engine(*cfg)
    tr = drive(eng, arrivals)
    check_finished(eng, [r for _, r in arrivals], tr)
    event(f"preempted={eng.num_preemptions > 0}")
    event(f"interrupted={tr.interrupts > 0}")
    event(f"prefix hit={eng.prefix_hits > 0}")


@FAST
@given(scenarios(), st.data())
def test_random_fast_path_interrupts_keep_block_accounting(sc, data):
    """Cutting fast-path runs at random steps releases the unused reservations:
    refs always equal the requests' holdings and every request still completes."""
    cfg, arrivals = sc
    eng = engine(*cfg)
    tr = drive(eng, arrivals, cut=lambda plan: data.draw(st.integers(1, len(plan.ends)), label="steps"))
    check_finished(eng, [r for _, r in arrivals], tr)


def _eager_abort(eng: EagerEngine, r) -> bool:
    """What the emulator did to abort a request before Engine.abort existed."""
    if r in eng.waiting:
        eng.waiting.remove(r)
    elif r in eng.running:
        eng.running.remove(r)
        eng.pool.free_blocks(reversed(r.blocks))
        r.blocks = []
    else:
        return False
    return True


def _state(eng, reqs) -> tuple:
    """Everything a step could change, as comparable values."""
    pool = eng.pool
    per_request = [(r.rid, r.num_computed, r.num_generated, list(r.blocks), r.num_cached_blocks, r.cached_tokens,
                    r.preemptions, r.start_s, r.first_token_s, r.finish_s) for r in reqs]
    return (per_request, [r.rid for r in eng.running], [r.rid for r in eng.waiting], pool.ref.tolist(),
            list(pool.block_hash), sorted(pool.cached.items()), pool.free, pool.num_evictions,
            eng.prefix_queries, eng.prefix_hits, eng.num_preemptions, eng.busy_s, eng.pending_prefill_tokens(),
            eng.queue_delay_s(7))


@FAST
@given(scenarios(), st.data())
def test_lazy_engine_equals_the_eager_one(sc, data):
    """The engine's lazy decode accounting against the eager engine it replaced
    (tests/eager_engine.py), driven side by side through arrivals, runs cut at random
    steps, finishes, preemptions and aborts: the same plans bit for bit, the same first
    tokens and finishes, and after every commit the same request counts (materialised
    from the step counter), block holdings, pool maps, free queue and counters."""
    cfg, arrivals = sc
    bs, num_blocks, budget, max_seqs = cfg
    if data.draw(st.booleans(), label="tight budget"):  # fewer tokens than sequences: the batch's tail waits
        budget = data.draw(st.integers(1, 6), label="budget")
        cfg = (bs, num_blocks, budget, max_seqs)
    lazy, eager = engine(*cfg), EagerEngine("e", MODEL, num_blocks, bs, budget, max_seqs)
    copies = {r.rid: EagerRequest(r.rid, r.prompt_tokens, r.output_tokens, list(r.hashes)) for _, r in arrivals}
    pending = sorted(arrivals, key=lambda a: a[0])
    t = 0.0
    plans = 0
    while pending or not lazy.idle:
        while pending and pending[0][0] <= t:
            a, r = pending.pop(0)
            lazy.add(r)
            eager.add(copies[r.rid])
        if lazy.idle:
            assert eager.idle
            t = pending[0][0]
            continue
        if data.draw(st.integers(0, 9), label="abort?") == 0:
            victim = data.draw(st.sampled_from([r for _, r in arrivals]), label="abort")
            assert lazy.abort(victim) == _eager_abort(eager, copies[victim.rid])
            assert _state(lazy, [r for _, r in arrivals]) == _state(eager, [copies[r.rid] for _, r in arrivals])
            if lazy.idle:
                continue
        lazy.now = eager.now = t
        p, q = lazy.plan(), eager.plan()
        plans += 1
        assert plans < 10_000
        check_plan(lazy, p)
        assert [(r.rid, n) for r, n in p.sched] == [(r.rid, n) for r, n in q.sched]
        assert list(p.ends) == list(q.ends) and p.decode_only == q.decode_only
        steps = data.draw(st.integers(1, len(p.ends)), label="steps")
        f1, d1 = lazy.commit(p, steps, t)
        f2, d2 = eager.commit(q, steps, t)
        assert [r.rid for r in f1] == [r.rid for r in f2] and [r.rid for r in d1] == [r.rid for r in d2]
        assert _state(lazy, [r for _, r in arrivals]) == _state(eager, [copies[r.rid] for _, r in arrivals])
        check_blocks(lazy)
        t += float(p.ends[steps - 1])


@FAST
@given(
    bs=st.sampled_from([4, 16]),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 3),
    sizes=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 20)), min_size=1, max_size=6),
)
def test_tight_budget_and_seq_cap_are_respected(bs, budget, max_seqs, sizes):
    """With a tiny token budget and sequence cap (all requests queued at t=0), every
    plan stays within max_num_batched_tokens and max_num_seqs (checked in drive)."""
    eng = engine(bs, 256, budget, max_seqs)
    reqs = [make_request(i, p, o, bs) for i, (p, o) in enumerate(sizes)]
    tr = drive(eng, [(0.0, r) for r in reqs])
    check_finished(eng, reqs, tr)
    # chunked prefill: a prompt longer than the budget takes several steps
    assert tr.plans >= max(-(-p // budget) for p, _ in sizes)


@settings(max_examples=30, deadline=None)
@given(
    bs=st.sampled_from([4, 16]),
    output=st.integers(2, 40),
    prompts=st.lists(st.integers(1, 100), min_size=2, max_size=6),
    data=st.data(),
)
def test_preemption_when_pool_too_small_and_everything_finishes(bs, output, prompts, data):
    """All requests fit and are admitted together but their full contexts do not fit
    at once, so the engine must preempt (recompute) and still finish everything."""
    reqs = [make_request(i, p, output, bs) for i, p in enumerate(prompts)]
    fit_prompts = sum(blocks_for(p, bs) for p in prompts)
    fit_all = sum(blocks_for(p + output - 1, bs) for p in prompts)
    largest = max(blocks_for(p + output - 1, bs) for p in prompts)
    lo = max(fit_prompts, largest)
    assume(lo < fit_all)  # otherwise the outputs are too short to outgrow any fitting pool
    num_blocks = data.draw(st.integers(lo, fit_all - 1), label="num_blocks")
    eng = engine(bs, num_blocks, sum(prompts), len(prompts))
    tr = drive(eng, [(0.0, r) for r in reqs])
    check_finished(eng, reqs, tr)
    assert eng.num_preemptions > 0
    assert eng.num_preemptions == sum(r.preemptions for r in reqs)


def test_preemption_example():
    """Three 8-token prompts decoding 20 tokens each need 3 x 7 blocks; 10 blocks force
    recompute preemption, the earliest admitted request is never the victim."""
    eng = engine(4, 10, 64, 8)
    reqs = [make_request(i, 8, 20, 4) for i in range(3)]
    tr = drive(eng, [(0.0, r) for r in reqs])
    check_finished(eng, reqs, tr)
    assert eng.num_preemptions > 0
    assert reqs[0].preemptions == 0
    assert reqs[0].finish_s < reqs[2].finish_s


def test_request_needing_whole_pool_finishes():
    """A request whose context needs exactly every block of the pool runs to completion."""
    eng = engine(4, 5, 64, 4)
    r = make_request(0, 10, 11, 4)  # 10 + 11 - 1 = 20 tokens = 5 blocks
    other = make_request(1, 3, 5, 4)
    tr = drive(eng, [(0.0, r), (0.0, other)])
    check_finished(eng, [r, other], tr)


# -- prefix cache ---------------------------------------------------------------


def _conversation_request(rid: int, stream: ConversationStream, prompt: int, output: int) -> EngineRequest:
    return EngineRequest(rid, prompt, output, stream.chain(prompt + output))


def test_shared_system_prompt_hits_full_blocks():
    """A request sharing a 1000-token system prompt with a finished one hits its
    62 full blocks (992 tokens); the next turn of the same chat also hits the
    computed blocks of the previous reply."""
    bs = 16
    eng = engine(bs, 512, 2048, 8)
    s0 = ConversationStream("sys", 1000, bs)
    s0.add_user(0, 0, 50)
    s0.add_assistant(0, 0, 20)
    r0 = _conversation_request(0, s0, 1050, 20)
    tr = drive(eng, [(0.0, r0)])
    assert r0.cached_tokens == 0

    s1 = ConversationStream("sys", 1000, bs)
    s1.add_user(1, 0, 70)
    s1.add_assistant(1, 0, 10)
    r1 = _conversation_request(1, s1, 1070, 10)
    tr2 = drive(eng, [(tr.end_s + 1.0, r1)])
    assert r1.cached_tokens == 992

    s0.add_user(0, 1, 30)  # turn 2 of chat 0: history (1070 tokens) + 30
    s0.add_assistant(0, 1, 5)
    r2 = _conversation_request(2, s0, 1100, 5)
    tr3 = drive(eng, [(tr2.end_s + 1.0, r2)])
    # turn 1 computed 1050 + 20 - 1 tokens -> 66 full blocks are cached
    assert r2.cached_tokens == 16 * ((1050 + 20 - 1) // 16) == 1056
    other = ConversationStream("other-sys", 1000, bs)
    other.add_user(3, 0, 10)
    r3 = _conversation_request(3, other, 1010, 1)
    drive(eng, [(tr3.end_s + 1.0, r3)])
    assert r3.cached_tokens == 0
    assert eng.prefix_hits == 992 + 1056
    assert r1.first_token_s - r1.arrival_s < r0.first_token_s - r0.arrival_s  # the hit saves prefill time


def test_identical_prompt_recomputes_last_token():
    """Repeating a block-aligned prompt hits all but its last block: the last prompt
    token is always recomputed so the engine can sample from it."""
    bs = 16
    eng = engine(bs, 64, 2048, 8)
    a = make_request(0, 64, 4, bs, family=7, shared=64)
    b = make_request(1, 64, 4, bs, family=7, shared=64)
    tr = drive(eng, [(0.0, a)])
    drive(eng, [(tr.end_s, b)])
    assert a.cached_tokens == 0
    assert b.cached_tokens == 48


def test_concurrent_shared_prefix_hits_running_request_blocks():
    """A prefix computed by a still-running request is shared (refcount 2), not copied."""
    bs = 4
    eng = engine(bs, 32, 256, 8)
    a = make_request(0, 16, 30, bs, family=1, shared=16)
    b = make_request(1, 18, 3, bs, family=1, shared=16)
    eng.add(a)
    eng.now = 0.0
    plan = eng.plan()
    eng.commit(plan, 1, 0.0)  # a's prefill
    eng.add(b)
    plan = eng.plan()
    assert b.cached_tokens == 16
    assert b.blocks[:4] == a.blocks[:4]
    assert all(eng.pool.ref[x] == 2 for x in a.blocks[:4])
    check_blocks(eng)


# -- the fast path --------------------------------------------------------------


def _run_lockstep(eng: Engine, reqs: list[EngineRequest], single: bool) -> dict[int, float]:
    for r in reqs:
        eng.add(r)
    t = 0.0
    while not eng.idle:
        eng.now = t
        plan = eng.plan()
        check_plan(eng, plan)
        steps = 1 if single else len(plan.ends)
        eng.commit(plan, steps, t)
        t += float(plan.ends[steps - 1])
        check_blocks(eng)
    return {r.rid: r.finish_s for r in reqs}


@settings(max_examples=40, deadline=None)
@given(
    bs=st.sampled_from([4, 16]),
    max_seqs=st.integers(1, 6),
    budget=st.integers(1, 300),
    sizes=st.lists(st.tuples(st.integers(1, 150), st.integers(1, 60)), min_size=1, max_size=6),
)
def test_fast_path_equals_single_stepping(bs, max_seqs, budget, sizes):
    """Committing decode runs whole gives the same first-token and finish times (1e-9)
    as committing every plan one step at a time on an identical engine."""
    def build():
        return [make_request(i, p, o, bs) for i, (p, o) in enumerate(sizes)]

    fast_reqs, slow_reqs = build(), build()
    fast = engine(bs, 1024, budget, max_seqs)
    slow = engine(bs, 1024, budget, max_seqs)
    f = _run_lockstep(fast, fast_reqs, single=False)
    s = _run_lockstep(slow, slow_reqs, single=True)
    for a, b in zip(fast_reqs, slow_reqs):
        assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-9)
        assert f[a.rid] == pytest.approx(s[b.rid], abs=1e-9)
    assert fast.busy_s == pytest.approx(slow.busy_s, abs=1e-9)


def test_fast_path_plans_a_whole_decode_run():
    """With nothing to admit and everyone decoding, one plan covers the steps until the
    first finish, and its step times match step_time called one step at a time."""
    bs = 16
    eng = engine(bs, 256, 2048, 8)
    a, b = make_request(0, 40, 30, bs), make_request(1, 10, 12, bs)
    eng.add(a)
    eng.add(b)
    eng.now = 0.0
    plan = eng.plan()  # both prefills in one step
    assert not plan.decode_only and len(plan.ends) == 1
    first, _ = eng.commit(plan, 1, 0.0)
    assert set(first) == {a, b}
    plan = eng.plan()
    assert plan.decode_only and len(plan.ends) == 11  # b has 11 tokens left
    ctx = a.num_computed + 1 + b.num_computed + 1
    expect = np.cumsum([MODEL.step_time(2, ctx + 2 * i, ()) for i in range(11)])
    assert np.allclose(plan.ends, expect, rtol=0, atol=1e-12)
    _, done = eng.commit(plan, 11, 0.0)
    assert done == [b]
    check_blocks(eng)


def test_interrupted_fast_path_takes_only_blocks_for_steps_run():
    """Planning a fast-path run takes no blocks beyond the first step's; committing part
    of it takes blocks only for the steps that ran, so each request holds exactly what
    its computed tokens and next step need."""
    bs = 4
    eng = engine(bs, 64, 256, 8)
    a, b = make_request(0, 5, 40, bs), make_request(1, 9, 30, bs)
    eng.add(a)
    eng.add(b)
    eng.now = 0.0
    eng.commit(eng.plan(), 1, 0.0)
    plan = eng.plan()
    assert len(plan.ends) == 29
    assert len(a.blocks) == blocks_for(5 + 1, bs) and len(b.blocks) == blocks_for(9 + 1, bs)
    eng.commit(plan, 3, 0.0)
    assert a.num_computed == 8 and b.num_computed == 12
    assert len(a.blocks) == blocks_for(8, bs) and len(b.blocks) == blocks_for(12, bs)
    assert eng.pool.num_used_blocks == len(a.blocks) + len(b.blocks)
    check_blocks(eng)
    drive(eng, [])
    check_finished(eng, [a, b], Trace(finished=[a, b], end_s=max(a.finish_s, b.finish_s)))


def test_interrupted_fast_path_does_not_evict_more_than_single_stepping():
    """The fast path is an optimisation: after running one step of a decode run, the
    prefix cache must be what one single step would leave. Here a finished request's
    10 cached blocks sit in the free queue; a new request's first decode step needs no
    new block, yet reserving 29 steps up front evicts 6 of them for good."""
    bs = 4
    eng = engine(bs, 12, 64, 8)
    a = make_request(0, 40, 1, bs)
    tr = drive(eng, [(0.0, a)])
    hs = a.hashes[:10]
    assert eng.pool.num_cached_blocks(hs) == 10
    b = make_request(1, 3, 30, bs)
    t = tr.end_s
    eng.add(b)
    eng.now = t
    plan = eng.plan()
    eng.commit(plan, 1, t)  # b's prefill: 1 block (an uncached one)
    t += float(plan.ends[0])
    assert eng.pool.num_cached_blocks(hs) == 10
    eng.now = t
    plan = eng.plan()
    assert len(plan.ends) == 29
    eng.commit(plan, 1, t)  # interrupted after one step (e.g. an arrival)
    check_blocks(eng)
    # one decode step (4 -> 5 tokens) needs 1 more block, and an unhashed one is free
    assert eng.pool.num_cached_blocks(hs) == 10


def test_a_step_that_admits_requests_costs_admission_s_more_for_each():
    """Admission is engine time in the step that admits (vLLM's, a few ms on the CPU build),
    so a decoder batched with two new requests waits for both; a long prompt's later chunk,
    and every step that admits nothing, cost what they would without it."""
    bs, budget = 16, 64
    durations = {}
    for name, model in (("admits", MODEL), ("free", replace(MODEL, admission_s=0.0))):
        eng = Engine("e", model, 256, bs, budget, 8)
        eng.add(make_request(0, 20, 30, bs))
        steps: list[float] = []
        plans = 0
        while not eng.idle:
            eng.now = 0.0
            plan = eng.plan()
            steps += np.diff([0.0, *plan.ends]).tolist()
            eng.commit(plan, len(plan.ends) if plans else 1, 0.0)
            if plans == 0:  # r0 decodes while two arrive: 40 tokens, and 100 in two chunks
                eng.add(make_request(1, 40, 5, bs))
                eng.add(make_request(2, 100, 5, bs))
            plans += 1
        durations[name] = steps
    extra = np.array(durations["admits"]) - np.array(durations["free"])
    assert extra[:2] == pytest.approx([MODEL.admission_s, 2 * MODEL.admission_s])
    assert extra[2:] == pytest.approx(np.zeros(len(extra) - 2), abs=1e-15)
    assert len(extra) > 3  # r2's second chunk, then decode steps
