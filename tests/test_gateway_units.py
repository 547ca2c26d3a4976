"""Gateway parts without sockets: prompt digests, the view's counters, the memory session table."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.live.gateway import parse_worker
from kvroute.live.prefix import CHAT_PATH, COMPLETIONS_PATH, PrefixHasher, PromptError, chat_text
from kvroute.live.sessions import SessionStore
from kvroute.live.view import ExcludingView, GatewayView
from kvroute.policies import make_policy
from kvroute.policies.base import RouteRequest

import numpy as np


def chat(*turns: str, system: str = "You are helpful.") -> dict:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": msgs}


# -- prefix.py ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=600), st.text(max_size=300), st.integers(1, 80))
def test_hashes_of_an_extended_text_start_with_the_text_hashes(a, b, block_chars):
    h = PrefixHasher(block_chars)
    short, long = h.block_hashes(a), h.block_hashes(a + b)
    assert len(short) == len(a) // block_chars  # full chunks only
    assert long[: len(short)] == short


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400), st.integers(1, 80))
def test_block_hashes_are_the_simulators_chained_hashes_of_the_chunks(text, block_chars):
    from kvroute.kvcache.hashing import chain_hashes, text_key

    n = block_chars
    reference = chain_hashes((text_key(text[i : i + n]),) for i in range(0, len(text) - n + 1, n))
    assert PrefixHasher(n).block_hashes(text) == reference
    ascii_text = text.encode("ascii", "replace").decode()
    reference = chain_hashes((text_key(ascii_text[i : i + n]),) for i in range(0, len(text) - n + 1, n))
    assert PrefixHasher(n).block_hashes(ascii_text) == reference


def test_a_later_chat_turn_extends_the_earlier_turn():
    h = PrefixHasher(64)
    sys_prompt = "S" * 1000
    t1 = h.digest(CHAT_PATH, chat("hello " * 30, system=sys_prompt))
    t2 = h.digest(CHAT_PATH, chat("hello " * 30, "reply " * 40, "more " * 20, system=sys_prompt))
    assert t1.turn == 0 and t2.turn == 1
    assert t2.block_hashes[: len(t1.block_hashes)] == t1.block_hashes
    assert len(t2.block_hashes) > len(t1.block_hashes)
    other = h.digest(CHAT_PATH, chat("hello " * 30, system="T" * 1000))
    assert other.block_hashes[0] != t1.block_hashes[0]


def test_token_estimate_and_block_tokens():
    h = PrefixHasher(64, 4.0)
    assert h.block_tokens == 16
    assert h.estimate_tokens("x" * 401) == 101
    assert PrefixHasher(128, 4.0).block_tokens == 32
    d = h.digest(COMPLETIONS_PATH, {"prompt": "y" * 200})
    assert d.prompt_tokens == 50 and len(d.block_hashes) == 3 and d.turn == 0
    assert h.digest(COMPLETIONS_PATH, {"prompt": ["ab", "cd"]}).text == "abcd"


def test_hashes_are_stable_across_processes():
    # text_key is CRC-32 and the chain hashes tuples of ints: no PYTHONHASHSEED salt
    import subprocess
    import sys

    code = "from kvroute.live.prefix import PrefixHasher; print(PrefixHasher(64).block_hashes('z' * 300))"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONHASHSEED": str(seed)}, check=True).stdout
        for seed in (1, 2)
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str(PrefixHasher(64).block_hashes("z" * 300))


@pytest.mark.parametrize(
    "path, body, needle",
    [
        (CHAT_PATH, {"model": "m"}, "'messages'"),
        (CHAT_PATH, {"messages": []}, "'messages'"),
        (CHAT_PATH, {"messages": ["hi"]}, "messages[0]"),
        (CHAT_PATH, {"messages": [{"content": "hi"}]}, "'role'"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": 3}]}, "'content'"),
        (COMPLETIONS_PATH, {"model": "m"}, "'prompt'"),
    ],
)
def test_bad_prompts_are_named(path, body, needle):
    with pytest.raises(PromptError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        PrefixHasher().digest(path, body)


def test_content_parts_are_joined():
    text, turn = chat_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert text == "<|user|>ab" and turn == 0


def test_parse_worker():
    assert parse_worker("http://127.0.0.1:8001/") == ("http://127.0.0.1:8001", "http://127.0.0.1:8001")
    assert parse_worker("w0=http://127.0.0.1:8001") == ("w0", "http://127.0.0.1:8001")
    with pytest.raises(ValueError, match="http"):
        parse_worker("127.0.0.1:8001")


# -- view.py -----------------------------------------------------------------------


def request(prompt_tokens: int, hashes=(), session="s") -> RouteRequest:
    return RouteRequest("r", session, 0, prompt_tokens, tuple(hashes))


def test_a_full_batch_adds_a_slot_wait_to_the_queue_delay():
    """With max_num_seqs running, a new request waits for replies of the worker's mean
    length so far; a fully cached prompt no longer makes a full worker look free, so
    cost_aware spreads chats that share a system prompt."""
    v = GatewayView([("a", "http://a"), ("b", "http://b")], 16, prefill_s_per_token=1e-3,
                    decode_s_per_running=0.0, max_num_seqs=2, decode_step_s=0.02)
    done = v.begin("a", request(32), 32)
    v.first_byte(done)
    v.add_output(done, 30)
    v.finish(done)  # the worker's mean reply: 30 tokens
    flights = [v.begin("a", request(32), 32) for _ in range(3)]
    for f in flights[:2]:
        v.first_byte(f)
    # 3 in flight, cap 2: one wave of 30 tokens at 20 ms
    assert v.queue_delay_s("a") == pytest.approx(30 * 0.02)
    assert v.queue_delay_s("b") == 0.0
    flights.append(v.begin("a", request(32), 32))  # 4 in flight: the new one waits one wave too
    assert v.queue_delay_s("a") == pytest.approx(2 * 30 * 0.02)
    capped = v.delays
    v.delays = dataclasses.replace(capped, max_num_seqs=None)  # without the cap the estimate has no slot wait
    assert v.queue_delay_s("a") == 0.0
    v.delays = capped
    cost = make_policy("cost_aware:alpha=1.0", np.random.default_rng(0))
    shared = request(64, hashes=[1, 2, 3, 4])
    v.snapshot()
    v.record("a", shared)  # a holds the shared prefix, b nothing; a's full batch outweighs it
    assert cost.choose(request(64, hashes=[1, 2, 3, 4], session="new"), v) == "b"


def test_view_counters_follow_a_request_through_its_life():
    t = [0.0]
    v = GatewayView([("a", "http://a"), ("b", "http://b")], 16, clock=lambda: t[0],
                    prefill_s_per_token=1e-3, decode_s_per_running=0.01)
    req = request(100, hashes=[11, 12, 13])
    v.snapshot()
    v.record("a", req)
    assert v.matched_tokens("a", req) == 48 and v.matched_tokens("b", req) == 0
    assert v.index_size("a") == 3
    f = v.begin("a", req, matched_tokens=48)
    assert (v.in_flight("a"), v.waiting("a"), v.active_blocks("a")) == (1, 1, 7)
    assert v.queue_delay_s("a") == pytest.approx(52e-3)  # uncached 52 tokens, none running
    v.first_byte(f)
    assert (v.waiting("a"), v.queue_delay_s("a")) == (0, pytest.approx(0.01))
    v.add_output(f, 12)  # 112 tokens -> 7 blocks
    assert v.active_blocks("a") == 7
    v.add_output(f, 1)  # 113 -> 8
    assert v.active_blocks("a") == 8
    v.finish(f)
    v.finish(f)  # idempotent
    assert (v.in_flight("a"), v.waiting("a"), v.active_blocks("a"), v.queue_delay_s("a")) == (0, 0, 0, 0)
    # a request that ends before its first byte
    f2 = v.begin("b", request(10), 0)
    v.finish(f2)
    assert v.state["b"].waiting_uncached_tokens == 0 and v.in_flight("b") == 0
    assert v.prefill_time_s("a", 1000) == pytest.approx(1.0)


def test_matched_tokens_are_capped_at_the_prompt_estimate():
    v = GatewayView([("a", "http://a")], 16)
    req = request(20, hashes=[1, 2])
    v.snapshot()
    v.record("a", req)
    assert v.matched_tokens("a", req) == 20


def test_mark_down_empties_the_index_and_policies_avoid_the_worker():
    v = GatewayView([("a", "http://a"), ("b", "http://b")], 16)
    req = request(64, hashes=[1, 2, 3, 4])
    v.snapshot()
    v.record("a", req)
    kv = make_policy("kv_aware", np.random.default_rng(0))
    assert kv.choose(req, v) == "a"
    assert v.mark_down("a") and not v.mark_down("a")
    assert v.index_size("a") == 0 and not v.is_up("a")
    assert kv.choose(req, v) == "b"
    assert v.mark_up("a") and v.is_up("a")
    assert make_policy("round_robin", np.random.default_rng(0)).choose(req, ExcludingView(v, ["a"])) == "b"


def test_duplicate_worker_names_are_rejected():
    with pytest.raises(ValueError, match="twice"):
        GatewayView([("a", "http://x"), ("a", "http://y")], 16)


# -- sessions.py (memory only; Redis in test_gateway.py) ---------------------------


def test_memory_session_table_has_a_ttl_and_a_bound():
    t = [0.0]
    s = SessionStore(None, ttl_s=10.0, max_memory=2, clock=lambda: t[0])
    s.set("x", "a")
    s.set("y", "b")
    assert s.peek("x") == "a" and asyncio.run(s.get("y")) == "b"
    t[0] = 10.5
    assert s.peek("x") is None
    s.set("x", "a")
    s.set("y", "b")
    s.set("z", "c")  # beyond max_memory: the least recently written goes
    assert s.peek("x") is None and s.peek("z") == "c"
    assert not s.redis_up and s.pending_writes == 0
