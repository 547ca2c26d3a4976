"""Conversation token streams hash exactly as the documented content rule says."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.kvcache.hashing import ROOT_HASH, block_hash
from kvroute.sim.stream import ConversationStream


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
       partial=st.booleans())
def test_incremental_chain_equals_reference(system, bs, turns, partial):
    s = ConversationStream("sys", system, bs)
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
