"""The gateway's exact view from KV events, against emulated workers (fast, no vLLM).

Two emulators publish their block pools' events over ZMQ (vLLM's format); the gateway
subscribes (binding tcp://127.0.0.1:P, the engines connect) and routes with kv_aware.
A small pool (40 blocks of 16 tokens) makes eviction quick to reach.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.hardware import load_hardware
from kvroute.live import text
from kvroute.live.emulator import start_emulator
from kvroute.live.engines import free_ports, kv_events_config
from kvroute.live.gateway import Gateway
from kvroute.live.kv_events import WordChatTokenizer, chain_hashes_of

BS = 16
BLOCKS = 40


def small_hw():
    hw = load_hardware("cpu")
    hw = dataclasses.replace(hw, engine=dataclasses.replace(hw.engine, block_size=BS))
    return dataclasses.replace(hw, kv_cache_bytes=BLOCKS * BS * hw.model.kv_bytes_per_token)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def chat(client: aiohttp.ClientSession, url: str, messages: list[dict], session: str | None = None):
    body = {"messages": messages, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"X-Session-ID": session} if session else {}
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        usage, words = None, []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                words += [c["delta"].get("content", "") for c in chunk.get("choices", [])]
        return resp.headers.get("X-Worker"), usage, "".join(words).strip()


async def subscribed(client: aiohttp.ClientSession, emu, ex, worker: str) -> None:
    """Wait until the gateway hears ``worker``'s events, then empty that engine's cache.

    ZMQ publishers drop what they send before the subscriber's subscription reaches
    them, a moment after the connection (the handshake ``Gateway.start`` waits for): a
    batch published then is lost, as with vLLM. So send throwaway requests until one of
    their batches arrives, then reset the engine so the test starts from an empty cache
    on both sides. Each is a new conversation: a repeat of a lost one would hit the
    cache, store no block and publish nothing.
    """
    for k in range(50):
        await chat(client, emu.url, conv(f"prime{k}"))
        try:
            await until(lambda: ex.workers[worker].last_seq is not None, 0.2)
            break
        except AssertionError:
            continue
    else:
        raise AssertionError(f"no KV event from {worker} reached the gateway")
    async with client.post(emu.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    await until(lambda: ex.size(worker) == 0)


def conv(key: str, system_words: int = 100, user_words: int = 20) -> list[dict]:
    return [{"role": "system", "content": text.system_text(key, system_words)},
            {"role": "user", "content": text.user_text(key, 0, user_words)}]


def test_kv_aware_routes_on_the_engines_events_and_follows_eviction_and_reset():
    hw = small_hw()
    assert hw.num_blocks == BLOCKS
    eps = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]

    async def body():
        emus = [await start_emulator(hw, i, time_scale=0.0, kv_events_config=kv_events_config(eps[i]))
                for i in range(2)]
        gw = Gateway([f"w{i}={e.url}" for i, e in enumerate(emus)], "kv_aware", kv_events=eps,
                     tokenizer="emulator", kv_block_size=BS)
        async with aiohttp.ClientSession() as early:
            # batches published before the gateway listens are lost; the first priming
            # request repeats this one, hits the cache and publishes nothing
            for e in emus:
                await chat(early, e.url, conv("prime0"))
        await gw.start()
        ex = gw.exact_index
        tok = WordChatTokenizer()
        try:
            assert gw.view.exact and gw.view.block_size == BS
            async with aiohttp.ClientSession() as client:
                for i, e in enumerate(emus):
                    await subscribed(client, e, ex, f"w{i}")
                    # a start after lost batches is not a gap: nothing missed since joining
                    assert ex.workers[f"w{i}"].last_seq > 0 and ex.workers[f"w{i}"].gaps == 0
                cleared0 = ex.workers["w0"].cleared
                # turn 1 goes to w1 behind the gateway's back: only the engine's events can tell
                turn1 = conv("a")
                _, usage1, reply = await chat(client, emus[1].url, turn1)
                await until(lambda: ex.size("w1") > 0)
                pool1 = emus[1].worker.engine.pool
                # the index holds exactly the engine's cached blocks (same hashes here: the
                # emulator's chain over its word tokens is kvroute's)
                assert set(ex.workers["w1"].refs) == set(pool1.cached)
                turn2 = turn1 + [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": text.user_text("a", 1, 20)}]
                ids = tok.chat_ids(turn2)
                want = min(ex.match("w1", chain_hashes_of(ids, BS)), (len(ids) - 1) // BS) * BS
                assert want >= 128
                worker, usage2, _ = await chat(client, gw.url, turn2, session="a")
                assert worker == "w1", "kv_aware must follow the engine's cache, not the (empty) routing history"
                assert usage2["prompt_tokens"] == len(ids)
                assert usage2["prompt_tokens_details"]["cached_tokens"] == want
                # the approximate index would have known nothing of turn 1
                assert gw.view.index.size("w1") == 0

                # eviction: other prompts on w1 fill its 40 blocks; the index follows the pool
                a_hashes = chain_hashes_of(tok.chat_ids(turn1), BS)
                for k in range(6):
                    await chat(client, emus[1].url, conv(f"filler{k}", 110, 10))
                await until(lambda: set(ex.workers["w1"].refs) == set(pool1.cached))
                assert ex.workers["w1"].removed > 0
                assert ex.match("w1", a_hashes) == 0 and pool1.num_cached_blocks(a_hashes) == 0
                # the next turn of "a" now matches nowhere: least loaded, the tie goes to w0
                worker, usage3, _ = await chat(client, gw.url, turn2, session="a")
                assert worker == "w0" and usage3["prompt_tokens_details"]["cached_tokens"] == 0
                await until(lambda: ex.match("w0", chain_hashes_of(ids, BS)) > 0)

                # AllBlocksCleared: a reset empties the worker's index
                async with client.post(emus[0].url + "/reset_prefix_cache") as resp:
                    assert resp.status == 200
                await until(lambda: ex.size("w0") == 0)
                assert ex.workers["w0"].cleared == cleared0 + 1
                async with client.get(gw.url + "/health") as resp:
                    health = await resp.json()
                assert health["view"] == "exact"
                assert health["workers"]["w1"]["kv_events"]["gaps"] == 0
                async with client.get(gw.url + "/metrics") as resp:
                    metrics = await resp.text()
                assert 'kvroute_gateway_kv_events_total{worker="w1"}' in metrics
        finally:
            await gw.stop()
            for e in emus:
                await e.close()

    run(body())


def test_gateway_rejects_kv_events_without_tokenizer_or_block_size():
    with pytest.raises(ValueError, match="tokenizer"):
        Gateway(["w0=http://127.0.0.1:1"], "kv_aware", kv_events=["tcp://127.0.0.1:2"])
    with pytest.raises(ValueError, match="endpoints"):
        Gateway(["w0=http://127.0.0.1:1"], "kv_aware", kv_events=["tcp://127.0.0.1:2", "tcp://127.0.0.1:3"],
                tokenizer="emulator", kv_block_size=16)
    res = CliRunner().invoke(main, ["gateway", "--policy", "kv_aware", "--worker", "w0=http://127.0.0.1:1",
                                    "--kv-events", "tcp://127.0.0.1:2"])
    assert res.exit_code != 0 and "--tokenizer" in res.output


def test_measure_with_kv_events_records_an_exact_view(tmp_path):
    """`kvroute measure --kv-events` on emulated workers: engines publish, each gateway subscribes."""
    exp = {"name": "kvtest", "seed": 3, "rounds": 1,
           "workload": {"generator": "note2", "params": {"chats": 4, "turns": 3, "system_words": 300,
                                                         "user_words": 200, "reply_tokens": 8, "ramp_s": 0.5}},
           "runs": [{"hardware": "cpu", "policies": ["kv_aware", "round_robin"]}]}
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(exp))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["measure", str(f), "--hardware", "cpu", "--engine", "emulator", "--out", str(out),
                                    "--kv-events", "--time-scale", "0.2"])
    assert res.exit_code == 0, res.output
    df = pd.read_parquet(out / "requests.parquet")
    assert (df.status == "ok").all() and (df.source == "emulated").all() and (df.view == "exact").all()
    later = df[(df.policy == "kv_aware") & (df.turn > 0)]
    # every later turn of kv_aware lands where its history is cached, as the engines said
    assert (later.cached_tokens > later.prompt_tokens * 0.5).all()
    assert json.loads((out / "load.json").read_text())["kv_events"] is True
    cmd = (out / "engines" / "w0.log").read_text()
    assert "KV events to tcp://127.0.0.1:" in cmd
