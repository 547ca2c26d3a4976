"""The sticky-routing explainer: its worked arithmetic, computed, and its two-replica test.

Arithmetic. A turn whose prompt is ``history + new`` tokens prefills ``new`` tokens
on the replica holding the history (warm) and ``history + new`` on any other (cold).
With n replicas and uniform random routing a turn lands warm with probability 1/n,
so its expected prefill is ``new + (1 - 1/n) * history``. Real engines cache whole
blocks only and always recompute the last prompt token: the warm prefill with
``B``-token blocks is ``P - min(B floor(history / B), B floor((P - 1) / B))``.

Measurement (``results/measure/explainer-two-replicas``). Each trial is a two-turn
conversation; turn 2 (``turn == 1``) is timed. A turn 2 is warm when it read cached
tokens beyond what a cold replica could hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvroute.analysis.stats import interval


@dataclass(frozen=True)
class Arithmetic:
    history: int
    new: int
    replicas: int
    block_size: int = 1

    @property
    def prompt(self) -> int:
        return self.history + self.new

    @property
    def warm(self) -> int:
        """Tokens prefilled on the replica holding the history."""
        B = self.block_size
        cached = min(B * (self.history // B), B * ((self.prompt - 1) // B))
        return self.prompt - cached

    @property
    def cold(self) -> int:
        return self.prompt

    @property
    def ratio(self) -> float:
        return self.cold / self.warm

    @property
    def p_cold(self) -> float:
        return 1 - 1 / self.replicas

    @property
    def random_expected(self) -> float:
        """Expected prefill under uniform random routing."""
        return self.warm / self.replicas + self.cold * self.p_cold

    @property
    def random_over_sticky(self) -> float:
        return self.random_expected / self.warm


def arithmetic_table(cases: list[Arithmetic]) -> pd.DataFrame:
    """One row per case: history, new, block size, warm, cold, ratio, random expectation."""
    return pd.DataFrame([{
        "history": c.history, "new": c.new, "block_size": c.block_size, "replicas": c.replicas,
        "warm": c.warm, "cold": c.cold, "ratio": c.ratio, "p_cold": c.p_cold,
        "random_expected": c.random_expected, "random_over_sticky": c.random_over_sticky,
    } for c in cases])


def turn_two(records: pd.DataFrame) -> pd.DataFrame:
    """Turn-2 rows (``turn == 1``, ok) with a ``warm`` flag.

    Warm: cached tokens exceed what the trial's turn 1 alone could leave on a replica
    that never saw the trial (half the turn-2 prompt is a safe bar: the history is
    most of the prompt by design).
    """
    d = records[(records["turn"] == 1) & (records["status"] == "ok")].copy()
    d["warm"] = d["cached_tokens"] >= 0.5 * d["prompt_tokens"]
    return d


def measurement_summary(records: pd.DataFrame) -> pd.DataFrame:
    """Per (source, policy): trials, warm turn 2s, turn-2 TTFT (mean with interval over
    trials, median), warm and cold TTFT medians, and the busiest replica's share of trials."""
    d = turn_two(records)
    rows = []
    for (src, pol), g in d.groupby(["source", "policy"], sort=True):
        iv = interval(g["ttft_ms"])
        share = g["worker"].value_counts(normalize=True)
        rows.append({
            "source": src, "policy": pol, "trials": len(g), "warm": int(g["warm"].sum()),
            "ttft_mean_ms": iv.mean, "ttft_half_ms": iv.half, "ttft_median_ms": float(g["ttft_ms"].median()),
            "warm_ttft_median_ms": float(g.loc[g["warm"], "ttft_ms"].median()) if g["warm"].any() else np.nan,
            "cold_ttft_median_ms": float(g.loc[~g["warm"], "ttft_ms"].median()) if (~g["warm"]).any() else np.nan,
            "busiest_share": float(share.max()) if len(share) else np.nan,
            "replicas_used": int(g["worker"].nunique()),
        })
    return pd.DataFrame(rows)
