"""KV-aware routing: the worker that already holds the longest prefix of the prompt."""

from __future__ import annotations

from typing import ClassVar

from kvroute.policies.base import ClusterView, Policy, RouteRequest, up_workers


class KvAwarePolicy(Policy):
    """argmax of ``view.matched_tokens(w, request)``; ties -> fewest in flight -> lowest index.

    Parameters: none. When nothing matches anywhere every worker ties, so it is
    least-loaded. A system prompt shared by all conversations makes every worker that
    holds it tie on a conversation's first turn (the tie-break spreads them); later
    turns follow their history. But from a cold start the first worker to hold the
    system prompt out-matches the others and takes every new conversation: load only
    breaks ties, so a hot prefix piles onto one worker (as the field notes measured for
    the cache_aware peers). Exact or approximate depending on the view.
    """

    name: ClassVar[str] = "kv_aware"

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        return min(
            up_workers(view),
            key=lambda w: (-view.matched_tokens(w, request), view.in_flight(w)),
        )
