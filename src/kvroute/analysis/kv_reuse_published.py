"""The kv-reuse study's published figures beside the rebuild, and its five findings judged.

The original (multi-turn-kv-reuse-bench) publishes, per strategy, mean and p99 TTFT, hit
rate, a "reuse" figure and imbalance, reuse by turn index for four strategies, the best
strategy per objective and five findings (``paper/reported/kv_reuse.csv`` and
``kv_reuse_findings.csv``). Its "reuse" is not defined; kvroute compares it with
``request_reuse``, the mean over every request (turn 0 included) of cached / prompt
tokens, the reading its values fit (below the token-weighted hit rate, as turn 0 reuses
nothing). Its imbalance is "a dispersion measure"; kvroute's is the coefficient of
variation of per-worker work.

Each finding is split into the parts it asserts; a part is a comparison of two means
(paired over rounds: with two rounds or more it counts only when a one-sided paired
t-test gives p < 0.05, with one round the means decide). A finding holds when every part
does, holds in part when some do, does not hold when none does, and is undecided when
no part can be decided. Comparisons are among the original's strategies only (like for
like): kvroute's additions are reported beside, never counted as the original's best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as _st

from kvroute.analysis.kv_reuse import claim_miss_destroys

HOLDS, PART, NOT, UNDECIDED = "holds", "holds in part", "does not hold", "undecided"
#: significance of a paired comparison over rounds
ALPHA = 0.05
#: the five metrics of the original's results table: its column, kvroute's column
METRICS = {"ttft_mean_ms": "mean TTFT", "ttft_p99_ms": "p99 TTFT", "hit_rate": "hit rate",
           "request_reuse": "reuse", "imbalance": "imbalance"}
#: the four objectives of "best per objective" and finding 5 (direction: min or max)
OBJECTIVES = {"ttft_mean_ms": "min", "ttft_p99_ms": "min", "hit_rate": "max", "imbalance": "min"}
HYBRID_LARGE = "hybrid_sticky:threshold_ms=5000"
HYBRIDS = ("hybrid_sticky:threshold_ms=500", HYBRID_LARGE)


def read_published(reported: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``kv_reuse.csv`` and ``kv_reuse_findings.csv`` of the folder ``reported``."""
    reported = Path(reported)
    return pd.read_csv(reported / "kv_reuse.csv"), pd.read_csv(reported / "kv_reuse_findings.csv")


def original_strategies(published: pd.DataFrame) -> list[str]:
    """The original's strategies as kvroute specs, in its mean-TTFT order, and the one
    its best-balance line names (cost-aware at alpha 2)."""
    return list(dict.fromkeys(published.loc[published["table"].isin(["results", "best"]), "policy"]))


def beside(res: pd.DataFrame, published: pd.DataFrame) -> pd.DataFrame:
    """One row per (strategy, metric) the original publishes: ``published``, ``rebuilt``
    (mean over rounds) with ``rebuilt_ci95``, and ``rel_error`` (rebuilt / published - 1)."""
    rows = []
    byname = res.set_index("strategy")
    for r in published[published["table"].isin(["results", "best"])].itertuples(index=False):
        have = r.policy in byname.index and r.metric in byname.columns
        value = float(byname.loc[r.policy, r.metric]) if have else math.nan
        ci = float(byname.loc[r.policy, f"{r.metric}_ci95"]) if have and f"{r.metric}_ci95" in byname else math.nan
        rows.append({"key": r.key, "strategy": r.policy, "metric": r.metric, "published": float(r.value),
                     "rebuilt": value, "rebuilt_ci95": ci, "rel_error": value / float(r.value) - 1 if have else math.nan})
    return pd.DataFrame(rows)


def turns_beside(per_turn: pd.DataFrame, published: pd.DataFrame) -> pd.DataFrame:
    """Reuse by turn index: one row per (strategy, turn) the original publishes, with the
    rebuild's mean reuse of that turn's requests (pooled over rounds) and their count."""
    rows = []
    pt = per_turn.set_index(["strategy", "turn"])
    for r in published[published["table"] == "per_turn"].itertuples(index=False):
        turn = int(r.metric.rsplit("_", 1)[1])
        have = (r.policy, turn) in pt.index
        rows.append({"key": r.key, "strategy": r.policy, "turn": turn, "published": float(r.value),
                     "rebuilt": float(pt.loc[(r.policy, turn), "reuse"]) if have else math.nan,
                     "requests": int(pt.loc[(r.policy, turn), "requests"]) if have else 0})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Part:
    """One assertion of a finding, decided from the records: ``holds`` None if they cannot tell."""

    text: str
    holds: bool | None
    evidence: str = ""


@dataclass(frozen=True)
class Finding:
    """A finding of the original, its parts, and the figures it quotes beside the rebuild's."""

    number: int
    statement: str
    parts: tuple[Part, ...]
    #: (quantity, published, rebuilt, unit) of the figures the finding quotes; unit as
    #: kv_reuse_findings.csv's (fraction, ms, count)
    figures: tuple[tuple[str, float, float, str], ...] = field(default=())

    @property
    def verdict(self) -> str:
        decided = [p.holds for p in self.parts if p.holds is not None]
        if not decided:
            return UNDECIDED
        if all(decided) and len(decided) == len(self.parts):
            return HOLDS
        return PART if any(decided) else NOT


#: objective names in prose
OBJECTIVE_NAMES = {"ttft_mean_ms": "mean TTFT", "ttft_p99_ms": "p99 TTFT", "hit_rate": "hit rate", "imbalance": "imbalance"}


def readable(spec: str) -> str:
    """A policy spec in plain prose: ``cost_aware:alpha=0.25`` -> ``cost-aware (alpha 0.25)``."""
    from kvroute.analysis.tables import POLICY_NAMES

    name, _, params = spec.partition(":")
    parts = []
    for kv in filter(None, params.split(",")):
        k, _, v = kv.partition("=")
        parts.append(f"{v} ms" if k.strip() == "threshold_ms" else f"{k.strip()} {v.strip()}")
    return POLICY_NAMES.get(name, name) + (f" ({', '.join(parts)})" if parts else "")


def _series(pr: pd.DataFrame, policy: str, col: str) -> pd.Series:
    return pr[pr["policy"] == policy].set_index("round")[col]


def better(pr: pd.DataFrame, a: str, b: str, col: str, how: str) -> tuple[bool | None, str]:
    """Is ``a`` better than ``b`` on ``col`` (``how`` min: lower is better)? Paired over
    rounds; None when either is missing or the rounds do not separate them."""
    va, vb = _series(pr, a, col), _series(pr, b, col)
    shared = va.index.intersection(vb.index)
    if not len(shared):
        return None, f"{a} or {b} not run"
    d = (vb[shared] - va[shared]) * (1 if how == "min" else -1)  # > 0: a better
    text = f"{a} {va[shared].mean():.4g} vs {b} {vb[shared].mean():.4g}"
    if len(shared) < 2:
        return bool(d.mean() > 0) if d.mean() != 0 else None, text + " (one round: the means decide)"
    sd = float(d.std(ddof=1))
    if sd == 0:
        return (bool(d.mean() > 0) if d.mean() != 0 else None), text + " (identical in every round)"
    t = d.mean() / (sd / math.sqrt(len(d)))
    p_better, p_worse = float(_st.t.sf(t, len(d) - 1)), float(_st.t.cdf(t, len(d) - 1))
    if p_better < ALPHA:
        return True, text + f" (paired p {p_better:.3g})"
    if p_worse < ALPHA:
        return False, text + f" (paired p {p_worse:.3g} the other way)"
    return None, text + f" (rounds do not separate them: p {min(p_better, p_worse):.2g})"


def best(pr: pd.DataFrame, strategies: list[str], col: str, how: str) -> str:
    """The strategy of ``strategies`` with the best mean of ``col`` over rounds."""
    means = pr[pr["policy"].isin(strategies)].groupby("policy")[col].mean()
    return str(means.idxmin() if how == "min" else means.idxmax())


def is_best(pr: pd.DataFrame, strategies: list[str], who: str, col: str, how: str) -> Part:
    """``who`` is better on ``col`` than every other of ``strategies`` (each pair decided by :func:`better`)."""
    others = [s for s in strategies if s != who and s in set(pr["policy"])]
    text = f"{readable(who)} best on {OBJECTIVE_NAMES.get(col, col)}"
    if who not in set(pr["policy"]):
        return Part(text, None, f"{who} not run")
    results = [better(pr, who, o, col, how) for o in others]
    if any(r is False for r, _ in results):
        beaten_by = [o for o, (r, _) in zip(others, results) if r is False]
        return Part(text, False, f"beaten by {', '.join(beaten_by)}")
    if all(r is True for r, _ in results):
        return Part(text, True, f"better than all {len(others)} others")
    tied = [o for o, (r, _) in zip(others, results) if r is None]
    return Part(text, None, f"not separated from {', '.join(tied)}")


def _mean(pr: pd.DataFrame, policy: str, col: str) -> float:
    s = _series(pr, policy, col)
    return float(s.mean()) if len(s) else math.nan


def _turn_reuse(pt: pd.DataFrame, policy: str, turn: int, min_requests: int) -> float:
    r = pt[(pt["strategy"] == policy) & (pt["turn"] == turn)]
    return float(r["reuse"].iloc[0]) if len(r) and int(r["requests"].iloc[0]) >= min_requests else math.nan


def findings(pr: pd.DataFrame, pt: pd.DataFrame, mp: pd.DataFrame, published: pd.DataFrame,
             quoted: pd.DataFrame, min_requests: int = 30) -> list[Finding]:
    """The five findings judged on one experiment's records.

    Args:
        pr: :func:`kvroute.analysis.kv_reuse.per_round` (with ``request_reuse``).
        pt: :func:`kvroute.analysis.kv_reuse.per_turn`.
        mp: :func:`kvroute.analysis.kv_reuse.miss_persistence`.
        published: ``kv_reuse.csv`` (the original's strategies).
        quoted: ``kv_reuse_findings.csv`` (the figures the findings quote, by key).
        min_requests: a turn's reuse counts only from this many requests.
    """
    orig = [s for s in original_strategies(published) if s in set(pr["policy"])]
    qv = quoted.set_index("key")

    def fig(key: str, label: str, rebuilt: float) -> tuple[str, float, float, str]:
        return label, float(qv.loc[key, "value"]), rebuilt, str(qv.loc[key, "unit"])

    stmt = quoted.groupby("finding")["statement"].first()
    ll, st, hy = "least_loaded", "sticky", HYBRID_LARGE
    out = []

    # 1: sticky's reuse at turn 1 above least-load's at turn 7; a miss destroys locality
    s1, l7 = _turn_reuse(pt, st, 1, min_requests), _turn_reuse(pt, ll, 7, min_requests)
    a = Part("sticky's reuse at turn 1 above least-loaded's at turn 7", None if np.isnan(s1) or np.isnan(l7) else bool(s1 > l7),
             f"{s1:.3f} vs {l7:.3f}")
    miss = claim_miss_destroys(mp[mp["strategy"].isin(orig)])
    out.append(Finding(1, stmt[1], (a, Part("a routing miss destroys accumulated locality", miss.holds, miss.evidence)),
                       (fig("f1_sticky_turn1", "sticky's reuse at turn 1", s1),
                        fig("f1_least_turn7", "least-loaded's reuse at turn 7", l7))))

    # 2: sticky has the highest hit rate, and worse mean and p99 TTFT than least-load
    m_ratio = _mean(pr, st, "ttft_mean_ms") / _mean(pr, ll, "ttft_mean_ms") - 1
    p_ratio = _mean(pr, st, "ttft_p99_ms") / _mean(pr, ll, "ttft_p99_ms") - 1
    worse_mean, ev_m = better(pr, ll, st, "ttft_mean_ms", "min")
    worse_p99, ev_p = better(pr, ll, st, "ttft_p99_ms", "min")
    out.append(Finding(2, stmt[2], (
        is_best(pr, orig, st, "hit_rate", "max"),
        Part("sticky's mean TTFT worse than least-loaded's", worse_mean, ev_m),
        Part("sticky's p99 TTFT worse than least-loaded's", worse_p99, ev_p)),
        (fig("f2_sticky_hit", "sticky's hit rate", _mean(pr, st, "hit_rate")),
         fig("f2_mean_worse", "sticky's mean TTFT against least-loaded's", m_ratio),
         fig("f2_p99_worse", "sticky's p99 TTFT against least-loaded's", p_ratio))))

    # 3: hybrid (large threshold) best mean TTFT; keeps part of sticky's hit rate, faster than sticky
    kept = _mean(pr, hy, "hit_rate") / _mean(pr, st, "hit_rate")
    faster = 1 - _mean(pr, hy, "ttft_mean_ms") / _mean(pr, st, "ttft_mean_ms")
    fast, ev_f = better(pr, hy, st, "ttft_mean_ms", "min")
    out.append(Finding(3, stmt[3], (
        is_best(pr, orig, hy, "ttft_mean_ms", "min"),
        Part("hybrid sticky (5000 ms) faster on average than sticky", fast, ev_f)),
        (fig("f3_hit_kept", "hybrid (5000 ms)'s hit rate as a share of sticky's", kept),
         fig("f3_mean_better", "hybrid (5000 ms)'s mean TTFT below sticky's", faster))))

    # 4: a cost-aware strategy has the lowest p99, and better balance than both hybrids
    tail = best(pr, orig, "ttft_p99_ms", "min")
    cost = [s for s in orig if s.startswith("cost_aware")]
    low_tail = best(pr, cost, "ttft_p99_ms", "min") if cost else None
    parts = [Part("a cost-aware strategy has the lowest p99 TTFT",
                  is_best(pr, orig, low_tail, "ttft_p99_ms", "min").holds if low_tail else None,
                  f"lowest p99: {tail}")]
    for h in HYBRIDS:
        r, ev = better(pr, low_tail, h, "imbalance", "min") if low_tail else (None, "no cost-aware strategy")
        parts.append(Part(f"its imbalance below {readable(h)}'s", r, ev))
    out.append(Finding(4, stmt[4], tuple(parts),
                       (fig("f4_best_tail", "lowest p99 TTFT of a cost-aware strategy",
                            _mean(pr, low_tail, "ttft_p99_ms") if low_tail else math.nan),)))

    # 5: no strategy dominates: none is best on all four objectives
    champs = {col: best(pr, orig, col, how) for col, how in OBJECTIVES.items()}
    dominating = [s for s in orig if all(is_best(pr, orig, s, col, how).holds for col, how in OBJECTIVES.items())]
    out.append(Finding(5, stmt[5], (Part("no strategy best on every objective", not dominating,
                                         "; ".join(f"best {c}: {s}" for c, s in champs.items())),),
                       (fig("f5_none_dominates", "strategies dominating every objective", float(len(dominating))),)))
    return out


def findings_table(found: list[Finding]) -> pd.DataFrame:
    """One row per finding: number, verdict, and its parts with their verdicts."""
    mark = {True: "yes", False: "no", None: "undecided"}
    return pd.DataFrame([{"finding": f.number, "verdict": f.verdict,
                          "parts": "; ".join(f"{p.text}: {mark[p.holds]}" for p in f.parts)} for f in found])
