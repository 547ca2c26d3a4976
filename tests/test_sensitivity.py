"""kvroute.analysis.sensitivity: one GPU coefficient at a time swapped, on the same draws."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvroute.analysis.sensitivity import A100_SWAPS, Swap, sensitivity, write
from kvroute.experiment import load_experiment
from kvroute.hardware import load_hardware
from kvroute.records import summarize
from kvroute.sim.run import load_trace, simulate_run

SWAPS = {s.name: s for s in A100_SWAPS}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """note2-a100's arrangements on a few short chats."""
    path = tmp_path_factory.mktemp("exp") / "note2-a100.yaml"
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "config/experiments/note2-a100.yaml").read_text())
    raw["workload"]["params"] |= {"chats": 8, "turns": 3}
    path.write_text(yaml.safe_dump(raw))
    return load_experiment(path)


def test_a_swap_sets_only_its_inputs_and_keeps_the_routers_coefficients():
    a100, a6000 = load_hardware("a100x1"), load_hardware("a6000x4")
    hw = SWAPS["mem_as_a6000"].apply(a100)
    assert hw.coefficients.mem_efficiency == a6000.coefficients.mem_efficiency != a100.coefficients.mem_efficiency
    assert hw.coefficients.compute_efficiency == a100.coefficients.compute_efficiency
    assert hw.router_coefficients == a100.coefficients  # a gateway's estimates stay the filed ones
    every = SWAPS["all"].apply(a100).coefficients
    assert (every.per_seq_overhead_ms, every.step_overhead_ms, every.api_overhead_ms) == (0.0, 0.0, 0.0)
    assert every.compute_efficiency == a6000.coefficients.compute_efficiency
    assert Swap("x", (("api_overhead_ms", None),)).apply(a100).coefficients.api_overhead_ms == 0.0


def test_the_filed_prediction_is_the_simulators_and_each_swap_moves_it_its_way(small):
    df = sensitivity(small, rounds=1)
    assert set(df["swap"]) == set(SWAPS) and len(df) == 3 * len(SWAPS) * 2  # arrangements x swaps x metrics
    run = next(r for r in small.expand(None, None, 1, None) if r.hardware == "a100x1")
    recs, _ = simulate_run(small, run, load_trace(small, 0))
    filed = summarize(pd.DataFrame(recs)).iloc[0]
    row = df[(df["hardware"] == "a100x1") & (df["metric"] == "time_to_complete_s")].iloc[0]
    assert row["filed"] == pytest.approx(filed["time_to_complete_s"])

    def change(swap, hw, metric):
        return df[(df["swap"] == swap) & (df["hardware"] == hw) & (df["metric"] == metric)]["change"].iloc[0]

    for hw in ("a100x1", "a100x1-2workers"):
        # a faster engine or no API server: every prediction shorter, all at once most
        for swap in SWAPS:
            assert change(swap, hw, "time_to_complete_s") < 0, (swap, hw)
        assert change("all", hw, "time_to_complete_s") < min(change(s, hw, "time_to_complete_s")
                                                             for s in SWAPS if s != "all")
        assert change("no_api", hw, "later_ttft_mean_ms") < -0.3  # 100 ms of a later turn's TTFT
    assert (df["rounds"] == 1).all()


def test_it_is_deterministic_and_written_as_a_csv(small, tmp_path):
    out = tmp_path / "s.csv"
    a = write(small, out, rounds=1)
    b = pd.read_csv(out)
    assert list(b.columns) == list(a.columns)
    pd.testing.assert_frame_equal(sensitivity(small, rounds=1), a)
