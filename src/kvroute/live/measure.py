"""``kvroute measure``: engines up, gateway up, load, engines down; the same records.

For every run of an experiment on one hardware profile: start the profile's workers
(real vLLM on GPU hosts, vLLM's CPU build here, or the emulator), then per round and
policy reset every engine's prefix cache (no policy inherits another's cache), start a
gateway routing with that policy, replay the round's trace through it with the load
generator, and stop the gateway. Records carry ``source`` = ``live`` for real engines
and ``emulated`` for the emulator. Before the first run, real engines are warmed up
(:func:`warm_up`: the first run's trace, round-robin over every worker, unrecorded, for at
most ``WARMUP_S``), since the first load a fresh engine serves runs slower than any after
it and would otherwise be charged to whichever policy is measured first. The gateway's
prefix view is approximate (``view`` =
``approx``), or, with ``kv_events``, exact (``view`` = ``exact``): the engines publish
their KV cache events and each gateway subscribes to them
(:mod:`kvroute.live.kv_events`). The experiment's ``load_signal`` goes to every gateway
(records: ``load_signal``, as the simulator writes it; ``events`` turns the engines' KV
events on). Engines are always stopped, also on an error or Ctrl-C.

A production router's spec (``sglang_router:cache_aware``, ``vllm_router:consistent_hash``,
... see :mod:`kvroute.live.peers`) runs that router in the gateway's place, fronting
the same engines, through the same load generator (which sends ``X-Session-ID``, the
key of ``vllm_router:consistent_hash``); its records have ``view`` = ``peer``. The
routers drop kvroute's ``X-Worker`` header, so a request's worker comes from the
emulator's ``kvroute_worker`` body field, else is ``unknown``; load.json then has each
engine's request and prompt-token counts from its /metrics (``per_worker``), for every
policy, so per-worker load can be read beside the hit rate either way.

With the profile's ``engine.client_worker``, this process (the gateway and the load
generator) is pinned to that worker's core once the engines are healthy
(:func:`~kvroute.live.engines.pinned_process`, every thread; a production router started
meanwhile inherits it), so the client's CPU work lands on one known core, where the
simulator charges it; the engines are started first because their wrapper places worker i
on the i-th CPU this process may use.

load.json also says how the workers shared the machine (``cpu_affinity``): the
profile's ``engine.cpu_affinity``, the CPUs each worker's process tree was allowed as
read from /proc once they were healthy, those of this process, which runs the
gateway and the load generator, and ``client_worker`` (the worker whose core it was pinned
to, or null); ``client_cpu_s`` per policy and round is this process's
CPU time (gateway and load generator; a production router's own process is not in it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvroute.experiment import Experiment
from kvroute.hardware import load_hardware
from kvroute.live.canary import canary, engine_cpus
from kvroute.live.engines import EngineError, pinned_process, running_engines, served_model_name
from kvroute.live.gateway import Gateway
from kvroute.live.loadgen import WORKER_FIELD, LoadResult, records_for, run_load, write_results
from kvroute.live.peers import PeerError, is_peer_spec, parse_peer_spec, routers_venv, running_peer
from kvroute.live.probe import BracketProbe, write_probed
from kvroute.loadsignal import ROUTER, LoadSignal
from kvroute.pipeline import format_load
from kvroute.policies import make_policy
from kvroute.records import imbalance, write_csv
from kvroute.sim.run import load_columns, load_trace, trace_seed

log = logging.getLogger(__name__)

#: the ``worker`` of a request no header or body field attributed
UNKNOWN_WORKER = "unknown"
PEER_VIEW = "peer"


async def gateway_load(engines, hw, trace, spec: str, seed: int, redis_url: str | None,
                          load_signal: LoadSignal = ROUTER, **load_kwargs) -> LoadResult:
    """Replay ``trace`` through a kvroute gateway routing with ``spec`` in front of
    ``engines`` (:func:`~kvroute.live.loadgen.run_load`'s keywords pass through)."""
    kv = {}
    if engines.kv_events:
        kv = {"kv_events": engines.kv_events, "kv_topic": engines.kv_topics, "tokenizer": engines.tokenizer}
    gw = Gateway(
        [f"{n}={u}" for n, u in zip(engines.names, engines.urls)],
        spec,
        seed=seed,
        redis_url=redis_url,
        load_signal=load_signal,
        kv_capacity_blocks=hw.num_blocks,
        kv_block_size=hw.engine.block_size,
        **_delay_kwargs(hw),
        **kv,
    )
    await gw.start()
    try:
        return await run_load(trace, gw.url, metrics_urls=engines.urls, model=served_model_name(hw), **load_kwargs)
    finally:
        await gw.stop()


def _measure_peer(engines, hw, trace, spec: str, log_path: Path, **load_kwargs) -> LoadResult:
    """Replay ``trace`` through the production router ``spec`` fronting ``engines``."""
    with running_peer(spec, engines.urls, log_path=log_path) as url:
        result = asyncio.run(run_load(trace, url, metrics_urls=engines.urls, model=served_model_name(hw),
                                      worker_field=WORKER_FIELD, **load_kwargs))
    for r in result.rows:  # the router's own URL names no worker
        if r["worker"] == r["endpoint"]:
            r["worker"] = UNKNOWN_WORKER
    return result


#: How long the warm-up may send (the first run's trace, cut there): enough for the first
#: prefills of every chunk size, every batch size and the KV cache's memory to be touched.
WARMUP_S = 15.0
WARMUP_POLICY = "round_robin"  # reaches every worker


def warm_up(engines, hw, trace, seed: int, warmup_s: float = WARMUP_S,
            max_requests: int | None = None) -> dict[str, float]:
    """Serve ``trace`` (at most ``warmup_s`` of it) through a round-robin gateway and keep
    no record of it, then empty every prefix cache: what fresh engines run slowly the first
    time (in note2-cpu's round 0 the first policy measured, round-robin, had a mean TTFT of
    102 ms where its later rounds had 66-68) is paid here, by no policy. Returns what
    load.json says of it."""
    result = asyncio.run(gateway_load(engines, hw, trace, WARMUP_POLICY, seed=seed, redis_url=None,
                                         max_requests=max_requests, time_limit_s=warmup_s))
    engines.reset_prefix_cache()
    errors = sum(1 for r in result.rows if r["status"] != "ok")
    return {"policy": WARMUP_POLICY, "requests": float(len(result.rows)), "errors": float(errors),
            "seconds": round(result.wall_s, 3), "limit_s": warmup_s}


def _delay_kwargs(hw) -> dict:
    """The gateway's delay estimates from the profile's cost model (:meth:`DelayModel.from_hardware`)."""
    from dataclasses import asdict

    from kvroute.loadsignal import DelayModel

    return asdict(DelayModel.from_hardware(hw))


def per_worker_load(result: LoadResult, names: list[str], urls: list[str]) -> dict[str, dict[str, float]]:
    """Per worker: requests and prompt tokens it served, from its /metrics counters, and
    the requests the records attribute to it (``NaN`` where a counter was unreadable)."""
    deltas = result.deltas
    out: dict[str, dict[str, float]] = {}
    for name, url in zip(names, urls):
        d = deltas.get(url.rstrip("/"), {})
        out[name] = {
            "metrics_requests": d.get("request_success", math.nan),
            "metrics_prompt_tokens": d.get("prompt_tokens", math.nan),
            "metrics_cache_hits": d.get("prefix_cache_hits", math.nan),
            "metrics_generation_tokens": d.get("generation_tokens", math.nan),
            # seconds summed over the worker's requests (vLLM's histograms; NaN where absent)
            "metrics_engine_ttft_s": d.get("engine_ttft_s", math.nan),
            "metrics_engine_queue_s": d.get("engine_queue_s", math.nan),
            "metrics_engine_prefill_s": d.get("engine_prefill_s", math.nan),
            "metrics_engine_decode_s": d.get("engine_decode_s", math.nan),
            "metrics_engine_itl_s": d.get("engine_itl_s", math.nan),
            "metrics_engine_itl_tokens": d.get("engine_itl_count", math.nan),
            "records_requests": float(sum(1 for r in result.rows if r["worker"] == name)),
        }
    return out


@dataclass(frozen=True)
class Measurement:
    """One experiment of an engine session: where its records go (``out``) and, with a
    bracketing probe, its probe requests (``probe_out``); ``rounds`` as ``--rounds``."""

    exp: Experiment
    out: Path
    probe_out: Path | None = None
    rounds: int | None = None


def measure_experiment(
    exp: Experiment,
    out: Path,
    hardware: str,
    policies: list[str] | None = None,
    rounds: int | None = None,
    round_: int | None = None,
    engine: str | None = None,
    redis_url: str | None = None,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    time_limit_s: float | None = None,
    kv_events: bool = False,
    load: float | None = None,
    warmup_s: float = WARMUP_S,
    probe_out: Path | None = None,
) -> pd.DataFrame:
    """Measure ``exp``'s policies (kvroute's, or production routers) on ``hardware``;
    write ``out``'s records, summary and load.json.

    ``kv_events``: the engines publish KV cache events and kvroute's gateways route from
    them (an exact view; the production routers ignore them). ``load``: only that value
    of the experiment's load axis (default every value, each its own set of runs); the
    records carry it (``load_param``, ``load``). ``warmup_s``: how long real engines are
    warmed up before the first run (:func:`warm_up`; 0: not at all). ``probe_out``: probe
    the engines before and after the measurement (:class:`~kvroute.live.probe.BracketProbe`,
    real engines only) and write those probe requests there
    (:func:`~kvroute.live.probe.write_probed`), apart from the records: `kvroute calibrate
    --probe --probed` fits them and sees nothing else.

    Raises:
        EngineError: an engine or a production router cannot be started or reached
            (the message says what to build).
    """
    return measure_experiments([Measurement(exp, Path(out), probe_out, rounds)], hardware, policies, round_, engine,
                               redis_url, time_scale, max_requests, time_limit_s, kv_events, load, warmup_s)[0]


def measure_experiments(
    items: Sequence[Measurement],
    hardware: str,
    policies: list[str] | None = None,
    round_: int | None = None,
    engine: str | None = None,
    redis_url: str | None = None,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    time_limit_s: float | None = None,
    kv_events: bool = False,
    load: float | None = None,
    warmup_s: float = WARMUP_S,
) -> list[pd.DataFrame]:
    """:func:`measure_experiment` for several experiments, one after another on one set of
    engine processes (one start-up; the engines' logs in the first's ``out``/engines).

    With probes (every item's ``probe_out``, or none's), one :class:`BracketProbe` session
    runs before the first, after the last, and one between each two, which closes the
    first's bracket and opens the next's: each measurement is still probed on either side,
    on the processes it ran. Each experiment warms the engines up and resets their prefix
    caches before its runs, as when it runs alone. Every spec is checked, and the
    experiments must want the same engines (KV events on or off), before any engine starts.
    Records are written once the engines have stopped.

    Raises:
        EngineError: as :func:`measure_experiment`.
        ValueError: some items have a probe file and others not, or the experiments want
            engines started differently.
    """
    try:
        return _measure_experiments(list(items), hardware, policies, round_, engine, redis_url, time_scale,
                                    max_requests, time_limit_s, kv_events, load, warmup_s)
    except PeerError as exc:
        raise EngineError(str(exc)) from exc


def _measure_experiments(items, hardware, policies, round_, engine, redis_url, time_scale, max_requests,
                         time_limit_s, kv_events=False, load=None, warmup_s=WARMUP_S) -> list[pd.DataFrame]:
    if not items:
        raise ValueError("no experiment to measure")
    hw = load_hardware(hardware)
    probed = [m.probe_out is not None for m in items]
    if any(probed) and not all(probed):
        raise ValueError("probe every experiment of an engine session or none: "
                         f"{', '.join(m.exp.name for m in items if m.probe_out is None)} have no probe file")
    bracket = None
    if all(probed):
        if (engine or hw.engine.kind) == "emulator":
            raise EngineError("--probe calibrates real engines; the emulator runs the simulator's own step times")
        bracket = BracketProbe(hw, measurements=len(items))
    plans = []
    for m in items:
        runs = m.exp.expand(policies, hardware, m.rounds, round_, measured=True, load=load)
        for r in runs:  # bad specs (and a missing routers environment) fail before any engine starts
            if is_peer_spec(r.policy):
                parse_peer_spec(r.policy)
                routers_venv()
            else:
                make_policy(r.policy, np.random.default_rng(0))
        plans.append((m, runs, m.exp.load_signal))
    events = {signal.source == "events" for _, _, signal in plans}
    if not kv_events and len(events) > 1:
        raise ValueError("one engine session cannot measure both experiments whose load signal is KV events "
                         f"({', '.join(m.exp.name for m, _, s in plans if s.source == 'events')}) and others "
                         "(their engines publish no events): measure them apart")
    if not kv_events and events == {True}:
        log.info("load_signal events: the engines publish KV events (as with --kv-events)")
        kv_events = True
    done = []
    with ExitStack() as stack:
        engines = stack.enter_context(running_engines(hw, run_dir=Path(items[0].out) / "engines", kind=engine,
                                                      time_scale=time_scale, kv_events=kv_events))
        source = "emulated" if engines.kind == "emulator" else "live"
        pinned = stack.enter_context(pinned_process(engines.client_cpus(hw)))
        affinity = {"mode": hw.engine.cpu_affinity if engines.kind == "vllm-cpu" else "none",
                    "workers": engines.cpu_affinity(), "gateway_and_loadgen": sorted(os.sched_getaffinity(0)),
                    "client_worker": engines.names[hw.engine.client_worker] if pinned else None}
        log.info("CPU affinity: %s", affinity)
        if bracket is not None:
            log.info("probing %s before the measurement (its own requests, every worker alone)", hardware)
            bracket.before(engines)
        for i, (m, runs, signal) in enumerate(plans):
            result = _measure_runs(engines, hw, hardware, m.exp, m.out, runs, signal, source, kv_events, redis_url,
                                   max_requests, time_limit_s, warmup_s)
            result["extra"] |= {"cpu_affinity": affinity, "engine_session": _session_facts(items, i)}
            done.append(result)
            if bracket is not None:
                nxt = f" (and before {items[i + 1].exp.name})" if i + 1 < len(items) else ""
                log.info("probing %s after the measurement of %s%s", hardware, m.exp.name, nxt)
                bracket.after(engines)
    from kvroute.probefit import plan_facts

    summaries = []
    for i, (m, result) in enumerate(zip(items, done)):
        summary = write_results(result["records"], m.out, workers=result["workers"], extra=result["extra"])
        if bracket is not None:
            requests, facts = bracket.bracket(i)
            write_probed(m.probe_out, requests, plan_facts(bracket.plan, hw) | facts
                         | {"engine_session": result["extra"]["engine_session"]})
            log.info("wrote %s: %d probe requests (fit them with kvroute calibrate --probe --probed)", m.probe_out,
                     len(requests))
        summaries.append(_imbalance_from_metrics(summary, result["records"], result["loads"], m.out))
    return summaries


def _session_facts(items: Sequence[Measurement], i: int) -> dict:
    """load.json's ``engine_session``: the experiments measured on the same engine processes,
    in order, this one's place among them, and where the engines' logs are."""
    return {"experiments": [m.exp.name for m in items], "position": i,
            "engine_logs": str(Path(items[0].out) / "engines")}


def _measure_runs(engines, hw, hardware, exp, out, runs, signal, source, kv_events, redis_url, max_requests,
                  time_limit_s, warmup_s) -> dict:
    """One experiment's runs on the running ``engines``: its records, workers, per-worker
    loads and load.json's facts (written later, once the engines are down)."""
    records: list[dict] = []
    workers: dict[tuple, list[str]] = {}
    checks: dict[str, dict] = {}
    loads: dict[str, dict] = {}
    client_cpu: dict[str, float] = {}
    warmup = {}
    if runs and engines.kind != "emulator" and warmup_s > 0:  # the emulator has no first-load cost
        log.info("warming up %s for at most %.0f s (unrecorded)", hardware, warmup_s)
        warmup = warm_up(engines, hw, load_trace(exp, runs[0].round, runs[0].load), exp.seed, warmup_s,
                         max_requests)
    canaries: dict[str, list[dict]] = {}
    for run in runs:
        trace = load_trace(exp, run.round, run.load)
        key = _run_label(run.policy, run.round, run.load)
        engines.reset_prefix_cache()
        if engines.kind != "emulator":  # the machine's speed on the engines' cores, idle, before each run
            canaries[key] = canary(engine_cpus(engines))
        peer = is_peer_spec(run.policy)
        at = "" if run.load is None else f" {exp.load.param}={run.load}"
        log.info("measuring %s of %s on %s round %d%s (%s)", run.policy, exp.name, hardware, run.round, at, source)
        kwargs = {"max_requests": max_requests, "time_limit_s": time_limit_s}
        cpu0 = time.process_time()
        if peer:
            at_load = "" if run.load is None else f"-load{format_load(run.load)}"
            logp = Path(out) / "routers" / f"{run.policy.replace(':', '-')}{at_load}-round{run.round}.log"
            result = _measure_peer(engines, hw, trace, run.policy, logp, **kwargs)
        else:
            result = asyncio.run(
                gateway_load(engines, hw, trace, run.policy, seed=exp.seed + run.round, redis_url=redis_url,
                             load_signal=signal, **kwargs)
            )
        records += records_for(result.rows, source=source, experiment=exp.name, hardware=hardware,
                               policy=run.policy, round=run.round, seed=trace_seed(exp.seed, run.round),
                               view=PEER_VIEW if peer else "exact" if kv_events else "approx",
                               load_signal=PEER_VIEW if peer else signal.label, **load_columns(exp, run),
                               scaling=trace.meta.get("scaling"))
        workers[(exp.name, hardware, run.policy, run.round)] = list(engines.names)
        client_cpu[key] = round(time.process_time() - cpu0, 3)
        checks[key] = result.cross_check()
        loads[key] = per_worker_load(result, list(engines.names), list(engines.urls))
    extra = {"engine": engines.kind, "cross_check": checks, "per_worker": loads, "kv_events": kv_events,
             "client_cpu_s": client_cpu, "load_signal": signal.label, "warmup": warmup, "canary": canaries}
    return {"records": records, "workers": workers, "loads": loads, "extra": extra}


def _run_label(policy: str, round_: int, load: float | None) -> str:
    """How load.json names a run: ``POLICY round R``, with `` load V`` on a load axis."""
    at = "" if load is None or load != load else f" load {format_load(load)}"
    return f"{policy} round {int(round_)}{at}"


def _imbalance_from_metrics(summary: pd.DataFrame, records: list[dict], loads: dict, out: Path) -> pd.DataFrame:
    """Where the records cannot name a request's worker (a peer router behind real engines
    drops X-Worker), the records-based imbalance would be a meaningless 0: take it from the
    engines' own counters instead (uncached prompt + generated tokens per engine, the
    records' definition of work), or NaN where those are unreadable; rewrite summary.csv."""
    unknown = {_run_label(r["policy"], r["round"], r.get("load")) for r in records if r["worker"] == "unknown"}
    if not unknown:
        return summary
    for i, row in summary.iterrows():
        label = _run_label(row["policy"], row["round"], row.get("load"))
        if label not in unknown:
            continue
        per = loads.get(label, {})
        work = [w["metrics_prompt_tokens"] - w["metrics_cache_hits"] + w["metrics_generation_tokens"] for w in per.values()]
        summary.loc[i, "imbalance"] = imbalance(work) if work and not any(math.isnan(x) for x in work) else math.nan
    write_csv(summary, Path(out) / "summary.csv")
    return summary
