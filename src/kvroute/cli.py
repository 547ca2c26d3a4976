"""The ``kvroute`` command line. Every subcommand has --help; errors name the problem."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from kvroute.experiment import ExperimentError, load_experiment


@click.group()
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
def simulate(experiment: Path, out: Path, policies: tuple[str, ...], rounds: int | None, round_: int | None, hardware: str | None) -> None:
    """Simulate EXPERIMENT and write OUT/requests.parquet and OUT/summary.csv."""
    from kvroute.sim.run import simulate_experiment

    try:
        exp = load_experiment(experiment)
        summary = simulate_experiment(exp, out, list(policies) or None, rounds, round_, hardware)
    except (ExperimentError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    cols = ["hardware", "policy", "round", "time_to_complete_s", "later_ttft_mean_ms", "hit_rate", "imbalance"]
    click.echo(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    sys.exit(main())
