"""``kvroute measure``: engines up, gateway up, load, engines down; the same records.

For every run of an experiment on one hardware profile: start the profile's workers
(real vLLM on GPU hosts, vLLM's CPU build here, or the emulator), then per round and
policy reset every engine's prefix cache (no policy inherits another's cache), start a
gateway routing with that policy, replay the round's trace through it with the load
generator, and stop the gateway. Records carry ``source`` = ``live`` for real engines
and ``emulated`` for the emulator; the gateway's prefix view is approximate (``view`` =
``approx``). Engines are always stopped, also on an error or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from kvroute.experiment import Experiment
from kvroute.hardware import load_hardware
from kvroute.live.engines import running_engines, served_model_name
from kvroute.live.gateway import Gateway
from kvroute.live.loadgen import records_for, run_load, write_results
from kvroute.policies import make_policy
from kvroute.sim.run import load_trace, trace_seed

log = logging.getLogger(__name__)


async def _measure_policy(engines, hw, trace, spec: str, seed: int, redis_url: str | None, **load_kwargs):
    gw = Gateway(
        [f"{n}={u}" for n, u in zip(engines.names, engines.urls)],
        spec,
        seed=seed,
        redis_url=redis_url,
        prefill_s_per_token=_prefill_s_per_token(hw),
    )
    await gw.start()
    try:
        return await run_load(trace, gw.url, metrics_urls=engines.urls, model=served_model_name(hw), **load_kwargs)
    finally:
        await gw.stop()


def _prefill_s_per_token(hw) -> float:
    """The hardware profile's marginal prefill cost per token, for the gateway's delay estimate."""
    from kvroute.costmodel import StepTimeModel

    return StepTimeModel.from_hardware(hw).prefill_time(1000) / 1000


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
) -> pd.DataFrame:
    """Measure ``exp``'s policies on ``hardware`` and write ``out``'s records and summary."""
    hw = load_hardware(hardware)
    runs = exp.expand(policies, hardware, rounds, round_)
    for r in runs:  # bad specs fail before any engine starts
        make_policy(r.policy, np.random.default_rng(0))
    out = Path(out)
    records: list[dict] = []
    workers: dict[tuple, list[str]] = {}
    checks: dict[str, dict] = {}
    with running_engines(hw, run_dir=out / "engines", kind=engine, time_scale=time_scale) as engines:
        source = "emulated" if engines.kind == "emulator" else "live"
        for run in runs:
            trace = load_trace(exp, run.round)
            engines.reset_prefix_cache()
            log.info("measuring %s on %s round %d (%s)", run.policy, hardware, run.round, source)
            result = asyncio.run(
                _measure_policy(engines, hw, trace, run.policy, seed=exp.seed + run.round, redis_url=redis_url,
                                max_requests=max_requests, time_limit_s=time_limit_s)
            )
            records += records_for(result.rows, source=source, experiment=exp.name, hardware=hardware,
                                   policy=run.policy, round=run.round, seed=trace_seed(exp.seed, run.round),
                                   view="approx")
            workers[(exp.name, hardware, run.policy, run.round)] = list(engines.names)
            checks[f"{run.policy} round {run.round}"] = result.cross_check()
    return write_results(records, out, workers=workers, extra={"engine": engine or hw.engine.kind, "cross_check": checks})
