"""The simulator's approximate view is the gateway's: the same counters, the same delay estimates."""

import dataclasses

import numpy as np
import pytest
import yaml

from kvroute.hardware import load_hardware, with_coefficients
from kvroute.live.view import GatewayView
from kvroute.loadsignal import ROUTER, DelayModel, LoadSignal
from kvroute.policies import make_policy
from kvroute.policies.base import RouteRequest
from kvroute.sim.cluster import SimCluster
from kvroute.sim.run import common_rng
from kvroute.workload import generate


class _Mirrored(SimCluster):
    """Tells a real GatewayView every event the simulated gateway counts, and checks at each
    decision that both views estimate every worker's queue delay alike."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gateway = GatewayView([(w, f"http://{w}") for w in self.workers], self.hw.engine.block_size,
                                   load_signal=self.load_signal, **dataclasses.asdict(self.delays))
        self.flights = {}
        self.checked = 0
        self.nonzero = 0

    def route(self, conv, index, turn, stream, prompt, output):
        if self.scrape is not None:  # the gateway is handed the same gauges as the simulated scrape read
            for i, w in enumerate(self.workers):
                self.gateway.apply_scrape(w, {"num_requests_running": self.scrape.running[i],
                                              "num_requests_waiting": self.scrape.in_flight[i] - self.scrape.running[i]})
        for w in self.workers:
            sim, gw = self.view.queue_delay_s(w), self.gateway.queue_delay_s(w)
            assert sim == pytest.approx(gw, abs=1e-12), (w, sim, gw)
            self.checked += 1
            self.nonzero += sim > 0
        rid = self._next_rid
        done = super().route(conv, index, turn, stream, prompt, output)
        p = self.pending[rid]
        req = RouteRequest(f"r{rid}", conv.id, turn, prompt, [])
        self.flights[rid] = self.gateway.begin(self.workers[p.worker], req, prompt - p.uncached)
        return done

    def first_token(self, r):
        super().first_token(r)
        self.gateway.first_byte(self.flights[r.rid])

    def finished(self, driver, r):
        super().finished(driver, r)
        f = self.flights.pop(r.rid)
        self.gateway.add_output(f, r.output_tokens)
        self.gateway.finish(f)


@pytest.mark.parametrize("signal", [ROUTER, LoadSignal("scraped", interval_ms=50.0)], ids=["router", "scraped"])
@pytest.mark.parametrize("spec", ["cost_aware:alpha=1.0", "hybrid_sticky:threshold_ms=50"])
def test_the_approximate_view_estimates_delays_as_the_gateway_does(spec, signal):
    hw = load_hardware("cpu")
    trace = generate("note2", 3, chats=12, turns=4, system_words=300, user_words=60, reply_tokens=32, ramp_s=0.5)
    cluster = _Mirrored(trace, hw, make_policy(spec, np.random.default_rng(0)), common_rng(3, 0), False, signal)
    rows = cluster.run()
    assert len(rows) == 12 * 4 and cluster.checked == 2 * len(rows)
    assert cluster.nonzero > len(rows) / 4, "the test needs queues the estimate sees"
    # every request ended: the gateway's counters are back to zero
    assert cluster.router_running == [0, 0] and cluster.waiting_uncached == [0, 0]
    assert sum(cluster.finished_requests) == len(rows)


def test_the_gateway_keeps_the_profile_s_coefficients_when_a_calibration_replaces_the_engines(tmp_path):
    """kvroute measure configures its gateway from the profile as filed; a simulation with
    a probe calibration's coefficients keeps those for its gateway view (like for like)."""
    hw = load_hardware("cpu")
    entry = dataclasses.asdict(hw.coefficients) | {"compute_efficiency": 4 * hw.coefficients.compute_efficiency}
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump({hw.coefficients_name: entry}))
    probed = with_coefficients(hw, path)
    assert probed.coefficients.compute_efficiency == 4 * hw.coefficients.compute_efficiency
    assert DelayModel.from_hardware(probed) == DelayModel.from_hardware(hw)
    assert probed.router_coefficients == hw.coefficients
    trace = generate("note2", 3, chats=2, turns=2)
    policy = make_policy("cost_aware", np.random.default_rng(0))
    cluster = SimCluster(trace, probed, policy, common_rng(3, 0), False)
    assert cluster.delays == DelayModel.from_hardware(hw)
    assert cluster.view.prefill_time_s("w0", 1000) == pytest.approx(1000 * cluster.delays.prefill_s_per_token)
    exact = SimCluster(trace, probed, policy, common_rng(3, 0), True)
    assert exact.view.prefill_time_s("w0", 1000) == pytest.approx(exact.model.prefill_time(1000))
    assert exact.view.prefill_time_s("w0", 1000) != pytest.approx(cluster.view.prefill_time_s("w0", 1000))
