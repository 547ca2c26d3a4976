"""An experiment's operating point: the search recovers a load it was given the metric of,
refuses a target outside its bounds, and the key is checked before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.experiment import ExperimentError, load_experiment
from kvroute.sim import operating_point as op
from kvroute.sim.run import load_trace
from kvroute.workload import read_trace


def _write(tmp_path: Path, value: float, **point) -> Path:
    reported = tmp_path / "reported.csv"
    reported.write_text(f"key,value,source\nll_mean,{value},a study (section Results)\n")
    spec = {"param": "rate_per_s", "bounds": [0.5, 40], "policy": "least_loaded", "metric": "ttft_mean_ms",
            "target": {"reported": str(reported), "key": "ll_mean"}, "rtol": 0.02, **point}
    exp = {
        "name": "pt", "seed": 3, "rounds": 2,
        "workload": {"generator": "sharegpt_like", "params": {"conversations": 12, "max_turns": 3}},
        "runs": [{"hardware": "a6000x4", "policies": ["least_loaded", "sticky"]}],
        "operating_point": spec,
    }
    path = tmp_path / "pt.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


@pytest.fixture(scope="module")
def open_loop(tmp_path_factory) -> Path:
    """An open-loop experiment (sharegpt_like on the slow cpu profile, where queueing
    sets in at a fraction of a conversation per second), cheap enough to search in a test."""
    tmp = tmp_path_factory.mktemp("op")
    reported = tmp / "reported.csv"
    exp = {
        "name": "pt", "seed": 3, "rounds": 2,
        "workload": {"generator": "sharegpt_like", "params": {"conversations": 40, "max_turns": 6}},
        "runs": [{"hardware": "cpu", "policies": ["least_loaded", "sticky"]}],
        "operating_point": {"param": "rate_per_s", "bounds": [0.2, 5], "policy": "least_loaded",
                            "metric": "ttft_mean_ms", "target": {"reported": str(reported), "key": "ll_mean"},
                            "rtol": 0.02},
    }
    path = tmp / "pt.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _set_target(path: Path, value: float) -> None:
    exp = yaml.safe_load(path.read_text())
    Path(exp["operating_point"]["target"]["reported"]).write_text(f"key,value,source\nll_mean,{value},a study (section X)\n")


def test_the_search_recovers_a_rate_from_its_metric(open_loop):
    exp = load_experiment(open_loop)
    given = op.evaluate(exp, 0.4)["ttft_mean_ms"]
    _set_target(open_loop, given)
    record = op.find(exp)
    assert record["value"] == pytest.approx(0.4, rel=0.05)
    assert record["achieved"] == pytest.approx(given, rel=0.05)
    assert record["target"] == given and record["target_key"] == "ll_mean"
    values = [e["value"] for e in record["evaluations"]]
    assert values == sorted(values) and len(set(values)) == len(values)  # each value simulated once
    assert min(values) == pytest.approx(0.2) and max(values) == pytest.approx(5)
    assert op.find(exp) == record  # deterministic: same seed, same walk


def test_a_target_out_of_reach_names_both_ends(open_loop):
    _set_target(open_loop, 1e9)
    with pytest.raises(ExperimentError, match=r"rate_per_s=0\.2 and .* at 5: the target 1e\+09 is not between them"):
        op.find(load_experiment(open_loop))


def test_the_workload_takes_the_point_and_needs_it(open_loop, tmp_path):
    exp = load_experiment(open_loop)
    with pytest.raises(ValueError, match="operating point: run `kvroute operating-point`"):
        load_trace(exp, 0)
    at = load_trace(exp, 0, point=12.5)
    assert at.meta["params"]["rate_per_s"] == 12.5
    point = tmp_path / "point.json"
    op.write({"experiment": "pt", "param": "rate_per_s", "value": 12.5}, point)
    out = tmp_path / "w.parquet"
    res = CliRunner().invoke(main, ["workload", str(open_loop), "--round", "0", "--out", str(out),
                                    "--operating-point", str(point)])
    assert res.exit_code == 0, res.output
    assert read_trace(out).conversations == at.conversations
    res = CliRunner().invoke(main, ["workload", str(open_loop), "--round", "0", "--out", str(out)])
    assert res.exit_code != 0 and "--operating-point" in res.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"experiment": "kv-reuse", "param": "rate_per_s", "value": 3}))
    res = CliRunner().invoke(main, ["workload", str(open_loop), "--round", "0", "--out", str(out),
                                    "--operating-point", str(other)])
    assert res.exit_code != 0 and "not of 'pt'" in res.output


def test_the_command_writes_the_search(open_loop, tmp_path):
    exp = load_experiment(open_loop)
    _set_target(open_loop, op.evaluate(exp, 0.6)["ttft_mean_ms"])
    out = tmp_path / "point.json"
    res = CliRunner().invoke(main, ["operating-point", str(open_loop), "--out", str(out)])
    assert res.exit_code == 0, res.output
    record = json.loads(out.read_text())
    assert record["value"] == pytest.approx(0.6, rel=0.05) and "rate_per_s = " in res.output
    assert op.read(out, exp) == record["value"]


@pytest.mark.parametrize("change, message", [
    ({"bounds": [5, 1]}, "operating_point.bounds: need 0 < low < high"),
    ({"policy": "kv_aware"}, "operating_point.policy: 'kv_aware' is not a policy the experiment runs"),
    ({"param": "conversations"}, "workload.params.conversations: the operating point sets conversations"),
    ({"param": "nonsense"}, "operating_point.param: 'nonsense' is not a parameter"),
    ({"round": 2}, "operating_point.round: 2 but the experiment has rounds 0..1"),
    ({"metric": "hit_rate"}, "operating_point.metric"),
    ({"colour": "red"}, "operating_point"),
])
def test_a_bad_operating_point_names_its_key(tmp_path, change, message):
    with pytest.raises(ExperimentError, match=message):
        load_experiment(_write(tmp_path, 100.0, **change))


def test_an_unknown_published_key_is_named(tmp_path):
    exp = load_experiment(_write(tmp_path, 100.0, target={"reported": str(tmp_path / "reported.csv"), "key": "nope"}))
    with pytest.raises(ExperimentError, match="operating_point.target.key: 'nope' is not a row"):
        exp.operating_point.target()


def test_kv_reuse_matches_a_published_figure_by_key():
    root = Path(__file__).resolve().parents[1]
    exp = load_experiment(root / "config/experiments/kv-reuse.yaml")
    spec = exp.operating_point
    assert (spec.policy, spec.metric, spec.param) == ("least_loaded", "ttft_mean_ms", "rate_per_s")
    value, source = op.OperatingPointSpec(**{**spec.__dict__, "reported": root / spec.reported}).target()
    assert value > 0 and "multi-turn-kv-reuse-bench" in source
    assert "rate_per_s" not in exp.workload["params"]
