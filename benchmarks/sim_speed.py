"""Simulator speed: simulated seconds per wall second, and how wall time scales.

Runs, in one process and one sitting (this machine is shared and noisy, so the
ratios are measured side by side):

1. note2-20turn (config/experiments/note2-20turn.yaml) with its three policies,
   one round each: simulated seconds per wall second per policy and overall;
2. the same workload with ten times the conversations (640 chats), once on the
   same four workers (each engine's batch grows tenfold too) and once on forty
   workers (load per worker unchanged): the wall-time ratio against (1), next to
   the request-count ratio (10x), the ratio of engine steps simulated and the ratio
   of tokens the engines prefilled (the simulated work: tenfold chats on four workers
   overflow the KV cache, and round-robin on forty workers rarely finds a chat's
   history, so both prefill far more per request). Wall time growing like the steps
   and the prefill is linear growth.

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


def prefilled(rows) -> int:
    """Prompt tokens the engines computed (not served from their caches)."""
    return sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows)


def steps(worker_stats: dict[str, dict]) -> int:
    """Engine steps the run simulated, over all workers."""
    return sum(w["steps"] for w in worker_stats.values())


Timing = tuple[float, float, int, int, int]  # sim s, wall s, requests, prefilled tokens, engine steps


def tally(rows, sim_s: float, wall_s: float, worker_stats: dict[str, dict]) -> Timing:
    return sim_s, wall_s, len(rows), prefilled(rows), steps(worker_stats)


def timed(exp, trace, run) -> Timing:
    """Simulated seconds, wall seconds, requests, prefilled tokens and engine steps of ``run``."""
    t0 = time.perf_counter()
    rows, meta = simulate_run(exp, run, trace)
    wall = time.perf_counter() - t0
    return tally(rows, meta["sim_s"], wall, meta["worker_stats"])


def timed_cluster(trace, hw, run) -> Timing:
    """Like :func:`timed` on a hardware variant that has no profile file (more workers)."""
    cluster = SimCluster(trace, hw, make_policy(run.policy, np.random.default_rng(1)), np.random.default_rng(2), True)
    t0 = time.perf_counter()
    rows = cluster.run()
    wall = time.perf_counter() - t0
    return tally(rows, max(r["finish_s"] for r in rows), wall, cluster.worker_stats())


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
        best = min((timed(exp, trace, run) for _ in range(args.repeat)), key=lambda t: t[1])
        per_policy[run.policy] = best
        sim, wall = best[:2]
        print(f"  {run.policy:14s} {sim:7.1f} sim s in {wall:6.3f} wall s = {sim / wall:6.0f} sim s per wall s")
    sim = sum(v[0] for v in per_policy.values())
    wall = sum(v[1] for v in per_policy.values())
    print(f"  all three      {sim:7.1f} sim s in {wall:6.3f} wall s = {sim / wall:6.0f} sim s per wall s")

    hw = load_hardware(runs[0].hardware)
    wide_hw = dataclasses.replace(hw, workers=10 * hw.workers)
    reps = max(1, args.repeat - 1)  # tenfold runs take seconds each: best of two
    cases = {
        f"same {hw.workers} workers": {r.policy: min((timed(big, big_trace, r) for _ in range(reps)), key=lambda t: t[1]) for r in runs},
        f"{wide_hw.workers} workers": {r.policy: min((timed_cluster(big_trace, wide_hw, r) for _ in range(reps)), key=lambda t: t[1]) for r in runs},
    }
    print(f"tenfold conversations ({big_trace.num_requests} requests, x{big_trace.num_requests / trace.num_requests:.0f}):"
          " wall time x (engine steps x, prefilled tokens x)")
    print(f"  {'':16s}" + "".join(f"{r.policy:>26s}" for r in runs) + f"{'all three':>26s}")
    for label, res in cases.items():
        cells = []
        for key in [r.policy for r in runs] + [None]:
            a = per_policy[key] if key else tuple(map(sum, zip(*per_policy.values())))
            b = res[key] if key else tuple(map(sum, zip(*res.values())))
            w, p, st = b[1] / a[1], b[3] / a[3], b[4] / a[4]
            cells.append(f"x{w:.1f} (x{st:.1f}, x{p:.1f})".rjust(26))
        print(f"  {label:16s}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
