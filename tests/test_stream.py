"""Conversation token streams hash exactly as the documented content rule says."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.hardware import ChatTemplate, load_model
from kvroute.kvcache.hashing import ROOT_HASH, block_hash
from kvroute.sim.stream import ConversationStream

CHATML = ChatTemplate(system_open=3, system_close=2, user_open=3, user_close=2, generation_prompt=3, assistant_close=2)


def reference_chain(stream: ConversationStream) -> list[int]:
    """Token by token: a block's content is its (key..., start, end) runs, chained."""
    tokens = [(key, j) for key, length in stream.segments for j in range(length)]
    bs, out, parent = stream.block_size, [], ROOT_HASH
    for b in range(len(tokens) // bs):
        block, content, j = tokens[b * bs : (b + 1) * bs], [], 0
        while j < len(block):
            key, start = block[j]
            k = j
            while k + 1 < len(block) and block[k + 1][0] == key:
                k += 1
            content += [*key, start, block[k][1] + 1]
            j = k + 1
        parent = block_hash(parent, tuple(content))
        out.append(parent)
    return out


@settings(max_examples=60, deadline=None)
@given(system=st.integers(0, 300), bs=st.sampled_from([4, 16, 128]),
       turns=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 70)), min_size=1, max_size=6),
       partial=st.booleans(), templated=st.booleans())
def test_incremental_chain_equals_reference(system, bs, turns, partial, templated):
    s = ConversationStream("sys", system, bs, CHATML if templated else ChatTemplate())
    for k, (user, reply) in enumerate(turns):
        s.add_user(7, k, user)
        prompt = s.length
        s.add_assistant(7, k, reply)
        got = s.chain(prompt if partial else prompt + reply)  # chains grow in uneven steps
        assert got == reference_chain(s)[: len(got)]
    assert s.chain(s.length) == reference_chain(s)


def test_shared_system_prompt_hashes_alike_across_conversations():
    a, b = ConversationStream("sys", 800, 16), ConversationStream("sys", 800, 16)
    a.add_user(1, 0, 200)
    b.add_user(2, 0, 200)
    ha, hb = a.chain(1000), b.chain(1000)
    assert ha[:50] == hb[:50] and ha[50] != hb[50]


@settings(max_examples=60, deadline=None)
@given(bs=st.sampled_from([4, 16, 48, 128, 512, 1000]), block=st.sampled_from([8, 64, 512]),
       ids=st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True), cut=st.integers(0, 511),
       reply=st.integers(1, 90))
def test_explicit_blocks_chain_equals_reference(bs, block, ids, cut, reply):
    n = block * len(ids) - cut % block  # the last block partial (or full when cut % block == 0)
    s = ConversationStream("", 0, bs)
    s.add_blocks(tuple(ids), n, block)
    s.add_assistant(3, 0, reply)
    assert s.length == n + reply
    assert s.chain(s.length) == reference_chain(s)


@pytest.mark.parametrize("bs", [1, 16, 48, 100, 512, 1024])
def test_equal_leading_ids_hash_alike_at_any_block_size(bs):
    """Prompts [7, 8, 9, 6] and [7, 8, 4, 6] share 1,024 tokens; [7, 8] cut at 700 tokens
    is a prefix of both (its partial block is a prefix of id 8's content)."""
    def chain(ids, n):
        s = ConversationStream("", 0, bs)
        s.add_blocks(ids, n, 512)
        s.add_assistant(len(ids), 0, 5)  # a reply of its own after each prompt
        return s.chain(n)

    a, b, c = chain((7, 8, 9, 6), 2048), chain((7, 8, 4, 6), 2048), chain((7, 8), 700)
    shared = 1024 // bs
    assert a[:shared] == b[:shared] and len(a) > shared
    assert all(x != y for x, y in zip(a[shared:], b[shared:]))  # chained: nothing after the first difference
    assert c == a[: 700 // bs] == b[: 700 // bs]


def test_add_blocks_checks_the_count():
    with pytest.raises(ValueError, match="3 hash_ids for 1024 tokens"):
        ConversationStream("", 0, 16).add_blocks((1, 2, 3), 1024, 512)


def test_the_chat_template_adds_its_tokens_around_every_message():
    t = load_model("tiny-qwen2").chat_template
    s = ConversationStream("sys", 800, 128, t)
    s.add_user(0, 0, 100)
    assert s.length == t.system_open + 800 + t.system_close + t.user_open + 100 + t.user_close + t.generation_prompt
    first = s.length
    s.add_assistant(0, 0, 32)
    s.add_user(0, 1, 100)
    assert s.length - first == 32 + t.assistant_close + t.user_open + 100 + t.user_close + t.generation_prompt
    plain = ConversationStream("sys", 800, 128)
    plain.add_user(0, 0, 100)
    assert plain.length == 900  # no template: the trace's counts are the prompt


def test_template_tokens_share_blocks_like_the_text_they_are():
    """The system prompt with its template is one prefix across conversations; the
    template's tokens after it are the same text too, so the user message is where they part."""
    a, b = ConversationStream("sys", 800, 16, CHATML), ConversationStream("sys", 800, 16, CHATML)
    a.add_user(1, 0, 200)
    b.add_user(2, 0, 200)
    shared = (3 + 800 + 2 + 3) // 16  # full blocks before the first user token
    ha, hb = a.chain(a.length), b.chain(b.length)
    assert ha[:shared] == hb[:shared] and ha[shared] != hb[shared]
