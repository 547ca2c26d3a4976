"""Cost-aware routing: trade the prefill a worker's cache saves against its queue."""

from __future__ import annotations

from typing import ClassVar

from kvroute.policies.base import ClusterView, Policy, RouteRequest, up_workers

#: scores closer than this (seconds) count as a tie, so float noise never decides
TIE_S = 1e-9


class CostAwarePolicy(Policy):
    """Minimise ``alpha * penalty(w) - saved(w)`` over the up workers.

    With P = ``request.prompt_tokens`` and m(w) = ``view.matched_tokens(w, request)``
    (clamped to [0, P]):

    * saved(w) = prefill_time_s(w, m(w)): the prefill the worker's cache saves. Under
      causal attention the tokens after the cached prefix cost the same whether the
      prefix is cached or recomputed (they attend to all P either way), so the saving
      is exactly the cost of computing the first m tokens from an empty context;
    * penalty(w) = queue_delay_s(w): the wait before this request's prefill starts.

    ``alpha`` (float >= 0, default 1.0) prices a second of queueing in seconds of
    prefill: alpha -> 0 is pure locality (most prefill saved), large alpha is pure
    load balancing (shortest estimated queue), and alpha = 1 minimises the estimated
    time to first token, queue_delay + prefill(P) - saved, on workers sharing one cost
    model (the score is then TTFT minus the constant prefill_time_s(P)). A fixed
    per-prefill term in the cost model counts as saved for any m > 0, the same on
    every worker. Ties (within 1 ns) go to the fewest in flight, then the lowest index.
    Assumes the view's delay and prefill estimates are unbiased; ignores decode
    slow-down from added batch load.
    """

    name: ClassVar[str] = "cost_aware"
    params: ClassVar[dict[str, tuple[type, object]]] = {"alpha": (float, 1.0)}

    alpha: float

    def check_params(self) -> None:
        self._require_nonnegative("alpha")

    def score(self, worker: str, request: RouteRequest, view: ClusterView) -> float:
        """``alpha * penalty - saved`` for one worker (seconds; lower is better)."""
        prompt = max(request.prompt_tokens, 0)
        matched = min(max(view.matched_tokens(worker, request), 0), prompt)
        saved = view.prefill_time_s(worker, matched) if matched else 0.0
        return self.alpha * view.queue_delay_s(worker) - saved

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        up = up_workers(view)
        scores = {w: self.score(w, request, view) for w in up}
        best = min(scores.values())
        tied = [w for w in up if scores[w] <= best + TIE_S]
        return min(tied, key=view.in_flight)
