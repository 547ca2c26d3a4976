"""Recorded traces an experiment can name (``workload: {dataset: NAME, params: {...}}``).

Unlike a generator, a dataset is converted from a file, not drawn from a seed: every
round replays the same requests. Each entry is a function taking its parameters as
keywords plus ``path`` (the file to read; default the project's own verified copy),
and a check of those parameters that reads nothing, so an experiment file is judged
before anything runs.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from kvroute.workload import mooncake
from kvroute.workload.trace import Trace


ParameterError = mooncake.ParameterError


def _check_mooncake(params: dict[str, Any]) -> None:
    p = {**dataset_params("mooncake"), **params}
    mooncake.check_params(p["speedup"], p["start_s"], p["duration_s"], p["max_requests"], p["name"],
                          token_scale=p["token_scale"], max_input_tokens=p["max_input_tokens"],
                          max_output_tokens=p["max_output_tokens"], session_fraction=p["session_fraction"])


#: name -> (converter, parameter check)
DATASETS: dict[str, tuple[Callable[..., Trace], Callable[[dict[str, Any]], None]]] = {
    "mooncake": (mooncake.mooncake_trace, _check_mooncake),
}


def _lookup(name: str) -> tuple[Callable[..., Trace], Callable[[dict[str, Any]], None]]:
    try:
        return DATASETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)}") from None


def dataset_params(name: str) -> dict[str, Any]:
    """A dataset's parameters (besides ``path``) and their defaults."""
    fn, _ = _lookup(name)
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if k != "path"}


def check_dataset_params(name: str, params: dict[str, Any]) -> None:
    """:class:`ParameterError` (a ValueError; ``key`` names it) for the first unknown or
    bad parameter, ValueError for an unknown dataset; reads no file."""
    _, check = _lookup(name)
    valid = dataset_params(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ParameterError(unknown[0], f"unknown parameter of dataset {name!r}; valid: {', '.join(sorted(valid))}")
    check(params)


def load_dataset(dataset: str, path: str | os.PathLike | None = None, /, **params: Any) -> Trace:
    """Dataset ``dataset`` converted with ``params``, read from ``path`` (default: the
    project's copy), verified by checksum."""
    check_dataset_params(dataset, params)
    fn, _ = _lookup(dataset)
    return fn(**params, path=path)
