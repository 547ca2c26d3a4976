"""The ``kvroute`` command line. Every subcommand has --help; errors name the problem."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import click

from kvroute.experiment import ExperimentError, load_experiment

LOAD_HELP = ("{verb} only this value of the experiment's load axis (key load: its param set to it); "
             "default: every value.")


def _load_cols(summary) -> list[str]:
    """The summary's load column, for printing, where the experiment has a load axis."""
    return ["load"] if "load" in summary and summary["load"].notna().any() else []


def _echo_scaling(summary) -> None:
    """Say how a recorded trace was scaled (the summary's ``scaling``), where it was."""
    if "scaling" in summary:
        for label in summary["scaling"].dropna().unique():
            click.echo(f"trace scaled: {label}")


POINT_HELP = ("The experiment's operating point (`kvroute operating-point`'s file), which an experiment "
              "with key operating_point needs to draw its workload.")


@click.command()
@click.argument("experiments", metavar="EXPERIMENT...", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--hardware", required=True, help="Hardware profile whose workers to start (cpu here).")
@click.option("--out", "outs", multiple=True, required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for requests.parquet and summary.csv: one per EXPERIMENT, in their order.")
@click.option("--policy", "policies", multiple=True, help="Policy spec (repeatable); replaces the experiment's policies.")
@click.option("--rounds", "rounds", multiple=True, type=click.IntRange(min=1),
              help="Number of rounds (default: the experiment's): once for every EXPERIMENT, or once for each.")
@click.option("--round", "round_", type=click.IntRange(min=0), help="Measure only this round (0-based).")
@click.option("--engine", type=click.Choice(["vllm", "vllm-cpu", "emulator"]), help="Engine kind instead of the profile's (emulator: labelled emulated).")
@click.option("--redis", "redis_url", help="Redis URL for the gateway's session table (default: in memory).")
@click.option("--time-scale", type=float, default=1.0, show_default=True, help="Emulator only: real seconds per modelled second.")
@click.option("--max-requests", type=click.IntRange(min=1), help="Bound on requests per policy and round.")
@click.option("--time-limit-s", type=float, help="Bound on seconds per policy and round.")
@click.option("--kv-events", is_flag=True,
              help="Engines publish KV cache events (ZMQ) and the gateway routes from them: an exact view (records: view=exact).")
@click.option("--load", type=float, help=LOAD_HELP.format(verb="Measure"))
@click.option("--warmup-s", type=click.FloatRange(min=0),
              help="Warm real engines up first for at most this long (the first run's trace, round-robin, unrecorded; "
                   "default kvroute.live.measure.WARMUP_S); 0: not at all.")
@click.option("--probe", "probe_outs", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Also probe the engines before and after each measurement (probe requests of their own, as "
                   "`kvroute calibrate --probe` sends) and write them to this JSON file, for `kvroute calibrate "
                   "--probe --probed FILE`: one per EXPERIMENT, in their order.")
def measure(experiments: tuple[Path, ...], hardware: str, outs: tuple[Path, ...], policies: tuple[str, ...],
            rounds: tuple[int, ...], round_: int | None, engine: str | None, redis_url: str | None, time_scale: float,
            max_requests: int | None, time_limit_s: float | None, kv_events: bool, load: float | None,
            warmup_s: float | None, probe_outs: tuple[Path, ...]) -> None:
    """Measure EXPERIMENT on real engines behind the gateway: engines up, load, engines down.

    Several EXPERIMENTs run one after another on the same engine processes (one start-up),
    each with its own --out (and --probe). With --probe, the very engine processes each
    measures are probed before and after it (one probe session between two experiments
    serves both) and the probe requests written apart from the records, for `kvroute
    calibrate --probe --probed` to fit: the fit reads its own probe requests only."""
    from kvroute.live.engines import EngineError
    from kvroute.live.measure import WARMUP_S, Measurement, measure_experiments

    n = len(experiments)
    if len(outs) != n:
        raise click.UsageError(f"give one --out per EXPERIMENT: {n} experiment(s), {len(outs)} --out")
    if len(rounds) not in (0, 1, n):
        raise click.UsageError(f"give --rounds once, or once per EXPERIMENT ({n}), not {len(rounds)} times")
    if len(probe_outs) not in (0, n):
        raise click.UsageError(f"give one --probe per EXPERIMENT ({n}), or none, not {len(probe_outs)}")
    each = list(rounds) * n if len(rounds) == 1 else list(rounds) or [None] * n
    try:
        items = [Measurement(load_experiment(e), out, probe_outs[i] if probe_outs else None, each[i])
                 for i, (e, out) in enumerate(zip(experiments, outs))]
        summaries = measure_experiments(items, hardware, list(policies) or None, round_, engine, redis_url,
                                        time_scale, max_requests, time_limit_s, kv_events, load,
                                        WARMUP_S if warmup_s is None else warmup_s)
    except (ExperimentError, EngineError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    for m, summary in zip(items, summaries):
        if n > 1:
            click.echo(f"{m.exp.name}:")
        cols = ["hardware", "policy", "round", *_load_cols(summary), "requests", "errors", "later_ttft_mean_ms",
                "hit_rate", "imbalance"]
        click.echo(summary[[c for c in cols if c in summary]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        _echo_scaling(summary)


class LazyGroup(click.Group):
    """Subcommands whose modules load only when called (the live stack imports aiohttp)."""

    lazy = {
        "gateway": "kvroute.live.gateway:gateway_command",
        "emulate": "kvroute.live.emulator:emulate",
        "loadgen": "kvroute.live.loadgen:loadgen",
        "measure": "kvroute.cli:measure",
        "model": "kvroute.live.model:model_command",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup)
@click.option("-v", "--verbose", is_flag=True, help="Log progress of every run.")
def main(verbose: bool) -> None:
    """kvroute: where should a router send each turn of a multi-turn chat?"""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("experiment", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder for requests.parquet and summary.csv.")
@click.option("--policy", "policies", multiple=True, help="Policy spec (repeatable); replaces the experiment's policies.")
@click.option("--rounds", type=click.IntRange(min=1), help="Number of rounds (default: the experiment's).")
@click.option("--round", "round_", type=click.IntRange(min=0), help="Simulate only this round (0-based); one job of a sweep.")
@click.option("--hardware", help="Run every policy on this hardware profile instead.")
@click.option("--trace", "traces", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Replay this trace (from `kvroute workload`) instead of drawing the round's workload again. "
                   "Repeatable: one per round and load the runs cover, each matched by the round and load it records.")
@click.option("--coefficients", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Coefficients entries (e.g. from `kvroute calibrate --probe`) to use for the hardware family instead of hardware/coefficients.yaml.")
@click.option("--load", type=float, help=LOAD_HELP.format(verb="Simulate") + " One job of a load sweep.")
@click.option("--operating-point", "point_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=POINT_HELP)
def simulate(experiment: Path, out: Path, policies: tuple[str, ...], rounds: int | None, round_: int | None, hardware: str | None,
             traces: tuple[Path, ...], coefficients: Path | None, load: float | None, point_file: Path | None) -> None:
    """Simulate EXPERIMENT and write OUT/requests.parquet and OUT/summary.csv."""
    from kvroute.sim.run import simulate_experiment
    from kvroute.workload.sharegpt import DownloadError

    try:
        exp = load_experiment(experiment)
        point = None
        if point_file is not None and not traces:  # a replayed trace was drawn at the point already
            from kvroute.sim.operating_point import read  # imports scipy.optimize: only when asked

            point = read(point_file, exp)
        summary = simulate_experiment(exp, out, list(policies) or None, rounds, round_, hardware, list(traces) or None,
                                      coefficients, load, point)
    except (ExperimentError, ValueError, DownloadError) as exc:  # DownloadError: a dataset failing its checksum
        raise click.ClickException(str(exc)) from exc
    cols = ["hardware", "policy", "round", *_load_cols(summary), "time_to_complete_s", "later_ttft_mean_ms", "hit_rate", "imbalance"]
    click.echo(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    _echo_scaling(summary)



@main.command()
@click.argument("experiment", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--round", "round_", required=True, type=click.IntRange(min=0), help="Round (0-based) whose workload to write.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Trace file to write (parquet).")
@click.option("--load", type=float, help="The value of the experiment's load axis to write the workload at (required when it has one).")
@click.option("--dataset", "dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The file a dataset workload converts (from `kvroute fetch`); default: the project's copy. Verified by checksum.")
@click.option("--operating-point", "point_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=POINT_HELP)
def workload(experiment: Path, round_: int, out: Path, load: float | None, dataset: Path | None,
             point_file: Path | None) -> None:
    """Write round ROUND's workload of EXPERIMENT to OUT, as `kvroute simulate` would draw it."""
    from kvroute.pipeline import write_round_trace
    from kvroute.workload.sharegpt import DownloadError

    try:
        path = write_round_trace(experiment, round_, out, load, dataset, point_file)
    except (ExperimentError, ValueError, DownloadError) as exc:  # DownloadError: a file failing its checksum
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {path}")


@main.command("operating-point")
@click.argument("experiment", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="JSON file to write.")
@click.option("--coefficients", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Coefficients entries to simulate with instead of hardware/coefficients.yaml's.")
def operating_point(experiment: Path, out: Path, coefficients: Path | None) -> None:
    """Find EXPERIMENT's operating point (its key operating_point): the parameter value at
    which the policy's metric equals the published value; write the value and every
    evaluation to OUT."""
    from kvroute.sim import operating_point as op

    try:
        record = op.find(load_experiment(experiment), coefficients)
    except (ExperimentError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    op.write(record, out)
    click.echo(f"{record['experiment']}: {record['param']} = {record['value']:.4g} gives {record['policy']} "
               f"{record['metric']} {record['achieved']:.1f} (target {record['target']:g}, "
               f"{len(record['evaluations'])} simulations)")


@main.command()
@click.argument("experiment", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="CSV file to write.")
@click.option("--rounds", type=click.IntRange(min=1), help="Number of rounds (default: the experiment's).")
def sensitivity(experiment: Path, out: Path, rounds: int | None) -> None:
    """What each GPU coefficient is worth to EXPERIMENT's predictions: one input at a time set
    to the A6000's value or to none, on the same draws (a diagnostic of a miss, never a fit)."""
    from kvroute.analysis.sensitivity import write

    try:
        df = write(load_experiment(experiment), out, rounds)
    except (ExperimentError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    ttc = df[df["metric"] == "time_to_complete_s"]
    click.echo(ttc[["hardware", "policy", "swap", "filed", "value", "change"]].to_string(
        index=False, float_format=lambda v: f"{v:.3f}"))


@main.command()
@click.argument("dataset", type=click.Choice(["mooncake"]))
@click.option("--name", required=True, help="Which trace of the dataset (mooncake: conversation, synthetic).")
@click.option("--dest", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder to put the verified file in.")
@click.option("--url", help="Fetch from this URL instead of the original location (same checksum).")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="How long to wait for the original location before using the project's copy.")
@click.option("--offline", is_flag=True, help="Do not try the original location; use the project's copy (also: $KVROUTE_OFFLINE=1).")
@click.option("--copy", "copy", type=click.Path(dir_okay=False, path_type=Path),
              help="The project's copy to fall back on (default: data/mooncake/NAME_trace.jsonl.gz of kvroute's repository).")
def fetch(dataset: str, name: str, dest: Path, url: str | None, timeout_s: float, offline: bool, copy: Path | None) -> None:
    """Fetch a DATASET trace from its original location into DEST, or use the project's copy; verified either way."""
    from kvroute.workload import mooncake

    try:
        got = mooncake.fetch(name, dest, url=url, timeout_s=timeout_s, offline=offline or None, copy=copy)
    except (ValueError, mooncake.DownloadError) as exc:
        raise click.ClickException(str(exc)) from exc
    said = {"present": "already present", "download": "downloaded from", "copy": "the project's copy, because"}
    click.echo(f"{got.path}: SHA-256 verified; {said[got.source]} {got.detail}")


@main.command()
@click.argument("dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder for the merged requests.parquet and summary.csv.")
def merge(dirs: tuple[Path, ...], out: Path) -> None:
    """Concatenate the requests.parquet and summary.csv of each of DIRS into OUT."""
    from kvroute.pipeline import merge_results

    try:
        n_requests, n_runs = merge_results(out, list(dirs))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"merged {len(dirs)} folders: {n_runs} runs, {n_requests} requests -> {out}")


@main.command()
@click.option("--sim", "sims", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A merged simulation folder (summary.csv, requests.parquet); repeatable.")
@click.option("--measured", "measured", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A measurement folder (summary.csv, requests.parquet); repeatable.")
@click.option("--reported", type=click.Path(exists=True, file_okay=False, path_type=Path), default=Path("paper/reported"),
              show_default=True, help="Folder of the published figures (*.csv).")
@click.option("--coefficients", "coefficients", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Coefficient entries the simulations used instead of hardware/coefficients.yaml (simulate --coefficients); "
                   "their provenance says what is in sample. Repeatable.")
@click.option("--experiments", "experiments", type=click.Path(file_okay=False, path_type=Path), default=Path("config/experiments"),
              show_default=True, help="Folder of the experiment files (an operating point's target is in sample).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder for summary.csv and published.csv.")
def validate(sims: tuple[Path, ...], measured: tuple[Path, ...], reported: Path, coefficients: tuple[Path, ...],
             experiments: Path, out: Path) -> None:
    """Every prediction beside its measurement (summary.csv; per worker, workers.csv) and published value
    (published.csv); the machine's speed during each measurement against its probes (machine.csv)."""
    import functools

    import pandas as pd

    from kvroute.analysis.validation import (
        WORKER_COLUMNS,
        ValidationError,
        headline,
        in_sample_experiments,
        machine_rows,
        measured_rows,
        operating_point_anchors,
        published_rows,
        read_reported,
        worker_rows,
    )
    from kvroute.hardware import load_hardware
    from kvroute.records import write_csv

    def read(dirs: tuple[Path, ...]) -> tuple[pd.DataFrame, pd.DataFrame]:
        summaries = [pd.read_csv(d / "summary.csv") for d in dirs]
        reqs = [pd.read_parquet(d / "requests.parquet", columns=["experiment", "hardware", "policy", "view"])
                for d in dirs if (d / "requests.parquet").is_file()]
        return (pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame(),
                pd.concat(reqs, ignore_index=True) if reqs else None)

    sim, sim_req = read(sims)
    meas, meas_req = read(measured)
    try:
        in_sample = functools.partial(in_sample_experiments, coefficients=coefficients)
        summary = measured_rows(sim, meas, sim_req, meas_req, in_sample=in_sample)
        anchors = operating_point_anchors(experiments, sim["experiment"].unique() if len(sim) else ())
        published = published_rows(sim, read_reported(reported), in_sample=in_sample, anchors=anchors)
    except ValidationError as exc:
        raise click.ClickException(str(exc)) from exc
    # per worker, for the measured experiments only (their full records; the rest are never read)
    measured_exps = sorted(meas["experiment"].unique()) if len(meas) else []
    records = [pd.read_parquet(d / "requests.parquet", filters=[("experiment", "in", measured_exps)])
               for d in sims + measured if measured_exps and (d / "requests.parquet").is_file()]
    records = [r for r in records if len(r)]
    live = [r for r in records if r["source"].iloc[0] != "sim"]
    simulated = [r for r in records if r["source"].iloc[0] == "sim"]
    workers = (worker_rows(pd.concat(simulated, ignore_index=True), pd.concat(live, ignore_index=True),
                           lambda hw: load_hardware(hw).engine.max_num_seqs)
               if live and simulated else pd.DataFrame(columns=list(WORKER_COLUMNS)))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(summary, out / "summary.csv")
    write_csv(published, out / "published.csv")
    write_csv(workers, out / "workers.csv")
    machine = machine_rows(measured)
    write_csv(machine, out / "machine.csv")
    h = headline(summary)
    click.echo(f"{len(summary)} measured rows, {len(published)} published rows; "
               f"timing median |error| {h['timing_median_abs_rel_error']:.1%}, hit rate worst {h['hit_rate_max_points']:.1f} points, "
               f"piled where measured: {h['piled_agree']:g}, order kept in {h['order_same_share']:.0%} of {h['order_pairs']:.0f} "
               f"distinguishable pairs")
    for (exp, work), g in machine.groupby(["experiment", "work"]):
        click.echo(f"machine during {exp}'s runs against its probes ({work}): x{g.ratio.median():.3f} "
                   f"(slowest run x{(g.measured_max_ms / g.probe_ms).max():.3f})")


@main.command("fit-gpu")
@click.argument("measurements", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="YAML file for the fitted families (hardware/coefficients.yaml entries, with provenance); OUT.csv gets every residual.")
def fit_gpu(measurements: Path | None, out: Path) -> None:
    """Fit the GPU families' coefficients to independent MEASUREMENTS (default: hardware/measurements/gpu.yaml)."""
    import pandas as pd
    import yaml

    from kvroute.gpufit import coefficient_entries, default_measurements, fit_gpus
    from kvroute.records import write_atomic

    path = measurements or default_measurements()
    try:
        result = fit_gpus(path)
    except (KeyError, ValueError) as exc:
        raise click.ClickException(f"{path}: {exc}") from exc
    entries = coefficient_entries(result)
    text = yaml.safe_dump(entries, sort_keys=False, width=100)
    table = pd.DataFrame(result.residuals)
    write_atomic(out, lambda tmp: Path(tmp).write_text(text))
    write_atomic(out.with_suffix(".csv"), lambda tmp: table.to_csv(tmp, index=False))
    for fam, c in result.coefficients.items():
        click.echo(f"{fam}: " + ", ".join(f"{k} {v:.3g} ± {result.errors[fam][k]:.2g}" for k, v in c.items()))
    cols = ["family", "observation", "measured", "predicted", "rel_error", "used"]
    click.echo(table[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    click.echo(f"wrote {out} and {out.with_suffix('.csv')}")


@main.command()
@click.argument("experiment", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.argument("measured", required=False, type=click.Path(exists=True, path_type=Path))
@click.option("--hardware", required=True, help="Hardware profile whose family's coefficients are fitted.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="YAML file for the fitted coefficients (a hardware/coefficients.yaml entry); OUT.csv gets every observation.")
@click.option("--probe", is_flag=True,
              help="Start the profile's engines and fit to probe requests of its own; reads no experiment (no EXPERIMENT, MEASURED).")
@click.option("--sessions", type=click.IntRange(min=1), default=2, show_default=True,
              help="--probe: times the engines are started afresh (the spread between engine processes is part of the errors).")
@click.option("--repetitions", type=click.IntRange(min=1), default=2, show_default=True,
              help="--probe: repetitions of every probe, per worker and session.")
@click.option("--api-probes", type=click.IntRange(min=3), default=24, show_default=True,
              help="--probe: minimal requests per worker and session for the API server's cost.")
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path),
              help="--probe: the model the engines serve (default: as `kvroute measure` finds it).")
@click.option("--probed", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="--probe: fit the probe requests in this file (`kvroute measure --probe` writes it) instead of "
                   "starting engines.")
@click.option("--fit", "fit", multiple=True, help="Replay fit: coefficient to fit (repeatable; default: compute_efficiency, step_overhead_ms, api_overhead_ms).")
@click.option("--max-evaluations", type=click.IntRange(min=4), default=200, show_default=True, help="Replay fit: bound on simulations of the search.")
def calibrate(experiment: Path | None, measured: Path | None, hardware: str, out: Path, probe: bool, sessions: int,
              repetitions: int, api_probes: int, model_dir: Path | None, probed: Path | None, fit: tuple[str, ...],
              max_evaluations: int) -> None:
    """Fit HARDWARE's step-time coefficients (docs/costmodel.md).

    With --probe: profile the live engines with probe requests and fit to them, never
    reading an experiment. Without: replay MEASURED records of EXPERIMENT through the
    simulator and fit to them (kept for comparison; its fit has seen what it predicts).
    """
    from kvroute.records import write_atomic

    if probe:
        if experiment is not None or measured is not None or fit:
            raise click.UsageError("--probe reads no experiment: drop EXPERIMENT, MEASURED and --fit")
        _calibrate_probe(hardware, out, sessions, repetitions, api_probes, model_dir, probed)
        return
    if probed is not None:
        raise click.UsageError("--probed is a --probe option: give --probe too")
    if experiment is None or measured is None:
        raise click.UsageError("give EXPERIMENT and MEASURED (a replay fit), or --probe")
    from kvroute.calibrate import DEFAULT_FIT, calibrate as fit_coefficients, read_measured

    try:
        exp = load_experiment(experiment)
        result = fit_coefficients(exp, read_measured(measured), hardware, tuple(fit) or DEFAULT_FIT, max_evaluations)
    except (ExperimentError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    table = result.table()
    write_atomic(out, lambda tmp: Path(tmp).write_text(result.coefficients_yaml()))
    write_atomic(out.with_suffix(".csv"), lambda tmp: table.to_csv(tmp, index=False))
    click.echo(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    click.echo(result.coefficients_yaml().rstrip())
    click.echo(f"wrote {out} and {out.with_suffix('.csv')}")


def _calibrate_probe(hardware: str, out: Path, sessions: int, repetitions: int, api_probes: int,
                     model_dir: Path | None, probed_file: Path | None = None) -> None:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import EngineError
    from kvroute.live.probe import ProbePlan, read_probed, run_probe
    from kvroute.probefit import fit_and_write, load_warning, plan_facts

    written_by = ""
    try:
        hw = load_hardware(hardware)
        if probed_file is not None:  # recorded around a measurement: no engine to start
            requests, probed = read_probed(probed_file)
            written_by = f"kvroute calibrate --hardware {hardware} --probe --probed {probed_file}"
        else:
            if hw.engine.kind == "emulator":
                raise ValueError(f"hardware {hardware!r} runs the emulator: there is no engine to probe")
            plan = ProbePlan(api_probes=api_probes, sessions=sessions, repetitions=repetitions)
            requests, facts = run_probe(hw, out.parent / f"{out.stem}-engines", plan, model_dir=model_dir)
            probed = plan_facts(plan, hw) | facts
    except (EngineError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        result = fit_and_write(requests, hw, probed, out, written_by)
    except ValueError as exc:  # what was measured is kept: the table can be read and fitted again
        raise click.ClickException(str(exc)) from exc
    click.echo("\n".join(result.residual_lines()))
    click.echo(f"{result.family}: " + ", ".join(f"{k} {v:.3g} ± {result.errors[k]:.2g}"
                                                for k, v in result.coefficients.items()))
    warning = load_warning(result.probed)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {out} and {out.with_suffix('.csv')}")


@main.command()
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for requests.parquet, summary.csv and predictions.csv.")
def arithmetic(out: Path) -> None:
    """Technical note 4's sweep: closed-form hit rates checked against simulation."""
    try:
        from kvroute.analysis.arithmetic import run_sweep
    except ImportError as exc:
        raise click.ClickException(f"the arithmetic sweep is not available: {exc}") from exc
    run_sweep(out)
    click.echo(f"wrote {out}")


@main.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Manifest to write (JSON).")
@click.option("--results", default=Path("results"), show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Results folder to scan for simulated, measured and emulated records.")
@click.option("--config", "config", default=Path("config/config.yaml"), show_default=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Workflow config whose sha256 is recorded.")
@click.option("--experiments", default=Path("config/experiments"), show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder of experiment files whose sha256 are recorded.")
@click.option("--tex", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write it as LaTeX here: the provenance appendix the notes \\input (manifest.tex).")
def manifest(out: Path, results: Path, config: Path, experiments: Path, tex: Path | None) -> None:
    """Write provenance: commit, package versions, hardware profiles, config hashes, and
    which results are simulated, measured or emulated."""
    from kvroute.pipeline import write_manifest

    m = write_manifest(out, tex, results, config, experiments)
    src = m["sources"]
    click.echo(f"wrote {out}: commit {m['commit'][:12]}, {len(m['results'])} result folders "
               f"({len(src['simulated'])} simulated, {len(src['measured'])} measured, {len(src['emulated'])} emulated)")



if __name__ == "__main__":
    sys.exit(main())
