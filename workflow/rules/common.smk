# Setup shared by every rule file. First the config is validated (before anything else),
# then come the small functions that rule files ask for inputs, parameters and targets.
# Rule files never walk the config or the experiment files themselves; they call
# get_* / is_* here.
#
# Layout of results/ (see docs/pipeline.md, the contract between stages):
#   data/mooncake/NAME_trace.jsonl                      kvroute fetch (a dataset workload's file)
#   workload/EXP/[loadV/]roundR.parquet                 kvroute workload
#     (loadV/: only for an experiment with a load axis, one file per value; the
#     wildcard `loaddir` is "loadV/" there and empty otherwise)
#   sim/EXP/HW/POLICY_SLUG/{requests.parquet,summary.csv,run.json}   kvroute simulate
#     (one job per hardware and policy: every round and load of the experiment)
#   sim/EXP/{requests.parquet,summary.csv}              kvroute merge
#   sim/tn4-arithmetic/{requests.parquet,summary.csv,predictions.csv}       kvroute arithmetic
#   measure/EXP/HW/{requests.parquet,summary.csv}       kvroute measure (measure.enabled)
#   analysis/NB.ipynb, figures/NAME/, tables/NAME/, numbers/NAME.tex        papermill
#   paper/NOTE.pdf (built in build/NOTE/)               latexmk
#   manifest.json, manifest.tex                         kvroute manifest
#   logs/, benchmarks/                                  one per job

import functools
import glob
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

try:
    import kvroute.pipeline
except ImportError:  # kvroute is not installed beside Snakemake: use the source tree
    sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from kvroute.pipeline import ARITHMETIC_NAME, config_errors, load_slug, policy_slug

# Rules call `kvroute`, `papermill` and `latexmk` by name: run Snakemake with the
# environment's bin/ on PATH (`make paper` does; or `source .venv/bin/activate`), or
# with `--sdm conda`, which activates envs/*.yaml per rule.

CONFIG_SCHEMA = "../schemas/config.schema.yaml"
EXPERIMENT_DIR = "config/experiments"
RESULTS = "results"


def _fail(message):
    raise WorkflowError(f"invalid config: {message}")


# ------------------------------------------------------------------ validation (first)

try:
    validate(config, CONFIG_SCHEMA)  # also fills in the schema's defaults
except WorkflowError:
    from kvroute.yamlfile import read_yaml

    _problems = config_errors(config, read_yaml(Path(workflow.current_basedir) / CONFIG_SCHEMA))
    _fail("; ".join(_problems) or "does not match workflow/schemas/config.schema.yaml")


def experiment_file(name):
    return f"{EXPERIMENT_DIR}/{name}.yaml"


_EXPERIMENTS = {}


def _experiment(name, key):
    """The experiment ``name``, loaded and validated by kvroute; ``key`` names where the config uses it."""
    from kvroute.experiment import ExperimentError, load_experiment

    if name not in _EXPERIMENTS:
        try:
            _EXPERIMENTS[name] = load_experiment(experiment_file(name))
        except ExperimentError as exc:
            _fail(f"key {key}: {exc}")
    return _EXPERIMENTS[name]


def _check_config():
    """Cross-references the schema cannot express; each error names its key."""
    experiments = config["experiments"]
    if ARITHMETIC_NAME in experiments:
        _fail(f"key experiments: {ARITHMETIC_NAME!r} is reserved for `kvroute arithmetic`")
    for i, name in enumerate(experiments):
        _experiment(name, f"experiments.{i}")
    for i, name in enumerate(config["field_experiments"]):
        if name in experiments:
            _fail(f"key field_experiments.{i}: {name!r} is in `experiments` too; `paper` builds it already")
        _experiment(name, f"field_experiments.{i}")
    notebooks = [a["notebook"] for a in config["analyses"]]
    names = [a["name"] for a in config["analyses"]]
    for what, values in (("notebook", notebooks), ("name", names)):
        dup = sorted({v for v in values if values.count(v) > 1})
        if dup:
            _fail(f"key analyses: {what} {dup[0]!r} appears twice")
    for i, a in enumerate(config["analyses"]):
        for j, sim in enumerate(a["sim"]):
            if sim not in experiments and sim != ARITHMETIC_NAME:
                _fail(f"key analyses.{i}.sim.{j}: {sim!r} is neither in `experiments` nor {ARITHMETIC_NAME!r}")
    notes = [n["name"] for n in config["notes"]]
    if len(set(notes)) != len(notes):
        _fail("key notes: a note appears twice")
    for i, note in enumerate(config["notes"]):
        for j, nb in enumerate(note["analyses"]):
            if nb not in notebooks:
                _fail(f"key notes.{i}.analyses.{j}: unknown notebook {nb!r}; analyses are {', '.join(notebooks)}")
    if is_measure_enabled():
        for i, run in enumerate(config["measure"]["runs"]):
            _experiment(run["experiment"], f"measure.runs.{i}.experiment")
            _hardware(run["hardware"], f"measure.runs.{i}.hardware")


def _hardware(name, key):
    from kvroute.hardware import load_hardware

    try:
        return load_hardware(name)
    except ValueError as exc:
        _fail(f"key {key}: {exc}")


def is_measure_enabled():
    return bool(config["measure"]["enabled"])


def _alternation(names):
    """A wildcard regex matching exactly ``names`` (nothing when empty)."""
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) or "(?!)"


_check_config()

wildcard_constraints:
    exp=_alternation([*config["experiments"], *config["field_experiments"]]),
    hardware=r"[A-Za-z0-9_.-]+",
    policy=r"[A-Za-z0-9_.+-]+",
    round=r"\d+",
    loaddir=r"(load[0-9][0-9.e+-]*/)?",  # "loadV/" on a load axis, else empty
    note=_alternation(n["name"] for n in config["notes"]),


# ------------------------------------------------------------------ paths from a job's files
# Shell commands take folders from the job's own input and output paths, never from a
# hard-coded results/, so they still work where a storage plugin rewrites those paths
# (executors without a shared file system, such as kubernetes).


def output_dir(key, up=1):
    """A params function: the folder ``up`` levels above output ``key``."""

    def fn(wildcards, output):
        return str(Path(getattr(output, key)).parents[up - 1])

    return fn


def scratch_for(key):
    """A params function: a hidden scratch folder beside output ``key`` (same file system, so a move is atomic)."""

    def fn(wildcards, output):
        path = Path(getattr(output, key))
        return str(path.parent / f".{path.stem}.tmp")

    return fn


def input_dirs(key):
    """A params function: the folder of each file of input ``key``."""

    def fn(wildcards, input):
        return [str(Path(p).parent) for p in getattr(input, key)]

    return fn


def input_dir(key, up=1):
    """A params function: the folder ``up`` levels above input ``key``."""

    def fn(wildcards, input):
        return str(Path(getattr(input, key)).parents[up - 1])

    return fn


# ------------------------------------------------------------------ source files
# Code a stage's results depend on: editing it reruns that stage (and what follows).


def _sources(*patterns):
    return sorted({p for pat in patterns for p in glob.glob(pat)})


# sim/run.py: load_trace draws a round's workload and stamp_trace records which it is
WORKLOAD_SOURCES = _sources("src/kvroute/workload/*.py", "src/kvroute/experiment.py", "src/kvroute/sim/run.py")
# A simulation job depends on the simulator and on its own policy's modules only
# (get_policy_sources), so editing one policy reruns only that policy's simulations.
SIM_CORE_SOURCES = _sources(
    "src/kvroute/sim/*.py", "src/kvroute/kvcache/*.py", "src/kvroute/costmodel.py",
    "src/kvroute/hardware.py", "src/kvroute/workload/*.py", "src/kvroute/records.py",
    "src/kvroute/loadsignal.py",
)
SIM_SOURCES = SIM_CORE_SOURCES + _sources("src/kvroute/policies/*.py")  # every policy: jobs that run them all
ARITHMETIC_SOURCES = SIM_SOURCES + _sources("src/kvroute/analysis/arithmetic*.py")
# What a measurement's results depend on: the live stack and what it imports (policies,
# hashing, workloads, records), not the simulator's engine model, so editing the
# simulator does not rerun real-engine measurements (the emulator is not measured here).
# A measurement depends on the live stack and on the modules of the policies it runs
# (get_measure_policy_sources), as a simulation does; the probe routes nothing, so no policy.
LIVE_SOURCES = _sources(
    "src/kvroute/live/*.py", "src/kvroute/kvcache/*.py", "src/kvroute/hardware.py",
    "src/kvroute/workload/*.py", "src/kvroute/records.py", "src/kvroute/experiment.py",
    "src/kvroute/loadsignal.py", "src/kvroute/costmodel.py",
)
CALIBRATE_SOURCES = SIM_SOURCES + _sources("src/kvroute/calibrate.py", "src/kvroute/experiment.py")
PROBE_FIT_SOURCES = _sources("src/kvroute/calibrate*.py", "src/kvroute/probefit.py", "src/kvroute/gpufit.py",
                             "src/kvroute/costmodel.py", "src/kvroute/hardware.py", "src/kvroute/live/probe.py")
PROBE_SOURCES = LIVE_SOURCES + PROBE_FIT_SOURCES
# the manifest job also renders the appendix (manifest.tex), so its renderer is its code too
MANIFEST_SOURCES = _sources(
    "src/kvroute/pipeline.py", "src/kvroute/analysis/manifest_tex.py", "src/kvroute/analysis/tables.py",
)
ANALYSIS_SOURCES = _sources("src/kvroute/analysis/*.py")  # what the notebooks import


# ------------------------------------------------------------------ workload and simulate


def get_experiments():
    return list(config["experiments"])


def get_experiment_files():
    """Every experiment file (the manifest hashes them all)."""
    return sorted(glob.glob(f"{EXPERIMENT_DIR}/*.yaml"))


def get_all_hardware_files():
    return sorted(glob.glob("hardware/*.yaml"))


def get_workload_inputs(wildcards):
    """The experiment file, and the trace it replays or the dataset file it converts."""
    exp = _experiment(wildcards.exp, "experiments")
    files = {"experiment": experiment_file(wildcards.exp), "sources": WORKLOAD_SOURCES}
    if "trace" in exp.workload:
        files["replayed"] = exp.workload["trace"]
    if "dataset" in exp.workload:  # only mooncake so far (rule fetch_mooncake)
        name = exp.workload.get("params", {}).get("name", "conversation")
        files["dataset"] = f"{RESULTS}/data/{exp.workload['dataset']}/{name}_trace.jsonl"
    if exp.operating_point is not None:  # rule operating_point chooses a parameter first
        files["point"] = operating_point_file(wildcards.exp)
    return files


def get_workload_dataset_arg(wildcards, input):
    args = [f"--dataset {input.dataset}"] if hasattr(input, "dataset") else []
    if hasattr(input, "point"):
        args.append(f"--operating-point {input.point}")
    return " ".join(args)


def operating_point_file(name):
    return f"{RESULTS}/operating_point/{name}.json"


def get_operating_point_inputs(wildcards):
    """What an operating-point search reads: the experiment, the published value it
    matches, the simulator, the matched policy's modules and its hardware (with the probe
    calibration where the profile is measured CPU hardware)."""
    from kvroute.pipeline import policy_sources

    exp = _experiment(wildcards.exp, "experiments")
    op = exp.operating_point
    if op is None:
        _fail(f"experiment {wildcards.exp} has no operating_point key")
    files = {
        "experiment": experiment_file(wildcards.exp), "reported": str(op.reported),
        "hardware": [f"hardware/{op.hardware}.yaml", "hardware/models.yaml", "hardware/coefficients.yaml"],
        "sources": SIM_CORE_SOURCES, "policy_sources": policy_sources(op.policy),
    }
    coefficients = sim_probe(wildcards.exp, op.hardware)
    if coefficients:
        files["coefficients"] = coefficients
    return files


def get_operating_point_coefficients_arg(wildcards, input):
    return f"--coefficients {input.coefficients[0]}" if hasattr(input, "coefficients") else ""


def get_hardware_files(wildcards):
    return [f"hardware/{wildcards.hardware}.yaml", "hardware/models.yaml", "hardware/coefficients.yaml"]


def is_probe_enabled():
    return is_measure_enabled() and config["measure"].get("probe", True)


def get_probe_hardware():
    """Measured CPU hardware calibrated by probes (measure.probe), none while measuring is off."""
    return get_measure_hardware(cpu=True) if is_probe_enabled() else []


def get_probe_runs():
    """Measured (experiment, CPU hardware) pairs whose measurement job probes its engines
    around the measurement (measure.probe: `kvroute measure --probe`)."""
    return [(exp, hw) for exp, hw in get_measure_runs() if hw in get_probe_hardware()]


def probe_result(exp, hardware):
    """The probe calibration of ``exp``'s measurement on ``hardware`` (yaml entry, csv)."""
    base = f"{RESULTS}/calibration/probe/{exp}/{hardware}"
    return [f"{base}.yaml", f"{base}.csv"]


def sim_probe(exp, hardware):
    """The probe calibration a simulation of ``exp`` on ``hardware`` uses: that measurement's
    own, else (an experiment simulated on probed hardware but not measured) the first
    measurement's on that hardware; empty: hardware/coefficients.yaml."""
    runs = get_probe_runs()
    if (exp, hardware) in runs:
        return probe_result(exp, hardware)[:1]
    first = [e for e, hw in runs if hw == hardware][:1]
    return probe_result(first[0], hardware)[:1] if first else []


def get_sim_coefficients(wildcards):
    """The probe calibration a simulation uses (:func:`sim_probe`; empty: hardware/coefficients.yaml)."""
    return sim_probe(wildcards.exp, wildcards.hardware)


def get_sim_coefficients_arg(wildcards, input):
    return f"--coefficients {input.coefficients[0]}" if input.coefficients else ""


def loaddir_of(load):
    """The `loaddir` wildcard of a load: "loadV/", or "" without a load axis."""
    return f"{load_slug(load)}/" if load is not None else ""


def get_load_arg(wildcards):
    """``--load V`` for a job of a load axis (from its `loaddir`), else nothing."""
    return f"--load {wildcards.loaddir[len('load'):-1]}" if wildcards.loaddir else ""


@functools.cache
def _sim_jobs(name):
    """{(hardware, policy slug): (policy spec, ((loaddir, round), ...))} for every simulation
    job of experiment ``name``: one job per hardware and policy runs every round and load
    (one process: the start-up of a job costs more than most of this project's runs)."""
    jobs = {}
    # production routers (sglang_router:..., vllm_router:...) are measured, never simulated
    runs = _experiment(name, "experiments").expand()
    for run in runs:
        try:
            slug = policy_slug(run.policy)
        except ValueError as exc:
            _fail(f"experiment {experiment_file(name)}: {exc}")
        key = (run.hardware, slug)
        spec, traces = jobs.get(key, (run.policy, ()))
        if spec != run.policy:
            _fail(f"experiment {experiment_file(name)}: policies {spec!r} and {run.policy!r} share the folder name {slug!r}")
        jobs[key] = (spec, (*traces, (loaddir_of(run.load), run.round)))
    return jobs


def sim_job_dir(exp, hardware, slug):
    return f"{RESULTS}/sim/{exp}/{hardware}/{slug}"


def get_sim_job_count(name=None):
    """Number of simulate jobs: of experiment ``name``, or of every configured experiment."""
    names = [name] if name else get_experiments()
    return sum(len(_sim_jobs(n)) for n in names)


def _sim_job(wildcards):
    try:
        return _sim_jobs(wildcards.exp)[(wildcards.hardware, wildcards.policy)]
    except KeyError:
        raise WorkflowError(f"experiment {wildcards.exp} has no job for hardware {wildcards.hardware}, policy {wildcards.policy}")


def get_policy_spec(wildcards):
    return _sim_job(wildcards)[0]


def get_sim_traces(wildcards):
    """The workloads simulate job ``wildcards`` replays: its runs' every (load, round)."""
    pattern = rules.workload.output.trace  # the workload rule's own path, not a copy of it
    return [pattern.format(exp=wildcards.exp, loaddir=loaddir, round=round_) for loaddir, round_ in _sim_job(wildcards)[1]]


def get_sim_traces_arg(wildcards, input):
    return " ".join(f"--trace {shlex.quote(t)}" for t in input.traces)


def get_policy_sources(wildcards):
    """The policy modules simulate job ``wildcards`` runs (kvroute.pipeline.policy_sources)."""
    from kvroute.pipeline import policy_sources

    return policy_sources(get_policy_spec(wildcards))


def get_sim_job_dirs(wildcards):
    return [sim_job_dir(wildcards.exp, *key) for key in sorted(_sim_jobs(wildcards.exp))]


def get_merge_inputs(wildcards):
    dirs = get_sim_job_dirs(wildcards)
    return {"requests": [f"{d}/requests.parquet" for d in dirs], "summaries": [f"{d}/summary.csv" for d in dirs]}


def sim_result(name):
    """The merged result files of ``name`` (an experiment, or tn4-arithmetic)."""
    base = f"{RESULTS}/sim/{name}"
    files = [f"{base}/requests.parquet", f"{base}/summary.csv"]
    if name == ARITHMETIC_NAME:
        files.append(f"{base}/predictions.csv")
    return files


def is_arithmetic_used():
    return any(ARITHMETIC_NAME in a["sim"] for a in config["analyses"])


# ------------------------------------------------------------------ measure


def get_measure_runs():
    """(experiment, hardware) pairs to measure; none while measure.enabled is false."""
    if not is_measure_enabled():
        return []
    return [(r["experiment"], r["hardware"]) for r in config["measure"]["runs"]]


def measure_result(exp, hardware):
    base = f"{RESULTS}/measure/{exp}/{hardware}"
    return [f"{base}/requests.parquet", f"{base}/summary.csv"]


def get_calibration_runs():
    """Measured (experiment, hardware) pairs whose run asks for `calibrate: true`."""
    if not is_measure_enabled():
        return []
    return [(r["experiment"], r["hardware"]) for r in config["measure"]["runs"] if r.get("calibrate")]


def calibration_result(exp, hardware):
    base = f"{RESULTS}/calibration/{exp}/{hardware}"
    return [f"{base}.yaml", f"{base}.csv"]


def is_cpu_hardware(name):
    return _hardware(name, "measure.runs").engine.kind.endswith("cpu")


def get_measure_hardware(cpu):
    """Measured hardware names that run on CPUs (``cpu=True``) or on GPUs."""
    return sorted({hw for _, hw in get_measure_runs() if is_cpu_hardware(hw) == cpu})


def get_measure_gpus(wildcards):
    """GPUs a measurement asks the executor for: the profile's GPU count."""
    return _hardware(wildcards.mhw, "measure.runs").gpus


def get_measure_experiment(wildcards):
    return experiment_file(wildcards.mexp)


def get_measure_policy_sources(wildcards):
    """The policy modules a measurement runs (kvroute.pipeline.policy_sources of each of its
    kvroute policies; a production router runs as itself, through live/peers.py)."""
    from kvroute.live.peers import is_peer_spec
    from kvroute.pipeline import policy_sources

    if not os.path.exists(experiment_file(wildcards.mexp)):
        return []  # not an experiment: the missing file makes the rule not apply (calibrate's mexp=probe)
    exp = _experiment(wildcards.mexp, "measure.runs")
    specs = {p for _, pols in exp.runs for p in pols if not is_peer_spec(p)}
    return sorted({f for p in specs for f in policy_sources(p)})


def get_measure_rounds_arg(wildcards):
    """``--rounds N`` where the config's measure run sets ``rounds``, else nothing."""
    for r in config["measure"]["runs"]:
        if (r["experiment"], r["hardware"]) == (wildcards.mexp, wildcards.mhw) and r.get("rounds"):
            return f"--rounds {int(r['rounds'])}"
    return ""


def is_engine_session_shared():
    """measure.share_engines (default true): one job measures every CPU experiment of a
    hardware on one set of engine processes (`kvroute measure EXP... --out D...`)."""
    return config["measure"].get("share_engines", True)


def get_cpu_session():
    """The experiments one CPU engine session measures, in measure.runs' order: the same
    on every CPU hardware, or a WorkflowError that says to measure apart."""
    per = {hw: [e for e, h in get_measure_runs() if h == hw] for hw in get_measure_hardware(cpu=True)}
    if len({tuple(v) for v in per.values()}) > 1:
        raise WorkflowError("measure.share_engines: every CPU hardware must measure the same experiments to share "
                            f"one job's engine session ({per}); set measure.share_engines: false")
    return next(iter(per.values()), [])


def get_cpu_session_policy_sources(wildcards):
    """The policy modules an engine session runs: every experiment's (get_measure_policy_sources)."""
    from types import SimpleNamespace

    return sorted({f for e in get_cpu_session() for f in get_measure_policy_sources(SimpleNamespace(mexp=e))})


def get_cpu_session_args(wildcards, output):
    """`kvroute measure`'s arguments for the engine session: every experiment, then an --out
    (and a --probe, with measure.probe) per experiment, and each one's rounds where a run sets any."""
    session = get_cpu_session()
    files = [experiment_file(e) for e in session]
    outs = [str(Path(output[f"requests_{i}"]).parent) for i in range(len(session))]
    args = [*files, *(a for o in outs for a in ("--out", o))]
    if is_probe_enabled():
        args += [a for i in range(len(session)) for a in ("--probe", output[f"probed_{i}"])]
    set_ = {r["experiment"]: r.get("rounds") for r in config["measure"]["runs"] if r["hardware"] == wildcards.mhw}
    if any(set_.values()):
        args += [a for e in session for a in ("--rounds", str(int(set_[e] or _experiment(e, "measure.runs").rounds)))]
    return " ".join(shlex.quote(a) for a in args)


def get_measure_hardware_files(wildcards):
    return [f"hardware/{wildcards.mhw}.yaml", "hardware/models.yaml", "hardware/coefficients.yaml"]


# ------------------------------------------------------------------ validate

VALIDATION_SOURCES = _sources("src/kvroute/analysis/validation.py", "src/kvroute/policies/__init__.py")


def get_validation_inputs():
    """The merged simulations and measurements (requests, summary pairs), the published
    figures and the coefficients whose provenance says what is in sample."""
    return {
        "sim": [f for name in get_experiments() for f in sim_result(name)],
        "measure": [f for exp, hw in get_measure_runs() for f in measure_result(exp, hw)],
        "reported": sorted(glob.glob("paper/reported/*.csv")),
        "experiments": [experiment_file(name) for name in get_experiments()],  # operating points: in sample
        "coefficients": "hardware/coefficients.yaml",
        "probes": [probe_result(exp, hw)[0] for exp, hw in get_probe_runs()],
        "code": VALIDATION_SOURCES,
    }


def get_validation_targets():
    return [f"{RESULTS}/validation/summary.csv", f"{RESULTS}/validation/published.csv"]


# ------------------------------------------------------------------ analyse


def get_analyses():
    return list(config["analyses"])


def _analysis(notebook):
    for a in config["analyses"]:
        if a["notebook"] == notebook:
            return a
    raise WorkflowError(f"no analysis for notebook {notebook!r}")


def get_analysis_inputs(notebook):
    """Inputs of a notebook's rule: the notebook, the results it reads, its other files."""
    a = _analysis(notebook)
    extra = []
    for pattern in a["inputs"]:
        if glob.has_magic(pattern):
            extra += sorted(glob.glob(pattern))
        else:
            extra.append(pattern)
    return {
        "notebook": f"notebooks/{notebook}.ipynb",
        "code": ANALYSIS_SOURCES,
        "sim": [f for name in a["sim"] for f in sim_result(name)],
        "measure": [f for exp, hw in get_measure_runs() if exp in a["measure"] for f in measure_result(exp, hw)],
        "calibration": [f for exp, hw in get_calibration_runs() if exp in a["measure"] for f in calibration_result(exp, hw)]
                       + [f for exp, hw in get_probe_runs() if exp in a["measure"] for f in probe_result(exp, hw)],
        "extra": extra,
    }


def get_analysis_outputs(notebook):
    """Relative to results/: what the notebook must write under out_dir."""
    a = _analysis(notebook)
    return [f"figures/{a['name']}", f"tables/{a['name']}", f"numbers/{a['name']}.tex", *a["outputs"]]


def analysis_output_files(notebook):
    """Named outputs of a notebook's rule (figures and tables are folders)."""
    a = _analysis(notebook)
    return {
        "executed": f"{RESULTS}/analysis/{notebook}.ipynb",
        "figures": directory(f"{RESULTS}/figures/{a['name']}"),
        "tables": directory(f"{RESULTS}/tables/{a['name']}"),
        "numbers": f"{RESULTS}/numbers/{a['name']}.tex",
        "extra": [f"{RESULTS}/{p}" for p in a["outputs"]],
    }


def get_analysis_products(notebook, kinds=("figures", "tables", "numbers", "extra")):
    """An analysis's products as plain paths, for rules that use them."""
    a = _analysis(notebook)
    out = {
        "figures": [f"{RESULTS}/figures/{a['name']}"],
        "tables": [f"{RESULTS}/tables/{a['name']}"],
        "numbers": [f"{RESULTS}/numbers/{a['name']}.tex"],
        "extra": [f"{RESULTS}/{p}" for p in a["outputs"]],
    }
    return [p for k in kinds for p in out[k]]


# ------------------------------------------------------------------ notes


def _note(name):
    for n in config["notes"]:
        if n["name"] == name:
            return n
    raise WorkflowError(f"no note {name!r} in config")


#: what LaTeX leaves beside a source when someone runs it in paper/ by hand: never an input
_LATEX_AUX = re.compile(r"(\.(aux|log|fls|fdb_latexmk|out|toc|bbl|blg|lof|lot|nav|snm|synctex\.gz)|/main\.pdf)$")


def get_note_sources(wildcards):
    """The note's own files and the shared paper/common/ (found when the DAG is built)."""
    files = [f"paper/{wildcards.note}/main.tex"]
    for folder in (f"paper/{wildcards.note}", "paper/common"):
        files += [p for p in glob.glob(f"{folder}/**", recursive=True) if Path(p).is_file() and not _LATEX_AUX.search(p)]
    return sorted(set(files))


def get_note_products(wildcards):
    """Figures, tables and numbers of the analyses the note uses."""
    return [p for nb in _note(wildcards.note)["analyses"] for p in get_analysis_products(nb)]


# ------------------------------------------------------------------ targets


def get_field_experiments():
    return list(config["field_experiments"])


def get_field_targets():
    """Target `field`: the field_experiments' merged simulations and their summary table."""
    names = get_field_experiments()
    return [f for name in names for f in sim_result(name)] + (
        [f"{RESULTS}/field/whole_traces.csv", f"{RESULTS}/field/whole_traces.md"] if names else [])


def get_sim_targets():
    names = get_experiments() + ([ARITHMETIC_NAME] if is_arithmetic_used() else [])
    return [f for name in names for f in sim_result(name)]


def get_measure_targets():
    measured = [f for exp, hw in get_measure_runs() for f in measure_result(exp, hw)]
    probes = [f for exp, hw in get_probe_runs() for f in probe_result(exp, hw)]
    return measured + probes + [f for exp, hw in get_calibration_runs() for f in calibration_result(exp, hw)]


def get_figure_targets():
    return [p for a in get_analyses() for p in get_analysis_products(a["notebook"], ("figures",))]


def get_table_targets():
    tables = [p for a in get_analyses() for p in get_analysis_products(a["notebook"], ("tables", "numbers", "extra"))]
    return tables + [f"{RESULTS}/manifest.tex"]


def get_paper_targets():
    return ([f"{RESULTS}/paper/{n['name']}.{ext}" for n in config["notes"] for ext in ("pdf", "layout.txt")]
            + [f"{RESULTS}/manifest.json"]
            + get_validation_targets())
