"""Experiment files: load, validate against the schema, and expand into runs.

Everything that can be wrong with an experiment (a misspelt key, an unknown policy,
hardware or generator, a bad parameter) is reported before anything runs, naming the
key or value at fault.

An experiment may have a load axis (``load: {param: rate_per_s, values: [2, 4, 8]}``):
each value of one workload parameter is its own set of runs. The workload of round
``r`` is drawn from the same seed at every load (:func:`kvroute.sim.run.trace_seed`
has no load in it), and the generators keep lengths unchanged when the rate or the
number of chats changes, so the loads of a round are common random numbers too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import yaml

from kvroute.hardware import load_hardware
from kvroute.live.peers import is_peer_spec, parse_peer_spec
from kvroute.loadsignal import ROUTER, LoadSignal
from kvroute.pipeline import format_load
from kvroute.policies import make_policy
from kvroute.yamlfile import load_yaml, read_yaml


class ExperimentError(ValueError):
    """An experiment file that cannot run; the message names the file and key."""


@dataclass(frozen=True)
class Run:
    """One simulation job: a policy on a hardware profile for one round (at one load)."""

    experiment: str
    hardware: str
    policy: str
    round: int
    #: the load axis's value for this run (as the file gives it); None without a load axis
    load: float | None = None


@dataclass(frozen=True)
class LoadAxis:
    """The workload parameter an experiment sweeps (``param``) and its ``values``."""

    param: str
    values: tuple[float, ...]

    def value(self, load: float) -> float:
        """The file's value equal to ``load`` (so ``10`` finds ``10.0``); ValueError if none."""
        for v in self.values:
            if v == load:
                return v
        listed = ", ".join(format_load(v) for v in self.values)
        raise ValueError(f"load {format_load(load)} is not one of load.values ({listed})")


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
    load: LoadAxis | None = None
    #: kvroute.sim.operating_point.OperatingPointSpec, or None
    operating_point: Any = None

    def loads(self, load: float | None = None) -> list[float | None]:
        """The load values to run: every one of the axis, or just ``load`` (``[None]``
        without a load axis). Raises :class:`ExperimentError` for a ``load`` the file lacks."""
        if load is None:
            return list(self.load.values) if self.load else [None]
        if self.load is None:
            raise ExperimentError(f"{self.path}: a load ({format_load(load)}) was given, but the experiment has no "
                                  "load axis (key load)")
        try:
            return [self.load.value(load)]
        except ValueError as exc:
            raise ExperimentError(f"{self.path}: {exc}") from exc

    def expand(
        self,
        policies: list[str] | None = None,
        hardware: str | None = None,
        rounds: int | None = None,
        round_: int | None = None,
        measured: bool = False,
        load: float | None = None,
    ) -> list[Run]:
        """The runs to do, with command-line overrides applied: one per round x load x
        (hardware, policy), in that order.

        ``hardware`` moves every policy of the experiment onto that profile;
        ``policies`` replaces each run's policy list; ``round_`` selects one round;
        ``load`` one value of the load axis (see :meth:`loads`).
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
        loads = self.loads(load)
        return [Run(self.name, hw, p, r, v) for r in rnds for v in loads for hw, p in pairs]


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
    load = _load_axis(path, raw.get("load"), wl) if "load" in raw else None
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
    point = _operating_point(path, raw, wl, tuple(runs), raw.get("rounds", 1)) if "operating_point" in raw else None
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
        load=load,
        operating_point=point,
    )


def _operating_point(path: Path, raw: dict, workload: dict, runs: tuple, rounds: int):
    """Check ``operating_point``: a generator parameter set by nothing else, then the rest
    (:func:`kvroute.sim.operating_point.parse_spec`)."""
    from kvroute.sim.operating_point import parse_spec

    spec = raw["operating_point"]
    param = spec["param"]
    if "generator" not in workload:
        raise ExperimentError(f"{path}: key operating_point: needs a generator workload (this one has "
                              f"{'a trace file' if 'trace' in workload else 'a dataset'})")
    if param not in workload_parameters(workload):
        raise ExperimentError(f"{path}: key operating_point.param: {param!r} is not a parameter of generator "
                              f"{workload['generator']!r}")
    if param in workload.get("params", {}):
        raise ExperimentError(f"{path}: key workload.params.{param}: the operating point sets {param}; "
                              "drop it from workload.params")
    if "load" in raw and raw["load"]["param"] == param:
        raise ExperimentError(f"{path}: key operating_point.param: the load axis sweeps {param} already")
    return parse_spec(path, spec, runs, rounds)


def workload_parameters(workload: dict) -> dict[str, Any]:
    """The parameters a load axis may set on ``workload`` (name -> default): a
    generator's (:func:`kvroute.workload.generator_params`), a dataset's
    (:func:`kvroute.workload.dataset_params`: Mooncake's ``speedup``, say); a trace file has none."""
    if "generator" in workload:
        from kvroute.workload import generator_params

        return generator_params(workload["generator"])
    if "dataset" in workload:
        from kvroute.workload import dataset_params

        return dataset_params(workload["dataset"])
    return {}


def _load_axis(path: Path, spec: dict, workload: dict) -> LoadAxis:
    """Check ``load`` beyond the schema: a parameter of the workload, not also fixed in
    ``workload.params``, with distinct finite values (whole numbers where its default is)."""
    param, values = spec["param"], spec["values"]
    valid = workload_parameters(workload)
    if param not in valid:
        what = (f"generator {workload['generator']!r}" if "generator" in workload
                else f"dataset {workload['dataset']!r}" if "dataset" in workload else "a trace file")
        listed = ", ".join(sorted(valid)) or "none"
        raise ExperimentError(f"{path}: key load.param: {param!r} is not a parameter of the workload ({what}); "
                              f"valid: {listed}")
    if param in workload.get("params", {}):
        raise ExperimentError(f"{path}: key workload.params.{param}: the load axis sets {param}; "
                              "drop it from workload.params")
    default = valid[param]
    whole = isinstance(default, int) and not isinstance(default, bool)
    seen: list[float] = []
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ExperimentError(f"{path}: key load.values.{i}: {v} is not a finite number")
        if whole and not float(v).is_integer():
            raise ExperimentError(f"{path}: key load.values.{i}: {param} takes whole numbers "
                                  f"(its default is {default}), got {v}")
        if v in seen:
            raise ExperimentError(f"{path}: key load.values.{i}: {format_load(v)} appears twice")
        seen.append(v)
        if "dataset" in workload:  # each value a valid parameter of the conversion (speedup > 0, ...)
            from kvroute.workload import check_dataset_params

            try:
                check_dataset_params(workload["dataset"], {**workload.get("params", {}), param: v})
            except ValueError as exc:
                raise ExperimentError(f"{path}: key load.values.{i}: {exc}") from exc
    return LoadAxis(param, tuple(int(v) if whole else v for v in values))
