"""results/validation/: predictions beside measurements and published figures, like for like."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from kvroute.analysis.validation import (
    COLUMNS,
    MACHINE_COLUMNS,
    ValidationError,
    headline,
    is_experiment_pattern,
    machine_rows,
    measured_rows,
    order_checks,
    published_rows,
    read_reported,
    reported_experiment_matches,
)
from kvroute.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _summary(policy: str, ttc: list[float], hit: list[float], exp: str = "e", hw: str = "cpu") -> pd.DataFrame:
    n = len(ttc)
    return pd.DataFrame({"experiment": exp, "hardware": hw, "policy": policy, "round": range(n),
                         "time_to_complete_s": ttc, "hit_rate": hit, "imbalance": [0.1] * n})


def _requests(policy: str, view: str, exp: str = "e", hw: str = "cpu") -> pd.DataFrame:
    return pd.DataFrame({"experiment": [exp], "hardware": [hw], "policy": [policy], "view": [view]})


def never(_hw: str) -> set[str]:
    return set()


def test_measured_rows_put_the_counterpart_beside_a_production_router():
    sim = pd.concat([_summary("round_robin", [10, 11, 12], [0.7, 0.7, 0.7]),
                     _summary("sglang_cache_aware", [8, 8, 8], [0.9, 0.9, 0.9])])
    meas = pd.concat([_summary("round_robin", [10, 10, 10], [0.7, 0.8, 0.75]),
                      _summary("sglang_router:cache_aware", [9, 10, 11], [0.8, 0.8, 0.8])])
    out = measured_rows(sim, meas, in_sample=never)
    assert list(out.columns) == list(COLUMNS)
    peer = out[(out["policy"] == "sglang_router:cache_aware") & (out["metric"] == "time_to_complete_s")].iloc[0]
    assert peer["predicted"] == 8 and peer["measured"] == 10
    assert peer["rel_error"] == pytest.approx(-0.2)
    assert peer["measured_lo"] < 10 < peer["measured_hi"]  # a t interval over three rounds
    rr = out[(out["policy"] == "round_robin") & (out["metric"] == "time_to_complete_s")].iloc[0]
    assert rr["predicted"] == 11 and rr["rel_error"] == pytest.approx(0.1)
    assert not out["in_sample"].any()


def test_a_different_view_is_not_like_for_like():
    sim, meas = _summary("kv_aware", [5], [0.9]), _summary("kv_aware", [4], [0.9])
    with pytest.raises(ValidationError, match="view 'approx' but simulated .* view 'exact'"):
        measured_rows(sim, meas, _requests("kv_aware", "exact"), _requests("kv_aware", "approx"), in_sample=never)
    ok = measured_rows(sim, meas, _requests("kv_aware", "approx"), _requests("kv_aware", "approx"), in_sample=never)
    assert len(ok) == 3  # ttc, hit rate, imbalance


def test_in_sample_follows_the_coefficients_provenance():
    sim, meas = _summary("sticky", [5], [0.9], exp="explainer-two-replicas"), _summary("sticky", [4], [0.9], exp="explainer-two-replicas")
    out = measured_rows(sim, meas)  # cpu-provisional's provenance: in sample for the explainer
    assert out["in_sample"].all()


def test_published_rows_ranges_changes_and_unstated_chat_lengths():
    sim = pd.concat([_summary("kv_aware", [90, 90], [0.93, 0.93], exp="note2-20turn", hw="a6000x4"),
                     _summary("least_loaded", [100, 100], [0.95, 0.95], exp="note2-20turn", hw="a6000x4"),
                     _summary("kv_aware", [24, 24], [0.88, 0.88], exp="note2-6turn", hw="a6000x4"),
                     _summary("least_loaded", [24, 24], [0.88, 0.88], exp="note2-6turn", hw="a6000x4"),
                     _summary("kv_aware", [1, 1], [0.5, 0.5], exp="other", hw="a6000x4"),
                     _summary("kv_aware", [2, 2], [0.6, 0.6], exp="note2-turns", hw="a6000x4")
                     .assign(load_param="turns", load=[2, 12])])
    rep = pd.DataFrame([
        {"experiment": "*", "hardware": "a6000x4", "policy": "kv_aware", "metric": "hit_rate", "value": 0.89,
         "value_hi": 0.95, "note": "note2"},
        {"experiment": "note2-20turn", "hardware": "a6000x4", "policy": "kv_aware", "metric": "time_to_complete_s",
         "value": 100.0, "value_hi": np.nan, "note": "note2"},
        {"experiment": "note2-20turn", "hardware": "a6000x4", "policy": "kv_aware vs least_loaded",
         "metric": "time_to_complete_s_change", "value": -0.06, "value_hi": -0.03, "note": "note2"},
    ])
    out = published_rows(sim, rep, in_sample=never)
    hits = out[out["metric"] == "hit_rate"].set_index("experiment")
    # `*`: the note's experiments only, not `other`, nor a sweep of the note's (a load axis)
    assert set(hits.index) == {"note2-6turn", "note2-20turn"}
    assert hits.loc["note2-20turn", "rel_error"] == 0  # inside the range
    assert hits.loc["note2-6turn", "rel_error"] == pytest.approx(0.88 / 0.89 - 1)  # to the nearer end
    ttc = out[out["metric"] == "time_to_complete_s"].iloc[0]
    assert ttc["rel_error"] == pytest.approx(-0.1)
    change = out[out["metric"] == "time_to_complete_s_change"].iloc[0]
    assert change["predicted"] == pytest.approx(-0.1)  # 90 / 100 - 1
    assert change["rel_error"] == pytest.approx(-0.04)  # a difference of changes, to the nearer end -0.06


def test_a_reported_pattern_names_an_experiment_and_its_variants():
    """``note2-20turn*``: the experiment and its load-signal variant, not the 6-turn one; ``*``
    is every experiment of the note, variants included."""
    sim = pd.concat([_summary(p, [t, t], [0.9, 0.9], exp=e, hw="a6000x4")
                     for e in ("note2-20turn", "note2-20turn-scraped", "note2-6turn")
                     for p, t in (("kv_aware", 90), ("least_loaded", 100 if e.endswith("scraped") else 90))])
    rep = pd.DataFrame([
        {"experiment": "note2-20turn*", "hardware": "a6000x4", "policy": "kv_aware vs least_loaded",
         "metric": "time_to_complete_s_change", "value": -0.33, "value_hi": np.nan, "note": "note2"},
        {"experiment": "*", "hardware": "a6000x4", "policy": "least_loaded", "metric": "hit_rate", "value": 0.86,
         "value_hi": np.nan, "note": "note2"},
    ])
    out = published_rows(sim, rep, in_sample=never)
    change = out[out["metric"] == "time_to_complete_s_change"].set_index("experiment")["predicted"]
    assert change.to_dict() == pytest.approx({"note2-20turn": 0.0, "note2-20turn-scraped": -0.1})
    assert set(out.loc[out["metric"] == "hit_rate", "experiment"]) == {"note2-20turn", "note2-20turn-scraped", "note2-6turn"}
    assert reported_experiment_matches("*", "note2-6turn", "note2")
    assert not reported_experiment_matches("*", "kv-reuse", "note2")
    assert reported_experiment_matches("note2-6turn", "note2-6turn") and not reported_experiment_matches("note2-6turn", "note2-6turn-scraped")


def test_order_checks_judge_only_distinguishable_pairs():
    s = pd.DataFrame([
        {"experiment": "e", "hardware": "h", "policy": "a", "metric": "m", "predicted": 1.0, "measured": 1.0,
         "measured_lo": 0.9, "measured_hi": 1.1},
        {"experiment": "e", "hardware": "h", "policy": "b", "metric": "m", "predicted": 3.0, "measured": 2.0,
         "measured_lo": 1.9, "measured_hi": 2.1},
        {"experiment": "e", "hardware": "h", "policy": "c", "metric": "m", "predicted": 0.5, "measured": 2.05,
         "measured_lo": 1.95, "measured_hi": 2.15},  # overlaps b: not judged against it
    ])
    out = order_checks(s)
    assert {(r.lower, r.higher): r.predicted_same for r in out.itertuples()} == {("a", "b"): True, ("a", "c"): False}


def test_headline_measures():
    s = pd.DataFrame([
        {"experiment": "e", "hardware": "h", "policy": "a", "metric": "ttft_mean_ms", "predicted": 110, "measured": 100,
         "measured_lo": np.nan, "measured_hi": np.nan, "rel_error": 0.1},
        {"experiment": "e", "hardware": "h", "policy": "a", "metric": "time_to_complete_s", "predicted": 7, "measured": 10,
         "measured_lo": np.nan, "measured_hi": np.nan, "rel_error": -0.3},
        {"experiment": "e", "hardware": "h", "policy": "a", "metric": "hit_rate", "predicted": 0.8, "measured": 0.85,
         "measured_lo": np.nan, "measured_hi": np.nan, "rel_error": -0.06},
        {"experiment": "e", "hardware": "h", "policy": "a", "metric": "imbalance", "predicted": 0.9, "measured": 0.2,
         "measured_lo": np.nan, "measured_hi": np.nan, "rel_error": 3.5},
    ])
    h = headline(s)
    assert h["timing_median_abs_rel_error"] == pytest.approx(0.2)
    assert h["hit_rate_max_points"] == pytest.approx(5.0)
    assert h["piled_agree"] == 0.0  # piled in the prediction, spread when measured


def test_every_reported_figure_of_note2_has_a_prediction_row(tmp_path):
    """The command over merged simulations: one published row per figure of note2.csv with a
    metric (a figure whose experiment is a pattern once per chat length it names)."""
    from kvroute.experiment import load_experiment
    from kvroute.sim.run import simulate_experiment

    sims = []
    for name, policies in (("note2-6turn", ["round_robin", "least_loaded", "kv_aware"]),
                           ("note2-20turn", ["round_robin", "least_loaded", "kv_aware"]),
                           ("note2-a100", None)):
        exp = load_experiment(ROOT / f"config/experiments/{name}.yaml")
        small = exp.raw | {"rounds": 1, "workload": {**exp.workload, "params": {**exp.workload["params"], "chats": 4, "turns": 2}}}
        import yaml
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(small))
        simulate_experiment(load_experiment(path), tmp_path / name, policies=policies)
        sims += ["--sim", str(tmp_path / name)]
    res = CliRunner().invoke(main, ["validate", *sims, "--out", str(tmp_path / "v")])
    assert res.exit_code == 0, res.output
    pub = pd.read_csv(tmp_path / "v" / "published.csv")
    rep = read_reported(ROOT / "paper/reported")
    rep = rep[rep["note"] == "note2"]  # only note 2's experiments were simulated here
    chats = ("note2-6turn", "note2-20turn")  # the figures a pattern names are on a6000x4: these two
    expected = sum(sum(reported_experiment_matches(r.experiment, e, "note2") for e in chats)
                   if is_experiment_pattern(r.experiment) else 1
                   for r in rep.itertuples() if isinstance(r.metric, str))
    assert len(pub) == expected
    assert pub["predicted"].notna().all() and not pub["in_sample"].any()
    assert pd.read_csv(tmp_path / "v" / "summary.csv").empty  # nothing measured


def test_a_figure_whose_hardware_is_unpublished_is_judged_on_every_profile_and_an_anchor_in_sample():
    """kv-reuse's figures name no hardware (``*``): one row per profile simulated; the
    operating point's target (least-loaded's mean TTFT) is in sample, the rest are not."""
    sim = pd.DataFrame([{"experiment": "kv-reuse", "hardware": h, "policy": p, "ttft_mean_ms": 100.0, "hit_rate": 0.9}
                        for h in ("a6000x4", "h100x8") for p in ("least_loaded", "sticky")])
    rep = pd.DataFrame([{"experiment": "kv-reuse", "hardware": "*", "policy": p, "metric": m, "value": 50.0,
                         "value_hi": float("nan"), "note": "kv_reuse"}
                        for p in ("least_loaded", "sticky") for m in ("ttft_mean_ms", "hit_rate")])
    from kvroute.analysis.validation import published_rows

    out = published_rows(sim, rep, in_sample=lambda hw: frozenset(),
                         anchors=frozenset({("kv-reuse", "least_loaded", "ttft_mean_ms")}))
    assert len(out) == 2 * 4 and set(out["hardware"]) == {"a6000x4", "h100x8"}
    inside = out[out["in_sample"]]
    assert set(zip(inside["policy"], inside["metric"])) == {("least_loaded", "ttft_mean_ms")} and len(inside) == 2


def test_the_operating_points_target_is_an_anchor():
    from kvroute.analysis.validation import operating_point_anchors

    anchors = operating_point_anchors(ROOT / "config/experiments", ["kv-reuse", "note2-6turn", "no-such"])
    assert anchors == frozenset({("kv-reuse", "least_loaded", "ttft_mean_ms")})


def test_oversubscribed_share_is_the_time_a_worker_holds_more_than_its_batch():
    """Two requests on w0 overlapping for 1 s of a 4 s round, with max_seqs 1: a quarter of
    the round; on two workers, or with max_seqs 2, never; a failed row is left out."""
    from kvroute.analysis.validation import oversubscribed_share

    rows = pd.DataFrame([
        {"policy": "p", "round": 0, "worker": "w0", "arrival_s": 0.0, "finish_s": 2.0},
        {"policy": "p", "round": 0, "worker": "w0", "arrival_s": 1.0, "finish_s": 3.0},
        {"policy": "p", "round": 0, "worker": "w1", "arrival_s": 3.0, "finish_s": 4.0},
        {"policy": "p", "round": 0, "worker": "w1", "arrival_s": 3.5, "finish_s": float("nan")},
        {"policy": "q", "round": 0, "worker": "w0", "arrival_s": 0.0, "finish_s": 2.0},
        {"policy": "q", "round": 0, "worker": "w1", "arrival_s": 1.0, "finish_s": 3.0},
        {"policy": "q", "round": 0, "worker": "w0", "arrival_s": 2.0, "finish_s": 4.0},  # starts as one ends
    ])
    got = oversubscribed_share(rows, max_seqs=1).set_index("policy")["share"]
    assert got["p"] == pytest.approx(0.25) and got["q"] == 0.0
    assert oversubscribed_share(rows, max_seqs=2)["share"].eq(0.0).all()


def _request(policy: str, rnd: int, worker: str, arrival: float, finish: float, ttft_ms: float,
             tokens: int = 11, status: str = "ok", exp: str = "e", hw: str = "cpu") -> dict:
    return {"experiment": exp, "hardware": hw, "policy": policy, "round": rnd, "worker": worker,
            "arrival_s": arrival, "finish_s": finish, "ttft_ms": ttft_ms, "e2e_ms": 1e3 * (finish - arrival),
            "output_tokens": tokens, "status": status}


def test_worker_rows_set_each_workers_measurement_beside_its_prediction():
    """Per worker and round: its share of the requests, mean TTFT, decode time per token
    after the first ((e2e - ttft) / (tokens - 1)) and time over max_seqs; a round that sent
    a worker nothing counts a share of 0; a failed row and a peer's 'unknown' worker are
    left out; a production router is predicted by its counterpart's records."""
    from kvroute.analysis.validation import WORKER_COLUMNS, worker_rows

    measured = pd.DataFrame([
        # round 0: w0 two requests, overlapping 0.5 s of a 2 s round; w1 one
        _request("p", 0, "w0", 0.0, 1.0, 100.0), _request("p", 0, "w0", 0.5, 1.5, 200.0),
        _request("p", 0, "w1", 1.0, 2.0, 300.0),
        _request("p", 0, "w1", 1.0, float("nan"), float("nan"), status="error"),
        # round 1: w0 only
        _request("p", 1, "w0", 0.0, 1.0, 100.0), _request("p", 1, "w0", 1.0, 2.0, 100.0),
        _request("sglang_router:cache_aware", 0, "unknown", 0.0, 1.0, 50.0),
    ])
    simulated = pd.DataFrame([
        _request("p", 0, "w0", 0.0, 1.0, 120.0), _request("p", 0, "w1", 0.5, 1.5, 240.0),
        _request("p", 1, "w0", 0.0, 1.0, 120.0), _request("p", 1, "w1", 0.5, 1.5, 240.0),
        _request("sglang_cache_aware", 0, "w0", 0.0, 1.0, 60.0),
    ])
    got = worker_rows(simulated, measured, max_seqs=lambda hw: 1)
    assert tuple(got.columns) == WORKER_COLUMNS
    assert set(got["policy"]) == {"p"}  # the peer's records name no worker the simulation has
    row = got.set_index(["worker", "metric"])
    assert row.loc[("w0", "request_share"), "measured"] == pytest.approx((2 / 3 + 1) / 2)
    assert row.loc[("w1", "request_share"), "measured"] == pytest.approx((1 / 3 + 0) / 2)
    assert row.loc[("w1", "request_share"), "predicted"] == pytest.approx(0.5)
    assert row.loc[("w0", "ttft_mean_ms"), "measured"] == pytest.approx((150 + 100) / 2)
    assert row.loc[("w0", "ttft_mean_ms"), "rel_error"] == pytest.approx(120 / 125 - 1)
    assert row.loc[("w1", "ttft_mean_ms"), "measured"] == pytest.approx(300)  # round 1 sent it nothing
    assert row.loc[("w0", "decode_ms_per_token"), "measured"] == pytest.approx(
        ((900 + 800) / 2 / 10 + 900 / 10) / 2)
    assert row.loc[("w0", "oversubscribed_share"), "measured"] == pytest.approx((0.5 / 2 + 0) / 2)
    assert row.loc[("w0", "oversubscribed_share"), "predicted"] == 0.0


def test_the_command_writes_each_measured_workers_rows(tmp_path):
    """`kvroute validate` with a measurement writes workers.csv from the full records of the
    measured experiments only. Test data: a small simulation of note2-cpu relabelled
    ``live`` stands in for the measurement, so each worker's prediction equals it."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from kvroute.experiment import load_experiment
    from kvroute.records import write_requests
    from kvroute.sim.run import simulate_experiment

    dirs = {}
    for name in ("note2-cpu", "note2-6turn"):
        exp = load_experiment(ROOT / f"config/experiments/{name}.yaml")
        small = exp.raw | {"rounds": 2, "workload": {**exp.workload, "params": {**exp.workload["params"], "chats": 4, "turns": 2}}}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(small))
        simulate_experiment(load_experiment(path), tmp_path / name, policies=["round_robin", "kv_aware"])
        dirs[name] = tmp_path / name
    live = tmp_path / "measure" / "note2-cpu" / "cpu"
    live.mkdir(parents=True)
    t = pq.read_table(dirs["note2-cpu"] / "requests.parquet")
    t = t.set_column(t.schema.get_field_index("source"), "source", pa.array(["live"] * len(t)))
    write_requests(t, live / "requests.parquet")
    shutil.copy(dirs["note2-cpu"] / "summary.csv", live / "summary.csv")
    args = [a for d in dirs.values() for a in ("--sim", str(d))] + ["--measured", str(live)]
    res = CliRunner().invoke(main, ["validate", *args, "--out", str(tmp_path / "v")])
    assert res.exit_code == 0, res.output
    w = pd.read_csv(tmp_path / "v" / "workers.csv")
    assert set(w["experiment"]) == {"note2-cpu"} and set(w["hardware"]) == {"cpu"}
    assert set(w["policy"]) == {"round_robin", "kv_aware"}
    assert set(w[w["policy"] == "round_robin"]["worker"]) == {"w0", "w1"}
    assert np.allclose(w["predicted"], w["measured"], equal_nan=True)
    assert w[w["metric"] == "request_share"].groupby("policy")["measured"].sum().round(9).eq(1.0).all()
    # no canary in these folders (no load.json, no probe file): machine.csv has its columns and no rows
    assert list(pd.read_csv(tmp_path / "v" / "machine.csv").columns) == list(MACHINE_COLUMNS)
    assert pd.read_csv(tmp_path / "v" / "machine.csv").empty


def test_machine_rows_set_the_runs_canary_beside_the_probes(tmp_path):
    """A measurement whose canary ran 10% slower on cpu 0 than in its probe sessions (and as
    fast on cpu 1) gets ratio 1.1 there and 1.0 beside it; folders without a canary are skipped."""
    import json

    d = tmp_path / "m"
    d.mkdir()
    pd.DataFrame({"experiment": ["e"], "hardware": ["cpu"]}).to_csv(d / "summary.csv", index=False)
    probe = [{"cpu": c, "work": w, "ms": ms, "session": s, "when": "start"}
             for s in (0, 1) for c, ms in ((0, 10.0), (1, 20.0)) for w in ("python", "numpy")]
    (d / "probe.json").write_text(json.dumps({"probed": {"canary": probe}, "requests": []}))
    runs = {f"p round {r}": [{"cpu": 0, "work": w, "ms": ms} for w in ("python", "numpy")] +
            [{"cpu": 1, "work": w, "ms": 20.0} for w in ("python", "numpy")]
            for r, ms in enumerate((11.0, 10.5, 11.5))}
    (d / "load.json").write_text(json.dumps({"canary": runs}))
    (tmp_path / "old").mkdir()
    rows = machine_rows([d, tmp_path / "old"]).set_index(["cpu", "work"])
    assert len(rows) == 4 and set(rows.experiment) == {"e"} and (rows.runs == 3).all()
    assert rows.loc[(0, "python"), "ratio"] == pytest.approx(1.1)
    assert rows.loc[(0, "numpy"), "measured_max_ms"] == 11.5
    assert rows.loc[(1, "numpy"), "ratio"] == pytest.approx(1.0)
