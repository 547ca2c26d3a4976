"""``kvroute calibrate --probe``: a family's step-time coefficients from probes of the live engines.

The inputs are the probe requests of :mod:`kvroute.live.probe` (work the calibration
chose and sent itself), never an experiment's records, so the simulations the
coefficients feed are predictions. Each probe becomes an observation the simulator
can predict, through the same :class:`~kvroute.costmodel.StepTimeModel` it runs
(:func:`kvroute.gpufit.step_model`):

* ``prefill``: the engine's prefill time of a prompt of ``tokens`` with ``cached`` of
  them from the prefix cache, predicted as the simulator's engine would run it alone:
  chunks of at most the profile's ``max_num_batched_tokens``, each one step.
* ``decode_step``: the time of one step decoding ``seqs`` sequences of ``tokens``
  context each: the engine's mean inter-token latency over a batch of ``seqs`` streams
  (their admission takes a step or two of a few tokens: a small bias, left in).

Repeated probes of one condition (the same lengths or batch, over repetitions and
workers) are summarised by their median: the build machines share their cores with
other jobs, and a contended probe is an outlier of one condition, not a fact about the
engine. The fit is the GPU fit's (:func:`kvroute.gpufit.fit_least_squares`): squared log
ratios predicted/median over conditions, standard errors from the Jacobian.

The API server's cost is measured, not fitted: per minimal probe, the client's time
to first token less the engine's queue and prefill time; its median and its
interquartile range ``api_jitter_ms`` (the simulator draws the cost uniformly in
``api_overhead_ms ± api_jitter_ms``, whose interquartile range is exactly
``api_jitter_ms``), each with a bootstrap standard error. A request's first step costs more
than a step of its tokens (vLLM admits it: on the CPU build a few ms); the fit finds that
``admission_ms`` beside the step coefficients. It is engine time: the simulator's engine adds
it to the step that admits a request, where the requests batched with it wait for it too, so
``api_overhead_ms`` is the API server's cost alone. The API server also templates and tokenises
the whole chat before the engine sees it, so its cost grows with the prompt: the same
difference, taken on every minimal and prefill probe (16 to 3,012 tokens), gives
``api_per_prompt_token_ms``, the Theil-Sen slope against prompt tokens (robust to a contended
probe; se from its 95% interval), and ``api_cost_ms`` is the minimal probes' median less that
slope's share. On the CPU build the API server shares its core with the engine core, so while
the engine runs it gets only part of the core: the ``api_busy`` probes (sent while other
streams decode) give ``api_busy_factor``, the median ratio of their delay to the idle one at
their length, each less the wait for the engine's step in progress (half a decode step of the
streams beside it: vLLM starts its queue time only when the engine core takes the request,
between steps, and the simulator's engine charges that wait itself). The simulator stretches
the API work by it while the engine runs and, the two processes sharing the core fairly, slows
the engine for as long (kvroute.sim.cluster). The cost per streamed token (client gap less the
engine's) is reported; the simulator has no such term.

The client (the gateway and the load generator, one process) costs CPU too, per request
routed, per prompt token and per streamed token, and on the CPU build it runs on a worker's
core (``engine.client_worker``). The probe's client batches (:func:`client_costs`) measure it
through a gateway of the probe's own; the simulator charges it to that worker's engine,
times ``client_interference`` (:func:`client_interference`): the engine time each second of
it costs the engine beside it, from the probe's interference batches (each engine's own
inter-token latency with the client beside it and elsewhere).
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvroute.costmodel import GBPS, TFLOP, StepTimeModel, attention_rates
from kvroute.gpufit import fit_least_squares, signed_percent, step_model
from kvroute.hardware import Hardware
from kvroute.live.probe import ProbePlan, ProbeRequest

#: attention's own rates (kvroute.costmodel): against cached KV, and within a prefill chunk
ATTENTION = ("attn_cached_efficiency", "attn_chunk_efficiency")
FITTED = ("compute_efficiency", "mem_efficiency", "step_overhead_ms", "per_seq_overhead_ms", *ATTENTION)
#: fitted beside them: what a request's first (prefill) step costs beyond a step of its tokens
ADMISSION = "admission_ms"
PER_TOKEN = "api_per_prompt_token_ms"
BUSY = "api_busy_factor"
MEASURED = ("api_overhead_ms", "api_jitter_ms", PER_TOKEN, BUSY)
#: (lower, upper, start): the cpu profile's bandwidth and peak are nominal figures for one
#: core, not a datasheet's, so an efficiency may pass 1 (the nominal figure is then low)
BOUNDS = {"compute_efficiency": (0.01, 20.0, 0.5), "mem_efficiency": (0.01, 20.0, 0.5),
          "step_overhead_ms": (0.0, 200.0, 5.0), "per_seq_overhead_ms": (0.0, 50.0, 0.5),
          ADMISSION: (0.0, 200.0, 2.0),
          # started at compute_efficiency's start: the fit begins from attention at the body's rate
          **dict.fromkeys(ATTENTION, (0.01, 50.0, 0.5))}
BOOTSTRAP = 2000


@dataclass(frozen=True)
class Observation:
    """One condition's median timing, and how the simulator would run that work."""

    kind: str  # prefill | decode_step
    tokens: int  # prefill: prompt tokens; decode_step: context per sequence
    cached: int  # prefill: tokens from the prefix cache; decode_step: 0
    seqs: int  # sequences in the step (1 for a prefill)
    measured_ms: float
    samples: int = 1
    spread_ms: float = 0.0  # median absolute deviation of the samples

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill tokens={self.tokens} cached={self.cached}"
        return f"decode_step seqs={self.seqs} context={self.tokens}"


def predict(o: Observation, model: StepTimeModel, budget: int) -> float:
    """The simulator's time (ms) for the work of ``o`` on an otherwise idle engine (a
    prefill's first step admits it: ``model.admission_s``)."""
    if o.kind == "decode_step":
        return 1e3 * model.step_time(o.seqs, o.seqs * o.tokens)
    done, left, total = o.cached, o.tokens - o.cached, 0.0
    while left > 0:
        q = min(budget, left)
        total += model.step_time(0, 0, [(q, done)], admissions=int(done == o.cached))
        done, left = done + q, left - q
    return 1e3 * total


def model_at(hw: Hardware, coef: dict[str, float]) -> StepTimeModel:
    """The simulator's step model of ``hw`` at ``coef`` (attention at the body's rate, and no
    admission cost, where ``coef`` gives none)."""
    m = step_model(hw.model, hw.mem_bw_gbps * GBPS * coef["mem_efficiency"],
                   hw.tflops * TFLOP * coef["compute_efficiency"], coef)
    return replace(m, admission_s=coef.get(ADMISSION, 0.0) * 1e-3,
                   **attention_rates(m.attn_flops_per_pair, hw.tflops * TFLOP, *(coef.get(k) for k in ATTENTION)))


# -- from probe requests to samples -------------------------------------------------------------


@dataclass
class Samples:
    """Every usable sample of one calibration, keyed by condition, and every request's row."""

    prefill: dict[tuple[int, bool], list[tuple[float, int, int]]] = field(default_factory=dict)
    decode: dict[tuple[int, int], list[tuple[float, int]]] = field(default_factory=dict)
    api: list[float] = field(default_factory=list)
    api_tokens: list[int] = field(default_factory=list)  # the minimal probes' prompt tokens
    #: (client TTFT - engine queue - engine prefill, prompt tokens) of every minimal and prefill probe
    api_by_tokens: list[tuple[float, int]] = field(default_factory=list)
    #: every API probe sent while the engine decoded: the same difference, its prompt tokens,
    #: the streams decoding beside it and their context (tokens)
    busy: list[tuple[float, int, int, float]] = field(default_factory=list)
    per_token: list[float] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def _outside_engine_ms(r: ProbeRequest) -> float:
    """The client's TTFT less the engine's queue and prefill time: the API server's cost."""
    return r.ttft_ms - 1e3 * (r.engine["queue_s"] + r.engine["prefill_s"])


def collect(requests: Iterable[ProbeRequest]) -> Samples:
    """Turn probe requests into samples; requests with an error are kept as rows, unused
    (a decode batch is one sample, on its first request's row)."""
    s = Samples()
    groups: dict[tuple[int, str, int], list[ProbeRequest]] = {}  # (session, worker, batch)
    background = [r.prompt_tokens for r in requests if r.phase == "busy_background" and not r.error]
    background_ctx = statistics.median(background) if background else 0.0
    for r in requests:
        row = r.row() | {"kind": r.phase, "measured_ms": math.nan, "context": math.nan, "used": False}
        ok = not r.error
        if r.phase == "api" and ok:
            api = _outside_engine_ms(r)
            s.api.append(api)
            s.api_tokens.append(r.prompt_tokens)
            s.api_by_tokens.append((api, r.prompt_tokens))
            row |= {"kind": "api", "measured_ms": api, "used": True}
        elif r.phase == "api_busy" and ok:
            api = _outside_engine_ms(r)
            s.busy.append((api, r.prompt_tokens, r.batch - 1, background_ctx))
            row |= {"kind": "api_busy", "measured_ms": api, "used": True}
        elif r.phase == "prefill" and ok:
            ms = 1e3 * r.engine["prefill_s"]
            s.prefill.setdefault((r.words, r.warm), []).append((ms, r.prompt_tokens, r.cached_tokens))
            api = _outside_engine_ms(r)
            s.api_by_tokens.append((api, r.prompt_tokens))
            row |= {"kind": "prefill", "measured_ms": ms, "context": r.cached_tokens, "used": True, "api_ms": api}
        elif r.phase == "decode":
            groups.setdefault((r.session, r.worker, r.group), []).append(r)
            continue
        s.rows.append(row)
    for streams in groups.values():
        first = streams[0]
        n = first.max_tokens
        ok = all(not r.error for r in streams) and first.engine.get("itl_tokens") == len(streams) * (n - 1)
        step = 1e3 * first.engine["itl_s"] / first.engine["itl_tokens"] if ok else math.nan
        ctx = round(statistics.mean(r.prompt_tokens for r in streams) + n / 2) if ok else math.nan
        if ok:
            s.decode.setdefault((first.words, first.batch), []).append((step, ctx))
        for i, r in enumerate(streams):
            row = r.row() | {"kind": "decode_step", "measured_ms": step, "context": ctx, "used": ok and i == 0}
            if len(r.token_s) > 1 and r.output_tokens > 1:
                row["client_gap_ms"] = 1e3 * (r.token_s[-1] - r.token_s[0]) / (r.output_tokens - 1)
                if ok and r.batch == 1:
                    s.per_token.append(row["client_gap_ms"] - step)
                    row["api_per_token_ms"] = row["client_gap_ms"] - step
            if not ok and not row["error"]:
                row["error"] = f"the batch's engine counted {first.engine.get('itl_tokens')} inter-token gaps"
            s.rows.append(row)
    return s


def _mad(xs: Sequence[float]) -> float:
    m = statistics.median(xs)
    return statistics.median(abs(x - m) for x in xs)


def observations(s: Samples) -> list[Observation]:
    """One observation per condition: the median time, at the median sizes."""
    obs = []
    for (_, _), xs in sorted(s.prefill.items()):
        ms = [x[0] for x in xs]
        obs.append(Observation("prefill", int(statistics.median(x[1] for x in xs)),
                               int(statistics.median(x[2] for x in xs)), 1, statistics.median(ms), len(ms), _mad(ms)))
    for (_, b), xs in sorted(s.decode.items()):
        ms = [x[0] for x in xs]
        obs.append(Observation("decode_step", int(statistics.median(x[1] for x in xs)), 0, b,
                               statistics.median(ms), len(ms), _mad(ms)))
    return obs


def bootstrap_se(xs: Sequence[float], stat, seed: int = 0) -> float:
    """Standard error of ``stat(xs)`` from resampling ``xs`` (a fixed seed: deterministic)."""
    a = np.asarray(xs, dtype=float)
    if a.size < 2:
        return math.nan
    idx = np.random.default_rng(seed).integers(0, a.size, size=(BOOTSTRAP, a.size))
    return float(np.std([stat(a[i]) for i in idx], ddof=1))


def _iqr(a: np.ndarray) -> float:
    q1, q3 = np.percentile(a, [25, 75])
    return float(q3 - q1)


# -- the fit ----------------------------------------------------------------------------------


@dataclass
class ProbeFit:
    """Coefficients with standard errors, every observation and the facts of the probe."""

    hardware: str
    family: str
    coefficients: dict[str, float]
    errors: dict[str, float]
    observations: list[Observation]
    predicted: list[float]
    rows: list[dict]
    measured: dict[str, dict[str, float]]
    probed: dict
    #: degrees of freedom of each stated error (the source it came from): the 95% interval is
    #: ``t(0.975, dof) * se`` (:func:`interval95`)
    dof: dict[str, float] = field(default_factory=dict)

    def residual_lines(self) -> list[str]:
        return [f"{o.label} ({o.samples} samples, MAD {o.spread_ms:.3g} ms): measured median {o.measured_ms:.4g} ms, "
                f"predicted {p:.4g} ({signed_percent(p / o.measured_ms - 1)})" for o, p in zip(self.observations, self.predicted)]

    def rms_log_error(self) -> float:
        r = [math.log(p / o.measured_ms) for o, p in zip(self.observations, self.predicted)]
        return math.sqrt(sum(x * x for x in r) / len(r)) if r else math.nan


def _check(s: Samples, obs: list[Observation]) -> None:
    kinds = {o.kind for o in obs}
    if len(s.api) < 3 or kinds != {"prefill", "decode_step"} or len(obs) <= len(FITTED) + 1:
        raise ValueError(f"too few usable probes to fit: {len(s.api)} api, "
                         f"{sum(o.kind == 'prefill' for o in obs)} prefill and "
                         f"{sum(o.kind == 'decode_step' for o in obs)} decode conditions "
                         f"({sum(1 for r in s.rows if r['error'])} requests failed)")


def _estimate(s: Samples, obs: list[Observation], hw: Hardware) -> tuple[dict[str, float], dict[str, float]]:
    """Every estimated quantity (the step coefficients, admission, the API cost's median and
    interquartile range) and the Jacobian's standard errors of the fitted ones."""
    budget = hw.engine.max_num_batched_tokens
    names = (*FITTED, ADMISSION)
    lo = [BOUNDS[k][0] for k in names]
    hi = [BOUNDS[k][1] for k in names]
    x0 = [BOUNDS[k][2] for k in names]

    def residuals(x):
        c = dict(zip(names, map(float, x)))
        m = model_at(hw, c)
        return np.array([math.log(predict(o, m, budget) / o.measured_ms) for o in obs])

    x, se_x = fit_least_squares(residuals, x0, lo, hi)
    est = dict(zip(names, map(float, x)))
    slope, _ = api_slope(s)
    api = np.asarray(s.api)
    est |= {"api_cost_ms": float(np.median(api - slope * np.asarray(s.api_tokens, dtype=float))), "api_jitter_ms": _iqr(api),
            PER_TOKEN: slope}
    est[BUSY] = busy_factor(s, est, hw)
    # admission is engine time (the simulator's engine charges it in the request's first step,
    # where the requests batched with it wait for it too), so the API server's delay is its own
    est["api_overhead_ms"] = est["api_cost_ms"]
    return est, dict(zip(names, map(float, se_x)))


def api_slope(s: Samples) -> tuple[float, float]:
    """The API cost's growth per prompt token (ms) over every minimal and prefill probe, and
    its standard error: the Theil-Sen slope (a median of pairwise slopes, so a few contended
    probes do not move it) and its 95% interval / 3.92. Not below zero (a cost does not fall
    with more tokens to template); 0 and NaN when the probes span no range of lengths."""
    from scipy.stats import theilslopes

    pairs = np.asarray(s.api_by_tokens, dtype=float).reshape(-1, 2)
    if len(pairs) < 3 or np.ptp(pairs[:, 1]) == 0:
        return 0.0, math.nan
    res = theilslopes(pairs[:, 0], pairs[:, 1])
    return max(0.0, float(res.slope)), float(res.high_slope - res.low_slope) / 3.92


def step_wait_ms(s: Samples, est: dict[str, float], hw: Hardware) -> np.ndarray:
    """Per ``api_busy`` probe: the mean wait for the engine's step in progress, half a decode
    step of the streams beside it (the fitted model's). The engine core takes a new request
    only between steps and vLLM starts its queue time there, so the probe's cost outside the
    engine holds that wait; the simulator's engine charges it itself."""
    busy = np.asarray(s.busy, dtype=float).reshape(-1, 4)
    m = model_at(hw, est)
    return np.array([0.5e3 * m.step_time(int(n), int(n) * ctx) if n > 0 else 0.0 for n, ctx in busy[:, 2:]])


def busy_ratios(s: Samples, est: dict[str, float], hw: Hardware) -> np.ndarray:
    """Each ``api_busy`` probe's delay over the idle one at its length, as the simulator
    charges them: the API cost, less the wait for the step in progress
    (:func:`step_wait_ms`)."""
    busy = np.asarray(s.busy, dtype=float).reshape(-1, 4)
    idle = est["api_cost_ms"] + est[PER_TOKEN] * busy[:, 1]
    return (busy[:, 0] - step_wait_ms(s, est, hw)) / idle


def busy_factor(s: Samples, est: dict[str, float], hw: Hardware) -> float:
    """How much longer a request's API delay is while its engine runs: the median of
    :func:`busy_ratios`, not below 1; 1 without busy probes (nothing measured, nothing added)."""
    ratios = busy_ratios(s, est, hw)
    return max(1.0, float(np.median(ratios))) if ratios.size else 1.0


def _jackknife_se(requests: list, grouped: list, key, est: dict[str, float], hw,
                  min_groups: int) -> tuple[dict[str, float], list, list[dict[str, float]]]:
    """Jackknife standard errors of every estimate in ``est``, leaving out one group of
    ``grouped`` (by ``key``) at a time from ``requests`` (NaN with fewer than ``min_groups``
    groups that fit); also the groups and the fit without each (empty where one failed)."""
    groups = sorted({key(r) for r in grouped})
    fits: list[dict[str, float]] = []
    if len(groups) >= min_groups:
        for g in groups:
            rest = collect([r for r in requests if key(r) != g])
            obs = observations(rest)
            try:
                _check(rest, obs)
            except ValueError:
                continue
            fits.append(_estimate(rest, obs, hw)[0])
    out = {k: _jackknife_spread([f[k] for f in fits]) if len(fits) >= min_groups else math.nan for k in est}
    return out, groups, fits


def _jackknife_spread(leave_one_out: Sequence[float]) -> float:
    """The jackknife standard error from an estimate's values with each group left out."""
    vals = np.asarray(leave_one_out, dtype=float)
    n = vals.size
    return float(math.sqrt((n - 1) / n * np.sum((vals - vals.mean()) ** 2)))


def _stretch(row: dict) -> tuple[int, int]:
    """A phase row's stretch of time: its (session, repetition); rows written before the
    phases ran in every session name no session, and were all the last one's."""
    return row.get("session", 0), row["rep"]


def _mean_with_errors(xs: np.ndarray, blocks: list[tuple[int, str, int]]) -> dict[str, float]:
    """The mean of ``xs`` (one per probe of ``blocks``: (session, worker, repetition)) with the
    largest of its within-run standard error, a delete-one-block jackknife and a
    leave-one-process-out jackknife, as the fitted terms state theirs: the within-run
    error alone says nothing of what a second calibration's fresh processes will give."""
    def jackknife(labels: list) -> tuple[float, float]:
        groups = sorted(set(labels))
        if len(groups) < 2:
            return math.nan, math.nan
        means = [xs[np.array([label != g for label in labels])].mean() for g in groups]
        return _jackknife_spread(means), len(groups) - 1.0

    sources = [(float(xs.std(ddof=1) / math.sqrt(xs.size)), xs.size - 1.0), jackknife(blocks),
               jackknife([b[:2] for b in blocks])]
    se, dof = max((s for s in sources if math.isfinite(s[0])), default=(math.nan, math.nan))
    return {"value": float(xs.mean()), "se": se, "dof": dof}


#: the client's CPU costs (:func:`client_costs`), in the order of their columns
CLIENT = ("client_cpu_per_request_ms", "client_cpu_per_prompt_token_ms", "client_cpu_per_token_ms")


#: a worker's CPU per request it refuses (:func:`refused_cost`)
REFUSED = "api_refused_request_ms"


def refused_cost(batches: Sequence[dict]) -> dict[str, dict[str, float]]:
    """A worker's CPU per request it answers without serving it (vllm-router's render call,
    refused), from the probe's refused batches (:func:`kvroute.live.probe.refused_probe`):
    the mean over batches of CPU per request, with the larger of its standard error and the
    jackknives over repetitions and engine processes (:func:`_mean_with_errors`). Empty with
    fewer than three error-free batches."""
    ok = [b for b in batches if b.get("calls") and not b.get("errors")]
    if len(ok) < 3:
        return {}
    xs = np.array([b["cpu_ms"] / b["calls"] for b in ok], float)
    return {REFUSED: _mean_with_errors(xs, [(b.get("session", 0), b["worker"], b["rep"]) for b in ok])}


#: the engine time a second of the client's CPU beside it costs (:func:`client_interference`)
INTERFERENCE = "client_interference"


def interference(itl_beside_ms: float, itl_alone_ms: float, cpu_s: float, wall_s: float) -> dict[str, float]:
    """An engine's slowdown beside the client (its ITL there over its ITL without it), the
    client's share of a core (CPU over wall seconds), the slowdown that share alone explains
    if the engine lost exactly the client's CPU time (1 / (1 - share)), and k, the engine's
    lost share of time over the client's share (1: exactly its CPU time)."""
    slowdown = itl_beside_ms / itl_alone_ms
    share = cpu_s / wall_s
    return {"slowdown": slowdown, "share": share, "cpu_only": 1.0 / (1.0 - share),
            "k": (1.0 - 1.0 / slowdown) / share if share > 0 else float("nan")}


def paired_interference(rows: Sequence[dict]) -> list[dict]:
    """Per repetition and engine of the probe's interference batches
    (:func:`kvroute.live.probe.interference_probe`): :func:`interference` of its ITL with the
    client pinned beside it (placement named for its worker) against its own ITL with the
    client pinned beside another worker in the same repetition. Comparing an engine with
    itself, not with the other engine, keeps a difference between the cores (another
    tenant's load, interrupts) from reading as the client's cost. Batches with errors are left out."""
    out = []
    for session, rep in sorted({_stretch(r) for r in rows}):
        by = {r["client"]: r for r in rows if _stretch(r) == (session, rep) and not r.get("errors")}
        names = [f"w{i}" for i in range(max((len(r["itl_ms"]) for r in by.values()), default=0))]
        for e, name in enumerate(names):
            others = [o for o in names if o != name and o in by]
            if name not in by or not others:
                continue
            beside = by[name]["itl_ms"][e]
            alone = [by[o]["itl_ms"][e] for o in others if by[o]["itl_ms"][e]]
            if not beside or not alone:
                continue
            f = interference(beside, float(np.mean(alone)), by[name]["cpu_s"], by[name]["wall_s"])
            out.append({"session": session, "rep": rep, "engine": name, "alone": float(np.mean(alone)),
                        "beside": beside} | f)
    return out


def client_interference(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """``client_interference``: the mean k of :func:`paired_interference` with the larger of
    its within-run error and the jackknives over repetitions and engines
    (:func:`_mean_with_errors`). Empty with fewer than three pairs."""
    pairs = [p for p in paired_interference(rows) if math.isfinite(p["k"])]
    if len(pairs) < 3:
        return {}
    xs = np.array([p["k"] for p in pairs], float)
    return {INTERFERENCE: _mean_with_errors(xs, [(p["session"], p["engine"], p["rep"]) for p in pairs])}


#: how much slower an engine runs while another engine of the host runs (:func:`neighbour_slowdown`)
NEIGHBOUR = "neighbour_slowdown"


def neighbour_slowdown(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """``neighbour_slowdown``: per session, repetition and worker of the probe's neighbour batches
    (:func:`kvroute.live.probe.neighbour_probe`), its ITL with its neighbour decoding over
    its ITL with the neighbour idle; the mean with the larger of its standard error and the
    jackknives over repetitions and workers (:func:`_mean_with_errors`). Batches with errors
    are left out with their pair. Empty with fewer than three pairs."""
    pairs = []
    for stretch in sorted({_stretch(r) for r in rows}):
        for w in sorted({r["worker"] for r in rows if _stretch(r) == stretch}):
            by = {r["neighbour_busy"]: r for r in rows
                  if _stretch(r) == stretch and r["worker"] == w and not r.get("errors")}
            if by.get(True, {}).get("itl_ms") and by.get(False, {}).get("itl_ms"):
                pairs.append(((stretch[0], w, stretch[1]), by[True]["itl_ms"] / by[False]["itl_ms"]))
    if len(pairs) < 3:
        return {}
    xs = np.array([x for _, x in pairs], float)
    return {NEIGHBOUR: _mean_with_errors(xs, [block for block, _ in pairs])}


def client_costs(batches: Sequence[dict]) -> dict[str, dict[str, float]]:
    """The client's CPU per request, per prompt token and per streamed token, from the
    probe's client batches (:func:`kvroute.live.probe.client_probe`): least squares of each
    error-free batch's ``cpu_ms`` on its requests, prompt tokens and output tokens, no
    intercept, each cost at least 0. Standard error: the larger of the fit's own (residual
    variance over the design) and a leave-one-repetition-out jackknife (a repetition of a
    session: what changes between stretches of time), with that error's degrees of freedom. Empty without enough batches
    of at least three kinds."""
    from scipy.optimize import lsq_linear

    ok = [b for b in batches if not b.get("errors") and b.get("requests")]
    if len(ok) <= len(CLIENT):
        return {}
    X = np.array([[b["requests"], b["prompt_tokens"], b["output_tokens"]] for b in ok], float)
    y = np.array([b["cpu_ms"] for b in ok], float)
    if np.linalg.matrix_rank(X) < len(CLIENT):
        return {}

    def solve(X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return lsq_linear(X, y, bounds=(0.0, np.inf)).x

    beta = solve(X, y)
    dof = float(len(y) - len(CLIENT))
    resid = y - X @ beta
    cov = (resid @ resid / dof) * np.linalg.inv(X.T @ X)
    se_fit = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    reps = sorted({_stretch(b) for b in ok})
    loo = []
    for rep in reps if len(reps) >= 3 else ():
        keep = np.array([_stretch(b) != rep for b in ok])
        if np.linalg.matrix_rank(X[keep]) == len(CLIENT):
            loo.append(solve(X[keep], y[keep]))
    out = {}
    for j, k in enumerate(CLIENT):
        se, df = float(se_fit[j]), dof
        if len(loo) >= 3:
            jack = _jackknife_spread([b[j] for b in loo])
            if jack > se:
                se, df = jack, len(loo) - 1.0
        out[k] = {"value": float(beta[j]), "se": se, "dof": df, "se_fit": float(se_fit[j])}
    return out


def fit_probes(requests: Sequence[ProbeRequest], hw: Hardware, probed: dict | None = None) -> ProbeFit:
    """Fit ``hw``'s family to probe ``requests`` (see the module docstring).

    Standard errors: the largest of the fit's own (the Jacobian's, or the bootstrap's for
    the API cost); a delete-one-block jackknife over the probe's blocks (a worker's
    repetition: probes sent in one stretch of time), which carries what changes between
    stretches, above all the load other jobs put on shared cores; and a leave-one-process-out
    jackknife over the engine processes (each worker in each session of
    :func:`~kvroute.live.probe.run_probe`), which carries what differs between processes
    (each one's own share of the machine), drawn afresh by every calibration. The last two say how far a second
    calibration may land; all three are in the provenance. Each stated error keeps the degrees
    of freedom of its source (``ProbeFit.dof``), so its 95% interval is Student's, not 2 se.

    Raises:
        ValueError: too few usable probes for a fit (named by phase).
    """
    s = collect(requests)
    obs = observations(s)
    _check(s, obs)
    est, se_fit = _estimate(s, obs, hw)
    api = np.asarray(s.api)
    se_fit |= {"api_cost_ms": bootstrap_se(api, np.median), "api_jitter_ms": bootstrap_se(api, _iqr),
               PER_TOKEN: api_slope(s)[1],
               BUSY: bootstrap_se(busy_ratios(s, est, hw), np.median)
               if len(s.busy) >= 3 else math.nan}
    se_fit["api_overhead_ms"] = se_fit["api_cost_ms"]
    # a delete-one-block jackknife over (session, worker, repetition) blocks of probes; and,
    # since each engine process (a worker in one session) has its own share of the machine,
    # drawn afresh by every calibration, a leave-one-process-out jackknife for the run-to-run
    # part (with two processes: half the difference of their own fits)
    timed = [r for r in requests if r.phase in ("api", "prefill", "decode", "api_busy")]
    se_jack, _, jack = _jackknife_se(requests, timed, lambda r: (r.session, r.worker, r.rep), est, hw, min_groups=3)
    se_workers, workers, per_worker = _jackknife_se(requests, requests, lambda r: (r.session, r.worker), est, hw,
                                                    min_groups=2)
    # each error's degrees of freedom, for its 95% interval: the Jacobian's, conditions less
    # parameters; a bootstrap's, samples less one; a jackknife's, groups less one (two engine
    # processes per session over two sessions: 3, where a 2-se band covers only 86%)
    df_fit = {k: float(len(obs) - len(FITTED) - 1) for k in (*FITTED, ADMISSION)}
    df_fit |= {"api_cost_ms": len(s.api) - 1.0, "api_jitter_ms": len(s.api) - 1.0,
               PER_TOKEN: len(s.api_by_tokens) - 2.0, BUSY: len(s.busy) - 1.0}
    df_fit["api_overhead_ms"] = df_fit["api_cost_ms"]
    sources = ((se_fit, df_fit), (se_jack, dict.fromkeys(est, len(jack) - 1.0)),
               (se_workers, dict.fromkeys(est, len(per_worker) - 1.0)))
    se, dof = {}, {}
    for k in est:
        finite = [(errs[k], dfs[k]) for errs, dfs in sources if math.isfinite(errs[k])]
        se[k], dof[k] = max(finite, default=(math.nan, math.nan))

    budget = hw.engine.max_num_batched_tokens
    coef = {k: est[k] for k in (*FITTED, ADMISSION)}
    m = model_at(hw, coef)
    predicted = [predict(o, m, budget) for o in obs]
    wait = float(np.median(step_wait_ms(s, est, hw))) if s.busy else 0.0  # the busy probes' step in progress
    for row in s.rows:
        if row["kind"] == "prefill" and row["used"]:
            o = Observation("prefill", int(row["prompt_tokens"]), int(row["cached_tokens"]), 1, row["measured_ms"])
            row["predicted_ms"] = predict(o, m, budget)
        elif row["kind"] == "decode_step" and row["used"]:
            row["predicted_ms"] = predict(Observation("decode_step", int(row["context"]), 0, int(row["batch"]),
                                                      row["measured_ms"]), m, budget)
        elif row["kind"] in ("api", "api_busy"):
            idle = est["api_cost_ms"] + est[PER_TOKEN] * row["prompt_tokens"]
            row["predicted_ms"] = est[BUSY] * idle + wait if row["kind"] == "api_busy" else idle
    measured = {k: {"value": est[k], "se": se[k], "dof": dof[k], "se_fit": se_fit[k], "se_jackknife": se_jack[k],
                    "se_processes": se_workers[k]}
                for k in ("api_cost_ms", ADMISSION, "api_overhead_ms", "api_jitter_ms", PER_TOKEN, BUSY)}
    measured["api_cost_mean_ms"] = _mean_with_errors(api, [(r.session, r.worker, r.rep) for r in requests
                                                          if r.phase == "api" and not r.error])
    if s.per_token:
        pt = np.asarray(s.per_token)
        measured["api_per_token_ms"] = {"value": float(np.median(pt)), "se": bootstrap_se(pt, np.median),
                                        "dof": pt.size - 1.0}
    # what the client and the refused requests cost (the phases that follow the worker probes)
    facts = probed or {}
    cpu_costs = (client_costs(facts.get("client") or []) | client_interference(facts.get("interference") or [])
                 | neighbour_slowdown(facts.get("neighbour") or []) | refused_cost(facts.get("refused") or []))
    measured |= cpu_costs
    coefficients = coef | {k: est[k] for k in MEASURED} | {k: v["value"] for k, v in cpu_costs.items()}
    errors = {k: se[k] for k in (*FITTED, ADMISSION, *MEASURED)} | {k: v["se"] for k, v in cpu_costs.items()}
    dof |= {k: v["dof"] for k, v in cpu_costs.items()}
    info = dict(probed or {})
    info["usable"] = {"api": len(s.api), "api_busy": len(s.busy), "prefill": sum(len(v) for v in s.prefill.values()),
                      "decode_batches": sum(len(v) for v in s.decode.values()),
                      "failed": sum(1 for r in s.rows if r["error"]), "jackknife_blocks": len(jack)}
    # a coefficient the fit pushed to a bound, or whose term never binds (no Jacobian se), is
    # not pinned down by the probes: say so (its stated se is then the jackknife's)
    loose = {}
    for k in (*FITTED, ADMISSION):
        lo_k, hi_k = BOUNDS[k][:2]
        tol = 1e-4 * (hi_k - lo_k)
        if est[k] <= lo_k + tol or est[k] >= hi_k - tol:
            loose[k] = f"at its {'lower' if est[k] <= lo_k + tol else 'upper'} bound: not pinned down by the probes"
        elif not math.isfinite(se_fit[k]):
            loose[k] = "no probe depends on it at the optimum (its roofline term never binds): not pinned down"
    if loose:
        info["not_identified"] = loose
    info["se_fit"] = {k: _sig(se_fit[k], 2) for k in FITTED}
    info["se_jackknife"] = {k: _sig(se_jack[k], 2) for k in FITTED}
    info["se_processes"] = {k: _sig(se_workers[k], 2) for k in FITTED}
    info["without_process"] = {f"session {s_} {w}": {k: _sig(v) for k, v in e.items()}
                           for (s_, w), e in zip(workers, per_worker)} if len(per_worker) == len(workers) else {}
    return ProbeFit(hw.name, hw.coefficients_name, coefficients, errors, obs, predicted, s.rows, measured, info,
                    {k: dof[k] for k in (*FITTED, ADMISSION, *MEASURED, *cpu_costs)})


def interval95(se: float, dof: float) -> float:
    """Half-width of the two-sided 95% interval of an estimate with standard error ``se`` on
    ``dof`` degrees of freedom (Student's t; the normal 1.96 without a finite ``dof``)."""
    from scipy.stats import norm, t

    if not math.isfinite(se):
        return math.nan
    q = t.ppf(0.975, dof) if math.isfinite(dof) and dof >= 1 else norm.ppf(0.975)
    return float(q * se)


def _sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x


def _stated(value: float, se: float, dof: float) -> dict[str, float]:
    """A coefficient as the provenance states it: value, se, its dof and 95% half-width."""
    out = {"value": _sig(value), "se": _sig(se, 2)}
    if math.isfinite(dof):
        out |= {"dof": int(dof), "ci95": _sig(interval95(se, dof), 2)}
    return out


def coefficient_entry(fit: ProbeFit, hw: Hardware, date: dt.date | None = None) -> dict[str, dict]:
    """The fit as a ``hardware/coefficients.yaml`` entry of ``hw``'s family, with its provenance."""
    c = fit.coefficients
    entry: dict = {k: _sig(c[k]) for k in (*FITTED, ADMISSION, *MEASURED, *CLIENT, INTERFERENCE, NEIGHBOUR, REFUSED)
                   if k in c}
    entry["activation_reserve_gb"] = float(hw.coefficients.activation_reserve_gb)
    e = hw.engine
    entry["provenance"] = {
        "method": ("kvroute calibrate --probe: probe requests of its own to the live engines (OpenAI API, streaming, "
                   "temperature 0, ignore_eos); least squares on log(predicted / measured median) through the "
                   "simulator's StepTimeModel (kvroute.probefit)"),
        "date": (date or dt.date.today()).isoformat(),
        "experiments_read": "none: no experiment, trace or measured record is an input of this fit",
        "engines": (f"{hw.name}: {hw.workers} x {e.kind} {e.version}, {hw.model.name}, block {e.block_size}, "
                    f"max_num_seqs {e.max_num_seqs}, max_num_batched_tokens {e.max_num_batched_tokens}, "
                    f"dtype {e.dtype}; workers probed one at a time, the others idle; each stream of a decode "
                    "batch on a cached prefix of its own"),
        "probed": fit.probed,
        "fitted": {k: _stated(c[k], fit.errors[k], fit.dof.get(k, math.nan)) for k in FITTED},
        "measured": {k: _stated(v["value"], v["se"], v.get("dof", math.nan)) for k, v in fit.measured.items()},
        "uncertainty": ("se is the largest of the fit's own (Jacobian; bootstrap for the API cost), a "
                        "delete-one-block jackknife over (worker, repetition) blocks of probes and a "
                        "leave-one-engine-process-out jackknife (a worker in one session: what differs between processes); "
                        "dof is that error's degrees of freedom (conditions less parameters, samples less one, groups "
                        "less one) and ci95 the half-width of its 95% interval, t(0.975, dof) x se"),
        "notes": [
            "api_cost_ms is the median, api_jitter_ms the interquartile range, of (client TTFT - engine queue "
            "- engine prefill) over the minimal probes (bootstrap se), and api_overhead_ms = api_cost_ms; "
            "admission_ms is what a request's first step costs the engine beyond a step of its tokens (fitted with "
            "the step coefficients), which the simulator's engine adds to that step, so the requests batched "
            "with it wait for it too",
            "api_per_prompt_token_ms is the Theil-Sen slope of that difference against prompt tokens over the "
            "minimal and prefill probes (se: its 95% interval / 3.92): the API server templates and tokenises "
            "the whole chat, and the simulator adds it times a request's prompt tokens to its API delay; "
            "api_cost_ms is the minimal probes' median less the slope's share",
            "api_busy_factor is the median, over API probes sent while max_num_seqs - 1 other streams decoded on "
            "the same engine, of their delay over the idle one at their length, each less half a decode step "
            "of the streams beside it (the wait for the step in progress, which the simulator's engine "
            "charges itself; bootstrap se; 1 without such "
            "probes): on the CPU build the API server shares its core with the engine core; the simulator runs "
            "a request's API work at 1/f of its speed while its engine runs, and the engine's steps f/(f-c) "
            "times as long while API work is in progress, c = min(1, f - 1) being the part of the API delay "
            "that is work on that core when the two share it fairly",
            "api_per_token_ms (client gap - engine gap per streamed token) is reported only: the simulator "
            "has no per-token API cost",
            "client_cpu_per_request_ms, client_cpu_per_prompt_token_ms and client_cpu_per_token_ms are the CPU "
            "time of this process (a kvroute gateway and the load generator, as kvroute measure runs them) per "
            "request, prompt token and streamed token: least squares over the client batches (probed.client), "
            "no intercept, at least 0 (se: the larger of the fit's and a leave-one-repetition-out jackknife); "
            "the simulator charges that work to the core of engine.client_worker, where kvroute measure pins "
            "the process",
            "client_interference is the engine time a second of that CPU costs the engine beside it: per "
            "session, repetition and engine of the interference batches (probed.interference: full batches of 64-token "
            "chats with the process pinned beside each worker in turn), k = (1 - ITL alone / ITL beside) / "
            "(client CPU / wall), its ITL with the client beside it against its own with the client on the other "
            "core (engine-core timestamps); the mean over those pairs (se: the larger of theirs and the "
            "jackknives over repetitions and engine processes); 1 would be exactly the client's CPU time; the simulator "
            "multiplies the client's charge by it",
            "neighbour_slowdown is how much slower an engine runs while another engine of the host runs: per "
            "session, repetition and worker of the neighbour batches (probed.neighbour: a full batch straight to the worker "
            "with every other worker idle and with them decoding full batches, alternating, this process pinned "
            "to another worker's core), its ITL beside busy neighbours over its ITL beside idle ones; the mean "
            "over those pairs (se: the larger of theirs and the jackknives over repetitions and engine processes). Every "
            "other probe was timed beside idle neighbours (the workers are probed one at a time, this process "
            "pinned to another worker's core), so the simulator runs a worker's steps that many times as long "
            "while any other worker of the host is busy",
            "api_refused_request_ms is the CPU time of a worker's process tree per request it answers "
            "without serving it (POST /v1/chat/completions/render, which vllm-router's cache_aware sends every "
            "worker before routing a request and plain vLLM refuses), over batches sent to the idle workers "
            "(probed.refused; se: the larger of the batches' and the jackknives over repetitions and engine processes); the "
            "simulator charges it to every worker's core for each request a policy that asks them routes",
            "attn_cached_efficiency and attn_chunk_efficiency are attention's effective rates as fractions of "
            "the nominal peak, fitted with the step coefficients: its query x key pairs against KV already in "
            "the cache (a later chunk's, a decode token's) and its causal pairs within a prefill chunk; vLLM's "
            "CPU build runs them through different kernels, neither at the body's rate",
            "activation_reserve_gb is kept from the profile's entry: the cpu profile gives its KV budget directly",
        ],
        "rms_log_error": _sig(fit.rms_log_error()),
        **({"warning": w} if (w := load_warning(fit.probed)) else {}),
        "residuals": fit.residual_lines(),
    }
    return {fit.family: entry}


def load_warning(probed: dict) -> str:
    """A warning when the machine ran more than one job per core during the probe: the step
    times, and the API server's cost most of all, then carry other jobs' contention."""
    cores = probed.get("cores") or 0
    loads = [(probed.get(k) or [0.0])[0] for k in ("load_average_before", "load_average_after")]  # 1-minute
    if cores and max(loads) > cores:
        return (f"the machine was loaded (1-minute load average up to {max(loads):.1f} on {cores} cores): the timings carry "
                f"other jobs' contention; the API cost varies most with it between calibrations")
    return ""


def plan_facts(plan: ProbePlan, hw: Hardware) -> dict:
    """What the probe sends, for the provenance: counts and ranges."""
    return {"requests_per_worker": plan.count(hw.engine.max_num_seqs) * plan.sessions, "workers": hw.workers,
            "plan": plan.to_dict(hw.engine.max_num_seqs)}


def observation_table(fit: ProbeFit):
    """Every probe (``level`` probe) and every fitted condition (``level`` condition), each
    with its measured and predicted time: OUT.csv."""
    import pandas as pd

    probes = pd.DataFrame(fit.rows).assign(level="probe")
    conditions = pd.DataFrame([{"level": "condition", "kind": o.kind, "label": o.label, "prompt_tokens": o.tokens,
                                "cached_tokens": o.cached, "batch": o.seqs, "samples": o.samples,
                                "measured_ms": o.measured_ms, "spread_ms": o.spread_ms, "predicted_ms": p, "used": True}
                               for o, p in zip(fit.observations, fit.predicted)])
    table = pd.concat([conditions, probes], ignore_index=True)
    first = ["level", "kind", "label", "worker", "phase", "words", "warm", "batch", "prompt_tokens", "cached_tokens",
             "context", "samples", "measured_ms", "predicted_ms", "spread_ms", "used"]
    return table[[c for c in first if c in table] + [c for c in table if c not in first]]


def write_probe_fit(fit: ProbeFit, entry: dict, out, written_by: str = "") -> None:
    """OUT (the coefficients entry) and OUT.csv (:func:`observation_table`), atomically."""
    from pathlib import Path

    import yaml

    from kvroute.records import write_atomic

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written_by = written_by or f"kvroute calibrate --hardware {fit.hardware} --probe"
    head = f"# written by `{written_by}`: probe requests only, no experiment read\n"
    text = head + yaml.safe_dump(entry, sort_keys=False, width=100)
    table = observation_table(fit)
    write_atomic(out, lambda tmp: Path(tmp).write_text(text))
    write_atomic(out.with_suffix(".csv"), lambda tmp: table.to_csv(tmp, index=False))


def fit_and_write(requests: Sequence[ProbeRequest], hw: Hardware, probed: dict, out,
                  written_by: str = "") -> ProbeFit:
    """Fit ``requests`` (``probed``: the plan's and the run's facts, :func:`plan_facts` and
    more) and write OUT and OUT.csv
    (:func:`write_probe_fit`). A fit that fails keeps every probe in OUT.csv, to be read
    and fitted again, and raises.

    Raises:
        ValueError: too few usable probes for a fit (the message names OUT.csv).
    """
    from pathlib import Path

    import pandas as pd

    from kvroute.records import write_atomic

    out = Path(out)
    try:
        fit = fit_probes(requests, hw, probed)
    except ValueError as exc:
        table = pd.DataFrame([r.row() for r in requests])
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out.with_suffix(".csv"), lambda tmp: table.to_csv(tmp, index=False))
        raise ValueError(f"{exc}; every probe is in {out.with_suffix('.csv')}") from exc
    write_probe_fit(fit, coefficient_entry(fit, hw), out, written_by)
    return fit
