"""SGLang router's ``cache_aware`` rules over the view (``prefix_approx``)."""

from __future__ import annotations

from typing import ClassVar

from kvroute.policies.base import ClusterView, Policy, RouteRequest, up_workers


class PrefixApproxPolicy(Policy):
    """SGLang ``cache_aware``: balance when clearly imbalanced, else follow the cache.

    With load(w) = ``view.in_flight(w)`` over the up workers:

    1. imbalanced if ``max - min > balance_abs_threshold`` and
       ``max > min * balance_rel_threshold``: the least-loaded worker;
    2. else, if the best match rate ``matched_tokens / prompt_tokens`` is
       ``> cache_threshold``: the best-matching worker (ties -> least loaded);
    3. else the worker with the smallest prefix index (``view.index_size``; ties ->
       least loaded), which spreads new prefixes.

    Ties after that go to the lowest index. Parameters (SGLang's Python CLI
    defaults): ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
    ``balance_rel_threshold`` 1.5. SGLang matches raw characters in a per-worker
    radix tree; here the match is in tokens from the view. Defined over a
    router-side approximate index built from routing history (``default_exact``
    False); the caller records every decision, imbalanced ones included, as SGLang
    does. Rule 3 ignores load below the imbalance thresholds (the "death spiral"
    users report).
    """

    name: ClassVar[str] = "prefix_approx"
    params: ClassVar[dict[str, tuple[type, object]]] = {
        "cache_threshold": (float, 0.3),
        "balance_abs_threshold": (int, 64),
        "balance_rel_threshold": (float, 1.5),
    }
    default_exact: ClassVar[bool] = False

    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float

    def check_params(self) -> None:
        self._require_nonnegative(
            "cache_threshold", "balance_abs_threshold", "balance_rel_threshold"
        )

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        up = up_workers(view)
        load = {w: view.in_flight(w) for w in up}
        hi, lo = max(load.values()), min(load.values())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return min(up, key=load.__getitem__)
        matched = {w: view.matched_tokens(w, request) for w in up}
        best = min(up, key=lambda w: (-matched[w], load[w]))
        prompt = request.prompt_tokens
        if prompt > 0 and matched[best] / prompt > self.cache_threshold:
            return best
        return self.low_match_worker(up, load, view)

    def low_match_worker(self, up: list[str], load: dict[str, int], view: ClusterView) -> str:
        """Rule 3, below the cache threshold: SGLang's smallest tree (ties -> least loaded)."""
        return min(up, key=lambda w: (view.index_size(w), load[w]))
