"""The one record schema shared by simulation and measurement, and its summary.

``requests.parquet`` holds one row per request (turn); ``summary.csv`` one row per
(experiment, hardware, policy, round), and per load where the experiment has a load
axis (``load_param`` names the workload parameter swept, ``load`` its value; both are
empty without one). ``scaling`` says how a recorded trace was scaled down to the engines
(token and time scale, window; empty for a generated workload), in requests and summary. Both worlds write them through this module, so notebooks compare
them without adapters. See DESIGN.md for the contract.

Imbalance is the coefficient of variation (population std / mean) of per-worker
work, where a worker's work is the tokens it computed: uncached prompt tokens plus
output tokens, over every worker of the cluster (idle ones count as zero). 0 means
perfectly even; one worker doing everything among n gives sqrt(n - 1).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

#: columns every producer writes, in order, with their Arrow types
REQUEST_COLUMNS: dict[str, pa.DataType] = {
    "source": pa.string(),  # sim | live | emulated
    "experiment": pa.string(),
    "hardware": pa.string(),
    "policy": pa.string(),
    "round": pa.int32(),
    "conversation": pa.string(),
    "turn": pa.int32(),
    "worker": pa.string(),
    "arrival_s": pa.float64(),
    "first_token_s": pa.float64(),
    "finish_s": pa.float64(),
    "ttft_ms": pa.float64(),
    "e2e_ms": pa.float64(),
    "prompt_tokens": pa.int64(),
    "cached_tokens": pa.int64(),
    "output_tokens": pa.int64(),
    "status": pa.string(),  # ok | error kind
    # extra columns (welcome by the contract)
    "view": pa.string(),  # exact | approx: what the router's prefix view read
    "load_signal": pa.string(),  # router | scraped:Nms | events:Nms (kvroute.loadsignal); peer
    "seed": pa.int64(),
    "queue_ms": pa.float64(),  # engine receipt to first admission
    "preemptions": pa.int32(),
    "load_param": pa.string(),  # the load axis's workload parameter (rate_per_s, chats...); null without one
    "load": pa.float64(),  # its value for this run; null without a load axis
    # how a recorded trace was scaled to the engines (mooncake.scaling_label: "tokens/16,time x6,window 0-600s");
    # null for a generated workload
    "scaling": pa.string(),
}

#: what the ``workers`` of :func:`summarize` are keyed by (a run's workers do not depend on its load)
SUMMARY_KEYS = ["experiment", "hardware", "policy", "round"]
#: a run's identity and the order of summary rows and merged records: a load axis's
#: values sort within a policy, rounds within a load (no load: NaN, one group)
RUN_KEYS = ["experiment", "hardware", "policy", "load", "round"]


def requests_table(rows: Sequence[dict]) -> pa.Table:
    """Arrow table with the contract's columns in order (missing extras become null)."""
    cols = {name: [r.get(name) for r in rows] for name in REQUEST_COLUMNS}
    return pa.table({n: pa.array(v, type=t) for (n, t), v in zip(REQUEST_COLUMNS.items(), cols.values())})


def atomic_path(path: Path) -> tuple[int, str]:
    """A temp file beside ``path`` (same filesystem, so os.replace is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")


def write_atomic(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then move the result into place; never leave a partial file."""
    path = Path(path)
    fd, tmp = atomic_path(path)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_requests(table: pa.Table, path: Path) -> None:
    # deterministic bytes: no created_by timestamp varies, statistics are content-derived
    write_atomic(Path(path), lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def write_csv(df: pd.DataFrame, path: Path) -> None:
    """``df`` as CSV, floats to 6 significant digits except ``load``, written exactly
    (a load axis's values identify runs: 0.1234567 must not read back as 0.123457)."""
    if "load" in df and pd.api.types.is_float_dtype(df["load"]):
        from kvroute.pipeline import format_load

        df = df.assign(load=[format_load(v) if math.isfinite(v) else "" for v in df["load"]])
    write_atomic(Path(path), lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g"))


def imbalance(work_by_worker: Sequence[float]) -> float:
    arr = np.asarray(work_by_worker, dtype=float)
    mean = arr.mean() if arr.size else 0.0
    return float(arr.std() / mean) if mean > 0 else 0.0


def summarize(df: pd.DataFrame, workers: dict[tuple, Sequence[str]] | None = None) -> pd.DataFrame:
    """One summary row per run: (experiment, hardware, policy, round) and load.

    Columns: the keys, ``load_param`` and ``load`` (empty without a load axis),
    ``scaling`` (the records' labels, joined by ``;``; empty where they have none), then the
    metrics.

    Args:
        df: request records (without ``load`` columns: no load axis).
        workers: all worker names per (experiment, hardware, policy, round), so idle
            workers count in imbalance; by default the workers seen in the records.
    """
    df = df.assign(load=pd.to_numeric(df["load"], errors="coerce") if "load" in df else math.nan,
                   load_param=df["load_param"] if "load_param" in df else None)
    out = []
    for key, g in df.groupby(RUN_KEYS, sort=True, dropna=False):
        run = dict(zip(RUN_KEYS, key))
        key = tuple(run[k] for k in SUMMARY_KEYS)
        ok = g[g["status"] == "ok"]
        later = ok[ok["turn"] > 0]
        ttft = ok["ttft_ms"]
        work = (ok["prompt_tokens"] - ok["cached_tokens"] + ok["output_tokens"]).groupby(ok["worker"]).sum()
        names = list(workers.get(key, work.index)) if workers else list(work.index)
        prompt = ok["prompt_tokens"].sum()
        row = dict(zip(SUMMARY_KEYS, key))
        params = g["load_param"].dropna().unique()
        row.update(load_param=",".join(sorted(params)) if len(params) else None, load=run["load"])
        scalings = g["scaling"].dropna().unique() if "scaling" in g else ()
        row["scaling"] = ";".join(sorted(scalings)) if len(scalings) else None  # labels hold commas
        row.update(
            source=",".join(sorted(g["source"].unique())),
            requests=len(g),
            errors=int((g["status"] != "ok").sum()),
            time_to_complete_s=float(g["finish_s"].max() - g["arrival_s"].min()) if len(ok) else math.nan,
            ttft_mean_ms=ttft.mean(),
            ttft_p50_ms=ttft.quantile(0.5),
            ttft_p90_ms=ttft.quantile(0.9),
            ttft_p99_ms=ttft.quantile(0.99),
            later_ttft_mean_ms=later["ttft_ms"].mean(),
            later_ttft_p90_ms=later["ttft_ms"].quantile(0.9),
            e2e_mean_ms=ok["e2e_ms"].mean(),
            hit_rate=float(ok["cached_tokens"].sum() / prompt) if prompt else math.nan,
            imbalance=imbalance([work.get(w, 0.0) for w in names]),
        )
        out.append(row)
    return pd.DataFrame(out)
