"""Experiment files: load, validate against the schema, and expand into runs.

Everything that can be wrong with an experiment (a misspelt key, an unknown policy,
hardware or generator, a bad parameter) is reported before anything runs, naming the
key or value at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import jsonschema
import numpy as np
import yaml

from kvroute.hardware import load_hardware
from kvroute.live.peers import is_peer_spec, parse_peer_spec
from kvroute.loadsignal import ROUTER, LoadSignal
from kvroute.policies import make_policy
from kvroute.yamlfile import load_yaml, read_yaml


class ExperimentError(ValueError):
    """An experiment file that cannot run; the message names the file and key."""


@dataclass(frozen=True)
class Run:
    """One simulation job: a policy on a hardware profile for one round."""

    experiment: str
    hardware: str
    policy: str
    round: int


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path
    seed: int
    rounds: int
    view: str
    workload: dict
    runs: tuple[tuple[str, tuple[str, ...]], ...]  # (hardware, policy specs)
    raw: dict
    load_signal: LoadSignal = ROUTER

    def expand(
        self,
        policies: list[str] | None = None,
        hardware: str | None = None,
        rounds: int | None = None,
        round_: int | None = None,
        measured: bool = False,
    ) -> list[Run]:
        """The runs to do, with command-line overrides applied.

        ``hardware`` moves every policy of the experiment onto that profile;
        ``policies`` replaces each run's policy list; ``round_`` selects one round.
        Production routers (``sglang_router:...``, ``vllm_router:...``) run only as
        themselves when ``measured``. Simulated (the workflow's simulations and
        ``kvroute simulate`` alike), each one the file lists becomes its kvroute
        counterpart (:func:`kvroute.policies.counterpart`: the router's algorithm at its
        defaults), once, so every measured row has a prediction; a router without one is
        left out; naming a router in ``policies`` is an :class:`ExperimentError` that names
        its counterpart.
        """
        from kvroute.policies import counterpart

        if not measured:
            for p in policies or ():
                if is_peer_spec(p):
                    twin = counterpart(p)
                    hint = f"; simulate its counterpart with --policy {twin}" if twin else ""
                    raise ExperimentError(f"{self.path}: policy {p!r} {PEER_NOT_SIMULATED}{hint}")
        pairs: list[tuple[str, str]] = []
        for hw, pols in self.runs:
            hw = hardware or hw
            for p in policies or pols:
                if not measured and is_peer_spec(p):
                    p = counterpart(p)
                if p is not None and (hw, p) not in pairs:
                    pairs.append((hw, p))
        n = rounds or self.rounds
        rnds = [round_] if round_ is not None else list(range(n))
        return [Run(self.name, hw, p, r) for r in rnds for hw, p in pairs]


@cache
def _validator() -> jsonschema.Draft202012Validator:
    text = resources.files("kvroute.schemas").joinpath("experiment.schema.yaml").read_text()
    return jsonschema.Draft202012Validator(load_yaml(text))


def _where(err: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


PEER_NOT_SIMULATED = "is a production router: it can be measured (kvroute measure), not simulated"


def validate_policy_spec(spec: str) -> None:
    """Raise ValueError unless ``spec`` is a kvroute policy or a production router spec."""
    if is_peer_spec(spec):
        parse_peer_spec(spec)
        return
    make_policy(spec, np.random.default_rng(0))


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file; raise :class:`ExperimentError` naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"{path}: no such experiment file")
    try:
        raw = read_yaml(path) or {}
    except yaml.YAMLError as exc:
        raise ExperimentError(f"{path}: not valid YAML: {exc}") from exc
    errors = sorted(_validator().iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        raise ExperimentError(f"{path}: key {_where(e)}: {e.message}")
    wl = raw["workload"]
    if "generator" in wl:
        from kvroute.workload import generator_params

        try:
            valid = generator_params(wl["generator"])
        except ValueError as exc:
            raise ExperimentError(f"{path}: key workload.generator: {exc}") from exc
        for key in wl.get("params", {}):
            if key not in valid:
                raise ExperimentError(
                    f"{path}: key workload.params.{key}: unknown parameter of generator "
                    f"{wl['generator']!r}; valid: {', '.join(sorted(valid))}"
                )
    if "dataset" in wl:
        from kvroute.workload import check_dataset_params

        try:
            check_dataset_params(wl["dataset"], wl.get("params", {}))
        except ValueError as exc:  # a ParameterError names its key
            raise ExperimentError(f"{path}: key workload.params.{getattr(exc, 'key', '')}: {exc}") from exc
    try:
        load_signal = LoadSignal.from_config(raw.get("load_signal"))
    except ValueError as exc:  # the message starts with the key (load_signal.KEY: ...)
        raise ExperimentError(f"{path}: key {exc}") from exc
    if load_signal.source == "events" and raw.get("view", "auto") != "exact":
        raise ExperimentError(
            f"{path}: key load_signal.source: events delays the engines' KV events, which only the "
            f"exact view reads; set view: exact (the file has view: {raw.get('view', 'auto')})"
        )
    runs = []
    for i, run in enumerate(raw["runs"]):
        try:
            load_hardware(run["hardware"])
        except ValueError as exc:
            raise ExperimentError(f"{path}: key runs.{i}.hardware: {exc}") from exc
        for j, spec in enumerate(run["policies"]):
            try:
                validate_policy_spec(spec)
            except ValueError as exc:
                raise ExperimentError(f"{path}: key runs.{i}.policies.{j}: {exc}") from exc
        runs.append((run["hardware"], tuple(run["policies"])))
    return Experiment(
        name=raw["name"],
        path=path,
        seed=raw.get("seed", 1),
        rounds=raw.get("rounds", 1),
        view=raw.get("view", "auto"),
        workload=raw["workload"],
        runs=tuple(runs),
        raw=raw,
        load_signal=load_signal,
    )
