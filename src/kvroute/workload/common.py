"""What every workload generator shares: parameter checks that name the parameter, and
independent named random streams drawn from one seed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.random import Generator


def named_streams(seed: int, names: Sequence[str]) -> dict[str, Generator]:
    """One ``default_rng`` per name, from ``SeedSequence(seed).spawn``: drawing more from one
    stream (say, arrivals at a higher rate) never shifts another (say, lengths)."""
    children = np.random.SeedSequence(seed).spawn(len(names))
    return {name: np.random.default_rng(child) for name, child in zip(names, children)}


def int_param(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def float_param(name: str, value: Any, minimum: float = 0.0, strict: bool = False) -> float:
    """``value`` as a finite float >= ``minimum`` (> with ``strict``), else ValueError."""
    ok = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {op} {minimum}, got {value!r}")
    return float(value)


def seed_param(seed: Any) -> int:
    """A generator's seed: an int >= 0."""
    return int_param("seed", seed, minimum=0)
