"""`kvroute calibrate`: the fit recovers coefficients that made the records, and says so."""

import shutil

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from kvroute.calibrate import STATS, calibrate, timing_stats
from kvroute.cli import main
from kvroute.experiment import load_experiment
from kvroute.hardware import hardware_dir, load_hardware
from kvroute.sim.run import simulate_experiment

TRUTH = {"compute_efficiency": 0.5, "step_overhead_ms": 12.0, "api_overhead_ms": 25.0}


def _experiment(tmp_path):
    raw = {
        "name": "cal", "seed": 5, "rounds": 1,
        "workload": {"generator": "note2", "params": {"chats": 4, "turns": 3, "system_words": 300,
                                                      "user_words": 60, "reply_tokens": 16, "ramp_s": 0.5}},
        "runs": [{"hardware": "cpu", "policies": ["round_robin", "kv_aware"]}],
    }
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def records_from_truth(tmp_path, monkeypatch):
    """Records simulated on a copy of the profiles whose cpu coefficients are TRUTH."""
    hw_copy = tmp_path / "hardware"
    shutil.copytree(hardware_dir(), hw_copy)
    coeffs = yaml.safe_load((hw_copy / "coefficients.yaml").read_text())
    family = load_hardware("cpu").coefficients_name
    coeffs[family].update(TRUTH)
    (hw_copy / "coefficients.yaml").write_text(yaml.safe_dump(coeffs))
    exp_path = _experiment(tmp_path)
    monkeypatch.setenv("KVROUTE_HARDWARE_DIR", str(hw_copy))
    simulate_experiment(load_experiment(exp_path), tmp_path / "truth")
    monkeypatch.delenv("KVROUTE_HARDWARE_DIR")
    return exp_path, tmp_path / "truth"


def test_timing_stats_are_means_per_policy():
    rec = pd.DataFrame({
        "policy": ["a", "a", "a", "b"], "turn": [0, 1, 2, 0], "status": ["ok", "ok", "error", "ok"],
        "ttft_ms": [100.0, 20.0, 999.0, 50.0], "e2e_ms": [190.0, 60.0, 999.0, 50.0], "output_tokens": [10, 5, 0, 1],
    })
    s = timing_stats(rec)
    assert list(s.columns) == list(STATS)
    assert s.loc["a", "ttft_first_ms"] == 100.0 and s.loc["a", "ttft_later_ms"] == 20.0  # the error row is left out
    assert s.loc["a", "tpot_ms"] == pytest.approx((90 / 9 + 40 / 4) / 2)
    assert pd.isna(s.loc["b", "tpot_ms"])  # one output token: no time per output token


def test_calibration_recovers_the_coefficients_that_made_the_records(records_from_truth):
    exp_path, truth_dir = records_from_truth
    start = load_hardware("cpu").coefficients
    assert all(getattr(start, k) != pytest.approx(v, rel=0.2) for k, v in TRUTH.items())  # it has to move
    fit = calibrate(load_experiment(exp_path), pd.read_parquet(truth_dir / "requests.parquet"), "cpu")
    assert fit.loss_after < fit.loss_before / 20
    for key, value in TRUTH.items():
        assert getattr(fit.fitted, key) == pytest.approx(value, rel=0.15), key
    table = fit.table()
    assert (table["error_after"].abs() < 0.05).all()
    assert fit.fitted.mem_efficiency == start.mem_efficiency  # not fitted, kept


def test_calibrate_command_writes_a_coefficients_entry(records_from_truth, tmp_path):
    exp_path, truth_dir = records_from_truth
    out = tmp_path / "fit" / "cpu.yaml"
    res = CliRunner().invoke(main, ["calibrate", str(exp_path), str(truth_dir), "--hardware", "cpu",
                                    "--out", str(out), "--fit", "step_overhead_ms", "--max-evaluations", "40"])
    assert res.exit_code == 0, res.output
    entry = yaml.safe_load(out.read_text())
    family = load_hardware("cpu").coefficients_name
    assert set(entry) == {family}
    assert entry[family]["step_overhead_ms"] != load_hardware("cpu").coefficients.step_overhead_ms
    assert set(pd.read_csv(out.with_suffix(".csv"))["statistic"]) == set(STATS)


def test_calibrate_names_bad_input(records_from_truth, tmp_path):
    exp_path, truth_dir = records_from_truth
    runner = CliRunner()
    res = runner.invoke(main, ["calibrate", str(exp_path), str(truth_dir), "--hardware", "cpu",
                               "--out", str(tmp_path / "x.yaml"), "--fit", "warp_factor"])
    assert res.exit_code != 0 and "warp_factor" in res.output and "compute_efficiency" in res.output
    res = runner.invoke(main, ["calibrate", str(exp_path), str(truth_dir), "--hardware", "a6000x4",
                               "--out", str(tmp_path / "x.yaml")])
    assert res.exit_code != 0 and "no records" in res.output and "a6000x4" in res.output
    res = runner.invoke(main, ["calibrate", str(exp_path), str(tmp_path), "--hardware", "cpu", "--out", str(tmp_path / "x.yaml")])
    assert res.exit_code != 0 and "requests.parquet" in res.output
