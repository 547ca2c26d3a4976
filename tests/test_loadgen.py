"""The load generator against real emulators over HTTP: accounting, bounds, faults, records."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import time

import aiohttp
import pandas as pd
import pyarrow.parquet as pq
import pytest

from kvroute.live import text
from kvroute.live.emulator import start_emulator
from kvroute.live.engines import free_ports, running_engines
from kvroute.live.loadgen import make_session, records_for, replay, run_load, write_results
from kvroute.live.metrics import delta, parse_metrics
from kvroute.records import REQUEST_COLUMNS
from kvroute.workload import note2
from kvroute.workload.trace import Conversation, Trace, Turn

CONTRACT = ["source", "experiment", "hardware", "policy", "round", "conversation", "turn", "worker", "arrival_s",
            "first_token_s", "finish_s", "ttft_ms", "e2e_ms", "prompt_tokens", "cached_tokens", "output_tokens",
            "status"]


def run(coro, timeout=30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def small_trace(chats=4, turns=3, reply=16, **kw):
    return note2(3, chats=chats, turns=turns, system_words=240, user_words=90, reply_tokens=reply, **kw)


def test_closed_loop_on_two_emulator_processes_records_every_request(tmp_path):
    trace = small_trace()
    with running_engines("cpu", kind="emulator", run_dir=tmp_path / "engines", time_scale=0.5) as eng:
        result = run(run_load(trace, eng.urls, progress_every_s=0.2))
    rows = result.rows
    assert len(rows) == trace.num_requests == 12
    assert all(r["status"] == "ok" for r in rows)
    assert {r["worker"] for r in rows} == set(eng.urls)  # chats alternate between the two
    for r in rows:
        conv = next(c for c in trace.conversations if c.id == r["conversation"])
        content = conv.prompt_tokens(r["turn"])
        assert r["prompt_tokens"] == text.chat_prompt_tokens(content, 2 + 2 * r["turn"])  # sizes kept exactly
        assert r["output_tokens"] == 16
        assert r["first_token_s"] > r["arrival_s"] and r["finish_s"] >= r["first_token_s"]
        assert r["ttft_ms"] == pytest.approx((r["first_token_s"] - r["arrival_s"]) * 1e3)
    # closed loop: a chat's turn starts after its previous reply ended
    by_conv = {}
    for r in rows:
        by_conv.setdefault(r["conversation"], []).append(r)
    for turns in by_conv.values():
        for a, b in zip(turns, turns[1:]):
            assert b["arrival_s"] >= a["finish_s"]
    later = [r for r in rows if r["turn"] > 0]
    assert all(r["cached_tokens"] >= 3 * 128 for r in later)  # history reused on the same worker
    check = result.cross_check()
    assert check["metrics_hits"] == check["usage_cached_tokens"] > 0
    assert check["metrics_queries"] == check["usage_prompt_tokens"]

    recs = records_for(rows, source="emulated", experiment="t", hardware="cpu", policy="direct", round=0)
    summary = write_results(recs, tmp_path / "out", {("t", "cpu", "direct", 0): eng.urls}, extra={"deltas": result.deltas})
    table = pq.read_table(tmp_path / "out/requests.parquet")
    assert table.column_names[: len(CONTRACT)] == CONTRACT
    assert table.column_names == list(REQUEST_COLUMNS)
    df = table.to_pandas()
    assert (df["source"] == "emulated").all() and len(df) == 12
    s = pd.read_csv(tmp_path / "out/summary.csv")
    assert s.loc[0, "requests"] == 12 and s.loc[0, "errors"] == 0
    assert 0 < summary.loc[0, "hit_rate"] < 1
    assert (tmp_path / "out/load.json").is_file()


def test_killed_emulator_gives_error_rows_and_the_run_finishes(tmp_path):
    trace = small_trace(chats=4, turns=4, reply=60)

    async def load_and_kill(eng):
        async def killer():
            await asyncio.sleep(0.2)  # turn 0's replies (60 tokens, ~0.35 s) are streaming
            os.kill(eng.procs[1].pid, signal.SIGKILL)  # the process this test started

        k = asyncio.create_task(killer())
        rows = await replay(trace, eng.urls, request_timeout_s=10, progress_every_s=None)
        await k
        return rows

    with running_engines("cpu", kind="emulator", run_dir=tmp_path / "engines", time_scale=0.5) as eng:
        t = time.perf_counter()
        rows = run(load_and_kill(eng))
        wall = time.perf_counter() - t
        dead, alive = eng.urls[1], eng.urls[0]
    assert wall < 15
    assert len(rows) == trace.num_requests  # every request accounted for, none missing
    keys = {(r["conversation"], r["turn"]) for r in rows}
    assert len(keys) == len(rows)
    on_dead = [r for r in rows if r["endpoint"] == dead]
    errors = [r for r in on_dead if r["status"] != "ok"]
    assert errors, "the killed engine's requests must become error rows"
    assert {r["status"] for r in errors} <= {"error:stream", "error:connect"}
    assert any(r["status"] == "error:stream" for r in errors)  # in flight when it died
    assert all(r["status"] == "ok" for r in rows if r["endpoint"] == alive)
    # the conversations on the dead engine went on to their later turns (all failing fast)
    assert max(r["turn"] for r in errors) == 3
    for r in errors:
        assert r["error"] and math.isfinite(r["e2e_ms"])


def test_count_and_time_bounds_are_respected():
    trace = small_trace(chats=4, turns=6, reply=200)

    async def main():
        async with await start_emulator("cpu", 0, time_scale=0) as emu:
            capped = await replay(trace, emu.url, max_requests=5, progress_every_s=None)
        async with await start_emulator("cpu", 0, time_scale=1.0) as emu:
            t = time.perf_counter()
            timed = await replay(trace, emu.url, time_limit_s=0.8, progress_every_s=None)
            t_time = time.perf_counter() - t
            return capped, timed, t_time

    capped, timed, t_time = run(main())
    assert len(capped) == 5 and all(r["status"] == "ok" for r in capped)
    assert t_time < 1.5
    assert timed, "some requests were sent"
    assert all(r["arrival_s"] < 0.8 for r in timed)
    assert all(r["finish_s"] < 1.0 for r in timed)
    cut = [r for r in timed if r["status"] == "error:time_limit"]
    assert len(cut) == 4  # the four chats' replies (200 tokens, ~2 s each) were all cut


def test_open_loop_sends_at_the_arrivals():
    convs = tuple(
        Conversation(f"c{i}", "s", 50, (Turn(20, 4), Turn(20, 4, think_s=0.1)), arrival_s=0.15 * i) for i in range(3)
    )
    trace = Trace("open-test", "open", convs).validate()

    async def main():
        async with await start_emulator("cpu", 0, time_scale=0.2) as emu:
            return await replay(trace, emu.url, progress_every_s=None)

    rows = run(main())
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        start = 0.15 * int(r["conversation"][1:])
        assert r["arrival_s"] >= start
        if r["turn"] == 0:  # on time within 0.1 s (a loaded 2-core machine ran 68 ms late once), before the next arrival
            assert r["arrival_s"] < start + 0.1
    t0 = {r["conversation"]: r for r in rows if r["turn"] == 0}
    for r in rows:
        if r["turn"] == 1:
            assert r["arrival_s"] >= t0[r["conversation"]]["finish_s"] + 0.1


def test_connect_and_http_errors_are_rows_and_chats_go_on():
    trace = small_trace(chats=2, turns=3)

    async def main():
        (port,) = free_ports(1)  # nothing listens here
        refused = await replay(trace, f"http://127.0.0.1:{port}", model="m", progress_every_s=None)
        async with await start_emulator("cpu", 0, time_scale=0) as emu:
            wrong_model = await replay(trace, emu.url, model="no-such-model", progress_every_s=None)
        return refused, wrong_model

    refused, wrong_model = run(main())
    assert len(refused) == 6 and {r["status"] for r in refused} == {"error:connect"}
    assert len(wrong_model) == 6 and {r["status"] for r in wrong_model} == {"error:http_404"}
    assert all("does not exist" in r["error"] for r in wrong_model)
    assert all(math.isnan(r["ttft_ms"]) for r in refused + wrong_model)
    recs = records_for(refused, source="live", experiment="t", hardware="cpu", policy="p", round=1)
    assert all(r["status"] == "error:connect" and r["round"] == 1 for r in recs)


def test_connections_are_kept_alive_with_tcp_nodelay():
    async def main():
        async with await start_emulator("cpu", 0, time_scale=0.1) as emu, make_session() as s:
            socks = []
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
            for _ in range(3):
                async with s.post(emu.url + "/v1/chat/completions", json=body) as resp:
                    sock = resp.connection.transport.get_extra_info("socket")
                    socks.append((sock.fileno(), sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
                    await resp.read()
            return socks

    socks = run(main())
    assert all(nodelay for _, nodelay in socks)
    assert len({fd for fd, _ in socks}) == 1  # one kept-alive connection


def test_records_for_rejects_a_simulation_source():
    with pytest.raises(ValueError, match="live, emulated"):
        records_for([], source="sim", experiment="e", hardware="h", policy="p", round=0)


def test_parse_metrics_sums_labels_and_delta_flags_restarts():
    page = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1664.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 3148.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""
    m = parse_metrics(page)
    assert m == {"prefix_cache_hits": 1792.0, "prefix_cache_queries": 3148.0, "num_requests_running": 2.0}
    d = delta({"prefix_cache_hits": 10.0, "prefix_cache_queries": 50.0}, {"prefix_cache_hits": 4.0, "prefix_cache_queries": 80.0})
    assert math.isnan(d["prefix_cache_hits"]) and d["prefix_cache_queries"] == 30.0
    assert all(math.isnan(v) for v in delta(None, m).values())


def test_a_failed_scrape_is_none_not_an_exception():
    async def main():
        (port,) = free_ports(1)
        async with aiohttp.ClientSession() as s:
            from kvroute.live.metrics import scrape_all

            return await scrape_all(s, [f"http://127.0.0.1:{port}"], timeout_s=2)

    assert list(run(main()).values()) == [None]
