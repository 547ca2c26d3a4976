"""Reading the pipeline's result folders (``results/sim/<exp>``, ``results/measure/<exp>``).

Simulations are merged per experiment (``sim/<exp>/{requests.parquet,summary.csv}``);
measurements may sit one level deeper per hardware profile
(``measure/<exp>/<hardware>/...``). Both are read the same way: every
``summary.csv`` and ``requests.parquet`` under the folder, concatenated.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def _files(folder: Path, name: str) -> list[Path]:
    if not folder.is_dir():
        return []
    direct = folder / name
    return [direct] if direct.is_file() else sorted(folder.rglob(name))


def read_summary(results_dir: Path, kind: str, experiment: str) -> pd.DataFrame | None:
    """All summary rows of ``<results_dir>/<kind>/<experiment>``; None when absent."""
    files = _files(Path(results_dir) / kind / experiment, "summary.csv")
    if not files:
        return None
    return pd.concat([pd.read_csv(f) for f in files], ignore_index=True)


def read_requests(results_dir: Path, kind: str, experiment: str) -> pd.DataFrame | None:
    """All request records of ``<results_dir>/<kind>/<experiment>``; None when absent."""
    files = _files(Path(results_dir) / kind / experiment, "requests.parquet")
    if not files:
        return None
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def present(results_dir: Path, kind: str, experiment: str) -> bool:
    return bool(_files(Path(results_dir) / kind / experiment, "summary.csv"))
