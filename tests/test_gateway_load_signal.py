"""The gateway's load signals over real HTTP, with emulated workers: ``scraped`` load comes
from each worker's /metrics and changes only at scrapes; ``events`` applies KV events late."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import zmq

from kvroute.hardware import load_hardware
from kvroute.live.emulator import start_emulator
from kvroute.live.engines import free_ports
from kvroute.live.gateway import Gateway
from kvroute.live.kv_events import BlockStored, ExactPrefixIndex, KVEventSubscriber, chain_hashes_of, encode_batch
from kvroute.live.metrics import parse_load
from kvroute.loadsignal import LoadSignal

HOUR_MS = 3_600_000.0  # a scrape interval no test outlives: the test scrapes by hand


def run(coro, timeout=30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond, timeout=10.0):
    t = time.monotonic()
    while not cond():
        if time.monotonic() - t > timeout:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def test_parse_load_reads_vllms_gauges():
    page = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m a"} 3.0
vllm:num_requests_running{engine="1",model_name="m a"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m a"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:time_to_first_token_seconds_bucket{le="0.01"} 7.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 2.0
"""
    assert parse_load(page) == {"num_requests_running": 4.0, "num_requests_waiting": 2.0,
                                "kv_cache_usage_perc": 0.375}
    assert parse_load("vllm:gpu_cache_usage_perc 0.125\nvllm:num_requests_waiting 1\n") == {
        "kv_cache_usage_perc": 0.125, "num_requests_waiting": 1.0}


def _chat(model: str, conv: int, max_tokens: int) -> dict:
    return {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"chat {conv}: " + "tell me more " * 80}]}


async def _post(session, url, body) -> str:
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["X-Worker"]


def test_scraped_load_changes_only_at_scrapes():
    """A request in flight is invisible to the view until a scrape; a finished one stays
    visible until the next; KV usage comes from the page, in the engines' blocks."""
    hw = load_hardware("cpu")

    async def body():
        emus = [await start_emulator("cpu", i, time_scale=1.0) for i in range(2)]
        gw = Gateway([(f"w{i}", e.url) for i, e in enumerate(emus)], "least_loaded", health_interval_s=60,
                     load_signal=LoadSignal("scraped", interval_ms=HOUR_MS), kv_capacity_blocks=hw.num_blocks)
        await gw.start()
        view, w0 = gw.view, gw.view.state["w0"]
        try:
            await until(lambda: all(s.scrapes == 1 for s in view.state.values()))  # the loop's first scrape
            async with aiohttp.ClientSession() as c:
                model = emus[0].server.model_name
                task = asyncio.create_task(_post(c, gw.url, _chat(model, 0, 24)))
                await until(lambda: w0.in_flight == 1)  # the gateway's own counter sees it at once
                assert view.in_flight("w0") == 0 and view.active_blocks("w0") == 0  # the view: not yet
                # a second request between scrapes sees the same stale, empty cluster: the same worker
                second = await _post(c, gw.url, _chat(model, 1, 1))
                assert second == "w0"
                await until(lambda: emus[0].worker.num_running == 1)
                assert await gw.scrape_once("w0")
                assert view.in_flight("w0") == 1 and view.waiting("w0") == 0
                pool = emus[0].worker.engine.pool
                assert view.active_blocks("w0") == pool.num_used_blocks > 0
                assert await task == "w0"
                assert w0.in_flight == 0
                assert view.in_flight("w0") == 1  # finished, but not scraped since
                assert await gw.scrape_once("w0")
                assert view.in_flight("w0") == 0 and view.active_blocks("w0") == 0
                async with c.get(gw.url + "/health") as r:
                    health = await r.json()
                assert health["load_signal"] == f"scraped:{HOUR_MS:g}ms"
                assert health["workers"]["w0"]["scraped"]["scrapes"] == 3
        finally:
            await gw.stop()
            for e in emus:
                await e.close()

    run(body())


def test_scraper_runs_every_interval_and_survives_a_dead_worker():
    async def body():
        emu = await start_emulator("cpu", 0, time_scale=1.0)
        dead = f"http://127.0.0.1:{free_ports(1)[0]}"
        gw = Gateway([("w0", emu.url), ("w1", dead)], "least_loaded", health_interval_s=60,
                     load_signal=LoadSignal("scraped", interval_ms=50.0))
        await gw.start()
        try:
            await asyncio.sleep(0.5)
            s0, s1 = gw.view.state["w0"], gw.view.state["w1"]
            assert 5 <= s0.scrapes <= 12, s0.scrapes
            assert s1.scrapes == 0 and s1.scrape_errors >= 5
            assert gw.view.in_flight("w1") == 0  # never scraped: reads 0
        finally:
            await gw.stop()
            await emu.close()

    run(body())


def test_router_signal_counts_at_once():
    """The default, for contrast: the second concurrent request goes to the other worker."""
    async def body():
        emus = [await start_emulator("cpu", i, time_scale=1.0) for i in range(2)]
        gw = Gateway([(f"w{i}", e.url) for i, e in enumerate(emus)], "least_loaded", health_interval_s=60)
        await gw.start()
        try:
            async with aiohttp.ClientSession() as c:
                model = emus[0].server.model_name
                task = asyncio.create_task(_post(c, gw.url, _chat(model, 0, 24)))
                await until(lambda: gw.view.state["w0"].in_flight == 1)
                assert gw.view.in_flight("w0") == 1
                assert await _post(c, gw.url, _chat(model, 1, 1)) == "w1"
                assert await task == "w0"
        finally:
            await gw.stop()
            for e in emus:
                await e.close()

    run(body())


def test_events_signal_needs_kv_events():
    with pytest.raises(ValueError, match="kv_events"):
        Gateway([("w0", "http://127.0.0.1:1")], "kv_aware", load_signal=LoadSignal("events", delay_ms=10.0))


def test_subscriber_applies_batches_after_the_delay():
    bs = 4
    ep = f"tcp://127.0.0.1:{free_ports(1)[0]}"

    async def body():
        idx = ExactPrefixIndex(["w0"], bs)
        sub = KVEventSubscriber(idx, {"w0": ep}, delay_s=0.3)
        await sub.start()
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(ep)
        try:
            assert await sub.wait_connected(5.0) == []
            a = list(range(8))
            t0 = time.monotonic()
            stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=a, block_size=bs)
            pub.send_multipart([b"", (0).to_bytes(8, "big"), encode_batch([stored])])
            await asyncio.sleep(0.1)
            assert idx.match("w0", chain_hashes_of(a, bs)) == 0  # arrived, held back
            await until(lambda: idx.workers["w0"].batches == 1)
            assert time.monotonic() - t0 >= 0.29
            assert idx.match("w0", chain_hashes_of(a, bs)) == 2
        finally:
            pub.close(linger=0)
            ctx.term()
            await sub.stop()

    run(body())


@pytest.mark.parametrize("args, message", [
    (["--load-signal", "scraped"], "--load-signal scraped needs --scrape-interval-ms"),
    (["--scrape-interval-ms", "100"], "--scrape-interval-ms applies to --load-signal scraped only"),
    (["--load-signal", "events", "--events-delay-ms", "5"], "--load-signal events needs --kv-events"),
])
def test_gateway_command_names_the_flag(args, message):
    from click.testing import CliRunner

    from kvroute.live.gateway import gateway_command

    res = CliRunner().invoke(gateway_command, ["--policy", "least_loaded", "--worker", "http://127.0.0.1:1", *args])
    assert res.exit_code != 0 and message in res.output, res.output
