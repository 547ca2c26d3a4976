"""Length and time distributions written as small dicts, the way the field's benchmarks do.

The field's workload generators (SGLang bench_serving, inference-perf, vLLM
benchmarks/multi_turn, BLIS) each describe a token count or a delay as a named
distribution with a few parameters. :func:`parse_dist` reads one of those, checks it
(every error names the parameter and the key), and returns a :class:`Dist` that draws
from a ``numpy.random.Generator``. A bare number is shorthand for ``constant``.

=========================================== =====================================================
spec                                        draws
=========================================== =====================================================
``{dist: constant, value: v}``              ``v``
``{dist: uniform, min: a, max: b}``         integers ``a..b`` inclusive (vLLM, BLIS); for a
                                            time, continuous on ``[a, b)``
``{dist: range_ratio, value: L, ratio: r}`` SGLang's ``compute_random_lens``: integers uniform
                                            on ``[max(int(L * r), 1), L]`` (``r = 1``: always L)
``{dist: normal, mean, std, min, max}``     Gaussian clipped to ``[min, max]``, then rounded
                                            (BLIS ``gaussian``, inference-perf ``normal``)
``{dist: lognormal, average, median_ratio,  vLLM's form: ``mu = ln(average * median_ratio)``,
max}``                                      ``sigma = sqrt(2 ln(1 / median_ratio))`` (so the
                                            mean is ``average``); ``median_ratio`` defaults to
                                            vLLM's 0.85
``{dist: lognormal, median, sigma, max}``   ``exp(ln(median) + sigma * Z)``
``{dist: lognormal, mu, sigma, max}``       ``exp(mu + sigma * Z)`` (numpy's parameters)
``{dist: zipf, alpha, max}``                ``numpy`` Zipf, ``alpha > 1`` (vLLM)
``{dist: poisson, mean, max}``              Poisson with that mean (vLLM calls it ``alpha``)
``{dist: exponential, mean}``               exponential (think times)
=========================================== =====================================================

``max`` (and, where listed, ``min``) clip the draws; ``max`` is optional for the
unbounded laws. Integer draws are rounded to the nearest integer after clipping, as
the sources do. Draws below a quantity's floor (a reply needs one token) are raised
to it, as vLLM and BLIS do; bounds given below the floor are rejected instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.random import Generator

#: vLLM benchmarks/multi_turn/bench_dataset.py: median/average when only average is given.
VLLM_MEDIAN_RATIO: float = 0.85

# dist name -> (required keys, optional keys); an integer quantity may use every law, a
# time only the continuous ones.
_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "constant": (frozenset({"value"}), frozenset()),
    "uniform": (frozenset({"min", "max"}), frozenset()),
    "range_ratio": (frozenset({"value", "ratio"}), frozenset()),
    "normal": (frozenset({"mean", "std", "min", "max"}), frozenset()),
    "lognormal": (frozenset(), frozenset({"average", "median_ratio", "median", "mu", "sigma",
                                          "min", "max"})),
    "zipf": (frozenset({"alpha"}), frozenset({"max"})),
    "poisson": (frozenset({"mean"}), frozenset({"max"})),
    "exponential": (frozenset({"mean"}), frozenset({"max"})),
}
_INTEGER_ONLY = frozenset({"range_ratio", "zipf", "poisson"})
_LOGNORMAL_FORMS = (
    frozenset({"average"}), frozenset({"average", "median_ratio"}),
    frozenset({"median", "sigma"}), frozenset({"mu", "sigma"}),
)


@dataclass(frozen=True)
class Dist:
    """A checked distribution: draw with :meth:`sample`; :meth:`to_dict` gives its spec."""

    name: str  # the parameter it belongs to, for messages
    kind: str
    args: dict[str, float] = field(default_factory=dict)
    integer: bool = True
    floor: float = 0.0

    def sample(self, rng: Generator, n: int) -> np.ndarray:
        """``n`` draws, clipped, rounded (integer quantities) and raised to the floor."""
        a = self.args
        if n == 0:
            return np.zeros(0, dtype=np.int64 if self.integer else float)
        if self.kind == "constant":
            x = np.full(n, a["value"], dtype=float)
        elif self.kind == "uniform":
            if self.integer:
                x = rng.integers(int(a["min"]), int(a["max"]), size=n, endpoint=True).astype(float)
            else:
                x = rng.uniform(a["min"], a["max"], size=n)
        elif self.kind == "range_ratio":
            full = int(a["value"])
            if full <= 0:
                x = np.zeros(n)
            else:
                lo = max(int(full * a["ratio"]), 1)
                x = rng.integers(lo, full, size=n, endpoint=True).astype(float)
        elif self.kind == "normal":
            x = np.clip(rng.normal(a["mean"], a["std"], size=n), a["min"], a["max"])
        elif self.kind == "lognormal":
            mu, sigma = lognormal_mu_sigma(a)
            x = rng.lognormal(mu, sigma, size=n)
        elif self.kind == "zipf":
            x = rng.zipf(a["alpha"], size=n).astype(float)
        elif self.kind == "poisson":
            x = rng.poisson(a["mean"], size=n).astype(float)
        else:  # exponential
            x = rng.exponential(a["mean"], size=n)
        if "max" in a and self.kind not in ("uniform", "normal"):
            x = np.minimum(x, a["max"])
        if "min" in a and self.kind == "lognormal":
            x = np.maximum(x, a["min"])
        if self.integer:
            return np.maximum(np.rint(x), self.floor).astype(np.int64)
        return np.maximum(x, self.floor)

    @property
    def is_zero(self) -> bool:
        """Always 0 (a prefix that is not there)."""
        return (self.kind == "constant" and self.args["value"] == 0) or (
            self.kind == "range_ratio" and self.args["value"] <= 0)

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain JSON (what a trace's meta records)."""
        cast = int if self.integer else float
        keep_int = {"value", "min", "max"} if self.integer else set()
        return {"dist": self.kind,
                **{k: (cast(v) if k in keep_int else float(v)) for k, v in self.args.items()}}


def lognormal_mu_sigma(args: dict[str, float]) -> tuple[float, float]:
    """(mu, sigma) of the underlying normal for each of the three lognormal forms."""
    if "average" in args:
        ratio = args.get("median_ratio", VLLM_MEDIAN_RATIO)
        return math.log(args["average"] * ratio), math.sqrt(2 * math.log(1 / ratio))
    if "median" in args:
        return math.log(args["median"]), args["sigma"]
    return args["mu"], args["sigma"]


def _number(name: str, key: str, value: Any, *, integer: bool) -> float:
    ok = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value)
    if integer and ok and float(value) != int(value):
        ok = False
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name}.{key} must be {kind}, got {value!r}")
    return float(value)


def parse_dist(name: str, spec: Any, *, integer: bool = True, floor: float = 0.0) -> Dist:
    """Check ``spec`` (a dict as in the module docstring, or a number) for parameter ``name``.

    ``integer``: token counts (True) or times in seconds (False). ``floor``: the least
    value the quantity may take (explicit bounds below it are rejected; unbounded
    draws below it are raised to it).
    """
    if isinstance(spec, Dist):
        return spec
    if not isinstance(spec, dict):
        value = _number(name, "value", spec, integer=integer)
        spec = {"dist": "constant", "value": value}
    spec = dict(spec)
    kind = spec.pop("dist", None)
    if kind not in _KEYS:
        raise ValueError(f"{name}: dist must be one of {sorted(_KEYS)}, got {kind!r}")
    if not integer and kind in _INTEGER_ONLY:
        raise ValueError(f"{name}: dist {kind!r} draws integers; a time takes one of "
                         f"{sorted(set(_KEYS) - _INTEGER_ONLY)}")
    required, optional = _KEYS[kind]
    unknown = sorted(set(spec) - required - optional)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown} for dist {kind!r}; "
                         f"valid: {sorted(required | optional)}")
    missing = sorted(required - set(spec))
    if missing:
        raise ValueError(f"{name}: dist {kind!r} needs key(s) {missing}")
    int_keys = {"value", "min", "max"} if integer else set()
    args = {k: _number(name, k, v, integer=k in int_keys) for k, v in spec.items()}
    _check_args(name, kind, args, integer, floor)
    return Dist(name, kind, args, integer, floor)


def _check_args(name: str, kind: str, a: dict[str, float], integer: bool, floor: float) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"{name}: {message}")

    for key in ("value", "min"):
        if key in a and kind != "range_ratio":
            need(a[key] >= floor, f"{key} must be >= {floor:g}, got {a[key]:g}")
    if "max" in a:
        need(a["max"] >= floor, f"max must be >= {floor:g}, got {a['max']:g}")
    if "min" in a and "max" in a:
        need(a["min"] <= a["max"], f"min ({a['min']:g}) must not exceed max ({a['max']:g})")
    if kind == "range_ratio":
        need(a["value"] >= 0, f"value must be >= 0, got {a['value']:g}")
        need(0 <= a["ratio"] <= 1, f"ratio must be in [0, 1], got {a['ratio']:g}")
        need(a["value"] == 0 or max(int(a["value"] * a["ratio"]), 1) >= floor,
             f"the shortest draw, max(int(value * ratio), 1), must be >= {floor:g}")
    elif kind == "normal":
        need(a["std"] >= 0, f"std must be >= 0, got {a['std']:g}")
    elif kind == "lognormal":
        form = frozenset(k for k in a if k not in ("min", "max"))
        need(form in _LOGNORMAL_FORMS,
             "lognormal takes one of {average[, median_ratio]}, {median, sigma}, {mu, sigma} "
             f"(plus min, max), got {sorted(form)}")
        need(a.get("average", 1) > 0, f"average must be > 0, got {a.get('average')}")
        need(a.get("median", 1) > 0, f"median must be > 0, got {a.get('median')}")
        need(0 < a.get("median_ratio", 0.5) < 1,
             f"median_ratio must be in (0, 1), got {a.get('median_ratio')}")
        need(a.get("sigma", 0) >= 0, f"sigma must be >= 0, got {a.get('sigma')}")
    elif kind == "zipf":
        need(a["alpha"] > 1, f"zipf alpha must be > 1, got {a['alpha']:g}")
    elif kind in ("poisson", "exponential"):
        need(a["mean"] >= 0, f"mean must be >= 0, got {a['mean']:g}")
