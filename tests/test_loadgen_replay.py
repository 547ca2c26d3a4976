"""Replaying a recorded trace (replay mode, prompts as hash_ids) against emulators over HTTP:
arrivals, prompt content per hash id, the scaling in every record, failures as rows.

The cache checks compare with a model written from ``hash_ids`` alone (as
tests/test_mooncake.py does for the simulator): with one request in the engine at a time
and a cache that keeps everything, request ``i`` hits ``floor(min(bound_i, P_i - 1) /
bs) * bs`` tokens, ``bound_i`` the longest token prefix its ids share with an earlier
prompt (``mooncake.reused_tokens``), ``bs`` the engine block. It holds on the emulator
only if equal leading ids are equal leading tokens there and nothing else is.
"""

from __future__ import annotations

import asyncio
import math

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.experiment import load_experiment
from kvroute.live import text
from kvroute.live.emulator import start_emulator
from kvroute.live.engines import free_ports
from kvroute.live.loadgen import records_for, replay, write_results
from kvroute.records import REQUEST_COLUMNS
from kvroute.sim.run import simulate_experiment
from kvroute.workload import mooncake as mc
from kvroute.workload.mooncake import Request
from kvroute.workload.trace import Conversation, Trace, Turn

BLOCK = 32  # the trace's block (512 / 16)
ENGINE_BLOCK = 128  # the cpu profile's, which the emulator keeps


def run(coro, timeout=60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def explicit_trace(requests: list[tuple[str, float, tuple[int, ...], int, int]], name="rec") -> Trace:
    """(conversation, arrival, hash_ids, prompt tokens, output tokens) per request, in time order."""
    turns: dict[str, list[Turn]] = {}
    for conv, at, ids, n, out in requests:
        turns.setdefault(conv, []).append(Turn(n, out, 0.0, at, ids))
    convs = tuple(Conversation(c, "", 0, tuple(ts), ts[0].arrival_s) for c, ts in turns.items())
    return Trace(name, "replay", convs, None, {"scaling": "tokens/16,time x1,window 0-1s"}, BLOCK).validate()


# a session (a) growing, another (b) sharing only the leading id 0, a third (c) forking off a's
# first turn, and a's partial last block (20 of 32 tokens) continued in full by its next turn
SHARING = [
    ("a", 0.00, (0, 1, 2, 3, 4, 5), 180, 4),
    ("b", 0.10, (0, 10, 11, 12, 13), 150, 4),
    ("a", 0.20, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9), 300, 4),
    ("c", 0.30, (0, 1, 2, 3, 4, 5, 20, 21), 250, 4),
    ("a", 0.40, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 30, 31, 32, 33), 440, 4),
    ("b", 0.50, (0, 10, 11, 12, 13, 40), 170, 4),
]


def expected_cached(reqs: list[tuple], head: int = 0, tail: int = 0) -> list[int]:
    """Per request: what one engine that keeps everything hits, from the ids alone
    (``head``, ``tail``: template tokens before and after the prompt, the same for all)."""
    bound = mc.reused_tokens([Request(0, n, out, ids) for _, _, ids, n, out in reqs], BLOCK)
    out = []
    for i, ((*_, n, _), b) in enumerate(zip(reqs, bound)):
        shared = head + b if i else 0  # the head is in every earlier prompt
        out.append(min(shared, head + n + tail - 1) // ENGINE_BLOCK * ENGINE_BLOCK)
    return out


def test_explicit_prompt_text_is_the_ids_blocks():
    a = text.explicit_prompt((5, 7, 9), 70, BLOCK)
    assert text.count_tokens(a) == len(a.split()) == 70
    assert a.startswith(" ") and "  " not in a  # every word after one space
    # equal leading ids: equal leading text, ending at a space before the next block's word
    b = text.explicit_prompt((5, 7, 11), 96, BLOCK)
    head = text.explicit_prompt((5, 7), 64, BLOCK)
    assert a.startswith(head) and b.startswith(head) and a[len(head)] == b[len(head)] == " "
    assert text.tokenize(a)[:64] == text.tokenize(b)[:64] != text.tokenize(a)[:65]
    # a partial block is a prefix of its id's full block; different ids share nothing
    assert text.block_text(9, 32, BLOCK).startswith(text.block_text(9, 6, BLOCK)) and a.endswith(text.block_text(9, 6, BLOCK))
    assert text.block_text(9, 32) != text.block_text(10, 32)
    with pytest.raises(ValueError, match="expected 3"):
        text.explicit_prompt((5, 7), 70, BLOCK)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_equal_hash_id_prefixes_are_equal_tokens_on_the_emulator(api):
    """Cached tokens on one emulator follow the ids alone: equal leading ids are equal
    leading tokens (partial blocks included), different ids share nothing, and the chat
    template's tokens (``<|im_start|>user``: 2) only shift every prompt alike."""
    trace = explicit_trace(SHARING)

    async def main():
        async with await start_emulator("cpu", 0, time_scale=0) as emu:
            return await replay(trace, emu.url, explicit_api=api, progress_every_s=None)

    rows = run(main())
    assert [r["status"] for r in rows] == ["ok"] * len(SHARING)
    head, tail = (0, 0) if api == "completions" else (2, 3)  # <|im_start|> user | <|im_end|> <|im_start|> assistant
    assert [r["prompt_tokens"] for r in rows] == [head + n + tail for *_, n, _ in SHARING]
    cached = [r["cached_tokens"] for r in rows]
    assert cached == expected_cached(SHARING, head, tail) == [0, 0, 128, 128, 256, 128]
    assert [r["conversation"] for r in rows] == [c for c, *_ in SHARING]
    assert [r["turn"] for r in rows] == [0, 0, 1, 0, 2, 1]


def test_replay_sends_each_turn_at_its_arrival_without_waiting_for_replies():
    # turn 1 of "a" is due while turn 0's 100-token reply is still streaming
    trace = explicit_trace([("a", 0.0, (0, 1), 40, 100), ("b", 0.1, (0, 2), 40, 8), ("a", 0.2, (0, 1, 3), 70, 8),
                            ("c", 0.35, (5,), 10, 8)])

    async def main():
        async with await start_emulator("cpu", 0, time_scale=1.0) as emu:
            return await replay(trace, emu.url, progress_every_s=None)

    rows = run(main())
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    due = {(c.id, k): t.arrival_s for c in trace.conversations for k, t in enumerate(c.turns)}
    for r in rows:
        at = due[(r["conversation"], r["turn"])]
        assert at <= r["arrival_s"] < at + 0.1  # on time (a loaded 2-core machine ran 68 ms late once)
    first, second = (r for r in rows if r["conversation"] == "a")
    assert second["arrival_s"] < first["finish_s"]  # open loop: not after the previous reply
    assert first["output_tokens"] == 100


def test_request_limit_takes_the_first_by_arrival_and_implicit_replay_is_refused():
    trace = explicit_trace(SHARING)

    async def main():
        async with await start_emulator("cpu", 0, time_scale=0) as emu:
            return await replay(trace, emu.url, max_requests=3, progress_every_s=None)

    rows = run(main())
    assert [(r["conversation"], r["turn"]) for r in rows] == [("a", 0), ("b", 0), ("a", 1)]
    implicit = Trace("imp", "replay", (Conversation("x", "", 0, (Turn(10, 4, 0.0, 0.0), Turn(10, 4, 0.0, 1.0)), 0.0),))
    with pytest.raises(ValueError, match="hash_ids"):
        run(replay(implicit.validate(), "http://127.0.0.1:1", model="m"))
    with pytest.raises(ValueError, match="explicit_api"):
        run(replay(trace, "http://127.0.0.1:1", model="m", explicit_api="raw"))


def test_explicit_prompts_in_a_closed_loop_wait_for_the_previous_reply():
    """Outside replay mode an explicit turn is paced like any other (after the previous
    reply plus think time), and still sent as its own blocks, without history."""
    conv = Conversation("x", "", 0, (Turn(40, 30, 0.0, None, (0, 1)), Turn(70, 4, 0.05, None, (0, 1, 2))))
    trace = Trace("closed-explicit", "closed", (conv,), 1, {}, BLOCK).validate()

    async def main():
        async with await start_emulator("cpu", 0, time_scale=0.2) as emu:
            return await replay(trace, emu.url, progress_every_s=None)

    first, second = run(main())
    assert (first["prompt_tokens"], second["prompt_tokens"]) == (40, 70)  # no history, no template
    assert second["arrival_s"] >= first["finish_s"] + 0.05


def test_failed_requests_are_rows_labelled_with_the_scaling(tmp_path):
    trace = explicit_trace(SHARING)
    (port,) = free_ports(1)  # nothing listens here
    rows = run(replay(trace, f"http://127.0.0.1:{port}", model="m", progress_every_s=None))
    assert len(rows) == len(SHARING) and {r["status"] for r in rows} == {"error:connect"}
    assert [r["prompt_tokens"] for r in rows] == [n for *_, n, _ in SHARING]  # the expected counts
    recs = records_for(rows, source="live", experiment="e", hardware="cpu", policy="p", round=0,
                       scaling=trace.meta["scaling"])
    write_results(recs, tmp_path)
    table = pq.read_table(tmp_path / "requests.parquet")
    assert table.column_names == list(REQUEST_COLUMNS)
    assert set(table.column("scaling").to_pylist()) == {"tokens/16,time x1,window 0-1s"}
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert summary.loc[0, "scaling"] == "tokens/16,time x1,window 0-1s" and summary.loc[0, "errors"] == len(SHARING)


def test_a_scaled_mooncake_window_through_the_gateway_on_emulators(tmp_path):
    """`kvroute measure` on emulated cpu workers: the scaled window's every request is a
    row with its own prompt size and the trace's scaling label, the summary says it too,
    kv_aware keeps sessions' prefixes where round_robin loses some, and the simulator's
    records of the same experiment carry the same label (like for like)."""
    params = {"name": "conversation", "start_s": 0, "duration_s": 600, "speedup": 40, "token_scale": 16,
              "max_input_tokens": 1024, "max_output_tokens": 8, "session_fraction": 0.1, "max_requests": 40}
    raw = {"name": "mc-emu", "seed": 1, "rounds": 1, "view": "approx",
           "workload": {"dataset": "mooncake", "params": params},
           "runs": [{"hardware": "cpu", "policies": ["kv_aware", "round_robin"]}]}
    exp_path = tmp_path / "mc.yaml"
    exp_path.write_text(yaml.safe_dump(raw))
    trace = mc.mooncake_trace(**params)
    label = trace.meta["scaling"]
    assert label == "tokens/16,input<=1024,output<=8,time x40,window 0-600s,sessions 0.1,first 40"
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["measure", str(exp_path), "--hardware", "cpu", "--engine", "emulator",
                                    "--time-scale", "0.2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"trace scaled: {label}" in res.output
    df = pd.read_parquet(out / "requests.parquet")
    assert len(df) == 2 * 40 and (df.status == "ok").all() and (df.scaling == label).all()
    size = {(c.id, k): t.user_tokens for c in trace.conversations for k, t in enumerate(c.turns)}
    assert all(r.prompt_tokens == size[(r.conversation, r.turn)] for r in df.itertuples())  # completions: no template
    summary = pd.read_csv(out / "summary.csv").set_index("policy")
    assert (summary.scaling == label).all()
    assert summary.loc["kv_aware", "hit_rate"] > summary.loc["round_robin", "hit_rate"] > 0
    simulate_experiment(load_experiment(exp_path), tmp_path / "sim")
    assert set(pd.read_parquet(tmp_path / "sim/requests.parquet").scaling) == {label}
