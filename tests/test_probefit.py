"""`kvroute calibrate --probe`'s fit: probes made by the model with known coefficients give them back."""

import math

import numpy as np
import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.hardware import load_hardware
from kvroute.live.probe import ProbePlan, ProbeRequest
from kvroute.probefit import (CLIENT, FITTED, INTERFERENCE, NEIGHBOUR, REFUSED, Observation, client_costs,
                              client_interference, coefficient_entry, collect, fit_probes, interference, model_at,
                              neighbour_slowdown, observation_table, paired_interference, plan_facts, predict,
                              refused_cost)

TRUTH = {"compute_efficiency": 1.3, "mem_efficiency": 0.8, "step_overhead_ms": 3.0, "per_seq_overhead_ms": 0.25,
         "attn_cached_efficiency": 0.9, "attn_chunk_efficiency": 2.5}
API_MS, JITTER_MS, ADMISSION_MS = 12.0, 4.0, 3.5
PER_PROMPT_TOKEN_MS = 0.004  # the API server's templating and tokenising, per prompt token
BUSY_FACTOR = 1.7  # the API delay's stretch beside a running engine
HW = load_hardware("cpu")
PLAN = ProbePlan(api_probes=40, repetitions=2, decode_tokens=24)
TEMPLATE = 12  # chat-template tokens around a message's words


def synthetic_requests(noise: float = 0.0, seed: int = 1) -> list[ProbeRequest]:
    """What the probe would record from engines that run exactly the model with TRUTH
    (times multiplied by lognormal noise of ``noise``): both workers, every phase."""
    rng = np.random.default_rng(seed)
    m, budget = model_at(HW, TRUTH | {"admission_ms": ADMISSION_MS}), HW.engine.max_num_batched_tokens
    block = HW.engine.block_size

    def jitter(x):
        return x * float(np.exp(rng.normal(0.0, noise))) if noise else x

    reqs, t = [], 0.0
    for w in HW.worker_names:
        for i in range(PLAN.api_probes):
            prompt = PLAN.api_words + TEMPLATE
            pre = jitter(predict(Observation("prefill", prompt, 0, 1, 1.0), m, budget)) / 1e3
            api = (API_MS + PER_PROMPT_TOKEN_MS * prompt + JITTER_MS * float(rng.uniform(-1, 1))) / 1e3
            reqs.append(ProbeRequest(w, "api", f"a{i}", PLAN.api_words, 2, rep=i % 2, sent_s=t, token_s=[t + api + pre] * 2,
                                     prompt_tokens=prompt, output_tokens=2,
                                     engine={"queue_s": 0.0, "prefill_s": pre, "decode_s": 0.0, "ttft_s": pre,
                                             "requests": 1.0}))
        for rep in range(PLAN.repetitions):
            for n in PLAN.prefill_words:
                prompt = n + TEMPLATE
                for warm in (False, True):
                    cached = (prompt - 1) // block * block if warm else 0
                    pre = jitter(predict(Observation("prefill", prompt, cached, 1, 1.0), m, budget)) / 1e3
                    api = (API_MS + PER_PROMPT_TOKEN_MS * prompt + JITTER_MS * float(rng.uniform(-1, 1))) / 1e3
                    reqs.append(ProbeRequest(w, "prefill", f"p{rep}:{n}", n, 4, warm=warm, rep=rep, sent_s=t,
                                             token_s=[t + api + pre + 0.01 * k for k in range(4)], prompt_tokens=prompt,
                                             cached_tokens=cached, output_tokens=4,
                                             engine={"queue_s": 0.0, "prefill_s": pre, "decode_s": 0.03,
                                                     "ttft_s": pre, "requests": 1.0}))
        group = 0
        for rep in range(PLAN.repetitions):
            for n in PLAN.decode_words:
                for b in PLAN.batches(HW.engine.max_num_seqs):
                    prompt = n + TEMPLATE + PLAN.decode_suffix_words
                    reqs.append(ProbeRequest(w, "decode_prefix", f"d{group}", n, 1, group=group, sent_s=t,
                                             token_s=[t + 0.05], prompt_tokens=n + TEMPLATE, output_tokens=1))
                    k = PLAN.decode_tokens
                    steps = [jitter(m.step_time(b, b * (prompt + i))) for i in range(1, k)]
                    times = list(np.cumsum([0.01, *steps]))
                    engine = {"itl_s": b * sum(steps), "itl_tokens": float(b * (k - 1)), "queue_s": 0.0,
                              "prefill_s": 0.0, "decode_s": b * sum(steps), "ttft_s": 0.0, "requests": float(b)}
                    for j in range(b):
                        reqs.append(ProbeRequest(w, "decode", f"d{group}:{j}", n, k, prefix=f"d{group}", rep=rep,
                                                 suffix_words=PLAN.decode_suffix_words, batch=b, group=group,
                                                 sent_s=t, token_s=times, prompt_tokens=prompt, output_tokens=k,
                                                 engine=engine if j == 0 else {}))
                    group += 1
        # API probes beside max_num_seqs - 1 decoding streams: the stretched API delay, and the
        # wait for the step in progress (half a step of the background), before the engine's time
        n_bg, bg_prompt = HW.engine.max_num_seqs - 1, 32 + TEMPLATE
        wait = 0.5 * m.step_time(n_bg, n_bg * bg_prompt)
        for i in range(8):
            words = (4, 1152)[i % 2]
            prompt = words + TEMPLATE
            for j in range(n_bg):
                reqs.append(ProbeRequest(w, "busy_background", f"b{i}:bg{j}", 32, 96, rep=i % 2, batch=n_bg + 1,
                                         sent_s=t, token_s=[t + 0.01 * k for k in range(96)], prompt_tokens=bg_prompt,
                                         output_tokens=96))
            pre = predict(Observation("prefill", prompt, 0, 1, 1.0), m, budget) / 1e3
            idle = API_MS + PER_PROMPT_TOKEN_MS * prompt
            api = BUSY_FACTOR * idle / 1e3 + wait
            reqs.append(ProbeRequest(w, "api_busy", f"b{i}", words, 2, rep=i % 2, batch=n_bg + 1, sent_s=t,
                                     token_s=[t + api + pre] * 2, prompt_tokens=prompt, output_tokens=2,
                                     engine={"queue_s": 0.0, "prefill_s": pre, "decode_s": 0.0, "ttft_s": pre,
                                             "requests": 1.0}))
    return reqs


def test_the_fit_recovers_known_coefficients():
    fit = fit_probes(synthetic_requests(), HW)
    for k, v in TRUTH.items():
        assert fit.coefficients[k] == pytest.approx(v, rel=0.02), k
    assert fit.rms_log_error() < 0.01
    assert fit.measured["admission_ms"]["value"] == pytest.approx(ADMISSION_MS, rel=0.05)
    assert fit.measured["api_cost_ms"]["value"] == pytest.approx(API_MS, abs=1.0)
    # admission is the engine's (its first step), not the API server's
    assert fit.coefficients["admission_ms"] == pytest.approx(ADMISSION_MS, rel=0.05)
    assert fit.coefficients["api_overhead_ms"] == pytest.approx(API_MS, abs=1.0)
    # uniform in API_MS +- JITTER_MS: the interquartile range is JITTER_MS
    assert fit.coefficients["api_jitter_ms"] == pytest.approx(JITTER_MS, rel=0.3)
    assert fit.measured["api_per_token_ms"]["value"] == pytest.approx(0.0, abs=1e-6)
    # the API cost's growth with the prompt, from the minimal and the prefill probes
    assert fit.coefficients["api_per_prompt_token_ms"] == pytest.approx(PER_PROMPT_TOKEN_MS, rel=0.15)
    se = fit.errors["api_per_prompt_token_ms"]
    assert math.isfinite(se) and 0 < se < PER_PROMPT_TOKEN_MS / 2
    # the stretch beside a running engine, the wait for the step in progress taken out
    assert fit.coefficients["api_busy_factor"] == pytest.approx(BUSY_FACTOR, rel=0.05)


def test_without_busy_probes_the_api_delay_is_not_stretched():
    fit = fit_probes([r for r in synthetic_requests() if r.phase not in ("api_busy", "busy_background")], HW)
    assert fit.coefficients["api_busy_factor"] == 1.0


def test_an_api_cost_that_does_not_grow_with_the_prompt_gives_no_slope():
    reqs = synthetic_requests()
    for r in reqs:  # every prefill probe's API cost as a minimal probe's: no growth with length
        if r.phase == "prefill":
            r.token_s[:] = [x - PER_PROMPT_TOKEN_MS * (r.prompt_tokens - PLAN.api_words - TEMPLATE) / 1e3
                            for x in r.token_s]
    fit = fit_probes(reqs, HW)
    assert fit.coefficients["api_per_prompt_token_ms"] == pytest.approx(0.0, abs=2e-4)


def test_noisy_probes_give_the_truth_within_the_stated_errors():
    fit = fit_probes(synthetic_requests(noise=0.05, seed=3), HW)
    for k in FITTED:
        se = fit.errors[k]
        assert math.isfinite(se) and se > 0, k
        assert abs(fit.coefficients[k] - TRUTH[k]) < 4 * se + 0.05 * TRUTH[k], (k, fit.coefficients[k], se)


def test_prefill_is_predicted_in_the_engine_s_chunks():
    m, budget = model_at(HW, TRUTH | {"admission_ms": ADMISSION_MS}), HW.engine.max_num_batched_tokens
    long = predict(Observation("prefill", budget + 500, 0, 1, 1.0), m, budget)
    chunks = 1e3 * (m.step_time(0, 0, [(budget, 0)]) + m.step_time(0, 0, [(500, budget)]))
    assert long == pytest.approx(chunks + ADMISSION_MS)  # the first step admits it, once
    assert long != pytest.approx(1e3 * m.step_time(0, 0, [(budget + 500, 0)], admissions=1))  # two steps, not one
    warm = predict(Observation("prefill", 1000, 896, 1, 1.0), m, budget)
    assert warm == pytest.approx(1e3 * m.step_time(0, 0, [(104, 896)]) + ADMISSION_MS)
    assert predict(Observation("prefill", 1000, 896, 1, 1.0), model_at(HW, TRUTH), budget) == pytest.approx(
        warm - ADMISSION_MS)


def test_a_decode_batch_is_one_sample_of_the_engine_s_inter_token_latency():
    reqs = synthetic_requests()
    s = collect(reqs)
    b4 = s.decode[(PLAN.decode_words[-1], 4)]
    assert len(b4) == PLAN.repetitions * HW.workers  # one sample per batch, not per stream
    step, ctx = b4[0]
    m = model_at(HW, TRUTH)
    assert step == pytest.approx(1e3 * m.step_time(4, 4 * ctx), rel=0.02)
    # a batch whose engine counted other gaps than its streams' (a stray request) is not used
    first = next(r for r in reqs if r.phase == "decode" and r.batch == 4)
    first.engine = first.engine | {"itl_tokens": first.engine["itl_tokens"] + 1}
    s2 = collect(reqs)
    assert len(s2.decode[(first.words, 4)]) == len(s.decode[(first.words, 4)]) - 1
    assert any("inter-token gaps" in r["error"] for r in s2.rows)


def test_errors_are_kept_as_rows_but_not_fitted():
    reqs = synthetic_requests()
    reqs[0].error = "http 500: boom"
    s = collect(reqs)
    assert len(s.api) == PLAN.api_probes * HW.workers - 1
    assert sum(bool(r["error"]) for r in s.rows) == 1 and not s.rows[0]["used"]
    with pytest.raises(ValueError, match="too few usable probes"):
        fit_probes([r for r in reqs if r.phase != "decode"], HW)


def test_the_entry_is_a_coefficients_entry_that_says_what_it_read():
    from kvroute.hardware import Coefficients, coefficient_values

    fit = fit_probes(synthetic_requests(), HW, {"workers": 2})
    entry = coefficient_entry(fit, HW)
    (family, e), = entry.items()
    assert family == HW.coefficients_name
    Coefficients(**coefficient_values(e))  # loads as the simulator's coefficients
    prov = e["provenance"]
    assert prov["experiments_read"].startswith("none")
    assert set(prov["fitted"]) == set(FITTED) and all(v["se"] > 0 for v in prov["fitted"].values())
    from scipy.stats import t
    for k, v in (prov["fitted"] | prov["measured"]).items():  # a 95% interval on the error's own dof
        assert v["dof"] >= 1 and v["ci95"] == pytest.approx(t.ppf(0.975, v["dof"]) * v["se"], rel=0.06), k
    assert fit.dof["compute_efficiency"] in (len(fit.observations) - len(FITTED) - 1,
                                             fit.probed["usable"]["jackknife_blocks"] - 1, HW.workers * PLAN.sessions - 1)
    assert len(prov["residuals"]) == len(fit.observations)
    table = observation_table(fit)
    assert set(table["level"]) == {"condition", "probe"}
    used = table[(table["level"] == "probe") & table["used"]]
    assert used["predicted_ms"].notna().all() and len(used) == sum(r["used"] for r in fit.rows)
    assert len(table[table["level"] == "probe"]) == len(fit.rows)  # every probe, used or not


def test_probe_calibration_takes_no_experiment(tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["calibrate", "exp.yaml", str(tmp_path), "--hardware", "cpu", "--probe",
                               "--out", str(tmp_path / "f.yaml")])
    assert res.exit_code != 0 and "reads no experiment" in res.output
    res = runner.invoke(main, ["calibrate", "--hardware", "cpu", "--out", str(tmp_path / "f.yaml")])
    assert res.exit_code != 0 and "--probe" in res.output
    res = runner.invoke(main, ["calibrate", "--hardware", "nonesuch", "--probe", "--out", str(tmp_path / "f.yaml")])
    assert res.exit_code != 0 and "nonesuch" in res.output


def test_a_coefficient_the_probes_cannot_pin_down_is_flagged():
    # every decode step as long as the step overhead alone: no cost per sequence, so the
    # per-sequence overhead runs to its lower bound
    reqs = synthetic_requests()
    m0 = model_at(HW, TRUTH | {"mem_efficiency": 1e3, "per_seq_overhead_ms": 0.0})
    for r in reqs:
        if r.phase == "decode" and r.engine:
            r.engine = r.engine | {"itl_s": r.engine["itl_tokens"] * m0.step_time(1, 1)}
    fit = fit_probes(reqs, HW)
    assert "lower bound" in fit.probed["not_identified"]["per_seq_overhead_ms"]
    assert "compute_efficiency" not in fit.probed["not_identified"]
    assert "not_identified" not in fit_probes(synthetic_requests(), HW).probed


def test_the_stated_errors_include_the_spread_between_repetitions():
    fit = fit_probes(synthetic_requests(noise=0.05, seed=4), HW)
    assert fit.probed["usable"]["jackknife_blocks"] == HW.workers * PLAN.repetitions
    for k in FITTED:
        # (the provenance rounds to 2 digits)
        assert fit.errors[k] >= fit.probed["se_fit"][k] * 0.95 and fit.errors[k] >= fit.probed["se_jackknife"][k] * 0.95
        assert fit.probed["se_jackknife"][k] > 0


def test_a_loaded_machine_is_named_in_the_provenance():
    fit = fit_probes(synthetic_requests(), HW, {"cores": 2, "load_average_before": [7.5, 6.0, 5.0],
                                                "load_average_after": [1.0, 1.0, 1.0]})
    assert "7.5 on 2 cores" in coefficient_entry(fit, HW)[HW.coefficients_name]["provenance"]["warning"]
    quiet = fit_probes(synthetic_requests(), HW, {"cores": 2, "load_average_before": [0.5, 0.4, 0.3],
                                                  "load_average_after": [1.2, 1.0, 0.9]})
    assert "warning" not in coefficient_entry(quiet, HW)[HW.coefficients_name]["provenance"]


def test_a_saved_probe_table_fits_the_same():
    from kvroute.live.probe import ProbeRequest as PR

    fit = fit_probes(synthetic_requests(noise=0.05, seed=5), HW)
    rows = observation_table(fit)
    again = [PR.from_row(r) for r in rows[rows["level"] == "probe"].to_dict("records")]
    refit = fit_probes(again, HW)
    for k in (*FITTED, "api_overhead_ms", "api_jitter_ms"):
        assert refit.coefficients[k] == pytest.approx(fit.coefficients[k], rel=1e-3), k


def test_a_probe_file_of_kvroute_measure_fits_through_the_cli_as_in_memory(tmp_path):
    """`kvroute measure --probe` writes its probe requests and facts (write_probed);
    `kvroute calibrate --probe --probed` fits that file, starting no engine, to the
    coefficients the requests give in memory, and says where they came from; a file that
    is not one is named."""
    import yaml

    from kvroute.live.probe import read_probed, write_probed

    reqs = synthetic_requests(noise=0.05, seed=5)
    probed = plan_facts(PLAN, HW) | {"cores": 2, "bracket": "session 0 before the measurement"}
    raw = tmp_path / "probe.json"
    write_probed(raw, reqs, probed)
    again, facts = read_probed(raw)
    assert facts == probed and len(again) == len(reqs)
    out = tmp_path / "cpu.yaml"
    res = CliRunner().invoke(main, ["calibrate", "--probe", "--probed", str(raw), "--hardware", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    entry = yaml.safe_load(out.read_text())[HW.coefficients_name]
    fit = fit_probes(reqs, HW, probed)
    for k in FITTED:
        assert entry[k] == pytest.approx(fit.coefficients[k], rel=5e-3), k
    assert entry["provenance"]["probed"]["bracket"].startswith("session 0 before")
    assert "--probed" in out.read_text().splitlines()[0] and out.with_suffix(".csv").is_file()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = CliRunner().invoke(main, ["calibrate", "--probe", "--probed", str(bad), "--hardware", "cpu",
                                    "--out", str(tmp_path / "x.yaml")])
    assert res.exit_code != 0 and "not a probe file" in res.output
    res = CliRunner().invoke(main, ["calibrate", "--probed", str(raw), "--hardware", "cpu", "--out", str(out)])
    assert res.exit_code != 0 and "--probe too" in res.output


def test_workers_that_differ_widen_the_stated_errors():
    reqs = synthetic_requests(noise=0.02, seed=6)
    base = fit_probes(reqs, HW)
    for r in reqs:  # worker w1's engine runs every step 30% slower
        if r.worker == "w1":
            r.engine = {k: (v * 1.3 if k.endswith("_s") and k != "queue_s" else v) for k, v in r.engine.items()}
    slow = fit_probes(reqs, HW)
    assert set(slow.probed["without_process"]) == {f"session 0 {w}" for w in HW.worker_names}
    assert slow.errors["step_overhead_ms"] > 2 * base.errors["step_overhead_ms"]
    assert slow.errors["step_overhead_ms"] >= slow.probed["se_processes"]["step_overhead_ms"] * 0.95


def test_sessions_are_kept_apart():
    # a second start of the engines numbers its batches from 0 again: they must not merge
    import copy

    one = synthetic_requests(noise=0.02, seed=7)
    two = copy.deepcopy(synthetic_requests(noise=0.02, seed=8))
    for r in two:
        r.session = 1
    fit = fit_probes(one + two, HW)
    assert fit.probed["usable"]["decode_batches"] == 2 * sum(1 for r in one if r.phase == "decode" and r.engine)
    assert fit.probed["usable"]["failed"] == 0
    assert len(fit.probed["without_process"]) == 2 * HW.workers
    assert fit.probed["usable"]["jackknife_blocks"] == 2 * HW.workers * PLAN.repetitions


def test_the_reported_mean_api_cost_carries_the_spread_between_processes():
    # worker w1's API server costs 5 ms more: the within-run error of the mean knows
    # nothing of it, the leave-one-process-out jackknife does
    reqs = synthetic_requests(seed=9)
    base = fit_probes(reqs, HW).measured["api_cost_mean_ms"]
    for r in reqs:
        if r.worker == "w1" and r.phase == "api":
            r.token_s = [t + 0.005 for t in r.token_s]
    apart = fit_probes(reqs, HW).measured["api_cost_mean_ms"]
    assert apart["value"] == pytest.approx(base["value"] + 2.5, abs=1e-6)
    api = {w: [r.ttft_ms - 1e3 * r.engine["prefill_s"] for r in reqs if r.phase == "api" and r.worker == w]
           for w in HW.worker_names}
    pooled = sum(api.values(), [])
    within = np.std(pooled, ddof=1) / math.sqrt(len(pooled))
    # two processes: the jackknife's error is half the difference of their means, on 1 dof
    assert apart["se"] == pytest.approx(abs(np.mean(api["w1"]) - np.mean(api["w0"])) / 2, rel=1e-9)
    assert apart["se"] > 3 * within and apart["dof"] == 1.0


#: the client's CPU per request, per prompt token and per streamed token (ms), as client_costs names them
CLIENT_TRUTH = dict(zip(CLIENT, (0.8, 0.0008, 0.085)))


def client_batches(noise_ms: float = 0.0, seed: int = 0, reps: int = 3) -> list[dict]:
    """Client batches as kvroute.live.probe.client_probe writes them, timed by CLIENT_TRUTH."""
    rng = np.random.default_rng(seed)
    rows = []
    for rep in range(reps):
        for words, tokens in ProbePlan().client_kinds:
            n = 16
            prompt, out = n * (words + 12), n * tokens
            cpu = np.dot(list(CLIENT_TRUTH.values()), [n, prompt, out]) + rng.normal(0, noise_ms)
            rows.append({"rep": rep, "words": words, "max_tokens": tokens, "requests": n, "prompt_tokens": prompt,
                         "output_tokens": out, "errors": 0, "wall_s": 1.0, "cpu_ms": float(cpu)})
    return rows


def test_the_clients_costs_are_recovered_within_their_errors():
    exact = client_costs(client_batches())
    assert set(exact) == set(CLIENT)
    for k, truth in CLIENT_TRUTH.items():
        assert exact[k]["value"] == pytest.approx(truth, rel=1e-6), k
    noisy = client_costs(client_batches(noise_ms=2.0, seed=3))
    for k, truth in CLIENT_TRUTH.items():
        v = noisy[k]
        assert v["se"] > 0 and v["dof"] >= 2 and abs(v["value"] - truth) < 4 * v["se"], (k, v)
    # a batch with errors is not fitted; too few batches, or one kind only, fit nothing
    bad = client_batches() + [dict(client_batches()[0], errors=3, cpu_ms=1e6)]
    assert client_costs(bad)["client_cpu_per_request_ms"]["value"] == pytest.approx(0.8, rel=1e-6)
    assert client_costs(client_batches()[:3]) == {}
    assert client_costs([b for b in client_batches(reps=5) if b["words"] == 4 and b["max_tokens"] == 2]) == {}
    # a cost the batches cannot tell from zero stays at zero, never negative
    free = [dict(b, cpu_ms=b["cpu_ms"] - b["prompt_tokens"] * 0.01) for b in client_batches()]
    assert client_costs(free)["client_cpu_per_prompt_token_ms"]["value"] == pytest.approx(0.0, abs=1e-12)


def test_the_clients_costs_reach_the_coefficients_entry():
    fit = fit_probes(synthetic_requests(), HW, {"workers": 2, "client": client_batches(noise_ms=1.0)})
    entry = coefficient_entry(fit, HW)[HW.coefficients_name]
    for k, truth in CLIENT_TRUTH.items():
        assert entry[k] == pytest.approx(truth, rel=0.2), k
        assert entry["provenance"]["measured"][k]["se"] > 0
    assert entry["provenance"]["probed"]["client"]  # the batches themselves, for a reader to refit
    # without a client phase the entry has no client terms: the simulator charges nothing
    bare = coefficient_entry(fit_probes(synthetic_requests(), HW, {"workers": 2}), HW)[HW.coefficients_name]
    assert not set(CLIENT) & set(bare)


def refused_batches(ms: float = 0.6, noise_ms: float = 0.0, seed: int = 0) -> list[dict]:
    """Refused batches as kvroute.live.probe.refused_probe writes them, ``ms`` CPU a refusal."""
    rng = np.random.default_rng(seed)
    return [{"worker": w, "rep": rep, "calls": 40, "statuses": {"403": 40}, "errors": 0, "wall_s": 0.03,
             "cpu_ms": float(40 * ms + rng.normal(0, noise_ms))} for rep in range(4) for w in HW.worker_names]


def test_a_refusals_cost_is_the_mean_per_request_and_reaches_the_entry():
    """vllm-router's render call, refused by every worker: the CPU per refusal, with an error."""
    exact = refused_cost(refused_batches())[REFUSED]
    assert exact["value"] == pytest.approx(0.6) and exact["se"] == pytest.approx(0.0, abs=1e-12)
    noisy = refused_cost(refused_batches(noise_ms=4.0, seed=2))[REFUSED]
    assert noisy["se"] > 0 and noisy["dof"] >= 1 and abs(noisy["value"] - 0.6) < 4 * noisy["se"]
    # a batch with errors is left out; too few batches measure nothing
    bad = refused_batches() + [dict(refused_batches()[0], errors=40, cpu_ms=1e6)]
    assert refused_cost(bad)[REFUSED]["value"] == pytest.approx(0.6)
    assert refused_cost(refused_batches()[:2]) == {}
    fit = fit_probes(synthetic_requests(), HW, {"workers": 2, "refused": refused_batches(noise_ms=1.0)})
    entry = coefficient_entry(fit, HW)[HW.coefficients_name]
    assert entry[REFUSED] == pytest.approx(0.6, rel=0.2) and entry["provenance"]["measured"][REFUSED]["se"] > 0
    bare = coefficient_entry(fit_probes(synthetic_requests(), HW, {"workers": 2}), HW)[HW.coefficients_name]
    assert REFUSED not in bare


def interference_batches(k: float = 1.5, share: float = 0.2, core: tuple[float, float] = (4.4, 4.0), reps: int = 4,
                         noise_ms: float = 0.0, seed: int = 3) -> list[dict]:
    """What the probe's interference phase records from engines whose own ITL is ``core`` (a
    slower first core) and that lose ``k`` times the client's CPU share of their time when
    it is beside them: ITL x 1 / (1 - k x share)."""
    rng = np.random.default_rng(seed)
    rows = []
    for rep in range(reps):
        for where in ("w0", "w1"):
            itl = [c / (1.0 - k * share) if f"w{e}" == where else c for e, c in enumerate(core)]
            rows.append({"rep": rep, "client": where, "itl_ms": [x + rng.normal(0, noise_ms) for x in itl],
                         "cpu_s": share, "wall_s": 1.0, "errors": 0})
    return rows


def test_interference_reads_k_as_the_engines_lost_time_per_client_cpu():
    """An engine that loses exactly the client's CPU time has k = 1; slowed more, k > 1."""
    whole = interference(itl_beside_ms=5.0, itl_alone_ms=4.0, cpu_s=0.2, wall_s=1.0)
    assert whole["share"] == pytest.approx(0.2) and whole["cpu_only"] == pytest.approx(1.25)
    assert whole["slowdown"] == pytest.approx(1.25) and whole["k"] == pytest.approx(1.0)
    more = interference(itl_beside_ms=5.2, itl_alone_ms=4.3, cpu_s=0.094, wall_s=0.70)
    assert more["slowdown"] > more["cpu_only"] and more["k"] > 1.0


def test_client_interference_pairs_each_engine_with_itself_so_a_slower_core_is_not_the_clients():
    """w0's core 10% slower than w1's on its own: comparing the engine beside the client with
    the other engine would read that as the client's cost; the probe's k compares each
    engine with itself with the client elsewhere, and recovers the engines' k exactly."""
    rows = interference_batches(k=1.0)
    unpaired = interference(rows[0]["itl_ms"][0], rows[0]["itl_ms"][1], 0.2, 1.0)["k"]
    assert unpaired > 1.3
    pairs = paired_interference(rows)
    assert [(p["rep"], p["engine"]) for p in pairs] == [(r, w) for r in range(4) for w in ("w0", "w1")]
    assert [p["alone"] for p in pairs[:2]] == pytest.approx([4.4, 4.0])
    assert [p["k"] for p in pairs] == pytest.approx([1.0] * 8)
    k = client_interference(interference_batches(k=1.6))[INTERFERENCE]
    assert k["value"] == pytest.approx(1.6) and k["se"] == pytest.approx(0.0, abs=1e-9)
    noisy = client_interference(interference_batches(k=1.6, noise_ms=0.15))[INTERFERENCE]
    assert noisy["se"] > 0 and noisy["dof"] >= 1 and abs(noisy["value"] - 1.6) < 4 * noisy["se"]
    # a batch with errors is left out with its pairs; too few pairs measure nothing
    bad = interference_batches(k=1.6)
    bad[0] = dict(bad[0], errors=3, itl_ms=[50.0, 4.0])
    assert len(paired_interference(bad)) == 6 and client_interference(bad)[INTERFERENCE]["value"] == pytest.approx(1.6)
    assert client_interference(interference_batches(reps=1)) == {}


def test_the_client_interference_reaches_the_entry_and_the_hardware():
    fit = fit_probes(synthetic_requests(), HW, {"workers": 2, "interference": interference_batches(k=1.4)})
    entry = coefficient_entry(fit, HW)[HW.coefficients_name]
    assert entry[INTERFERENCE] == pytest.approx(1.4) and INTERFERENCE in entry["provenance"]["measured"]
    bare = coefficient_entry(fit_probes(synthetic_requests(), HW, {"workers": 2}), HW)[HW.coefficients_name]
    assert INTERFERENCE not in bare
    from kvroute.hardware import Coefficients
    from kvroute.hardware import coefficient_values

    c = Coefficients(**coefficient_values(entry))
    assert c.client_interference == pytest.approx(1.4) and c.client_charge_s(0.01) == pytest.approx(0.014)


def neighbour_batches(slowdown: float = 1.1, reps: int = 4, noise_ms: float = 0.0, seed: int = 5) -> list[dict]:
    """What the probe's neighbour phase records from workers of ITL 4.0 and 4.4 ms beside idle
    neighbours that run ``slowdown`` times slower beside busy ones."""
    rng = np.random.default_rng(seed)
    return [{"rep": rep, "worker": w, "neighbour_busy": busy, "errors": 0,
             "itl_ms": base * (slowdown if busy else 1.0) + rng.normal(0, noise_ms)}
            for rep in range(reps) for w, base in (("w0", 4.0), ("w1", 4.4)) for busy in (False, True)]


def test_the_neighbour_slowdown_is_each_workers_busy_over_idle_itl_and_reaches_the_entry():
    exact = neighbour_slowdown(neighbour_batches(1.1))[NEIGHBOUR]
    assert exact["value"] == pytest.approx(1.1) and exact["se"] == pytest.approx(0.0, abs=1e-9)
    noisy = neighbour_slowdown(neighbour_batches(1.1, noise_ms=0.1))[NEIGHBOUR]
    assert noisy["se"] > 0 and noisy["dof"] >= 1 and abs(noisy["value"] - 1.1) < 4 * noisy["se"]
    bad = neighbour_batches(1.1)
    bad[1] = dict(bad[1], errors=2, itl_ms=40.0)  # w0's busy batch of rep 0 failed: its pair is left out
    assert neighbour_slowdown(bad)[NEIGHBOUR]["value"] == pytest.approx(1.1)
    assert neighbour_slowdown(neighbour_batches(reps=1)) == {}
    fit = fit_probes(synthetic_requests(), HW, {"workers": 2, "neighbour": neighbour_batches(1.08)})
    entry = coefficient_entry(fit, HW)[HW.coefficients_name]
    assert entry[NEIGHBOUR] == pytest.approx(1.08) and NEIGHBOUR in entry["provenance"]["measured"]
    from kvroute.hardware import Coefficients, coefficient_values

    assert Coefficients(**coefficient_values(entry)).neighbour_slowdown == pytest.approx(1.08)


def test_phase_rows_of_two_sessions_are_paired_within_their_session_and_their_shift_widens_the_error():
    """kvroute calibrate --probe runs the phases in every session, so repetition numbers
    repeat: a pair never spans two sessions, and a shift between sessions' engine processes,
    invisible within one, shows in the stated error (the leave-one-process-out jackknife)."""
    one = neighbour_batches(1.1, noise_ms=0.02)
    two = [dict(r, session=0) for r in one] + [dict(r, session=1, itl_ms=r["itl_ms"] * (1.05 if r["neighbour_busy"] else 1.0))
                                              for r in neighbour_batches(1.1, noise_ms=0.02, seed=6)]
    within, across = neighbour_slowdown(one)[NEIGHBOUR], neighbour_slowdown(two)[NEIGHBOUR]
    assert across["value"] == pytest.approx((1.1 + 1.1 * 1.05) / 2, rel=2e-3)  # 16 pairs, none mixed
    assert across["se"] > 5 * within["se"] and across["dof"] == 3  # four engine processes
    # the other phases keep their sessions apart the same way
    refused = [dict(b, session=s, cpu_ms=b["cpu_ms"] * (1 + 0.2 * s)) for s in (0, 1) for b in refused_batches()]
    assert refused_cost(refused)[REFUSED]["value"] == pytest.approx(0.66) and refused_cost(refused)[REFUSED]["se"] > 0
    pairs = paired_interference([dict(r, session=s) for s in (0, 1) for r in interference_batches(k=1.6)])
    assert len(pairs) == 2 * len(paired_interference(interference_batches(k=1.6)))
    assert {p["session"] for p in pairs} == {0, 1}
    batches = [dict(b, session=s) for s in (0, 1) for b in client_batches(noise_ms=1.0, reps=2)]
    assert client_costs(batches)["client_cpu_per_token_ms"]["dof"] >= 1  # four stretches: the jackknife applies


def test_merge_phases_appends_each_sessions_rows_after_the_earlier_ones():
    from kvroute.live.probe import merge_phases

    facts = merge_phases({"probe_s": [1.0]}, {"neighbour": [{"rep": 0, "session": 0}], "client_cpus": [1]})
    facts = merge_phases(facts, {"neighbour": [{"rep": 0, "session": 1}], "client_cpus": [0]})
    assert [r["session"] for r in facts["neighbour"]] == [0, 1]
    assert facts["client_cpus"] == [0] and facts["probe_s"] == [1.0]
