"""Mooncake's whole traces, every policy, every speed-up: the table `make field` writes.

`make paper`'s field note replays windows of the two traces; the whole traces with every
kvroute policy at every speed-up take longer than its time allows, so target `field`
simulates them (config key ``field_experiments``) and this module turns their merged
summaries into one table: per trace, speed-up and policy, the requests, hit rate beside
the trace's own bound on prefix reuse (``kvroute.workload.mooncake.prefix_reuse_bound``,
from ``hash_ids`` alone), mean and p90 TTFT and imbalance. Everything in it is simulated.

Command line (rule field_whole_traces)::

    python -m kvroute.analysis.whole_traces --sim results/sim/EXP ... --out results/field
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from kvroute.records import write_csv

COLUMNS = ("experiment", "trace", "hardware", "speedup", "policy", "requests", "errors", "hit_rate",
           "reuse_bound", "ttft_mean_ms", "ttft_p90_ms", "imbalance")


def trace_of(experiment: Path) -> str:
    """Which Mooncake trace an experiment replays (its workload's ``name``)."""
    from kvroute.experiment import load_experiment

    exp = load_experiment(experiment)
    if exp.workload.get("dataset") != "mooncake":
        raise ValueError(f"{experiment}: not a Mooncake replay (workload.dataset is {exp.workload.get('dataset')!r})")
    return exp.workload.get("params", {}).get("name", "conversation")


def table(sim_dirs: list[Path], experiments_dir: Path = Path("config/experiments"),
          data: Path | None = None) -> pd.DataFrame:
    """One row per (experiment, hardware, speed-up, policy) of the merged ``sim_dirs``,
    rounds averaged; ``data`` is where the traces' copies are (default ``data/mooncake``)."""
    from kvroute.workload import mooncake

    bounds: dict[str, float] = {}
    frames = []
    for d in sim_dirs:
        s = pd.read_csv(Path(d) / "summary.csv")
        for exp_name in s["experiment"].unique():
            name = trace_of(Path(experiments_dir) / f"{exp_name}.yaml")
            if name not in bounds:
                path = mooncake.copy_path(name, data) if data is not None else None
                bounds[name] = mooncake.prefix_reuse_bound(mooncake.read_requests(name, path))
            e = s[s["experiment"] == exp_name]
            g = e.groupby(["experiment", "hardware", "load", "policy"], sort=True)
            out = g[["requests", "errors"]].sum().join(
                g[["hit_rate", "ttft_mean_ms", "ttft_p90_ms", "imbalance"]].mean()).reset_index()
            frames.append(out.assign(trace=name, reuse_bound=bounds[name]).rename(columns={"load": "speedup"}))
    if not frames:
        return pd.DataFrame(columns=list(COLUMNS))
    return pd.concat(frames, ignore_index=True)[list(COLUMNS)].sort_values(
        ["trace", "speedup", "ttft_mean_ms"], kind="stable").reset_index(drop=True)


def markdown(t: pd.DataFrame) -> str:
    """The table as Markdown, one block per trace and speed-up, fastest policy first."""
    lines = ["Simulated (kvroute's simulator; nothing measured). `make field`.", ""]
    for (trace, speedup), g in t.groupby(["trace", "speedup"], sort=True):
        r0 = g.iloc[0]
        lines += [f"### {trace} trace, whole, speed-up {speedup:g} ({int(r0.requests)} requests per policy, "
                  f"{r0.hardware}; the trace's reuse bound {100 * r0.reuse_bound:.1f}%)", "",
                  "| policy | hit rate | mean TTFT (s) | p90 TTFT (s) | imbalance | errors |", "|---|---|---|---|---|---|"]
        for r in g.itertuples(index=False):
            lines.append(f"| {r.policy} | {100 * r.hit_rate:.1f}% | {r.ttft_mean_ms / 1e3:.2f} | "
                         f"{r.ttft_p90_ms / 1e3:.2f} | {r.imbalance:.2f} | {int(r.errors)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sim", action="append", type=Path, required=True, help="A merged simulation folder; repeatable.")
    ap.add_argument("--experiments", type=Path, default=Path("config/experiments"))
    ap.add_argument("--out", type=Path, required=True, help="Folder for whole_traces.csv and whole_traces.md.")
    args = ap.parse_args(argv)
    from kvroute.analysis.tables import write_text

    t = table(args.sim, args.experiments)
    write_csv(t, args.out / "whole_traces.csv")
    write_text(args.out / "whole_traces.md", markdown(t))
    print(markdown(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
