"""Policy behaviour: properties over random views and hand-computed examples."""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies import (
    POLICY_NAMES,
    HashRing,
    NoWorkerUpError,
    RouteRequest,
    make_policy,
)


@dataclass
class FakeView:
    """A ClusterView built from dicts; missing entries read as 0 / up / empty.

    ``prefill_time_s`` is linear: ``overhead + per_token * tokens`` (0 tokens -> 0 s).
    ``matched`` is per worker, whatever the request.
    """

    workers: Sequence[str]
    down: set[str] = field(default_factory=set)
    inflight: dict[str, int] = field(default_factory=dict)
    waits: dict[str, int] = field(default_factory=dict)
    active: dict[str, int] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)
    delay: dict[str, float] = field(default_factory=dict)
    matched: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)
    per_token_s: float = 1e-4
    overhead_s: float = 0.0
    exact: bool = True
    block_size: int = 16

    def is_up(self, worker: str) -> bool:
        return worker not in self.down

    def in_flight(self, worker: str) -> int:
        return self.inflight.get(worker, 0)

    def waiting(self, worker: str) -> int:
        return self.waits.get(worker, 0)

    def active_blocks(self, worker: str) -> int:
        return self.active.get(worker, 0)

    def kv_usage(self, worker: str) -> float:
        return self.usage.get(worker, 0.0)

    def queue_delay_s(self, worker: str) -> float:
        return self.delay.get(worker, 0.0)

    def matched_tokens(self, worker: str, request: RouteRequest) -> int:
        return self.matched.get(worker, 0)

    def index_size(self, worker: str) -> int:
        return self.sizes.get(worker, 0)

    def prefill_time_s(self, worker: str, tokens: int) -> float:
        return self.overhead_s + self.per_token_s * tokens if tokens > 0 else 0.0

    def session_worker(self, session_id: str) -> str | None:
        return self.sessions.get(session_id)


def names(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def req(session: str = "s", prompt: int = 1000, turn: int = 0) -> RouteRequest:
    return RouteRequest(request_id=f"{session}-{turn}", session_id=session, turn=turn,
                        prompt_tokens=prompt)


def policy(spec: str, seed: int = 0):
    return make_policy(spec, np.random.default_rng(seed))


# Every registered policy, plus non-default parameters that change code paths.
ALL_SPECS = [
    *POLICY_NAMES,
    "hybrid_sticky:threshold_ms=0",
    "cost_aware:alpha=0",
    "cost_aware:alpha=1e6",
    "prefix_approx:balance_abs_threshold=0,balance_rel_threshold=1",
    "prefix_approx:cache_threshold=0",
    "dynamo:temperature=0.5",
    "dynamo:overlap_weight=0",
    "loadaware:beta=0",
    "weighted:session=1,load=1,prefix_source=history,max_blocks=2",
    "weighted:prefix_norm=minmax",
]


@st.composite
def views(draw, min_up: int = 1) -> FakeView:
    n = draw(st.integers(1, 8))
    ws = names(n)
    down = draw(st.sets(st.sampled_from(ws), max_size=n - min_up))
    ints = st.integers(0, 300)

    def per_worker(values):
        return {w: draw(values) for w in ws}

    sessions = {f"s{i}": draw(st.sampled_from(ws)) for i in range(draw(st.integers(0, 3)))}
    return FakeView(
        workers=ws, down=set(down), inflight=per_worker(ints), waits=per_worker(ints),
        active=per_worker(st.integers(0, 5000)), usage=per_worker(st.floats(0, 1)),
        delay=per_worker(st.floats(0, 30, allow_nan=False)),
        matched=per_worker(st.integers(0, 2000)), sizes=per_worker(st.integers(0, 10**5)),
        sessions=sessions, overhead_s=draw(st.sampled_from([0.0, 0.005])),
    )


# ---------------------------------------------------------------- every policy


@settings(max_examples=25, deadline=None)
@given(view=views(), session=st.sampled_from(["s0", "s1", "new"]),
       prompt=st.integers(0, 2000), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_returns_an_up_worker_and_leaves_view_alone(spec, view, session, prompt, seed):
    before = copy.deepcopy(view)
    p = policy(spec, seed)
    for turn in range(3):
        w = p.choose(req(session, prompt, turn), view)
        assert w in view.workers and view.is_up(w)
    assert view == before


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_raises_when_no_worker_is_up(spec):
    view = FakeView(workers=names(3), down=set(names(3)))
    with pytest.raises(NoWorkerUpError, match="no worker is up"):
        policy(spec).choose(req(), view)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_same_seed_same_decisions(spec):
    view = FakeView(workers=names(4), inflight={"w1": 2, "w3": 2},
                    active={"w0": 3, "w2": 3}, matched={"w0": 64, "w2": 64})
    runs = [[policy(spec, seed=7).choose(req(f"s{i}"), view) for i in range(50)]
            for _ in range(2)]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------- baselines


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), requests=st.integers(0, 200))
def test_round_robin_keeps_counts_within_one(n, requests):
    view = FakeView(workers=names(n))
    p = policy("round_robin")
    counts = Counter(p.choose(req(f"s{i}"), view) for i in range(requests))
    loads = [counts[w] for w in view.workers]
    assert max(loads) - min(loads) <= 1


def test_round_robin_skips_a_down_worker_in_order():
    view = FakeView(workers=names(3))
    p = policy("round_robin")
    assert [p.choose(req(), view) for _ in range(3)] == ["w0", "w1", "w2"]
    view.down = {"w1"}
    assert [p.choose(req(), view) for _ in range(4)] == ["w0", "w2", "w0", "w2"]


def test_random_is_roughly_uniform_over_up_workers():
    view = FakeView(workers=names(4), down={"w3"})
    p = policy("random", seed=1)
    counts = Counter(p.choose(req(), view) for _ in range(3000))
    assert set(counts) == {"w0", "w1", "w2"}
    assert all(900 < c < 1100 for c in counts.values())


def test_least_loaded_breaks_ties_by_lowest_index():
    view = FakeView(workers=names(4), inflight={"w0": 3, "w1": 1, "w2": 1, "w3": 2})
    assert policy("least_loaded").choose(req(), view) == "w1"
    view.down = {"w1"}
    assert policy("least_loaded").choose(req(), view) == "w2"


# ---------------------------------------------------------------- sticky


def test_sticky_is_stable_and_spreads_sessions():
    view = FakeView(workers=names(4))
    p = policy("sticky")
    first = {f"conv-{i}": p.choose(req(f"conv-{i}"), view) for i in range(1000)}
    again = {s: p.choose(req(s, turn=1), view) for s in first}
    assert first == again
    shares = Counter(first.values())
    assert all(150 <= shares[w] <= 350 for w in view.workers), shares


def test_sticky_hash_is_process_independent():
    # Pinned values: a salted hash (Python's str hash) would change these per process.
    ring = HashRing(names(4))
    got = [ring.lookup(f"conv-{i}", lambda w: True) for i in range(8)]
    assert got == PINNED_RING


PINNED_RING = ["w3", "w3", "w0", "w1", "w0", "w0", "w0", "w3"]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 8), data=st.data())
@pytest.mark.parametrize("spec", ["sticky", "consistent_hash"])  # vllm-router's ring: the same rule
def test_sticky_moves_only_the_down_workers_sessions(spec, n, data):
    view = FakeView(workers=names(n))
    p = policy(spec)
    sessions = [f"conv-{i}" for i in range(200)]
    before = {s: p.choose(req(s), view) for s in sessions}
    gone = data.draw(st.sampled_from(view.workers))
    view.down = {gone}
    after = {s: p.choose(req(s), view) for s in sessions}
    assert {s for s in sessions if after[s] != before[s]} == {s for s in sessions if before[s] == gone}
    assert gone not in after.values()
    view.down = set()
    assert {s: p.choose(req(s), view) for s in sessions} == before


# ---------------------------------------------------------------- hybrid_sticky


@pytest.mark.parametrize("threshold_ms", [0.0, 300.0, 500.0, 5000.0])
def test_hybrid_switches_exactly_at_the_threshold(threshold_ms):
    limit = threshold_ms / 1000
    view = FakeView(workers=names(3), sessions={"s": "w2"}, inflight={"w0": 5, "w1": 4, "w2": 0})
    p = policy(f"hybrid_sticky:threshold_ms={threshold_ms:g}")
    view.delay = {"w2": limit}
    assert p.choose(req("s"), view) == "w2"
    view.delay = {"w2": math.nextafter(limit, math.inf)}
    # over the threshold: least-loaded among the others, even though w2 has fewest in flight
    assert p.choose(req("s"), view) == "w1"


def test_hybrid_uses_the_ring_for_an_unknown_or_down_session_worker():
    view = FakeView(workers=names(4))
    ring = policy("sticky")
    home = ring.choose(req("fresh"), view)
    assert policy("hybrid_sticky").choose(req("fresh"), view) == home
    view.sessions = {"fresh": "gone-worker"}
    assert policy("hybrid_sticky").choose(req("fresh"), view) == home
    other = next(w for w in view.workers if w != home)
    view.sessions = {"fresh": other}
    view.down = {other}
    assert policy("hybrid_sticky").choose(req("fresh"), view) == home


def test_hybrid_stays_when_home_is_the_only_worker_up():
    view = FakeView(workers=names(2), down={"w1"}, sessions={"s": "w0"}, delay={"w0": 99.0})
    assert policy("hybrid_sticky").choose(req("s"), view) == "w0"


# ---------------------------------------------------------------- cost_aware


@settings(max_examples=40, deadline=None)
@given(view=views(), overhead=st.sampled_from([0.0, 0.01]))
def test_cost_aware_alpha_extremes(view, overhead):
    view.overhead_s = overhead
    up = [w for w in view.workers if view.is_up(w)]
    r = req(prompt=2500)
    w0 = policy("cost_aware:alpha=0").choose(r, view)
    assert view.matched_tokens(w0, r) == max(view.matched_tokens(w, r) for w in up)
    delays = sorted({view.queue_delay_s(w) for w in up})
    if len(delays) > 1 and delays[1] - delays[0] > 1e-6:
        w_big = policy("cost_aware:alpha=1e9").choose(r, view)
        assert view.queue_delay_s(w_big) == delays[0]


def test_cost_aware_alpha_one_minimises_estimated_ttft():
    # TTFT(w) = delay + prefill(P - m): w0 = 0.30 + 0.10, w1 = 0.05 + 0.30, w2 = 0 + 0.50
    view = FakeView(workers=names(3), delay={"w0": 0.30, "w1": 0.05},
                    matched={"w0": 4000, "w1": 2000}, per_token_s=1e-4, overhead_s=0.02)
    r = req(prompt=5000)
    assert policy("cost_aware").choose(r, view) == "w1"
    assert policy("cost_aware:alpha=0.25").choose(r, view) == "w0"
    assert policy("cost_aware:alpha=100").choose(r, view) == "w2"


class CausalView(FakeView):
    """prefill(n tokens after c cached) = a*n + b*n*(c + n/2): linear + causal attention."""

    a, b = 1e-4, 2e-8

    def cost(self, n: int, context: int = 0) -> float:
        return self.a * n + self.b * n * (context + n / 2)

    def prefill_time_s(self, worker: str, tokens: int) -> float:
        return self.cost(tokens)


@settings(max_examples=40, deadline=None)
@given(view=views(), prompt=st.integers(1, 8000))
def test_cost_aware_alpha_one_picks_min_ttft_under_causal_attention(view, prompt):
    view = CausalView(**vars(view))
    r = req(prompt=prompt)
    up = [w for w in view.workers if view.is_up(w)]

    def ttft(w: str) -> float:
        m = min(view.matched_tokens(w, r), prompt)
        return view.queue_delay_s(w) + view.cost(prompt - m, context=m)

    chosen = policy("cost_aware").choose(r, view)
    assert ttft(chosen) <= min(ttft(w) for w in up) + 1e-6


def test_cost_aware_ties_go_to_fewest_in_flight_then_lowest_index():
    view = FakeView(workers=names(3), inflight={"w0": 2, "w1": 1, "w2": 1})
    assert policy("cost_aware").choose(req(), view) == "w1"


# ---------------------------------------------------------------- kv_aware


def test_kv_aware_takes_longest_match_and_breaks_ties_by_load_then_index():
    view = FakeView(workers=names(4), matched={"w0": 32, "w1": 512, "w2": 512, "w3": 512},
                    inflight={"w1": 3, "w2": 1, "w3": 1})
    assert policy("kv_aware").choose(req(), view) == "w2"
    view.matched = {}  # nothing anywhere: least loaded
    assert policy("kv_aware").choose(req(), view) == "w0"


def test_kv_aware_shared_system_prompt_ties_every_worker():
    view = FakeView(workers=names(3), matched={w: 256 for w in names(3)},
                    inflight={"w0": 2, "w1": 2, "w2": 1})
    assert policy("kv_aware").choose(req(), view) == "w2"


# ---------------------------------------------------------------- prefix_approx (SGLang)


def test_prefix_approx_is_approximate_by_default():
    assert policy("prefix_approx").default_exact is False
    assert policy("kv_aware").default_exact is True


def test_prefix_approx_imbalance_needs_both_thresholds():
    # max - min = 70 > 64 and 80 > 10 * 1.5: shortest queue despite w0's full match
    view = FakeView(workers=names(3), inflight={"w0": 80, "w1": 10, "w2": 30},
                    matched={"w0": 1000})
    assert policy("prefix_approx").choose(req(prompt=1000), view) == "w1"
    # abs gap 70 but relative 170 / 100 = 1.7 > 1.5 -> still imbalanced
    view.inflight = {"w0": 170, "w1": 100, "w2": 120}
    assert policy("prefix_approx").choose(req(prompt=1000), view) == "w1"
    # abs gap 70 but 210 is not > 140 * 1.5 -> balanced: follow the cache
    view.inflight = {"w0": 210, "w1": 140, "w2": 150}
    assert policy("prefix_approx").choose(req(prompt=1000), view) == "w0"
    # relative 3x but abs gap 64 (not > 64) -> balanced
    view.inflight = {"w0": 96, "w1": 32, "w2": 40}
    assert policy("prefix_approx").choose(req(prompt=1000), view) == "w0"


def test_prefix_approx_cache_threshold_then_smallest_index():
    view = FakeView(workers=names(3), matched={"w0": 300, "w1": 100},
                    sizes={"w0": 900, "w1": 50, "w2": 70})
    assert policy("prefix_approx").choose(req(prompt=1000), view) == "w1"  # 0.30 is not > 0.3
    view.matched["w0"] = 301
    assert policy("prefix_approx").choose(req(prompt=1000), view) == "w0"
    assert policy("prefix_approx:cache_threshold=0.5").choose(req(prompt=1000), view) == "w1"


# ---------------------------------------------------------------- dynamo


def test_dynamo_cost_on_a_hand_computed_example():
    # block 16, prompt 100: w0 m=64 -> ceil(36/16)=3 prefill, 10 decode: 1*3+10 = 13
    # w1 m=0 -> ceil(100/16)=7, 4 decode: 11;  w2 m=96 -> ceil(4/16)=1, 12 decode: 13
    view = FakeView(workers=names(3), block_size=16, matched={"w0": 64, "w2": 96},
                    active={"w0": 10, "w1": 4, "w2": 12})
    r = req(prompt=100)
    p = policy("dynamo")
    assert [p.cost(w, r, view) for w in view.workers] == [13, 11, 13]
    assert p.choose(r, view) == "w1"
    # weight 3: 19, 25, 15 -> w2
    p3 = policy("dynamo:overlap_weight=3")
    assert [p3.cost(w, r, view) for w in view.workers] == [19, 25, 15]
    assert p3.choose(r, view) == "w2"


def test_dynamo_ties_go_to_smallest_index_then_random():
    view = FakeView(workers=names(3), sizes={"w0": 5, "w1": 2, "w2": 9})
    assert policy("dynamo").choose(req(), view) == "w1"
    view.sizes = {}
    picks = Counter(policy("dynamo", seed=s).choose(req(), view) for s in range(300))
    assert set(picks) == set(view.workers)


def test_dynamo_temperature_softmax_over_range_normalised_costs():
    # costs 0, 10, 20 -> normalised 0, 0.5, 1 -> p ~ exp(-x / T)
    view = FakeView(workers=names(3), block_size=1, matched={"w0": 100, "w1": 90, "w2": 80})
    T = 0.5
    p = policy(f"dynamo:temperature={T}", seed=3)
    counts = Counter(p.choose(req(prompt=100), view) for _ in range(3000))
    z = np.exp(-np.array([0.0, 0.5, 1.0]) / T)
    expect = z / z.sum()
    for w, e in zip(view.workers, expect):
        assert abs(counts[w] / 3000 - e) < 0.04
    same = FakeView(workers=names(3))
    assert len(Counter(p.choose(req(), same) for _ in range(300))) == 3


# ---------------------------------------------------------------- loadaware (production-stack)


def test_loadaware_score_on_a_hand_computed_example():
    # prompt 1000; loads 6, 2, 1 -> mean 3
    # w0: 0.9 - (6-3)/3 = -0.1; w1: 0.5 - (2-3)/3 = 0.8333; w2: 0.0 - (1-3)/3 = 0.6667
    view = FakeView(workers=names(3), inflight={"w0": 6, "w1": 2, "w2": 1},
                    matched={"w0": 900, "w1": 500})
    assert policy("loadaware").choose(req(prompt=1000), view) == "w1"
    # beta 0: pure match -> w0
    assert policy("loadaware:beta=0").choose(req(prompt=1000), view) == "w0"
    # beta 3: w0 = 0.9 - 3 = -2.1, w1 = 0.5 + 1 = 1.5, w2 = 0 + 2 = 2.0 -> w2
    assert policy("loadaware:beta=3").choose(req(prompt=1000), view) == "w2"


def test_loadaware_mean_below_one_uses_one_and_ties_by_load():
    # loads 0, 1, 0 -> mean 1/3, divisor 1; w0 = w2 = 0 + 1/3, w1 = -2/3
    view = FakeView(workers=names(3), inflight={"w1": 1})
    assert policy("loadaware").choose(req(), view) == "w0"


# ---------------------------------------------------------------- with the approximate index


@pytest.mark.parametrize("warm", [False, True])
def test_kv_aware_over_the_approximate_index_keeps_conversations_home(warm):
    """Turns follow their history. Cold, the first worker to hold the shared system
    prompt out-matches the rest and takes every conversation; once every worker holds
    it, first turns tie and the in-flight tie-break spreads them."""
    from kvroute.kvcache.hashing import chain_hashes
    from kvroute.kvcache.index import ApproxPrefixIndex

    class IndexView(FakeView):
        def matched_tokens(self, worker: str, request: RouteRequest) -> int:
            return index.match_tokens(worker, request.block_hashes, now)

    index = ApproxPrefixIndex(names(3), block_size=16)
    view = IndexView(workers=names(3), exact=False)
    p = policy("kv_aware")
    system = [(0,)] * 4  # a shared 4-block system prompt
    if warm:
        for w in names(3):
            index.record(w, chain_hashes(system), 0.0)
    homes: dict[str, str] = {}
    for turn in range(3):
        for c in range(6):
            now = float(turn * 10 + c)
            blocks = system + [(c, t) for t in range(turn + 1)]
            r = RouteRequest(f"c{c}-{turn}", f"c{c}", turn, 16 * len(blocks),
                             block_hashes=chain_hashes(blocks))
            w = p.choose(r, view)
            homes.setdefault(r.session_id, w)
            assert w == homes[r.session_id]
            index.record(w, r.block_hashes, now)  # the caller's job
            view.inflight[w] = view.inflight.get(w, 0) + 1
    assert len(set(homes.values())) == (3 if warm else 1)
