"""Load signals (kvroute.loadsignal): the experiment key, and what each one makes the
simulator's view see. The gateway's side is in test_gateway_load_signal.py."""

import hashlib

import numpy as np
import pandas as pd
import pytest
import yaml

from kvroute.experiment import ExperimentError, load_experiment
from kvroute.hardware import load_hardware
from kvroute.kvcache.holders import LaggingHolders
from kvroute.loadsignal import LoadSignal
from kvroute.policies import make_policy
from kvroute.sim.cluster import SimCluster
from kvroute.sim.run import common_rng, simulate_experiment
from kvroute.workload import generate

#: closed-loop note2-style chats (64 chats at once on four workers, back-to-back turns)
WORKLOAD = {"generator": "note2",
            "params": {"chats": 32, "turns": 6, "system_words": 300, "user_words": 80, "reply_tokens": 48, "ramp_s": 1.0}}


def _exp(tmp_path, policies=("least_loaded", "kv_aware"), name="ls", **kw):
    raw = {"name": name, "seed": 5, "rounds": 1, "workload": WORKLOAD,
           "runs": [{"hardware": "a6000x4", "policies": list(policies)}], **kw}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _summary(tmp_path, out, **kw) -> pd.DataFrame:
    s = simulate_experiment(load_experiment(_exp(tmp_path, **kw)), tmp_path / out)
    return s.set_index("policy")


# -- the key ---------------------------------------------------------------------------------

def test_labels():
    assert LoadSignal().label == "router"
    assert LoadSignal("scraped", interval_ms=100.0).label == "scraped:100ms"
    assert LoadSignal("events", delay_ms=2.5).label == "events:2.5ms"


@pytest.mark.parametrize("signal, key", [
    ({"source": "telepathy"}, "load_signal.source"),
    ({"source": "scraped"}, "load_signal"),  # interval_ms is required
    ({"source": "scraped", "interval_ms": 0}, "load_signal.interval_ms"),
    ({"source": "scraped", "interval_ms": "fast"}, "load_signal.interval_ms"),
    ({"source": "router", "interval_ms": 100}, "load_signal.interval_ms"),
    ({"source": "scraped", "interval_ms": 100, "delay_ms": 5}, "load_signal.delay_ms"),
    ({"source": "events"}, "load_signal"),
    ({"source": "events", "delay_ms": -1}, "load_signal.delay_ms"),
    ({"source": "scraped", "interval_ms": 100, "period": 3}, "load_signal"),
    ({"source": "events", "delay_ms": 10}, "load_signal.source"),  # needs view: exact
])
def test_bad_load_signal_names_the_key(tmp_path, signal, key):
    with pytest.raises(ExperimentError, match=rf"key {key}\b") as err:
        load_experiment(_exp(tmp_path, load_signal=signal))
    if signal == {"source": "router", "interval_ms": 100}:
        assert "scraped only" in str(err.value)


def test_events_with_the_exact_view_loads(tmp_path):
    exp = load_experiment(_exp(tmp_path, view="exact", load_signal={"source": "events", "delay_ms": 0}))
    assert exp.load_signal == LoadSignal("events", delay_ms=0.0)


def test_explicit_router_is_byte_identical_to_the_default(tmp_path):
    simulate_experiment(load_experiment(_exp(tmp_path, name="a")), tmp_path / "a")
    simulate_experiment(load_experiment(_exp(tmp_path, name="a", load_signal={"source": "router"})), tmp_path / "b")
    digest = [hashlib.sha256((tmp_path / d / "requests.parquet").read_bytes()).hexdigest() for d in "ab"]
    assert digest[0] == digest[1]
    assert set(pd.read_parquet(tmp_path / "a/requests.parquet").load_signal) == {"router"}


# -- scraped ----------------------------------------------------------------------------------

def test_router_signal_makes_least_loaded_sticky(tmp_path):
    """The problem: with the router's exact, instantaneous counter a closed-loop chat's
    next turn always finds its own worker least loaded, so least_loaded reuses as much
    as kv_aware."""
    s = _summary(tmp_path, "o")
    assert s.hit_rate["least_loaded"] == pytest.approx(s.hit_rate["kv_aware"], abs=1e-9)


def test_scraped_at_a_long_interval_makes_least_loaded_lose_the_cache(tmp_path):
    s = _summary(tmp_path, "o", load_signal={"source": "scraped", "interval_ms": 1000})
    assert s.hit_rate["least_loaded"] < s.hit_rate["kv_aware"] - 0.05, s.hit_rate
    assert set(pd.read_parquet(tmp_path / "o/requests.parquet").load_signal) == {"scraped:1000ms"}


def test_scraped_runs_are_deterministic(tmp_path):
    kw = {"load_signal": {"source": "scraped", "interval_ms": 50}}
    a, b = (_summary(tmp_path, d, **kw) for d in "ab")
    assert (tmp_path / "a/requests.parquet").read_bytes() == (tmp_path / "b/requests.parquet").read_bytes()
    assert a.drop(columns="sim_seconds_per_wall_second").equals(b.drop(columns="sim_seconds_per_wall_second"))


def _trace():
    return generate("note2", 3, chats=24, turns=4, system_words=200, user_words=60, reply_tokens=32, ramp_s=1.0)


class _Seeing:
    """least_loaded that records, at each decision, the time and each worker's load."""

    def __new__(cls, log):
        inner = make_policy("least_loaded", np.random.default_rng(0))

        class Seeing(type(inner)):
            def choose(self, request, view):
                log.append((view.c.env.now, [view.in_flight(w) for w in view.workers],
                            [view.active_blocks(w) for w in view.workers]))
                return super().choose(request, view)

        return Seeing(np.random.default_rng(0))


def test_scraped_load_changes_only_at_the_workers_scrapes():
    hw = load_hardware("a6000x4")
    seen: list = []
    period = 0.25
    cluster = SimCluster(_trace(), hw, _Seeing(seen), common_rng(1, 0), True, LoadSignal("scraped", interval_ms=250.0))
    cluster.run()
    phases = cluster.scrape_phase_s
    assert len(set(phases)) == 4 and all(0 <= p < period for p in phases), phases
    changes = 0
    for (t0, load0, blocks0), (t1, load1, blocks1) in zip(seen, seen[1:]):
        for i, ph in enumerate(phases):
            if (load0[i], blocks0[i]) != (load1[i], blocks1[i]):
                changes += 1
                # some scrape time ph + k * period lies in (t0, t1]
                k = np.floor((t1 - ph) / period + 1e-9)
                assert ph + k * period > t0 - 1e-9, (i, t0, t1)
    assert changes > 20


def test_scrape_phases_come_from_the_common_stream():
    """Every policy of a round sees the same scrape phases (common random numbers)."""
    hw, sig = load_hardware("a6000x4"), LoadSignal("scraped", interval_ms=100.0)
    phases = [SimCluster(_trace(), hw, make_policy(p, np.random.default_rng(9)), common_rng(4, 0), True, sig)
              .scrape_phase_s for p in ("round_robin", "kv_aware")]
    assert phases[0] == phases[1]
    router = SimCluster(_trace(), hw, make_policy("round_robin", np.random.default_rng(9)), common_rng(4, 0), True)
    assert router.api_delay_s == SimCluster(_trace(), hw, make_policy("round_robin", np.random.default_rng(9)),
                                            common_rng(4, 0), True, sig).api_delay_s


# -- events -----------------------------------------------------------------------------------

def test_lagging_holders_apply_changes_late():
    now = [0.0]
    lag = LaggingHolders(lambda: now[0], delay_s=1.0)
    lag.gain(1, 10)
    lag.gain(1, 11)
    lag.catch_up()
    assert lag.matched_blocks([10, 11], 1) == [0]
    now[0] = 0.5
    lag.drop(1, 11)
    now[0] = 1.0
    lag.catch_up()
    assert lag.matched_blocks([10, 11], 1) == [2] and lag.sizes[1] == 2  # the drop is not known yet
    now[0] = 1.5
    lag.catch_up()
    assert lag.matched_blocks([10, 11], 1) == [1] and lag.sizes[1] == 1


def _records(tmp_path, out, policies, **kw):
    simulate_experiment(load_experiment(_exp(tmp_path, policies=policies, **kw)), tmp_path / out)
    df = pd.read_parquet(tmp_path / out / "requests.parquet")
    return df.drop(columns=["load_signal", "policy"]).reset_index(drop=True)


def test_events_without_delay_route_as_the_exact_view(tmp_path):
    exact = _records(tmp_path, "a", ["kv_aware"], view="exact")
    events = _records(tmp_path, "b", ["kv_aware"], view="exact", load_signal={"source": "events", "delay_ms": 0})
    pd.testing.assert_frame_equal(exact, events)


def test_events_that_never_arrive_leave_kv_aware_to_its_load_tie_break(tmp_path):
    """Delayed past the run's end, no block is ever known: every match is 0, and kv_aware's
    tie-break (fewest in flight, then lowest index) is least_loaded's rule."""
    never = {"source": "events", "delay_ms": 1e9}
    blind = _records(tmp_path, "a", ["kv_aware"], view="exact", load_signal=never)
    least = _records(tmp_path, "b", ["least_loaded"], view="exact")
    pd.testing.assert_frame_equal(blind, least)


def test_validation_refuses_unlike_load_signals():
    """A prediction beside a measurement only when both saw load the same way."""
    from kvroute.analysis.validation import ValidationError, measured_rows

    key = {"experiment": "e", "hardware": "cpu", "policy": "least_loaded"}
    summary = pd.DataFrame([{**key, "round": 0, "hit_rate": 0.5}])
    sim = pd.DataFrame([{**key, "view": "exact", "load_signal": "scraped:100ms"}])
    meas = pd.DataFrame([{**key, "view": "exact", "load_signal": "router"}])
    with pytest.raises(ValidationError, match="load_signal 'router'.*'scraped:100ms'"):
        measured_rows(summary, summary, sim, meas, in_sample=lambda hw: set())
    same = measured_rows(summary, summary, sim, sim, in_sample=lambda hw: set())
    assert len(same) == 1
    old = meas.assign(load_signal=None)  # records from before the column: nothing to check
    assert len(measured_rows(summary, summary, sim, old, in_sample=lambda hw: set())) == 1
