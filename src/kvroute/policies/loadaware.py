"""vLLM production-stack router's ``loadaware`` score: match rate minus relative load."""

from __future__ import annotations

from typing import ClassVar

from kvroute.policies.base import ClusterView, Policy, RouteRequest, up_workers

#: scores closer than this count as a tie
TIE = 1e-12


class LoadAwarePolicy(Policy):
    """Highest ``matched/prompt - beta * (load - mean) / max(1, mean)`` wins.

    load(w) = ``view.in_flight(w)``; mean = mean load over the up workers; matched =
    ``view.matched_tokens(w, request)``, prompt = ``request.prompt_tokens`` (match term
    0 for an empty prompt). Ties -> fewest in flight -> lowest index.

    Parameters: ``beta`` (float >= 0, default 1.0): how many match-rate points one
    mean-load of excess load costs; 0 is pure locality. The production stack reads
    matches from an LMCache controller (exact); here from the view.
    """

    name: ClassVar[str] = "loadaware"
    params: ClassVar[dict[str, tuple[type, object]]] = {"beta": (float, 1.0)}

    beta: float

    def check_params(self) -> None:
        self._require_nonnegative("beta")

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        up = up_workers(view)
        load = {w: view.in_flight(w) for w in up}
        mean = sum(load.values()) / len(up)
        prompt = request.prompt_tokens

        def score(w: str) -> float:
            rate = view.matched_tokens(w, request) / prompt if prompt > 0 else 0.0
            return rate - self.beta * (load[w] - mean) / max(1.0, mean)

        scores = {w: score(w) for w in up}
        best = max(scores.values())
        return min((w for w in up if scores[w] >= best - TIE), key=load.__getitem__)
