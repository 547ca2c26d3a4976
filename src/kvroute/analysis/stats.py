"""Intervals over rounds: the mean and a two-sided t-based confidence interval.

Rounds are independent repetitions (fresh workload draw and jitter), so a metric's
per-round values are treated as an i.i.d. sample and its mean gets a Student-t
interval ``mean +- t_{(1+c)/2, n-1} * s / sqrt(n)``. With one round there is no
estimate of spread: the interval is undefined (``lo``, ``hi``, ``half`` are NaN and
``n`` says why), never a zero-width interval that would claim certainty.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as _st


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with a ``confidence`` interval [lo, hi].

    ``half`` is the half-width; NaN when ``n < 2`` (no spread can be estimated) and
    0 when every value is equal.
    """

    mean: float
    lo: float
    hi: float
    half: float
    n: int
    confidence: float = 0.95

    @property
    def has_interval(self) -> bool:
        return self.n >= 2 and math.isfinite(self.half)


def interval(values: Iterable[float], confidence: float = 0.95) -> Interval:
    """Mean and t-based interval of ``values`` (NaNs dropped).

    Args:
        values: one value per round.
        confidence: two-sided level, in (0, 1).

    Returns:
        An :class:`Interval`; with no values every field is NaN and n is 0; with one
        value the mean is that value and the interval is NaN.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    arr = arr[np.isfinite(arr)]
    n = int(arr.size)
    if n == 0:
        nan = math.nan
        return Interval(nan, nan, nan, nan, 0, confidence)
    mean = float(arr.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, math.nan, 1, confidence)
    sd = float(arr.std(ddof=1))
    half = float(_st.t.ppf((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)) if sd > 0 else 0.0
    return Interval(mean, mean - half, mean + half, half, n, confidence)


def over_rounds(
    summary: pd.DataFrame,
    metrics: Sequence[str],
    by: Sequence[str] = ("experiment", "hardware", "policy"),
    confidence: float = 0.95,
) -> pd.DataFrame:
    """One row per group of ``by`` with ``{metric}_mean/_lo/_hi/_half`` and ``n``.

    Args:
        summary: rows per round (e.g. ``summary.csv``), one value per metric and round.
        metrics: columns to summarise.
        by: grouping columns (everything but the round).
    """
    rows = []
    for key, g in summary.groupby(list(by), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(by, key))
        for m in metrics:
            iv = interval(g[m], confidence)
            row.update({f"{m}_mean": iv.mean, f"{m}_lo": iv.lo, f"{m}_hi": iv.hi, f"{m}_half": iv.half})
            row["n"] = iv.n
        rows.append(row)
    return pd.DataFrame(rows)
