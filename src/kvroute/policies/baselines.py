"""Load-only baselines: no locality at all (random, round-robin, least-loaded)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvroute.policies.base import ClusterView, Policy, RouteRequest, least_loaded, up_workers


class RandomPolicy(Policy):
    """Uniform choice over the up workers, drawn from the policy's ``rng``.

    Parameters: none. Assumes nothing; the baseline every locality claim is
    measured against (a turn returns to its previous worker with probability 1/n).
    """

    name: ClassVar[str] = "random"

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        up = up_workers(view)
        return up[int(self.rng.integers(len(up)))]


class RoundRobinPolicy(Policy):
    """Cycle over ``view.workers`` in order, skipping down workers.

    Parameters: none. State: the position after the last choice. With every worker
    up the per-worker counts over any request sequence differ by at most 1; a down
    worker is skipped without reshuffling the others' order. Ignores load and
    locality, so a two-turn chat alternates workers whenever turns interleave.
    """

    name: ClassVar[str] = "round_robin"

    def __init__(self, rng: np.random.Generator, **kwargs: object) -> None:
        super().__init__(rng, **kwargs)
        self._next = 0

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        up_workers(view)  # raises NoWorkerUpError when none is up
        workers = view.workers
        n = len(workers)
        i = self._next % n
        while not view.is_up(workers[i]):
            i = (i + 1) % n
        self._next = i + 1
        return workers[i]


class LeastLoadedPolicy(Policy):
    """The up worker with the fewest requests in flight (``view.in_flight``).

    Parameters: none. Ties go to the lowest worker index (deterministic, no rng
    draw), so equal-load bursts fill workers in order. Balances work, keeps no
    locality: the "least_load" policy of the reuse study.
    """

    name: ClassVar[str] = "least_loaded"

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        return least_loaded(view, up_workers(view))
