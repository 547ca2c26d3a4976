"""Read a vLLM-compatible ``/metrics`` page: the prefix-cache counters and a few gauges.

vLLM (and kvroute's emulator) exposes Prometheus text; the load generator scrapes every
engine before and after a load and reports the counters' deltas beside the per-request
``cached_tokens`` from ``usage``, so the two accounts of cache hits can be compared.
Samples are summed over label sets (vLLM labels by ``model_name`` and ``engine``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

#: sample name -> short key in the dicts this module returns
SAMPLES: dict[str, str] = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_success_total": "request_success",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    # the engine's own account of the time to first token (from its API server's receipt of
    # the request) and of its parts inside the engine core: with the client's TTFT they say
    # how much of it the gateway, the load generator and the API server took
    "vllm:time_to_first_token_seconds_sum": "engine_ttft_s",
    "vllm:time_to_first_token_seconds_count": "engine_ttft_count",
    "vllm:request_queue_time_seconds_sum": "engine_queue_s",
    "vllm:request_prefill_time_seconds_sum": "engine_prefill_s",
    # the engine core's gaps between a stream's tokens (engine-core timestamps): with the
    # client's gaps they say whether a slow decode is the engine's steps or their delivery
    "vllm:request_decode_time_seconds_sum": "engine_decode_s",
    "vllm:inter_token_latency_seconds_sum": "engine_itl_s",
    "vllm:inter_token_latency_seconds_count": "engine_itl_count",
}
#: the load gauges a scraping router reads (``load_signal`` scraped), under vLLM's names;
#: vLLM's V0 engine called the KV usage ``gpu_cache_usage_perc`` (V1, 0.32 here: ``kv_cache_usage_perc``)
LOAD_SAMPLES: dict[str, str] = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_perc",
}
#: monotonic counters (their deltas mean something)
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success",
            "engine_ttft_s", "engine_ttft_count", "engine_queue_s", "engine_prefill_s", "engine_decode_s",
            "engine_itl_s", "engine_itl_count")


def parse_metrics(text: str, names: Mapping[str, str] = SAMPLES) -> dict[str, float]:
    """Sum each wanted sample over its label sets; absent samples are left out.

    Args:
        text: a Prometheus text exposition (a /metrics body).
        names: sample name -> key of the result.
    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def parse_load(text: str) -> dict[str, float]:
    """The :data:`LOAD_SAMPLES` gauges of a /metrics body, read line by line.

    Why not :func:`parse_metrics`: a scraping gateway reads every engine's page every
    ``interval_ms``, and vLLM's page is mostly histograms nobody here needs; parsing all
    of it costs the gateway's event loop milliseconds per scrape. Request counts are
    summed over label sets (engines); the KV usage fraction is their mean. A line that
    does not parse is skipped; a gauge that is absent is left out.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace, space = line.find("{"), line.find(" ")
        labelled = 0 <= brace < space or (brace >= 0 and space < 0)
        key = LOAD_SAMPLES.get(line[:brace] if labelled else line[:space])
        if key is None:
            continue
        rest = line[line.rfind("}") + 1:] if labelled else line[space:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + 1
    if "kv_cache_usage_perc" in sums:
        sums["kv_cache_usage_perc"] /= counts["kv_cache_usage_perc"]
    return sums


async def scrape_load(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> dict[str, float]:
    """GET ``base_url``/metrics and read its load gauges (:func:`parse_load`); raises on a
    connection or HTTP error."""
    url = base_url.rstrip("/") + "/metrics"
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return parse_load(await resp.text())


async def scrape(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """GET ``base_url``/metrics and parse it (raises on a connection or HTTP error)."""
    url = base_url.rstrip("/") + "/metrics"
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return parse_metrics(await resp.text())


async def scrape_all(
    session: aiohttp.ClientSession, base_urls: Iterable[str], timeout_s: float = 10.0
) -> dict[str, dict[str, float] | None]:
    """Scrape every engine; an engine that cannot be read maps to None (logged)."""
    out: dict[str, dict[str, float] | None] = {}
    for url in base_urls:
        try:
            out[url] = await scrape(session, url, timeout_s)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("cannot scrape %s/metrics: %s", url.rstrip("/"), exc or type(exc).__name__)
            out[url] = None
    return out


def delta(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float]:
    """Counter increase between two scrapes; NaN where either scrape is missing.

    A counter that went down means the engine restarted in between; its delta is NaN
    rather than a wrong number.
    """
    out: dict[str, float] = {}
    for key in COUNTERS:
        if before is None or after is None or key not in before or key not in after:
            out[key] = math.nan
            continue
        d = after[key] - before[key]
        out[key] = d if d >= 0 else math.nan
    return out
