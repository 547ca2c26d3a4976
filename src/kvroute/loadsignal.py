"""How a router sees the workers' load and caches: the experiment's ``load_signal``.

Both worlds fill a policy's view with the same choice (docs/policies.md, "Load signals"):

* ``router``: the router's own counters, exact and instantaneous (requests it routed and
  has not seen finish). The default; what the simulator always did.
* ``scraped``: the engines' ``/metrics`` gauges (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) as of the last scrape,
  one every ``interval_ms`` per worker, as llm-d and the vLLM production stack read load.
  Decisions between two scrapes see the same, stale load.
* ``events``: the engines' KV cache events, applied ``delay_ms`` after the engine
  changed its cache: the exact prefix view lags the engines. Load stays the router's own
  counters (KV events carry blocks, not queues; Dynamo counts load itself).

Why a type of its own: the simulator, the gateway, ``kvroute measure`` and the records
(column ``load_signal``) all need the same three options and the same label, so a
simulated row and a measured one can be checked like for like.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

SOURCES = ("router", "scraped", "events")


def _ms(value: float) -> str:
    return format(value, "g")


@dataclass(frozen=True, slots=True)
class LoadSignal:
    """One load-signal setting; :meth:`from_config` checks it, ``label`` names it in records.

    Attributes:
        source: ``router``, ``scraped`` or ``events``.
        interval_ms: scrape period of each worker's /metrics (``scraped`` only).
        delay_ms: how late KV events are applied (``events`` only).
    """

    source: str = "router"
    interval_ms: float | None = None
    delay_ms: float | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"load_signal.source: {self.source!r} is not one of {', '.join(SOURCES)}")
        for key, needed_by in (("interval_ms", "scraped"), ("delay_ms", "events")):
            value = getattr(self, key)
            if self.source == needed_by:
                if value is None:
                    raise ValueError(f"load_signal.{key}: source {needed_by} needs it")
                if not (math.isfinite(value) and (value > 0 if key == "interval_ms" else value >= 0)):
                    bound = "> 0" if key == "interval_ms" else ">= 0"
                    raise ValueError(f"load_signal.{key}: must be a finite number {bound}, got {value!r}")
            elif value is not None:
                raise ValueError(f"load_signal.{key}: applies to source {needed_by} only, not {self.source}")

    @classmethod
    def from_config(cls, raw: Mapping | None) -> LoadSignal:
        """Build from an experiment file's ``load_signal`` mapping (``None``: the default)."""
        raw = dict(raw or {})
        unknown = sorted(set(raw) - {"source", "interval_ms", "delay_ms"})
        if unknown:
            raise ValueError(f"load_signal.{unknown[0]}: unknown key; allowed: source, interval_ms, delay_ms")
        ms = {k: float(raw[k]) for k in ("interval_ms", "delay_ms") if raw.get(k) is not None}
        return cls(raw.get("source", "router"), **ms)

    @property
    def label(self) -> str:
        """The records' ``load_signal`` value: ``router``, ``scraped:100ms``, ``events:50ms``."""
        if self.source == "scraped":
            return f"scraped:{_ms(self.interval_ms)}ms"
        if self.source == "events":
            return f"events:{_ms(self.delay_ms)}ms"
        return "router"

    @property
    def interval_s(self) -> float:
        return (self.interval_ms or 0.0) / 1e3

    @property
    def delay_s(self) -> float:
        return (self.delay_ms or 0.0) / 1e3


ROUTER = LoadSignal()
