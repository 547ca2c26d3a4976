"""Traces as tables and parquet files.

A trace is stored as one row per turn (the shape every notebook and the record schema
already use) plus the trace-level fields (``name``, ``mode``, ``concurrency``, ``meta``)
as JSON in the parquet schema metadata, so one file is the whole workload. Writes are
atomic (temp file in the same folder, then ``os.replace``) so an interrupted run never
leaves a half-written trace behind, and the round trip is exact: ``read_trace(p) ==
trace`` after ``write_trace(trace, p)``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvroute.workload.trace import Conversation, Mode, Trace, Turn

log = logging.getLogger(__name__)

METADATA_KEY = b"kvroute.trace"
FORMAT_VERSION = 1

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


def trace_to_frame(trace: Trace) -> pd.DataFrame:
    """One row per turn, conversations in trace order, turns 0-based in order."""
    rows = [
        (c.id, c.system_id, c.system_tokens, c.arrival_s,
         i, t.user_tokens, t.output_tokens, t.think_s)
        for c in trace.conversations
        for i, t in enumerate(c.turns)
    ]
    frame = pd.DataFrame.from_records(rows, columns=list(COLUMNS))
    return frame.astype(COLUMNS)


def trace_from_frame(
    df: pd.DataFrame,
    name: str,
    mode: Mode,
    concurrency: int | None = None,
    meta: Mapping | None = None,
) -> Trace:
    """Rebuild a trace from :func:`trace_to_frame`'s table; validates what it builds.

    Conversations come out in the order of their first row; rows of one conversation
    may be in any order but their ``turn`` values must be exactly 0..n-1 and their
    conversation-level columns must agree.
    """
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"trace table lacks column(s) {missing}; expected {list(COLUMNS)}")
    cols = {c: df[c].tolist() for c in COLUMNS}  # Python scalars, not numpy ones
    grouped: dict[str, list[int]] = {}
    for row, conv in enumerate(cols["conversation"]):
        grouped.setdefault(str(conv), []).append(row)
    conversations = tuple(_conversation(conv, rows, cols) for conv, rows in grouped.items())
    trace = Trace(name, mode, conversations, concurrency, dict(meta or {}))
    return trace.validate()


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
        Turn(int(cols["user_tokens"][r]), int(cols["output_tokens"][r]), float(cols["think_s"][r]))
        for r in rows
    )
    return Conversation(
        id=conv,
        system_id=str(cols["system_id"][first]),
        system_tokens=int(cols["system_tokens"][first]),
        turns=turns,
        arrival_s=float(cols["arrival_s"][first]),
    )


def _header(trace: Trace) -> bytes:
    """Trace-level fields as JSON; refuses meta that JSON would not give back equal."""
    header = {
        "format": FORMAT_VERSION,
        "name": trace.name,
        "mode": trace.mode,
        "concurrency": trace.concurrency,
        "meta": trace.meta,
    }
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
    table = pa.Table.from_pandas(trace_to_frame(trace), preserve_index=False)
    metadata = dict(table.schema.metadata or {})
    metadata[METADATA_KEY] = _header(trace)
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
    if header.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: trace format {header.get('format')!r}, this kvroute reads {FORMAT_VERSION}"
        )
    return trace_from_frame(
        table.to_pandas(), header["name"], header["mode"], header["concurrency"], header["meta"]
    )
