"""Mooncake's FAST'25 traces: fetch them, verify them, and convert them into a trace.

Two traces of kvcache-ai/Mooncake, folder ``FAST25-release/traces/`` (Apache-2.0): the
*conversation* trace (12,031 requests over one hour of a production chat service) and
the *synthetic* one (3,993 requests built from public datasets, Poisson arrivals). One
JSON object a line: ``timestamp`` (ms from the start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the prompt
(the last block partial): equal leading ids mean an identical prefix.

Where the file comes from (:func:`fetch`): the original location (:data:`TRACES`,
raw GitHub at a pinned commit) when it can be had, else the project's own copy
(``data/mooncake/*.jsonl.gz``, :func:`copy_path`); both are checked against the same
SHA-256 (:class:`ChecksumMismatch` names the expected and actual digest), and the
caller is told which was used.

The conversion (:func:`convert`) keeps each request's content as it is in the file:
a turn with ``hash_ids`` (``Trace.block_tokens`` = 512), ``input_length`` tokens of
prompt and ``output_length`` of reply, sent at its own timestamp (mode ``replay``)
divided by a speed-up factor, within a window of the file. Sessions are not in the
trace; :func:`infer_sessions` infers them (the rule is in its docstring and in
docs/workloads.md, "Mooncake"), and each session is one conversation of the trace,
so session-affine policies see it as a chat.

Scaling, for engines that cannot serve the trace as it is (this machine's CPU workers):
``token_scale`` divides every length (512-token blocks become ``512 / token_scale``),
``max_input_tokens`` and ``max_output_tokens`` clip the scaled prompts (to their leading
blocks, so prefixes stay prefixes) and replies, ``session_fraction`` keeps a fixed share
of the sessions (whole sessions, so their reuse is kept), and the speed-up and window
scale time. It is part of the conversion, so the simulator and the load generator
replay the same scaled trace; ``meta["scaling"]`` says what was done
(:func:`scaling_label`), and every record of a run carries it (column ``scaling``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.records import write_atomic
from kvroute.workload.sharegpt import ChecksumMismatch, DownloadError, download, sha256_file
from kvroute.workload.trace import Conversation, Trace, Turn

log = logging.getLogger(__name__)

#: Tokens per hash id in both traces.
BLOCK_TOKENS = 512
#: The Mooncake repository commit the checksums were taken at (the files were added in
#: 3cca71d, "add FAST25 release", 2025-02-21, and are unchanged since).
COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"
_RAW = f"https://raw.githubusercontent.com/kvcache-ai/Mooncake/{COMMIT}/FAST25-release/traces"
#: Seconds to wait for the original location before using the copy.
FETCH_TIMEOUT_S = 10.0
#: Set (to anything but ``""`` or ``0``) to skip the original location and use the copy.
OFFLINE_ENV = "KVROUTE_OFFLINE"


@dataclass(frozen=True)
class TraceFile:
    """One trace of the release: where it lives and what it must hash to."""

    name: str
    filename: str  # the original, uncompressed file
    url: str
    sha256: str  # of the uncompressed file (the original's bytes)
    size: int  # bytes of the uncompressed file
    gz_sha256: str  # of the project's gzipped copy
    requests: int

    @property
    def copy_name(self) -> str:
        return self.filename + ".gz"


TRACES: dict[str, TraceFile] = {
    "conversation": TraceFile(
        "conversation", "conversation_trace.jsonl", f"{_RAW}/conversation_trace.jsonl",
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", 3_029_533,
        "cbae1655f679723e13e66e016606208ac03590d5b470d82cc4306a249288ea8a", 12_031,
    ),
    "synthetic": TraceFile(
        "synthetic", "synthetic_trace.jsonl", f"{_RAW}/synthetic_trace.jsonl",
        "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131", 1_136_313,
        "e43beb47ac9d36c2e7b1254e3309dd3c39cebc26c8ef340612070bf0298bacb8", 3_993,
    ),
}


def trace_file(name: str) -> TraceFile:
    """The :data:`TRACES` entry ``name``; ValueError listing the names otherwise."""
    try:
        return TRACES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown Mooncake trace {name!r}; valid: {sorted(TRACES)}") from None


# --- where the files are ----------------------------------------------------------------


def data_dir() -> Path:
    """``$KVROUTE_DATA_DIR``, else the repository's ``data/``, else ``./data``."""
    env = os.environ.get("KVROUTE_DATA_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3] / "data"
    return repo if repo.is_dir() else Path.cwd() / "data"


def copy_path(name: str, directory: str | os.PathLike | None = None) -> Path:
    """The project's gzipped copy of trace ``name`` (in ``directory``, default
    :func:`data_dir` ``/mooncake``)."""
    folder = Path(directory) if directory is not None else data_dir() / "mooncake"
    return folder / trace_file(name).copy_name


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _expect(what: str, digest: str, expected: str) -> None:
    if digest != expected:
        raise ChecksumMismatch(f"{what}: SHA-256 mismatch: expected {expected}, got {digest}")


def verified_bytes(name: str, path: str | os.PathLike) -> bytes:
    """The uncompressed bytes of trace ``name`` read from ``path`` (the original
    ``.jsonl`` or the project's ``.jsonl.gz``), checked against :data:`TRACES`'
    checksums (both of a gzipped file's); :class:`ChecksumMismatch` otherwise."""
    tf = trace_file(name)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no {name} trace file at {path}")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        _expect(f"{path} (the {name} trace's gzipped copy)", _digest(raw), tf.gz_sha256)
        raw = gzip.decompress(raw)
    _expect(f"{path} (the {name} trace)", _digest(raw), tf.sha256)
    return raw


@dataclass(frozen=True)
class Fetched:
    """Where :func:`fetch` put the file and where it came from."""

    path: Path
    source: str  # "present" (already there, verified), "download" or "copy"
    detail: str  # the URL, or why the copy was used


def _offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "") not in ("", "0")


def fetch(
    name: str,
    dest_dir: str | os.PathLike,
    *,
    url: str | None = None,
    timeout_s: float = FETCH_TIMEOUT_S,
    offline: bool | None = None,
    copy: str | os.PathLike | None = None,
) -> Fetched:
    """Put trace ``name``'s original file into ``dest_dir``, verified by its SHA-256.

    A verified file already there is kept. Otherwise the original location (``url``,
    default the pinned raw GitHub URL of :data:`TRACES`) is tried with
    :func:`~kvroute.workload.sharegpt.download` (``timeout_s``; size and SHA-256
    checked, atomic); when that fails, or ``offline`` (default: ``$KVROUTE_OFFLINE``
    set), the project's copy (``copy``, default :func:`copy_path`) is verified,
    decompressed and written there atomically. The result and the log say
    which was used. Raises :class:`ChecksumMismatch` if the copy does not verify.
    """
    tf = trace_file(name)
    url = url or tf.url
    dest = Path(dest_dir) / tf.filename
    if dest.is_file() and sha256_file(dest) == tf.sha256:
        log.info("mooncake %s: %s already present and verified", name, dest)
        return Fetched(dest, "present", str(dest))
    offline = _offline() if offline is None else offline
    if offline:
        reason = f"offline (${OFFLINE_ENV} or --offline)"
    else:
        try:
            download(url, dest, sha256=tf.sha256, size=tf.size, progress=False, timeout_s=timeout_s)
        except DownloadError as exc:
            reason = f"the original location failed: {exc}"
        else:
            log.info("mooncake %s: downloaded %s to %s (SHA-256 verified)", name, url, dest)
            return Fetched(dest, "download", url)
    src = Path(copy) if copy is not None else copy_path(name)
    log.warning("mooncake %s: %s; using the project's copy %s", name, reason, src)
    data = verified_bytes(name, src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(dest, lambda tmp: Path(tmp).write_bytes(data))
    return Fetched(dest, "copy", reason)


# --- reading --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One line of a trace file."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_count(x: Any, minimum: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def parse_requests(text: str | bytes, source: str = "trace", block_tokens: int = BLOCK_TOKENS) -> list[Request]:
    """The requests of a trace file's text, checked line by line (ValueError naming the
    line and field): the four fields, ints, ``input_length`` and ``output_length`` >= 1,
    ``ceil(input_length / block_tokens)`` ids, timestamps non-decreasing."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    out: list[Request] = []
    last = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        at = f"{source} line {n}"
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{at}: not JSON ({exc.msg})") from None
        if not isinstance(r, dict):
            raise ValueError(f"{at}: expected a JSON object")
        missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in r]
        if missing:
            raise ValueError(f"{at}: missing field(s) {missing}")
        ts, inp, outp, ids = r["timestamp"], r["input_length"], r["output_length"], r["hash_ids"]
        if not _is_count(ts, last):
            raise ValueError(f"{at}: timestamp must be an int >= the previous line's {last}, got {ts!r}")
        if not _is_count(inp, 1) or not _is_count(outp, 1):
            raise ValueError(f"{at}: input_length and output_length must be ints >= 1, got {inp!r}, {outp!r}")
        if not isinstance(ids, list) or not all(_is_count(h, 0) for h in ids):
            raise ValueError(f"{at}: hash_ids must be a list of ints >= 0")
        if len(ids) != -(-inp // block_tokens):
            raise ValueError(
                f"{at}: {len(ids)} hash_ids for input_length {inp}; expected "
                f"ceil({inp} / {block_tokens}) = {-(-inp // block_tokens)}"
            )
        last = ts
        out.append(Request(ts, inp, outp, tuple(ids)))
    if not out:
        raise ValueError(f"{source}: no requests")
    return out


def read_requests(name: str, path: str | os.PathLike | None = None) -> list[Request]:
    """Trace ``name``'s requests from ``path`` (default: the project's copy), verified."""
    path = Path(path) if path is not None else copy_path(name)
    return parse_requests(verified_bytes(name, path), str(path))


# --- sessions and reuse, from hash_ids alone -----------------------------------------


def common_leading_blocks(requests: Sequence[Request]) -> int:
    """How many leading ids every request shares (the conversation trace's id 0: 1)."""
    first = requests[0].hash_ids
    n = len(first)
    for r in requests[1:]:
        ids = r.hash_ids
        k = 0
        while k < n and k < len(ids) and ids[k] == first[k]:
            k += 1
        n = k
        if not n:
            break
    return n


def infer_sessions(requests: Sequence[Request], common: int | None = None) -> list[int]:
    """The session of every request: the index of the session's first request.

    Rule: a request continues the session of the earlier request (in file order, which
    is time order) with which it shares the most leading hash ids, provided it shares
    more than the ``common`` leading ids every request of the file has (default
    :func:`common_leading_blocks`: the conversation trace's id 0, a system prompt, links
    nothing); among equals, the most recent. Otherwise it starts a session.

    Equivalently, requests whose first ``common + 1`` ids agree form one session (the
    first block after the shared ones, the start of a chat's first message, which
    every later turn sends again), and a request with no more than ``common`` ids is a
    session of its own: two requests sharing more than ``common`` leading ids with a
    third share them with each other, so by induction over the file every request
    sharing that much with an earlier one is already in that one's session, whichever
    is chosen. That is what is computed. A session may fork (a regenerated reply, an
    edited message); it stays one session.
    """
    common = common_leading_blocks(requests) if common is None else common
    first: dict[tuple[int, ...], int] = {}
    out: list[int] = []
    for i, r in enumerate(requests):
        ids = r.hash_ids
        out.append(first.setdefault(ids[: common + 1], i) if len(ids) > common else i)
    return out


def reused_tokens(requests: Sequence[Request], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Per request, the trace's own bound on its prefix-cache hit, from ``hash_ids`` alone.

    The longest leading run of its ids that some earlier request's prompt starts with,
    in tokens: full blocks count ``block_tokens``; where the run ends in a partial
    block (this request's last, or every earlier one's with that prefix), the shorter
    of this block and the longest earlier one counts (a partial block is a prefix of
    its id's content). What a cache that never forgets could serve, before the
    engine's own rules (whole engine blocks; the last prompt token recomputed).
    """
    children: dict[tuple[int, int], int] = {}
    longest: list[int] = [0]  # per node: the longest block the earlier prompts had there
    out: list[int] = []
    for r in requests:
        ids, n = r.hash_ids, r.input_length
        node = depth = 0
        for h in ids:
            nxt = children.get((node, h))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        if depth:
            own = min(block_tokens, n - block_tokens * (depth - 1))
            out.append(block_tokens * (depth - 1) + min(own, longest[node]))
        else:
            out.append(0)
        node = 0
        for j, h in enumerate(ids):
            nxt = children.get((node, h))
            if nxt is None:
                nxt = children[(node, h)] = len(longest)
                longest.append(0)
            size = min(block_tokens, n - block_tokens * j)
            if size > longest[nxt]:
                longest[nxt] = size
            node = nxt
    return out


def prefix_reuse_bound(requests: Sequence[Request], block_tokens: int = BLOCK_TOKENS) -> float:
    """:func:`reused_tokens` over all input tokens: the hit rate an unbounded cache on
    one worker would have (the trace's own bound)."""
    total = sum(r.input_length for r in requests)
    return sum(reused_tokens(requests, block_tokens)) / total if total else 0.0


def _shared_tokens(a: Request, b: Request, block_tokens: int) -> int:
    """Leading tokens ``a``'s prompt shares with ``b``'s (``b`` earlier)."""
    k = 0
    for x, y in zip(a.hash_ids, b.hash_ids):
        if x != y:
            break
        k += 1
    if not k:
        return 0
    last_a = min(block_tokens, a.input_length - block_tokens * (k - 1))
    last_b = min(block_tokens, b.input_length - block_tokens * (k - 1))
    return block_tokens * (k - 1) + min(last_a, last_b)


# --- conversion -----------------------------------------------------------------------


def _window(requests: Sequence[Request], start_s: float, duration_s: float | None,
            max_requests: int | None, session: Sequence[int] | None = None, session_fraction: float = 1.0) -> list[int]:
    """Indices of the requests in ``[start_s, start_s + duration_s)`` (trace seconds) whose
    session is kept (:func:`session_kept`), at most ``max_requests``."""
    lo = start_s * 1000.0
    hi = math.inf if duration_s is None else (start_s + duration_s) * 1000.0
    picked = [i for i, r in enumerate(requests) if lo <= r.timestamp_ms < hi]
    if session_fraction < 1:
        picked = [i for i in picked if session_kept(session[i], session_fraction)]
    return picked if max_requests is None else picked[:max_requests]


def session_kept(session: int, fraction: float) -> bool:
    """Whether ``session_fraction`` keeps the session whose first request is ``session``:
    the first 8 bytes of SHA-256 of its index, as a number in [0, 1), below ``fraction``.
    Fixed by the index alone (no seed: every round, and both worlds, keep the same
    sessions), nested (a smaller fraction keeps a subset) and independent of the window."""
    u = int.from_bytes(hashlib.sha256(f"mooncake-session:{session}".encode()).digest()[:8], "big") / 2.0**64
    return u < fraction


def scale_request(r: Request, token_scale: int = 1, max_input_tokens: int | None = None,
                  max_output_tokens: int | None = None) -> Request:
    """``r`` in scaled tokens: lengths ``ceil(length / token_scale)`` (at least 1), the
    prompt cut to its first ``max_input_tokens`` tokens and its ids to the blocks those
    cover, the reply to ``max_output_tokens``. With ``B = 512 / token_scale`` tokens a
    block, ``ceil(ceil(n / s) / B) == ceil(n / 512)``: the ids stay one per block."""
    inp = -(-r.input_length // token_scale)
    out = -(-r.output_length // token_scale)
    if max_input_tokens is not None and inp > max_input_tokens:
        inp = max_input_tokens
    if max_output_tokens is not None:
        out = min(out, max_output_tokens)
    block = BLOCK_TOKENS // token_scale
    return Request(r.timestamp_ms, inp, out, r.hash_ids[: -(-inp // block)])


def scaling_label(token_scale: int = 1, speedup: float = 1.0, start_s: float = 0.0, duration_s: float | None = None,
                  max_requests: int | None = None, max_input_tokens: int | None = None,
                  max_output_tokens: int | None = None, session_fraction: float = 1.0) -> str:
    """What a conversion did to the trace, in one line for the records' ``scaling`` column:
    ``tokens/16,input<=3072,output<=64,time x6,window 0-600s,sessions 0.1,first 200``
    (tokens, time and window always; the rest where set)."""
    parts = [f"tokens/{token_scale:g}"]
    if max_input_tokens is not None:
        parts.append(f"input<={max_input_tokens}")
    if max_output_tokens is not None:
        parts.append(f"output<={max_output_tokens}")
    parts.append(f"time x{speedup:g}")
    parts.append(f"window {start_s:g}-{start_s + duration_s:g}s" if duration_s is not None else f"window {start_s:g}s-end")
    if session_fraction < 1:
        parts.append(f"sessions {session_fraction:g}")
    if max_requests is not None:
        parts.append(f"first {max_requests}")
    return ",".join(parts)


class ParameterError(ValueError):
    """A bad conversion parameter; ``key`` names it (for ``workload.params.KEY`` messages)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def check_params(speedup: Any, start_s: Any, duration_s: Any, max_requests: Any, name: Any = "conversation", *,
                 token_scale: Any = 1, max_input_tokens: Any = None, max_output_tokens: Any = None,
                 session_fraction: Any = 1.0) -> None:
    """Raise :class:`ParameterError` naming the first bad parameter of :func:`convert`."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (_is_count(token_scale, 1) and BLOCK_TOKENS % token_scale == 0):
        raise ParameterError("token_scale", f"token_scale must be an integer >= 1 dividing {BLOCK_TOKENS} "
                                            f"(so a block is whole tokens: 1, 2, 4, ..., 512), got {token_scale!r}")
    for key, v in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)):
        if v is not None and not _is_count(v, 1):
            raise ParameterError(key, f"{key} must be None or an integer >= 1 (scaled tokens), got {v!r}")
    if not (number(session_fraction) and 0 < session_fraction <= 1):
        raise ParameterError("session_fraction", f"session_fraction must be a number in (0, 1], got {session_fraction!r}")

    if name not in TRACES:
        raise ParameterError("name", f"name must be a Mooncake trace, one of {sorted(TRACES)}; got {name!r}")
    if not (number(speedup) and speedup > 0):
        raise ParameterError("speedup", f"speedup must be a finite number > 0, got {speedup!r}")
    if not (number(start_s) and start_s >= 0):
        raise ParameterError("start_s", f"start_s must be a finite number >= 0, got {start_s!r}")
    if duration_s is not None and not (number(duration_s) and duration_s > 0):
        raise ParameterError("duration_s", f"duration_s must be None or a finite number > 0, got {duration_s!r}")
    if max_requests is not None and not _is_count(max_requests, 1):
        raise ParameterError("max_requests", f"max_requests must be None or an integer >= 1, got {max_requests!r}")


def convert(
    requests: Sequence[Request],
    name: str = "conversation",
    *,
    speedup: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    source: dict | None = None,
    token_scale: int = 1,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    session_fraction: float = 1.0,
) -> Trace:
    """The requests as a replay-mode trace (the module docstring, and docs/workloads.md).

    Sessions are inferred over all ``requests`` (so a request's session does not
    depend on the window), then the window is cut: requests with
    ``start_s <= timestamp / 1000 < start_s + duration_s`` (trace seconds; ``None``: to
    the end) whose session ``session_fraction`` keeps (:func:`session_kept`), the first
    ``max_requests`` of them. Request ``i`` arrives at
    ``(timestamp_i / 1000 - start_s) / speedup``; its lengths are scaled by
    :func:`scale_request` (``block_tokens = 512 / token_scale``). A session is a conversation
    ``mooncake-<name>-<index of its first request in the file>``, its requests in the
    window its turns in order; conversations come in order of their first turn.
    """
    check_params(speedup, start_s, duration_s, max_requests, name, token_scale=token_scale,
                 max_input_tokens=max_input_tokens, max_output_tokens=max_output_tokens,
                 session_fraction=session_fraction)
    if not requests:
        raise ValueError("no requests to convert")
    common = common_leading_blocks(requests)
    session = infer_sessions(requests, common)
    picked = _window(requests, start_s, duration_s, max_requests, session, session_fraction)
    if not picked:
        kept = "" if session_fraction == 1 else f" among the sessions session_fraction={session_fraction} keeps"
        raise ValueError(
            f"no request of the {name} trace in the window start_s={start_s}, duration_s={duration_s}{kept} "
            f"(its timestamps run from 0 to {requests[-1].timestamp_ms / 1000:.3f} s)"
        )
    block = BLOCK_TOKENS // token_scale
    scaled = {i: scale_request(requests[i], token_scale, max_input_tokens, max_output_tokens) for i in picked}
    prefix = f"mooncake-{name}"
    turns: dict[int, list[Turn]] = {}
    for i in picked:
        r = scaled[i]
        at = (r.timestamp_ms / 1000.0 - start_s) / speedup
        turns.setdefault(session[i], []).append(Turn(r.input_length, r.output_length, 0.0, at, r.hash_ids))
    convs = tuple(Conversation(f"{prefix}-{s:05d}", "", 0, tuple(ts), ts[0].arrival_s) for s, ts in turns.items())
    window = [scaled[i] for i in picked]
    params = {"name": name, "speedup": speedup, "start_s": start_s, "duration_s": duration_s,
              "max_requests": max_requests, "token_scale": token_scale, "max_input_tokens": max_input_tokens,
              "max_output_tokens": max_output_tokens, "session_fraction": session_fraction}
    stats = _stats(scaled, picked, session, window, common, block, len(requests))
    stats["truncated_prompts"] = sum(1 for i in picked if scaled[i].input_length < -(-requests[i].input_length // token_scale))
    stats["clipped_replies"] = sum(1 for i in picked if scaled[i].output_length < -(-requests[i].output_length // token_scale))
    meta = {
        "dataset": "mooncake",
        "trace": name,
        "source": dict(source or {}),
        "params": params,
        "block_tokens": block,
        "scaling": scaling_label(token_scale, speedup, start_s, duration_s, max_requests, max_input_tokens,
                                 max_output_tokens, session_fraction),
        "session_rule": (f"a request continues the session of the earlier request it shares the most "
                         f"leading hash ids with, if more than the {common} every request shares; "
                         f"ties: the most recent; else a new session (so: one session per first "
                         f"{common + 1} hash ids)"),
        "stats": stats,
    }
    trace = Trace(prefix, "replay", convs, None, meta, block).validate()
    log.info("mooncake %s: %d requests in %d sessions, %.1f s after a %gx speed-up (%s)",
             name, len(picked), len(convs), window[-1].timestamp_ms / 1000 / speedup - start_s / speedup, speedup,
             meta["scaling"])
    return trace


def _stats(requests: dict[int, Request], picked: list[int], session: list[int], window: list[Request],
           common: int, block_tokens: int, in_file: int) -> dict[str, Any]:
    """Sessions and reuse of the window (``requests``: the window's, by index in the
    file, in ``block_tokens``-token blocks), for the trace's meta (plain JSON)."""
    sizes: dict[int, int] = {}
    for i in picked:
        sizes[session[i]] = sizes.get(session[i], 0) + 1
    per_session = list(sizes.values())
    total_in = sum(r.input_length for r in window)
    # tokens each request shares with the previous request of its session in the window:
    # what perfect session affinity could reuse, before capacity
    previous: dict[int, int] = {}
    session_reuse = 0
    for i in picked:
        s = session[i]
        if s in previous:
            session_reuse += _shared_tokens(requests[i], requests[previous[s]], block_tokens)
        previous[s] = i
    reuse = reused_tokens(window, block_tokens)
    return {
        "requests": len(window),
        "requests_in_file": in_file,
        "sessions": len(per_session),
        "turns_per_session_mean": len(window) / len(per_session),
        "turns_per_session_median": statistics.median(per_session),
        "turns_per_session_max": max(per_session),
        "single_request_sessions": sum(1 for n in per_session if n == 1),
        "common_leading_blocks": common,
        "span_s": (window[-1].timestamp_ms - window[0].timestamp_ms) / 1000.0,
        "input_tokens": total_in,
        "input_tokens_mean": total_in / len(window),
        "output_tokens_mean": sum(r.output_length for r in window) / len(window),
        "prefix_reuse_bound": sum(reuse) / total_in,
        "session_reuse": session_reuse / total_in,
    }


def mooncake_trace(
    name: str = "conversation",
    speedup: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    token_scale: int = 1,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    session_fraction: float = 1.0,
    *,
    path: str | os.PathLike | None = None,
) -> Trace:
    """Trace ``name`` converted (:func:`convert`) from ``path`` (a fetched original or a
    gzipped copy; default the project's copy), verified by checksum first."""
    scale = {"token_scale": token_scale, "max_input_tokens": max_input_tokens,
             "max_output_tokens": max_output_tokens, "session_fraction": session_fraction}
    check_params(speedup, start_s, duration_s, max_requests, name, **scale)
    tf = trace_file(name)
    requests = read_requests(name, path)
    source = {"file": tf.filename, "sha256": tf.sha256, "url": tf.url, "commit": COMMIT}
    return convert(requests, name, speedup=speedup, start_s=start_s, duration_s=duration_s,
                   max_requests=max_requests, source=source, **scale)


#: Aliases under which :mod:`kvroute.workload` exports them.
MOONCAKE_TRACES = TRACES
fetch_mooncake = fetch
