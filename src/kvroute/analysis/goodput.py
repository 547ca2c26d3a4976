"""Goodput at a service class: requests per second that meet TTFT and TPOT targets.

A request meets the class when it succeeded, its time to first token is at most
``ttft_ms`` and its time per output token is at most ``tpot_ms``, with

    TPOT = (e2e - ttft) / (output_tokens - 1)

(the mean gap between output tokens after the first; vLLM's benchmark definition).
A one-token reply has no gap: its TPOT is 0 and only TTFT counts. Goodput is the
number of requests meeting the class divided by the run's duration (first arrival to
last finish, the records' ``time_to_complete_s``); ``attainment`` is the fraction
meeting it. Failed requests count in the denominator of attainment and never meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class ServiceClass:
    """Latency targets a request must meet to count towards goodput."""

    name: str
    ttft_ms: float
    tpot_ms: float


def tpot_ms(df: pd.DataFrame) -> pd.Series:
    """Time per output token after the first, in ms (0 for one-token replies)."""
    gaps = (df["output_tokens"] - 1).astype(float)
    decode = df["e2e_ms"] - df["ttft_ms"]
    return (decode / gaps.where(gaps > 0)).fillna(0.0).where(gaps > 0, 0.0)


def meets(df: pd.DataFrame, sc: ServiceClass) -> pd.Series:
    """Boolean per request: ok and within both targets."""
    ok = df["status"] == "ok"
    return ok & (df["ttft_ms"] <= sc.ttft_ms) & (tpot_ms(df) <= sc.tpot_ms)


def goodput(
    df: pd.DataFrame,
    sc: ServiceClass,
    by: Sequence[str] = ("experiment", "hardware", "policy", "round"),
) -> pd.DataFrame:
    """Per group: ``requests``, ``good``, ``duration_s``, ``goodput_rps``, ``throughput_rps``, ``attainment``."""
    rows = []
    good = meets(df, sc)
    for key, g in df.groupby(list(by), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        dur = float(g["finish_s"].max() - g["arrival_s"].min()) if len(g) else np.nan
        n_good = int(good.loc[g.index].sum())
        rows.append({
            **dict(zip(by, key)),
            "service_class": sc.name,
            "requests": len(g),
            "good": n_good,
            "duration_s": dur,
            "goodput_rps": n_good / dur if dur and dur > 0 else np.nan,
            "throughput_rps": len(g) / dur if dur and dur > 0 else np.nan,
            "attainment": n_good / len(g) if len(g) else np.nan,
        })
    return pd.DataFrame(rows)


def goodput_curve(
    df: pd.DataFrame,
    ttft_targets_ms: Sequence[float],
    tpot_ms_target: float,
    by: Sequence[str] = ("experiment", "hardware", "policy", "round"),
) -> pd.DataFrame:
    """Goodput for each TTFT target at a fixed TPOT target (one frame, ``ttft_target_ms`` column)."""
    parts = []
    for t in ttft_targets_ms:
        g = goodput(df, ServiceClass(f"ttft<={t:g}ms", float(t), float(tpot_ms_target)), by)
        g["ttft_target_ms"] = float(t)
        parts.append(g)
    return pd.concat(parts, ignore_index=True)
