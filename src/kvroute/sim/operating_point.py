"""An experiment's operating point: the workload parameter at which one policy's metric
equals a published value, found by a search over simulations.

Why: a study that publishes latencies but not its load (the kv-reuse study: mean TTFT
of seconds, arrival rate unknown) can only be rebuilt at its operating point if the load
is chosen by a rule. The rule here: the value of ``param`` (a rate, say) in ``bounds`` at
which ``policy``'s ``metric`` in round ``round`` equals ``target``, found by Brent's method
on ``log metric - log target`` against ``log param`` (so a metric that grows by orders of
magnitude near saturation is still a smooth root). The target is one row of a published
values file (``paper/reported/``), named by its key: the published value is read, never
typed. That one figure is then in sample; every other metric and policy at the point is a
prediction.

Each evaluation simulates one run from the round's workload seed, so the search is
deterministic, and the file it writes lists every evaluation (the curve it walked).
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.experiment import Experiment, ExperimentError, Run

log = logging.getLogger(__name__)

#: metrics the search may match: the summary's columns (kvroute.records.summarize)
METRICS = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "later_ttft_mean_ms", "time_to_complete_s")


@dataclass(frozen=True)
class OperatingPointSpec:
    """An experiment's ``operating_point`` key, checked."""

    param: str
    lo: float
    hi: float
    policy: str
    hardware: str
    metric: str
    reported: Path
    key: str
    round: int = 0
    rtol: float = 0.01

    def target(self) -> tuple[float, str]:
        """The published value and its source, from the reported file's row ``key``."""
        if not self.reported.is_file():
            raise ExperimentError(f"operating_point.target.reported: no such file {self.reported}")
        with self.reported.open(newline="") as fh:
            for row in csv.DictReader(fh):
                if row.get("key") == self.key:
                    try:
                        return float(row["value"]), row.get("source", "")
                    except (TypeError, ValueError):
                        raise ExperimentError(f"{self.reported}: row {self.key!r} has no numeric value") from None
        raise ExperimentError(f"operating_point.target.key: {self.key!r} is not a row of {self.reported}")


def parse_spec(path: Path, raw: dict, exp_runs: tuple[tuple[str, tuple[str, ...]], ...], rounds: int) -> OperatingPointSpec:
    """Check an ``operating_point`` mapping beyond the schema; ExperimentError names the key."""
    lo, hi = raw["bounds"]
    if not 0 < lo < hi:
        raise ExperimentError(f"{path}: key operating_point.bounds: need 0 < low < high, got [{lo}, {hi}]")
    hardware = raw.get("hardware", exp_runs[0][0])
    if raw["policy"] not in {p for hw, pols in exp_runs if hw == hardware for p in pols}:
        raise ExperimentError(f"{path}: key operating_point.policy: {raw['policy']!r} is not a policy the experiment "
                              f"runs on {hardware}")
    round_ = raw.get("round", 0)
    if round_ >= rounds:
        raise ExperimentError(f"{path}: key operating_point.round: {round_} but the experiment has rounds 0..{rounds - 1}")
    target = raw["target"]
    return OperatingPointSpec(
        param=raw["param"], lo=float(lo), hi=float(hi), policy=raw["policy"], hardware=hardware,
        metric=raw["metric"], reported=Path(target["reported"]), key=target["key"], round=round_,
        rtol=float(raw.get("rtol", 0.01)),
    )


def evaluate(exp: Experiment, value: float, coefficients: Path | None = None) -> dict[str, float]:
    """The spec's policy at ``param = value`` in the spec's round: the run's summary metrics."""
    from kvroute.records import requests_table, summarize
    from kvroute.sim.run import load_trace, simulate_run

    spec = exp.operating_point
    trace = load_trace(exp, spec.round, point=value)
    rows, _ = simulate_run(exp, Run(exp.name, spec.hardware, spec.policy, spec.round), trace, coefficients)
    summary = summarize(requests_table(rows).to_pandas()).iloc[0]
    return {m: float(summary[m]) for m in METRICS}


def find(exp: Experiment, coefficients: Path | None = None) -> dict[str, Any]:
    """Search ``exp``'s operating point; the record written by :func:`write`.

    Raises ExperimentError when the target is outside what the bounds reach (naming the
    metric at both bounds), so an unreachable operating point is never silently clamped.
    """
    from scipy.optimize import brentq  # here, not at the top: every experiment with a point imports this module

    spec = exp.operating_point
    if spec is None:
        raise ExperimentError(f"{exp.path}: the experiment has no operating_point key")
    target, source = spec.target()
    evals: list[dict[str, float]] = []
    seen: dict[float, float] = {}  # brentq evaluates the bounds again: simulate each value once

    def gap(x: float) -> float:
        if x in seen:
            return seen[x]
        value = math.exp(x)
        metrics = evaluate(exp, value, coefficients)
        evals.append({"value": value, **metrics})
        log.info("%s = %.4g: %s %s = %.1f (target %.1f)", spec.param, value, spec.policy, spec.metric,
                 metrics[spec.metric], target)
        seen[x] = math.log(metrics[spec.metric]) - math.log(target)
        return seen[x]

    a, b = math.log(spec.lo), math.log(spec.hi)
    ga, gb = gap(a), gap(b)
    if ga * gb > 0:
        raise ExperimentError(
            f"{exp.path}: key operating_point: {spec.policy}'s {spec.metric} is {evals[0][spec.metric]:.1f} at "
            f"{spec.param}={spec.lo:g} and {evals[1][spec.metric]:.1f} at {spec.hi:g}: the target {target:g} is "
            "not between them; widen operating_point.bounds or change the workload")
    # xtol in log space: the parameter to within rtol
    x = a if ga == 0 else b if gb == 0 else brentq(gap, a, b, xtol=math.log1p(spec.rtol), rtol=1e-12, maxiter=50)
    value = math.exp(x)
    at = next((e for e in evals if e["value"] == value), None) or {"value": value, **evaluate(exp, value, coefficients)}
    return {
        "experiment": exp.name, "param": spec.param, "value": value,
        "policy": spec.policy, "hardware": spec.hardware, "round": spec.round, "metric": spec.metric,
        "target": target, "target_key": spec.key, "target_file": str(spec.reported), "target_source": source,
        "achieved": at[spec.metric], "rel_error": at[spec.metric] / target - 1, "rtol": spec.rtol,
        "bounds": [spec.lo, spec.hi], "evaluations": sorted(evals, key=lambda e: e["value"]),
    }


def write(record: dict[str, Any], out: Path) -> Path:
    """Write the search's record as JSON, atomically."""
    from kvroute.records import write_atomic

    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    write_atomic(Path(out), lambda tmp: Path(tmp).write_text(text))
    return Path(out)


def read(path: Path, exp: Experiment) -> float:
    """The operating point's value from ``path``, checked against ``exp`` (its name and param)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExperimentError(f"{path}: not an operating-point file: {exc}") from exc
    if exp.operating_point is None:
        raise ExperimentError(f"{exp.path}: an operating point ({path}) was given, but the experiment has no "
                              "operating_point key")
    if record.get("experiment") != exp.name or record.get("param") != exp.operating_point.param:
        raise ExperimentError(f"{path}: the operating point of {record.get('experiment')!r} "
                              f"({record.get('param')}), not of {exp.name!r} ({exp.operating_point.param})")
    return float(record["value"])
