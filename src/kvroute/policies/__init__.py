"""Routing policies: one small class per policy, looked up by name.

A spec names a policy and its parameters: ``NAME`` or ``NAME:key=value,...``
(``hybrid_sticky:threshold_ms=5000``, ``cost_aware:alpha=0.25``). Every run builds
fresh instances with :func:`make_policy`, so no state (a round-robin counter, a
hash ring, an rng) leaks between runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

import numpy as np

from kvroute.live.peers import is_peer_spec, parse_peer_spec
from kvroute.policies.base import (
    ClusterView,
    NoWorkerUpError,
    Policy,
    RouteRequest,
    least_loaded,
    up_workers,
)
from kvroute.policies.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from kvroute.policies.cost_aware import CostAwarePolicy
from kvroute.policies.dynamo import DynamoPolicy
from kvroute.policies.kv_aware import KvAwarePolicy
from kvroute.policies.loadaware import LoadAwarePolicy
from kvroute.policies.sglang import PrefixApproxPolicy
from kvroute.policies.sticky import HashRing, HybridStickyPolicy, StickyPolicy
from kvroute.policies.vllm_router import ConsistentHashPolicy, SglangCacheAwarePolicy, VllmCacheAwarePolicy
from kvroute.policies.weighted import (
    BlisDefaultPolicy,
    BlisPrefixQueuePolicy,
    BlisQueueDepthPolicy,
    LlmdApproxPolicy,
    LlmdLoadPolicy,
    LlmdPrecisePolicy,
    WeightedPolicy,
)


class PolicyName(StrEnum):
    """Policy names, as written on the command line and in records."""

    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    STICKY = "sticky"
    HYBRID_STICKY = "hybrid_sticky"
    COST_AWARE = "cost_aware"
    KV_AWARE = "kv_aware"
    PREFIX_APPROX = "prefix_approx"
    DYNAMO = "dynamo"
    LOADAWARE = "loadaware"
    VLLM_CACHE_AWARE = "vllm_cache_aware"
    SGLANG_CACHE_AWARE = "sglang_cache_aware"
    CONSISTENT_HASH = "consistent_hash"
    WEIGHTED = "weighted"
    LLMD_PRECISE = "llmd_precise"
    LLMD_APPROX = "llmd_approx"
    LLMD_LOAD = "llmd_load"
    BLIS_QUEUE_DEPTH = "blis_queue_depth"
    BLIS_PREFIX_QUEUE = "blis_prefix_queue"
    BLIS_DEFAULT = "blis_default"


POLICIES: Mapping[PolicyName, type[Policy]] = MappingProxyType(
    {
        PolicyName.RANDOM: RandomPolicy,
        PolicyName.ROUND_ROBIN: RoundRobinPolicy,
        PolicyName.LEAST_LOADED: LeastLoadedPolicy,
        PolicyName.STICKY: StickyPolicy,
        PolicyName.HYBRID_STICKY: HybridStickyPolicy,
        PolicyName.COST_AWARE: CostAwarePolicy,
        PolicyName.KV_AWARE: KvAwarePolicy,
        PolicyName.PREFIX_APPROX: PrefixApproxPolicy,
        PolicyName.DYNAMO: DynamoPolicy,
        PolicyName.LOADAWARE: LoadAwarePolicy,
        PolicyName.VLLM_CACHE_AWARE: VllmCacheAwarePolicy,
        PolicyName.SGLANG_CACHE_AWARE: SglangCacheAwarePolicy,
        PolicyName.CONSISTENT_HASH: ConsistentHashPolicy,
        PolicyName.WEIGHTED: WeightedPolicy,
        PolicyName.LLMD_PRECISE: LlmdPrecisePolicy,
        PolicyName.LLMD_APPROX: LlmdApproxPolicy,
        PolicyName.LLMD_LOAD: LlmdLoadPolicy,
        PolicyName.BLIS_QUEUE_DEPTH: BlisQueueDepthPolicy,
        PolicyName.BLIS_PREFIX_QUEUE: BlisPrefixQueuePolicy,
        PolicyName.BLIS_DEFAULT: BlisDefaultPolicy,
    }
)

POLICY_NAMES: tuple[str, ...] = tuple(n.value for n in PolicyName)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``NAME`` or ``NAME:key=value,...`` into the name and raw string values.

    Only syntax is checked here (empty name, a pair without ``=``, an empty key, a
    repeated key); names, keys and value types are checked by :func:`make_policy`.
    Whitespace around names, keys and values is ignored.
    """
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"policy spec {spec!r}: missing policy name")
    args: dict[str, str] = {}
    if not sep:
        return name, args
    if not rest.strip():
        raise ValueError(f"policy spec {spec!r}: ':' must be followed by key=value pairs")
    for pair in rest.split(","):
        key, eq, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"policy spec {spec!r}: {pair.strip()!r} is not key=value")
        if key in args:
            raise ValueError(f"policy spec {spec!r}: parameter {key!r} given twice")
        args[key] = value
    return name, args


def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name``; ValueError listing valid names otherwise."""
    try:
        return POLICIES[PolicyName(name)]
    except ValueError:
        raise ValueError(
            f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}"
        ) from None


def make_policy(spec: str, rng: np.random.Generator) -> Policy:
    """A fresh policy from a spec; ``rng`` is its only source of randomness.

    Raises ValueError for an unknown name (listing valid names), an unknown
    parameter (naming it, listing valid ones), or a bad value (naming key and value).
    """
    name, args = parse_spec(spec)
    return policy_class(name)(rng, **args)


#: production router spec -> the kvroute policy that simulates it at that router's
#: defaults; None where kvroute has no counterpart (power_of_two: none yet).
#: sglang-router 0.3.2's cache_aware sends a low-match request to the least loaded worker,
#: not to the smallest tree (measured: tests/test_peers.py), so its counterpart is
#: vllm_cache_aware, not prefix_approx (older SGLang source, kept for comparison).
COUNTERPARTS: Mapping[str, str | None] = MappingProxyType(
    {
        "sglang_router:cache_aware": PolicyName.SGLANG_CACHE_AWARE.value,
        "sglang_router:round_robin": PolicyName.ROUND_ROBIN.value,
        "sglang_router:random": PolicyName.RANDOM.value,
        "sglang_router:power_of_two": None,
        # in front of vLLM workers, which refuse its /render posts, it matched no prefix (vllm_router.py)
        "vllm_router:cache_aware": f"{PolicyName.VLLM_CACHE_AWARE.value}:prefix_match=false",
        "vllm_router:consistent_hash": PolicyName.CONSISTENT_HASH.value,
        "vllm_router:round_robin": PolicyName.ROUND_ROBIN.value,
        "vllm_router:power_of_two": None,
    }
)


def counterpart(spec: str) -> str | None:
    """The kvroute policy spec that simulates the production router ``spec``.

    ``sglang_router:cache_aware`` -> ``sglang_cache_aware``, ``vllm_router:consistent_hash``
    -> ``consistent_hash``, and so on (:data:`COUNTERPARTS`). The policy's defaults are that
    router's command-line defaults. Returns None for a kvroute policy spec, and for a
    router policy that kvroute has no counterpart for (``power_of_two``). Raises
    ValueError for an unknown router policy (``vllm_router:nope``), naming the valid ones.
    """
    if not is_peer_spec(spec):
        return None
    router, policy = parse_peer_spec(spec)
    return COUNTERPARTS[f"{router}:{policy}"]


__all__ = [
    "COUNTERPARTS",
    "POLICIES",
    "POLICY_NAMES",
    "ClusterView",
    "ConsistentHashPolicy",
    "CostAwarePolicy",
    "DynamoPolicy",
    "HashRing",
    "HybridStickyPolicy",
    "KvAwarePolicy",
    "LeastLoadedPolicy",
    "LoadAwarePolicy",
    "NoWorkerUpError",
    "Policy",
    "PolicyName",
    "PrefixApproxPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "StickyPolicy",
    "SglangCacheAwarePolicy",
    "VllmCacheAwarePolicy",
    "WeightedPolicy",
    "counterpart",
    "least_loaded",
    "make_policy",
    "parse_spec",
    "policy_class",
    "up_workers",
]
