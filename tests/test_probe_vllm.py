"""The probe on real vLLM CPU engines (the `cpu` profile): a small probe, a sane fit.

Needs the engine environment (`make engine-cpu` builds .venv-engine-cpu, or set
KVROUTE_ENGINE_PYTHON); skipped, saying so, without it. Starts the profile's two workers
(the Engines class measure uses) and runs a small plan through
kvroute.live.probe.BracketProbe, as `kvroute measure --probe` runs it around two
measurements of one engine session (three sessions on the same engines, the middle one
closing the first's bracket and opening the second's; `kvroute calibrate --probe` runs its
sessions on engines started for each), then fits it. About 1.5-2.5 minutes on 2
shared cores (start-up is most of it).
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from kvroute.hardware import Coefficients, coefficient_values, load_hardware
from kvroute.live.engines import running_engines
from kvroute.live.probe import BracketProbe, ProbePlan
from kvroute.probefit import FITTED, coefficient_entry, fit_probes, plan_facts, write_probe_fit

import engine_env  # noqa: E402  (tests/engine_env.py)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = engine_env.ENGINE_MARKS
PLAN = ProbePlan(api_probes=8, api_words=4, prefill_words=(128, 1024, 2500), sessions=2, repetitions=1,
                 decode_words=(128, 1500), decode_tokens=16)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    model = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    subprocess.run([engine_env.ENGINE_PY, "-m", "kvroute.live.model", "tiny", str(model)], check=True, cwd=ROOT,
                   timeout=600)
    hw = load_hardware("cpu")
    bracket = BracketProbe(hw, PLAN, measurements=2)  # as `kvroute measure EXP1 EXP2 --probe P1 --probe P2`
    with running_engines(hw, run_dir=tmp_path_factory.mktemp("engines"), host="127.0.0.1", model_dir=model,
                         python=engine_env.ENGINE_PY) as eng:
        bracket.before(eng)
        bracket.after(eng)  # the first measurement runs before this session, the second after it
        bracket.after(eng)
    SECOND.update(zip(("requests", "facts"), bracket.bracket(1)))
    return hw, bracket.requests, bracket.facts


SECOND: dict = {}  # the second measurement's bracket (sessions 1 and 2), filled by the fixture


def test_every_probe_ran_as_planned(probed):
    hw, requests, facts = probed
    assert len(requests) == PLAN.count(hw.engine.max_num_seqs) * hw.workers * PLAN.sessions
    failed = [(r.phase, r.error) for r in requests if r.error]
    assert len(failed) <= 2, failed  # a shared machine may drop a probe; more is a bug
    warm = [r for r in requests if r.phase == "prefill" and r.warm and not r.error]
    block = hw.engine.block_size
    # the repeat of a prompt reads every full block of it from the prefix cache; the first reads none
    assert warm and all(r.cached_tokens == (r.prompt_tokens - 1) // block * block for r in warm)
    assert all(r.cached_tokens == 0 for r in requests if r.phase == "prefill" and not r.warm and not r.error)
    # a decode batch's streams attend to prefixes of their own, each found cached (its full blocks)
    batches: dict[tuple, list] = {}
    for r in requests:
        if r.phase == "decode" and not r.error:
            batches.setdefault((r.session, r.worker, r.group), []).append(r)
    assert batches and all(len({r.prefix for r in b}) == len(b) == b[0].batch for b in batches.values())
    assert all(r.cached_tokens >= r.words // block * block - block for b in batches.values() for r in b)
    # the engines' own histograms counted every sequential probe's prefill
    assert all(r.engine["prefill_s"] > 0 for r in requests if r.phase in ("api", "prefill") and not r.error)
    assert len(facts["probe_s"]) == PLAN.sessions and min(facts["probe_s"]) > 0
    # the phases split around the measurement: refused and client before, the rest after
    assert set(BracketProbe.BEFORE) | set(BracketProbe.AFTER) <= set(facts)


def test_the_workers_are_probed_one_at_a_time(probed):
    """Each repetition of a worker's probes runs while every other worker idles (the fit is
    an engine beside idle neighbours; neighbour_slowdown says what a busy one costs): no
    two workers' repetition windows, first send to last token, overlap."""
    hw, requests, facts = probed
    windows: dict[tuple[int, str, int], list[float]] = {}
    for r in requests:
        if r.phase != "warmup" and r.token_s:
            w = windows.setdefault((r.session, r.worker, r.rep), [math.inf, -math.inf])
            w[0], w[1] = min(w[0], r.sent_s), max(w[1], r.token_s[-1])
    assert len(windows) == PLAN.sessions * hw.workers * PLAN.repetitions
    spans = sorted((lo, hi, key) for key, (lo, hi) in windows.items())
    for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
        assert hi < lo, (a, b, hi, lo)
    # the turns' order rotates with each repetition, counted across sessions
    assert [[key[1] for *_, key in spans if key[0] == s][0] for s in range(2)] == hw.worker_names[:2]


def test_the_fit_is_sane(probed, tmp_path):
    hw, requests, facts = probed
    fit = fit_probes(requests, hw, plan_facts(PLAN, hw) | facts)
    for k in (*FITTED, "api_overhead_ms", "api_jitter_ms"):
        assert math.isfinite(fit.coefficients[k]) and math.isfinite(fit.errors[k]), k
    assert fit.coefficients["compute_efficiency"] > 0.05 and fit.coefficients["step_overhead_ms"] > 0.1
    assert fit.coefficients["api_overhead_ms"] > 0
    # the model follows the probes within a factor of about 1.5 (log error 0.4) on a shared machine
    assert fit.rms_log_error() < 0.4, fit.residual_lines()
    prefills = sorted((o.tokens, o.measured_ms) for o in fit.observations if o.kind == "prefill" and o.cached == 0)
    assert prefills[-1][1] > 3 * prefills[0][1]  # 2,500 cold tokens take longer than 128
    out = tmp_path / "cpu.yaml"
    write_probe_fit(fit, coefficient_entry(fit, hw), out)
    entry = yaml.safe_load(out.read_text())[hw.coefficients_name]
    Coefficients(**coefficient_values(entry))
    assert entry["provenance"]["experiments_read"].startswith("none")
    assert out.with_suffix(".csv").is_file()


def test_the_client_phase_measures_the_gateway_and_load_generators_cpu(probed):
    """The bracket's first session ends with batches through a kvroute gateway in this process, pinned to
    engine.client_worker's core as kvroute measure pins it; the fit gives the client's costs."""
    hw, requests, facts = probed
    batches = facts["client"]
    # BracketProbe.BEFORE in session 0, and again in session 1, which opens the next measurement's bracket
    assert len(batches) == PLAN.client_repetitions * len(PLAN.client_kinds) * 2
    assert {b["session"] for b in batches} == {0, 1}
    assert all(b["errors"] == 0 and b["requests"] == PLAN.client_requests and b["cpu_ms"] > 0 for b in batches)
    for b in batches:  # every chat streamed all its tokens back through the gateway
        assert b["output_tokens"] == PLAN.client_requests * b["max_tokens"]
    cores = sorted(os.sched_getaffinity(0))  # worker i runs on the i-th of them (kvroute.live.engines.plan_workers)
    assert facts["client_cpus"] == [cores[hw.engine.client_worker % len(cores)]]
    # the long replies cost the client more than the short ones: CPU per streamed token is real
    short = [b["cpu_ms"] for b in batches if b["max_tokens"] == 2 and b["words"] < 100]
    long_ = [b["cpu_ms"] for b in batches if b["max_tokens"] > 2]
    assert min(long_) > max(short)
    fit = fit_probes(requests, hw, plan_facts(PLAN, hw) | facts)
    assert fit.coefficients["client_cpu_per_request_ms"] > 0 and fit.coefficients["client_cpu_per_token_ms"] > 0
    entry = coefficient_entry(fit, hw)[hw.coefficients_name]
    assert Coefficients(**coefficient_values(entry)).client_cpu_per_token_ms == entry["client_cpu_per_token_ms"]


def test_the_refused_phase_measures_what_a_refusal_costs_a_worker(probed):
    """The bracket's first session asks every idle worker to render requests, as vllm-router's
    cache_aware does before routing; vLLM refuses (403), and each refusal costs that
    worker's process tree CPU time, which the fit states with an error."""
    hw, requests, facts = probed
    batches = facts["refused"]
    assert len(batches) == PLAN.refused_repetitions * hw.workers * 2  # sessions 0 and 1 (see the client phase)
    assert all(b["statuses"] == {"403": PLAN.refused_requests} and b["errors"] == 0 for b in batches), batches
    assert sum(b["cpu_ms"] for b in batches) > 0
    fit = fit_probes(requests, hw, plan_facts(PLAN, hw) | facts)
    assert 0 < fit.coefficients["api_refused_request_ms"] < 20 and fit.errors["api_refused_request_ms"] > 0


def test_the_interference_phase_pins_the_client_beside_each_engine_in_turn(probed):
    """The bracket's second session's interference batches: the client pinned to each worker's core in
    turn, every engine's ITL read from its own histogram over each batch; the fit states
    what a second of the client's CPU costs the engine beside it, with an error."""
    hw, requests, facts = probed
    rows = facts["interference"]
    assert [(r["rep"], r["client"]) for r in rows] == [(rep, w) for rep in range(PLAN.interference_repetitions)
                                                       for w in hw.worker_names]
    assert all(r["errors"] == 0 and r["cpu_s"] > 0 and len(r["itl_ms"]) == hw.workers and all(r["itl_ms"])
               for r in rows), rows
    fit = fit_probes(requests, hw, plan_facts(PLAN, hw) | facts)
    k = fit.measured["client_interference"]
    # its size is the benchmark's to judge (benchmarks/client_interference.py): a test's
    # batches share the machine with whatever else runs, which can put either core behind
    assert math.isfinite(k["value"]) and abs(k["value"]) < 20 and k["se"] > 0, k
    entry = coefficient_entry(fit, hw)[hw.coefficients_name]
    assert Coefficients(**coefficient_values(entry)).client_interference == entry["client_interference"]



def test_the_neighbour_phase_times_each_engine_beside_idle_and_busy_neighbours(probed):
    """The bracket's second session's neighbour batches: each worker, with the other idle and decoding,
    in alternating order; the fit states the ratio with an error."""
    hw, requests, facts = probed
    rows = facts["neighbour"]
    assert len(rows) == PLAN.neighbour_repetitions * hw.workers * 2
    assert {r["session"] for r in rows} == {1}  # BracketProbe.AFTER
    assert {(r["worker"], r["neighbour_busy"]) for r in rows} == {(w, b) for w in hw.worker_names for b in (False, True)}
    assert all(r["errors"] == 0 and r["itl_ms"] and r["itl_ms"] > 0 for r in rows), rows
    fit = fit_probes(requests, hw, plan_facts(PLAN, hw) | facts)
    k = fit.measured["neighbour_slowdown"]
    assert 0.5 < k["value"] < 3 and k["se"] > 0, k


def test_a_session_between_two_measurements_closes_one_bracket_and_opens_the_next(probed):
    """Two measurements on one engine session: the second's probe is sessions 1 and 2, the
    middle one shared with the first's and holding every phase; each bracket is two
    sessions' worth of requests and fits on its own."""
    hw, first, facts = probed
    second, facts2 = SECOND["requests"], SECOND["facts"]
    assert {r.session for r in first} == {0, 1} and {r.session for r in second} == {1, 2}
    assert len(second) == len(first) == PLAN.count(hw.engine.max_num_seqs) * hw.workers * PLAN.sessions
    assert facts["sessions"] == [0, 1] and facts2["sessions"] == [1, 2]
    assert facts2["probe_s"][0] == facts["probe_s"][1] and "session 1 also closed measurement 0's" in facts2["bracket"]
    assert "session 1 also opens measurement 1's" in facts["bracket"]
    assert {b["session"] for b in facts2["client"]} == {1} and {r["session"] for r in facts2["neighbour"]} == {1, 2}
    fit = fit_probes(second, hw, plan_facts(PLAN, hw) | facts2)
    assert all(math.isfinite(fit.coefficients[k]) for k in FITTED), fit.coefficients


def test_each_session_times_the_machine_canary_on_each_engine_core(probed):
    """kvroute.live.canary at the start and end of each session, on each worker's core: what
    `kvroute validate` sets the measured runs' canary beside (machine.csv)."""
    from kvroute.live.canary import WORK

    hw, _, facts = probed
    rows = facts["canary"]
    cores = sorted(os.sched_getaffinity(0))[: hw.workers]
    assert {(r["session"], r["when"], r["cpu"], r["work"]) for r in rows} == {
        (s, w, c, k) for s in (0, 1) for w in ("start", "end") for c in cores for k in WORK}
    assert all(r["ms"] > 0 for r in rows)
