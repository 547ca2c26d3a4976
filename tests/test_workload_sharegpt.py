"""ShareGPT conversion (role rules, token counts, arrivals) and the atomic downloader.

The downloader is exercised against a real ``http.server`` on 127.0.0.1 serving files
this test writes; nothing else is contacted.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvroute.workload import (
    SHAREGPT_SIZE,
    SHAREGPT_URL,
    ChecksumMismatch,
    DownloadError,
    Turn,
    convert_sharegpt,
    download,
    iter_records,
)
from kvroute.workload import sharegpt as sg


def msg(role: str, words: int) -> dict:
    return {"from": role, "value": " ".join(["w"] * words)}


# 3 words -> 4 tokens, 6 -> 8, 9 -> 12, 150 -> 200 at 4/3 tokens per word.
RECORDS = [
    {"id": "plain",
     "conversations": [msg("human", 3), msg("gpt", 6), msg("human", 9), msg("gpt", 3)]},
    {"id": "system", "conversations": [msg("system", 150), msg("human", 3), msg("gpt", 3)]},
    {"id": "system-twin", "conversations": [msg("system", 150), msg("human", 6), msg("gpt", 6)]},
    {"id": "irregular", "conversations": [
        msg("gpt", 9),                   # answers nothing: dropped
        msg("human", 3), msg("user", 3),  # two user messages: one turn, 8 tokens
        msg("gpt", 3), msg("chatgpt", 6),  # two replies: one reply, 12 tokens
        msg("system", 3),                # mid-conversation system: part of the next message
        msg("human", 6), msg("bing", 9),
        msg("tool", 3),                  # unknown role: dropped
        msg("human", 9),                 # no reply: dropped
    ]},
    {"id": "only-question", "conversations": [msg("human", 3)]},
    {"id": "empty", "conversations": []},
    {"id": "broken"},
    {"conversations": [msg("human", 3), {"from": "gpt", "value": ""}]},  # no id; empty reply
    {"id": "plain", "conversations": [msg("human", 6), msg("gpt", 6)]},  # repeated id
]


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(RECORDS, indent=1), encoding="utf-8")
    return path


def by_id(trace) -> dict:
    return {c.id: c for c in trace.conversations}


def test_converter_role_rules(sharegpt_file: Path) -> None:
    trace = convert_sharegpt(sharegpt_file, seed=1)
    convs = by_id(trace)
    assert list(convs) == ["plain", "system", "system-twin", "irregular", "sharegpt-7", "plain~2"]
    assert convs["plain"].turns == (Turn(4, 8), Turn(12, 4))
    assert convs["plain"].system_tokens == 0
    assert convs["system"].system_tokens == 200
    assert convs["system"].system_id == convs["system-twin"].system_id != ""  # same text, same id
    assert convs["irregular"].turns == (Turn(8, 12), Turn(4 + 8, 12))
    assert convs["sharegpt-7"].turns == (Turn(4, 1),)  # an empty reply still has a first token
    stats = trace.meta["stats"]
    assert stats["records"] == 9 and stats["conversations"] == 6 and stats["turns"] == 8
    assert stats["skipped_no_turn"] == 3  # only-question, empty, broken
    assert stats["dropped_leading_assistant"] == 1
    assert stats["dropped_trailing_user"] == 2
    assert stats["unknown_roles"] == {"tool": 1}


def test_converter_meta_names_the_token_counting(sharegpt_file: Path) -> None:
    trace = convert_sharegpt(sharegpt_file)
    assert trace.meta["tokenizer"] == "none: 1.333 tokens/word ratio"
    assert trace.meta["tokens_per_word"] == pytest.approx(4 / 3)
    assert trace.meta["source"] == "sharegpt.json"
    ones = convert_sharegpt(sharegpt_file, tokens_per_word=1.0)
    assert by_id(ones)["plain"].turns[0] == Turn(3, 6)
    assert ones.meta["tokenizer"] == "none: 1.000 tokens/word ratio"


class CharTokenizer:
    """Test double for a Hugging Face tokenizer: one token per character."""

    name_or_path = "chars"

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]


def test_converter_uses_a_tokenizer_when_given() -> None:
    messages = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi!"}]
    records = [{"id": "x", "conversations": messages}]
    trace = convert_sharegpt(records, tokenizer=CharTokenizer())
    assert trace.conversations[0].turns == (Turn(5, 3),)
    assert trace.meta["tokenizer"] == "tokenizer: chars"
    assert trace.meta["tokens_per_word"] is None


def test_records_and_file_give_the_same_trace(sharegpt_file: Path) -> None:
    from_file = convert_sharegpt(sharegpt_file, seed=3)
    from_records = convert_sharegpt(RECORDS, seed=3)
    assert from_file.conversations == from_records.conversations
    assert from_records.meta["source"] == "records"


def test_open_loop_arrivals_are_seeded(sharegpt_file: Path) -> None:
    a, b, c = (convert_sharegpt(sharegpt_file, seed=s, rate_per_s=4.0) for s in (1, 1, 2))
    arrivals = [x.arrival_s for x in a.conversations]
    assert a == b and arrivals != [x.arrival_s for x in c.conversations]
    assert a.mode == "open" and a.concurrency is None
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_closed_loop_and_max_conversations(sharegpt_file: Path) -> None:
    trace = convert_sharegpt(sharegpt_file, mode="closed", concurrency=2, max_conversations=3)
    assert trace.mode == "closed" and trace.concurrency == 2
    assert [c.id for c in trace.conversations] == ["plain", "system", "system-twin"]
    assert all(c.arrival_s == 0.0 for c in trace.conversations)
    with pytest.raises(ValueError, match="concurrency"):
        convert_sharegpt(sharegpt_file, mode="closed")
    with pytest.raises(ValueError, match="exceeds"):
        convert_sharegpt(sharegpt_file, mode="closed", concurrency=50)


def test_shared_system_prompt_for_conversations_without_one(sharegpt_file: Path) -> None:
    convs = by_id(convert_sharegpt(sharegpt_file, system_tokens=500))
    assert convs["plain"].system_tokens == 500 and convs["plain"].system_id == "sharegpt-system"
    assert convs["irregular"].system_id == "sharegpt-system"
    assert convs["system"].system_tokens == 200  # its own system message wins


def test_context_limit_drops_turns_that_do_not_fit(sharegpt_file: Path) -> None:
    trace = convert_sharegpt(sharegpt_file, max_context_tokens=20)
    convs = by_id(trace)
    assert convs["plain"].turns == (Turn(4, 8),)  # 12 + 12 + 4 would be 28 > 20
    assert "system" not in convs  # a 200-token system prompt leaves no room
    assert trace.meta["stats"]["skipped_too_long"] == 2
    assert trace.meta["stats"]["dropped_over_context"] >= 1


def test_nothing_convertible_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "none.json"
    path.write_text(json.dumps([{"id": "q", "conversations": [msg("human", 2)]}]))
    with pytest.raises(ValueError, match="no conversation with a complete turn"):
        convert_sharegpt(path)


def test_stream_reader_across_chunk_boundaries(sharegpt_file: Path, monkeypatch) -> None:
    monkeypatch.setattr(sg, "_READ_CHUNK", 7)
    assert list(iter_records(sharegpt_file)) == RECORDS


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"id": 1}', "JSON list"),
        ('[{"id": 1}, {"id": ', "malformed"),
        ('[{"id": 1} {"id": 2}]', "','"),
        ('[{"id": 1},', "malformed"),
    ],
)
def test_stream_reader_rejects_bad_files(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        list(iter_records(path))


def test_stream_reader_reads_an_empty_list(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(" [ ] ")
    assert list(iter_records(path)) == []


# --- download -------------------------------------------------------------------------


def test_dataset_constants() -> None:
    assert SHAREGPT_URL == (
        "https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered/"
        "resolve/main/ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    assert SHAREGPT_SIZE == 672_837_942


class Handler(SimpleHTTPRequestHandler):
    """Serves the test's folder; ``/truncated`` promises more bytes than it sends."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.requests.append(self.path)
        if self.path == "/truncated":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"only ten b")
            return
        super().do_GET()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def no_proxy(monkeypatch) -> None:
    """Keep urllib from sending 127.0.0.1 requests through a proxy from the environment."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def server(tmp_path: Path, no_proxy) -> Iterator[tuple[str, Path, list]]:
    root = tmp_path / "served"
    root.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    httpd.requests = []
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root, httpd.requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


PAYLOAD = bytes(range(256)) * 4099  # ~1 MB: several chunks
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()


def only(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_download_success(server, tmp_path: Path) -> None:
    url, root, requests = server
    (root / "data.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "out" / "data.bin"
    got = download(f"{url}/data.bin", dest, sha256=DIGEST.upper(), size=len(PAYLOAD),
                   chunk_size=65536, progress=False)
    assert got == dest and dest.read_bytes() == PAYLOAD
    assert only(dest.parent) == ["data.bin"]
    assert requests == ["/data.bin"]


def test_checksum_mismatch_leaves_nothing(server, tmp_path: Path) -> None:
    url, root, _ = server
    (root / "data.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "out" / "data.bin"
    with pytest.raises(ChecksumMismatch) as info:
        download(f"{url}/data.bin", dest, sha256="0" * 64, progress=False)
    assert "0" * 64 in str(info.value) and DIGEST in str(info.value)
    assert only(dest.parent) == []


def test_size_mismatch_leaves_nothing(server, tmp_path: Path) -> None:
    url, root, _ = server
    (root / "data.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "data.bin"
    with pytest.raises(DownloadError, match=f"expected 5 bytes, got {len(PAYLOAD)}"):
        download(f"{url}/data.bin", dest, size=5, progress=False)
    assert not dest.exists()


def test_http_error_names_url_and_status(server, tmp_path: Path) -> None:
    url, _, _ = server
    dest = tmp_path / "missing.bin"
    with pytest.raises(DownloadError, match=rf"{url}/missing.bin.*HTTP 404"):
        download(f"{url}/missing.bin", dest, progress=False)
    assert only(tmp_path) == ["served"]


def test_cut_short_download_leaves_nothing(server, tmp_path: Path) -> None:
    url, _, _ = server
    dest = tmp_path / "out" / "t.bin"
    with pytest.raises(DownloadError, match="truncated|cut short|failed after"):
        download(f"{url}/truncated", dest, progress=False)
    assert only(dest.parent) == []


def test_refused_connection_names_url(tmp_path: Path, no_proxy) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as closed:  # bind a port, then free it
        port = closed.server_address[1]
    with pytest.raises(DownloadError, match=f"127.0.0.1:{port}/x"):
        download(f"http://127.0.0.1:{port}/x", tmp_path / "x", progress=False, timeout_s=5)


def test_present_file_with_right_checksum_is_not_downloaded_again(server, tmp_path: Path) -> None:
    url, root, requests = server
    (root / "data.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "data.bin"
    dest.write_bytes(PAYLOAD)
    got = download(f"{url}/data.bin", dest, sha256=DIGEST, size=len(PAYLOAD), progress=False)
    assert got == dest
    assert requests == []


def test_present_file_with_wrong_checksum_is_replaced(server, tmp_path: Path) -> None:
    url, root, requests = server
    (root / "data.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "data.bin"
    dest.write_bytes(b"stale")
    download(f"{url}/data.bin", dest, sha256=DIGEST, progress=False)
    assert dest.read_bytes() == PAYLOAD and requests == ["/data.bin"]


def test_progress_auto_is_off_in_ci_and_off_a_terminal(monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert sg.progress_enabled(None) is False
    monkeypatch.delenv("CI")
    monkeypatch.setattr(sg.sys.stderr, "isatty", lambda: False, raising=False)
    assert sg.progress_enabled(None) is False
    assert sg.progress_enabled(True) is True
