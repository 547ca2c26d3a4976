"""`kvroute measure` end to end on emulated engines: workers up, gateway per policy, load, workers down."""

import json
import os

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.records import REQUEST_COLUMNS

EXP = {
    "name": "mtest",
    "seed": 3,
    "rounds": 1,
    "workload": {"generator": "note2", "params": {"chats": 4, "turns": 3, "system_words": 300, "user_words": 200,
                                                  "reply_tokens": 8, "ramp_s": 0.5}},
    "runs": [{"hardware": "cpu", "policies": ["round_robin", "sticky"]}],
}


@pytest.fixture
def exp_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(EXP))
    return p


def test_measure_on_the_emulator_writes_labelled_records(tmp_path, exp_file):
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["measure", str(exp_file), "--hardware", "cpu", "--engine", "emulator", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_parquet(out / "requests.parquet")
    assert list(df.columns) == list(REQUEST_COLUMNS)
    assert len(df) == 2 * 4 * 3 and (df.status == "ok").all()
    assert (df.source == "emulated").all() and (df.view == "approx").all()
    assert set(df.worker) <= {"w0", "w1"}
    # sticky keeps a conversation on one worker, so its later turns read their history from cache
    sticky = df[df.policy == "sticky"]
    assert sticky.groupby("conversation").worker.nunique().eq(1).all()
    later = sticky[sticky.turn > 0]
    assert (later.cached_tokens > later.prompt_tokens * 0.5).all()
    summary = pd.read_csv(out / "summary.csv")
    assert set(summary.policy) == {"round_robin", "sticky"}
    # engines were stopped: the run folder's engines left logs but no live workers behind
    assert (out / "engines").is_dir()
    # how the workers shared the machine: emulators are not pinned, whatever the profile says
    meta = json.loads((out / "load.json").read_text())
    cpus = sorted(os.sched_getaffinity(0))
    assert meta["cpu_affinity"] == {"mode": "none", "workers": {"w0": cpus, "w1": cpus}, "gateway_and_loadgen": cpus,
                                    "client_worker": None}
    assert set(meta["client_cpu_s"]) == {"round_robin round 0", "sticky round 0"}
    assert all(v > 0 for v in meta["client_cpu_s"].values())
    assert meta["warmup"] == {}  # the emulator has no first-load cost to pay: no warm-up
    assert meta["canary"] == {}  # the machine-speed canary times real engines' cores only


def test_measure_rejects_unknown_policy_before_starting_engines(tmp_path, exp_file):
    res = CliRunner().invoke(main, ["measure", str(exp_file), "--hardware", "cpu", "--engine", "emulator",
                                    "--out", str(tmp_path / "o"), "--policy", "telepathy"])
    assert res.exit_code != 0 and "telepathy" in res.output and "kv_aware" in res.output
    assert not (tmp_path / "o" / "engines").exists()


def test_measure_refuses_to_probe_the_emulator_before_starting_engines(tmp_path, exp_file):
    """--probe calibrates real engines; an emulator's step times are the simulator's own."""
    res = CliRunner().invoke(main, ["measure", str(exp_file), "--hardware", "cpu", "--engine", "emulator",
                                    "--out", str(tmp_path / "o"), "--probe", str(tmp_path / "p.yaml")])
    assert res.exit_code != 0 and "--probe calibrates real engines" in res.output
    assert not (tmp_path / "o" / "engines").exists() and not (tmp_path / "p.yaml").exists()


def test_measure_passes_the_load_signal_to_the_gateway(tmp_path):
    """The experiment's load_signal reaches every gateway and the records, as the
    simulator writes it, so a simulated and a measured row compare like for like."""
    from kvroute.experiment import load_experiment
    from kvroute.sim.run import simulate_experiment

    raw = {**EXP, "load_signal": {"source": "scraped", "interval_ms": 50}, "runs": [{"hardware": "cpu", "policies": ["least_loaded"]}]}
    p = tmp_path / "scraped.yaml"
    p.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["measure", str(p), "--hardware", "cpu", "--engine", "emulator", "--out", str(out)])
    assert res.exit_code == 0, res.output
    measured = pd.read_parquet(out / "requests.parquet")
    assert (measured.load_signal == "scraped:50ms").all() and (measured.status == "ok").all()
    simulate_experiment(load_experiment(p), tmp_path / "sim")
    assert set(pd.read_parquet(tmp_path / "sim/requests.parquet").load_signal) == {"scraped:50ms"}


def test_measure_runs_several_experiments_on_one_engine_session(tmp_path, exp_file):
    """Two experiments, one engine start-up: each gets its own records, summary and load.json
    (naming the session it shared), the engines' logs stay in the first's folder, and each
    experiment's records are its own."""
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**EXP, "name": "mtest2", "seed": 5,
                                     "runs": [{"hardware": "cpu", "policies": ["least_loaded"]}]}))
    a, b = tmp_path / "a", tmp_path / "b"
    res = CliRunner().invoke(main, ["measure", str(exp_file), str(other), "--hardware", "cpu", "--engine", "emulator",
                                    "--out", str(a), "--out", str(b), "--rounds", "1"])
    assert res.exit_code == 0, res.output
    first, second = pd.read_parquet(a / "requests.parquet"), pd.read_parquet(b / "requests.parquet")
    assert set(first.experiment) == {"mtest"} and set(first.policy) == {"round_robin", "sticky"}
    assert set(second.experiment) == {"mtest2"} and set(second.policy) == {"least_loaded"}
    assert len(second) == 4 * 3 and (second.status == "ok").all()
    assert set(pd.read_csv(b / "summary.csv").policy) == {"least_loaded"}
    for i, out in enumerate((a, b)):
        session = json.loads((out / "load.json").read_text())["engine_session"]
        assert session == {"experiments": ["mtest", "mtest2"], "position": i, "engine_logs": str(a / "engines")}
    assert (a / "engines").is_dir() and not (b / "engines").exists()
    assert "mtest:" in res.output and "mtest2:" in res.output


@pytest.mark.parametrize("extra, message", [
    (["--out", "o1"], "give one --out per EXPERIMENT: 2 experiment(s), 1 --out"),
    (["--out", "o1", "--out", "o2", "--probe", "p1"], "give one --probe per EXPERIMENT (2), or none, not 1"),
    (["--out", "o1", "--out", "o2", "--rounds", "1", "--rounds", "2", "--rounds", "3"],
     "give --rounds once, or once per EXPERIMENT (2), not 3 times"),
])
def test_measure_of_several_experiments_names_a_miscount(tmp_path, exp_file, extra, message):
    res = CliRunner().invoke(main, ["measure", str(exp_file), str(exp_file), "--hardware", "cpu", "--engine",
                                    "emulator", *extra])
    assert res.exit_code != 0 and message in res.output, res.output
    assert not (tmp_path / "o1").exists()


def test_an_engine_session_refuses_experiments_that_want_different_engines(tmp_path, exp_file):
    """KV events change how the engines start: such experiments cannot share them."""
    events = tmp_path / "events.yaml"
    events.write_text(yaml.safe_dump({**EXP, "name": "ev", "view": "exact",
                                      "load_signal": {"source": "events", "delay_ms": 10}}))
    res = CliRunner().invoke(main, ["measure", str(exp_file), str(events), "--hardware", "cpu", "--engine", "emulator",
                                    "--out", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert res.exit_code != 0 and "KV events (ev)" in res.output and "measure them apart" in res.output, res.output
    assert not (tmp_path / "a" / "engines").exists()
