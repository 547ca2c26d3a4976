"""What each coefficient is worth to a prediction: one input at a time set to a named
alternative, the rest as filed, on the same workload draws.

A diagnostic of what a miss leaves out, never a fit. Research note 2's single-GPU rerun
(Table 3) is predicted 40-90% too slow; the note has to say what the model leaves out, and
this says how far each input moves the prediction. The alternatives come from the inputs'
own sources, not from the results they are compared with: another family's fitted value
(the A6000's efficiencies, from a sweep run with CUDA graphs, where the A100's come from
operator timings without them) or none of an overhead (what the prediction would be if the
engine's software, or the API server, cost nothing on that GPU). The published figures
appear only in the note, beside these predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from kvroute.experiment import Experiment
from kvroute.hardware import Hardware, load_hardware


@dataclass(frozen=True)
class Swap:
    """Set each input of ``to`` to another profile's value (its family's, named) or to 0 (None)."""

    name: str
    to: tuple[tuple[str, str | None], ...]
    why: str = ""

    def apply(self, hw: Hardware) -> Hardware:
        values = {k: getattr(load_hardware(like).coefficients, k) if like else 0.0 for k, like in self.to}
        return replace(hw, coefficients=replace(hw.coefficients, **values),
                       filed_coefficients=hw.router_coefficients)


_A6000 = "a6000x4"
_EFF = (("mem_efficiency", _A6000), ("compute_efficiency", _A6000))
_OVERHEADS = (("per_seq_overhead_ms", None), ("step_overhead_ms", None), ("api_overhead_ms", None))

#: the swaps of note 2's single-GPU rerun (docs/costmodel.md, "What the fit says, and what it cannot")
A100_SWAPS = (
    Swap("mem_as_a6000", _EFF[:1],
         "memory efficiency as the A6000's (a decode sweep with CUDA graphs; the A100's is from operator timings without them)"),
    Swap("compute_as_a6000", _EFF[1:], "compute efficiency as the A6000's (near what Preble's A100 prefill slope implies)"),
    Swap("no_per_seq", _OVERHEADS[:1],
         "no per-sequence overhead (fitted on the A6000's whole steps, shared by the family as the engine's software)"),
    Swap("no_step", _OVERHEADS[1:2], "no per-step overhead"),
    Swap("no_api", _OVERHEADS[2:], "no API-server overhead (the note states about 100 ms)"),
    Swap("all", _EFF + _OVERHEADS, "the efficiencies as the A6000's and no overheads, at once"),
)

METRICS = ("time_to_complete_s", "later_ttft_mean_ms")


def sensitivity(exp: Experiment, swaps: tuple[Swap, ...] = A100_SWAPS, rounds: int | None = None) -> pd.DataFrame:
    """Every run of ``exp`` as filed and under each swap, on the same workload draw per round;
    one row per (hardware, policy, swap, metric): the filed prediction, the swapped one and
    their ratio less 1, means over rounds."""
    from kvroute.records import summarize
    from kvroute.sim.run import load_trace, simulate_run

    runs = exp.expand(None, None, rounds, None)
    traces = {r.round: load_trace(exp, r.round) for r in runs}
    rows = []
    for run in runs:
        filed = load_hardware(run.hardware)
        for swap in (None, *swaps):
            hw = filed if swap is None else swap.apply(filed)
            recs, _ = simulate_run(exp, run, traces[run.round], hw=hw)
            s = summarize(pd.DataFrame(recs)).iloc[0]
            rows += [{"experiment": exp.name, "hardware": run.hardware, "policy": run.policy, "round": run.round,
                      "swap": "filed" if swap is None else swap.name, "metric": m, "value": float(s[m])}
                     for m in METRICS]
    df = (pd.DataFrame(rows).groupby(["experiment", "hardware", "policy", "swap", "metric"], sort=False)
          .agg(value=("value", "mean"), rounds=("round", "nunique")).reset_index())
    base = df[df["swap"] == "filed"].set_index(["hardware", "policy", "metric"])["value"]
    df["filed"] = [base[(h, p, m)] for h, p, m in zip(df["hardware"], df["policy"], df["metric"])]
    df["change"] = df["value"] / df["filed"] - 1.0
    df = df[df["swap"] != "filed"].reset_index(drop=True)
    df["what"] = df["swap"].map({s.name: s.why for s in swaps})
    return df


def write(exp: Experiment, out: Path, rounds: int | None = None) -> pd.DataFrame:
    """:func:`sensitivity` of ``exp`` to ``out`` (CSV, atomically)."""
    from kvroute.records import write_csv

    df = sensitivity(exp, rounds=rounds)
    write_csv(df, Path(out))
    return df
