"""vllm-router's cache_aware and consistent_hash as kvroute policies, and the production
routers' counterparts. Defaults are pinned to vllm-router's source (vllm-project/router)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policies import FakeView, names, policy, req

from kvroute.live.peers import PEER_SPECS
from kvroute.policies import COUNTERPARTS, POLICY_NAMES, counterpart, make_policy
from kvroute.policies.vllm_router import VLLM_ROUTER_VNODES, ConsistentHashPolicy

# ---------------------------------------------------------------- defaults, pinned to the source


def test_vllm_cache_aware_defaults_are_the_vllm_router_command_lines():
    # vllm_router/router_args.py (RouterArgs, 0.1.17): cache_threshold 0.3,
    # balance_abs_threshold 64, balance_rel_threshold 1.5
    p = policy("vllm_cache_aware")
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (0.3, 64, 1.5)
    assert type(p.balance_abs_threshold) is int  # a usize in the router: no fractional gap
    assert p.spec == ("vllm_cache_aware:cache_threshold=0.3,balance_abs_threshold=64,balance_rel_threshold=1.5,"
                      "prefix_match=true")
    assert p.default_exact is False  # routes from its own approximate tree
    assert policy("sglang_cache_aware").spec == ("sglang_cache_aware:cache_threshold=0.3,balance_abs_threshold=64,"
                                                 "balance_rel_threshold=1.5")


def test_consistent_hash_has_160_virtual_nodes_and_no_parameters():
    # src/policies/consistent_hash.rs: VIRTUAL_NODES_PER_WORKER = 160 (factory.rs hard-codes it)
    assert VLLM_ROUTER_VNODES == ConsistentHashPolicy.vnodes == 160
    p = policy("consistent_hash")
    assert p.spec == "consistent_hash" and p.default_exact is True
    p.choose(req(), FakeView(workers=names(3)))
    assert len(p._ring._points) == 3 * 160


# ---------------------------------------------------------------- vllm_cache_aware


def test_vllm_cache_aware_follows_the_cache_above_the_threshold_else_least_loaded():
    view = FakeView(workers=names(3), matched={"w0": 300, "w1": 100},
                    inflight={"w0": 5, "w1": 3, "w2": 1}, sizes={"w0": 10, "w1": 900, "w2": 900})
    p = policy("vllm_cache_aware")
    assert p.choose(req(prompt=1000), view) == "w2"  # 0.30 is not > 0.3: least loaded
    view.matched["w0"] = 301
    assert p.choose(req(prompt=1000), view) == "w0"  # 0.301 > 0.3: the cache, load 5 or not
    assert policy("vllm_cache_aware:cache_threshold=0.5").choose(req(prompt=1000), view) == "w2"
    # where SGLang's rule (prefix_approx) would take the smallest tree instead
    view.matched["w0"] = 300
    assert policy("prefix_approx").choose(req(prompt=1000), view) == "w0"


def test_vllm_cache_aware_without_prefix_match_takes_the_least_loaded_whatever_matches():
    """What vllm-router did in front of workers refusing /render (the measured rows' counterpart)."""
    view = FakeView(workers=names(3), matched={"w0": 1000}, inflight={"w0": 2, "w1": 1, "w2": 1})
    assert policy("vllm_cache_aware").choose(req(prompt=1000), view) == "w0"  # all cached: the cache
    p = policy("vllm_cache_aware:prefix_match=false")
    assert p.choose(req(prompt=1000), view) == "w1"  # least loaded, ties to the lowest index
    assert p.asks_every_worker and p.index_on_finish  # still posts /render to every worker
    assert counterpart("vllm_router:cache_aware") == "vllm_cache_aware:prefix_match=false"


def test_vllm_cache_aware_miss_ties_go_to_the_lowest_index():
    view = FakeView(workers=names(4), inflight={"w0": 2, "w1": 1, "w3": 1}, sizes={"w3": 0, "w1": 50})
    assert policy("vllm_cache_aware").choose(req(prompt=100), view) == "w2"
    view.inflight["w2"] = 1
    assert policy("vllm_cache_aware").choose(req(prompt=100), view) == "w1"


def test_vllm_cache_aware_balances_only_when_both_thresholds_are_crossed():
    view = FakeView(workers=names(3), inflight={"w0": 80, "w1": 10, "w2": 30}, matched={"w0": 1000})
    p = policy("vllm_cache_aware")
    assert p.choose(req(prompt=1000), view) == "w1"  # 70 > 64 and 80 > 15: shortest queue
    view.inflight = {"w0": 210, "w1": 140, "w2": 150}
    assert p.choose(req(prompt=1000), view) == "w0"  # 70 > 64 but 210 <= 210: the cache
    view.inflight = {"w0": 96, "w1": 32, "w2": 40}
    assert p.choose(req(prompt=1000), view) == "w0"  # 3x but a gap of 64, not > 64
    view.down = {"w1"}  # a down worker's load does not count
    view.inflight = {"w0": 80, "w1": 0, "w2": 10}
    assert p.choose(req(prompt=1000), view) == "w2"


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(st.integers(0, 200), min_size=1, max_size=6), matched=st.integers(0, 1000),
       abs_t=st.integers(0, 80), rel_t=st.floats(1.0, 3.0))
def test_vllm_cache_aware_is_least_loaded_unless_a_balanced_cluster_has_a_match(loads, matched, abs_t, rel_t):
    ws = names(len(loads))
    # the smallest tree is the busiest worker, so SGLang's miss rule would fail here
    view = FakeView(workers=ws, inflight=dict(zip(ws, loads)), matched={ws[-1]: matched},
                    sizes={w: 1000 - load for w, load in zip(ws, loads)})
    p = policy(f"vllm_cache_aware:balance_abs_threshold={abs_t},balance_rel_threshold={rel_t!r}")
    got = p.choose(req(prompt=1000), view)
    hi, lo = max(loads), min(loads)
    imbalanced = hi - lo > abs_t and hi > lo * rel_t
    if not imbalanced and matched / 1000 > 0.3:
        assert got == ws[-1]
    else:
        assert got == ws[loads.index(lo)]


# ---------------------------------------------------------------- consistent_hash


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 8), sessions=st.sets(st.text(min_size=1, max_size=12), min_size=1, max_size=40))
def test_consistent_hash_keeps_a_session_on_one_worker(n, sessions):
    view = FakeView(workers=names(n), inflight={w: i for i, w in enumerate(names(n))})
    p = policy("consistent_hash")
    first = {s: p.choose(req(s), view) for s in sessions}
    view.inflight = {}  # load never moves a session
    for turn in range(1, 3):
        assert {s: p.choose(req(s, turn=turn), view) for s in sessions} == first
    assert {s: policy("consistent_hash").choose(req(s), view) for s in sessions} == first  # a fresh instance


@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 6))
def test_consistent_hash_spreads_sessions_over_the_workers(n):
    view = FakeView(workers=names(n))
    p = policy("consistent_hash")
    shares = Counter(p.choose(req(f"conv-{i}"), view) for i in range(300 * n))
    assert set(shares) == set(view.workers)
    assert all(0.5 * 300 <= c <= 1.6 * 300 for c in shares.values()), shares


# When a worker goes down only its sessions move, and they move back when it returns:
# tests/test_policies.py::test_sticky_moves_only_the_down_workers_sessions runs it for both.


# ---------------------------------------------------------------- counterparts


def test_every_production_router_spec_has_a_counterpart_entry_naming_a_policy():
    assert set(COUNTERPARTS) == set(PEER_SPECS)
    for spec, cp in COUNTERPARTS.items():
        assert counterpart(spec) == cp
        if cp is not None:
            assert make_policy(cp, np.random.default_rng(0)).name == cp.split(":")[0]
    assert counterpart("vllm_router:cache_aware") == "vllm_cache_aware:prefix_match=false"  # it matched nothing here
    assert counterpart("vllm_router:consistent_hash") == "consistent_hash"
    assert counterpart("sglang_router:cache_aware") == "sglang_cache_aware"  # the same rules, its tree learns at routing
    assert counterpart(" vllm_router : round_robin ") == "round_robin"
    assert counterpart("sglang_router:random") == "random"
    assert counterpart("vllm_router:power_of_two") is None


@pytest.mark.parametrize("spec", [*POLICY_NAMES, "hybrid_sticky:threshold_ms=5000"])
def test_a_kvroute_policy_has_no_counterpart(spec):
    assert counterpart(spec) is None


def test_an_unknown_router_policy_is_an_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match="unknown policy 'sticky' of vllm_router.*vllm_router:consistent_hash"):
        counterpart("vllm_router:sticky")


def test_vllm_cache_aware_spreads_chats_that_start_together_and_sglang_piles_them(tmp_path):
    """Simulated, eight chats sharing a system prompt start within a second: vllm-router's
    tree learns each decision only when the request finishes, so the first turns spread by
    load and each chat stays where it began (imbalance near 0); sglang-router's learns at
    routing and piles them on one worker."""
    import yaml
    from click.testing import CliRunner

    from kvroute.cli import main

    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump({
        "name": "e", "seed": 1, "rounds": 1, "view": "approx",
        "workload": {"generator": "note2", "params": {"chats": 8, "turns": 4, "system_words": 600, "user_words": 75,
                                                      "reply_tokens": 32, "ramp_s": 1.0}},
        "runs": [{"hardware": "cpu", "policies": ["vllm_cache_aware", "sglang_cache_aware"]}]}))
    res = CliRunner().invoke(main, ["simulate", str(path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    import pandas as pd

    s = pd.read_csv(tmp_path / "o" / "summary.csv").set_index("policy")
    assert s.loc["vllm_cache_aware", "imbalance"] < 0.3 < s.loc["sglang_cache_aware", "imbalance"]
    r = pd.read_parquet(tmp_path / "o" / "requests.parquet")
    stays = r[r.policy == "vllm_cache_aware"].groupby("conversation").worker.nunique()
    assert (stays == 1).all()  # each chat keeps its worker
