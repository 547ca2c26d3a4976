"""Research note 2, rebuilt: its tables with published | simulated | measured side by side.

Published values come only from ``paper/reported/note2.csv`` (with their source);
a value the reference does not give shows a dash. Simulated and measured values are
means over rounds with a t-based 95% interval (:mod:`kvroute.analysis.stats`);
measured cells are dashes until ``results/measure/<exp>`` exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvroute.analysis.stats import Interval, interval
from kvroute.analysis.tables import DASH, Tex, fmt, num, num_ci

#: experiments the note reads (simulated; measured where the hardware exists)
EXPERIMENTS = ("note2-6turn", "note2-20turn", "note2-a100", "note2-large")


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


def published_cell(pub: pd.DataFrame | None, row: Row) -> Tex:
    """The published value (or range) for ``row``, a dash when the reference gives none.

    Only a value published in the same table counts: the least-loaded comparison
    does not borrow Table 2's KV-aware figures, which may come from other runs.
    """
    if pub is None:
        return DASH
    m = pub[(pub["table"] == row.table) & (pub["metric"] == row.metric) & (pub["policy"] == row.policy)
            & pub["experiment"].isin([row.experiment, "*"]) & pub["hardware"].isin([row.hardware, "*"])]
    if m.empty:
        return DASH
    r = m.iloc[0]
    k = 100 if row.percent else 1
    if pd.notna(r.get("value_hi")):
        lo, hi = fmt(r["value"] * k, 0 if row.percent else row.digits), fmt(r["value_hi"] * k, 0 if row.percent else row.digits)
        return Tex(rf"\numrange{{{lo}}}{{{hi}}}")
    return num(r["value"] * k, row.digits)


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
    """A frame ``measure | policy | published | simulated | measured`` of LaTeX cells."""
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
            "measured": num_ci(meas, r.digits),
        })
    return pd.DataFrame(out)


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


def least_loaded_rows() -> list[Row]:
    rows = []
    for pol in ("kv_aware", "least_loaded"):
        rows.append(Row("time to complete (s), 20-turn", "note2-20turn", "a6000x4", pol, "time_to_complete_s", 1,
                        table="least_loaded"))
    for pol in ("kv_aware", "least_loaded"):
        rows.append(Row("p90 TTFT (ms), 20-turn", "note2-20turn", "a6000x4", pol, "ttft_p90_ms", 0,
                        table="least_loaded"))
    return rows


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
        "engine": f"simulated {main.engine.kind} {main.engine.version}-style engine: prefix caching on, "
                  f"{main.engine.block_size}-token blocks, chunked prefill of {main.engine.max_num_batched_tokens} tokens",
        "hardware": "; ".join(f"{h.name}: {h.gpus} x {h.gpu_name}, {h.workers} worker(s)" for h in profiles),
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
EXPERIMENT_LABELS = {"note2-6turn": "6-turn", "note2-20turn": "20-turn", "note2-a100": "A100, 6-turn", "note2-cpu": "CPU"}


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
            given = Tex(rf"\numrange{{{fmt(k * r.measured_lo, d)}}}{{{fmt(k * r.measured_hi, d)}}}")
        else:
            given = num(k * r.measured, d)
        pol = (arrangement or {}).get((r.hardware, r.policy))
        a, sep, b = str(r.policy).partition(" vs ")
        shown = Tex(pol) if pol else (policy_tex(a) + Tex(" vs ") + policy_tex(b) if sep else policy_tex(r.policy))
        out.append({"experiment": EXPERIMENT_LABELS.get(r.experiment, r.experiment), "policy": shown,
                    "measure": f"{label} ({unit})" if unit else label, "given": given,
                    "predicted": num(k * r.predicted, d), "error": _error_cell(r.metric, error_points(r))})
    return pd.DataFrame(out)
