"""The routing-policy interface shared by the simulator and the live gateway.

A policy is a small synchronous object: ``choose(request, view) -> worker``. It reads
a read-only :class:`ClusterView` and never does I/O; the caller (the simulator's
router or the asyncio gateway) fills the view, calls ``choose``, then records the
decision (session table, router-side prefix index) itself. Every run builds fresh
policy objects through :func:`kvroute.policies.make_policy`; randomness comes from
the ``rng`` passed in, never from global state.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router knows about one request when it routes it."""

    request_id: str
    session_id: str  # conversation id (X-Session-ID in the gateway)
    turn: int  # 0-based turn index within the conversation
    prompt_tokens: int  # total prompt length (tokens; estimated from text in the gateway)
    block_hashes: Sequence[int] = ()  # chained hashes of the prompt's full blocks
    text: str | None = None  # raw prompt text where the router sees it (gateway)


class ClusterView(Protocol):
    """Read-only snapshot of the cluster a policy decides from.

    ``exact`` tells whether ``matched_tokens`` reads the instances' true caches
    (simulator with an exact view, or engine KV events) or a router-side
    approximate index built from the router's own decisions.
    """

    exact: bool
    block_size: int

    @property
    def workers(self) -> Sequence[str]:
        """All worker names, in a fixed order (down workers included)."""

    def is_up(self, worker: str) -> bool:
        """False when the worker is known to be down (refused connections)."""

    def in_flight(self, worker: str) -> int:
        """Requests routed to the worker and not finished (waiting + running)."""

    def waiting(self, worker: str) -> int:
        """Requests at the worker that have not started prefill yet."""

    def active_blocks(self, worker: str) -> int:
        """KV blocks held by the worker's unfinished requests (decode load)."""

    def kv_usage(self, worker: str) -> float:
        """Fraction of the worker's KV blocks in use, in [0, 1] (vLLM's ``kv_cache_usage_perc``)."""

    def queue_delay_s(self, worker: str) -> float:
        """Estimated time a new request waits at the worker before its prefill starts."""

    def matched_tokens(self, worker: str, request: RouteRequest) -> int:
        """Tokens of the request's prompt prefix cached on (or believed to be on) the worker."""

    def index_size(self, worker: str) -> int:
        """Size of the worker's prefix index (blocks); SGLang's "smallest tree" rule."""

    def prefill_time_s(self, worker: str, tokens: int) -> float:
        """Cost-model estimate of the worker prefilling ``tokens`` uncached tokens."""

    def session_worker(self, session_id: str) -> str | None:
        """Worker the session's previous turn went to, if the session table knows it."""


class NoWorkerUpError(RuntimeError):
    """Raised by a policy when the view has no worker that is up (the gateway answers 503)."""


def up_workers(view: ClusterView) -> list[str]:
    """The view's up workers in the view's order; raises :class:`NoWorkerUpError` if none.

    Every policy chooses from this list, so "lower index" always means earlier in
    ``view.workers`` and a down worker is never returned.
    """
    up = [w for w in view.workers if view.is_up(w)]
    if not up:
        raise NoWorkerUpError(f"no worker is up (workers: {list(view.workers)})")
    return up


def least_loaded(view: ClusterView, candidates: Iterable[str]) -> str:
    """Candidate with the fewest requests in flight; ties go to the earliest candidate."""
    return min(candidates, key=view.in_flight)


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def coerce_param(policy: str, key: str, typ: type, value: object) -> object:
    """Convert one parameter value (often a string from a spec) to its declared type.

    Raises ValueError naming the policy, the key and the value, so a bad
    ``--policy`` flag fails before any run starts. Floats must be finite; an int
    parameter accepts integral floats only; bools accept true/false/1/0/yes/no/on/off.
    """

    def bad(why: str = "") -> ValueError:
        return ValueError(
            f"policy {policy!r}: parameter {key}={value!r} is not a valid "
            f"{typ.__name__}{': ' + why if why else ''}"
        )

    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise bad("use true or false")
    if typ is int and isinstance(value, float):
        if not value.is_integer():
            raise bad()
        return int(value)
    try:
        out = typ(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise bad() from None
    if isinstance(out, float) and not math.isfinite(out):
        raise bad("must be finite")
    return out


def format_param(value: object) -> str:
    """Canonical text of a parameter value in a spec (``500.0`` -> ``500``).

    Floats use ``format(v, 'g')`` unless that would lose precision (then ``repr``),
    so ``make_policy(p.spec)`` rebuilds an identical policy.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        short = format(value, "g")
        return short if float(short) == value else repr(value)
    return str(value)


class Policy(ABC):
    """One routing policy. Subclasses set ``name`` and implement :meth:`choose`.

    Parameters arrive as keyword arguments (typed values or spec strings) and are
    converted to the types declared in ``params``; unknown names and bad values
    raise ValueError naming them. Subclasses check ranges in :meth:`check_params`.
    """

    name: ClassVar[str]
    #: parameter name -> (type, default); parsed from ``NAME:key=value,...`` specs
    params: ClassVar[dict[str, tuple[type, object]]] = {}
    #: whether the policy is defined over a router-side approximate index by default
    default_exact: ClassVar[bool] = True
    #: when the router-side index learns a decision: at routing (False), or only when the
    #: request finishes (True: vllm-router 0.1.17's tree), so requests routed while it is in
    #: flight do not see its prefix; the simulator and the gateway both honour it
    index_on_finish: ClassVar[bool] = False
    #: whether the router first sends each request to every worker (vllm-router's cache_aware
    #: asks each to render it; vLLM refuses): work on every worker, which the simulator charges
    #: to each worker's core where the API server shares it (``api_refused_request_ms``)
    asks_every_worker: ClassVar[bool] = False

    def __init__(self, rng: np.random.Generator, **kwargs: object) -> None:
        self.rng = rng
        unknown = sorted(set(kwargs) - set(self.params))
        if unknown:
            raise ValueError(
                f"policy {self.name!r} has no parameter(s) {unknown}; "
                f"valid: {sorted(self.params) or 'none'}"
            )
        for key, (typ, default) in self.params.items():
            setattr(self, key, coerce_param(self.name, key, typ, kwargs.get(key, default)))
        self.check_params()

    def check_params(self) -> None:
        """Raise ValueError naming any parameter whose value is out of range."""

    def _require_nonnegative(self, *keys: str) -> None:
        for key in keys:
            if getattr(self, key) < 0:
                raise ValueError(
                    f"policy {self.name!r}: parameter {key}={getattr(self, key)!r} must be >= 0"
                )

    @abstractmethod
    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        """Return the worker for ``request``. Must return a worker that is up."""

    @property
    def spec(self) -> str:
        """Canonical spec string, e.g. ``hybrid_sticky:threshold_ms=500``.

        Every declared parameter appears, in declaration order, so two policies with
        equal specs behave identically (given equal rngs).
        """
        if not self.params:
            return self.name
        args = ",".join(f"{k}={format_param(getattr(self, k))}" for k in self.params)
        return f"{self.name}:{args}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"
