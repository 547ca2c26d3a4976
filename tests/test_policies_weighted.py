"""The weighted-scorer policy and its llm-d / BLIS presets: each scorer's formula on
hand-built views, the pick and its ties, the presets' documented defaults, and the same
object routing in the simulator and in the gateway."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from pathlib import Path
from typing import ClassVar

import aiohttp
import numpy as np
import pandas as pd
import pytest
import yaml
from test_policies import FakeView, names, policy

from kvroute.experiment import load_experiment
from kvroute.hardware import load_hardware
from kvroute.live.emulator import start_emulator
from kvroute.live.gateway import Gateway
from kvroute.live.view import GatewayView
from kvroute.loadsignal import LoadSignal
from kvroute.policies import POLICY_NAMES, Policy, RouteRequest, make_policy
from kvroute.policies.weighted import (
    PRESETS,
    SCORERS,
    WeightedPolicy,
    inverted_minmax,
    prefix_minmax,
    prefix_ratio,
)
from kvroute.sim.cluster import SimCluster
from kvroute.sim.run import simulate_experiment
from kvroute.workload import generate


def req(session: str = "s", prompt: int = 64, hashes=(1, 2, 3, 4), turn: int = 0) -> RouteRequest:
    return RouteRequest(f"{session}-{turn}", session, turn, prompt, tuple(hashes))


def only(scorer: str, **options) -> WeightedPolicy:
    """A weighted policy with one scorer at weight 1."""
    spec = ",".join([f"{k}={1 if k == scorer else 0}" for k in SCORERS] + [f"{k}={v}" for k, v in options.items()])
    return policy(f"weighted:{spec}")


# ---------------------------------------------------------------- scorer formulas


def test_inverted_minmax_is_the_queue_scorers_formula():
    assert inverted_minmax([4, 2, 0]) == [0.0, 0.5, 1.0]
    assert inverted_minmax([3, 3]) == [1.0, 1.0]  # all equal: neutral 1
    assert inverted_minmax([]) == []


def test_queue_scorer_reads_the_waiting_requests_only():
    view = FakeView(workers=names(3), waits={"w0": 4, "w1": 2}, inflight={"w2": 50})
    assert only("queue").scores(req(), view) == {"w0": 0.0, "w1": 0.5, "w2": 1.0}
    assert only("queue").choose(req(), view) == "w2"  # in flight does not count


def test_load_scorer_reads_in_flight():
    view = FakeView(workers=names(3), inflight={"w0": 6, "w1": 3, "w2": 0}, waits={"w2": 9})
    assert only("load").scores(req(), view) == {"w0": 0.0, "w1": 0.5, "w2": 1.0}


def test_kv_scorer_is_one_minus_usage_clamped():
    view = FakeView(workers=names(3), usage={"w0": 0.25, "w1": 1.5})
    assert only("kv").scores(req(), view) == {"w0": 0.75, "w1": 0.0, "w2": 1.0}


def test_session_scorer_marks_the_previous_worker_only():
    view = FakeView(workers=names(3), sessions={"s": "w1", "gone": "w9"})
    assert only("session").scores(req("s"), view) == {"w0": 0.0, "w1": 1.0, "w2": 0.0}
    assert set(only("session").scores(req("gone"), view).values()) == {0.0}
    assert set(only("session").scores(req("new"), view).values()) == {0.0}


def test_prefix_ratio_from_the_view_is_matched_over_prompt_blocks():
    view = FakeView(workers=names(3), matched={"w0": 32, "w1": 64, "w2": 15}, block_size=16)
    # 4 blocks of 16; a partial block (15 tokens) counts nothing
    assert only("prefix").scores(req(), view) == {"w0": 0.5, "w1": 1.0, "w2": 0.0}
    # no block hashes: the prompt's full blocks by its length (100 tokens -> 6 blocks)
    assert only("prefix").scores(req(prompt=100, hashes=()), view)["w0"] == pytest.approx(2 / 6)
    # max_blocks: only the first 2 blocks are compared, and w0 holds both
    assert only("prefix", max_blocks=2).scores(req(), view) == {"w0": 1.0, "w1": 1.0, "w2": 0.0}
    assert prefix_ratio([3, 0], 0) == [0.0, 0.0]


def test_prefix_minmax_is_llmds_precise_normalisation():
    assert prefix_minmax([10, 5, 0, 5]) == [1.0, 0.0, 0.0, 0.0]  # the least of the hits ties the misses
    assert prefix_minmax([8, 6, 4, 0]) == [1.0, 0.5, 0.0, 0.0]
    assert prefix_minmax([5, 5, 0]) == [1.0, 1.0, 0.0]  # equal hits: 1, however few blocks
    assert prefix_minmax([1, 0]) == [1.0, 0.0]
    assert prefix_minmax([0, 0]) == [0.0, 0.0]
    view = FakeView(workers=names(3), matched={"w0": 160, "w1": 16}, block_size=16)
    assert only("prefix", prefix_norm="minmax").scores(req(hashes=range(10)), view) == {
        "w0": 1.0, "w1": 0.0, "w2": 0.0}


def test_history_prefix_learns_from_its_own_picks_not_from_the_view():
    view = FakeView(workers=names(3), matched={"w2": 64})  # the view's match is ignored
    p = only("prefix", prefix_source="history")
    first = p.choose(req("a", hashes=(1, 2, 3, 4)), view)  # nothing recorded: a three-way tie
    assert p.scores(req("b", hashes=(1, 2, 9, 9)), view) == {w: (0.5 if w == first else 0.0) for w in view.workers}
    assert p.choose(req("c", hashes=(1, 2, 3, 4, 5, 6, 7, 8)), view) == first
    # a policy that never routed knows nothing
    assert set(only("prefix", prefix_source="history").scores(req(), view).values()) == {0.0}


def test_history_evicts_a_chains_head_first_as_llmd_and_blis():
    """Blocks are added head first, so with a capacity below the chain the head goes and
    the whole chain stops matching (llm-d's indexer, BLIS's PrefixCacheIndex)."""
    view = FakeView(workers=names(1))
    p = only("prefix", prefix_source="history", history_blocks=4)
    p.choose(req(hashes=range(6)), view)
    assert p.scores(req(hashes=range(6)), view) == {"w0": 0.0}
    q = only("prefix", prefix_source="history", history_blocks=6)
    q.choose(req(hashes=range(6)), view)
    assert q.scores(req(hashes=range(6)), view) == {"w0": 1.0}


def test_history_records_only_the_first_max_blocks():
    view = FakeView(workers=names(2))
    p = only("prefix", prefix_source="history", max_blocks=2)
    w = p.choose(req(hashes=(1, 2, 3, 4)), view)
    assert p._history.size(w) == 2
    assert p.scores(req(hashes=(1, 2, 7, 7)), view)[w] == 1.0  # beyond block 2 nothing is compared


# ---------------------------------------------------------------- the pick


def test_weights_change_the_pick():
    # w0 holds the prompt, w1 has the shorter queue
    view = FakeView(workers=names(2), matched={"w0": 64}, waits={"w0": 3, "w1": 0})
    assert policy("weighted:prefix=1,queue=0,kv=0").choose(req(), view) == "w0"
    assert policy("weighted:prefix=1,queue=2,kv=0").choose(req(), view) == "w1"
    assert policy("weighted:prefix=2,queue=1,kv=0").choose(req(), view) == "w0"
    scores = policy("weighted:prefix=3,queue=2,kv=2").scores(req(), view)
    assert scores == {"w0": 3 * 1.0 + 2 * 0.0 + 2 * 1.0, "w1": 3 * 0.0 + 2 * 1.0 + 2 * 1.0}


def test_exact_ties_are_drawn_uniformly_from_the_policys_rng():
    view = FakeView(workers=names(4), waits={"w3": 1})  # w0..w2 tie at the top
    p = policy("weighted:prefix=0,queue=1,kv=1", seed=3)
    picks = [p.choose(req(f"s{i}"), view) for i in range(3000)]
    counts = Counter(picks)
    assert set(counts) == {"w0", "w1", "w2"}
    assert all(900 < c < 1100 for c in counts.values()), counts
    again = policy("weighted:prefix=0,queue=1,kv=1", seed=3)
    assert [again.choose(req(f"s{i}"), view) for i in range(3000)] == picks
    other = policy("weighted:prefix=0,queue=1,kv=1", seed=4)
    assert [other.choose(req(f"s{i}"), view) for i in range(3000)] != picks


def test_a_single_best_worker_draws_nothing():
    view = FakeView(workers=names(3), waits={"w0": 2, "w1": 2})
    p = policy("weighted:prefix=0,queue=1,kv=0", seed=5)
    state = p.rng.bit_generator.state
    assert p.choose(req(), view) == "w2"
    assert p.rng.bit_generator.state == state


# ---------------------------------------------------------------- presets and specs


PRESET_DEFAULTS = {
    "weighted": ({"prefix": 2, "queue": 1, "kv": 1}, "view", "ratio", 31250, 0),
    "llmd_precise": ({"prefix": 3, "kv": 2, "queue": 2}, "view", "minmax", 31250, 0),
    "llmd_approx": ({"prefix": 1, "kv": 1, "queue": 1}, "history", "ratio", 31250, 256),
    "llmd_load": ({"queue": 1, "kv": 1}, "view", "ratio", 31250, 0),
    "blis_queue_depth": ({"load": 1}, "view", "ratio", 31250, 0),
    "blis_prefix_queue": ({"prefix": 3, "load": 2}, "history", "ratio", 10000, 0),
    "blis_default": ({"prefix": 3, "load": 2, "kv": 2}, "history", "ratio", 10000, 0),
}


@pytest.mark.parametrize("name", sorted(PRESET_DEFAULTS))
def test_presets_parse_to_their_documented_defaults(name):
    weights, source, norm, capacity, max_blocks = PRESET_DEFAULTS[name]
    p = policy(name)
    assert p.name == name and name in POLICY_NAMES
    assert p.weights == weights
    assert (p.prefix_source, p.prefix_norm, p.history_blocks, p.max_blocks) == (source, norm, capacity, max_blocks)
    assert policy(p.spec).spec == p.spec  # the canonical spec rebuilds it
    assert p.spec.startswith(f"{name}:prefix=")


def test_every_preset_is_tested_and_documented():
    assert {cls.name for cls in PRESETS} | {"weighted"} == set(PRESET_DEFAULTS)
    doc = (Path(__file__).parents[1] / "docs/policies.md").read_text()
    assert all(f"`{name}`" in doc for name in PRESET_DEFAULTS)


def test_a_preset_takes_overrides():
    p = policy("llmd_precise:queue=1,prefix_norm=ratio")
    assert p.weights == {"prefix": 3, "queue": 1, "kv": 2} and p.prefix_norm == "ratio"
    assert policy("llmd_load:kv=0").weights == {"queue": 1}


@pytest.mark.parametrize(("spec", "message"), [
    ("weighted:prefix=0,queue=0,kv=0", "every weight is 0"),
    ("weighted:prefix=-1", "prefix=-1.0 must be >= 0"),
    ("weighted:prefix_source=exact", "prefix_source='exact' must be one of view, history"),
    ("weighted:prefix_norm=max", "prefix_norm='max' must be one of ratio, minmax"),
    ("weighted:history_blocks=0", "history_blocks=0 must be > 0"),
    ("weighted:max_blocks=-1", "max_blocks=-1 must be >= 0"),
    ("weighted:max_blocks=2.5", "max_blocks='2.5' is not a valid int"),
    ("weighted:cache=1", r"no parameter\(s\) \['cache'\]"),
])
def test_bad_parameters_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec, np.random.default_rng(0))


# ---------------------------------------------------------------- in the simulator

PRESET_NAMES = ["weighted", *(cls.name for cls in PRESETS)]


def _exp(tmp_path, policies, **kw):
    raw = {
        "name": "w", "seed": 7, "rounds": 1,
        "workload": {"generator": "note2", "params": {"chats": 16, "turns": 4, "system_words": 300,
                                                      "user_words": 60, "reply_tokens": 32}},
        "runs": [{"hardware": "a6000x4", "policies": policies}],
        **kw,
    }
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_experiment(path)


def test_every_preset_runs_in_a_simulation_and_the_prefix_ones_reuse_more(tmp_path):
    exp = _exp(tmp_path, ["round_robin", *PRESET_NAMES])
    summary = simulate_experiment(exp, tmp_path / "a").set_index("policy")
    df = pd.read_parquet(tmp_path / "a/requests.parquet")
    assert (df.groupby("policy").size() == 16 * 4).all() and set(df.policy) == {"round_robin", *PRESET_NAMES}
    hit = summary.hit_rate
    for name in ["llmd_precise", "blis_prefix_queue", "blis_default"]:
        assert hit[name] > hit["round_robin"] + 0.1, hit
    assert hit["llmd_approx"] > hit["round_robin"], hit
    # same seed, same records
    simulate_experiment(exp, tmp_path / "b")
    assert (tmp_path / "a/requests.parquet").read_bytes() == (tmp_path / "b/requests.parquet").read_bytes()


class Probe(Policy):
    """Routes as ``llmd_precise`` and notes what the view said of each worker's KV use."""

    name: ClassVar[str] = "probe"

    def __init__(self, rng):
        super().__init__(rng)
        self.inner = make_policy("llmd_precise", rng)
        self.seen: list[tuple[float, int]] = []

    def choose(self, request, view):
        self.seen += [(view.kv_usage(w), view.active_blocks(w)) for w in view.workers]
        return self.inner.choose(request, view)


@pytest.mark.parametrize("signal", [LoadSignal(), LoadSignal("scraped", interval_ms=50.0)])
def test_the_simulators_view_gives_kv_usage_as_used_over_pool_blocks(signal):
    hw = load_hardware("a6000x4")
    trace = generate("note2", 3, chats=8, turns=3, system_words=200, user_words=40, reply_tokens=64)
    probe = Probe(np.random.default_rng(0))
    SimCluster(trace, hw, probe, np.random.default_rng(1), True, signal).run()
    usage = np.array([u for u, _ in probe.seen])
    blocks = np.array([b for _, b in probe.seen])
    assert np.allclose(usage, blocks / hw.num_blocks)
    assert usage.max() > 0 and usage.max() <= 1


# ---------------------------------------------------------------- in the gateway


def test_the_gateways_view_gives_kv_usage_from_its_tokens_or_the_scrape():
    v = GatewayView([("a", "http://a"), ("b", "http://b")], 16, kv_capacity_blocks=10, kv_block_size=32)
    f = v.begin("a", RouteRequest("r", "s", 0, 100), 0)
    assert v.kv_usage("a") == pytest.approx(100 / 320) and v.kv_usage("b") == 0.0
    v.add_output(f, 60)
    assert v.kv_usage("a") == pytest.approx(160 / 320)
    v.finish(f)
    assert v.kv_usage("a") == 0.0
    big = v.begin("b", RouteRequest("r2", "s2", 0, 1000), 0)
    assert v.kv_usage("b") == 1.0  # at most full
    v.finish(big)
    assert GatewayView([("a", "http://a")], 16).kv_usage("a") == 0.0  # no capacity given
    s = GatewayView([("a", "http://a")], 16, load_signal=LoadSignal("scraped", interval_ms=50.0),
                    kv_capacity_blocks=10)
    s.begin("a", RouteRequest("r", "s", 0, 80), 0)
    assert s.kv_usage("a") == pytest.approx(80 / 160)  # not scraped yet: its own count
    s.apply_scrape("a", {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 0.0})
    assert s.kv_usage("a") == 0.25


def _run(coro, timeout=60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.mark.parametrize("spec", ["llmd_approx", "blis_default"])
def test_history_presets_keep_each_chat_on_one_worker_through_the_gateway(spec):
    """No session header: the policy's own history index keeps a chat's turns together,
    and the first turns' ties spread the chats over the emulated workers."""

    async def body():
        emus = [await start_emulator("cpu", i, time_scale=0.0) for i in range(2)]
        gw = Gateway([(f"w{i}", e.url) for i, e in enumerate(emus)], spec, health_interval_s=60, seed=2,
                     kv_capacity_blocks=load_hardware("cpu").num_blocks)
        await gw.start()
        where = defaultdict(list)
        try:
            async with aiohttp.ClientSession() as c:
                model = emus[0].server.model_name
                for conv in range(6):
                    msgs = [{"role": "system", "content": f"chat {conv}: " + "alpha beta gamma " * 200}]
                    for t in range(3):
                        msgs.append({"role": "user", "content": f"question {t} " + "why " * 40})
                        body = {"model": model, "messages": msgs, "stream": True, "max_tokens": 8}
                        async with c.post(gw.url + "/v1/chat/completions", json=body) as r:
                            assert r.status == 200, await r.text()
                            await r.read()
                        where[conv].append(r.headers["X-Worker"])
                        msgs.append({"role": "assistant", "content": "fine"})
            assert gw.policy.name == spec and gw.policy._history is not None
        finally:
            await gw.stop()
            for e in emus:
                await e.close()
        assert all(len(set(w)) == 1 for w in where.values()), dict(where)
        assert len({w[0] for w in where.values()}) == 2, dict(where)

    _run(body())
