"""The real ShareGPT dataset: download it, and convert it into a trace.

The file is ShareGPT_V3_unfiltered_cleaned_split.json from the Hugging Face dataset
anon8231489123/ShareGPT_Vicuna_unfiltered: a JSON list of
``{"id": ..., "conversations": [{"from": "human" | "gpt" | "system" | ..., "value": text}]}``.
It is read as a stream (one record at a time), so the 673 MB file never has to be
held as Python objects at once.

How messages become turns (the dataset's role order is not always regular):

* roles ``human``/``user`` are the user; ``gpt``/``chatgpt``/``bard``/``bing``/
  ``assistant``/``model`` the assistant; ``system`` the system; any other role is
  dropped and counted.
* leading ``system`` messages form the conversation's system prompt; conversations
  with the same system text share a ``system_id``. A later ``system`` message is
  counted into the next user message (it is in the prompt the model sees).
* consecutive user messages merge into one turn's message; consecutive assistant
  messages merge into one reply.
* assistant messages before the first user message answer nothing in the trace and
  are dropped (counted); a final user message with no reply is dropped (counted).
* a conversation left with no complete turn is skipped (counted).
* a repeated ``id`` gets a ``~2``, ``~3``... suffix; a missing one becomes ``sharegpt-<index>``.

Token counts come from ``tokenizer.encode(text)`` when a tokenizer is given, else
``ceil(words * tokens_per_word)``; chat-template tokens are not counted. An empty reply
counts as one token (a reply needs a first token).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
from tqdm import tqdm

from kvroute.workload.generators import TOKENS_PER_WORD, _poisson_arrivals
from kvroute.workload.trace import Conversation, Mode, Trace, Turn

log = logging.getLogger(__name__)

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_URL = (
    "https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered/"
    f"resolve/main/{SHAREGPT_FILENAME}"
)
#: Size in bytes (field notes, "Workloads"); checked on download.
SHAREGPT_SIZE = 672_837_942
#: Not known to this project (no hub reachable when written); the size is checked
#: instead. Fill in from the hub's file page to have downloads verified by digest.
SHAREGPT_SHA256: str | None = None

USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bard", "bing", "assistant", "model"})
SYSTEM_ROLES = frozenset({"system"})

_READ_CHUNK = 1 << 20


class Tokenizer(Protocol):
    """Anything with ``encode(text) -> list`` (e.g. a Hugging Face tokenizer)."""

    def encode(self, text: str) -> list: ...


# --- reading the JSON list as a stream ------------------------------------------------


def iter_records(path: str | os.PathLike) -> Iterator[Any]:
    """Yield the elements of a top-level JSON list one at a time."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(_READ_CHUNK)
            eof = chunk == ""
            buf, pos = buf[pos:] + chunk, 0
            return not eof

        def skip_ws() -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos].isspace():
                    pos += 1
                if pos < len(buf) or not more():
                    return

        skip_ws()
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: expected a JSON list of conversations")
        pos += 1
        skip_ws()
        if pos < len(buf) and buf[pos] == "]":
            return
        while True:
            skip_ws()
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as exc:
                    if eof or not more():
                        raise ValueError(f"{path}: malformed JSON ({exc.msg})") from exc
            pos = end
            yield record
            skip_ws()
            if pos >= len(buf):
                raise ValueError(f"{path}: JSON list is not closed")
            if buf[pos] == "]":
                return
            if buf[pos] != ",":
                raise ValueError(f"{path}: expected ',' or ']' between conversations")
            pos += 1


# --- messages to turns ----------------------------------------------------------------


@dataclass
class ConversionStats:
    """What the converter kept and dropped, recorded in the trace's meta."""

    records: int = 0
    conversations: int = 0
    turns: int = 0
    skipped_no_turn: int = 0
    skipped_too_long: int = 0
    dropped_unknown_role: int = 0
    dropped_leading_assistant: int = 0
    dropped_trailing_user: int = 0
    dropped_over_context: int = 0
    unknown_roles: dict[str, int] = field(default_factory=dict)


def _counter(tokenizer: Tokenizer | None, tokens_per_word: float) -> Callable[[str], int]:
    """A text -> tokens function: the tokenizer, else the words ratio."""
    if tokenizer is not None:
        return lambda text: len(tokenizer.encode(text))
    # the epsilon keeps ceil(150 * 4/3) at 200, not 201, despite float error
    return lambda text: math.ceil(len(text.split()) * tokens_per_word - 1e-9)


def _turns(
    messages: list, count: Callable[[str], int], stats: ConversionStats
) -> tuple[str, list[tuple[int, int]]]:
    """(system text, [(user tokens, reply tokens)]) by the module's role rules."""
    system_parts: list[str] = []
    turns: list[tuple[int, int]] = []
    user: int | None = None  # tokens of the pending user message
    reply: int | None = None  # tokens of the reply being merged
    started = False
    for m in messages:
        role = str(m.get("from", "")).lower() if isinstance(m, Mapping) else ""
        text = m.get("value") if isinstance(m, Mapping) else None
        text = text if isinstance(text, str) else ""
        if role in SYSTEM_ROLES and not started:
            system_parts.append(text)
            continue
        started = True
        if role in USER_ROLES or role in SYSTEM_ROLES:
            if reply is not None:
                turns.append((user, max(reply, 1)))
                user, reply = None, None
            user = (user or 0) + count(text)
        elif role in ASSISTANT_ROLES:
            if user is None:
                stats.dropped_leading_assistant += 1
            else:
                reply = (reply or 0) + count(text)
        else:
            stats.dropped_unknown_role += 1
            stats.unknown_roles[role] = stats.unknown_roles.get(role, 0) + 1
    if reply is not None:
        turns.append((user, max(reply, 1)))
    elif user is not None:
        stats.dropped_trailing_user += 1
    return "\n".join(system_parts), turns


def _fit(
    system: int, turns: list[tuple[int, int]], limit: int | None, stats: ConversionStats
) -> list[tuple[int, int]]:
    """Keep the turns whose prompt plus reply fit in ``limit`` tokens (None: all)."""
    if limit is None:
        return turns
    kept, history = [], system
    for u, r in turns:
        if history + u + r > limit:
            stats.dropped_over_context += len(turns) - len(kept)
            break
        kept.append((u, r))
        history += u + r
    return kept


def _records(source: str | os.PathLike | Iterable[Mapping]) -> Iterable[Any]:
    if isinstance(source, (str, os.PathLike)):
        return iter_records(source)
    return source


@dataclass
class _Converter:
    """Per-run state of one conversion: how to count, what to share, what was seen."""

    count: Callable[[str], int]
    shared_id: str
    shared_tokens: int
    limit: int | None
    stats: ConversionStats = field(default_factory=ConversionStats)
    used_ids: set[str] = field(default_factory=set)

    def conversation(self, record: Any, index: int) -> Conversation | None:
        """One record as a conversation, or None (counted in stats) when nothing is left."""
        messages = record.get("conversations") if isinstance(record, Mapping) else None
        if not isinstance(messages, list):
            self.stats.skipped_no_turn += 1
            return None
        system_text, turns = _turns(messages, self.count, self.stats)
        if system_text:
            system_id = "sys-" + hashlib.sha256(system_text.encode("utf-8")).hexdigest()[:16]
            system_tokens = self.count(system_text)
        else:
            system_id, system_tokens = self.shared_id, self.shared_tokens
        if not turns:
            self.stats.skipped_no_turn += 1
            return None
        turns = _fit(system_tokens, turns, self.limit, self.stats)
        if not turns:
            self.stats.skipped_too_long += 1
            return None
        cid = self.unique_id(str(record.get("id") or f"sharegpt-{index}"))
        return Conversation(cid, system_id, system_tokens, tuple(Turn(u, r) for u, r in turns))

    def unique_id(self, cid: str) -> str:
        """``cid``, or ``cid~2``, ``cid~3``... when already used (ids key the trace table)."""
        candidate, n = cid, 1
        while candidate in self.used_ids:
            n += 1
            candidate = f"{cid}~{n}"
        self.used_ids.add(candidate)
        return candidate


def convert_sharegpt(
    path_or_records: str | os.PathLike | Iterable[Mapping],
    *,
    tokenizer: Tokenizer | None = None,
    tokens_per_word: float = TOKENS_PER_WORD,
    max_conversations: int | None = None,
    mode: Mode = "open",
    rate_per_s: float = 2.0,
    concurrency: int | None = None,
    seed: int = 0,
    system_tokens: int = 0,
    max_context_tokens: int | None = None,
    name: str = "sharegpt",
    progress: bool | None = None,
) -> Trace:
    """Convert ShareGPT-format conversations (a file path or the parsed records) to a trace.

    Conversations keep file order; ``max_conversations`` stops after that many are
    kept. ``mode="open"``: Poisson arrivals at ``rate_per_s`` drawn from ``seed``;
    ``mode="closed"``: ``concurrency`` chats at once. ``system_tokens`` > 0 gives
    conversations without a system message of their own one shared system prompt of
    that size. ``max_context_tokens`` drops turns whose prompt plus reply would not fit
    (a conversation whose first turn does not fit is skipped). The tokenizer, or the
    ratio used in its place, is named in ``meta["tokenizer"]``.
    """
    params = {
        "max_conversations": max_conversations, "mode": mode,
        "rate_per_s": rate_per_s if mode == "open" else None, "concurrency": concurrency,
        "system_tokens": system_tokens, "max_context_tokens": max_context_tokens,
    }
    _check_args(params, tokens_per_word, seed)
    from_file = isinstance(path_or_records, (str, os.PathLike))
    source = Path(path_or_records).name if from_file else "records"
    shared_id = f"{name}-system" if system_tokens else ""
    counter = _counter(tokenizer, tokens_per_word)
    conv = _Converter(counter, shared_id, system_tokens, max_context_tokens)
    convs: list[Conversation] = []
    bar = tqdm(desc=f"converting {source}", unit=" conv", disable=not progress_enabled(progress))
    with bar:
        for index, record in enumerate(_records(path_or_records)):
            if max_conversations is not None and len(convs) >= max_conversations:
                break
            conv.stats.records += 1
            bar.update()
            if (c := conv.conversation(record, index)) is not None:
                convs.append(c)
    if not convs:
        raise ValueError(f"no conversation with a complete turn in {source}")
    if mode == "open":
        arrivals = _poisson_arrivals(np.random.default_rng(seed), len(convs), rate_per_s)
        convs = [replace(c, arrival_s=a) for c, a in zip(convs, arrivals)]
    elif concurrency > len(convs):
        raise ValueError(f"concurrency={concurrency} exceeds the {len(convs)} conversations kept")
    stats = conv.stats
    stats.conversations, stats.turns = len(convs), sum(len(c.turns) for c in convs)
    meta = {
        "generator": "sharegpt",
        "source": source,
        "tokenizer": describe_tokenizer(tokenizer, tokens_per_word),
        "tokens_per_word": None if tokenizer is not None else tokens_per_word,
        "seed": seed,
        "params": params,
        "stats": _stats_dict(stats),
    }
    log.info("converted %d conversations (%d turns) from %s; %s",
             stats.conversations, stats.turns, source, meta["tokenizer"])
    closed_concurrency = concurrency if mode == "closed" else None
    return Trace(name, mode, tuple(convs), closed_concurrency, meta).validate()


def _is_count(x: Any, minimum: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def _check_args(p: dict[str, Any], tokens_per_word: Any, seed: Any) -> None:
    """Fail before reading a 673 MB file, naming the bad argument."""
    mode, rate = p["mode"], p["rate_per_s"]
    if mode not in ("open", "closed"):
        raise ValueError(f"mode must be 'open' or 'closed', got {mode!r}")
    if mode == "open" and not (isinstance(rate, (int, float)) and 0 < rate < math.inf):
        raise ValueError(f"rate_per_s must be a finite number > 0, got {rate!r}")
    if mode == "closed" and not _is_count(p["concurrency"], 1):
        raise ValueError(f"mode='closed' needs concurrency >= 1, got {p['concurrency']!r}")
    if mode == "open" and p["concurrency"] is not None:
        raise ValueError("concurrency applies to mode='closed' only")
    for key in ("max_conversations", "max_context_tokens"):
        if p[key] is not None and not _is_count(p[key], 1):
            raise ValueError(f"{key} must be None or an integer >= 1, got {p[key]!r}")
    if not (isinstance(tokens_per_word, (int, float)) and 0 < tokens_per_word < math.inf):
        raise ValueError(f"tokens_per_word must be a finite number > 0, got {tokens_per_word!r}")
    if not _is_count(p["system_tokens"], 0):
        raise ValueError(f"system_tokens must be an integer >= 0, got {p['system_tokens']!r}")
    if not _is_count(seed, 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def _stats_dict(stats: ConversionStats) -> dict[str, Any]:
    out = dict(vars(stats))
    out["unknown_roles"] = dict(sorted(stats.unknown_roles.items()))
    return out


def describe_tokenizer(
    tokenizer: Tokenizer | None, tokens_per_word: float = TOKENS_PER_WORD
) -> str:
    """How token counts were made, for ``meta["tokenizer"]``."""
    if tokenizer is None:
        return f"none: {tokens_per_word:.3f} tokens/word ratio"
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    return f"tokenizer: {name}"


# --- download -------------------------------------------------------------------------


class DownloadError(RuntimeError):
    """A download failed; the message names the URL and what went wrong."""


class ChecksumMismatch(DownloadError):
    """The downloaded bytes do not have the expected SHA-256 digest."""


def progress_enabled(progress: bool | None) -> bool:
    """``None`` (auto): on only for a terminal and outside CI; True/False force it."""
    if progress is not None:
        return progress
    return sys.stderr.isatty() and not os.environ.get("CI")


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _present(dest: Path, sha256: str | None, size: int | None) -> bool:
    """True when ``dest`` already holds the expected file (so no download is needed)."""
    if not dest.is_file():
        return False
    if size is not None and dest.stat().st_size != size:
        log.warning("%s has %d bytes, expected %d: downloading again",
                    dest, dest.stat().st_size, size)
        return False
    if sha256 is not None and sha256_file(dest) != sha256:
        log.warning("%s does not have SHA-256 %s: downloading again", dest, sha256)
        return False
    return True


def download(
    url: str,
    dest: str | os.PathLike,
    *,
    sha256: str | None = None,
    size: int | None = None,
    chunk_size: int = 1 << 20,
    progress: bool | None = None,
    timeout_s: float = 60.0,
) -> Path:
    """Download ``url`` to ``dest`` atomically, verifying ``size`` and ``sha256`` when given.

    Skips the download when ``dest`` exists and matches what is given (a file there
    with nothing to check is taken as complete: this function never leaves a partial
    one). Bytes stream to a temp file in ``dest``'s folder, renamed onto ``dest`` only
    when complete and verified; on any failure the temp file is removed.
    """
    dest = Path(dest)
    sha256 = sha256.lower() if sha256 else None
    if _present(dest, sha256, size):
        log.info("%s already present: not downloading %s", dest, url)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            received, digest = _fetch(url, out, chunk_size, progress, timeout_s)
            out.flush()
            os.fsync(out.fileno())
        _verify(url, received, digest, sha256, size)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("downloaded %s to %s (%d bytes)", url, dest, received)
    return dest


def _fetch(
    url: str, out: BinaryIO, chunk_size: int, progress: bool | None, timeout_s: float
) -> tuple[int, str]:
    """Stream ``url`` into ``out``; returns (bytes received, SHA-256 hex digest)."""
    request = urllib.request.Request(url, headers={"User-Agent": "kvroute"})
    try:
        response = urllib.request.build_opener().open(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"download of {url} failed: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise DownloadError(f"download of {url} failed: {getattr(exc, 'reason', exc)}") from exc
    digest, received = hashlib.sha256(), 0
    with response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        bar = tqdm(total=total, desc=Path(url).name or url, unit="B", unit_scale=True,
                   unit_divisor=1024, disable=not progress_enabled(progress))
        with bar:
            try:
                while chunk := response.read(chunk_size):
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
            except (OSError, http.client.HTTPException) as exc:
                raise DownloadError(
                    f"download of {url} failed after {received} bytes: {exc!r}"
                ) from exc
    if total is not None and received != total:
        raise DownloadError(f"download of {url} was cut short: {received} of {total} bytes")
    return received, digest.hexdigest()


def _verify(url: str, received: int, digest: str, sha256: str | None, size: int | None) -> None:
    if size is not None and received != size:
        raise DownloadError(f"download of {url}: expected {size} bytes, got {received}")
    if sha256 is not None and digest != sha256:
        raise ChecksumMismatch(
            f"download of {url}: SHA-256 mismatch: expected {sha256}, got {digest}"
        )


def download_sharegpt(dest_dir: str | os.PathLike, *, progress: bool | None = None) -> Path:
    """Fetch the ShareGPT file into ``dest_dir`` (size-checked; digest-checked when known)."""
    return download(SHAREGPT_URL, Path(dest_dir) / SHAREGPT_FILENAME, sha256=SHAREGPT_SHA256,
                    size=SHAREGPT_SIZE, progress=progress)
