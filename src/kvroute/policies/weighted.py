"""Weighted scorers summed, the highest total wins: llm-d's scheduler and BLIS's ``weighted``.

Both the llm-d inference scheduler (Gateway API Inference Extension's scheduling profile
and max-score picker) and BLIS (inference-sim's ``weighted`` routing) route the same
way: each named scorer gives every candidate worker a score, clamped to [0, 1]; the
scores are multiplied by the scorers' weights and summed; the highest sum wins, and an
exact tie is broken uniformly at random. They differ in which scorers exist and in how
a few of them normalise, which is what the parameters here choose between. The sources
and every default are in docs/policies.md, "weighted".

Scorers (weight keys of the spec), each a list of scores over the up workers:

* ``prefix``: the share of the prompt's blocks cached on the worker, from the view
  (``prefix_source=view``: exact in an exact run, the run's approximate index
  otherwise) or from this policy's own LRU index of where it sent each prompt
  (``prefix_source=history``, llm-d's ``prefix-cache-scorer``, BLIS's
  ``prefix-affinity``). ``prefix_norm=ratio`` is matched / prompt blocks;
  ``minmax`` is llm-d's precise-prefix-cache scorer as it ran in 2025: the workers
  holding at least one block min-max normalised among themselves, the rest 0.
* ``queue``: ``(maxQ - q) / (maxQ - minQ)`` over ``view.waiting`` (1 when all equal):
  llm-d's ``queue-scorer``, BLIS's ``queue-depth`` since April 2026.
* ``kv``: ``1 - view.kv_usage``: llm-d's ``kv-cache-utilization-scorer``, BLIS's
  ``kv-utilization``.
* ``session``: 1 for the worker the session's previous turn went to, else 0: llm-d's
  ``session-affinity-scorer``.
* ``load``: the ``queue`` formula over ``view.in_flight``: BLIS's ``queue-depth`` as
  its prefix-affinity hypothesis ran it (min-max over queue + batch + in flight).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from kvroute.kvcache.index import ApproxPrefixIndex
from kvroute.policies.base import ClusterView, Policy, RouteRequest, up_workers

#: weight keys, in the order the weighted scores are summed
SCORERS: tuple[str, ...] = ("prefix", "queue", "kv", "session", "load")
PREFIX_SOURCES = ("view", "history")
PREFIX_NORMS = ("ratio", "minmax")

#: llm-d prefix-cache-scorer ``lruCapacityPerServer`` (blocks per worker)
LLMD_LRU_CAPACITY = 31_250
#: llm-d prefix-cache-scorer ``maxPrefixBlocksToMatch``
LLMD_MAX_PREFIX_BLOCKS = 256
#: BLIS prefix-affinity ``defaultLRUCapacity`` (blocks per instance)
BLIS_LRU_CAPACITY = 10_000


def inverted_minmax(values: Sequence[float]) -> list[float]:
    """``(max - v) / (max - min)`` per value; all 1.0 when every value is equal (or none)."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


def prefix_ratio(matched_blocks: Sequence[int], total_blocks: int) -> list[float]:
    """Matched / total blocks per worker (0 for a prompt without a full block)."""
    if total_blocks <= 0:
        return [0.0] * len(matched_blocks)
    return [min(1.0, m / total_blocks) for m in matched_blocks]


def prefix_minmax(matched_blocks: Sequence[int]) -> list[float]:
    """llm-d's precise scorer (``indexedScoresToNormalizedScoredPods``): the workers that
    hold the prompt's first block are min-max normalised among themselves (all 1.0 when
    they match equally), the workers that do not score 0."""
    hits = [m for m in matched_blocks if m > 0]
    if not hits:
        return [0.0] * len(matched_blocks)
    lo, hi = min(hits), max(hits)
    if hi == lo:
        return [1.0 if m > 0 else 0.0 for m in matched_blocks]
    return [(m - lo) / (hi - lo) if m > 0 else 0.0 for m in matched_blocks]


def queue_scores(view: ClusterView, workers: Sequence[str]) -> list[float]:
    """llm-d's queue scorer over the requests waiting at each worker."""
    return inverted_minmax([view.waiting(w) for w in workers])


def kv_scores(view: ClusterView, workers: Sequence[str]) -> list[float]:
    """llm-d's KV-cache-utilisation scorer: ``1 - kv_usage``."""
    return [1.0 - view.kv_usage(w) for w in workers]


def session_scores(view: ClusterView, workers: Sequence[str], session_id: str) -> list[float]:
    """llm-d's session-affinity scorer: 1 for the session's previous worker, else 0."""
    home = view.session_worker(session_id)
    return [1.0 if w == home else 0.0 for w in workers]


def load_scores(view: ClusterView, workers: Sequence[str]) -> list[float]:
    """BLIS's queue-depth scorer as the prefix-affinity hypothesis ran it, over in-flight load."""
    return inverted_minmax([view.in_flight(w) for w in workers])


def _choice(name: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"policy {name!r}: parameter {key}={value!r} must be one of {', '.join(allowed)}")


class WeightedPolicy(Policy):
    """The highest ``sum_k weight_k * score_k(w)`` wins; exact ties -> uniform draw from ``rng``.

    Weights (float >= 0, at least one > 0): ``prefix``, ``queue``, ``kv``, ``session``,
    ``load`` (module docstring). Defaults: prefix 2, queue 1, kv 1 on the view's prefix
    match, the weights of llm-d's sample precise-prefix configuration (BLIS's default
    profile since 2026 has the same weights).

    Options: ``prefix_source`` (``view`` | ``history``), ``prefix_norm`` (``ratio`` |
    ``minmax``), ``history_blocks`` (int > 0, the history index's LRU capacity per
    worker, default 31,250 as llm-d), ``max_blocks`` (int >= 0, only the prompt's first
    ``max_blocks`` blocks are matched and recorded, llm-d's 256; 0: all).

    With ``prefix_source=history`` the policy keeps the index itself: after each pick it
    records the prompt's blocks on the chosen worker, head first (as llm-d and BLIS add
    them, so under LRU pressure a chain's head goes first), with no TTL. It is the one
    policy state that grows with the trace, bounded by ``history_blocks`` per worker.
    """

    name: ClassVar[str] = "weighted"
    params: ClassVar[dict[str, tuple[type, object]]] = {
        "prefix": (float, 2.0),
        "queue": (float, 1.0),
        "kv": (float, 1.0),
        "session": (float, 0.0),
        "load": (float, 0.0),
        "prefix_source": (str, "view"),
        "prefix_norm": (str, "ratio"),
        "history_blocks": (int, LLMD_LRU_CAPACITY),
        "max_blocks": (int, 0),
    }

    prefix: float
    queue: float
    kv: float
    session: float
    load: float
    prefix_source: str
    prefix_norm: str
    history_blocks: int
    max_blocks: int

    def __init__(self, rng: np.random.Generator, **kwargs: object) -> None:
        super().__init__(rng, **kwargs)
        self._history: ApproxPrefixIndex | None = None
        self._decisions = 0  # the history index's clock (it has no TTL, so only order matters)
        scorers: dict[str, Callable[[RouteRequest, ClusterView, list[str]], list[float]]] = {
            "prefix": self.prefix_scores,
            "queue": lambda r, v, ws: queue_scores(v, ws),
            "kv": lambda r, v, ws: kv_scores(v, ws),
            "session": lambda r, v, ws: session_scores(v, ws, r.session_id),
            "load": lambda r, v, ws: load_scores(v, ws),
        }
        self._scorers = [(getattr(self, k), scorers[k]) for k in SCORERS if getattr(self, k) > 0]

    def check_params(self) -> None:
        self._require_nonnegative(*SCORERS, "max_blocks")
        if not any(getattr(self, k) > 0 for k in SCORERS):
            raise ValueError(f"policy {self.name!r}: every weight is 0; give one of {', '.join(SCORERS)} > 0")
        _choice(self.name, "prefix_source", self.prefix_source, PREFIX_SOURCES)
        _choice(self.name, "prefix_norm", self.prefix_norm, PREFIX_NORMS)
        if self.history_blocks <= 0:
            raise ValueError(f"policy {self.name!r}: parameter history_blocks={self.history_blocks!r} must be > 0")

    @property
    def weights(self) -> dict[str, float]:
        """The scorers in use and their weights, e.g. ``{"prefix": 3.0, "queue": 2.0, "kv": 2.0}``."""
        return {k: getattr(self, k) for k in SCORERS if getattr(self, k) > 0}

    # -- prefix -------------------------------------------------------------------------
    def _blocks(self, request: RouteRequest) -> Sequence[int]:
        hashes = request.block_hashes
        return hashes[: self.max_blocks] if self.max_blocks else hashes

    def matched_blocks(self, request: RouteRequest, view: ClusterView, workers: Sequence[str]) -> tuple[list[int], int]:
        """Per worker, the prompt's leading blocks believed cached there, and the prompt's blocks."""
        hashes = self._blocks(request)
        if self.prefix_source == "history":
            index = self._history_index(view)
            return [index.match(w, hashes, self._decisions) for w in workers], len(hashes)
        bs = view.block_size
        total = len(hashes) if request.block_hashes else request.prompt_tokens // bs
        if self.max_blocks:
            total = min(total, self.max_blocks)
        return [min(view.matched_tokens(w, request) // bs, total) for w in workers], total

    def prefix_scores(self, request: RouteRequest, view: ClusterView, workers: list[str]) -> list[float]:
        """The ``prefix`` scorer over ``workers`` (``prefix_norm``: ratio or llm-d's min-max)."""
        matched, total = self.matched_blocks(request, view, workers)
        if self.prefix_norm == "minmax":
            return prefix_minmax(matched)
        return prefix_ratio(matched, total)

    def _history_index(self, view: ClusterView) -> ApproxPrefixIndex:
        if self._history is None:
            self._history = ApproxPrefixIndex(view.workers, view.block_size, self.history_blocks, ttl_s=math.inf)
        return self._history

    def _record(self, worker: str, request: RouteRequest, view: ClusterView) -> None:
        index = self._history_index(view)
        index.add_worker(worker)
        self._decisions += 1
        # ApproxPrefixIndex records its argument tail first; reversed, the chain goes in
        # head first, as llm-d's indexer and BLIS's PrefixCacheIndex add it.
        index.record(worker, self._blocks(request)[::-1], self._decisions)

    # -- the pick -----------------------------------------------------------------------
    def scores(self, request: RouteRequest, view: ClusterView) -> dict[str, float]:
        """Each up worker's weighted sum (each score clamped to [0, 1] first, as both sources do)."""
        up = up_workers(view)
        total = [0.0] * len(up)
        for weight, scorer in self._scorers:
            for i, s in enumerate(scorer(request, view, up)):
                total[i] += weight * min(1.0, max(0.0, s))
        return dict(zip(up, total))

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        scores = self.scores(request, view)
        best = max(scores.values())
        tied = [w for w, s in scores.items() if s == best]  # exact equality, as both sources
        pick = tied[0] if len(tied) == 1 else tied[int(self.rng.integers(len(tied)))]
        if self.prefix_source == "history" and self.prefix > 0:
            self._record(pick, request, view)
        return pick


def _preset(weights: dict[str, float], **options: object) -> dict[str, tuple[type, object]]:
    """WeightedPolicy's parameters with these defaults; a weight not named here is 0."""
    defaults = {**dict.fromkeys(SCORERS, 0.0), **weights, **options}
    unknown = sorted(set(defaults) - set(WeightedPolicy.params))
    if unknown:
        raise ValueError(f"weighted preset: no parameter(s) {unknown}")
    return {k: (typ, defaults.get(k, d)) for k, (typ, d) in WeightedPolicy.params.items()}


class LlmdPrecisePolicy(WeightedPolicy):
    """llm-d's precise scheduler: precise-prefix : kv-utilisation : queue = 3 : 2 : 2.

    The prefix match is the view's (the engines' caches; KV events in the gateway), scored
    as llm-d's precise-prefix-cache scorer did in 2025 (``prefix_norm=minmax``). The
    weights are those of llm-d's precise-scheduling test (blog "KV-cache wins you can
    see", 2025-09-24). Any parameter can be overridden: ``llmd_precise:queue=1``.
    """

    name: ClassVar[str] = "llmd_precise"
    params: ClassVar[dict[str, tuple[type, object]]] = _preset(
        {"prefix": 3.0, "kv": 2.0, "queue": 2.0}, prefix_source="view", prefix_norm="minmax")


class LlmdApproxPolicy(WeightedPolicy):
    """llm-d's approximate scheduler: prefix (own routing history) : kv : queue = 1 : 1 : 1.

    The prefix scorer is llm-d's ``prefix-cache-scorer``: an LRU index per worker of the
    prompts it routed there (31,250 blocks per worker, the first 256 blocks of a prompt),
    matched blocks / prompt blocks.
    """

    name: ClassVar[str] = "llmd_approx"
    params: ClassVar[dict[str, tuple[type, object]]] = _preset(
        {"prefix": 1.0, "kv": 1.0, "queue": 1.0}, prefix_source="history", prefix_norm="ratio",
        history_blocks=LLMD_LRU_CAPACITY, max_blocks=LLMD_MAX_PREFIX_BLOCKS)


class LlmdLoadPolicy(WeightedPolicy):
    """llm-d's load scheduler of the precise-scheduling test: queue + kv-utilisation, 1 : 1."""

    name: ClassVar[str] = "llmd_load"
    params: ClassVar[dict[str, tuple[type, object]]] = _preset({"queue": 1.0, "kv": 1.0})


class BlisQueueDepthPolicy(WeightedPolicy):
    """BLIS's ``queue-depth:1`` of its prefix-affinity hypothesis: min-max over in-flight load."""

    name: ClassVar[str] = "blis_queue_depth"
    params: ClassVar[dict[str, tuple[type, object]]] = _preset({"load": 1.0})


class BlisPrefixQueuePolicy(WeightedPolicy):
    """BLIS's ``prefix-affinity:3,queue-depth:2`` of its prefix-affinity hypothesis.

    prefix-affinity is a router-side LRU index of 10,000 blocks per instance, matched /
    prompt blocks, the whole prompt; queue-depth is min-max over in-flight load (``load``).
    """

    name: ClassVar[str] = "blis_prefix_queue"
    params: ClassVar[dict[str, tuple[type, object]]] = _preset(
        {"prefix": 3.0, "load": 2.0}, prefix_source="history", prefix_norm="ratio",
        history_blocks=BLIS_LRU_CAPACITY, max_blocks=0)


class BlisDefaultPolicy(WeightedPolicy):
    """BLIS's default weighted profile of its prefix-affinity hypothesis:
    prefix-affinity : queue-depth : kv-utilisation = 3 : 2 : 2 (as ``blis_prefix_queue``
    plus ``kv``)."""

    name: ClassVar[str] = "blis_default"
    params: ClassVar[dict[str, tuple[type, object]]] = _preset(
        {"prefix": 3.0, "load": 2.0, "kv": 2.0}, prefix_source="history", prefix_norm="ratio",
        history_blocks=BLIS_LRU_CAPACITY, max_blocks=0)


#: every preset class, by name (docs/policies.md, "weighted")
PRESETS: tuple[type[WeightedPolicy], ...] = (
    LlmdPrecisePolicy, LlmdApproxPolicy, LlmdLoadPolicy,
    BlisQueueDepthPolicy, BlisPrefixQueuePolicy, BlisDefaultPolicy,
)
