"""``kvroute calibrate``: fit a hardware family's step-time coefficients to measured records.

The simulator's step time (docs/costmodel.md) has a few free coefficients per hardware
family. They are fitted once per family from a measurement, never per experiment: this
module replays the measured runs' own workloads through the simulator and searches the
coefficients that bring three timing statistics of each kvroute policy closest to the
measured ones:

* ``ttft_first_ms``: mean time to first token of first turns (mostly prefill work: the
  compute efficiency),
* ``ttft_later_ms``: the mean of later turns (short prefills after a cache hit: API-server
  and per-step overheads),
* ``tpot_ms``: mean time per output token after the first (decode steps: per-step
  overhead and memory traffic).

Means, not medians: a median moves in steps as the coefficients move (the simulator's
scheduling is discrete), which stalls the search; the mean moves smoothly.

The objective is the mean squared log ratio simulated/measured over policies and
statistics, minimised over the logarithms of the coefficients (they are all positive, and
a ratio error weighs the same at any scale): a coarse grid, then Nelder-Mead, restarted once. Production routers are
left out: they cannot be simulated. Every simulation is seeded, so the fit is
deterministic for the same records.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import pandas as pd

from kvroute.experiment import Experiment, Run, is_peer_spec
from kvroute.hardware import Coefficients, Hardware, load_hardware

#: the coefficients fitted unless told otherwise: the three the statistics pin down
DEFAULT_FIT = ("compute_efficiency", "step_overhead_ms", "api_overhead_ms")
STATS = ("ttft_first_ms", "ttft_later_ms", "tpot_ms")


def timing_stats(records: pd.DataFrame) -> pd.DataFrame:
    """Per policy: the three means of :data:`STATS` over the successful requests."""
    ok = records[records["status"] == "ok"]
    tpot = (ok["e2e_ms"] - ok["ttft_ms"]) / (ok["output_tokens"] - 1).where(ok["output_tokens"] > 1)
    frame = ok.assign(tpot_ms=tpot, first=ok["turn"] == 0)
    out = {}
    for pol, g in frame.groupby("policy", sort=True):
        out[pol] = {
            "ttft_first_ms": g.loc[g["first"], "ttft_ms"].mean(),
            "ttft_later_ms": g.loc[~g["first"], "ttft_ms"].mean(),
            "tpot_ms": g["tpot_ms"].mean(),
        }
    return pd.DataFrame.from_dict(out, orient="index")[list(STATS)]


@dataclass(frozen=True)
class Fit:
    """The outcome of a calibration, with the errors before and after."""

    hardware: str
    family: str
    start: Coefficients
    fitted: Coefficients
    measured: pd.DataFrame
    before: pd.DataFrame
    after: pd.DataFrame
    loss_before: float
    loss_after: float
    evaluations: int

    def table(self) -> pd.DataFrame:
        """One row per policy and statistic: measured, simulated before and after."""
        rows = []
        for pol in self.measured.index:
            for s in STATS:
                m = self.measured.loc[pol, s]
                rows.append({"policy": pol, "statistic": s, "measured": m,
                             "before": self.before.loc[pol, s], "after": self.after.loc[pol, s],
                             "error_before": self.before.loc[pol, s] / m - 1, "error_after": self.after.loc[pol, s] / m - 1})
        return pd.DataFrame(rows)

    def coefficients_yaml(self) -> str:
        """The fitted set as a ``hardware/coefficients.yaml`` entry, with its provenance."""
        lines = [f"# fitted by `kvroute calibrate` on {self.hardware}: mean squared log error "
                 f"{self.loss_before:.4f} -> {self.loss_after:.4f} ({self.evaluations} simulations)",
                 f"{self.family}:"]
        for f in fields(Coefficients):
            if (value := getattr(self.fitted, f.name)) is not None:  # attention's own rates: unset on most families
                lines.append(f"  {f.name}: {float(value):.6g}")
        return "\n".join(lines) + "\n"


def _simulate_stats(exp: Experiment, hw: Hardware, runs: list[Run]) -> pd.DataFrame:
    from kvroute.sim.cluster import SimCluster
    from kvroute.sim.run import common_rng, load_trace, policy_rng
    from kvroute.policies import make_policy

    frames = []
    for run in runs:
        policy = make_policy(run.policy, policy_rng(exp, run))
        exact = policy.default_exact if exp.view == "auto" else exp.view == "exact"
        rows = SimCluster(load_trace(exp, run.round), hw, policy, common_rng(exp.seed, run.round), exact).run()
        frames.append(pd.DataFrame(rows).assign(policy=run.policy))
    return timing_stats(pd.concat(frames, ignore_index=True))


def _loss(sim: pd.DataFrame, measured: pd.DataFrame) -> float:
    ratio = np.log(sim.loc[measured.index, list(STATS)].to_numpy(float) / measured[list(STATS)].to_numpy(float))
    ratio = ratio[np.isfinite(ratio)]
    return float(np.mean(ratio**2)) if ratio.size else float("nan")


def calibrate(
    exp: Experiment, records: pd.DataFrame, hardware: str, fit: tuple[str, ...] = DEFAULT_FIT,
    max_evaluations: int = 200,
) -> Fit:
    """Fit ``fit`` of ``hardware``'s coefficients to ``records`` measured on ``exp``."""
    from scipy.optimize import minimize

    names = {f.name for f in fields(Coefficients)}
    unknown = [f for f in fit if f not in names]
    if unknown or not fit:
        raise ValueError(f"cannot fit {unknown or 'nothing'}; coefficients: {', '.join(sorted(names))}")
    hw0 = load_hardware(hardware)
    recs = records[(records["hardware"] == hardware) & ~records["policy"].map(is_peer_spec)]
    if recs.empty:
        raise ValueError(f"no records of kvroute's policies on hardware {hardware!r} to calibrate against")
    measured = timing_stats(recs)
    pairs = recs[["policy", "round"]].drop_duplicates().sort_values(["policy", "round"])
    runs = [Run(exp.name, hardware, p, int(r)) for p, r in pairs.itertuples(index=False)]
    start = hw0.coefficients
    x0 = np.log([max(float(getattr(start, f)), 1e-6) for f in fit])

    def hw_at(x: np.ndarray) -> Hardware:
        values = dict(zip(fit, np.exp(x).tolist()))
        if "compute_efficiency" in values:
            values["compute_efficiency"] = min(values["compute_efficiency"], 1.0)
        if "mem_efficiency" in values:
            values["mem_efficiency"] = min(values["mem_efficiency"], 1.0)
        return replace(hw0, coefficients=replace(start, **values))

    count = 0

    def objective(x: np.ndarray) -> float:
        nonlocal count
        count += 1
        loss = _loss(_simulate_stats(exp, hw_at(x), runs), measured)
        return loss if np.isfinite(loss) else 1e9

    before = _simulate_stats(exp, hw0, runs)
    # The loss is not smooth (discrete scheduling): a coarse grid of x1/2, x1, x2 around the
    # start picks the basin, then Nelder-Mead from a wide simplex, restarted from a narrow
    # one around its result to leave the shallow local minima it stalls in.
    grid = np.array(np.meshgrid(*[np.log([0.5, 1.0, 2.0])] * len(fit), indexing="ij")).reshape(len(fit), -1).T
    if len(grid) > max_evaluations // 3:
        grid = grid[[0, len(grid) // 2, -1]]  # many coefficients: the corners and the start only
    best_x = min((x0 + g for g in grid), key=objective)
    for step in (np.log(1.5), np.log(1.1)):
        left = max_evaluations - count
        if left < len(fit) + 2:
            break
        simplex = np.vstack([best_x, best_x + step * np.eye(len(fit))])
        res = minimize(objective, best_x, method="Nelder-Mead",
                       options={"maxfev": left, "xatol": 1e-3, "fatol": 1e-6, "initial_simplex": simplex})
        best_x = res.x
    best = hw_at(best_x)
    after = _simulate_stats(exp, best, runs)
    return Fit(hardware, hw0.coefficients_name, start, best.coefficients, measured, before, after,
               _loss(before, measured), _loss(after, measured), count + 2)


def read_measured(path: Path) -> pd.DataFrame:
    """Records of a ``kvroute measure`` run (a folder with requests.parquet, or the file)."""
    path = Path(path)
    file = path / "requests.parquet" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no requests.parquet (the output of `kvroute measure`)")
    return pd.read_parquet(file)
