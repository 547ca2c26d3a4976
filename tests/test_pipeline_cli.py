"""The commands the workflow calls: workload, simulate --trace, merge, arithmetic, manifest;
and the pieces of kvroute.pipeline the rules rely on (policy slugs, config errors)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.experiment import load_experiment
from kvroute.pipeline import config_errors, policy_slug
from kvroute.records import requests_table, write_requests
from kvroute.sim.run import DRAWN_FOR, load_trace, stamp_trace
from kvroute.workload import read_trace, write_trace

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "name": "tiny",
    "seed": 3,
    "rounds": 2,
    "workload": {"generator": "note2", "params": {"chats": 4, "turns": 2, "system_words": 100, "user_words": 20, "reply_tokens": 8}},
    "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "cost_aware:alpha=0.5"]}],
}


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def exp(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


# ------------------------------------------------------------------ slugs


@pytest.mark.parametrize(
    "spec, slug",
    [
        ("round_robin", "round_robin"),
        ("cost_aware:alpha=0.25", "cost_aware__alpha-0.25"),
        ("hybrid_sticky:threshold_ms=5000", "hybrid_sticky__threshold_ms-5000"),
        ("dynamo:overlap_weight=2,temperature=0.1", "dynamo__overlap_weight-2_temperature-0.1"),
        ("cost_aware: alpha = 0.25", "cost_aware__alpha-0.25"),
    ],
)
def test_policy_slug(spec, slug):
    assert policy_slug(spec) == slug


@pytest.mark.parametrize("spec", ["", "a/b", "x:y=../z", "p:q=a b*"])
def test_policy_slug_refuses_what_is_no_folder_name(spec):
    with pytest.raises(ValueError):
        policy_slug(spec)


def test_every_configured_policy_has_a_distinct_slug():
    for path in sorted((ROOT / "config/experiments").glob("*.yaml")):
        specs = {spec for _, pols in load_experiment(path).runs for spec in pols}
        assert len({policy_slug(s) for s in specs}) == len(specs), path.name


# ------------------------------------------------------------------ workload and simulate --trace


def test_workload_writes_the_round_trace(exp, tmp_path):
    out = tmp_path / "w/round1.parquet"
    res = _run("workload", exp, "--round", 1, "--out", out)
    assert res.exit_code == 0, res.output
    assert read_trace(out) == stamp_trace(load_trace(load_experiment(exp), 1), "tiny", 1, None)
    assert read_trace(out).meta[DRAWN_FOR] == {"experiment": "tiny", "round": 1, "load": None}
    assert read_trace(out).conversations != load_trace(load_experiment(exp), 0).conversations
    assert not list(out.parent.glob(".*.tmp"))  # nothing left from the atomic write


def test_workload_refuses_a_round_the_experiment_lacks(exp, tmp_path):
    res = _run("workload", exp, "--round", 2, "--out", tmp_path / "x.parquet")
    assert res.exit_code != 0 and "round 2" in res.output
    assert not (tmp_path / "x.parquet").exists()


def test_simulate_from_a_trace_equals_simulating_from_the_experiment(exp, tmp_path):
    trace = tmp_path / "round1.parquet"
    assert _run("workload", exp, "--round", 1, "--out", trace).exit_code == 0
    common = ["--round", 1, "--hardware", "a6000x4", "--policy", "round_robin"]
    a = _run("simulate", exp, "--trace", trace, "--out", tmp_path / "a", *common)
    b = _run("simulate", exp, "--out", tmp_path / "b", *common)
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert _sha(tmp_path / "a/requests.parquet") == _sha(tmp_path / "b/requests.parquet")
    assert json.loads((tmp_path / "a/run.json").read_text())["trace"] == [str(trace)]


def _round_traces(exp: Path, folder: Path) -> list[Path]:
    paths = [folder / f"round{r}.parquet" for r in range(TINY["rounds"])]
    for r, path in enumerate(paths):
        assert _run("workload", exp, "--round", r, "--out", path).exit_code == 0
    return paths


def test_one_simulation_replays_every_rounds_trace_as_if_it_drew_them(exp, tmp_path):
    """The workflow's simulate job: one policy, every round from its own trace file (given
    in any order), the same records as drawing each round's workload."""
    paths = _round_traces(exp, tmp_path)
    common = ["--hardware", "a6000x4", "--policy", "round_robin"]
    a = _run("simulate", exp, *[x for p in reversed(paths) for x in ("--trace", p)], "--out", tmp_path / "a", *common)
    b = _run("simulate", exp, "--out", tmp_path / "b", *common)
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert _sha(tmp_path / "a/requests.parquet") == _sha(tmp_path / "b/requests.parquet")
    assert sorted(pd.read_csv(tmp_path / "a/summary.csv")["round"]) == [0, 1]


@pytest.mark.parametrize("case, said", [
    ("missing", "no --trace for round 1"),
    ("twice", "two traces are round 0"),
    ("unasked", "round 1, which none of the runs simulates"),
    ("other", "drawn for experiment 'tiny', not 'other'"),
    ("unstamped", "does not record the round and load"),
])
def test_replayed_traces_must_be_the_runs_rounds_once_each(exp, tmp_path, case, said):
    paths = _round_traces(exp, tmp_path)
    target, args = exp, []
    if case == "missing":
        args = ["--trace", paths[0]]
    elif case == "twice":
        args = ["--trace", paths[0], "--trace", paths[0], "--trace", paths[1]]
    elif case == "unasked":
        args = ["--trace", paths[0], "--trace", paths[1], "--round", 0]
    elif case == "other":
        target = tmp_path / "other.yaml"
        target.write_text(yaml.safe_dump({**TINY, "name": "other"}))
        args = ["--trace", paths[0], "--trace", paths[1]]
    else:
        bare = write_trace(load_trace(load_experiment(exp), 1), tmp_path / "bare.parquet")
        args = ["--trace", paths[0], "--trace", bare]
    res = _run("simulate", target, *args, "--out", tmp_path / "o", "--policy", "round_robin")
    assert res.exit_code != 0 and said in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_an_unstamped_trace_replays_one_round(exp, tmp_path):
    """A trace written before traces recorded their round still replays, for one round."""
    bare = write_trace(load_trace(load_experiment(exp), 1), tmp_path / "bare.parquet")
    res = _run("simulate", exp, "--trace", bare, "--out", tmp_path / "o")
    assert res.exit_code != 0 and "--round" in res.output
    assert not (tmp_path / "o").exists()
    res = _run("simulate", exp, "--trace", bare, "--round", 1, "--out", tmp_path / "a", "--policy", "round_robin")
    ref = _run("simulate", exp, "--round", 1, "--out", tmp_path / "b", "--policy", "round_robin")
    assert res.exit_code == 0 and ref.exit_code == 0, res.output + ref.output
    assert _sha(tmp_path / "a/requests.parquet") == _sha(tmp_path / "b/requests.parquet")


# ------------------------------------------------------------------ merge


@pytest.fixture
def job_dirs(exp, tmp_path):
    """Three single-run simulate outputs, as the workflow's jobs write them."""
    dirs = []
    for policy, round_ in (("round_robin", 1), ("cost_aware:alpha=0.5", 0), ("round_robin", 0)):
        d = tmp_path / f"jobs/{policy_slug(policy)}/round{round_}"
        res = _run("simulate", exp, "--out", d, "--policy", policy, "--round", round_)
        assert res.exit_code == 0, res.output
        dirs.append(d)
    return dirs


def test_merge_concatenates_and_sorts(job_dirs, tmp_path):
    res = _run("merge", "--out", tmp_path / "m", *job_dirs)
    assert res.exit_code == 0, res.output
    summary = pd.read_csv(tmp_path / "m/summary.csv")
    keys = list(summary[["policy", "round"]].itertuples(index=False, name=None))
    assert keys == [("cost_aware:alpha=0.5", 0), ("round_robin", 0), ("round_robin", 1)]
    requests = pq.read_table(tmp_path / "m/requests.parquet")
    parts = [pq.read_table(d / "requests.parquet") for d in job_dirs]
    assert requests.num_rows == sum(p.num_rows for p in parts)
    assert requests.schema == parts[0].schema
    df = requests.to_pandas()
    assert list(df[["policy", "round"]].drop_duplicates().itertuples(index=False, name=None)) == keys


def test_merge_is_independent_of_folder_order(job_dirs, tmp_path):
    assert _run("merge", "--out", tmp_path / "a", *job_dirs).exit_code == 0
    assert _run("merge", "--out", tmp_path / "b", *reversed(job_dirs)).exit_code == 0
    for name in ("requests.parquet", "summary.csv"):
        assert _sha(tmp_path / "a" / name) == _sha(tmp_path / "b" / name)


def test_merge_refuses_the_same_run_twice(job_dirs, tmp_path):
    res = _run("merge", "--out", tmp_path / "m", job_dirs[0], job_dirs[0])
    assert res.exit_code != 0 and "same run" in res.output
    assert not (tmp_path / "m/summary.csv").exists()


def test_merge_refuses_a_folder_without_results(tmp_path):
    (tmp_path / "empty").mkdir()
    res = _run("merge", "--out", tmp_path / "m", tmp_path / "empty")
    assert res.exit_code != 0 and "requests.parquet" in res.output


# ------------------------------------------------------------------ arithmetic


def test_arithmetic_is_registered():
    res = _run("arithmetic", "--help")
    assert res.exit_code == 0 and "--out" in res.output


# ------------------------------------------------------------------ manifest


def _records(path: Path, source: str, rows: int = 3) -> None:
    base = {"experiment": "e", "hardware": "cpu", "policy": "sticky", "round": 0, "turn": 0,
            "worker": "w0", "status": "ok", "source": source}
    write_requests(requests_table([{**base, "conversation": f"c{i}"} for i in range(rows)]), path)


def test_manifest_records_provenance(tmp_path):
    results = tmp_path / "results"
    _records(results / "sim/kv-reuse/requests.parquet", "sim")
    _records(results / "sim/kv-reuse/a6000x4/round_robin/round0/requests.parquet", "sim")  # per-job: not listed
    _records(results / "measure/note2-cpu/cpu/requests.parquet", "live", rows=5)
    _records(results / "measure/explainer/a100x1/requests.parquet", "emulated")
    out, tex = results / "manifest.json", results / "manifest.tex"
    res = _run("manifest", "--out", out, "--tex", tex, "--results", results,
               "--config", ROOT / "config/config.yaml", "--experiments", ROOT / "config/experiments")
    assert res.exit_code == 0, res.output
    m = json.loads(out.read_text())
    assert m["commit"] == "unknown" or len(m["commit"]) == 40
    assert m["packages"]["kvroute"] and m["packages"]["snakemake"]
    assert m["host"]["cores"] >= 1 and m["host"]["cpu"]  # the host's CPU model (CPU timings depend on it)
    for env in ("engine-cpu", "routers"):  # every environment: its versions, or that it is not built here
        assert m["environments"][env], env
    assert {"a6000x4", "cpu", "h100x8"} <= set(m["hardware"])
    assert m["hardware"]["cpu"]["workers"] == 2
    hashes = m["config_hash"]
    assert hashes[(ROOT / "config/config.yaml").as_posix()] == _sha(ROOT / "config/config.yaml")
    assert hashes[(ROOT / "config/experiments/kv-reuse.yaml").as_posix()] == _sha(ROOT / "config/experiments/kv-reuse.yaml")
    assert m["sources"] == {"simulated": ["sim/kv-reuse"], "measured": ["measure/note2-cpu/cpu"],
                            "emulated": ["measure/explainer/a100x1"]}
    assert m["results"]["measure/note2-cpu/cpu"] == {"sources": ["live"], "rows": 5}
    text = tex.read_text()  # the appendix: every key and value, LaTeX-escaped
    assert r"\toprule" in text and "explainer" in text and m["commit"][:7] in text
    body = "\n".join(line for line in text.splitlines() if not line.startswith("%"))
    assert "_" not in body.replace(r"\_", "")


def test_manifest_with_no_results(tmp_path):
    res = _run("manifest", "--out", tmp_path / "m.json", "--results", tmp_path / "none",
               "--config", ROOT / "config/config.yaml", "--experiments", ROOT / "config/experiments")
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["results"] == {} and m["sources"] == {"simulated": [], "measured": [], "emulated": []}


# ------------------------------------------------------------------ config errors


def test_config_errors_name_the_key():
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    assert config_errors(config, schema) == []
    config["measure"]["enabled"] = "yes"
    config["notes"][0]["colour"] = "blue"
    config["experimnets"] = []
    errors = "\n".join(config_errors(config, schema))
    assert "key measure.enabled:" in errors
    assert "key notes.0.colour: unknown key" in errors
    assert "key experimnets: unknown key" in errors


def test_schema_documents_every_key():
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())

    def walk(node, where):
        if node.get("type") == "object":
            assert node.get("additionalProperties") is False, f"{where}: additionalProperties must be false"
            for key, sub in node.get("properties", {}).items():
                path = f"{where}.{key}"
                assert sub.get("description"), f"{path}: no description"
                required = key in node.get("required", [])
                assert required or "default" in sub, f"{path}: no default"
                walk(sub, path)
        if node.get("type") == "array" and isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")

    walk(schema, "config")
