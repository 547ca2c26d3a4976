"""NVIDIA Dynamo KV router's cost: blocks still to prefill plus blocks being decoded."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from kvroute.policies.base import ClusterView, Policy, RouteRequest, up_workers

#: relative tolerance under which two costs tie at temperature 0
TIE_REL = 1e-9


class DynamoPolicy(Policy):
    """Lowest ``overlap_weight * prefill_blocks(w) + decode_blocks(w)`` wins.

    prefill_blocks(w) = ceil((prompt_tokens - matched_tokens(w)) / block_size): blocks
    the worker would still prefill; decode_blocks(w) = ``view.active_blocks(w)``.

    * temperature 0: argmin; ties -> smallest ``view.index_size``, then uniform over the
      remaining tie with the policy's rng (as Dynamo's selector).
    * temperature > 0: sample w with probability proportional to
      ``exp(-(cost(w) - min) / (max - min) / temperature)``: costs are scaled to
      [0, 1] by their range first (as Dynamo does), so temperature is unit-free;
      equal costs give a uniform draw.

    Parameters: ``overlap_weight`` (float >= 0, default 1.0; 0 = pure decode-load
    balancing, higher favours TTFT), ``temperature`` (float >= 0, default 0.0).
    Dynamo reads KV events from the engines (exact view); without them it uses an
    approximate indexer with a 120 s TTL (:class:`kvroute.kvcache.index.ApproxPrefixIndex`).
    """

    name: ClassVar[str] = "dynamo"
    params: ClassVar[dict[str, tuple[type, object]]] = {
        "overlap_weight": (float, 1.0),
        "temperature": (float, 0.0),
    }

    overlap_weight: float
    temperature: float

    def check_params(self) -> None:
        self._require_nonnegative("overlap_weight", "temperature")

    def cost(self, worker: str, request: RouteRequest, view: ClusterView) -> float:
        """The worker's logit (blocks; lower is better)."""
        uncached = max(request.prompt_tokens - view.matched_tokens(worker, request), 0)
        prefill_blocks = math.ceil(uncached / view.block_size)
        return self.overlap_weight * prefill_blocks + view.active_blocks(worker)

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        up = up_workers(view)
        costs = np.array([self.cost(w, request, view) for w in up], dtype=float)
        lo, hi = costs.min(), costs.max()
        if self.temperature == 0.0:
            tied = [w for w, c in zip(up, costs) if c <= lo + TIE_REL * max(1.0, abs(lo))]
            smallest = min(view.index_size(w) for w in tied)
            tied = [w for w in tied if view.index_size(w) == smallest]
            return tied[0] if len(tied) == 1 else tied[int(self.rng.integers(len(tied)))]
        if hi == lo:
            return up[int(self.rng.integers(len(up)))]
        logits = -(costs - lo) / (hi - lo) / self.temperature
        weights = np.exp(logits - logits.max())
        cumulative = np.cumsum(weights)
        pick = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
        return up[min(pick, len(up) - 1)]
