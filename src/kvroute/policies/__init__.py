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
from kvroute.policies.vllm_router import ConsistentHashPolicy, VllmCacheAwarePolicy


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
    CONSISTENT_HASH = "consistent_hash"


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
        PolicyName.CONSISTENT_HASH: ConsistentHashPolicy,
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


__all__ = [
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
    "VllmCacheAwarePolicy",
    "least_loaded",
    "make_policy",
    "parse_spec",
    "policy_class",
    "up_workers",
]
