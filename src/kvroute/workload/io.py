"""Traces as tables and parquet files.

A trace is stored as one row per turn (the shape every notebook and the record schema
already use) plus the trace-level fields (``name``, ``mode``, ``concurrency``, ``meta``,
``block_tokens``) as JSON in the parquet schema metadata, so one file is the whole
workload.

Format versions: 1 has the :data:`COLUMNS`; 2 adds, where the trace uses them, the
:data:`V2_COLUMNS` (``turn_arrival_s``: each turn's own arrival, replay mode;
``hash_ids``: a turn's prompt as block ids) and ``block_tokens`` in the header. A
trace is written in the oldest version that holds it, so a trace without either is
the same file as before version 2; both versions are read. Writes are
atomic (temp file in the same folder, then ``os.replace``) so an interrupted run never
leaves a half-written trace behind, and the round trip is exact: ``read_trace(p) ==
trace`` after ``write_trace(trace, p)``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvroute.workload.trace import Conversation, Mode, Trace, Turn

log = logging.getLogger(__name__)

METADATA_KEY = b"kvroute.trace"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)

#: Column name -> pandas dtype, in file order.
COLUMNS: dict[str, str] = {
    "conversation": "object",
    "system_id": "object",
    "system_tokens": "int64",
    "arrival_s": "float64",
    "turn": "int64",
    "user_tokens": "int64",
    "output_tokens": "int64",
    "think_s": "float64",
}
#: Version-2 columns, present when the trace uses them: a turn's own arrival (NaN: none)
#: and its prompt's block ids (None: built from the history).
V2_COLUMNS: dict[str, str] = {
    "turn_arrival_s": "float64",
    "hash_ids": "object",
}


def _v2_columns(trace: Trace) -> list[str]:
    """The version-2 columns ``trace`` needs (none: a version-1 table)."""
    out = []
    if any(t.arrival_s is not None for c in trace.conversations for t in c.turns):
        out.append("turn_arrival_s")
    if trace.explicit:
        out.append("hash_ids")
    return out


def trace_to_frame(trace: Trace) -> pd.DataFrame:
    """One row per turn, conversations in trace order, turns 0-based in order; the
    version-2 columns only where the trace uses them."""
    rows = [
        (c.id, c.system_id, c.system_tokens, c.arrival_s,
         i, t.user_tokens, t.output_tokens, t.think_s)
        for c in trace.conversations
        for i, t in enumerate(c.turns)
    ]
    frame = pd.DataFrame.from_records(rows, columns=list(COLUMNS)).astype(COLUMNS)
    turns = [t for c in trace.conversations for t in c.turns]
    for col in _v2_columns(trace):
        if col == "turn_arrival_s":
            frame[col] = pd.array([math.nan if t.arrival_s is None else t.arrival_s for t in turns], dtype="float64")
        else:
            frame[col] = pd.Series([None if t.hash_ids is None else list(t.hash_ids) for t in turns], dtype="object")
    return frame


def trace_from_frame(
    df: pd.DataFrame,
    name: str,
    mode: Mode,
    concurrency: int | None = None,
    meta: Mapping | None = None,
    block_tokens: int | None = None,
) -> Trace:
    """Rebuild a trace from :func:`trace_to_frame`'s table; validates what it builds.

    Conversations come out in the order of their first row; rows of one conversation
    may be in any order but their ``turn`` values must be exactly 0..n-1 and their
    conversation-level columns must agree. The :data:`V2_COLUMNS` are optional.
    """
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"trace table lacks column(s) {missing}; expected {list(COLUMNS)}")
    cols = {c: df[c].tolist() for c in COLUMNS}  # Python scalars, not numpy ones
    n = len(df)
    arrivals = df["turn_arrival_s"].tolist() if "turn_arrival_s" in df.columns else [math.nan] * n
    cols["turn_arrival_s"] = [None if a is None or math.isnan(a) else float(a) for a in arrivals]
    ids = df["hash_ids"].tolist() if "hash_ids" in df.columns else [None] * n
    cols["hash_ids"] = [_ids(v) for v in ids]
    grouped: dict[str, list[int]] = {}
    for row, conv in enumerate(cols["conversation"]):
        grouped.setdefault(str(conv), []).append(row)
    conversations = tuple(_conversation(conv, rows, cols) for conv, rows in grouped.items())
    trace = Trace(name, mode, conversations, concurrency, dict(meta or {}), block_tokens)
    return trace.validate()


def _ids(value: object) -> tuple[int, ...] | None:
    """A ``hash_ids`` cell as a tuple of Python ints (None: no explicit prompt)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return tuple(int(h) for h in value)


def _conversation(conv: str, rows: list[int], cols: dict[str, list]) -> Conversation:
    rows = sorted(rows, key=lambda r: cols["turn"][r])
    turns_seen = [cols["turn"][r] for r in rows]
    if turns_seen != list(range(len(rows))):
        raise ValueError(
            f"conversation {conv!r} has turns {turns_seen}; expected 0..{len(rows) - 1}"
        )
    for key in ("system_id", "system_tokens", "arrival_s"):
        values = {cols[key][r] for r in rows}
        if len(values) != 1:
            shown = sorted(map(str, values))
            raise ValueError(f"conversation {conv!r} has several {key} values: {shown}")
    first = rows[0]
    turns = tuple(
        Turn(int(cols["user_tokens"][r]), int(cols["output_tokens"][r]), float(cols["think_s"][r]),
             cols["turn_arrival_s"][r], cols["hash_ids"][r])
        for r in rows
    )
    return Conversation(
        id=conv,
        system_id=str(cols["system_id"][first]),
        system_tokens=int(cols["system_tokens"][first]),
        turns=turns,
        arrival_s=float(cols["arrival_s"][first]),
    )


def _header(trace: Trace, version: int) -> bytes:
    """Trace-level fields as JSON; refuses meta that JSON would not give back equal."""
    header = {
        "format": version,
        "name": trace.name,
        "mode": trace.mode,
        "concurrency": trace.concurrency,
        "meta": trace.meta,
    }
    if version >= 2:
        header["block_tokens"] = trace.block_tokens
    try:
        text = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"trace {trace.name!r}: meta is not plain JSON ({exc})") from exc
    if json.loads(text) != header:
        raise ValueError(
            f"trace {trace.name!r}: meta would not read back equal from JSON "
            "(tuples, non-string keys?); use lists and string keys"
        )
    return text.encode("utf-8")


def write_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write ``trace`` to a parquet file atomically; returns the path.

    The file appears complete or not at all: the table goes to a temp file in the
    destination folder, is flushed to disk, then renamed over ``path``.
    """
    trace.validate()
    path = Path(path)
    frame = trace_to_frame(trace)
    ids = frame.pop("hash_ids") if "hash_ids" in frame.columns else None
    table = pa.Table.from_pandas(frame, preserve_index=False)
    if ids is not None:
        table = table.append_column("hash_ids", pa.array(ids.tolist(), type=pa.list_(pa.int64())))
    version = FORMAT_VERSION if (trace.mode == "replay" or trace.explicit) else 1
    metadata = dict(table.schema.metadata or {})
    metadata[METADATA_KEY] = _header(trace, version)
    table = table.replace_schema_metadata(metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("wrote trace %s (%d conversations, %d turns) to %s",
             trace.name, len(trace.conversations), trace.num_requests, path)
    return path


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by :func:`write_trace`."""
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ValueError(f"{path} is not a kvroute trace (no {METADATA_KEY.decode()} metadata)")
    header = json.loads(raw)
    if header.get("format") not in READ_VERSIONS:
        raise ValueError(
            f"{path}: trace format {header.get('format')!r}, this kvroute reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}"
        )
    ids = None
    if "hash_ids" in table.column_names:  # Python lists straight from arrow (not numpy arrays)
        ids = table.column("hash_ids").to_pylist()
        table = table.drop_columns(["hash_ids"])
    frame = table.to_pandas()
    if ids is not None:
        frame["hash_ids"] = pd.Series(ids, dtype="object")
    return trace_from_frame(
        frame, header["name"], header["mode"], header["concurrency"], header["meta"],
        header.get("block_tokens"),
    )
