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


# -- why the measured time ratio is smaller than the work ratio -----------------------------


@dataclass(frozen=True)
class TurnTwoTimes:
    """Median tokens prefilled and median TTFT of warm and cold second turns.

    A line through the two medians, ``ttft = fixed_ms + per_token_ms * prefilled``,
    splits a turn's time into what it pays per prefilled token and what it pays
    however much it prefills; the TTFT ratio equals the work ratio only when
    ``fixed_ms`` is zero. NaN where one side has no turns.
    """

    warm_work: float
    cold_work: float
    warm_ttft_ms: float
    cold_ttft_ms: float

    @property
    def work_ratio(self) -> float:
        return self.cold_work / self.warm_work

    @property
    def ttft_ratio(self) -> float:
        return self.cold_ttft_ms / self.warm_ttft_ms

    @property
    def per_token_ms(self) -> float:
        return (self.cold_ttft_ms - self.warm_ttft_ms) / (self.cold_work - self.warm_work)

    @property
    def fixed_ms(self) -> float:
        return self.warm_ttft_ms - self.per_token_ms * self.warm_work


def turn_two_times(records: pd.DataFrame) -> TurnTwoTimes:
    """:class:`TurnTwoTimes` of the second turns in ``records`` (all policies together:
    a warm turn is the same work whichever policy sent it)."""
    d = turn_two(records)
    work = d["prompt_tokens"] - d["cached_tokens"]

    def median(s: pd.Series) -> float:
        return float(s.median()) if len(s) else np.nan

    return TurnTwoTimes(median(work[d["warm"]]), median(work[~d["warm"]]),
                        median(d.loc[d["warm"], "ttft_ms"]), median(d.loc[~d["warm"], "ttft_ms"]))


def turn_sizes(records: pd.DataFrame) -> dict[str, float]:
    """What the engines were sent, from the records: median prompt tokens of turns 1 and
    2 (as the engine counts them, chat template included), median cached tokens of a
    warm turn 2, median reply tokens, rounds, and second turns per policy and round."""
    ok = records[records["status"] == "ok"]
    d = turn_two(records)
    per_round = d.groupby(["policy", "round"]).size()
    return {
        "turn1_prompt": float(ok.loc[ok["turn"] == 0, "prompt_tokens"].median()),
        "turn2_prompt": float(d["prompt_tokens"].median()),
        "warm_cached": float(d.loc[d["warm"], "cached_tokens"].median()) if d["warm"].any() else np.nan,
        "reply": float(ok["output_tokens"].median()),
        "rounds": int(records["round"].nunique()),
        "trials_per_round": float(per_round.median()) if len(per_round) else np.nan,
    }


def api_cost_at_length(probes: pd.DataFrame, prompt_tokens: float) -> tuple[float, float, int]:
    """The API server's cost for a long prompt, from ``kvroute calibrate --probe``'s
    observations (``results/calibration/probe/HW.csv``).

    The calibration measures the API server's cost on minimal prompts only; a long
    prompt also has to be templated, tokenised and sent, warm or cold alike. Over the
    used prefill probes of the probed length nearest ``prompt_tokens``: the median of
    client TTFT less the engine's own queue and prefill time.

    Returns:
        (median cost in ms, those probes' median prompt tokens, how many probes).
    """
    need = {"level", "kind", "used", "words", "prompt_tokens", "ttft_ms", "engine_queue_s_ms", "engine_prefill_s_ms"}
    missing = sorted(need - set(probes.columns))
    if missing:
        raise ValueError(f"probe observations: missing columns {missing}")
    p = probes[(probes["level"] == "probe") & (probes["kind"] == "prefill") & probes["used"].astype(bool)]
    p = p.dropna(subset=["ttft_ms", "engine_queue_s_ms", "engine_prefill_s_ms"])
    if p.empty:
        raise ValueError("probe observations: no used prefill probe with engine timings")
    sizes = p.groupby("words")["prompt_tokens"].median()
    words = (sizes - prompt_tokens).abs().idxmin()
    g = p[p["words"] == words]
    cost = g["ttft_ms"] - g["engine_queue_s_ms"] - g["engine_prefill_s_ms"]
    return float(cost.median()), float(sizes[words]), len(g)


def probe_costs(entry: dict) -> dict[str, float]:
    """The API server's measured costs in a probe calibration's coefficients entry
    (``provenance.measured``): ``api_cost_ms`` (a minimal prompt, outside the engine),
    ``admission_ms`` (a request's first step beyond a step of its tokens, engine time) and
    ``api_overhead_ms`` (what the simulator charges every request before its engine)."""
    try:
        measured = entry["provenance"]["measured"]
        out = {k: float(measured[k]["value"]) for k in ("api_cost_ms", "admission_ms")}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"probe calibration entry: no provenance.measured.{exc} value") from exc
    out["api_overhead_ms"] = float(entry["api_overhead_ms"])
    return out


def predicted_ttft_ms(hw, prompt: int, cached: int, before_ms: float) -> float:
    """TTFT the simulator's engine gives one request alone on ``hw``: ``before_ms`` (the
    API server's cost before the engine sees it) plus the prefill of its uncached
    tokens in chunks of ``max_num_batched_tokens``, one step each (the first admits it),
    through the cost model."""
    from kvroute.costmodel import StepTimeModel
    from kvroute.probefit import Observation, predict

    work = Observation("prefill", int(prompt), int(cached), 1, np.nan)
    return before_ms + predict(work, StepTimeModel.from_hardware(hw), hw.engine.max_num_batched_tokens)
