"""Simulator speed: simulated seconds per wall second, and how wall time scales.

Runs, in one process and one sitting (this machine is shared and noisy, so the
ratios are measured side by side):

1. note2-20turn (config/experiments/note2-20turn.yaml) with its three policies,
   one round each: simulated seconds per wall second per policy and overall;
2. the same workload with ten times the conversations (640 chats): the wall-time
   ratio against (1), next to the request-count ratio (10x). Close to 10 means
   linear growth.

Usage: python benchmarks/sim_speed.py [--repeat N]   (make bench)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from kvroute.experiment import load_experiment  # noqa: E402
from kvroute.sim.run import load_trace, simulate_run  # noqa: E402


def timed(exp, trace, runs) -> tuple[float, float, int]:
    wall = sim = 0.0
    n = 0
    for run in runs:
        t0 = time.perf_counter()
        rows, meta = simulate_run(exp, run, trace)
        wall += time.perf_counter() - t0
        sim += meta["sim_s"]
        n += len(rows)
    return sim, wall, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="take the best of N timings")
    args = ap.parse_args()
    exp = load_experiment(ROOT / "config/experiments/note2-20turn.yaml")
    runs = exp.expand(rounds=1)
    trace = load_trace(exp, 0)
    big_params = dict(exp.workload["params"], chats=10 * exp.workload["params"]["chats"])
    big = dataclasses.replace(exp, workload={"generator": exp.workload["generator"], "params": big_params})
    big_trace = load_trace(big, 0)

    print(f"note2-20turn: {trace.num_requests} requests, policies {', '.join(r.policy for r in runs)}")
    per_policy = {}
    for run in runs:
        best = min((timed(exp, trace, [run]) for _ in range(args.repeat)), key=lambda t: t[1])
        per_policy[run.policy] = best
        sim, wall, _ = best
        print(f"  {run.policy:14s} {sim:7.1f} sim s in {wall:6.3f} wall s = {sim / wall:6.0f} sim s per wall s")
    sim = sum(v[0] for v in per_policy.values())
    wall = sum(v[1] for v in per_policy.values())
    print(f"  all three      {sim:7.1f} sim s in {wall:6.3f} wall s = {sim / wall:6.0f} sim s per wall s")

    small = min((timed(exp, trace, runs) for _ in range(args.repeat)), key=lambda t: t[1])
    large = min((timed(big, big_trace, runs) for _ in range(max(1, args.repeat // 2))), key=lambda t: t[1])
    print(f"tenfold conversations ({big_trace.num_requests} requests, same hardware):")
    print(f"  wall {small[1]:.3f} s -> {large[1]:.3f} s: x{large[1] / small[1]:.1f} for x{large[2] / small[2]:.0f} requests"
          f" (wall per request x{(large[1] / large[2]) / (small[1] / small[2]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
