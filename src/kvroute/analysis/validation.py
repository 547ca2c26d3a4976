"""Predictions beside what they predict: ``results/validation/{summary,published}.csv``.

``summary.csv`` puts each simulated (predicted) metric beside its measurement on real
engines, one row per (experiment, hardware, policy, metric) that was measured; a
production router's measured row is predicted by its kvroute counterpart
(:func:`kvroute.policies.counterpart`). ``published.csv`` puts each published figure of
the notes (``paper/reported/*.csv``) beside its prediction. Like for like: a simulated
and a measured row stand side by side only when both routed with the same view and load
signal (the records' ``view`` and ``load_signal`` columns), and on a trace scaled alike
(``scaling``: a recorded trace scaled to the engines); a mismatch is an error naming both.

Columns: ``experiment, hardware, policy, metric, predicted, measured, measured_lo,
measured_hi, rel_error, in_sample``. ``measured`` is the mean over rounds (or the
published value), ``measured_lo``/``measured_hi`` its 95% interval over rounds (NaN with
one round) or the published range; ``rel_error`` is ``predicted / measured - 1``, or, for
a published range, the relative distance to its nearer end (0 inside); for a published
change (``METRIC_change``, itself a ratio) it is the difference of the two changes. ``in_sample`` is
true where the hardware family's coefficients were fitted to that experiment (their
provenance's ``in_sample_for`` in ``hardware/coefficients.yaml``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import pandas as pd

from kvroute.analysis.stats import interval

METRICS = ("ttft_mean_ms", "ttft_p90_ms", "later_ttft_mean_ms", "time_to_complete_s", "hit_rate", "imbalance")
COLUMNS = ("experiment", "hardware", "policy", "metric", "predicted", "measured", "measured_lo", "measured_hi",
           "rel_error", "in_sample")
#: suffix of a published relative figure: ``METRIC_change`` of ``A vs B`` is A / B - 1
CHANGE = "_change"


class ValidationError(ValueError):
    """Predicted and measured rows that are not the same experiment."""


@functools.cache  # asked once per row: read each file once per process
def in_sample_experiments(hardware: str, coefficients: tuple[Path, ...] = ()) -> frozenset[str]:
    """Experiments the hardware family's coefficients were fitted to (their provenance's
    ``in_sample_for``): from the first of ``coefficients`` (files of entries the simulation
    used instead, ``kvroute simulate --coefficients``) that has the family, else from
    ``hardware/coefficients.yaml``."""
    from kvroute.hardware import hardware_dir, load_hardware
    from kvroute.yamlfile import read_yaml

    family = load_hardware(hardware).coefficients_name
    for f in coefficients:
        entries = read_yaml(f) or {}
        if family in entries:
            return frozenset((entries[family].get("provenance") or {}).get("in_sample_for") or ())
    entry = read_yaml(hardware_dir() / "coefficients.yaml")[family]
    return frozenset((entry.get("provenance") or {}).get("in_sample_for") or ())


def _rel(predicted: float, lo: float, hi: float | None = None, difference: bool = False) -> float:
    """predicted / value - 1 (or predicted - value), to the nearer end of [lo, hi] if a range."""
    if hi is not None and not np.isnan(hi) and hi != lo:
        a, b = min(lo, hi), max(lo, hi)
        if a <= predicted <= b:
            return 0.0
        lo = a if predicted < a else b
    if difference:
        return predicted - lo
    return predicted / lo - 1 if lo else float("nan")


def _views(requests: pd.DataFrame | None, column: str = "view") -> dict[tuple[str, str, str], str]:
    """``column``'s values per (experiment, hardware, policy); records written before the
    column existed (or with it null) say nothing."""
    if requests is None or column not in requests:
        return {}
    known = requests[requests[column].notna()]
    v = known.groupby(["experiment", "hardware", "policy"], sort=False)[column].agg(lambda s: ",".join(sorted(set(s))))
    return {k: str(x) for k, x in v.items()}


def measured_rows(
    sim: pd.DataFrame,
    measured: pd.DataFrame,
    sim_requests: pd.DataFrame | None = None,
    measured_requests: pd.DataFrame | None = None,
    counterpart: Callable[[str], str | None] | None = None,
    in_sample: Callable[[str], set[str]] = in_sample_experiments,
) -> pd.DataFrame:
    """One row per measured (experiment, hardware, policy, metric) with its prediction.

    Args:
        sim, measured: summaries (one row per round) of the simulation and the measurement.
        sim_requests, measured_requests: their records, to check both used the same view.
        counterpart: production router spec -> the kvroute policy simulating it.
    """
    if sim.empty or measured.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    if counterpart is None:
        from kvroute.policies import counterpart
    sim_view, meas_view = _views(sim_requests), _views(measured_requests)
    sim_signal, meas_signal = _views(sim_requests, "load_signal"), _views(measured_requests, "load_signal")
    sim_scale, meas_scale = _views(sim_requests, "scaling"), _views(measured_requests, "scaling")
    rows = []
    for (exp, hw, pol), m in measured.groupby(["experiment", "hardware", "policy"], sort=True):
        sim_pol = counterpart(pol) or pol
        s = sim[(sim["experiment"] == exp) & (sim["hardware"] == hw) & (sim["policy"] == sim_pol)]
        if s.empty:
            continue
        mv, sv = meas_view.get((exp, hw, pol)), sim_view.get((exp, hw, sim_pol))
        if mv and sv and mv != "peer" and mv != sv:
            raise ValidationError(f"{exp} on {hw}: {pol} was measured with view {mv!r} but simulated ({sim_pol}) "
                                  f"with view {sv!r}; set the experiment's `view` so both read the same")
        ml, sl = meas_signal.get((exp, hw, pol)), sim_signal.get((exp, hw, sim_pol))
        if ml and sl and ml != "peer" and ml != sl:
            raise ValidationError(f"{exp} on {hw}: {pol} was measured with load_signal {ml!r} but simulated "
                                  f"({sim_pol}) with {sl!r}; both read the experiment's `load_signal`")
        mc, sc = meas_scale.get((exp, hw, pol)), sim_scale.get((exp, hw, sim_pol))
        if mc and sc and mc != sc:
            raise ValidationError(f"{exp} on {hw}: {pol} was measured on a trace scaled {mc!r} but simulated "
                                  f"({sim_pol}) on one scaled {sc!r}; compare like with like")
        fitted = exp in in_sample(hw)
        for metric in METRICS:
            if metric not in m or metric not in s:
                continue
            iv = interval(m[metric])
            pred = float(s[metric].mean())
            rows.append({"experiment": exp, "hardware": hw, "policy": pol, "metric": metric, "predicted": pred,
                         "measured": iv.mean, "measured_lo": iv.lo, "measured_hi": iv.hi,
                         "rel_error": _rel(pred, iv.mean), "in_sample": fitted})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _predicted(sim: pd.DataFrame, exp: str, hw: str, policy: str, metric: str) -> float:
    if metric.endswith(CHANGE):
        a, _, b = policy.partition(" vs ")
        base = metric[: -len(CHANGE)]
        return _predicted(sim, exp, hw, a.strip(), base) / _predicted(sim, exp, hw, b.strip(), base) - 1
    s = sim[(sim["experiment"] == exp) & (sim["hardware"] == hw) & (sim["policy"] == policy)]
    return float(s[metric].mean()) if len(s) and metric in s else float("nan")


def is_experiment_pattern(experiment: str) -> bool:
    """Whether a published figure's ``experiment`` is a glob (:func:`reported_experiment_matches`)."""
    return any(c in experiment for c in "*?[")


def reported_experiment_matches(pattern: str, experiment: str, note: str | None = None) -> bool:
    """Whether a published figure's ``experiment`` (``paper/reported/*.csv``) applies to
    ``experiment``: the same name, or a glob over it (``note2-20turn*``); ``*`` alone is
    every experiment of the note ``note`` (``note2-*``), or of any note when none is given."""
    if pattern == "*" and note is not None:
        pattern = f"{note}-*"
    return fnmatchcase(experiment, pattern)


def published_rows(
    sim: pd.DataFrame,
    reported: pd.DataFrame,
    in_sample: Callable[[str], set[str]] = in_sample_experiments,
    anchors: frozenset[tuple[str, str, str]] = frozenset(),
) -> pd.DataFrame:
    """Every published figure of ``reported`` (``paper/reported/*.csv`` rows with a metric)
    beside its prediction from ``sim``. An experiment ``*`` (a figure whose chat length the
    original does not state) gives one row per simulated experiment of that note (named
    after the reported file: ``note2.csv`` -> ``note2-*``) on that hardware, except its
    sweeps (experiments with a load axis): they vary the workload the figure was
    published for. Any other pattern (``note2-20turn*``: the experiment and its variants,
    such as another load signal) is matched as :func:`reported_experiment_matches` does. A hardware ``*`` (an original whose hardware is not published) gives
    one row per profile the experiment was simulated on. ``anchors``: (experiment, policy,
    metric) figures the simulation was matched to (an operating point's target), in sample
    whatever the coefficients."""
    if sim.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    rows = []
    for r in reported[reported["metric"].notna()].itertuples(index=False):
        if is_experiment_pattern(r.experiment):
            swept = sim["load_param"].notna() if "load_param" in sim else pd.Series(False, index=sim.index)
            on_hw = sim.loc[(sim["hardware"] == r.hardware) & ~swept, "experiment"].unique()
            exps = sorted(e for e in on_hw if reported_experiment_matches(r.experiment, e, r.note))
        else:
            exps = [r.experiment]
        hi = float(r.value_hi) if pd.notna(getattr(r, "value_hi", float("nan"))) else float("nan")
        for exp in exps:
            hws = (sorted(sim.loc[sim["experiment"] == exp, "hardware"].unique()) if r.hardware == "*"
                   else [r.hardware])
            for hw in hws:
                pred = _predicted(sim, exp, hw, r.policy, r.metric)
                if np.isnan(pred):
                    continue
                lo = float(r.value)
                rows.append({"experiment": exp, "hardware": hw, "policy": r.policy, "metric": r.metric,
                             "predicted": pred, "measured": lo if np.isnan(hi) else (lo + hi) / 2,
                             "measured_lo": lo if not np.isnan(hi) else float("nan"), "measured_hi": hi,
                             "rel_error": _rel(pred, lo, hi, difference=r.metric.endswith(CHANGE)),
                             "in_sample": exp in in_sample(hw) or (exp, r.policy, r.metric) in anchors})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def operating_point_anchors(experiments: Path, names: Iterable[str]) -> frozenset[tuple[str, str, str]]:
    """(experiment, policy, metric) of each named experiment's operating-point target
    (``operating_point`` in ``experiments/NAME.yaml``): matched, so in sample."""
    from kvroute.experiment import load_experiment

    out = set()
    for name in names:
        f = Path(experiments) / f"{name}.yaml"
        if f.is_file():
            op = load_experiment(f).operating_point
            if op is not None:
                out.add((name, op.policy, op.metric))
    return frozenset(out)


def read_reported(directory: Path) -> pd.DataFrame:
    """The published figures of every ``paper/reported/*.csv`` that has metric columns."""
    frames = []
    for f in sorted(Path(directory).glob("*.csv")):
        df = pd.read_csv(f, dtype={"experiment": str, "hardware": str, "policy": str})
        if {"experiment", "hardware", "policy", "metric", "value"} <= set(df.columns):
            frames.append(df.assign(note=f.stem))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["experiment", "hardware", "policy", "metric", "value", "note"])


#: the timing metrics whose median error the fidelity goal judges
TIMING = ("ttft_mean_ms", "ttft_p90_ms", "later_ttft_mean_ms", "time_to_complete_s")
#: an imbalance above this means the run piled onto some worker
PILED = 0.5


def headline(summary: pd.DataFrame) -> dict[str, float]:
    """The measures of fit over the measured rows: median |relative error| of the four
    timing metrics, the largest hit-rate miss in points, whether a predicted imbalance
    above :data:`PILED` is exactly where a measured one is, and the share of
    distinguishable policy pairs (:func:`order_checks`) the prediction orders the same."""
    timing = summary[summary["metric"].isin(TIMING)]
    hit = summary[summary["metric"] == "hit_rate"]
    imb = summary[summary["metric"] == "imbalance"]
    orders = order_checks(summary)
    return {
        "timing_median_abs_rel_error": float(timing["rel_error"].abs().median()) if len(timing) else float("nan"),
        "hit_rate_max_points": float((100 * (hit["predicted"] - hit["measured"]).abs()).max()) if len(hit) else float("nan"),
        "piled_agree": float(((imb["predicted"] > PILED) == (imb["measured"] > PILED)).all()) if len(imb) else float("nan"),
        "order_pairs": float(len(orders)),
        "order_same_share": float(orders["predicted_same"].mean()) if len(orders) else float("nan"),
    }


def order_checks(summary: pd.DataFrame) -> pd.DataFrame:
    """Every pair of policies whose measured intervals do not overlap, per experiment,
    hardware and metric, with whether the prediction orders them the same way.

    Columns: ``experiment, hardware, metric, lower, higher`` (the policies, by measured
    value), ``predicted_same`` (bool). Pairs with an undefined interval (one round) are
    not judged.
    """
    rows = []
    for (exp, hw, metric), g in summary.groupby(["experiment", "hardware", "metric"], sort=True):
        g = g.dropna(subset=["measured_lo", "measured_hi"]).sort_values("measured")
        recs = list(g.itertuples(index=False))
        for i, a in enumerate(recs):
            for b in recs[i + 1:]:
                if a.measured_hi < b.measured_lo:  # a's interval lies wholly below b's
                    rows.append({"experiment": exp, "hardware": hw, "metric": metric, "lower": a.policy,
                                 "higher": b.policy, "predicted_same": bool(a.predicted < b.predicted)})
    return pd.DataFrame(rows, columns=["experiment", "hardware", "metric", "lower", "higher", "predicted_same"])


def _time_over(worker: pd.DataFrame, max_seqs: int) -> float:
    """Seconds during which one worker's records held more than ``max_seqs`` requests in
    flight (sent and not yet finished); at a tie a finish comes before an arrival."""
    times = np.concatenate([worker["arrival_s"].to_numpy(), worker["finish_s"].to_numpy()])
    steps = np.concatenate([np.ones(len(worker)), -np.ones(len(worker))])
    order = np.lexsort((steps, times))
    times, level = times[order], np.cumsum(steps[order])
    return float(np.sum(np.diff(times)[level[:-1] > max_seqs]))


def oversubscribed_share(records: pd.DataFrame, max_seqs: int) -> pd.DataFrame:
    """Per policy and round: the share of the round (first arrival to last finish) during
    which its busiest worker held more than ``max_seqs`` requests in flight (sent and not
    yet finished). Beyond its engine's ``max_num_seqs`` a request waits for a whole reply
    to end: the overload a policy without load feedback can fall into (docs/live.md, "vLLM
    on this machine", item 5). Rows without a finish (failed requests) are left out.

    Columns: ``policy, round, share``.
    """
    out = []
    ok = records.dropna(subset=["arrival_s", "finish_s"])
    for (policy, rnd), run in ok.groupby(["policy", "round"], sort=True):
        span = run["finish_s"].max() - run["arrival_s"].min()
        worst = max((_time_over(w, max_seqs) for _, w in run.groupby("worker")), default=0.0)
        out.append({"policy": policy, "round": int(rnd), "share": worst / span if span > 0 else 0.0})
    return pd.DataFrame(out, columns=["policy", "round", "share"])


#: what ``workers.csv`` compares per worker: its share of the requests, their mean TTFT,
#: their decode time per streamed token after the first, and the share of the round it
#: held more than ``max_num_seqs`` requests
WORKER_METRICS = ("request_share", "ttft_mean_ms", "decode_ms_per_token", "oversubscribed_share")
WORKER_COLUMNS = COLUMNS[:3] + ("worker",) + COLUMNS[3:9]


def _worker_metrics(run: pd.DataFrame, max_seqs: int) -> dict[str, dict[str, float]]:
    """One round of one policy: each worker's :data:`WORKER_METRICS`."""
    span = run["finish_s"].max() - run["arrival_s"].min()
    out = {}
    for worker, w in run.groupby("worker", sort=True):
        decoded = w[w["output_tokens"] > 1]
        per_token = (decoded["e2e_ms"] - decoded["ttft_ms"]) / (decoded["output_tokens"] - 1)
        out[str(worker)] = {"request_share": len(w) / len(run), "ttft_mean_ms": float(w["ttft_ms"].mean()),
                            "decode_ms_per_token": float(per_token.mean()) if len(per_token) else float("nan"),
                            "oversubscribed_share": _time_over(w, max_seqs) / span if span > 0 else 0.0}
    return out


def worker_rows(
    sim_requests: pd.DataFrame,
    measured_requests: pd.DataFrame,
    max_seqs: Callable[[str], int],
    counterpart: Callable[[str], str | None] | None = None,
) -> pd.DataFrame:
    """Each measured worker beside its prediction: where a policy's error comes from.

    A policy's row in ``summary.csv`` mixes its workers; on the CPU profile they differ
    (the client shares w1's core), so a miss can be one worker's. One row per
    (experiment, hardware, policy, worker, metric of :data:`WORKER_METRICS`), the
    measured mean over rounds with its 95% interval, the prediction the mean of the
    simulated rounds. Only successful requests count; a production router whose records
    name no worker the simulation has (a peer reports ``unknown``) gets no rows.

    Args:
        sim_requests, measured_requests: the records (``requests.parquet``).
        max_seqs: hardware name -> its engines' ``max_num_seqs``.
        counterpart: production router spec -> the kvroute policy simulating it.
    """
    if counterpart is None:
        from kvroute.policies import counterpart
    keys = ["experiment", "hardware", "policy"]

    def per_round(records: pd.DataFrame, limit: int) -> dict[str, dict[str, list[float]]]:
        """worker -> metric -> one value per round; a round that sent a worker nothing
        gives it shares of 0 and no TTFT or decode time."""
        ok = records[records["status"] == "ok"].dropna(subset=["arrival_s", "finish_s"])
        rounds = [_worker_metrics(run, limit) for _, run in ok.groupby("round", sort=True)]
        idle = {"request_share": 0.0, "ttft_mean_ms": math.nan, "decode_ms_per_token": math.nan,
                "oversubscribed_share": 0.0}
        workers = sorted({w for r in rounds for w in r})
        return {w: {k: [r.get(w, idle)[k] for r in rounds] for k in WORKER_METRICS} for w in workers}

    rows = []
    for (exp, hw, pol), m in measured_requests.groupby(keys, sort=True):
        sim_pol = counterpart(pol) or pol
        s = sim_requests[(sim_requests["experiment"] == exp) & (sim_requests["hardware"] == hw)
                         & (sim_requests["policy"] == sim_pol)]
        if s.empty:
            continue
        limit = max_seqs(hw)
        meas, pred = per_round(m, limit), per_round(s, limit)
        for worker in sorted(set(meas) & set(pred)):
            for metric in WORKER_METRICS:
                iv, p = interval(meas[worker][metric]), interval(pred[worker][metric]).mean
                rows.append({"experiment": exp, "hardware": hw, "policy": pol, "worker": worker, "metric": metric,
                             "predicted": p, "measured": iv.mean, "measured_lo": iv.lo, "measured_hi": iv.hi,
                             "rel_error": _rel(p, iv.mean)})
    return pd.DataFrame(rows, columns=list(WORKER_COLUMNS))


#: ``machine.csv``: the canary's times (kvroute.live.canary) on each engine core while the
#: engines were probed and before each measured run; ``ratio`` above 1: the machine was
#: slower during the measurement than in the probes its simulation was fitted to
MACHINE_COLUMNS = ("experiment", "hardware", "cpu", "work", "probe_ms", "measured_ms", "measured_max_ms", "runs",
                   "ratio")


def machine_rows(measured: Iterable[Path]) -> pd.DataFrame:
    """Per measured folder with a probe file (``load.json``'s ``canary`` beside
    ``probe.json``'s), CPU and kind of work: the median canary time over the probe
    sessions and over the runs, the slowest run, and their ratio. A report of the machine's
    drift, never an input to any prediction."""
    import json

    rows = []
    for d in measured:
        load, probe = Path(d) / "load.json", Path(d) / "probe.json"
        if not (load.is_file() and probe.is_file()):
            continue
        runs = json.loads(load.read_text()).get("canary") or {}
        probed = json.loads(probe.read_text()).get("probed", {}).get("canary") or []
        if not runs or not probed:
            continue  # measured before the canary existed
        summary = pd.read_csv(Path(d) / "summary.csv", usecols=["experiment", "hardware"]).iloc[0]
        ran = pd.DataFrame([r for rs in runs.values() for r in rs])
        base = pd.DataFrame(probed).groupby(["cpu", "work"]).ms.median()
        for (cpu, work), g in ran.groupby(["cpu", "work"]):
            ref = base.get((cpu, work), math.nan)
            med = float(g.ms.median())
            rows.append({"experiment": summary.experiment, "hardware": summary.hardware, "cpu": int(cpu),
                         "work": work, "probe_ms": float(ref), "measured_ms": med, "measured_max_ms": float(g.ms.max()),
                         "runs": len(g), "ratio": med / ref if ref > 0 else math.nan})
    return pd.DataFrame(rows, columns=list(MACHINE_COLUMNS))
