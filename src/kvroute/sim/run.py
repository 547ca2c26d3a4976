"""Run an experiment's simulations and write the records and summary.

Seeds follow one rule, common random numbers: within a round, every draw that is not
a policy's own decision is the same for every policy and hardware, and belongs to a
request rather than to the order a policy routes in, so a difference between two
policies' records is the policies' doing. Round ``r`` of an experiment with seed
``s`` draws

- its workload from :func:`trace_seed` ``(s, r)``: the same trace for every run of
  the round;
- its common stream from :func:`common_rng` ``(s, r)``: the API-server jitter, one
  uniform per (conversation, turn) drawn in trace order before the run starts
  (``kvroute.sim.cluster.api_delays``), then, with a scraped ``load_signal``, each
  worker's scrape phase; any new non-policy randomness belongs here;
- the policy's own randomness (``random``, tie-breaks) from :func:`policy_rng`
  ``(s, r, hardware, policy)``. That stream stays per policy on purpose: what a
  policy draws is part of the policy, and two specs that draw differently should.

None of these seeds holds the load of an experiment's load axis: at every load, round
``r`` draws from the same streams, and the generators keep lengths unchanged when the
rate (or the number of chats) changes, so the loads of a round differ by the load alone.

Same file and seed, byte-identical records.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from kvroute.experiment import Experiment, Run, format_load
from kvroute.hardware import Hardware, hardware_dir, load_hardware, with_coefficients
from kvroute.policies import make_policy
from kvroute.records import REQUEST_COLUMNS, requests_table, summarize, write_atomic, write_csv, write_requests
from kvroute.sim.cluster import SimCluster
from kvroute.workload import generate, load_dataset, read_trace
from kvroute.workload.trace import Trace

log = logging.getLogger(__name__)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def trace_seed(seed: int, round_: int) -> int:
    """The seed of round ``round_``'s workload."""
    return int(np.random.SeedSequence([seed, round_]).generate_state(1)[0])


def load_trace(exp: Experiment, round_: int, load: float | None = None, dataset: Path | None = None,
               point: float | None = None) -> Trace:
    """Round ``round_``'s workload; at ``load``, the load axis's parameter set to it
    (the seed is the round's whatever the load: common random numbers across loads). A
    dataset workload is converted from ``dataset`` (default the project's copy), the
    same requests every round. ``point``: the value of the experiment's operating-point
    parameter (kvroute.sim.operating_point), which an experiment with one needs."""
    wl = exp.workload
    if point is not None and exp.operating_point is None:
        raise ValueError(f"{exp.path}: an operating point ({point}) was given, but the experiment has no operating_point key")
    if exp.operating_point is not None and point is None:
        raise ValueError(f"{exp.path}: the experiment's {exp.operating_point.param} is its operating point: run "
                         "`kvroute operating-point` and pass its file (--operating-point)")
    if load is not None and exp.load is None:
        raise ValueError(f"{exp.path}: a load ({load}) was given, but the experiment has no load axis (key load)")
    if exp.load is not None and load is None:
        raise ValueError(f"{exp.path}: the experiment has a load axis ({exp.load.param}); say which load")
    if "trace" in wl:
        return read_trace(Path(wl["trace"]))
    params = dict(wl.get("params", {}))
    if load is not None:
        params[exp.load.param] = load
    if point is not None:
        params[exp.operating_point.param] = point
    if "dataset" in wl:
        return load_dataset(wl["dataset"], dataset, **params)
    return generate(wl["generator"], trace_seed(exp.seed, round_), **params)


def common_rng(seed: int, round_: int) -> np.random.Generator:
    """Round ``round_``'s common random numbers: no hardware, no policy in the seed.

    The tag keeps the stream apart from the workload's, which is seeded by ``(seed, round_)`` too."""
    return np.random.default_rng([seed, round_, _crc("common")])


def policy_rng(exp: Experiment, run: Run) -> np.random.Generator:
    """The policy's own stream: seeded per (seed, round, hardware, policy)."""
    return np.random.default_rng([exp.seed, run.round, _crc(run.hardware), _crc(run.policy)])


def run_hardware(name: str, coefficients: Path | None = None):
    """The profile ``name``, with its family's coefficients from ``coefficients`` when given."""
    hw = load_hardware(name)
    return with_coefficients(hw, coefficients) if coefficients is not None else hw


def coefficients_info(hardware: set[str], coefficients: Path | None) -> dict:
    """What run.json records of the coefficients each hardware ran with, and where from."""
    out = {}
    for h in sorted(hardware):
        hw = run_hardware(h, coefficients)
        out[h] = {"family": hw.coefficients_name,
                  "file": str(coefficients) if coefficients is not None else str(hardware_dir() / "coefficients.yaml"),
                  "values": dict(hw.coefficients.__dict__)}
    return out


def simulate_run(exp: Experiment, run: Run, trace: Trace, coefficients: Path | None = None,
                 hw: Hardware | None = None) -> tuple[list[dict], dict]:
    """Simulate one run; returns its record rows and run metadata.

    ``coefficients``: a file of coefficients entries (``kvroute calibrate --probe``'s
    output) whose entry for the run's hardware family replaces hardware/coefficients.yaml's.
    ``hw``: the run's profile itself, as given (kvroute.analysis.sensitivity's swaps).
    """
    hw = hw or run_hardware(run.hardware, coefficients)
    policy = make_policy(run.policy, policy_rng(exp, run))
    exact = policy.default_exact if exp.view == "auto" else exp.view == "exact"
    cluster = SimCluster(trace, hw, policy, common_rng(exp.seed, run.round), exact, exp.load_signal)
    t0 = time.perf_counter()
    rows = cluster.run()
    wall = time.perf_counter() - t0
    seed = trace_seed(exp.seed, run.round)
    common = {
        "source": "sim", "experiment": run.experiment, "hardware": run.hardware,
        "policy": run.policy, "round": run.round, "view": "exact" if exact else "approx",
        "load_signal": exp.load_signal.label, "seed": seed, **load_columns(exp, run),
        "scaling": trace.meta.get("scaling"),
    }
    rows = [{**common, **r} for r in sorted(rows, key=lambda r: (r["arrival_s"], r["conversation"], r["turn"]))]
    sim_s = max(r["finish_s"] for r in rows) - min(r["arrival_s"] for r in rows) if rows else 0.0
    meta = {
        "run": dict(run.__dict__), "policy_canonical": policy.spec, "wall_s": wall, "sim_s": sim_s,
        "workers": hw.worker_names, "worker_stats": cluster.worker_stats(),
    }
    return rows, meta


#: the simulated engines' counters a summary row carries (kvroute.sim.cluster.worker_stats)
ENGINE_COUNTERS = ("evictions", "preemptions", "max_batch", "mean_batch")


def engine_counters(stats: dict[str, dict]) -> dict[str, float]:
    """A run's engine counters over its workers: cached blocks evicted and preemptions
    (sums), the largest batch, and the mean batch while busy (sequence-seconds over busy
    seconds, all workers)."""
    busy = sum(w["busy_s"] for w in stats.values())
    return {
        "evictions": sum(w["evictions"] for w in stats.values()),
        "preemptions": sum(w["preemptions"] for w in stats.values()),
        "max_batch": max((w["max_batch"] for w in stats.values()), default=0),
        "mean_batch": sum(w["batch_seq_s"] for w in stats.values()) / busy if busy else float("nan"),
    }


def load_columns(exp: Experiment, run: Run) -> dict:
    """The records' ``load_param`` and ``load`` of ``run`` (None without a load axis)."""
    return {"load_param": exp.load.param if exp.load else None, "load": run.load}


def _run_key(run: dict) -> tuple:
    """A run's identity (experiment, hardware, policy, round, load), no load as None (not NaN)."""
    load = run["load"]
    return (run["experiment"], run["hardware"], run["policy"], int(run["round"]),
            None if load is None or load != load else float(load))


def _progress_disabled() -> bool:
    return bool(os.environ.get("CI")) or not sys.stderr.isatty()


DRAWN_FOR = "drawn_for"
"""The key of a trace's ``meta`` that says which experiment, round and load
``kvroute workload`` drew it for (:func:`stamp_trace`)."""


def stamp_trace(trace: Trace, experiment: str, round_: int, load: float | None) -> Trace:
    """``trace`` recording that it is ``experiment``'s round ``round_`` at ``load``, so a
    simulation replaying several traces gives each run its own."""
    return replace(trace, meta={**trace.meta, DRAWN_FOR: {"experiment": experiment, "round": round_, "load": load}})


def replayed_traces(exp: Experiment, runs: list[Run], paths: list[Path]) -> dict[tuple, Trace]:
    """The trace files to replay, by the (round, load) of the runs each serves.

    One file may be unstamped (from before traces recorded their round): it then serves
    runs of one round at one load. Otherwise each file's :data:`DRAWN_FOR` names its
    experiment, round and load, and the files cover the runs' (round, load) pairs exactly
    once each, so no run replays another round's traffic.
    """
    def where(key: tuple) -> str:
        return f"round {key[0]}" + ("" if key[1] is None else f", {exp.load.param} {format_load(key[1])}")

    needed = {(r.round, r.load) for r in runs}
    traces: dict[tuple, Trace] = {}
    for path in paths:
        trace = read_trace(path)
        drawn = trace.meta.get(DRAWN_FOR)
        if drawn is None:
            if len(paths) > 1:
                raise ValueError(f"--trace {path} does not record the round and load it was drawn for (write it again "
                                 "with `kvroute workload`), so it cannot be told apart from the other traces")
            if len({k[0] for k in needed}) > 1:
                raise ValueError(f"--trace {path} is one round's workload; choose the round with --round "
                                 f"(the experiment has {exp.rounds})")
            if len({k[1] for k in needed}) > 1:
                raise ValueError(f"--trace {path} is one load's workload; choose the load with --load "
                                 f"(the experiment's {exp.load.param} takes {len(exp.load.values)} values)")
            return {key: trace for key in needed}
        if drawn["experiment"] != exp.name:
            raise ValueError(f"--trace {path} was drawn for experiment {drawn['experiment']!r}, not {exp.name!r}")
        key = (int(drawn["round"]), None if drawn["load"] is None else float(drawn["load"]))
        if key in traces:
            raise ValueError(f"--trace {path}: two traces are {where(key)}")
        if key not in needed:
            raise ValueError(f"--trace {path} is {where(key)}, which none of the runs simulates (choose them with "
                             "--round and --load, or leave the file out)")
        traces[key] = trace
    missing = sorted(needed - traces.keys(), key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    if missing:
        raise ValueError(f"no --trace for {where(missing[0])}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                         + f" of the runs (given {len(paths)}; simulate fewer with --round and --load)")
    return traces


def simulate_experiment(
    exp: Experiment,
    out: Path,
    policies: list[str] | None = None,
    rounds: int | None = None,
    round_: int | None = None,
    hardware: str | None = None,
    trace: Path | Sequence[Path] | None = None,
    coefficients: Path | None = None,
    load: float | None = None,
    point: float | None = None,
) -> pd.DataFrame:
    """Simulate every run of ``exp`` (after overrides) and write ``out``'s two files.

    ``point``: the operating point's value (:func:`load_trace`), where the experiment has one.

    ``coefficients`` replaces each run's family coefficients with that file's entry
    (see :func:`simulate_run`); run.json records which were used.

    ``trace`` replays trace files (written by ``kvroute workload``) instead of drawing
    the workloads again (:func:`replayed_traces`): one file for one round at one load, or
    one per (round, load) the runs cover, each matched by the round and load it records
    it was drawn for (one job of the workflow simulates a policy over every round and load).
    """
    runs = exp.expand(policies, hardware, rounds, round_, load=load)
    paths = [] if trace is None else [Path(trace)] if isinstance(trace, (str, Path)) else [Path(t) for t in trace]
    for r in runs:  # fail on a bad override (or a coefficients file without the family) before anything runs
        run_hardware(r.hardware, coefficients)
        make_policy(r.policy, np.random.default_rng(0))
    traces = replayed_traces(exp, runs, paths) if paths else {}
    all_rows: list[dict] = []
    metas: list[dict] = []
    bar = tqdm(runs, desc=f"simulate {exp.name}", unit="run", disable=_progress_disabled())
    for run in bar:
        at = "" if run.load is None else f" {exp.load.param}={run.load}"
        bar.set_postfix_str(f"{run.hardware} {run.policy} round {run.round}{at}")
        if (run.round, run.load) not in traces:
            traces[(run.round, run.load)] = load_trace(exp, run.round, run.load, point=point)
        rows, meta = simulate_run(exp, run, traces[(run.round, run.load)], coefficients)
        all_rows.extend(rows)
        metas.append(meta)
        log.info("%s %s round %d%s: %d requests, %.1f sim s in %.2f wall s",
                 run.hardware, meta["run"]["policy"], run.round, at, len(rows), meta["sim_s"], meta["wall_s"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_requests(requests_table(all_rows), out / "requests.parquet")
    df = pd.DataFrame(all_rows, columns=list(REQUEST_COLUMNS))
    workers = {(m["run"]["experiment"], m["run"]["hardware"], m["run"]["policy"], m["run"]["round"]): m["workers"] for m in metas}
    summary = summarize(df, workers)
    speed = {_run_key(m["run"]): m["sim_s"] / m["wall_s"] if m["wall_s"] else float("nan") for m in metas}
    keys = summary[["experiment", "hardware", "policy", "round", "load"]].to_dict("records")
    summary["sim_seconds_per_wall_second"] = [speed[_run_key(k)] for k in keys]
    engines = {_run_key(m["run"]): engine_counters(m["worker_stats"]) for m in metas}
    for col in ENGINE_COUNTERS:
        summary[col] = [engines[_run_key(k)][col] for k in keys]
    write_csv(summary, out / "summary.csv")
    info = {"experiment": exp.raw, "trace": [str(p) for p in paths] or None, "runs": metas, "hardware": {h: load_hardware(h).to_dict() for h in {r.hardware for r in runs}},
            "coefficients": coefficients_info({r.hardware for r in runs}, coefficients)}
    write_atomic(out / "run.json", lambda tmp: Path(tmp).write_text(json.dumps(info, indent=1, default=str)))
    return summary
