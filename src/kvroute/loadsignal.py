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

:class:`DelayModel` is how the gateway turns its counters into the queue-delay and prefill
estimates a load-aware policy reads (``cost_aware``, ``hybrid_sticky``); the simulator's
approximate view (the gateway's, ``view: approx``) computes them the same way, from the
same parameters, so both routers decide on the same beliefs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

SOURCES = ("router", "scraped", "events")
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4  # ~0.1 ms/token: a 7B model's prefill on an A6000
DEFAULT_DECODE_S_PER_RUNNING = 1e-3  # what one running request adds to a step ahead


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


@dataclass(frozen=True, slots=True)
class DelayModel:
    """The gateway's delay estimates (docs/live.md, the gateway view's ``queue_delay_s``).

    Attributes:
        prefill_s_per_token: the marginal prefill cost of a token (s).
        decode_s_per_running: what one running request adds to a step ahead (s).
        max_num_seqs: the engines' batch cap (``None``: no slot wait is estimated).
        decode_step_s: one decode step with a full batch (s), for the slot wait.
    """

    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    decode_s_per_running: float = DEFAULT_DECODE_S_PER_RUNNING
    max_num_seqs: int | None = None
    decode_step_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill_s_per_token < 0 or self.decode_s_per_running < 0:
            raise ValueError("prefill_s_per_token and decode_s_per_running must be >= 0")

    @classmethod
    def from_hardware(cls, hw) -> DelayModel:
        """What ``kvroute measure`` gives its gateway: from the profile's cost model (its own
        coefficients, ``hw.router_coefficients``, even where a calibration replaced them for
        the engines), the marginal prefill cost per token (over 1,000 tokens), and the batch
        cap with a full batch's decode step (at 1,000 tokens of context each) for the slot wait."""
        from dataclasses import replace

        from kvroute.costmodel import StepTimeModel

        model = StepTimeModel.from_hardware(replace(hw, coefficients=hw.router_coefficients))
        seqs = hw.engine.max_num_seqs
        return cls(prefill_s_per_token=model.prefill_time(1000) / 1000, max_num_seqs=seqs,
                   decode_step_s=model.step_time(seqs, seqs * 1000))

    def queue_delay_s(self, waiting_tokens: float, running: int, in_flight: int, finished: int,
                      output_tokens: int) -> float:
        """The wait before a new request's prefill starts: the uncached prompt tokens queued
        ahead (``waiting_tokens``) at ``prefill_s_per_token``, ``decode_s_per_running`` per
        running request, and, with a full batch, ``ceil((in_flight + 1 - max_num_seqs) /
        max_num_seqs)`` replies of the mean length so far (``output_tokens / finished``) at
        ``decode_step_s`` a token."""
        delay = waiting_tokens * self.prefill_s_per_token + running * self.decode_s_per_running
        cap = self.max_num_seqs
        if cap and in_flight >= cap and finished:
            waves = -(-(in_flight + 1 - cap) // cap)
            delay += waves * (output_tokens / finished) * self.decode_step_s
        return delay

    def scraped_queue_delay_s(self, running: int, waiting: int, routed: int, uncached_routed: int, finished: int,
                              output_tokens: int) -> float:
        """:meth:`queue_delay_s` over scraped counts: the gauges carry no token counts, so the
        waiting requests' uncached tokens are their count times the mean uncached prompt of
        the ``routed`` requests sent to the worker (``uncached_routed`` tokens in all)."""
        mean_uncached = uncached_routed / routed if routed else 0.0
        return self.queue_delay_s(waiting * mean_uncached, running, running + waiting, finished, output_tokens)

    def prefill_time_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token
