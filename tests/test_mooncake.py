"""Mooncake's FAST'25 traces: checksums, fetching, session inference, and what the
simulator makes of their prefix structure.

The download path runs against a real ``http.server`` on 127.0.0.1 serving a file this
test writes; nothing else is contacted (``offline`` runs, and a closed port, show the
fallback to the project's copy).

The two simulator checks compare against models written from ``hash_ids`` alone, with
one request in the engine at a time (arrivals far apart):

* unbounded cache, engine block ``bs`` dividing 512: request ``i`` hits exactly
  ``floor(min(bound_i, P_i - 1) / bs) * bs`` tokens, ``bound_i`` the longest token
  prefix it shares with any earlier prompt. Exact, because every block of an earlier
  prompt stays cached, equal token content hashes equal (equal leading ids, and a
  partial block being a prefix of its id's content), and the engine serves whole
  blocks and recomputes the last prompt token (vLLM's rules);
* bounded caches, engine block 512 (one engine block per id): hits equal a plain LRU
  over the blocks, exactly. The LRU holds ``num_blocks`` slots, least recently used
  first; a request touches its cached leading run, takes a slot for each other block
  it holds (its other prompt blocks; its partial last block and its reply's blocks,
  which no later request can match), evicting from the LRU end, and gives them back
  last block first (so a prefix outlives its suffix, as vLLM frees). With no prompt a
  multiple of 512 tokens (checked), the recomputed last token never costs a cached
  block, so no block is held twice and nothing else differs.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
from collections import OrderedDict
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.experiment import ExperimentError, load_experiment
from kvroute.hardware import load_hardware
from kvroute.policies import POLICY_NAMES, make_policy
from kvroute.sim.cluster import SimCluster
from kvroute.sim.run import DRAWN_FOR
from kvroute.workload import ChecksumMismatch, load_dataset, read_trace, write_trace
from kvroute.workload import mooncake as mc
from kvroute.workload.mooncake import Request
from test_workload_sharegpt import Handler, no_proxy, server  # noqa: F401 (the 127.0.0.1 server fixtures)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def requests() -> dict[str, list[Request]]:
    return {name: mc.read_requests(name) for name in mc.TRACES}


# --- the files ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(mc.TRACES))
def test_both_traces_convert_verified(requests, name):
    tf = mc.TRACES[name]
    copy = mc.copy_path(name)
    assert copy == ROOT / "data/mooncake" / f"{name}_trace.jsonl.gz"
    assert mc.sha256_file(copy) == tf.gz_sha256
    raw = mc.verified_bytes(name, copy)
    assert len(raw) == tf.size
    reqs = requests[name]
    assert len(reqs) == tf.requests
    trace = mc.mooncake_trace(name)
    assert trace.mode == "replay" and trace.block_tokens == 512
    assert trace.num_requests == tf.requests
    assert trace.meta["source"]["sha256"] == tf.sha256
    turns = sorted((t for c in trace.conversations for t in c.turns), key=lambda t: t.arrival_s)
    assert [t.user_tokens for t in turns][:50] == [r.input_length for r in reqs][:50]
    assert sum(t.user_tokens for t in turns) == sum(r.input_length for r in reqs)
    assert sum(t.output_tokens for t in turns) == sum(r.output_length for r in reqs)
    assert sorted(t.hash_ids for t in turns) == sorted(r.hash_ids for r in reqs)
    assert turns[-1].arrival_s == reqs[-1].timestamp_ms / 1000


def test_readme_and_licence_travel_with_the_copy():
    readme = (ROOT / "data/mooncake/README.md").read_text()
    for tf in mc.TRACES.values():
        assert tf.sha256 in readme and tf.gz_sha256 in readme and tf.url in readme
    assert mc.COMMIT in readme
    assert "Apache License" in (ROOT / "data/mooncake/LICENSE-APACHE").read_text()


def test_corrupted_copy_is_rejected_naming_the_checksum(tmp_path):
    good = mc.copy_path("synthetic").read_bytes()
    bad = tmp_path / "synthetic_trace.jsonl.gz"
    bad.write_bytes(good[:-9] + bytes([good[-9] ^ 1]) + good[-8:])
    with pytest.raises(ChecksumMismatch, match=f"expected {mc.TRACES['synthetic'].gz_sha256}"):
        mc.read_requests("synthetic", bad)
    # the same content gzipped again is not the copy either (both digests are checked) ...
    regz = tmp_path / "regz" / "synthetic_trace.jsonl.gz"
    regz.parent.mkdir()
    regz.write_bytes(gzip.compress(gzip.decompress(good), compresslevel=1))
    with pytest.raises(ChecksumMismatch, match="gzipped copy"):
        mc.read_requests("synthetic", regz)
    # ... and an edited original is refused by the original's digest
    plain = tmp_path / "synthetic_trace.jsonl"
    plain.write_bytes(gzip.decompress(good).replace(b'"output_length": 1', b'"output_length": 2', 1))
    with pytest.raises(ChecksumMismatch, match=f"expected {mc.TRACES['synthetic'].sha256}"):
        mc.read_requests("synthetic", plain)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]}', "expected ceil"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [0, 1]}', "output_length"),
        ('{"timestamp": 0, "input_length": 600, "hash_ids": [0, 1]}', "missing"),
        ('{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, "a"]}', "hash_ids"),
        ("[1, 2]", "object"),
    ],
)
def test_bad_lines_are_named(line, fragment):
    with pytest.raises(ValueError, match=fragment):
        mc.parse_requests('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n' + line, "f")
    with pytest.raises(ValueError, match="f line 2"):
        mc.parse_requests('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n' + line, "f")


# --- fetching -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def online(monkeypatch) -> None:
    monkeypatch.delenv(mc.OFFLINE_ENV, raising=False)


def original(name: str) -> bytes:
    return gzip.decompress(mc.copy_path(name).read_bytes())


def test_fetch_downloads_from_the_original_location(server, tmp_path):
    base, root, seen = server
    (root / "synthetic_trace.jsonl").write_bytes(original("synthetic"))
    got = mc.fetch("synthetic", tmp_path / "out", url=f"{base}/synthetic_trace.jsonl", timeout_s=5)
    assert got.source == "download" and got.detail.endswith("/synthetic_trace.jsonl")
    assert got.path.read_bytes() == original("synthetic") and seen == ["/synthetic_trace.jsonl"]
    again = mc.fetch("synthetic", tmp_path / "out", url=f"{base}/synthetic_trace.jsonl", timeout_s=5)
    assert again.source == "present" and seen == ["/synthetic_trace.jsonl"]  # verified, not fetched again


@pytest.mark.parametrize("served", ["missing", "changed"])
def test_fetch_falls_back_to_the_copy_when_the_original_fails(server, tmp_path, served, caplog):
    base, root, _ = server
    if served == "changed":  # upstream's bytes differ from the checksum: not used
        (root / "synthetic_trace.jsonl").write_bytes(original("synthetic")[:-100])
    got = mc.fetch("synthetic", tmp_path / "out", url=f"{base}/synthetic_trace.jsonl", timeout_s=5)
    assert got.source == "copy"
    assert ("HTTP 404" if served == "missing" else "expected 1136313 bytes") in got.detail
    assert got.path.read_bytes() == original("synthetic")
    assert "using the project's copy" in caplog.text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["synthetic_trace.jsonl"]  # no temp files


def test_fetch_offline_uses_the_copy_without_asking(server, tmp_path, monkeypatch):
    base, root, seen = server
    (root / "synthetic_trace.jsonl").write_bytes(original("synthetic"))
    monkeypatch.setenv(mc.OFFLINE_ENV, "1")
    got = mc.fetch("synthetic", tmp_path / "out", url=f"{base}/synthetic_trace.jsonl")
    assert got.source == "copy" and "offline" in got.detail and seen == []
    assert mc.read_requests("synthetic", got.path) == mc.read_requests("synthetic")


def test_fetch_with_no_network_and_a_corrupted_copy_fails_naming_the_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as closed:  # bind a port, then free it
        port = closed.server_address[1]
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b"{}\n"))
    with pytest.raises(ChecksumMismatch, match=mc.TRACES["conversation"].gz_sha256):
        mc.fetch("conversation", tmp_path / "out", url=f"http://127.0.0.1:{port}/x", timeout_s=2, copy=bad)
    assert not (tmp_path / "out" / "conversation_trace.jsonl").exists()


def test_fetch_cli_says_which_source(tmp_path):
    out = CliRunner().invoke(main, ["fetch", "mooncake", "--name", "synthetic", "--dest", str(tmp_path), "--offline"])
    assert out.exit_code == 0, out.output
    assert "SHA-256 verified; the project's copy, because offline" in out.output
    assert (tmp_path / "synthetic_trace.jsonl").read_bytes() == original("synthetic")


# --- sessions and the reuse bound -----------------------------------------------------


def req(ts: int, ids: list[int], n: int | None = None) -> Request:
    return Request(ts, n if n is not None else 512 * len(ids), 4, tuple(ids))


def sessions_by_the_rule(reqs: list[Request], common: int) -> list[int]:
    """The session rule as stated, quadratic: the earlier request sharing the most
    leading ids (more than ``common``), the most recent among equals."""
    out: list[int] = []
    for i, r in enumerate(reqs):
        best, parent = common, None
        for j in range(i - 1, -1, -1):  # most recent first: a tie keeps the later one
            n = 0
            for x, y in zip(r.hash_ids, reqs[j].hash_ids):
                if x != y:
                    break
                n += 1
            if n > best:
                best, parent = n, j
        out.append(i if parent is None else out[parent])
    return out


def test_session_rule():
    reqs = [
        req(0, [0, 1, 2]),        # 0: new
        req(1, [0, 5, 6]),        # 1: shares only the common id 0: new
        req(2, [0, 1, 2, 3]),     # 2: continues 0 (3 ids)
        req(3, [0, 1, 9]),        # 3: shares 2 ids with 0 and with 2: session 0
        req(4, [0, 5, 6, 7]),     # 4: continues 1
        req(5, [0, 8]),           # 5: new
        req(6, [0, 1, 2, 3, 4]),  # 6: continues 2 (4 ids): session 0
        req(7, [0]),              # 7: nothing beyond the common id: new
    ]
    assert mc.common_leading_blocks(reqs) == 1
    assert mc.infer_sessions(reqs) == sessions_by_the_rule(reqs, 1) == [0, 1, 0, 0, 1, 5, 0, 7]
    nothing_common = [req(0, [7, 1]), req(1, [7, 2]), req(2, [0, 3]), req(3, [7, 1, 5])]
    assert mc.common_leading_blocks(nothing_common) == 0
    assert mc.infer_sessions(nothing_common) == sessions_by_the_rule(nothing_common, 0) == [0, 0, 2, 0]
    assert mc.infer_sessions(nothing_common, common=1) == [0, 1, 2, 0]


@pytest.mark.parametrize("name", sorted(mc.TRACES))
def test_session_inference_is_the_stated_rule_on_the_traces(requests, name):
    reqs = requests[name][:800]
    common = mc.common_leading_blocks(requests[name])
    assert mc.infer_sessions(reqs, common) == sessions_by_the_rule(reqs, common)


def test_session_stats_in_meta(requests):
    trace = mc.convert(requests["conversation"], "conversation", duration_s=600)
    st = trace.meta["stats"]
    assert st["requests"] == trace.num_requests and st["sessions"] == len(trace.conversations)
    assert st["turns_per_session_max"] == max(len(c.turns) for c in trace.conversations)
    assert st["single_request_sessions"] == sum(len(c.turns) == 1 for c in trace.conversations)
    assert st["common_leading_blocks"] == 1
    assert 0 < st["session_reuse"] <= st["prefix_reuse_bound"] < 1
    assert "most leading hash ids" in trace.meta["session_rule"]


def brute_force_bound(reqs: list[Request], block: int = 512) -> list[int]:
    """Per request, max over earlier prompts of the leading tokens both have (quadratic)."""
    def tokens(r: Request) -> list[tuple[int, int]]:
        return [(h, j) for k, h in enumerate(r.hash_ids) for j in range(min(block, r.input_length - block * k))]

    toks = [tokens(r) for r in reqs]
    out = []
    for i, a in enumerate(toks):
        best = 0
        for b in toks[:i]:
            n = 0
            for x, y in zip(a, b):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        out.append(best)
    return out


def test_reuse_bound_against_brute_force():
    reqs = [req(0, [0, 1, 2], 1200), req(1, [0, 1], 700), req(2, [0, 1, 3], 1100), req(3, [0, 1], 900),
            req(4, [0, 1, 2, 4], 1600), req(5, [5], 100), req(6, [0, 1, 2], 1030), req(7, [0, 1], 1000)]
    assert mc.reused_tokens(reqs) == brute_force_bound(reqs) == [0, 700, 1024, 900, 1200, 0, 1030, 1000]


# --- windows and speed-up -------------------------------------------------------------


def test_window_speedup_and_limit(requests):
    reqs = requests["conversation"]
    trace = mc.convert(reqs, "conversation", speedup=2.0, start_s=600, duration_s=120)
    inside = [r for r in reqs if 600_000 <= r.timestamp_ms < 720_000]
    arrivals = sorted(t.arrival_s for c in trace.conversations for t in c.turns)
    assert arrivals == sorted((r.timestamp_ms / 1000 - 600) / 2 for r in inside)
    assert max(arrivals) < 60
    limited = mc.convert(reqs, "conversation", start_s=600, duration_s=120, max_requests=50)
    assert limited.num_requests == 50
    # sessions are inferred over the whole file: a window does not rename them
    ids = {c.id for c in limited.conversations}
    assert ids <= {c.id for c in mc.convert(reqs, "conversation", start_s=600, duration_s=120).conversations}
    with pytest.raises(ValueError, match="no request"):
        mc.convert(reqs, "conversation", start_s=4000)
    for bad, key in [({"speedup": 0}, "speedup"), ({"start_s": -1}, "start_s"), ({"duration_s": 0}, "duration_s"),
                     ({"max_requests": 0}, "max_requests")]:
        with pytest.raises(mc.ParameterError, match=key) as info:
            mc.convert(reqs, "conversation", **bad)
        assert info.value.key == key


# --- scaling ---------------------------------------------------------------------------


def turns_by_time(trace):
    """The turns in arrival order, ties by their ids (so the file's requests sort alike)."""
    return sorted((t for c in trace.conversations for t in c.turns), key=lambda t: (t.arrival_s, t.hash_ids))


def by_time(reqs):
    return sorted(reqs, key=lambda r: (r.timestamp_ms, r.hash_ids))


def test_token_scale_divides_every_length_and_keeps_one_id_per_block(requests):
    reqs = requests["conversation"]
    inside = by_time(r for r in reqs if r.timestamp_ms < 120_000)
    trace = mc.convert(reqs, "conversation", duration_s=120, token_scale=16)
    assert trace.block_tokens == 32 and trace.meta["block_tokens"] == 32
    turns = turns_by_time(trace)
    assert [t.hash_ids for t in turns] == [r.hash_ids for r in inside]  # validate() checked ceil(n / 32) ids each
    assert [t.user_tokens for t in turns] == [-(-r.input_length // 16) for r in inside]
    assert [t.output_tokens for t in turns] == [-(-r.output_length // 16) for r in inside]
    # the same sharing, a sixteenth of the tokens: the reuse bound barely moves (ceil rounding)
    plain = mc.convert(reqs, "conversation", duration_s=120).meta["stats"]
    assert trace.meta["stats"]["prefix_reuse_bound"] == pytest.approx(plain["prefix_reuse_bound"], abs=0.002)
    assert trace.meta["scaling"] == "tokens/16,time x1,window 0-120s"
    assert mc.convert(reqs, "conversation").meta["scaling"] == "tokens/1,time x1,window 0s-end"


def test_clipped_prompts_keep_their_leading_blocks_and_replies_are_capped(requests):
    reqs = requests["conversation"]
    inside = by_time(r for r in reqs if r.timestamp_ms < 120_000)
    trace = mc.convert(reqs, "conversation", duration_s=120, token_scale=16, max_input_tokens=1000, max_output_tokens=20)
    turns = turns_by_time(trace)
    for t, r in zip(turns, inside):
        n = -(-r.input_length // 16)
        assert t.user_tokens == min(n, 1000) and t.output_tokens == min(-(-r.output_length // 16), 20)
        assert t.hash_ids == r.hash_ids[: -(-t.user_tokens // 32)]  # a prefix of the prompt: sharing kept
    st = trace.meta["stats"]
    assert st["truncated_prompts"] == sum(-(-r.input_length // 16) > 1000 for r in inside) > 0
    assert st["clipped_replies"] == sum(-(-r.output_length // 16) > 20 for r in inside) > 0
    assert trace.meta["scaling"] == "tokens/16,input<=1000,output<=20,time x1,window 0-120s"


def test_session_fraction_keeps_whole_sessions_nested(requests):
    reqs = requests["conversation"]
    full = mc.convert(reqs, "conversation", duration_s=600)
    tenth = mc.convert(reqs, "conversation", duration_s=600, session_fraction=0.1)
    twentieth = mc.convert(reqs, "conversation", duration_s=600, session_fraction=0.05)
    whole = {c.id: c for c in full.conversations}
    assert all(c == whole[c.id] for c in tenth.conversations)  # every kept session with all its turns
    assert {c.id for c in twentieth.conversations} < {c.id for c in tenth.conversations}
    assert 0.07 < len(tenth.conversations) / len(full.conversations) < 0.13
    kept = mc.convert(reqs, "conversation", duration_s=600, session_fraction=0.1, max_requests=50)
    assert kept.num_requests == 50 and {c.id for c in kept.conversations} <= {c.id for c in tenth.conversations}
    assert kept.meta["scaling"] == "tokens/1,time x1,window 0-600s,sessions 0.1,first 50"


@pytest.mark.parametrize(("bad", "key"), [
    ({"token_scale": 3}, "token_scale"), ({"token_scale": 0}, "token_scale"), ({"token_scale": 1024}, "token_scale"),
    ({"max_input_tokens": 0}, "max_input_tokens"), ({"max_output_tokens": 1.5}, "max_output_tokens"),
    ({"session_fraction": 0}, "session_fraction"), ({"session_fraction": 1.5}, "session_fraction"),
])
def test_bad_scale_parameters_are_named(requests, tmp_path, bad, key):
    with pytest.raises(mc.ParameterError, match=key) as info:
        mc.convert(requests["synthetic"], "synthetic", **bad)
    assert info.value.key == key
    with pytest.raises(ExperimentError, match=rf"key workload\.params\.{key}: "):
        load_experiment(experiment(tmp_path, {"name": "synthetic", **bad}))


def test_the_cpu_replay_experiment_fits_the_cpu_engines_and_simulates_labelled(tmp_path):
    """config/experiments/mooncake-cpu.yaml: what `kvroute measure --hardware cpu` replays
    live, and the simulator replays the same scaled trace, every record labelled."""
    from kvroute.live.engines import CPU_MAX_MODEL_LEN
    from kvroute.sim.run import load_trace, simulate_experiment

    exp = load_experiment(ROOT / "config/experiments/mooncake-cpu.yaml")
    assert exp.view == "approx" and [(r.hardware, r.policy) for r in exp.expand()] == [
        ("cpu", "kv_aware"), ("cpu", "round_robin")]
    trace = load_trace(exp, 0)
    turns = [t for c in trace.conversations for t in c.turns]
    assert max(t.user_tokens + t.output_tokens for t in turns) <= CPU_MAX_MODEL_LEN
    assert 100 <= len(turns) <= 300 and max(t.arrival_s for t in turns) <= 120  # one replay in about 1-2 minutes
    assert trace.meta["stats"]["session_reuse"] > 0.2  # the sessions' reuse survives the scaling
    label = trace.meta["scaling"]
    assert label.startswith("tokens/16,") and "sessions 0.1" in label
    summary = simulate_experiment(exp, tmp_path / "sim")
    df = pd.read_parquet(tmp_path / "sim/requests.parquet")
    assert (df.scaling == label).all() and len(df) == 2 * len(turns)
    assert (summary.scaling == label).all()


def test_converted_trace_round_trips_through_parquet(tmp_path, requests):
    trace = mc.convert(requests["synthetic"], "synthetic", duration_s=60)
    assert read_trace(write_trace(trace, tmp_path / "t.parquet")) == trace


# --- experiments and the command line -------------------------------------------------


def experiment(tmp_path: Path, params: dict, policies=("round_robin", "kv_aware")) -> Path:
    raw = {"name": "mc", "workload": {"dataset": "mooncake", "params": params},
           "runs": [{"hardware": "h100x8", "policies": list(policies)}]}
    path = tmp_path / "mc.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_experiment_names_bad_dataset_params(tmp_path):
    with pytest.raises(ExperimentError, match=r"key workload\.params\.speedup: speedup must be"):
        load_experiment(experiment(tmp_path, {"speedup": -1}))
    with pytest.raises(ExperimentError, match=r"key workload\.params\.colour: unknown parameter"):
        load_experiment(experiment(tmp_path, {"colour": 1}))
    with pytest.raises(ExperimentError, match=r"key workload\.params\.name: .*conversation"):
        load_experiment(experiment(tmp_path, {"name": "toolagent"}))


def test_workload_and_simulate_cli(tmp_path):
    exp = experiment(tmp_path, {"name": "synthetic", "duration_s": 20, "speedup": 2.0})
    fetched = mc.fetch("synthetic", tmp_path / "data", offline=True).path
    runner = CliRunner()
    out = runner.invoke(main, ["workload", str(exp), "--round", "0", "--out", str(tmp_path / "w.parquet"),
                               "--dataset", str(fetched)])
    assert out.exit_code == 0, out.output
    trace = read_trace(tmp_path / "w.parquet")
    assert trace.meta.pop(DRAWN_FOR)["round"] == 0  # which round the workflow drew it for
    assert trace == load_dataset("mooncake", None, name="synthetic", duration_s=20, speedup=2.0)
    out = runner.invoke(main, ["simulate", str(exp), "--trace", str(tmp_path / "w.parquet"), "--out", str(tmp_path / "s")])
    assert out.exit_code == 0, out.output
    assert "kv_aware" in out.output and "round_robin" in out.output
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(fetched.read_bytes()[:-1])
    out = runner.invoke(main, ["workload", str(exp), "--round", "0", "--out", str(tmp_path / "x.parquet"), "--dataset", str(bad)])
    assert out.exit_code != 0 and "SHA-256 mismatch" in out.output


# --- the simulator --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(mc.TRACES))
def test_every_policy_runs_on_a_sample(name):
    trace = mc.convert(multi_turn(name, sessions=12), name, speedup=20.0)  # sessions of 3+ turns, 20x as dense
    hw = load_hardware("h100x8")
    sessions = {c.id for c in trace.conversations if len(c.turns) > 1}
    assert sessions  # the window has multi-turn sessions for the affinity policies
    for name_ in POLICY_NAMES:
        policy = make_policy(name_, np.random.default_rng(0))
        rows = SimCluster(trace, hw, policy, np.random.default_rng(1), policy.default_exact).run()
        assert len(rows) == trace.num_requests, name_
        assert all(r["cached_tokens"] <= r["prompt_tokens"] for r in rows)
        if name_ == "sticky":
            workers: dict[str, set] = {}
            for r in rows:
                workers.setdefault(r["conversation"], set()).add(r["worker"])
            assert all(len(w) == 1 for w in workers.values())


def multi_turn(name: str, sessions: int, first: int = 2000) -> list[Request]:
    """The requests of the first ``sessions`` sessions with 3+ requests among the file's
    first ``first`` requests: a small sample with much reuse."""
    reqs = mc.read_requests(name)[:first]
    session = mc.infer_sessions(reqs)
    sizes: dict[int, int] = {}
    for s in session:
        sizes[s] = sizes.get(s, 0) + 1
    keep = set([s for s in dict.fromkeys(session) if sizes[s] >= 3][:sessions])
    return [r for r, s in zip(reqs, session) if s in keep]


def spaced(reqs: list[Request], name: str, gap_s: float = 1000.0):
    """The requests as a trace, the i-th of the file arriving at i * gap_s (one in the
    engine at a time), and (conversation, turn) -> i."""
    trace = mc.convert(reqs, name)
    index: dict[tuple[str, int], int] = {}
    for i, s in enumerate(mc.infer_sessions(reqs)):  # the converter's sessions: turns in file order
        cid = f"mooncake-{name}-{s:05d}"
        index[(cid, sum(1 for c, _ in index if c == cid))] = i
    convs = tuple(
        dataclasses.replace(c, arrival_s=index[(c.id, 0)] * gap_s, turns=tuple(
            dataclasses.replace(t, arrival_s=index[(c.id, k)] * gap_s) for k, t in enumerate(c.turns)))
        for c in trace.conversations
    )
    for c in convs:  # the same requests, in the same order
        for k, t in enumerate(c.turns):
            assert t.hash_ids == reqs[index[(c.id, k)]].hash_ids
    return dataclasses.replace(trace, conversations=convs).validate(), index


def one_worker(block_size: int, num_blocks: int):
    hw = load_hardware("h100x8")
    kv = num_blocks * hw.model.kv_bytes_per_token * block_size
    hw = dataclasses.replace(hw, workers=1, engine=dataclasses.replace(hw.engine, block_size=block_size), kv_cache_bytes=kv)
    assert hw.num_blocks == num_blocks
    return hw


def hits(trace, hw, index) -> list[int]:
    rows = SimCluster(trace, hw, make_policy("round_robin", np.random.default_rng(0)), np.random.default_rng(1), True).run()
    out = [0] * len(rows)
    for r in rows:
        assert r["preemptions"] == 0
        out[index[(r["conversation"], r["turn"])]] = r["cached_tokens"]
    return out


def blocks_held(r: Request, bs: int) -> int:
    return -(-(r.input_length + r.output_length - 1) // bs)  # prompt + reply, minus the last token's KV


@pytest.mark.parametrize(("name", "bs"), [("conversation", 16), ("synthetic", 16), ("conversation", 512)])
def test_one_worker_unbounded_cache_reaches_the_traces_bound(name, bs):
    reqs = multi_turn(name, sessions=8)
    trace, index = spaced(reqs, name)
    bound = mc.reused_tokens(reqs)
    assert sum(bound) > 0.3 * sum(r.input_length for r in reqs)  # a sample with much reuse
    hw = one_worker(bs, sum(blocks_held(r, bs) for r in reqs))  # room for every block: nothing evicted
    got = hits(trace, hw, index)
    expected = [min(b, r.input_length - 1) // bs * bs for b, r in zip(bound, reqs)]
    assert got == expected
    # so the hit rate is the trace's bound up to under one engine block per request
    total = sum(r.input_length for r in reqs)
    assert 0 <= sum(bound) - sum(got) < bs * len(reqs)
    assert sum(got) / total == pytest.approx(sum(bound) / total, abs=bs * len(reqs) / total)


def lru_hits(reqs: list[Request], num_blocks: int, bs: int = 512) -> list[int]:
    """Hit tokens of each request, one at a time, under a plain LRU of ``num_blocks`` block slots."""
    lru: OrderedDict = OrderedDict((("never used", s), None) for s in range(num_blocks))  # LRU end first
    out = []
    for i, r in enumerate(reqs):
        keys = [r.hash_ids[: j + 1] for j in range(r.input_length // bs)]  # the full prompt blocks
        hit = 0
        while hit < len(keys) and keys[hit] in lru:
            hit += 1
        out.append(hit * bs)
        for k in keys[:hit]:  # held by the request: not evictable
            del lru[k]
        held = blocks_held(r, bs)
        for _ in range(held - hit):  # the request's other blocks take slots from the LRU end
            lru.popitem(last=False)
        dead = [("dead", i, j) for j in range(held - len(keys))]  # partial last prompt block, reply blocks
        for k in [*keys, *dead][::-1]:  # given back last block first
            lru[k] = None
    return out


def test_smaller_caches_give_what_an_lru_over_the_same_blocks_gives():
    reqs = multi_turn("conversation", sessions=10)
    assert not any(r.input_length % 512 == 0 for r in reqs)  # see the module docstring
    trace, index = spaced(reqs, "conversation")
    need = max(blocks_held(r, 512) for r in reqs)
    total = sum(blocks_held(r, 512) for r in reqs)
    unbounded = lru_hits(reqs, total)
    rates = []
    for size in (need, need + total // 8, need + total // 3, total):
        want = lru_hits(reqs, size)
        assert hits(trace, one_worker(512, size), index) == want, size
        rates.append(sum(want))
    assert rates[0] < rates[1] < rates[-1] == sum(unbounded)  # eviction matters here, and less with more room


def test_speedup_as_a_load_axis(tmp_path):
    raw = {"name": "mc-load", "load": {"param": "speedup", "values": [1, 4]},
           "workload": {"dataset": "mooncake", "params": {"name": "synthetic", "duration_s": 10}},
           "runs": [{"hardware": "h100x8", "policies": ["round_robin", "sticky"]}]}
    path = tmp_path / "mc-load.yaml"
    path.write_text(yaml.safe_dump(raw))
    exp = load_experiment(path)
    assert [(r.policy, r.load) for r in exp.expand()] == [("round_robin", 1), ("sticky", 1), ("round_robin", 4), ("sticky", 4)]
    from kvroute.pipeline import write_round_trace

    slow = read_trace(write_round_trace(path, 0, tmp_path / "1.parquet", 1))
    fast = read_trace(write_round_trace(path, 0, tmp_path / "4.parquet", 4))
    arrivals = [[t.arrival_s for c in tr.conversations for t in c.turns] for tr in (slow, fast)]
    assert arrivals[1] == [a / 4 for a in arrivals[0]] and max(arrivals[0]) > 5
    raw["load"] = {"param": "name", "values": [1]}
    raw["workload"]["params"].pop("name")
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ExperimentError, match=r"key load.values.0: name must be a Mooncake trace"):
        load_experiment(path)
    raw["load"] = {"param": "speedup", "values": [2]}
    raw["workload"]["params"]["speedup"] = 2
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ExperimentError, match=r"key workload.params.speedup: the load axis sets speedup"):
        load_experiment(path)
