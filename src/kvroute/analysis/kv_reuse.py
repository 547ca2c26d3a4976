"""The multi-turn KV reuse study: results.csv, per_turn_results.csv, summary.txt, claim tests.

Definitions (turn k of a conversation, 0-based; "later" turns are k >= 1):

* hit rate: cached / prompt tokens over every ok request (``summary.csv``'s ``hit_rate``).
* reuse of a turn: ``cached_tokens / prompt_tokens`` of that request.
* history of turn k: the tokens the conversation had before turn k's new message,
  ``prompt_{k-1} + output_{k-1}`` (its previous prompt and reply).
* history reuse of turn k >= 1: ``min(cached, history) / history``, the fraction of the
  conversation's own past that the turn found in cache (1: it landed where its history
  is; near 0: it recomputed it).
* the reuse figures of ``results.csv``: ``request_reuse`` (mean reuse of every request,
  turn 0 included: the reading of the original's "reuse" that its values fit),
  ``later_turn_reuse`` (mean reuse of later turns) and ``history_reuse`` (token-weighted
  history reuse of later turns).
* a miss: a later turn whose history reuse is below :data:`MISS_THRESHOLD`.
* imbalance: ``summary.csv``'s coefficient of variation of per-worker work.

Every figure per strategy is computed per round, then averaged over rounds with a
t-based 95% interval (:mod:`kvroute.analysis.stats`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as _st

from kvroute.analysis.stats import interval
from kvroute.analysis.tables import write_text
from kvroute.records import write_csv

#: a later turn that finds less than this fraction of its history counts as a miss
MISS_THRESHOLD = 0.5
#: a strategy "keeps locality" when fewer than this fraction of its later turns miss
KEEPS_LOCALITY = 0.25
#: objectives: column, direction, label
OBJECTIVES = (
    ("ttft_mean_ms", "min", "mean TTFT"),
    ("ttft_p99_ms", "min", "p99 TTFT"),
    ("hit_rate", "max", "hit rate"),
    ("imbalance", "min", "balance (imbalance)"),
)
RESULT_METRICS = ("ttft_mean_ms", "ttft_p99_ms", "hit_rate", "request_reuse", "later_turn_reuse", "history_reuse",
                  "imbalance")


def with_history(records: pd.DataFrame) -> pd.DataFrame:
    """Ok records with ``history``, ``reuse`` and ``history_reuse`` columns (NaN on turn 0)."""
    d = records[records["status"] == "ok"].copy()
    d = d.sort_values(["experiment", "hardware", "policy", "round", "conversation", "turn"])
    key = [d["experiment"], d["hardware"], d["policy"], d["round"], d["conversation"]]
    prev = (d["prompt_tokens"] + d["output_tokens"]).groupby(key).shift(1)
    prev_turn = d["turn"].groupby(key).shift(1)
    d["history"] = prev.where(prev_turn == d["turn"] - 1)
    d["reuse"] = d["cached_tokens"] / d["prompt_tokens"]
    d["history_reuse"] = (np.minimum(d["cached_tokens"], d["history"]) / d["history"]).where(d["history"] > 0)
    return d


def per_round(records: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (policy, round): the summary's metrics and the two reuse figures."""
    d = with_history(records)
    later = d[d["turn"] >= 1]
    g = later.groupby(["policy", "round"])
    reuse = pd.DataFrame({
        "request_reuse": d.groupby(["policy", "round"])["reuse"].mean(),
        "later_turn_reuse": g["reuse"].mean(),
        "history_reuse": g.apply(lambda x: np.minimum(x["cached_tokens"], x["history"]).sum() / x["history"].sum()
                                 if x["history"].sum() > 0 else math.nan, include_groups=False),
    }).reset_index()
    cols = ["policy", "round", "ttft_mean_ms", "ttft_p99_ms", "hit_rate", "imbalance", "requests", "errors"]
    return summary[cols].merge(reuse, on=["policy", "round"], how="left")


def results(records: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """results.csv: one row per strategy, means over rounds (+ ``*_ci95`` half-widths)."""
    pr = per_round(records, summary)
    rows = []
    for pol, g in pr.groupby("policy", sort=False):
        row = {"strategy": pol, "rounds": int(g["round"].nunique())}
        for m in RESULT_METRICS:
            iv = interval(g[m])
            row[m] = iv.mean
            row[f"{m}_ci95"] = iv.half
        rows.append(row)
    out = pd.DataFrame(rows)
    return out.sort_values(["ttft_mean_ms", "strategy"]).reset_index(drop=True)


def per_turn(records: pd.DataFrame) -> pd.DataFrame:
    """per_turn_results.csv: reuse by turn index per strategy (pooled over rounds)."""
    d = with_history(records)
    g = d.groupby(["policy", "turn"])
    out = pd.DataFrame({
        "requests": g.size(),
        "reuse": g["reuse"].mean(),
        "token_reuse": g["cached_tokens"].sum() / g["prompt_tokens"].sum(),
        "history_reuse": g["history_reuse"].mean(),
        "ttft_mean_ms": g["ttft_ms"].mean(),
    }).reset_index().rename(columns={"policy": "strategy"})
    return out


def best_per_objective(res: pd.DataFrame) -> dict[str, str]:
    """The best strategy per objective (ties: first in mean-TTFT order)."""
    best = {}
    for col, how, label in OBJECTIVES:
        idx = res[col].idxmin() if how == "min" else res[col].idxmax()
        best[label] = res.loc[idx, "strategy"]
    return best


def worse_than_best(pr: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """Per (strategy, objective): is the strategy significantly worse than the objective's best?

    The best is the strategy with the best mean over rounds (ties: the lower mean
    TTFT, as :func:`best_per_objective`). Rounds replay the same
    workload for every strategy, so the comparison is paired by round: a one-sided
    paired t-test of (strategy - best) in the bad direction, significant at ``alpha``.
    With fewer than two shared rounds nothing is significant (``p`` is NaN).

    Returns:
        Columns strategy, objective, best, mean, best_mean, p, worse.
    """
    rows = []
    order = pr.groupby("policy")["ttft_mean_ms"].mean().sort_values(kind="stable").index  # ties: faster first
    for col, how, label in OBJECTIVES:
        means = pr.groupby("policy")[col].mean().reindex(order)
        best = means.idxmin() if how == "min" else means.idxmax()
        b = pr[pr["policy"] == best].set_index("round")[col]
        for pol, g in pr.groupby("policy", sort=False):
            v = g.set_index("round")[col]
            shared = v.index.intersection(b.index)
            diff = (v[shared] - b[shared]) * (1 if how == "min" else -1)  # > 0: worse
            p = math.nan
            if pol != best and len(shared) >= 2:
                sd = float(diff.std(ddof=1))
                if sd > 0:
                    p = float(_st.t.sf(diff.mean() / (sd / math.sqrt(len(diff))), len(diff) - 1))
                else:
                    p = 0.0 if diff.mean() > 0 else 1.0
            rows.append({"strategy": pol, "objective": label, "best": best, "mean": float(means[pol]),
                         "best_mean": float(means[best]), "p": p, "worse": bool(p < alpha) if p == p else False})
    return pd.DataFrame(rows)


def pareto_front(res: pd.DataFrame, x: str = "hit_rate", y: str = "ttft_mean_ms") -> list[str]:
    """Strategies not dominated in (higher ``x``, lower ``y``)."""
    front = []
    for i, r in res.iterrows():
        dominated = ((res[x] >= r[x]) & (res[y] <= r[y]) & ((res[x] > r[x]) | (res[y] < r[y]))).any()
        if not dominated:
            front.append(r["strategy"])
    return front


@dataclass(frozen=True)
class ClaimResult:
    """A claim of the original study, tested: ``holds`` None means these records cannot tell."""

    claim: str
    holds: bool | None
    evidence: str


VERDICT = {True: "holds", False: "does not hold", None: "undecided by these records"}


def claim_no_single_winner(pr: pd.DataFrame, alpha: float = 0.05) -> ClaimResult:
    """"No single strategy wins every metric".

    Holds when every strategy is significantly worse than some other strategy on at
    least one objective (:func:`worse_than_best`); does not hold when one strategy has
    the best mean on every objective; otherwise the rounds cannot tell (``None``), and
    the evidence names the strategies that no objective separates from the best.
    """
    name = "no single strategy wins every metric"
    wb = worse_than_best(pr, alpha)
    best = wb.groupby("objective")["best"].first()
    ev_best = "; ".join(f"best {obj}: {b}" for obj, b in best.items())
    if best.nunique() == 1:
        return ClaimResult(name, False, f"{best.iloc[0]} has the best mean on every objective ({ev_best})")
    beaten = wb.groupby("strategy")["worse"].any()
    unbeaten = sorted(beaten[~beaten].index)
    if not unbeaten:
        return ClaimResult(name, True, f"every strategy is significantly worse than another on some objective "
                                       f"(paired t-test over rounds, p < {alpha:g}; {ev_best})")
    return ClaimResult(name, None, f"the best means differ by objective ({ev_best}), but {', '.join(unbeaten)} "
                                   f"is not significantly worse than the best on any objective with these rounds")


def miss_persistence(records: pd.DataFrame, threshold: float = MISS_THRESHOLD) -> pd.DataFrame:
    """Per strategy: does a miss at turn k make the following turns miss too?

    Over later turns (k >= 1) of each conversation: ``miss_rate`` (the strategy's base
    rate), ``p_miss_after_miss`` = P(turn k+1 misses | turn k missed) and
    ``p_miss_after_hit`` = P(turn k+1 misses | turn k hit), with a one-sided Fisher
    exact test that the first is larger; the same two at k+2 (``*_2``); and
    ``recompute_tokens_per_turn``, the slope of tokens a missing turn recomputes
    against its turn index (what a miss throws away grows with the history).
    """
    d = with_history(records)
    d = d[d["turn"] >= 1].copy()
    d["miss"] = d["history_reuse"] < threshold
    key = ["policy", "round", "conversation"]
    d = d.sort_values([*key, "turn"])
    grp = d.groupby(key)
    for m in (1, 2):
        d[f"next_miss_{m}"] = grp["miss"].shift(-m)
        d[f"next_turn_{m}"] = grp["turn"].shift(-m)

    def table(g: pd.DataFrame, m: int) -> tuple[float, float, float, int]:
        pairs = g[g[f"next_turn_{m}"] == g["turn"] + m]
        nxt = pairs[f"next_miss_{m}"].astype(bool)
        mm, mh = int((pairs["miss"] & nxt).sum()), int((pairs["miss"] & ~nxt).sum())
        hm, hh = int((~pairs["miss"] & nxt).sum()), int((~pairs["miss"] & ~nxt).sum())
        pmm = mm / (mm + mh) if mm + mh else math.nan
        phm = hm / (hm + hh) if hm + hh else math.nan
        p = (float(_st.fisher_exact([[mm, mh], [hm, hh]], alternative="greater")[1])
             if (mm + mh) and (hm + hh) else math.nan)
        return pmm, phm, p, len(pairs)

    rows = []
    for pol, g in d.groupby("policy", sort=False):
        pmm, phm, p, n_pairs = table(g, 1)
        pmm2, phm2, p2, _ = table(g, 2)
        missed = g[g["miss"]]
        recompute = (missed["prompt_tokens"] - missed["cached_tokens"]).astype(float)
        slope = float(np.polyfit(missed["turn"], recompute, 1)[0]) if missed["turn"].nunique() > 1 else math.nan
        rows.append({
            "strategy": pol, "later_turns": len(g), "misses": int(g["miss"].sum()),
            "miss_rate": float(g["miss"].mean()) if len(g) else math.nan, "pairs": n_pairs,
            "p_miss_after_miss": pmm, "p_miss_after_hit": phm, "fisher_p": p,
            "p_miss_after_miss_2": pmm2, "p_miss_after_hit_2": phm2, "fisher_p_2": p2,
            "recompute_tokens_per_turn": slope,
        })
    return pd.DataFrame(rows)


def claim_miss_destroys(mp: pd.DataFrame, alpha: float = 0.01) -> ClaimResult:
    """"A routing miss destroys accumulated locality for the rest of a conversation".

    Only a strategy that accumulates locality can lose it: the test covers strategies
    whose later turns rarely miss (``miss_rate <`` :data:`KEEPS_LOCALITY`) and that
    missed at least once. For such a strategy the claim holds when a miss is followed by another miss
    more often than not (``p_miss_after_miss > 0.5``) and significantly more often than
    after a hit (Fisher p < alpha), and still significantly so two turns later: the lost
    locality does not come back. The study says a miss "can" do this, so the claim
    holds when it holds for at least one strategy; the evidence names them all.
    """
    name = "a routing miss destroys accumulated locality for the rest of a conversation"
    keeps = mp[(mp["miss_rate"] < KEEPS_LOCALITY) & (mp["misses"] > 0) & mp["fisher_p"].notna()]
    if keeps.empty:
        return ClaimResult(name, None, "no locality-keeping strategy ever missed")
    persists = keeps[(keeps["p_miss_after_miss"] > 0.5) & (keeps["fisher_p"] < alpha) & (keeps["fisher_p_2"] < alpha)]
    parts = [f"{r.strategy}: P(next misses | miss) {r.p_miss_after_miss:.2f}, P(next misses | hit) "
             f"{r.p_miss_after_hit:.2f}" for r in keeps.itertuples()]
    holds = not persists.empty
    head = (f"misses persist under {', '.join(persists['strategy'])}" if holds else
            "under every locality-keeping strategy that missed, the turn after a miss usually hits again "
            "(the conversation re-homes where it was recomputed)")
    skipped = mp[mp["miss_rate"] >= KEEPS_LOCALITY]["strategy"].tolist()
    tail = f"; not applicable (locality not kept to begin with): {', '.join(skipped)}" if skipped else ""
    return ClaimResult(name, holds, head + " (" + "; ".join(parts) + ")" + tail)


def summary_text(res: pd.DataFrame, claims: Sequence[ClaimResult], experiment: str = "kv-reuse") -> str:
    """summary.txt: strategies ranked by mean TTFT, the best per objective, the claims."""
    lines = [f"Multi-turn KV reuse under routing ({experiment}): strategies ranked by mean TTFT", ""]
    w = max(len(s) for s in res["strategy"]) if len(res) else 8
    lines.append(f"{'rank':>4}  {'strategy':<{w}}  {'mean TTFT ms':>12}  {'p99 TTFT ms':>11}  {'hit rate':>8}  "
                 f"{'later reuse':>11}  {'history reuse':>13}  {'imbalance':>9}")
    for i, r in enumerate(res.itertuples(), 1):
        lines.append(f"{i:>4}  {r.strategy:<{w}}  {r.ttft_mean_ms:>12.1f}  {r.ttft_p99_ms:>11.1f}  {r.hit_rate:>8.3f}  "
                     f"{r.later_turn_reuse:>11.3f}  {r.history_reuse:>13.3f}  {r.imbalance:>9.3f}")
    lines += ["", "Best per objective:"]
    for label, name in best_per_objective(res).items():
        lines.append(f"  {label}: {name}")
    lines += ["", "Claims:"]
    for c in claims:
        verdict = VERDICT[c.holds]
        lines.append(f"  {c.claim}: {verdict}. {c.evidence}")
    return "\n".join(lines) + "\n"


def alpha_of(policy: str) -> float:
    """The alpha of a ``cost_aware:alpha=...`` spec (NaN otherwise)."""
    if not policy.startswith("cost_aware"):
        return math.nan
    for part in policy.partition(":")[2].split(","):
        k, _, v = part.partition("=")
        if k.strip() == "alpha":
            return float(v)
    return 1.0  # the policy's default


def write_outputs(records: pd.DataFrame, summary: pd.DataFrame, out: Path) -> dict:
    """Write results.csv, per_turn_results.csv and summary.txt under ``out``; return the pieces."""
    out = Path(out)
    res = results(records, summary)
    pr = per_round(records, summary)
    pt = per_turn(records)
    mp = miss_persistence(records)
    claims = [claim_no_single_winner(pr), claim_miss_destroys(mp)]
    write_csv(res, out / "results.csv")
    write_csv(pt, out / "per_turn_results.csv")
    write_text(out / "summary.txt", summary_text(res, claims, ",".join(sorted(records["experiment"].unique()))))
    return {"results": res, "per_round": pr, "per_turn": pt, "miss": mp, "claims": claims,
            "worse": worse_than_best(pr)}
