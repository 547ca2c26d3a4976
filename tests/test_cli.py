"""The command line: outputs, and errors that name the problem before anything runs."""

import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main

GOOD = {
    "name": "cli",
    "workload": {"generator": "note2", "params": {"chats": 4, "turns": 2, "system_words": 100, "user_words": 20, "reply_tokens": 8}},
    "runs": [{"hardware": "a6000x4", "policies": ["round_robin"]}],
}


def _write(tmp_path, raw):
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_simulate_writes_the_two_files(tmp_path):
    res = _run("simulate", _write(tmp_path, GOOD), "--out", tmp_path / "o", "--policy", "kv_aware", "--policy", "sticky")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o/requests.parquet").is_file() and (tmp_path / "o/summary.csv").is_file()
    assert "kv_aware" in res.output and "sticky" in res.output


def test_unknown_policy_lists_valid_names(tmp_path):
    res = _run("simulate", _write(tmp_path, GOOD), "--out", tmp_path / "o", "--policy", "telepathy")
    assert res.exit_code != 0
    assert "telepathy" in res.output and "round_robin" in res.output and "kv_aware" in res.output
    assert not (tmp_path / "o").exists()


def test_unknown_hardware_lists_valid_names(tmp_path):
    res = _run("simulate", _write(tmp_path, GOOD), "--out", tmp_path / "o", "--hardware", "tpu")
    assert res.exit_code != 0 and "tpu" in res.output and "a6000x4" in res.output


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda r: r.update(rounds="three"), "rounds"),
        (lambda r: r.update(colour="blue"), "colour"),
        (lambda r: r["runs"][0].update(hardware="abacus"), "runs.0.hardware"),
        (lambda r: r["runs"][0].update(policies=["kv_aware", "cost_aware:beta=2"]), "runs.0.policies.1"),
        (lambda r: r.pop("workload"), "workload"),
    ],
)
def test_invalid_experiment_names_the_key(tmp_path, mutate, key):
    raw = yaml.safe_load(yaml.safe_dump(GOOD))
    mutate(raw)
    res = _run("simulate", _write(tmp_path, raw), "--out", tmp_path / "o")
    assert res.exit_code != 0
    assert key in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_unknown_generator_parameter_is_named(tmp_path):
    raw = yaml.safe_load(yaml.safe_dump(GOOD))
    raw["workload"]["params"]["chatz"] = 3
    res = _run("simulate", _write(tmp_path, raw), "--out", tmp_path / "o")
    assert res.exit_code != 0 and "chatz" in res.output


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "simulate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--policy" in out.stdout


def test_simulate_uses_the_coefficients_file_and_records_it(tmp_path):
    import json

    import pandas as pd

    from kvroute.hardware import load_hardware

    exp = _write(tmp_path, GOOD | {"runs": [{"hardware": "cpu", "policies": ["round_robin"]}]})
    base = load_hardware("cpu").coefficients
    slow = dict(base.__dict__) | {"step_overhead_ms": base.step_overhead_ms * 4, "api_overhead_ms": 200.0,
                                  "api_jitter_ms": 0.0}
    coef = tmp_path / "fit.yaml"
    coef.write_text(yaml.safe_dump({load_hardware("cpu").coefficients_name: slow | {"provenance": {"method": "test"}}}))
    assert _run("simulate", exp, "--out", tmp_path / "a").exit_code == 0
    res = _run("simulate", exp, "--out", tmp_path / "b", "--coefficients", coef)
    assert res.exit_code == 0, res.output
    a, b = (pd.read_parquet(tmp_path / d / "requests.parquet") for d in "ab")
    assert (b["ttft_ms"] >= 200.0).all() and (a["ttft_ms"] < 200.0).any()  # every request waited the file's API cost
    info = json.loads((tmp_path / "b/run.json").read_text())["coefficients"]["cpu"]
    assert info["file"] == str(coef) and info["values"]["api_overhead_ms"] == 200.0
    assert json.loads((tmp_path / "a/run.json").read_text())["coefficients"]["cpu"]["file"].endswith("coefficients.yaml")


def test_simulate_names_a_coefficients_file_without_the_family(tmp_path):
    coef = tmp_path / "fit.yaml"
    coef.write_text(yaml.safe_dump({"cpu-provisional": {"mem_efficiency": 0.5}}))
    res = _run("simulate", _write(tmp_path, GOOD), "--out", tmp_path / "o", "--coefficients", coef)
    assert res.exit_code != 0 and "gpu-a6000" in res.output and "cpu-provisional" in res.output
    res = _run("simulate", _write(tmp_path, GOOD), "--out", tmp_path / "o", "--hardware", "cpu", "--coefficients", coef)
    assert res.exit_code != 0 and "malformed" in res.output
    assert not (tmp_path / "o").exists()  # nothing ran
