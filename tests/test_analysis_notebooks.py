"""The analysis notebooks run under papermill on small sample results and write
exactly what docs/pipeline.md promises; one note compiles with latexmk from them.

The sample results are tiny simulations of the real experiments (same names, small
workloads, two rounds), written in a temporary folder once per session.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

# about a minute on a 2-core machine (four kernels, small simulations, two LaTeX builds)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

#: small versions of the experiments the notebooks read (same names)
#: the kv-reuse study's strategies (paper/reported/kv_reuse.csv)
KV_REUSE_ORIGINAL = ["random", "least_loaded", "sticky", "hybrid_sticky:threshold_ms=500", "hybrid_sticky:threshold_ms=5000",
                     "cost_aware:alpha=0.25", "cost_aware:alpha=1", "cost_aware:alpha=2"]
SAMPLES = {
    "note2-6turn": {"generator": "note2", "params": {"chats": 8, "turns": 3, "ramp_s": 1.0},
                    "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "least_loaded", "kv_aware"]}]},
    "note2-20turn": {"generator": "note2", "params": {"chats": 8, "turns": 4, "ramp_s": 1.0},
                     "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "least_loaded", "kv_aware"]}]},
    # the least-loaded comparison with scraped load (note2-*-scraped)
    "note2-6turn-scraped": {"generator": "note2", "params": {"chats": 8, "turns": 3, "ramp_s": 1.0},
                            "load_signal": {"source": "scraped", "interval_ms": 50},
                            "runs": [{"hardware": "a6000x4", "policies": ["least_loaded", "kv_aware"]}]},
    "note2-20turn-scraped": {"generator": "note2", "params": {"chats": 8, "turns": 4, "ramp_s": 1.0},
                             "load_signal": {"source": "scraped", "interval_ms": 50},
                             "runs": [{"hardware": "a6000x4", "policies": ["least_loaded", "kv_aware"]}]},
    "note2-a100": {"generator": "note2", "params": {"chats": 8, "turns": 3, "ramp_s": 1.0},
                   "runs": [{"hardware": "a100x1-2workers", "policies": ["round_robin", "kv_aware"]},
                            {"hardware": "a100x1", "policies": ["round_robin"]}]},
    "note2-large": {"generator": "agent",
                    "params": {"conversations": 6, "concurrency": 3, "first_prompt_tokens": 8000,
                               "last_prompt_tokens": 12000, "min_turns": 2, "max_turns": 3, "ramp_s": 1.0},
                    "runs": [{"hardware": "h100x8", "policies": ["round_robin", "least_loaded", "kv_aware",
                                                                 "cost_aware:alpha=1"]}]},
    # note 2's claims: small versions of its sweeps (workers, turns, reply length)
    "note2-workers": {"generator": "note2", "params": {"chats": 8, "turns": 3, "ramp_s": 1.0},
                      "runs": [{"hardware": "a6000x2", "policies": ["round_robin", "kv_aware"]},
                               {"hardware": "a6000x8", "policies": ["round_robin", "kv_aware"]}]},
    "note2-turns": {"generator": "note2", "params": {"chats": 8, "ramp_s": 1.0},
                    "load": {"param": "turns", "values": [2, 4]},
                    "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "kv_aware"]}]},
    "note2-replies": {"generator": "note2", "params": {"chats": 8, "turns": 3, "ramp_s": 1.0},
                      "load": {"param": "reply_tokens", "values": [32, 256]},
                      "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "kv_aware"]}]},
    "kv-reuse": {"generator": "sharegpt_like", "params": {"conversations": 30, "rate_per_s": 4.0},
                 "runs": [{"hardware": "a6000x4", "policies": [*KV_REUSE_ORIGINAL, "kv_aware", "cost_aware:alpha=0.5"]}]},
    "kv-reuse-load": {"generator": "sharegpt_like", "params": {"conversations": 30},
                      "load": {"param": "rate_per_s", "values": [2, 8]},
                      "runs": [{"hardware": "a6000x4", "policies": KV_REUSE_ORIGINAL}]},
    # the field setups (field.ipynb): few groups and sessions, two loads each
    "field-sglang-gsp": {"generator": "sglang_gsp", "params": {"groups": 4, "prompts_per_group": 3},
                         "load": {"param": "rate_per_s", "values": [8, 64]},
                         "runs": [{"hardware": "a100x8", "policies": ["round_robin", "sglang_cache_aware", "kv_aware"]}]},
    "field-sglang-gsp-burst": {"generator": "sglang_gsp", "params": {"groups": 4, "prompts_per_group": 3},
                               "runs": [{"hardware": "a100x8", "policies": ["round_robin", "sglang_cache_aware",
                                                                           "kv_aware"]}]},
    "field-llmd-precise": {"generator": "llmd_shared_prefix", "params": {"groups": 4, "prompts_per_group": 2},
                           "load": {"param": "rate_per_s", "values": [3, 30]},
                           "runs": [{"hardware": "h100x16-tp2", "policies": ["llmd_precise", "llmd_load", "random"]}]},
    "field-blis-prefix": {"generator": "blis_multiturn", "params": {"conversations": 12},
                          "load": {"param": "rate_per_s", "values": [50, 5000]},
                          "runs": [{"hardware": "h100x8-llama-tp2", "policies": ["round_robin", "blis_default"]}]},
    "field-vllm-multiturn": {"generator": "vllm_multiturn", "params": {"conversations": 4},
                             "load": {"param": "concurrency", "values": [2, 4]},
                             "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "kv_aware"]}]},
    "field-mooncake-conversation": {"dataset": "mooncake", "params": {"name": "conversation", "duration_s": 30},
                                    "load": {"param": "speedup", "values": [1, 4]},
                                    "runs": [{"hardware": "h100x8", "policies": ["round_robin", "kv_aware"]}]},
    "field-mooncake-synthetic": {"dataset": "mooncake", "params": {"name": "synthetic", "duration_s": 30},
                                 "load": {"param": "speedup", "values": [1, 4]},
                                 "runs": [{"hardware": "h100x8", "policies": ["round_robin", "kv_aware"]}]},
    "explainer-two-replicas": {"generator": "agent",
                               "params": {"conversations": 4, "concurrency": 1, "system_words": 0,
                                          "first_prompt_tokens": 1500, "last_prompt_tokens": 1616, "min_turns": 2,
                                          "max_turns": 2, "reply_tokens_min": 16, "reply_tokens_max": 16,
                                          "tool_tokens_min": 100, "max_context_tokens": 4096},
                               "runs": [{"hardware": "cpu", "policies": ["sticky", "random"]}]},
}

#: docs/pipeline.md: what each notebook writes under out_dir
OUTPUTS = {
    "kv_reuse": ["kv-reuse/results.csv", "kv-reuse/per_turn_results.csv", "kv-reuse/summary.txt",
                 *[f"figures/kv-reuse/{f}.{e}" for f in ("reuse_vs_turn", "pareto", "cost_aware_sweep",
                                                         "strategy_comparison") for e in ("pdf", "png")],
                 "tables/kv-reuse/results.tex", "tables/kv-reuse/claims.tex", "tables/kv-reuse/miss.tex",
                 *[f"tables/kv-reuse/{t}.tex" for t in ("published_latency", "published_reuse", "published_turns",
                                                        "findings", "findings_load")],
                 "figures/kv-reuse/against_load.pdf", "figures/kv-reuse/against_load.png",
                 "numbers/kv-reuse.tex"],
    "note2": [*[f"figures/note2/{f}.{e}" for f in ("table2", "hit_by_turn", "claims", "large_goodput", "validation")
                for e in ("pdf", "png")],
              *[f"tables/note2/{t}.tex" for t in ("table1", "table2", "least_loaded", "claims", "table3", "stated",
                                                  "large", "cpu", "validation", "validation_cpu", "sensitivity")],
              "numbers/note2.tex"],
    "tn4": [*[f"figures/tn4/{f}.{e}" for f in ("closed_vs_sim", "per_turn", "note2_shape") for e in ("pdf", "png")],
            "tables/tn4/sweep.tex", "numbers/tn4.tex"],
    "field": [*[f"figures/field/{f}.{e}" for f in ("sglang", "llmd", "blis", "vllm", "mooncake_conversation",
                                                   "mooncake_synthetic") for e in ("pdf", "png")],
              *[f"tables/field/{t}.tex" for t in ("setups", "sglang", "sglang_burst", "llmd", "blis", "vllm",
                                                  "mooncake_conversation", "mooncake_synthetic")],
              "numbers/field.tex"],
    "sticky": ["figures/sticky/arithmetic.pdf", "figures/sticky/arithmetic.png", "tables/sticky/arithmetic.tex",
               "tables/sticky/measurement.tex", "tables/sticky/why.tex", "numbers/sticky.tex"],
}
PARAMS = {
    "kv_reuse": {"reported_dir": str(ROOT / "paper/reported")},
    "field": {"experiments_dir": str(ROOT / "config/experiments")},
    "note2": {"reported_dir": str(ROOT / "paper/reported"), "experiments_dir": str(ROOT / "config/experiments")},
    "tn4": {"reported_dir": str(ROOT / "paper/reported")},
    "sticky": {"reported_dir": str(ROOT / "paper/reported"), "experiments_dir": str(ROOT / "config/experiments")},
}


def _simulate(name: str, spec: dict, out: Path, tmp: Path, rounds: int = 2) -> None:
    from kvroute.experiment import load_experiment
    from kvroute.sim.run import simulate_experiment

    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "seed": 3, "rounds": rounds,
                                    "workload": {("dataset" if "dataset" in spec else "generator"):
                                                 spec.get("dataset", spec.get("generator")), "params": spec["params"]},
                                    **{k: spec[k] for k in ("load", "load_signal") if k in spec}, "runs": spec["runs"]}))
    simulate_experiment(load_experiment(path), out)


@pytest.fixture(scope="session")
def sample_results(tmp_path_factory) -> Path:
    """results/ with small simulations of every experiment the notebooks read."""
    from kvroute.analysis.arithmetic import run_sweep

    root = tmp_path_factory.mktemp("results")
    cfg = tmp_path_factory.mktemp("experiments")
    for name, spec in SAMPLES.items():
        if name != "explainer-two-replicas":
            _simulate(name, spec, root / "sim" / name, cfg)
    # the operating point's file as rule operating_point writes it (test data: the sample's
    # fixed rate stands in for a search, which the sample's few conversations could not make)
    from kvroute.sim.operating_point import write

    write({"experiment": "kv-reuse", "param": "rate_per_s", "value": 4.0, "policy": "least_loaded",
           "hardware": "a6000x4", "round": 0, "metric": "ttft_mean_ms", "target": 4847.0, "achieved": 4800.0,
           "rel_error": -0.01, "rtol": 0.01, "bounds": [1.0, 40.0],
           "evaluations": [{"value": 1.0, "ttft_mean_ms": 100.0}, {"value": 4.0, "ttft_mean_ms": 4800.0}]},
          root / "operating_point" / "kv-reuse.json")
    run_sweep(root / "sim" / "tn4-arithmetic", workers=(2, 4), system_words=(0, 600),
              workload={"chats": 8, "turns": 4})
    _validate(root)
    # rule sensitivity: what each GPU coefficient is worth to the single-GPU predictions
    from kvroute.analysis.sensitivity import write as write_sensitivity
    from kvroute.experiment import load_experiment

    write_sensitivity(load_experiment(cfg / "note2-a100.yaml"), root / "validation" / "sensitivity-note2-a100.csv",
                      rounds=1)
    return root


def _validate(root: Path) -> None:
    """results/validation/ as the workflow's `kvroute validate` writes it."""
    from click.testing import CliRunner

    from kvroute.cli import main

    sims = [a for d in sorted((root / "sim").iterdir()) if (d / "summary.csv").is_file() for a in ("--sim", str(d))]
    measured = [a for d in sorted((root / "measure").glob("*/*")) for a in ("--measured", str(d))]
    res = CliRunner().invoke(main, ["validate", *sims, *measured, "--reported", str(ROOT / "paper/reported"),
                                    "--out", str(root / "validation")])
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="session")
def measured_results(tmp_path_factory) -> Path:
    """results/ with a stand-in measurement of the explainer's experiment.

    Test data only: a simulation relabelled ``live`` so the notebook's measured branch
    runs; nothing here is shown as a measurement anywhere else.
    """
    from kvroute.records import write_requests

    root = tmp_path_factory.mktemp("measured")
    cfg = tmp_path_factory.mktemp("experiments-measured")
    sim = root / "sim-tmp"
    _simulate("explainer-two-replicas", SAMPLES["explainer-two-replicas"], sim, cfg, rounds=1)
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(sim / "requests.parquet")
    t = t.set_column(t.schema.get_field_index("source"), "source", pa.array(["live"] * len(t)))
    dest = root / "measure" / "explainer-two-replicas" / "cpu"
    dest.mkdir(parents=True)
    write_requests(t, dest / "requests.parquet")
    shutil.copy(sim / "summary.csv", dest / "summary.csv")
    shutil.rmtree(sim)
    return root


def _run(nb: str, results: Path, out: Path) -> None:
    import papermill as pm

    out.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(str(NOTEBOOKS / f"{nb}.ipynb"), str(out / f"{nb}.executed.ipynb"),
                        parameters={"results_dir": str(results), "out_dir": str(out), **PARAMS[nb]},
                        progress_bar=False, kernel_name="python3", cwd=str(ROOT))


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="session")
def notebook_outputs(sample_results, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out")
    before = _files(sample_results)
    for nb in OUTPUTS:
        _run(nb, sample_results, out)
    assert _files(sample_results) == before, "a notebook wrote under results_dir"
    return out


@pytest.mark.parametrize("nb", list(OUTPUTS))
def test_notebook_writes_its_outputs(nb, notebook_outputs):
    missing = [p for p in OUTPUTS[nb] if not (notebook_outputs / p).is_file()]
    assert not missing, f"{nb}.ipynb did not write {missing}"


def test_notebook_has_tagged_parameters_cell():
    import nbformat

    for nb in OUTPUTS:
        cells = nbformat.read(NOTEBOOKS / f"{nb}.ipynb", as_version=4).cells
        params = [c for c in cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1, nb
        assert 'results_dir = "results"' in params[0].source and 'out_dir = "results"' in params[0].source
        assert all(c.get("outputs", []) == [] for c in cells if c.cell_type == "code"), f"{nb}: committed outputs"


def test_figures_name_their_notebook(notebook_outputs):
    for nb, files in OUTPUTS.items():
        for f in files:
            if f.endswith(".pdf"):
                assert f"notebooks/{nb}.ipynb".encode() in (notebook_outputs / f).read_bytes(), f
            if f.endswith(".png"):
                from PIL import Image

                assert Image.open(notebook_outputs / f).info.get("Source") == f"notebooks/{nb}.ipynb", f


def test_kv_reuse_outputs_content(notebook_outputs):
    res = pd.read_csv(notebook_outputs / "kv-reuse/results.csv")
    assert len(res) == len(SAMPLES["kv-reuse"]["runs"][0]["policies"])
    assert {"strategy", "ttft_mean_ms", "ttft_p99_ms", "hit_rate", "later_turn_reuse", "history_reuse",
            "imbalance"} <= set(res.columns)
    assert res["ttft_mean_ms"].is_monotonic_increasing
    assert "Claims:" in (notebook_outputs / "kv-reuse/summary.txt").read_text()
    nums = (notebook_outputs / "numbers/kv-reuse.tex").read_text()
    assert r"\newcommand{\kvKvPointRate}{\num{4.0}}" in nums and r"\newcommand{\kvKvPointTarget}{\qty{4847}" in nums
    for n in ("One", "Two", "Three", "Four", "Five"):
        assert rf"\newcommand{{\kvKvFinding{n}}}{{" in nums and rf"\kvKvFinding{n}Parts" in nums
    findings = (notebook_outputs / "tables/kv-reuse/findings_load.tex").read_text()
    assert r"\num{2} & \num{8}" in findings  # one column per rate of the sweep
    latency = (notebook_outputs / "tables/kv-reuse/published_latency.tex").read_text()
    assert r"\num{4847}" in latency and r"\num{4602}" in latency  # published beside the rebuild


def test_measured_cells_are_dashes_without_measurements(notebook_outputs):
    # nothing measured on A6000s or A100s: Tables 2 and 3 have no measured column, the note says why
    for table in ("table2", "table3"):
        t = (notebook_outputs / f"tables/note2/{table}.tex").read_text()
        head, *rows = [line for line in t.splitlines() if line.endswith(r"\\") and "&" in line]
        assert "measured" not in head and head.split("&")[-1].strip().startswith("difference"), head
        assert rows and all(len(line.split("&")) == 5 for line in rows)
    assert r"\kvNoteTwoMeasuredAnyfalse" in (notebook_outputs / "numbers/note2.tex").read_text()
    # the least-loaded comparison as the note published it: every row has its published value
    ll = (notebook_outputs / "tables/note2/least_loaded.tex").read_text()
    body = [line for line in ll.splitlines() if line.endswith(r"\\") and "&" in line][1:]
    assert len(body) == 5 and all(line.split("&")[2].strip() != r"\textemdash" for line in body)
    assert r"\num{-6} to \num{-3}" in body[0]
    nums = (notebook_outputs / "numbers/sticky.tex").read_text()
    assert r"\kvStickyMeasuredfalse" in nums and "kvStickyMeasStickyTtft" not in nums
    assert not (notebook_outputs / "figures/sticky/turn2_ttft.pdf").exists()


def test_tn4_says_what_it_simulated_and_gives_differences_in_points(notebook_outputs):
    nums = (notebook_outputs / "numbers/tn4.tex").read_text()
    # hit-rate differences are percentage points: bare numbers the prose calls "points"
    for name in ("kvTnMaxErrSticky", "kvTnMaxCfErrRandom", "kvTnMaxErrRRObserved"):
        line = next(x for x in nums.splitlines() if "{\\" + name + "}" in x)
        assert r"\num{" in line and r"\percent" not in line, line
    assert r"\newcommand{\kvTnHardware}{\texttt{a6000x4}}" in nums
    assert r"\newcommand{\kvTnSimHardware}{\texttt{a6000x2}, \texttt{a6000x4}}" in nums  # the sample's n = 2, 4
    assert "with simulated" in (notebook_outputs / "tables/tn4/sweep.tex").read_text()


def test_sticky_with_a_measurement(measured_results, tmp_path):
    _run("sticky", measured_results, tmp_path)
    nums = (tmp_path / "numbers/sticky.tex").read_text()
    assert r"\kvStickyMeasuredtrue" in nums and r"\kvStickyMeasStickyTtft" in nums
    assert (tmp_path / "figures/sticky/turn2_ttft.pdf").is_file()
    assert "measured" in (tmp_path / "tables/sticky/measurement.tex").read_text()
    # what ran, from the profile and the records; no probe calibration here, so no prediction
    assert r"\newcommand{\kvStickyDtype}{\texttt{float32}}" in nums and r"\kvStickyMeasTtftRatio" in nums
    assert r"\kvStickyProbedfalse" in nums and "kvStickyPredRatio" not in nums
    assert r"\textemdash" in (tmp_path / "tables/sticky/why.tex").read_text()


def test_sticky_predicts_from_a_probe_calibration(measured_results, tmp_path):
    """With results/calibration/probe/explainer-two-replicas/cpu.{yaml,csv} (as `kvroute
    measure --probe` writes them; test data here) the note predicts both second turns
    beside the measurement."""
    results = tmp_path / "results"
    shutil.copytree(measured_results, results)
    probe = results / "calibration" / "probe" / "explainer-two-replicas"
    probe.mkdir(parents=True)
    (probe / "cpu.yaml").write_text(yaml.safe_dump({"cpu-provisional": {
        "mem_efficiency": 1.4, "compute_efficiency": 1.0, "step_overhead_ms": 4.0, "per_seq_overhead_ms": 0.3,
        "activation_reserve_gb": 0.0, "api_overhead_ms": 6.5, "api_jitter_ms": 2.5,
        "provenance": {"measured": {"api_cost_ms": {"value": 4.5}, "admission_ms": {"value": 2.0}}}}}))
    pd.DataFrame([dict(level="probe", kind="prefill", used=True, words=w, prompt_tokens=n, ttft_ms=x + 30.0,
                       engine_queue_s_ms=0.0, engine_prefill_s_ms=30.0)
                  for w, n, x in ((128, 140, 5.0), (1500, 1512, 12.0), (1500, 1512, 14.0))]).to_csv(probe / "cpu.csv",
                                                                                                     index=False)
    _run("sticky", results, tmp_path / "out")
    nums = (tmp_path / "out" / "numbers/sticky.tex").read_text()
    assert r"\kvStickyProbedtrue" in nums
    assert r"\newcommand{\kvStickyApiLong}{\qty{13.0}{\milli\second}}" in nums  # the 1,512-token probes
    assert r"\newcommand{\kvStickyApiShort}{\qty{4.5}{\milli\second}}" in nums
    why = (tmp_path / "out" / "tables/sticky/why.tex").read_text()
    assert r"cold\,/\,warm" in why and r"\textemdash" not in why


def test_note2_reports_a_calibration(sample_results, tmp_path):
    """With results/calibration/note2-cpu/cpu.{yaml,csv} (as `kvroute calibrate` writes them;
    test data here) note 2's numbers carry the fitted coefficients and the errors."""
    results = tmp_path / "results"
    shutil.copytree(sample_results, results)
    cal = results / "calibration" / "note2-cpu"
    cal.mkdir(parents=True)
    (cal / "cpu.yaml").write_text(yaml.safe_dump({"cpu-provisional": {
        "mem_efficiency": 0.5, "compute_efficiency": 0.37, "step_overhead_ms": 13.5, "per_seq_overhead_ms": 0.5,
        "activation_reserve_gb": 0.0, "api_overhead_ms": 42.0, "api_jitter_ms": 5.0}}))
    pd.DataFrame({"policy": ["kv_aware"] * 3, "statistic": ["ttft_first_ms", "ttft_later_ms", "tpot_ms"],
                  "measured": [1.0] * 3, "before": [1.0] * 3, "after": [1.0] * 3,
                  "error_before": [0.5, -0.3, 0.2], "error_after": [0.05, -0.02, 0.01]}).to_csv(cal / "cpu.csv", index=False)
    _run("note2", results, tmp_path / "out")
    nums = (tmp_path / "out" / "numbers/note2.tex").read_text()
    assert r"\kvNoteTwoCpuCalibratedtrue" in nums
    assert r"\newcommand{\kvNoteTwoCpuCalComputeEffFit}{\num{0.37}}" in nums
    assert r"\newcommand{\kvNoteTwoCpuCalApiOverheadFit}{\qty{42.0}{\milli\second}}" in nums
    assert r"\newcommand{\kvNoteTwoCpuCalErrBefore}{\qty{30}{\percent}}" in nums
    assert r"\newcommand{\kvNoteTwoCpuCalErrAfter}{\qty{2}{\percent}}" in nums


def test_note2_claims_and_stated_figures(notebook_outputs):
    """Every claim of the analysis gets a verdict; every figure of note2_stated.csv a row;
    without results/gateway/latency.csv the gateway's latency is said to be unmeasured."""
    claims = (notebook_outputs / "tables/note2/claims.tex").read_text()
    rows = [line for line in claims.splitlines() if line.endswith(r"\\") and "&" in line][1:]
    assert len(rows) == 5
    assert all(re.search(r"& (holds|does not hold|holds for .+ only) \\\\$", line) for line in rows), rows
    stated = pd.read_csv(ROOT / "paper/reported/note2_stated.csv")
    body = [line for line in (notebook_outputs / "tables/note2/stated.tex").read_text().splitlines()
            if line.endswith(r"\\") and "&" in line][1:]
    assert len(body) == len(stated)
    nums = (notebook_outputs / "numbers/note2.tex").read_text()
    assert r"\kvNoteTwoGatewayMeasuredfalse" in nums
    assert r"\newcommand{\kvNoteTwoGwMemPacedPtwo}{\textemdash}" in nums


def test_note2_reports_the_gateway_benchmark(sample_results, tmp_path):
    """With results/gateway/latency.csv (as benchmarks/gateway_latency.py --csv writes it;
    test data here) note 2 cites its added latencies."""
    results = tmp_path / "results"
    shutil.copytree(sample_results, results)
    (results / "gateway").mkdir()
    rows = [(load, target, added, cpu) for load in ("sequential", "paced")
            for target, added, cpu in (("direct", "", ""), ("kvroute", 0.25, 0.3), ("kvroute-redis", 0.5, 0.6))]
    pd.DataFrame([{"load": load, "target": t, "requests": 40, "added_p50_ms": a, "added_p99_ms": a,
                   "router_cpu_ms_per_request": c, "rounds": 3, "turns": 4, "chats": 64 if load == "paced" else 10,
                   "pace_ttft_ms": 50.0 if load == "paced" else 0.0, "pace_itl_ms": 20.0 if load == "paced" else 0.0}
                  for load, t, a, c in rows]).to_csv(results / "gateway" / "latency.csv", index=False)
    _run("note2", results, tmp_path / "out")
    nums = (tmp_path / "out" / "numbers/note2.tex").read_text()
    assert r"\kvNoteTwoGatewayMeasuredtrue" in nums and r"\kvNoteTwoGatewayRedistrue" in nums
    assert r"\newcommand{\kvNoteTwoGwRedisPacedPtwo}{\qty{0.50}{\milli\second}}" in nums
    assert r"\newcommand{\kvNoteTwoGwMemSeqPtwo}{\qty{0.25}{\milli\second}}" in nums
    assert r"\newcommand{\kvNoteTwoGwChats}{\num{64}}" in nums
    assert r"\num{0.50} / \num{0.50}" in (tmp_path / "out" / "tables/note2/stated.tex").read_text()


@pytest.mark.skipif(shutil.which("latexmk") is None, reason="latexmk is not installed: cannot compile a note")
@pytest.mark.parametrize("note", ["tn4", "sticky", "field", "note2"])
def test_note_compiles(note, notebook_outputs, tmp_path):
    import json

    from kvroute.analysis.latex import compile_note
    from kvroute.analysis.manifest_tex import write_manifest_tex

    (tmp_path / "manifest.json").write_text(json.dumps({"commit": "test", "packages": {"kvroute": "0"}}))
    write_manifest_tex(tmp_path / "manifest.json", notebook_outputs / "manifest.tex")
    pdf = compile_note(note, ROOT / "paper", notebook_outputs, tmp_path / f"{note}.pdf", log=tmp_path / "latex.log")
    assert pdf.read_bytes().startswith(b"%PDF")
    last_run = (tmp_path / "latex.log").read_text().rsplit("Run number", 1)[-1]
    assert "undefined references" not in last_run and "Citation" not in last_run


# ------------------------------------------------ every published number beside its rebuild

#: which notebook shows each published file's figures
REPORTED_BY = {"kv_reuse": "kv_reuse", "kv_reuse_findings": "kv_reuse", "note2": "note2", "note2_setup": "note2",
               "note2_stated": "note2",
               "sticky": "sticky"}
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")


def _shown_numbers(tex: str) -> list[tuple[float, int]]:
    """(value, decimals shown) of every number in generated LaTeX (siunitx or plain)."""
    tex = re.sub(r"\\(?:\\|[a-zA-Z]+)", " ", tex).replace("{", " ").replace("}", " ")
    return [(float(m), len(m.split(".")[1]) if "." in m else 0) for m in _NUMBER.findall(tex)]


def _shows(value: float, shown: list[tuple[float, int]]) -> bool:
    """``value`` appears, as itself or in percent, to the precision it is shown with."""
    return any(abs(n - v) <= 0.5 * 10 ** -d + 1e-9 for n, d in shown for v in (value, 100 * value))


def test_every_published_figure_is_in_its_notes_generated_tables(notebook_outputs):
    """Each row of paper/reported/*.csv is printed by its note's notebook (a table or a
    macro), so a reader finds every number of the originals beside its rebuild."""
    files = sorted((ROOT / "paper/reported").glob("*.csv"))
    assert {f.stem for f in files} == set(REPORTED_BY), "a published file no notebook is said to show"
    missing = []
    for f in files:
        nb = REPORTED_BY[f.stem]
        name = {"kv_reuse": "kv-reuse"}.get(nb, nb)
        tex = "\n".join(p.read_text() for p in [*(notebook_outputs / "tables" / name).glob("*.tex"),
                                                 notebook_outputs / "numbers" / f"{name}.tex"])
        shown = _shown_numbers(tex)
        rep = pd.read_csv(f)
        for r in rep.itertuples(index=False):
            value = getattr(r, "value", None)
            if value is not None and isinstance(value, (int, float)) and value == value:
                if not _shows(float(value), shown):
                    missing.append(f"{f.name}:{r[0]} = {value}")
            elif hasattr(r, "published"):  # a setup row: text
                from kvroute.analysis.tables import escape

                if escape(str(r.published)) not in tex:
                    missing.append(f"{f.name}:{r[0]} = {r.published!r}")
    assert not missing, "published figures no generated table or macro shows:\n" + "\n".join(missing)
