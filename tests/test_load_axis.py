"""Load as an axis: an experiment's `load` key, its runs, the commands, records and curves.

The workflow's side (one workload and one simulate job per load, the merge collecting
them) is in tests/test_workflow.py (test_a_load_axis_is_one_workload_and_simulate_job_per_load).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from kvroute.analysis import figures
from kvroute.analysis.goodput import ServiceClass
from kvroute.analysis.load_curves import CURVE_METRICS, load_curves
from kvroute.cli import main
from kvroute.experiment import ExperimentError, Run, format_load, load_experiment
from kvroute.pipeline import load_slug
from kvroute.records import REQUEST_COLUMNS, write_csv
from kvroute.sim.run import DRAWN_FOR, load_trace
from kvroute.workload import read_trace

OPEN = {
    "name": "open-sweep",
    "seed": 7,
    "rounds": 2,
    "load": {"param": "rate_per_s", "values": [1, 2.5, 8]},
    "workload": {"generator": "sharegpt_like", "params": {"conversations": 6}},
    "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "kv_aware"]}],
}
CLOSED = {
    "name": "closed-sweep",
    "rounds": 1,
    "load": {"param": "chats", "values": [2, 4]},
    "workload": {"generator": "note2", "params": {"turns": 2, "system_words": 100, "user_words": 20, "reply_tokens": 8}},
    "runs": [{"hardware": "a6000x4", "policies": ["round_robin"]}],
}


def _write(tmp_path: Path, spec: dict, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


def _with(spec: dict, **changes) -> dict:
    out = yaml.safe_load(yaml.safe_dump(spec))
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node[p]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return out


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ the experiment file


def test_expand_is_one_run_per_load_hardware_policy_and_round(tmp_path):
    exp = load_experiment(_write(tmp_path, OPEN))
    assert exp.load.param == "rate_per_s" and exp.load.values == (1, 2.5, 8)
    runs = exp.expand()
    assert len(runs) == 2 * 3 * 2
    assert runs[:3] == [Run("open-sweep", "a6000x4", "round_robin", 0, 1), Run("open-sweep", "a6000x4", "kv_aware", 0, 1),
                        Run("open-sweep", "a6000x4", "round_robin", 0, 2.5)]
    assert {(r.load, r.round) for r in runs} == {(v, r) for v in (1, 2.5, 8) for r in (0, 1)}
    assert [r.load for r in exp.expand(load=2.5, round_=1)] == [2.5, 2.5]
    assert exp.expand(load=8.0)[0].load == 8  # the file's value, found by value


def test_an_experiment_without_a_load_axis_is_unchanged(tmp_path):
    exp = load_experiment(_write(tmp_path, _with(OPEN, load=None)))
    assert exp.load is None and exp.loads() == [None]
    assert [r.load for r in exp.expand()] == [None] * 4
    with pytest.raises(ExperimentError, match="no load axis"):
        exp.expand(load=2)


@pytest.mark.parametrize(
    "changes, key, words",
    [
        ({"load.param": "rate"}, "key load.param", "valid: "),
        ({"load.param": "rate_per_s", "workload.params.rate_per_s": 3}, "key workload.params.rate_per_s", "load axis sets"),
        ({"load.values": [1, 0]}, "key load.values.1", "0"),
        ({"load.values": [-2]}, "key load.values.0", ""),
        ({"load.values": []}, "key load.values", ""),
        ({"load.values": [2, 2.0]}, "key load.values", ""),
        ({"load.values": ["fast"]}, "key load.values.0", "number"),
        ({"load.values": [1, float("inf")]}, "key load.values.1", "finite"),
        ({"load.values": None}, "key load", "values"),
        ({"load.speed": 2}, "key load", "speed"),
    ],
)
def test_a_bad_load_axis_names_its_key(tmp_path, changes, key, words):
    with pytest.raises(ExperimentError) as info:
        load_experiment(_write(tmp_path, _with(OPEN, **changes)))
    assert key in str(info.value) and words in str(info.value)


def test_a_whole_number_parameter_takes_whole_numbers(tmp_path):
    with pytest.raises(ExperimentError, match=r"key load\.values\.1: chats takes whole numbers"):
        load_experiment(_write(tmp_path, _with(CLOSED, **{"load.values": [2, 2.5]})))
    exp = load_experiment(_write(tmp_path, _with(CLOSED, **{"load.values": [2, 4.0]})))
    assert exp.load.values == (2, 4) and all(isinstance(v, int) for v in exp.load.values)


def test_a_trace_file_has_no_parameter_to_sweep(tmp_path):
    spec = _with(OPEN, workload={"trace": "some.parquet"})
    with pytest.raises(ExperimentError, match=r"key load\.param: 'rate_per_s' is not a parameter of the workload \(a trace file\)"):
        load_experiment(_write(tmp_path, spec))


@pytest.mark.parametrize("value, text", [(8, "8"), (10.0, "10"), (2.5, "2.5"), (0.1, "0.1"), (1e-07, "1e-07"), (1 / 3, "0.3333333333333333")])
def test_load_text_is_exact_and_path_safe(value, text):
    assert format_load(value) == text and float(text) == value
    assert load_slug(value) == f"load{text}" and load_slug(None) == ""


def test_summary_csv_keeps_loads_exact(tmp_path):
    loads = [1 / 3, 1234567.0, 0.1234567, math.nan]
    write_csv(pd.DataFrame({"load": loads, "hit_rate": [1 / 3] * 4}), tmp_path / "s.csv")
    back = pd.read_csv(tmp_path / "s.csv")
    assert back["load"][:3].tolist() == loads[:3] and math.isnan(back["load"][3])
    assert back["hit_rate"][0] == 0.333333  # other floats keep the 6 digits


# ------------------------------------------------------------------ the workload at each load


def test_every_load_of_a_round_draws_the_same_lengths(tmp_path):
    exp = load_experiment(_write(tmp_path, OPEN))
    traces = {v: load_trace(exp, 0, v) for v in exp.load.values}
    shapes = {v: [(c.id, c.system_tokens, c.turns) for c in tr.conversations] for v, tr in traces.items()}
    assert shapes[1] == shapes[2.5] == shapes[8]  # common random numbers: only the arrivals move
    starts = {v: np.array([c.arrival_s for c in tr.conversations]) for v, tr in traces.items()}
    assert np.allclose(starts[1], 8 * starts[8]) and not np.allclose(starts[1], starts[8])
    assert traces[1].meta["params"]["rate_per_s"] == 1.0
    assert shapes[1] != [(c.id, c.system_tokens, c.turns) for c in load_trace(exp, 1, 1).conversations]  # rounds differ


def test_a_closed_loop_sweep_extends_the_smaller_trace(tmp_path):
    exp = load_experiment(_write(tmp_path, CLOSED))
    small, large = (load_trace(exp, 0, v) for v in exp.load.values)
    assert (small.concurrency, large.concurrency) == (2, 4)
    assert [c.id for c in large.conversations[:2]] == [c.id for c in small.conversations]


def test_load_trace_needs_the_load_of_an_axis(tmp_path):
    exp = load_experiment(_write(tmp_path, OPEN))
    with pytest.raises(ValueError, match="say which load"):
        load_trace(exp, 0)


# ------------------------------------------------------------------ the commands


def test_workload_writes_each_load_and_needs_one(tmp_path):
    path = _write(tmp_path, OPEN)
    res = _run("workload", path, "--round", 1, "--out", tmp_path / "w.parquet")
    assert res.exit_code != 0 and "--load" in res.output and "1, 2.5, 8" in res.output
    res = _run("workload", path, "--round", 1, "--load", 3, "--out", tmp_path / "w.parquet")
    assert res.exit_code != 0 and "load 3 is not one of load.values (1, 2.5, 8)" in res.output
    assert not (tmp_path / "w.parquet").exists()
    for v in ("2.5", "8"):
        out = tmp_path / f"load{v}/round1.parquet"
        res = _run("workload", path, "--round", 1, "--load", v, "--out", out)
        assert res.exit_code == 0, res.output
        written, drawn = read_trace(out), load_trace(load_experiment(path), 1, float(v))
        assert written.conversations == drawn.conversations
        assert written.meta.pop(DRAWN_FOR) == {"experiment": "open-sweep", "round": 1, "load": float(v)}
        assert written.meta == drawn.meta
    res = _run("workload", _write(tmp_path, _with(OPEN, load=None), "plain.yaml"), "--round", 0, "--load", 2, "--out", tmp_path / "p.parquet")
    assert res.exit_code != 0 and "no load axis" in res.output


def test_simulate_merge_carry_the_load(tmp_path):
    """The workflow's path by hand: a workload per (load, round), a simulate job per
    policy replaying all of them, and one merge; records and summaries carry the load."""
    path = _write(tmp_path, OPEN)
    exp = load_experiment(path)
    traces = []
    for v in exp.load.values:
        for r in range(exp.rounds):
            trace = tmp_path / f"workload/load{format_load(v)}/round{r}.parquet"
            assert _run("workload", path, "--round", r, "--load", format_load(v), "--out", trace).exit_code == 0
            traces.append(trace)
    dirs = []
    for policy in sorted({run.policy for run in exp.expand()}):
        d = tmp_path / f"sim/{policy}"
        res = _run("simulate", path, *[x for t in traces for x in ("--trace", t)], "--policy", policy, "--out", d)
        assert res.exit_code == 0, res.output
        dirs.append(d)
    # one job equals simulating every load of the experiment without the trace files
    direct = _run("simulate", path, "--policy", "kv_aware", "--out", tmp_path / "direct")
    assert direct.exit_code == 0, direct.output
    assert _sha(tmp_path / "direct/requests.parquet") == _sha(tmp_path / "sim/kv_aware/requests.parquet")

    res = _run("merge", "--out", tmp_path / "merged", *reversed(dirs))
    assert res.exit_code == 0, res.output
    summary = pd.read_csv(tmp_path / "merged/summary.csv")
    assert list(summary.columns[:6]) == ["experiment", "hardware", "policy", "round", "load_param", "load"]
    assert len(summary) == len(exp.expand()) and set(summary["load_param"]) == {"rate_per_s"}
    keys = list(summary[["policy", "load", "round"]].itertuples(index=False, name=None))
    assert keys == [(p, v, r) for p in ("kv_aware", "round_robin") for v in (1.0, 2.5, 8.0) for r in (0, 1)]
    table = pq.read_table(tmp_path / "merged/requests.parquet")
    assert table.schema.names == list(REQUEST_COLUMNS)
    records = table.to_pandas()
    assert set(records["load_param"]) == {"rate_per_s"} and set(records["load"]) == {1.0, 2.5, 8.0}
    per_run = records.groupby(["policy", "load", "round"]).size()
    assert list(per_run.values) == list(summary["requests"])
    # the same requests at every load of a round, only their timing differs
    a, b = (records[(records["policy"] == "round_robin") & (records["round"] == 0) & (records["load"] == v)] for v in (1.0, 8.0))
    assert sorted(zip(a["conversation"], a["turn"], a["prompt_tokens"])) == sorted(zip(b["conversation"], b["turn"], b["prompt_tokens"]))
    assert a["arrival_s"].max() > b["arrival_s"].max()


def test_simulate_trace_needs_one_load(tmp_path):
    path = _write(tmp_path, OPEN)
    trace = tmp_path / "w.parquet"
    assert _run("workload", path, "--round", 0, "--load", 1, "--out", trace).exit_code == 0
    res = _run("simulate", path, "--trace", trace, "--round", 0, "--out", tmp_path / "o")
    assert res.exit_code != 0 and "--load" in res.output
    assert not (tmp_path / "o").exists()


def test_without_a_load_axis_the_load_columns_are_empty(tmp_path):
    path = _write(tmp_path, _with(OPEN, load=None, rounds=1))
    assert _run("simulate", path, "--policy", "round_robin", "--out", tmp_path / "o").exit_code == 0
    summary = pd.read_csv(tmp_path / "o/summary.csv")
    assert summary["load_param"].isna().all() and summary["load"].isna().all() and len(summary) == 1
    records = pd.read_parquet(tmp_path / "o/requests.parquet")
    assert records["load_param"].isna().all() and records["load"].isna().all()


def test_measure_takes_a_load():
    res = _run("measure", "--help")
    assert res.exit_code == 0 and "--load" in res.output


def test_measured_runs_at_two_loads_keep_their_own_engine_counters(tmp_path):
    """Behind a production router the records name no worker; each load's imbalance then
    comes from that load's engine counters, not the other load's."""
    from kvroute.live.loadgen import records_for, write_results
    from kvroute.live.measure import _imbalance_from_metrics, _run_label

    row = {"conversation": "c", "turn": 0, "worker": "unknown", "arrival_s": 0.0, "finish_s": 1.0, "ttft_ms": 1.0,
           "e2e_ms": 2.0, "prompt_tokens": 10, "cached_tokens": 0, "output_tokens": 1, "status": "ok"}
    records = [r for v in (2, 8) for r in records_for([row], source="live", experiment="e", hardware="cpu", policy="p",
                                                        round=0, load_param="rate_per_s", load=v)]
    summary = write_results(records, tmp_path)
    counters = {"even": [10, 10], "piled": [20, 0]}
    loads = {_run_label("p", 0, v): {f"w{i}": {"metrics_prompt_tokens": w, "metrics_cache_hits": 0, "metrics_generation_tokens": 0}
                                     for i, w in enumerate(counters[name])} for v, name in ((2, "even"), (8, "piled"))}
    out = _imbalance_from_metrics(summary, records, loads, tmp_path).set_index("load")["imbalance"]
    assert out[2.0] == 0.0 and out[8.0] == pytest.approx(1.0)
    assert _run_label("p", 0, None) == "p round 0" and _run_label("p", 1, 2.5) == "p round 1 load 2.5"


# ------------------------------------------------------------------ curves against load


def _summary(rounds: int = 3) -> pd.DataFrame:
    """A made-up merged summary: TTFT grows with load, faster for round-robin."""
    rows = []
    for pol, slope in (("round_robin", 20.0), ("kv_aware", 5.0)):
        for load in (1.0, 4.0, 16.0):
            for r in range(rounds):
                rows.append({"experiment": "e", "hardware": "h", "policy": pol, "round": r, "load_param": "rate_per_s",
                             "load": load, "ttft_mean_ms": 100 + slope * load + r, "ttft_p90_ms": 200 + slope * load,
                             "later_ttft_mean_ms": 90.0, "e2e_mean_ms": 1000 + load, "time_to_complete_s": 60 / load,
                             "hit_rate": 0.5 if pol == "round_robin" else 0.9, "imbalance": 0.1 * r})
    return pd.DataFrame(rows)


def test_load_curves_are_means_over_rounds_with_intervals():
    curves = load_curves(_summary())
    assert len(curves) == 6 and list(curves["load"][:3]) == [1.0, 4.0, 16.0]
    rr = curves[(curves["policy"] == "round_robin") & (curves["load"] == 4.0)].iloc[0]
    assert rr["ttft_mean_ms_mean"] == pytest.approx(100 + 80 + 1) and rr["n"] == 3
    half = 2.0 * 0.0 + 4.302652729911275 * 1.0 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n), sd = 1
    assert rr["ttft_mean_ms_half"] == pytest.approx(half)
    assert rr["ttft_p90_ms_half"] == 0.0  # equal in every round
    assert set(f"{m}_mean" for m in CURVE_METRICS) <= set(curves.columns)
    one = load_curves(_summary(rounds=1))
    assert one["ttft_mean_ms_half"].isna().all()  # one round: no interval


def test_load_curves_refuse_what_has_no_load_axis():
    s = _summary().assign(load=np.nan)
    with pytest.raises(ValueError, match="no load axis"):
        load_curves(s)
    with pytest.raises(ValueError, match="no column p99"):
        load_curves(_summary(), metrics=["p99"])
    with pytest.raises(ValueError, match="both records and service_class"):
        load_curves(_summary(), records=pd.DataFrame())


def test_load_curves_with_goodput(tmp_path):
    base = {"experiment": "e", "hardware": "h", "load_param": "rate_per_s", "status": "ok", "output_tokens": 11}
    rows, summary = [], []
    for pol in ("a", "b"):
        for load in (1.0, 2.0):
            for r in (0, 1):
                # policy b misses the TTFT target at load 2; each run lasts 10 s
                ttft = 500.0 if (pol == "b" and load == 2.0) else 50.0
                for i in range(4):
                    rows.append({**base, "policy": pol, "load": load, "round": r, "arrival_s": i * 2.5,
                                 "finish_s": 10.0 if i == 3 else 1.0, "ttft_ms": ttft, "e2e_ms": ttft + 100})
                summary.append({"experiment": "e", "hardware": "h", "policy": pol, "round": r,
                                "load_param": "rate_per_s", "load": load, "hit_rate": 0.5})
    curves = load_curves(pd.DataFrame(summary), pd.DataFrame(rows), ServiceClass("s", 100.0, 50.0), metrics=["hit_rate"])
    got = curves.set_index(["policy", "load"])["goodput_rps_mean"].to_dict()
    assert got == {("a", 1.0): 0.4, ("a", 2.0): 0.4, ("b", 1.0): 0.4, ("b", 2.0): 0.0}
    assert curves.set_index(["policy", "load"])["attainment_mean"][("b", 2.0)] == 0.0


def test_against_load_draws_a_line_and_band_per_policy(tmp_path):
    figures.setup()
    curves = load_curves(_summary())
    fig, ax = figures.figure()
    figures.against_load(ax, curves, "ttft_mean_ms", policies=["kv_aware", "round_robin"], log_x=True)
    handles, labels = ax.get_legend_handles_labels()
    assert labels == ["KV-aware", "round-robin"]
    drawn = [ln for ln in ax.get_lines() if len(ln.get_xdata())]
    assert len(drawn) == 2 and sorted(drawn[0].get_xdata()) == [1.0, 4.0, 16.0]
    assert len(ax.collections) == 2  # an interval band per policy
    assert ax.get_xlabel() == "arrival rate (conversations/s)" and ax.get_ylabel() == CURVE_METRICS["ttft_mean_ms"]
    paths = figures.save(fig, tmp_path, "load", "ttft", "test.ipynb")
    assert all(p.stat().st_size > 0 for p in paths)
    fig, ax = figures.figure()
    with pytest.raises(ValueError, match="no metric 'goodput_rps'"):
        figures.against_load(ax, curves, "goodput_rps")
    with pytest.raises(ValueError, match="several experiments"):
        figures.against_load(ax, pd.concat([curves, curves.assign(hardware="other")]), "hit_rate")
    plt.close("all")
