"""Metrics against load: one curve per policy over an experiment's load axis.

An experiment with a load axis (``load: {param: rate_per_s, values: [...]}``) runs every
policy at every value; its merged ``summary.csv`` has one row per (hardware, policy,
load, round). :func:`load_curves` turns it into one row per (experiment, hardware,
policy, load) with each metric's mean over rounds and its t-interval
(:func:`kvroute.analysis.stats.over_rounds`), and, given the request records and a
service class, the goodput (:mod:`kvroute.analysis.goodput`) at each load too. Rounds
are independent, and within a round every load replays the same draw (common random
numbers), so the intervals are over rounds exactly as elsewhere in the notes.
:func:`kvroute.analysis.figures.against_load` draws a curve frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from kvroute.analysis.goodput import ServiceClass, goodput
from kvroute.analysis.stats import over_rounds

#: what a curve frame summarises by default, with the axis label a figure gives it
CURVE_METRICS: dict[str, str] = {
    "ttft_mean_ms": "mean TTFT (ms)",
    "ttft_p90_ms": "p90 TTFT (ms)",
    "later_ttft_mean_ms": "later-turn mean TTFT (ms)",
    "e2e_mean_ms": "mean end-to-end latency (ms)",
    "time_to_complete_s": "time to complete (s)",
    "hit_rate": "hit rate (cached / prompt tokens)",
    "imbalance": "imbalance (CV of work)",
}
#: added when :func:`load_curves` is given records and a service class
GOODPUT_METRICS: dict[str, str] = {
    "goodput_rps": "goodput (requests/s)",
    "attainment": "share of requests meeting the class",
}
#: a curve's identity: everything but the round
CURVE_KEYS = ("experiment", "hardware", "policy", "load_param", "load")


def with_goodput(summary: pd.DataFrame, records: pd.DataFrame, sc: ServiceClass) -> pd.DataFrame:
    """``summary`` with each run's ``goodput_rps`` and ``attainment`` at ``sc``
    (computed from ``records``, joined on experiment, hardware, policy, load and round)."""
    keys = ["experiment", "hardware", "policy", "load", "round"]
    missing = [k for k in keys if k not in records]
    if missing:
        raise ValueError(f"records lack the column(s) {', '.join(missing)} (records from before the load axis?)")
    g = goodput(records.assign(load=pd.to_numeric(records["load"])), sc, by=keys)
    return summary.drop(columns=[c for c in GOODPUT_METRICS if c in summary]).merge(
        g[[*keys, *GOODPUT_METRICS]], on=keys, how="left", validate="one_to_one")


def load_curves(
    summary: pd.DataFrame,
    records: pd.DataFrame | None = None,
    service_class: ServiceClass | None = None,
    metrics: Sequence[str] | None = None,
    confidence: float = 0.95,
) -> pd.DataFrame:
    """One row per (experiment, hardware, policy, load_param, load), sorted by load.

    Columns: the keys, then for each metric ``{m}_mean``, ``{m}_lo``, ``{m}_hi``,
    ``{m}_half`` (NaN with one round: no interval), and ``n`` (rounds).

    Args:
        summary: a merged ``summary.csv`` of an experiment with a load axis.
        records: its ``requests.parquet``, for goodput (with ``service_class``).
        service_class: the TTFT and TPOT targets goodput counts against.
        metrics: summary columns to carry (default :data:`CURVE_METRICS`); with
            goodput, :data:`GOODPUT_METRICS` are added.
        confidence: the intervals' two-sided level.

    Raises:
        ValueError: no load axis in ``summary`` (its ``load`` column is empty or
            absent), only one of records and service_class, or a metric it lacks.
    """
    if "load" not in summary or summary["load"].isna().all():
        raise ValueError("summary has no load axis: its load column is empty (an experiment without key load)")
    if (records is None) != (service_class is None):
        raise ValueError("goodput needs both records and service_class")
    summary = summary[summary["load"].notna()].assign(load=lambda d: pd.to_numeric(d["load"]))
    names = list(metrics) if metrics is not None else list(CURVE_METRICS)
    if records is not None:
        summary = with_goodput(summary, records, service_class)
        names += [m for m in GOODPUT_METRICS if m not in names]
    missing = [m for m in names if m not in summary]
    if missing:
        raise ValueError(f"summary has no column {', '.join(missing)}; it has {', '.join(summary.columns)}")
    curves = over_rounds(summary, names, by=CURVE_KEYS, confidence=confidence)
    return curves.sort_values(["experiment", "hardware", "policy", "load"], kind="stable").reset_index(drop=True)
