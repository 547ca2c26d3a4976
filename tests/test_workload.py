"""Workload generators, the registry, trace validation and the parquet round trip."""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.workload import (
    GENERATORS,
    TOKENS_PER_WORD,
    Conversation,
    Trace,
    Turn,
    agent,
    generate,
    note2,
    read_trace,
    sharegpt_like,
    trace_from_frame,
    trace_to_frame,
    write_trace,
)
from kvroute.workload import io as trace_io
from kvroute.workload.generators import (
    REPLY_TOKENS_MEDIAN,
    TURNS_MEAN,
    USER_TOKENS_MEDIAN,
    USER_TOKENS_P95,
    USER_TOKENS_SIGMA,
)


def lengths(trace: Trace) -> list[tuple]:
    """Everything of a trace but arrival times and ids."""
    return [(c.system_tokens, c.turns) for c in trace.conversations]


# --- note2 ----------------------------------------------------------------------------


def test_tokens_per_word_is_four_thirds() -> None:
    assert TOKENS_PER_WORD == pytest.approx(4 / 3)


@pytest.mark.parametrize("turns", [6, 20])
def test_note2_shape(turns: int) -> None:
    trace = note2(0, turns=turns)
    assert trace.mode == "closed" and trace.concurrency == 64
    assert len(trace.conversations) == 64
    assert trace.num_requests == 64 * turns
    assert len({c.id for c in trace.conversations}) == 64
    assert len({c.system_id for c in trace.conversations}) == 1  # one shared system prompt
    for c in trace.conversations:
        assert c.system_tokens == 800  # round(600 * 4/3)
        assert c.arrival_s == 0.0
        assert all(t == Turn(200, 128, 0.0) for t in c.turns)  # round(150 * 4/3), 128
    c = trace.conversations[0]
    assert c.prompt_tokens(0) == 1000
    assert c.prompt_lengths()[-1] == 800 + (turns - 1) * (200 + 128) + 200


def test_note2_ratio_and_think_time_are_parameters() -> None:
    trace = note2(1, chats=4, turns=3, tokens_per_word=1.0, think_s=2.5)
    c = trace.conversations[0]
    assert c.system_tokens == 600 and c.turns[0].user_tokens == 150
    assert [t.think_s for t in c.turns] == [0.0, 2.5, 2.5]  # turn 0 follows no reply
    assert trace.meta["tokens_per_word"] == 1.0


def test_note2_is_deterministic_and_seed_only_salts_ids() -> None:
    assert note2(3) == note2(3)
    assert lengths(note2(3)) == lengths(note2(4))
    assert note2(3).conversations[0].id != note2(4).conversations[0].id


@pytest.mark.parametrize("generator", [note2, agent])
def test_ramp_spreads_closed_loop_starts_by_seed(generator) -> None:
    a, b = generator(1, ramp_s=2.0), generator(2, ramp_s=2.0)
    starts = [c.arrival_s for c in a.conversations]
    assert all(0.0 <= s < 2.0 for s in starts) and len(set(starts)) == len(starts)
    assert starts != [c.arrival_s for c in b.conversations]
    assert all(c.arrival_s == 0.0 for c in generator(1).conversations)  # default: all at once
    if generator is note2:
        assert lengths(a) == lengths(b)


# --- determinism and meta for every generator -----------------------------------------

SMALL = {
    "note2": {"chats": 4},
    "sharegpt_like": {"conversations": 30},
    "agent": {"conversations": 6, "concurrency": 3},
    # the field's generator and its presets (tests/test_workload_field.py has their shapes)
    "field": {"conversations": 5, "turns": 2},
    "sglang_gsp": {"groups": 3, "prompts_per_group": 2},
    "llmd_shared_prefix": {"groups": 3},
    "llmd_shared_prefix_ladder": {"conversations": 20},
    "inference_perf_shared_prefix": {"groups": 2},
    "vllm_multiturn": {"conversations": 4},
    "blis_multiturn": {"conversations": 6},
}
#: Generators whose sizes are given in words (they record the tokens-per-word ratio).
WORD_SIZED = ("note2", "sharegpt_like", "agent")


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_trace(name: str) -> None:
    assert generate(name, 11, **SMALL[name]) == generate(name, 11, **SMALL[name])


@pytest.mark.parametrize("name", ["sharegpt_like", "agent"])
def test_different_seed_different_trace(name: str) -> None:
    assert lengths(generate(name, 11, **SMALL[name])) != lengths(generate(name, 12, **SMALL[name]))


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_meta_records_generator_seed_all_params_and_ratio(name: str) -> None:
    trace = generate(name, 5, **SMALL[name])
    expected = set(inspect.signature(GENERATORS[name]).parameters) - {"seed", "preset"}
    assert trace.meta["generator"] == (name if name in WORD_SIZED else "field")
    assert trace.meta["seed"] == 5
    assert set(trace.meta["params"]) == expected
    if name in WORD_SIZED:
        assert trace.meta["tokens_per_word"] == pytest.approx(4 / 3)


@pytest.mark.parametrize("name", ["sharegpt_like", "agent"])
def test_more_conversations_extend_fewer(name: str) -> None:
    small, big = generate(name, 2, conversations=10), generate(name, 2, conversations=20)
    assert big.conversations[:10] == small.conversations


def test_rate_changes_arrivals_not_lengths() -> None:
    slow = sharegpt_like(4, conversations=50, rate_per_s=1.0)
    fast = sharegpt_like(4, conversations=50, rate_per_s=8.0)
    assert lengths(slow) == lengths(fast)
    assert slow.conversations[-1].arrival_s > fast.conversations[-1].arrival_s


# --- sharegpt_like: the fit -----------------------------------------------------------


@pytest.fixture(scope="module")
def big_sharegpt() -> Trace:
    return sharegpt_like(2024, conversations=30_000, rate_per_s=5.0, max_context_tokens=None)


def test_sigma_follows_from_median_and_p95() -> None:
    assert USER_TOKENS_SIGMA == pytest.approx(math.log(940 / 145) / 1.6448536, rel=1e-6)


def test_sharegpt_like_user_tokens_fit(big_sharegpt: Trace) -> None:
    users = np.array([t.user_tokens for c in big_sharegpt.conversations for t in c.turns])
    assert np.median(users) == pytest.approx(USER_TOKENS_MEDIAN, rel=0.05)
    assert np.percentile(users, 95) == pytest.approx(USER_TOKENS_P95, rel=0.08)
    assert users.min() >= 1 and users.max() <= 8192


def test_sharegpt_like_turns_fit_and_heavy_tail(big_sharegpt: Trace) -> None:
    counts = np.array([len(c.turns) for c in big_sharegpt.conversations])
    assert counts.mean() == pytest.approx(TURNS_MEAN, abs=0.2)
    assert 0.55 < (counts == 1).mean() < 0.65  # the power law puts ~60% at one turn
    assert (counts >= 20).mean() > 0.02  # and keeps a heavy tail (a geometric would not)


def test_sharegpt_like_replies_and_arrivals(big_sharegpt: Trace) -> None:
    replies = np.array([t.output_tokens for c in big_sharegpt.conversations for t in c.turns])
    assert np.median(replies) == pytest.approx(REPLY_TOKENS_MEDIAN, rel=0.05)
    arrivals = np.array([c.arrival_s for c in big_sharegpt.conversations])
    assert big_sharegpt.mode == "open" and big_sharegpt.concurrency is None
    assert np.all(np.diff(arrivals) > 0)
    assert np.diff(arrivals).mean() == pytest.approx(1 / 5.0, rel=0.05)


def test_sharegpt_like_context_cap_and_shared_system_prompt() -> None:
    trace = sharegpt_like(9, conversations=300, system_words=300, max_context_tokens=2048)
    assert len({c.system_id for c in trace.conversations}) == 1
    for c in trace.conversations:
        assert c.system_tokens == 400
        for i, p in enumerate(c.prompt_lengths()):
            assert p + c.turns[i].output_tokens <= 2048


def test_sharegpt_like_max_turns_clips() -> None:
    trace = sharegpt_like(9, conversations=500, max_turns=2)
    assert max(len(c.turns) for c in trace.conversations) == 2


def test_sharegpt_like_think_times() -> None:
    trace = sharegpt_like(3, conversations=2000, think_s_mean=10.0)
    assert all(c.turns[0].think_s == 0.0 for c in trace.conversations)
    later = [t.think_s for c in trace.conversations for t in c.turns[1:]]
    assert np.mean(later) == pytest.approx(10.0, rel=0.1)


# --- agent ----------------------------------------------------------------------------


def test_agent_histories_grow_from_8k_to_32k_with_short_replies() -> None:
    trace = agent(0)
    assert trace.mode == "closed" and trace.concurrency == 8 and len(trace.conversations) == 32
    assert len({c.system_id for c in trace.conversations}) == 1
    for c in trace.conversations:
        prompts = c.prompt_lengths()
        assert prompts[0] == 8000 and prompts[-1] == 32000
        assert all(b > a for a, b in zip(prompts, prompts[1:]))
        assert 8 <= len(c.turns) <= 16
        assert all(16 <= t.output_tokens <= 128 for t in c.turns)
        assert c.turns[0].user_tokens == 8000 - c.system_tokens >= 5000  # documents up front
        assert all(t.user_tokens >= 64 for t in c.turns[1:])  # tool outputs
        assert prompts[-1] + c.turns[-1].output_tokens <= 32768


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"conversations": 4, "concurrency": 8}, "concurrency must not exceed"),
        ({"last_prompt_tokens": 9000}, "last_prompt_tokens - first_prompt_tokens"),
        ({"last_prompt_tokens": 32700}, "max_context_tokens"),
        ({"min_turns": 1}, "min_turns"),
        ({"first_prompt_tokens": 1000}, "system prompt"),
    ],
)
def test_agent_rejects_impossible_parameters(params: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        agent(0, **params)


# --- registry -------------------------------------------------------------------------


def test_registry_names_and_dispatch() -> None:
    assert set(GENERATORS) == {
        "note2", "sharegpt_like", "agent", "field", "sglang_gsp", "llmd_shared_prefix",
        "llmd_shared_prefix_ladder", "inference_perf_shared_prefix", "vllm_multiturn",
        "blis_multiturn",
    }
    assert generate("note2", 0, chats=2, turns=3) == note2(0, chats=2, turns=3)


def test_unknown_generator_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*\['agent', 'blis_multiturn', 'field', .*'note2', .*'sharegpt_like', 'vllm_multiturn'\]"):
        generate("nope", 0)


def test_unknown_parameter_lists_valid_parameters() -> None:
    with pytest.raises(ValueError, match=r"\['chatz'\].*'note2'.*valid:.*'chats'.*'turns'"):
        generate("note2", 0, chatz=3)


@pytest.mark.parametrize(
    ("name", "params", "fragment"),
    [
        ("note2", {"chats": 0}, "chats"),
        ("note2", {"turns": "6"}, "turns"),
        ("sharegpt_like", {"rate_per_s": 0}, "rate_per_s"),
        ("sharegpt_like", {"tokens_per_word": -1.0}, "tokens_per_word"),
        ("agent", {"think_s_mean": float("nan")}, "think_s_mean"),
    ],
)
def test_bad_parameter_values_name_the_parameter(name: str, params: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        generate(name, 0, **params)


def test_negative_seed_rejected() -> None:
    with pytest.raises(ValueError, match="seed"):
        note2(-1)


# --- trace validation -----------------------------------------------------------------


def tiny(**changes) -> Trace:
    conv = Conversation("a", "s", 10, (Turn(5, 3), Turn(4, 2, 1.5)), 0.25)
    base = Trace("tiny", "open", (conv, replace(conv, id="b", arrival_s=1.0)), None, {"k": [1, 2]})
    return replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"mode": "closed", "concurrency": 3}, "concurrency"),
        ({"concurrency": 1}, "open-loop"),
        ({"mode": "burst"}, "mode"),
        ({"conversations": ()}, "no conversations"),
    ],
)
def test_trace_validate_rejects(changes: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        tiny(**changes).validate()


def test_trace_validate_rejects_bad_conversations() -> None:
    good = tiny().conversations[0]
    cases = {
        "duplicate": (good, good),
        "no turns": (replace(good, turns=()),),
        "output_tokens": (replace(good, turns=(Turn(1, 0),)),),
        "think_s": (replace(good, turns=(Turn(1, 1, -1.0),)),),
        "shared prompt": (good, replace(good, id="z", system_tokens=11)),
    }
    for fragment, convs in cases.items():
        with pytest.raises(ValueError, match=fragment):
            tiny(conversations=convs).validate()


# --- tables and parquet ---------------------------------------------------------------


def test_frame_has_one_row_per_turn() -> None:
    frame = trace_to_frame(tiny())
    assert list(frame.columns) == [
        "conversation", "system_id", "system_tokens", "arrival_s", "turn",
        "user_tokens", "output_tokens", "think_s",
    ]
    assert frame["turn"].tolist() == [0, 1, 0, 1]
    assert frame["conversation"].tolist() == ["a", "a", "b", "b"]
    assert str(frame["user_tokens"].dtype) == "int64" and str(frame["think_s"].dtype) == "float64"


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_parquet_round_trip_is_exact(tmp_path, name: str) -> None:
    trace = generate(name, 8, **SMALL[name])
    path = write_trace(trace, tmp_path / "sub" / "t.parquet")
    back = read_trace(path)
    assert back == trace
    assert type(back.conversations[0].turns[0].user_tokens) is int


def test_round_trip_keeps_float_times_exactly(tmp_path) -> None:
    trace = sharegpt_like(1, conversations=40, think_s_mean=3.3)
    assert read_trace(write_trace(trace, tmp_path / "t.parquet")) == trace


def test_frame_rows_may_come_in_any_order() -> None:
    trace = tiny()
    shuffled = trace_to_frame(trace).iloc[[1, 0, 3, 2]]
    assert trace_from_frame(shuffled, "tiny", "open", None, {"k": [1, 2]}) == trace


def test_frame_with_a_turn_gap_is_rejected() -> None:
    frame = trace_to_frame(tiny())
    frame.loc[1, "turn"] = 2
    with pytest.raises(ValueError, match="turns"):
        trace_from_frame(frame, "tiny", "open")


def test_frame_missing_column_is_named() -> None:
    with pytest.raises(ValueError, match="think_s"):
        trace_from_frame(trace_to_frame(tiny()).drop(columns="think_s"), "tiny", "open")


def test_meta_that_json_would_change_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="meta"):
        write_trace(tiny(meta={"k": (1, 2)}), tmp_path / "t.parquet")
    assert list(tmp_path.iterdir()) == []


def test_write_is_atomic(tmp_path, monkeypatch) -> None:
    path = tmp_path / "t.parquet"
    write_trace(tiny(), path)
    before = path.read_bytes()

    def broken(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(trace_io.pq, "write_table", broken)
    with pytest.raises(OSError, match="disk full"):
        write_trace(note2(0, chats=2), path)
    assert path.read_bytes() == before  # the old file is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temp file left
    with pytest.raises(OSError):
        write_trace(note2(0, chats=2), tmp_path / "new.parquet")
    assert not (tmp_path / "new.parquet").exists()


def test_plain_parquet_is_not_a_trace(tmp_path) -> None:
    pq.write_table(pa.Table.from_pandas(pd.DataFrame({"x": [1]})), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="not a kvroute trace"):
        read_trace(tmp_path / "x.parquet")


turns_st = st.builds(
    Turn,
    st.integers(0, 10**6),
    st.integers(1, 10**6),
    st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
)
conversations_st = st.lists(
    st.tuples(st.sampled_from(["s0", "s1", ""]), st.lists(turns_st, min_size=1, max_size=4),
              st.floats(0, 1e9, allow_nan=False, allow_infinity=False)),
    min_size=1,
    max_size=5,
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(convs=conversations_st, closed=st.booleans())
def test_round_trip_property(tmp_path, convs, closed) -> None:
    sizes = {"s0": 0, "s1": 77, "": 5}
    conversations = tuple(
        Conversation(f"c{i}", sid, sizes[sid], tuple(turns), arrival)
        for i, (sid, turns, arrival) in enumerate(convs)
    )
    trace = Trace("prop", "closed" if closed else "open", conversations,
                  len(conversations) if closed else None, {"seed": 1, "x": [0.1, None, "y"]})
    assert read_trace(write_trace(trace, tmp_path / "p.parquet")) == trace


# --- explicit prompts (hash_ids) and replay arrivals: format version 2 ------------------


def recorded(**changes) -> Trace:
    """A replay trace with explicit prompts, as the Mooncake converter makes them."""
    a = Conversation("a", "", 0, (Turn(600, 5, 0.0, 0.5, (0, 1)), Turn(1030, 3, 0.0, 0.75, (0, 1, 2))), 0.5)
    b = Conversation("b", "", 0, (Turn(512, 1, 0.0, 0.5, (0,)),), 0.5)
    return replace(Trace("rec", "replay", (a, b), None, {"dataset": "x"}, 512), **changes)


def test_explicit_prompt_lengths_are_their_own() -> None:
    a = recorded().conversations[0]
    assert a.prompt_lengths() == [600, 1030] and a.prompt_tokens(1) == 1030
    assert recorded().explicit and not tiny().explicit


def test_version_2_round_trip_and_version_1_kept(tmp_path) -> None:
    path = write_trace(recorded(), tmp_path / "r.parquet")
    assert read_trace(path) == recorded()
    meta = pq.read_schema(path).metadata
    header = json.loads(meta[trace_io.METADATA_KEY])
    assert header["format"] == 2 and header["block_tokens"] == 512
    assert pq.read_schema(path).names[-2:] == ["turn_arrival_s", "hash_ids"]
    plain = write_trace(tiny(), tmp_path / "p.parquet")  # nothing of version 2 in it: a version-1 file
    assert json.loads(pq.read_schema(plain).metadata[trace_io.METADATA_KEY])["format"] == 1
    assert pq.read_schema(plain).names == list(trace_io.COLUMNS)
    assert read_trace(plain) == tiny()


def test_unknown_format_version_is_refused(tmp_path) -> None:
    path = write_trace(tiny(), tmp_path / "p.parquet")
    table = pq.read_table(path)
    header = json.loads(table.schema.metadata[trace_io.METADATA_KEY])
    header["format"] = 3
    meta = {**table.schema.metadata, trace_io.METADATA_KEY: json.dumps(header).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(ValueError, match="format 3, this kvroute reads versions 1, 2"):
        read_trace(path)


def test_replay_mode_is_simulated_at_each_turns_arrival() -> None:
    from kvroute.hardware import load_hardware
    from kvroute.policies import make_policy
    from kvroute.sim.cluster import SimCluster

    rng = np.random.default_rng
    rows = SimCluster(recorded(), load_hardware("h100x8"), make_policy("round_robin", rng(0)), rng(1), True).run()
    assert sorted((r["conversation"], r["turn"], r["arrival_s"]) for r in rows) == [
        ("a", 0, 0.5), ("a", 1, 0.75), ("b", 0, 0.5)]
    assert {r["prompt_tokens"] for r in rows} == {600, 1030, 512}


def _turn(t: Turn, **changes) -> Turn:
    return replace(t, **changes)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda tr: replace(tr, block_tokens=None), "block_tokens must be an int >= 1"),
        (lambda tr: replace(tr, block_tokens=256), r"expected ceil\(600 / 256\) = 3"),
        (lambda tr: replace(tr, mode="open"), "for mode 'replay' only"),
        (lambda tr: replace(tiny(), block_tokens=512), "no turn has hash_ids"),
        (lambda tr: _conv(tr, system_tokens=10, system_id="s"), "system_id must be ''"),
        (lambda tr: _turn0(tr, hash_ids=(0,)), r"1 hash_ids for 600 tokens; expected ceil\(600 / 512\) = 2"),
        (lambda tr: _turn0(tr, hash_ids=(0, -1)), r"ints in \[0, 2\*\*63\)"),
        (lambda tr: _turn0(tr, hash_ids=None), "turn 0 has no hash_ids but a later turn has"),
        (lambda tr: _turn0(tr, hash_ids=[0, 1]), "must be a tuple"),
        (lambda tr: _turn0(tr, arrival_s=None), "replay mode needs arrival_s"),
        (lambda tr: _turn0(tr, arrival_s=0.9), "before turn 0's"),
        (lambda tr: _turn0(tr, think_s=1.0), "think_s must be 0"),
        (lambda tr: _conv(tr, arrival_s=0.0), "must equal its first turn's arrival_s"),
        (lambda tr: replace(tr, concurrency=2), "replay trace 'rec' takes no concurrency"),
    ],
)
def test_explicit_and_replay_fields_are_validated(change, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        change(recorded()).validate()


def _conv(tr: Trace, **changes) -> Trace:
    return replace(tr, conversations=(replace(tr.conversations[0], **changes), *tr.conversations[1:]))


def _turn0(tr: Trace, **changes) -> Trace:
    """Change the first conversation's turn 0 (the arrival check: 0.9 is after turn 1's 0.75)."""
    c = tr.conversations[0]
    turns = (replace(c.turns[0], **changes), *c.turns[1:])
    arrival = turns[0].arrival_s if turns[0].arrival_s is not None and "arrival_s" in changes else c.arrival_s
    return replace(tr, conversations=(replace(c, turns=turns, arrival_s=arrival), *tr.conversations[1:]))
