"""Research note 2, rebuilt: its tables with published | simulated | measured side by side.

Published values come only from ``paper/reported/note2.csv`` (with their source);
a value the reference does not give shows a dash. Simulated and measured values are
means over rounds with a t-based 95% interval (:mod:`kvroute.analysis.stats`);
measured cells are dashes until ``results/measure/<exp>`` exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from kvroute.analysis.stats import Interval, interval
from kvroute.analysis.tables import DASH, Tex, fmt, num, num_ci
from kvroute.analysis.validation import reported_experiment_matches

#: experiments the note reads (simulated; measured where the hardware exists)
EXPERIMENTS = ("note2-6turn", "note2-20turn", "note2-a100", "note2-large")
#: the sweeps that test the analysis's claims (one round each), the base experiment whose
#: round 0 is each sweep's middle point, and what each varies
SWEEPS = {"note2-workers": "workers", "note2-turns": "turns", "note2-replies": "reply_tokens"}
SWEEP_BASE = "note2-6turn"


@dataclass(frozen=True)
class Row:
    """One table row: what it shows and where its values come from."""

    label: str
    experiment: str
    hardware: str
    policy: str
    metric: str
    digits: int = 1
    percent: bool = False
    shown: str | None = None  # what the policy column shows (default: the policy's name)
    table: str = "table2"  # the note's table the published value must come from


def read_published(path: Path) -> pd.DataFrame:
    """paper/reported/note2.csv; every row must carry a source."""
    pub = pd.read_csv(path, dtype={"experiment": str, "hardware": str})
    if "source" not in pub.columns or pub["source"].isna().any():
        raise ValueError(f"{path}: every published value needs a source")
    return pub


def published_range(pub: pd.DataFrame | None, row: Row) -> tuple[float, float] | None:
    """The published value of ``row`` as (low, high) in the row's units (percent where
    ``row.percent``; low == high for a single value), None when the reference gives none.

    Only a value published in the same table counts: the least-loaded comparison
    does not borrow Table 2's KV-aware figures, which may come from other runs.
    """
    if pub is None:
        return None
    m = pub[(pub["table"] == row.table) & (pub["metric"] == row.metric) & (pub["policy"] == row.policy)
            & pub["experiment"].map(lambda e: reported_experiment_matches(e, row.experiment))
            & pub["hardware"].isin([row.hardware, "*"])]
    if m.empty:
        return None
    r = m.iloc[0]
    k = 100 if row.percent else 1
    lo = float(r["value"]) * k
    return (lo, float(r["value_hi"]) * k) if pd.notna(r.get("value_hi")) else (lo, lo)


def published_cell(pub: pd.DataFrame | None, row: Row) -> Tex:
    """The published value (or range) for ``row``, a dash when the reference gives none."""
    given = published_range(pub, row)
    if given is None:
        return DASH
    lo, hi = given
    # a percentage with the decimals it was published with (86%, 72.8%), a time with the row's
    d = max(_decimals(lo, row.digits), _decimals(hi, row.digits)) if row.percent else row.digits
    if lo != hi:  # "-6 to -3": a dash between negative numbers reads as a minus
        return (Tex(rf"\num{{{fmt(lo, d)}}} to \num{{{fmt(hi, d)}}}") if min(lo, hi) < 0
                else Tex(rf"\numrange{{{fmt(lo, d)}}}{{{fmt(hi, d)}}}"))
    return num(lo, d)


def _decimals(x: float, most: int) -> int:
    """The fewest decimals (at most ``most``) that show ``x`` without rounding it."""
    return next((d for d in range(most) if abs(round(x, d) - x) < 1e-9), most)


def difference(given: tuple[float, float] | None, value: float, points: bool) -> float:
    """How far ``value`` is from a published value or range: in points (a percentage or a
    relative change: to the nearer end of a range, 0 inside it) when ``points``, else
    relative, in percent (to the single value or the nearer end). NaN when nothing was
    published or ``value`` is missing."""
    if given is None or not np.isfinite(value):
        return float("nan")
    lo, hi = sorted(given)
    if lo <= value <= hi:
        return 0.0
    ref = lo if value < lo else hi
    if points:
        return value - ref
    return 100 * (value / ref - 1) if ref else float("nan")


def difference_cell(diff: float, points: bool) -> Tex:
    """``\\num{-5}\\%`` (relative) or ``\\num{0.7}\\,pt`` (points); a dash for NaN."""
    if not np.isfinite(diff):
        return DASH
    return Tex(rf"\num{{{fmt(diff, 1)}}}\,pt") if points else Tex(rf"\num{{{fmt(diff, 0)}}}\%")


#: how :func:`range_verdict` places a value against a published range
INSIDE, ABOVE, BELOW, ACROSS_HIGH, ACROSS_LOW = ("inside", "above", "below", "across the upper end of",
                                                 "across the lower end of")


def range_verdict(iv: Interval, lo: float, hi: float) -> str:
    """Where a simulated mean and its interval over rounds lie against a published range
    [lo, hi] (a single value: lo == hi): wholly ``inside``, wholly ``above`` or
    ``below``, or across one end (the interval reaches both sides of it). Without an
    interval (one round) the mean alone decides. Words to put before "the range"."""
    if iv.n == 0 or not np.isfinite(iv.mean):
        raise ValueError("range_verdict: no simulated value")
    if lo > hi:
        raise ValueError(f"range_verdict: lo {lo!r} is above hi {hi!r}")
    half = iv.half if iv.has_interval else 0.0
    a, b = iv.mean - half, iv.mean + half
    if lo <= a and b <= hi:
        return INSIDE
    if a > hi:
        return ABOVE
    if b < lo:
        return BELOW
    return ACROSS_HIGH if b > hi else ACROSS_LOW


def rounds_interval(summary: pd.DataFrame | None, row: Row) -> Interval:
    """The row's metric over rounds from a summary (n = 0 when absent)."""
    if summary is None:
        return interval([])
    s = summary[(summary["experiment"] == row.experiment) & (summary["hardware"] == row.hardware)
                & (summary["policy"] == row.policy)]
    vals = s[row.metric] * (100 if row.percent else 1)
    return interval(vals)


def side_by_side(
    rows: Sequence[Row],
    sims: dict[str, pd.DataFrame | None],
    measured: dict[str, pd.DataFrame | None],
    pub: pd.DataFrame | None,
    policy_names: dict[str, str] | None = None,
) -> pd.DataFrame:
    """A frame ``measure | policy | published | simulated | difference | measured`` of
    LaTeX cells; the difference is the simulated mean's from the published value
    (:func:`difference`: points for a percentage, else percent)."""
    names = policy_names or {}
    out = []
    for r in rows:
        sim = rounds_interval(sims.get(r.experiment), r)
        meas = rounds_interval(measured.get(r.experiment), r)
        out.append({
            "measure": r.label,
            "policy": r.shown if r.shown is not None else names.get(r.policy, r.policy),
            "published": published_cell(pub, r),
            "simulated": num_ci(sim, r.digits),
            "difference": difference_cell(difference(published_range(pub, r), sim.mean, r.percent), r.percent),
            "measured": num_ci(meas, r.digits),
        })
    return pd.DataFrame(out)


def measured_with_prediction(measured: Sequence[str], simulated: Sequence[str],
                             counterpart=None) -> list[tuple[str | None, str | None]]:
    """Pairs ``(measured policy, simulated policy)`` for a table of both, like for like.

    A production router's measured row (``vllm_router:cache_aware``) stands beside its
    kvroute counterpart's simulation (:func:`kvroute.policies.counterpart`), as in
    ``results/validation/summary.csv``, instead of apart from it with a dash in each; a
    simulated policy that predicts no measured one, and a measured one with no
    simulation, get a pair of their own (None on the missing side). Order: the measured
    policies as given, then the simulated ones left over.
    """
    if counterpart is None:
        from kvroute.policies import counterpart
    sims = list(dict.fromkeys(simulated))
    pairs: list[tuple[str | None, str | None]] = []
    used: set[str] = set()
    for pol in dict.fromkeys(measured):
        sim = counterpart(pol) or pol
        pairs.append((pol, sim if sim in sims else None))
        if sim in sims:
            used.add(sim)
    pairs += [(None, sim) for sim in sims if sim not in used]
    return pairs


def any_measured(rows: Sequence[Row], measured: dict[str, pd.DataFrame | None]) -> bool:
    """Whether any row has a measured value (else a table leaves its measured column out)."""
    return any(rounds_interval(measured.get(r.experiment), r).n > 0 for r in rows)


def paired_change(summary: pd.DataFrame, hardware: str, policy: str, base: str, metric: str,
                  experiment: str | None = None) -> Interval:
    """``policy``'s ``metric`` relative to ``base``'s, ``policy / base - 1`` round by round
    (the policies of a round replay the same workload), with its interval over rounds."""
    s = summary[summary["hardware"] == hardware]
    if experiment is not None:
        s = s[s["experiment"] == experiment]
    a = s[s["policy"] == policy].set_index("round")[metric]
    b = s[s["policy"] == base].set_index("round")[metric]
    both = a.index.intersection(b.index)
    return interval(a[both] / b[both] - 1)


def return_share(records: pd.DataFrame) -> pd.DataFrame:
    """Per (experiment, hardware, policy, load, round): the share of later turns (turn > 0)
    routed to the worker that served the same conversation's previous turn, column
    ``share``. Round-robin over n workers returns a turn there about one time in n if
    the turns are independent of the rotation; a policy that keeps locality, always."""
    keys = ["experiment", "hardware", "policy", "load", "round"]
    r = records[records["status"] == "ok"].sort_values([*keys, "conversation", "turn"])
    prev = r.groupby([*keys, "conversation"], dropna=False)["worker"].shift()
    later = r["turn"] > 0
    back = (r["worker"] == prev)[later]
    out = back.groupby([r.loc[later, k] for k in keys], dropna=False).agg(["mean", "size"]).reset_index()
    return out.rename(columns={"mean": "share", "size": "later_turns"})


def gain(summary: pd.DataFrame, metric: str, policy: str = "kv_aware", base: str = "round_robin") -> pd.DataFrame:
    """Per (experiment, hardware, load, round): ``1 - policy / base`` of ``metric``, the
    saving of ``policy`` over ``base`` (positive when ``policy`` is lower), column ``gain``."""
    keys = ["experiment", "hardware", "load", "round"]
    s = summary.assign(load=summary["load"] if "load" in summary else float("nan"))
    a = s[s["policy"] == policy].set_index(keys)[metric]
    b = s[s["policy"] == base].set_index(keys)[metric]
    both = a.index.intersection(b.index)
    return (1 - a[both] / b[both]).rename("gain").reset_index()


def trend(values: Sequence[float]) -> str:
    """``rises`` or ``falls`` when every step goes that way, else ``not monotone``."""
    d = np.diff(np.asarray(values, dtype=float))
    if len(d) and (d > 0).all():
        return "rises"
    if len(d) and (d < 0).all():
        return "falls"
    return "not monotone"


def sweep_matches_base(sweep, base, axis: str) -> None:
    """Check that a sweep's middle point may be the base experiment's round 0: the same
    seed and the same workload apart from the swept parameter (``workers`` sweeps the
    hardware instead). ValueError naming what differs."""
    if sweep.seed != base.seed:
        raise ValueError(f"experiment {sweep.name}: seed {sweep.seed} differs from {base.name}'s {base.seed}; "
                         f"its middle point is {base.name}'s round 0")
    drop = {sweep.load.param} if sweep.load is not None else set()
    if axis != "workers" and sweep.load is None:
        raise ValueError(f"experiment {sweep.name}: no load axis over {axis}")
    a = {k: v for k, v in sweep.workload.get("params", {}).items() if k not in drop}
    b = {k: v for k, v in base.workload.get("params", {}).items() if k not in drop}
    if sweep.workload.get("generator") != base.workload.get("generator") or a != b:
        raise ValueError(f"experiment {sweep.name}: workload {sweep.workload} differs from {base.name}'s "
                         f"{base.workload} beyond {axis}")


def table2_rows() -> list[Row]:
    rows = []
    for exp, chats in (("note2-6turn", "6-turn"), ("note2-20turn", "20-turn")):
        for pol in ("round_robin", "kv_aware"):
            rows.append(Row(f"time to complete (s), {chats}", exp, "a6000x4", pol, "time_to_complete_s", 1))
    for exp, chats in (("note2-6turn", "6-turn"), ("note2-20turn", "20-turn")):
        for pol in ("round_robin", "kv_aware"):
            rows.append(Row(f"later-turn TTFT (ms), {chats}", exp, "a6000x4", pol, "later_ttft_mean_ms", 0))
    for exp, chats in (("note2-6turn", "6-turn"), ("note2-20turn", "20-turn")):
        for pol in ("round_robin", "kv_aware"):
            rows.append(Row(f"cache hit rate (%), {chats}", exp, "a6000x4", pol, "hit_rate", 1, percent=True))
    return rows


#: the chat lengths of the least-loaded comparison: (experiment, label)
CHATS = (("note2-6turn", "6-turn"), ("note2-20turn", "20-turn"))
#: the note's relative figures of KV-aware against least-loaded: (label, metric, chat
#: lengths); published as ``<metric>_change`` of policy ``kv_aware vs least_loaded``
LL_CHANGES = (("time to complete, change (%)", "time_to_complete_s", ("note2-6turn", "note2-20turn")),
              ("p90 TTFT, change (%)", "ttft_p90_ms", ("note2-20turn",)))


#: the load signals the least-loaded comparison is simulated with: the suffix of each
#: variant's experiment (note2-20turn-scraped: the same workload draws, the load as a
#: scraping router sees it; its file says which)
LL_VARIANTS = ("", "-scraped")
#: the variants' experiments (the note's own are in EXPERIMENTS)
LL_VARIANT_EXPERIMENTS = tuple(f"{e}{v}" for v in LL_VARIANTS if v for e, _ in CHATS)


def least_loaded_table(sims: dict[str, pd.DataFrame | None], pub: pd.DataFrame | None,
                       hardware: str = "a6000x4", variants: Sequence[str] = ("",)) -> pd.DataFrame:
    """KV-aware against least-loaded as the note published it: ``measure | chats |
    published`` then ``simulated<suffix> | difference<suffix>`` for each variant (the
    suffix of its experiments' names, "" for the note's own). The changes (KV-aware /
    least-loaded - 1) are paired round by round (:func:`paired_change`), in percent;
    least-loaded's hit rate in percent; the difference in points (:func:`difference`). A
    figure whose chat length the note does not state is shown for both."""
    label = dict(CHATS)
    out = []

    def cells(row: Row, ivs: dict[str, Interval]) -> dict:
        given = published_range(pub, row)
        d = {"measure": row.label, "chats": label[row.experiment], "published": published_cell(pub, row)}
        for v in variants:
            d[f"simulated{v}"] = num_ci(ivs[v], 1)
            d[f"difference{v}"] = difference_cell(difference(given, ivs[v].mean, True), True)
        return d

    for measure, metric, exps in LL_CHANGES:
        for exp in exps:
            row = Row(measure, exp, hardware, "kv_aware vs least_loaded", f"{metric}_change", 1, percent=True,
                      table="least_loaded")
            ivs = {}
            for v in variants:
                s = sims.get(exp + v)
                iv = (paired_change(s, hardware, "kv_aware", "least_loaded", metric) if s is not None else interval([]))
                ivs[v] = Interval(100 * iv.mean, 100 * iv.lo, 100 * iv.hi, 100 * iv.half, iv.n) if iv.n else iv
            out.append(cells(row, ivs))
    for exp, _ in CHATS:
        row = Row("least-loaded hit rate (%)", exp, hardware, "least_loaded", "hit_rate", 1, percent=True,
                  table="least_loaded")
        ivs = {v: rounds_interval(sims.get(exp + v), replace(row, experiment=exp + v)) for v in variants}
        out.append(cells(row, ivs))
    return pd.DataFrame(out)


#: research note 2's three A100 arrangements: (label, hardware, policy)
A100_ARRANGEMENTS = (
    ("two workers, round-robin", "a100x1-2workers", "round_robin"),
    ("two workers, KV-aware", "a100x1-2workers", "kv_aware"),
    ("one worker, whole GPU", "a100x1", "round_robin"),
)


def table3_rows() -> list[Row]:
    rows = []
    for metric, label, digits, pct in (("time_to_complete_s", "time to complete (s)", 1, False),
                                       ("later_ttft_mean_ms", "later-turn TTFT (ms)", 0, False),
                                       ("hit_rate", "cache hit rate (%)", 1, True)):
        for arr, hw, pol in A100_ARRANGEMENTS:
            rows.append(Row(label, "note2-a100", hw, pol, metric, digits, pct, shown=arr, table="table3"))
    return rows


def change(a: float, b: float) -> float:
    """Relative change from a to b (b / a - 1)."""
    return b / a - 1 if a else float("nan")


def plural(n: int, word: str) -> str:
    """``1 worker``, ``4 workers``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def setup_table(experiments: dict, setup_csv: Path | None, policy_names: dict[str, str]) -> pd.DataFrame:
    """Table 1: item | published | this rebuild (generated from experiments and hardware profiles).

    Args:
        experiments: name -> :class:`kvroute.experiment.Experiment` (note2-6turn,
            note2-20turn, note2-a100).
        setup_csv: paper/reported/note2_setup.csv (None: the published column is dashes).
    """
    from kvroute.hardware import load_hardware
    from kvroute.workload import generator_params, words_to_tokens

    six, twenty = experiments["note2-6turn"], experiments["note2-20turn"]
    p = {**generator_params("note2"), **six.workload.get("params", {})}
    tpw = p["tokens_per_word"]
    hws = []
    for exp in experiments.values():
        for hw, _ in exp.runs:
            if hw not in hws:
                hws.append(hw)
    profiles = [load_hardware(h) for h in hws]
    main = profiles[0]
    pols = []
    for exp in experiments.values():
        for _, ps in exp.runs:
            for q in ps:
                if q not in pols:
                    pols.append(q)
    t20 = {**generator_params("note2"), **twenty.workload.get("params", {})}["turns"]
    rounds = sorted({e.rounds for e in experiments.values()})
    rebuild = {
        "model": f"{main.model.name} ({main.model.params / 1e9:.2f} B parameters, BF16)",
        "engine": f"simulated {main.engine.kind.replace('vllm', 'vLLM')} {main.engine.version}-style engine: "
                  "prefix caching on, "
                  f"{main.engine.block_size}-token blocks, chunked prefill of {main.engine.max_num_batched_tokens} tokens",
        "hardware": "; ".join(f"{h.name}: {h.gpus} x {h.gpu_name}, {plural(h.workers, 'worker')}" for h in profiles),
        "traffic": f"{p['chats']} chats at once, closed loop, starts spread over {p['ramp_s']:g} s",
        "prompts": f"{p['system_words']}-word system prompt ({words_to_tokens(p['system_words'], tpw)} tokens) shared by "
                   f"every chat; {p['user_words']}-word user turns ({words_to_tokens(p['user_words'], tpw)} tokens); "
                   f"{p['reply_tokens']}-token replies",
        "chat length": f"{p['turns']} turns and {t20} turns",
        "policies": "; ".join(policy_names.get(q, q) for q in pols),
        "runs": f"{' or '.join(str(r) for r in rounds)} rounds for every experiment and policy",
    }
    pub = pd.read_csv(setup_csv) if setup_csv is not None and Path(setup_csv).is_file() else None
    rows = []
    for item, value in rebuild.items():
        given = pub[pub["item"] == item]["published"] if pub is not None else pd.Series(dtype=str)
        rows.append({"item": item, "published": given.iloc[0] if len(given) else DASH, "rebuild": value})
    return pd.DataFrame(rows)


#: macro keys of the CPU measurement's policies (LaTeX names take letters only)
CPU_POLICY_KEYS = {
    "round_robin": "RoundRobin", "least_loaded": "LeastLoaded", "kv_aware": "Kv",
    "cost_aware:alpha=1.0": "Cost", "hybrid_sticky:threshold_ms=500": "Hybrid", "sglang_router:cache_aware": "Sglang",
    "vllm_router:cache_aware": "Vllm",
}
#: imbalance (coefficient of variation of work over the workers) from which a run counts as
#: piled onto one worker, and below which as spread: with two workers, 1 is all on one
PILED_IMBALANCE, SPREAD_IMBALANCE = 0.9, 0.25


def locality_and_load(summary: pd.DataFrame) -> pd.DataFrame:
    """Per policy, means over rounds: hit rate, imbalance, later-turn TTFT, time to complete,
    and whether the run piled onto one worker or spread (see the thresholds above)."""
    cols = ["hit_rate", "imbalance", "later_ttft_mean_ms", "time_to_complete_s"]
    out = summary.groupby("policy", sort=True)[cols].mean()
    out["piled"] = out["imbalance"] >= PILED_IMBALANCE
    out["spread"] = out["imbalance"] < SPREAD_IMBALANCE
    return out


#: how the validation tables name the metrics of results/validation/*.csv
METRIC_LABELS = {
    "time_to_complete_s": ("time to complete", "s", 1), "later_ttft_mean_ms": ("later-turn TTFT", "ms", 0),
    "ttft_mean_ms": ("mean TTFT", "ms", 0), "ttft_p90_ms": ("p90 TTFT", "ms", 0), "hit_rate": ("hit rate", "%", 1),
    "imbalance": ("imbalance", "", 2), "time_to_complete_s_change": ("time to complete, change", "%", 1),
    "ttft_p90_ms_change": ("p90 TTFT, change", "%", 0),
}
#: the experiments' short names in the validation table
EXPERIMENT_LABELS = {"note2-6turn": "6-turn", "note2-20turn": "20-turn", "note2-a100": "A100, 6-turn", "note2-cpu": "CPU",
                     "note2-6turn-scraped": "6-turn, scraped", "note2-20turn-scraped": "20-turn, scraped",
                     "explainer-two-replicas": "sticky"}


def in_points(metric: str) -> bool:
    """Fractions (hit rates, relative changes) are compared in percentage points."""
    return metric == "hit_rate" or metric.endswith("_change")


def error_points(row) -> float:
    """A validation row's error as the tables show it: percentage points for fractions
    (to the nearer end of a published range, 0 inside), the difference itself for the
    imbalance (a coefficient of variation, near zero when spread: a ratio to it means
    nothing), else the relative error in percent."""
    if row.metric == "imbalance":
        return row.predicted - row.measured
    if not in_points(row.metric):
        return 100 * row.rel_error
    lo, hi = row.measured_lo, row.measured_hi
    if pd.notna(lo) and pd.notna(hi) and lo <= row.predicted <= hi:
        return 0.0
    ref = row.measured if pd.isna(lo) else (lo if row.predicted < lo else hi)
    return 100 * (row.predicted - ref)


def _error_cell(metric: str, err: float) -> Tex:
    if metric == "imbalance":
        return Tex(rf"\num{{{fmt(err, 2)}}}")
    if in_points(metric):
        return Tex(rf"\num{{{fmt(err, 1)}}}\,pt")
    return Tex(rf"\num{{{fmt(err, 0)}}}\%")


def validation_table(rows: pd.DataFrame, arrangement: dict[tuple[str, str], str] | None = None,
                     measured: bool = False) -> pd.DataFrame:
    """``results/validation/published.csv`` (or, ``measured``, ``summary.csv``) as LaTeX
    cells: experiment, policy, measure, the published value (a range where published as
    one) or the measured mean with the half-width of its interval over rounds, the
    prediction and the error (:func:`error_points`)."""
    from kvroute.analysis.tables import policy_tex

    out = []
    for r in rows.itertuples(index=False):
        label, unit, d = METRIC_LABELS.get(r.metric, (r.metric, "", 2))
        k = 100 if unit == "%" else 1
        if measured:
            half = (r.measured_hi - r.measured_lo) / 2 if pd.notna(r.measured_lo) and pd.notna(r.measured_hi) else None
            given = num_ci(Interval(k * r.measured, k * r.measured_lo, k * r.measured_hi, k * half, 2) if half is not None
                           else interval([k * r.measured]), d)
        elif pd.notna(r.measured_lo) and pd.notna(r.measured_hi) and r.measured_lo != r.measured_hi:
            lo, hi = fmt(k * r.measured_lo, d), fmt(k * r.measured_hi, d)
            given = (Tex(rf"\num{{{lo}}} to \num{{{hi}}}") if min(r.measured_lo, r.measured_hi) < 0
                     else Tex(rf"\numrange{{{lo}}}{{{hi}}}"))
        else:
            given = num(k * r.measured, d)
        pol = (arrangement or {}).get((r.hardware, r.policy))
        a, sep, b = str(r.policy).partition(" vs ")
        shown = Tex(pol) if pol else (policy_tex(a) + Tex(" vs ") + policy_tex(b) if sep else policy_tex(r.policy))
        out.append({"experiment": EXPERIMENT_LABELS.get(r.experiment, r.experiment), "policy": shown,
                    "measure": f"{label} ({unit})" if unit else label, "given": given,
                    "predicted": num(k * r.predicted, d), "error": _error_cell(r.metric, error_points(r))})
    return pd.DataFrame(out)
