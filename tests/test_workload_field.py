"""The field's workload generator (kvroute.workload.field): each preset's documented shape,
the distributions, the arrival processes, determinism and the parameter checks."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from scipy import stats

from kvroute.cli import main
from kvroute.experiment import ExperimentError, load_experiment
from kvroute.workload import GENERATORS, generate, generator_params, read_trace, write_trace
from kvroute.workload.distributions import parse_dist
from kvroute.workload.field import field
from kvroute.workload.field_presets import LLMD_LADDER, PRESETS
from kvroute.workload.trace import Trace, Turn


def lengths(trace: Trace) -> list[tuple]:
    """Everything of a trace but arrival times and ids."""
    return [(c.system_tokens, c.turns) for c in trace.conversations]


def per_group(trace: Trace) -> Counter:
    return Counter(c.system_id for c in trace.conversations)


def users(trace: Trace, first: bool = False) -> np.ndarray:
    """User-message lengths of every turn after the first (or of the first turns)."""
    if first:
        return np.array([c.turns[0].user_tokens for c in trace.conversations])
    return np.array([t.user_tokens for c in trace.conversations for t in c.turns[1:]])


def replies(trace: Trace) -> np.ndarray:
    return np.array([t.output_tokens for c in trace.conversations for t in c.turns])


def starts(trace: Trace) -> np.ndarray:
    return np.array([c.arrival_s for c in trace.conversations])


# --- presets: each source's documented shape ------------------------------------------


def test_every_preset_names_its_source_and_assumptions() -> None:
    for name, p in PRESETS.items():
        trace = generate(name, 0)
        assert trace.name == name and trace.meta["preset"] == name
        assert trace.meta["source"] == p.source and "/" in p.source  # names a file
        assert trace.meta["assumptions"] and trace.meta["assumptions"] == list(p.assumptions)
        assert p.source in GENERATORS[name].__doc__


def test_sglang_gsp_defaults() -> None:
    trace = generate("sglang_gsp", 0)
    assert trace.mode == "open" and len(trace.conversations) == 64 * 16
    counts = per_group(trace)
    assert len(counts) == 64 and set(counts.values()) == {16}  # 16 prompts share each prompt
    assert {c.system_tokens for c in trace.conversations} == {2048}
    assert {c.turns for c in trace.conversations} == {(Turn(128, 256, 0.0),)}  # one exact turn
    assert (starts(trace) == 0).all()  # --request-rate inf: all at once
    order = [c.system_id for c in trace.conversations]
    assert order != sorted(order)  # shuffled
    ordered = [c.system_id for c in generate("sglang_gsp", 0, shuffle=False).conversations]
    assert ordered == sorted(ordered)  # --gsp-ordered: group by group


def test_sglang_gsp_with_a_rate_is_poisson_and_keeps_the_lengths() -> None:
    burst = generate("sglang_gsp", 4)
    poisson = generate("sglang_gsp", 4, rate_per_s=20.0)
    assert poisson.meta["params"]["arrival"] == "poisson"
    assert lengths(poisson) == lengths(burst)
    gaps = np.diff(np.concatenate([[0.0], starts(poisson)]))
    assert stats.kstest(gaps, "expon", args=(0, 1 / 20.0)).pvalue > 0.01
    assert len(gaps) / starts(poisson)[-1] == pytest.approx(20.0, rel=0.1)


def test_sglang_gsp_range_ratio_draws_within_the_range() -> None:
    trace = generate("sglang_gsp", 2,
                     group_prefix_tokens={"dist": "range_ratio", "value": 2048, "ratio": 0.5},
                     user_tokens={"dist": "range_ratio", "value": 128, "ratio": 0.5})
    by_group = {}
    for c in trace.conversations:
        by_group.setdefault(c.system_id, set()).add(c.system_tokens)
    assert all(len(v) == 1 for v in by_group.values())  # one length per group's prompt
    systems = np.array([v.pop() for v in by_group.values()])
    assert systems.min() >= 1024 and systems.max() <= 2048 and len(set(systems)) > 32
    q = users(trace, first=True)
    assert q.min() >= 64 and q.max() <= 128
    assert q.mean() == pytest.approx(96, abs=2)  # uniform on 64..128


def test_sglang_gsp_zipf_popularity_skews_groups_as_it_should() -> None:
    alpha, groups = 1.2, 64
    trace = generate("sglang_gsp", 1, group_popularity="zipf", zipf_alpha=alpha,
                     conversations=20000)
    counts = per_group(trace)
    observed = np.array([counts.get(f"sglang_gsp-s1-g{g:04d}", 0) for g in range(groups)])
    p = np.arange(1, groups + 1, dtype=float) ** -alpha
    p /= p.sum()
    assert observed[0] == pytest.approx(20000 * p[0], rel=0.05)  # group 0 hottest
    assert stats.chisquare(observed, 20000 * p).pvalue > 0.001
    assert stats.spearmanr(np.arange(groups), observed).statistic < -0.9
    uniform = per_group(generate("sglang_gsp", 1, conversations=3 * 1024))
    assert set(uniform.values()) == {3 * 16}  # the pool of 64 x 16, cycled three times


def test_llmd_shared_prefix() -> None:
    trace = generate("llmd_shared_prefix", 0)
    assert len(trace.conversations) == 750
    counts = per_group(trace)
    assert len(counts) == 150 and set(counts.values()) == {5}
    assert {c.system_tokens for c in trace.conversations} == {6000}
    assert {c.turns for c in trace.conversations} == {(Turn(1200, 1000, 0.0),)}
    assert len(starts(trace)) / starts(trace)[-1] == pytest.approx(15.0, rel=0.1)
    at_40 = generate("llmd_shared_prefix", 0, rate_per_s=40.0, conversations=1520)
    assert len(at_40.conversations) == 1520
    assert lengths(at_40)[:750] == lengths(trace)  # a rate is an arrival, not a workload change
    assert 1520 / starts(at_40)[-1] == pytest.approx(40.0, rel=0.1)


def test_llmd_ladder_sends_each_step_at_its_rate() -> None:
    trace = generate("llmd_shared_prefix_ladder", 3)
    t = starts(trace)
    assert (np.diff(t) >= 0).all() and t[-1] < sum(d for _, d in LLMD_LADDER)
    edges = np.cumsum([0] + [d for _, d in LLMD_LADDER])
    observed = np.histogram(t, bins=edges)[0]
    expected = np.array([r * d for r, d in LLMD_LADDER])
    assert len(trace.conversations) == observed.sum()
    assert (np.abs(observed - expected) <= 4 * np.sqrt(expected)).all()  # Poisson counts
    # inference-perf cycles the shuffled pool: request i and i + 750 share a group
    ids = [c.system_id for c in trace.conversations]
    assert all(ids[i] == ids[i + 750] for i in range(len(ids) - 750))
    assert {c.system_tokens for c in trace.conversations} == {6000}


def test_inference_perf_shared_prefix_defaults() -> None:
    trace = generate("inference_perf_shared_prefix", 0)
    counts = per_group(trace)
    assert len(counts) == 10 and set(counts.values()) == {10}
    assert {c.system_tokens for c in trace.conversations} == {100}
    assert {c.turns for c in trace.conversations} == {(Turn(50, 50, 0.0),)}
    assert starts(trace).tolist() == [float(i) for i in range(100)]  # constant, 1/s


def test_vllm_multiturn_shape() -> None:
    trace = generate("vllm_multiturn", 0)
    assert len(trace.conversations) == 24
    assert trace.mode == "closed" and trace.concurrency == 2
    assert len(per_group(trace)) == 1  # the common prefix: one system prompt for all
    assert {c.system_tokens for c in trace.conversations} == {500}
    assert {len(c.turns) for c in trace.conversations} <= {6, 7, 8, 9}
    assert all(t.think_s == 0 for c in trace.conversations for t in c.turns)


def test_vllm_multiturn_turns_count_messages_rounded_up_to_even() -> None:
    trace = generate("vllm_multiturn", 5, conversations=7000)
    counts = Counter(len(c.turns) for c in trace.conversations)
    assert set(counts) == {6, 7, 8, 9}
    observed = np.array([counts[k] for k in (6, 7, 8, 9)])
    assert stats.chisquare(observed, 7000 * np.array([1, 2, 2, 2]) / 7).pvalue > 0.001


def test_vllm_multiturn_lengths() -> None:
    trace = generate("vllm_multiturn", 6, conversations=7000)
    later = users(trace)
    assert later.min() == 120 and later.max() == 160
    assert later.mean() == pytest.approx(140, abs=0.5)
    out = replies(trace)
    assert out.min() == 80 and out.max() == 120 and out.mean() == pytest.approx(100, abs=0.5)
    # turn 0: the conversation's own prefix, lognormal average 1,000 capped at 5,000 (the
    # 500-token common prefix has used up the 120-160 token budget of the first message)
    first = users(trace, first=True)
    assert first.max() <= 5000
    assert first.mean() == pytest.approx(1000, rel=0.03)
    assert np.median(first) == pytest.approx(850, rel=0.03)  # median ratio 0.85
    sigma = math.sqrt(2 * math.log(1 / 0.85))
    assert stats.kstest(first, "lognorm", args=(sigma, 0, 850)).pvalue > 0.001


def test_vllm_multiturn_prefixes_are_unique_and_the_common_prefix_shared() -> None:
    trace = generate("vllm_multiturn", 1, first_message_includes_common_prefix=False)
    first = users(trace, first=True)
    assert first.min() >= 120  # now the question is there beside the prefix
    unique = {c.id for c in trace.conversations}
    assert len(unique) == 24 and len({c.system_id for c in trace.conversations}) == 1


def test_blis_multiturn_shape() -> None:
    trace = generate("blis_multiturn", 0)
    assert len(trace.conversations) == 100 and trace.num_requests == 500
    assert {len(c.turns) for c in trace.conversations} == {5}
    assert {c.system_tokens for c in trace.conversations} == {0}  # no shared prefix
    assert all([t.think_s for t in c.turns] == [0.0, 0.5, 0.5, 0.5, 0.5]
               for c in trace.conversations)
    assert trace.mode == "open"
    c = trace.conversations[0]  # context accumulates: each round's prompt holds the history
    assert c.prompt_lengths()[4] == sum(t.user_tokens + t.output_tokens for t in c.turns[:4]) \
        + c.turns[4].user_tokens


def test_blis_multiturn_lengths_and_session_rate() -> None:
    trace = generate("blis_multiturn", 2, conversations=4000)
    u = np.array([t.user_tokens for c in trace.conversations for t in c.turns])
    o = replies(trace)
    assert u.min() >= 32 and u.max() <= 512 and o.min() >= 16 and o.max() <= 256
    assert u.mean() == pytest.approx(128, abs=1) and u.std() == pytest.approx(30, rel=0.03)
    assert o.mean() == pytest.approx(64, abs=1) and o.std() == pytest.approx(20, rel=0.04)
    assert 4000 / starts(trace)[-1] == pytest.approx(500, rel=0.05)  # sessions per second
    high = generate("blis_multiturn", 2, rate_per_s=5000.0, conversations=400)
    assert high.num_requests == 2000 and 400 / starts(high)[-1] == pytest.approx(5000, rel=0.2)


# --- distributions --------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, mean, lo, hi",
    [
        (7, 7, 7, 7),
        ({"dist": "uniform", "min": 3, "max": 9}, 6, 3, 9),
        ({"dist": "range_ratio", "value": 100, "ratio": 0.2}, 60, 20, 100),
        ({"dist": "normal", "mean": 50, "std": 5, "min": 0, "max": 100}, 50, 0, 100),
        ({"dist": "lognormal", "median": 100, "sigma": 0.5}, 100 * math.exp(0.125), 1, None),
        ({"dist": "lognormal", "mu": 3.0, "sigma": 0.2}, math.exp(3.02), 1, None),
        ({"dist": "poisson", "mean": 12}, 12, 0, None),
        ({"dist": "exponential", "mean": 30}, 30, 0, None),
    ],
)
def test_distribution_moments(spec, mean, lo, hi) -> None:
    x = parse_dist("x", spec).sample(np.random.default_rng(0), 40000)
    assert x.dtype == np.int64
    assert x.mean() == pytest.approx(mean, rel=0.02, abs=0.3)
    assert x.min() >= lo and (hi is None or x.max() <= hi)


def test_zipf_and_caps() -> None:
    x = parse_dist("x", {"dist": "zipf", "alpha": 2.0, "max": 50}).sample(
        np.random.default_rng(1), 50000)
    assert x.min() == 1 and x.max() == 50
    assert (x == 1).mean() == pytest.approx(1 / (math.pi**2 / 6), abs=0.01)  # 1 / zeta(2)
    capped = parse_dist("x", {"dist": "lognormal", "average": 1000, "max": 900}).sample(
        np.random.default_rng(1), 1000)
    assert capped.max() == 900


def test_floor_raises_unbounded_draws_and_rejects_bounds_below_it() -> None:
    out = parse_dist("output_tokens", {"dist": "poisson", "mean": 0.5}, floor=1).sample(
        np.random.default_rng(0), 1000)
    assert out.min() == 1  # a reply needs a token, as vLLM's max(n, 1)
    with pytest.raises(ValueError, match="output_tokens: value must be >= 1"):
        parse_dist("output_tokens", 0, floor=1)


def test_times_are_continuous() -> None:
    t = parse_dist("think_s", {"dist": "uniform", "min": 0.1, "max": 0.2},
                   integer=False).sample(np.random.default_rng(0), 100)
    assert t.dtype == float and len(set(t)) == 100 and t.min() >= 0.1 and t.max() <= 0.2


# --- arrivals -------------------------------------------------------------------------


def test_arrivals_burst_constant_closed_and_ramp() -> None:
    assert (starts(field(0, conversations=5)) == 0).all()
    assert field(0, conversations=5).mode == "open"
    assert starts(field(0, conversations=4, arrival="constant", rate_per_s=2.0)).tolist() == [
        0.0, 0.5, 1.0, 1.5]
    closed = field(0, conversations=6, concurrency=3)
    assert closed.mode == "closed" and closed.concurrency == 3 and (starts(closed) == 0).all()
    ramped = starts(field(0, conversations=200, concurrency=3, ramp_s=4.0))
    assert ramped.min() >= 0 and ramped.max() < 4 and ramped.std() > 0.9


def test_ladder_steps_and_pauses() -> None:
    trace = field(2, ladder=[[100, 10], [0, 5], [400, 10]])
    t = starts(trace)
    assert not ((t > 10) & (t < 15)).any()  # the pause sends nothing
    first, last = (t < 10).sum(), (t >= 15).sum()
    assert abs(first - 1000) <= 4 * math.sqrt(1000) and abs(last - 4000) <= 4 * math.sqrt(4000)
    within = t[t >= 15] - 15
    assert stats.kstest(within, "uniform", args=(0, 10)).pvalue > 0.001
    capped = field(2, ladder=[[100, 10], [0, 5], [400, 10]], conversations=50)
    assert capped.conversations == trace.conversations[:50]


def test_a_ladder_and_a_rate_draw_the_same_lengths() -> None:
    ladder = field(9, turns={"dist": "uniform", "min": 1, "max": 4},
                   user_tokens={"dist": "poisson", "mean": 40}, ladder=[[5, 20]])
    n = len(ladder.conversations)
    poisson = field(9, conversations=n, turns={"dist": "uniform", "min": 1, "max": 4},
                    user_tokens={"dist": "poisson", "mean": 40}, rate_per_s=50.0)
    assert lengths(poisson) == lengths(ladder)
    assert starts(poisson).tolist() != starts(ladder).tolist()


# --- determinism, ids, meta -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_same_seed_same_trace_and_seeded_ids(name: str) -> None:
    small = {"conversations": 12}
    a, b = generate(name, 7, **small), generate(name, 7, **small)
    assert a == b
    other = generate(name, 8, **small)
    assert not {c.id for c in a.conversations} & {c.id for c in other.conversations}
    assert not {c.system_id for c in a.conversations} & {c.system_id for c in other.conversations}


def test_different_seed_different_lengths() -> None:
    assert lengths(generate("vllm_multiturn", 1)) != lengths(generate("vllm_multiturn", 2))


def test_more_conversations_extend_fewer() -> None:
    small = generate("blis_multiturn", 3, conversations=10)
    big = generate("blis_multiturn", 3, conversations=30)
    assert big.conversations[:10] == small.conversations


def test_meta_reproduces_the_trace(tmp_path) -> None:
    trace = generate("vllm_multiturn", 4, concurrency=3)
    meta = trace.meta
    assert meta["generator"] == "field" and meta["seed"] == 4
    assert meta["params"]["concurrency"] == 3 and meta["params"]["arrival"] == "closed"
    assert meta["derived"]["conversations"] == 24 and meta["derived"]["common_prefix_tokens"] == 500
    assert field(4, preset=meta["preset"], **meta["params"]) == trace
    assert read_trace(write_trace(trace, tmp_path / "t.parquet")) == trace  # meta is plain JSON


def test_preset_generator_is_field_with_the_preset() -> None:
    assert generate("sglang_gsp", 0, groups=4, prompts_per_group=2) == field(
        0, preset="sglang_gsp", groups=4, prompts_per_group=2)
    assert generate("field", 0, preset="sglang_gsp", groups=3) == field(
        0, preset="sglang_gsp", groups=3)
    assert generator_params("sglang_gsp")["groups"] == 64
    assert generator_params("llmd_shared_prefix")["group_prefix_tokens"] == 6000
    assert generator_params("field")["preset"] is None


def test_an_arrival_override_replaces_the_presets_arrival() -> None:
    closed = generate("vllm_multiturn", 0, concurrency=4)
    assert closed.concurrency == 4
    opened = generate("vllm_multiturn", 0, rate_per_s=2.0)
    assert opened.mode == "open" and opened.meta["params"]["concurrency"] is None
    one_rate = generate("llmd_shared_prefix_ladder", 0, rate_per_s=30.0)
    assert len(one_rate.conversations) == 750 and one_rate.meta["params"]["ladder"] is None
    ramped = generate("vllm_multiturn", 0, ramp_s=2.0)  # not an arrival choice: kept closed
    assert ramped.concurrency == 2 and starts(ramped).max() > 0


# --- prefix sharing rules -------------------------------------------------------------


def test_prefix_sharing_through_system_ids() -> None:
    grouped = field(0, groups=3, prompts_per_group=4, group_prefix_tokens=64)
    assert len(per_group(grouped)) == 3 and set(per_group(grouped).values()) == {4}
    common = field(0, conversations=6, common_prefix_tokens=300,
                   conversation_prefix_tokens={"dist": "uniform", "min": 10, "max": 20})
    assert len(per_group(common)) == 1 and common.conversations[0].system_tokens == 300
    first = users(common, first=True)
    assert (first >= 128 + 10).all() and (first <= 128 + 20).all()
    one_group = field(0, conversations=4, common_prefix_tokens=100, group_prefix_tokens=50)
    assert {c.system_tokens for c in one_group.conversations} == {150}  # both shared by all


def test_common_and_distinct_group_prefixes_are_not_expressible_yet() -> None:
    with pytest.raises(ValueError, match="common_prefix_tokens.*not expressible yet"):
        field(0, groups=2, group_prefix_tokens=100, common_prefix_tokens=50)


# --- bad parameters -------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"groups": 0}, "groups must be an integer >= 1"),
        ({"prompts_per_group": 1.5}, "prompts_per_group"),
        ({"conversations": 0}, "conversations"),
        ({"group_popularity": "zipf"}, "zipf.*needs zipf_alpha"),
        ({"zipf_alpha": 1.0}, "zipf_alpha applies only"),
        ({"group_popularity": "zipf", "zipf_alpha": -1}, "zipf_alpha must be"),
        ({"group_popularity": "pareto"}, "group_popularity must be one of"),
        ({"shuffle": 1}, "shuffle must be true or false"),
        ({"user_tokens": {"dist": "gamma"}}, "user_tokens: dist must be one of"),
        ({"user_tokens": {"dist": "uniform", "min": 9, "max": 3}}, "user_tokens: min .* max"),
        ({"user_tokens": {"dist": "uniform", "min": 9}}, r"user_tokens: .*needs key\(s\) \['max'\]"),
        ({"user_tokens": {"dist": "uniform", "min": 1, "max": 3, "mode": 2}}, r"user_tokens: unknown key"),
        ({"user_tokens": {"dist": "uniform", "min": 1.5, "max": 3}}, "user_tokens.min must be an integer"),
        ({"user_tokens": -3}, "user_tokens: value must be >= 0"),
        ({"output_tokens": 0}, "output_tokens: value must be >= 1"),
        ({"output_tokens": {"dist": "normal", "mean": 5, "std": -1, "min": 1, "max": 9}}, "output_tokens: std"),
        ({"conversation_prefix_tokens": {"dist": "lognormal", "average": 10, "sigma": 1}}, "conversation_prefix_tokens: lognormal takes"),
        ({"conversation_prefix_tokens": {"dist": "lognormal", "average": 10, "median_ratio": 1.2}}, "median_ratio"),
        ({"turns": {"dist": "zipf", "alpha": 0.9}}, "turns: zipf alpha must be > 1"),
        ({"turns": 0}, "turns: value must be >= 1"),
        ({"turns_unit": "rounds"}, "turns_unit must be one of"),
        ({"think_s": {"dist": "poisson", "mean": 1}}, "think_s: dist 'poisson' draws integers"),
        ({"think_s": -0.5}, "think_s: value must be >= 0"),
        ({"group_prefix_tokens": {"dist": "range_ratio", "value": 10, "ratio": 2}}, "group_prefix_tokens: ratio"),
        ({"arrival": "trickle"}, "arrival must be one of"),
        ({"arrival": "poisson"}, "arrival 'poisson' needs rate_per_s"),
        ({"arrival": "burst", "rate_per_s": 3}, "rate_per_s does not apply to arrival 'burst'"),
        ({"rate_per_s": 3, "concurrency": 2}, "each choose an arrival process"),
        ({"rate_per_s": 0}, "rate_per_s must be a finite number > 0"),
        ({"ladder": []}, "ladder must be a non-empty list"),
        ({"ladder": [[5]]}, r"ladder\[0\] must be \[rate_per_s, duration_s\]"),
        ({"ladder": [[5, 0]]}, r"ladder\[0\] duration_s"),
        ({"ladder": [[0, 5]]}, "nothing would arrive"),
        ({"ladder": [{"rate": 5, "duration": 2}]}, r"ladder\[0\] must have keys"),
        ({"concurrency": 5, "conversations": 3}, r"concurrency \(5\) must not exceed"),
        ({"concurrency": 0}, "concurrency must be an integer >= 1"),
        ({"ramp_s": 2.0}, "ramp_s applies to arrival 'closed' only"),
        ({"colour": "blue"}, r"unknown parameter\(s\) \['colour'\]"),
        ({"preset": "sharegpt"}, "preset must be one of"),
    ],
)
def test_bad_parameters_are_rejected_naming_them(params: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        field(0, **params)


def test_a_ladder_with_a_tiny_rate_that_sends_nothing_is_rejected() -> None:
    with pytest.raises(ValueError, match="sent no conversation"):
        field(0, ladder=[[1e-9, 1]])


def test_unknown_parameter_of_a_preset_generator_is_rejected_by_the_registry() -> None:
    with pytest.raises(ValueError, match=r"unknown parameter.*'sglang_gsp'"):
        generate("sglang_gsp", 0, system_len=5)


# --- experiment files and the CLI -----------------------------------------------------


def _experiment(tmp_path, workload: dict):
    path = tmp_path / "field.yaml"
    path.write_text(yaml.safe_dump({
        "name": "field", "seed": 5, "workload": workload,
        "runs": [{"hardware": "a6000x4", "policies": ["round_robin"]}]}))
    return path


@pytest.mark.parametrize(
    "workload",
    [
        {"generator": "field", "params": {"preset": "sglang_gsp", "groups": 4,
                                          "prompts_per_group": 2, "rate_per_s": 8}},
        {"generator": "sglang_gsp", "params": {"groups": 4, "prompts_per_group": 2,
                                               "rate_per_s": 8}},
    ],
)
def test_kvroute_workload_writes_a_preset_trace(tmp_path, workload) -> None:
    exp = _experiment(tmp_path, workload)
    out = tmp_path / "round0.parquet"
    res = CliRunner().invoke(main, ["workload", str(exp), "--round", "0", "--out", str(out)])
    assert res.exit_code == 0, res.output
    trace = read_trace(out)
    assert trace.meta["preset"] == "sglang_gsp" and len(trace.conversations) == 8
    assert len(per_group(trace)) == 4 and trace.meta["params"]["arrival"] == "poisson"


def test_an_experiment_with_a_misspelt_field_parameter_names_the_key(tmp_path) -> None:
    exp = _experiment(tmp_path, {"generator": "vllm_multiturn", "params": {"clients": 2}})
    with pytest.raises(ExperimentError, match="workload.params.clients"):
        load_experiment(exp)
