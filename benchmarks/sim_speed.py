"""Simulator speed: simulated seconds per wall second, and how wall time scales.

Runs, in one process and one sitting (this machine is shared and noisy, so the
ratios are measured side by side):

1. note2-20turn (config/experiments/note2-20turn.yaml) with its three policies,
   one round each: simulated seconds per wall second per policy and overall;
2. the same workload with ten times the conversations (640 chats), once on the
   same four workers (each engine's batch grows tenfold too) and once on forty
   workers (load per worker unchanged): the wall-time ratio against (1), next to
   the request-count ratio (10x). Close to 10 means linear growth.

Usage: python benchmarks/sim_speed.py [--repeat N]   (make bench)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402

from kvroute.experiment import load_experiment  # noqa: E402
from kvroute.hardware import load_hardware  # noqa: E402
from kvroute.policies import make_policy  # noqa: E402
from kvroute.sim.cluster import SimCluster  # noqa: E402
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


def timed_cluster(trace, hw, runs) -> tuple[float, float, int]:
    """Like :func:`timed` on a hardware variant that has no profile file (more workers)."""
    wall = sim = 0.0
    n = 0
    for run in runs:
        cluster = SimCluster(trace, hw, make_policy(run.policy, np.random.default_rng(1)), np.random.default_rng(2), True)
        t0 = time.perf_counter()
        rows = cluster.run()
        wall += time.perf_counter() - t0
        sim += max(r["finish_s"] for r in rows)
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
    hw = load_hardware(runs[0].hardware)
    wide_hw = dataclasses.replace(hw, workers=10 * hw.workers)
    wide = min((timed_cluster(big_trace, wide_hw, runs) for _ in range(max(1, args.repeat // 2))), key=lambda t: t[1])
    print(f"tenfold conversations ({big_trace.num_requests} requests):")
    for label, res in ((f"same {hw.workers} workers", large), (f"{wide_hw.workers} workers", wide)):
        print(f"  {label:15s} wall {small[1]:.3f} s -> {res[1]:.3f} s: x{res[1] / small[1]:.1f} for"
              f" x{res[2] / small[2]:.0f} requests (wall per request x{(res[1] / res[2]) / (small[1] / small[2]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
