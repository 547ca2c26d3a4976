"""The policy registry: spec parsing, errors that name the problem, fresh instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies import (
    POLICIES,
    POLICY_NAMES,
    PolicyName,
    RouteRequest,
    make_policy,
    parse_spec,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_registry_names_match_classes_and_cli_names():
    assert POLICY_NAMES == tuple(PolicyName)
    assert {"round_robin", "least_loaded", "sticky", "hybrid_sticky", "cost_aware",
            "kv_aware", "random", "prefix_approx", "dynamo", "loadaware", "vllm_cache_aware", "sglang_cache_aware",
            "consistent_hash", "weighted", "llmd_precise", "llmd_approx", "llmd_load",
            "blis_queue_depth", "blis_prefix_queue", "blis_default"} == set(POLICY_NAMES)
    for name, cls in POLICIES.items():
        assert cls.name == name.value
        assert cls.__doc__ and len(cls.__doc__) > 80


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("round_robin", ("round_robin", {})),
        (" sticky ", ("sticky", {})),
        ("hybrid_sticky:threshold_ms=5000", ("hybrid_sticky", {"threshold_ms": "5000"})),
        ("dynamo: overlap_weight = 2 , temperature=0.1",
         ("dynamo", {"overlap_weight": "2", "temperature": "0.1"})),
    ],
)
def test_parse_spec(spec, expected):
    assert parse_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "missing policy name"),
        (":alpha=1", "missing policy name"),
        ("cost_aware:", "must be followed by key=value"),
        ("cost_aware:alpha", "'alpha' is not key=value"),
        ("cost_aware:alpha=", "'alpha=' is not key=value"),
        ("cost_aware:=1", "'=1' is not key=value"),
        ("cost_aware:alpha=1,", "'' is not key=value"),
        ("cost_aware:alpha=1,alpha=2", "'alpha' given twice"),
    ],
)
def test_parse_spec_rejects_bad_syntax(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match="unknown policy 'sticky_session'") as err:
        make_policy("sticky_session", rng())
    assert all(name in str(err.value) for name in POLICY_NAMES)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cost_aware:beta=1", r"no parameter\(s\) \['beta'\]; valid: \['alpha'\]"),
        ("round_robin:x=1", r"no parameter\(s\) \['x'\]; valid: none"),
        ("cost_aware:alpha=fast", "parameter alpha='fast' is not a valid float"),
        ("cost_aware:alpha=inf", "alpha='inf' is not a valid float: must be finite"),
        ("prefix_approx:balance_abs_threshold=6.5",
         "balance_abs_threshold='6.5' is not a valid int"),
        ("hybrid_sticky:threshold_ms=-1", "threshold_ms=-1.0 must be >= 0"),
        ("dynamo:temperature=-0.1", "temperature=-0.1 must be >= 0"),
    ],
)
def test_bad_parameters_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec, rng())


def test_values_are_typed_and_spec_is_canonical():
    p = make_policy("hybrid_sticky", rng())
    assert p.threshold_ms == 500.0 and isinstance(p.threshold_ms, float)
    assert p.spec == "hybrid_sticky:threshold_ms=500"
    assert make_policy("hybrid_sticky:threshold_ms=5e3", rng()).spec == (
        "hybrid_sticky:threshold_ms=5000")
    assert make_policy("cost_aware:alpha=0.25", rng()).spec == "cost_aware:alpha=0.25"
    assert make_policy("round_robin", rng()).spec == "round_robin"
    p = make_policy("prefix_approx:balance_abs_threshold=32", rng())
    assert p.balance_abs_threshold == 32 and isinstance(p.balance_abs_threshold, int)
    assert p.spec == ("prefix_approx:cache_threshold=0.3,balance_abs_threshold=32,"
                      "balance_rel_threshold=1.5")


@settings(max_examples=50, deadline=None)
@given(value=st.floats(0, 1e12, allow_nan=False, allow_infinity=False),
       name=st.sampled_from(["cost_aware:alpha", "hybrid_sticky:threshold_ms",
                             "loadaware:beta", "dynamo:temperature"]))
def test_spec_round_trips(value, name):
    p = make_policy(f"{name}={value!r}", rng())
    q = make_policy(p.spec, rng())
    assert q.spec == p.spec
    assert vars(q).keys() == vars(p).keys()
    key = name.split(":")[1]
    assert getattr(q, key) == getattr(p, key) == value


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_each_call_builds_a_fresh_independent_instance(name):
    a, b = make_policy(name, rng(1)), make_policy(name, rng(1))
    assert a is not b

    class View:  # the smallest view every policy can read
        workers = ("w0", "w1", "w2")
        exact, block_size = True, 16

        def is_up(self, w): return True
        def in_flight(self, w): return 0
        def waiting(self, w): return 0
        def active_blocks(self, w): return 0
        def kv_usage(self, w): return 0.0
        def queue_delay_s(self, w): return 0.0
        def matched_tokens(self, w, r): return 0
        def index_size(self, w): return 0
        def prefill_time_s(self, w, n): return 1e-4 * n
        def session_worker(self, s): return None

    view = View()
    reqs = [RouteRequest(f"r{i}", f"s{i}", 0, 100) for i in range(20)]
    first = [a.choose(r, view) for r in reqs]  # advances a's counter / rng only
    assert [b.choose(r, view) for r in reqs] == first


def test_coerce_and_format_params():
    from kvroute.policies.base import coerce_param, format_param

    assert coerce_param("p", "k", bool, " Yes ") is True
    assert coerce_param("p", "k", bool, "0") is False
    with pytest.raises(ValueError, match="k='maybe' is not a valid bool"):
        coerce_param("p", "k", bool, "maybe")
    assert coerce_param("p", "k", int, 3.0) == 3
    with pytest.raises(ValueError, match="k=3.5 is not a valid int"):
        coerce_param("p", "k", int, 3.5)
    assert coerce_param("p", "k", float, " 2.5 ") == 2.5
    assert [format_param(v) for v in (True, 500.0, 0.1, 1 / 3, 1e-7, 64)] == [
        "true", "500", "0.1", repr(1 / 3), "1e-07", "64"]
