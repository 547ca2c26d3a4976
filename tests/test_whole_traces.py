"""`make field`'s table: Mooncake's whole traces per speed-up and policy, beside the trace's
own bound on prefix reuse (here on a 30 s window, so the test stays short)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvroute.analysis import whole_traces
from kvroute.experiment import load_experiment
from kvroute.sim.run import simulate_experiment
from kvroute.workload import mooncake

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    exps = tmp / "experiments"
    exps.mkdir()
    exp = {"name": "moon-small", "seed": 1, "rounds": 1,
           "workload": {"dataset": "mooncake", "params": {"name": "synthetic", "duration_s": 30}},
           "load": {"param": "speedup", "values": [1, 4]},
           "runs": [{"hardware": "h100x8", "policies": ["round_robin", "kv_aware"]}]}
    (exps / "moon-small.yaml").write_text(yaml.safe_dump(exp))
    simulate_experiment(load_experiment(exps / "moon-small.yaml"), tmp / "sim" / "moon-small")
    return tmp


def test_the_table_has_a_row_per_speedup_and_policy_beside_the_bound(simulated):
    t = whole_traces.table([simulated / "sim" / "moon-small"], simulated / "experiments")
    assert list(t.columns) == list(whole_traces.COLUMNS)
    assert sorted(zip(t["speedup"], t["policy"])) == [(1, "kv_aware"), (1, "round_robin"), (4, "kv_aware"), (4, "round_robin")]
    assert (t["trace"] == "synthetic").all()
    bound = mooncake.prefix_reuse_bound(mooncake.read_requests("synthetic"))
    assert t["reuse_bound"].tolist() == [bound] * 4  # the whole trace's bound, from hash_ids alone
    summary = pd.read_csv(simulated / "sim" / "moon-small" / "summary.csv")
    kv4 = summary[(summary["policy"] == "kv_aware") & (summary["load"] == 4)].iloc[0]
    row = t[(t["policy"] == "kv_aware") & (t["speedup"] == 4)].iloc[0]
    assert row["hit_rate"] == kv4["hit_rate"] and row["requests"] == kv4["requests"]
    for _, g in t.groupby("speedup"):
        assert g["ttft_mean_ms"].is_monotonic_increasing  # fastest first
    md = whole_traces.markdown(t)
    assert md.count("### synthetic trace, whole, speed-up") == 2 and "| kv_aware |" in md and "Simulated" in md


def test_the_command_writes_both_files(simulated, tmp_path):
    out = tmp_path / "field"
    assert whole_traces.main(["--sim", str(simulated / "sim" / "moon-small"), "--experiments",
                              str(simulated / "experiments"), "--out", str(out)]) == 0
    assert len(pd.read_csv(out / "whole_traces.csv")) == 4 and (out / "whole_traces.md").read_text().startswith("Simulated")


def test_a_replay_that_is_not_mooncake_is_refused():
    with pytest.raises(ValueError, match="not a Mooncake replay"):
        whole_traces.trace_of(ROOT / "config/experiments/kv-reuse.yaml")


def test_the_field_experiments_are_the_whole_traces_at_every_speedup_with_every_policy():
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    assert set(cfg["field_experiments"]).isdisjoint(cfg["experiments"])
    for name in cfg["field_experiments"]:
        whole = load_experiment(ROOT / f"config/experiments/{name}.yaml")
        window = load_experiment(ROOT / f"config/experiments/{name.removesuffix('-whole')}.yaml")
        assert whole.workload["params"]["duration_s"] is None  # the whole trace
        assert set(window.load.values) <= set(whole.load.values) and whole.runs == window.runs  # its policies, more speed-ups
