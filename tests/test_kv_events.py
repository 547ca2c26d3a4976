"""Unit tests of the KV-event decoder, the exact index, the subscriber and the tokenizers.

Events are encoded with msgspec structs declared exactly as vLLM 0.32.0 declares them
(vllm/distributed/kv_events.py: required fields without defaults, tagged maps inside an
array-like batch), so the decoder is tested against vLLM's wire format, not its own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
import zmq

from kvroute.kvcache.hashing import chain_hashes, token_blocks
from kvroute.live import text
from kvroute.live.engines import free_ports
from kvroute.live.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExactPrefixIndex,
    HFChatTokenizer,
    KVEventPublisher,
    KVEventSubscriber,
    WordChatTokenizer,
    chain_hashes_of,
    decode_batch,
    engine_binds,
    request_ids,
)

BS = 4


# -- vLLM's structs, as declared in vllm/distributed/kv_events.py -----------------------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


ENC = msgspec.msgpack.Encoder()


def vstored(hashes, parent, tokens, bs=BS):
    return VBlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens), block_size=bs,
                        lora_id=None, medium="GPU", lora_name=None, group_idx=0)


def vbatch(*events) -> bytes:
    return ENC.encode(VKVEventBatch(ts=1.0, events=list(events), data_parallel_rank=0))


def test_vllm_structs_are_tagged_maps_in_an_array():
    raw = msgspec.msgpack.decode(vbatch(vstored([7], None, [1, 2, 3, 4]), VAllBlocksCleared()))
    assert raw[0] == 1.0 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["token_ids"] == [1, 2, 3, 4]
    assert raw[1][1] == {"type": "AllBlocksCleared"}


def test_decode_vllm_batch():
    payload = vbatch(vstored([b"\x01" * 32, 2], None, range(8)), VBlockRemoved(block_hashes=[2], medium="GPU"),
                     VAllBlocksCleared())
    events, skipped = decode_batch(payload)
    assert skipped == 0
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert events[0].block_hashes == [b"\x01" * 32, 2] and events[0].token_ids == list(range(8))
    assert events[0].parent_block_hash is None and events[0].block_size == BS


def test_unknown_event_types_are_skipped_not_the_batch():
    raw = [1.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                  "block_size": 4, "lora_id": None, "medium": None, "lora_name": None},
                 {"type": "SomethingNew", "x": 1}], 0]
    events, skipped = decode_batch(msgspec.msgpack.encode(raw))
    assert skipped == 1 and type(events[0]) is BlockStored
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1 not msgpack")


def test_chain_hashes_match_the_simulators():
    ids = list(range(100, 123))
    assert chain_hashes_of(ids, BS) == chain_hashes(token_blocks(ids, BS))
    assert chain_hashes_of(ids, BS, limit_blocks=2) == chain_hashes(token_blocks(ids, BS))[:2]
    assert text.block_hashes(ids, BS) == chain_hashes_of(ids, BS)


def test_index_keys_blocks_by_token_chain_not_engine_hash():
    idx = ExactPrefixIndex(["w0", "w1"], BS)
    a = list(range(12))  # three blocks
    # stored in two events: the second chains on the first's last engine hash
    idx.apply("w0", decode_batch(vbatch(vstored([111, 222], None, a[:8])))[0])
    idx.apply("w0", decode_batch(vbatch(vstored([333], 222, a[8:12])))[0])
    req = chain_hashes_of(a + [99, 98], BS)
    assert idx.match("w0", req) == 3 and idx.match("w1", req) == 0
    assert idx.size("w0") == 3
    # the same tokens under other (salted) engine hashes on w1 give the same chain
    idx.apply("w1", decode_batch(vbatch(vstored([9, 8, 7], None, a)))[0])
    assert idx.match("w1", req) == 3
    # another prefix diverging in block 2 matches one block
    other = chain_hashes_of(a[:4] + [50, 51, 52, 53] + a[8:], BS)
    assert idx.match("w0", other) == 1


def test_removal_and_clear():
    idx = ExactPrefixIndex(["w0"], BS)
    a = list(range(12))
    idx.apply("w0", [BlockStored([1, 2, 3], None, a, BS)])
    req = chain_hashes_of(a, BS)
    idx.apply("w0", [BlockRemoved([3])])  # tail evicted
    assert idx.match("w0", req) == 2
    idx.apply("w0", [BlockRemoved([1])])  # head evicted: the match stops at the first miss
    assert idx.match("w0", req) == 0 and idx.size("w0") == 1
    idx.apply("w0", [BlockRemoved([12345])])  # unknown: ignored
    idx.apply("w0", [AllBlocksCleared()])
    assert idx.size("w0") == 0 and idx.workers["w0"].cleared == 1
    assert not idx.workers["w0"].chain_of


def test_duplicate_blocks_are_refcounted():
    """Two blocks holding one hash (computed concurrently): one removal leaves it cached."""
    idx = ExactPrefixIndex(["w0"], BS)
    a = [5, 6, 7, 8]
    idx.apply("w0", [BlockStored([1], None, a, BS), BlockStored([1], None, a, BS)])
    idx.apply("w0", [BlockRemoved([1])])
    assert idx.match("w0", chain_hashes_of(a, BS)) == 1
    idx.apply("w0", [BlockRemoved([1])])
    assert idx.match("w0", chain_hashes_of(a, BS)) == 0


def test_orphans_partial_blocks_and_other_sizes_are_skipped():
    idx = ExactPrefixIndex(["w0"], BS)
    idx.apply("w0", [BlockStored([9], 404, [1, 2, 3, 4], BS)])  # parent never seen
    idx.apply("w0", [BlockStored([8], None, [1, 2], 2)])  # a partial block (vLLM's hybrid models)
    idx.apply("w0", [BlockStored([7], None, [1, 2, 3, 4, 5], BS)])  # tokens do not fill the blocks
    w = idx.workers["w0"]
    assert idx.size("w0") == 0 and w.orphans == 1 and w.skipped == 2


def test_engine_bind_rule_is_vllms():
    assert not engine_binds("tcp://127.0.0.1:5557")
    assert engine_binds("tcp://*:5557") and engine_binds("ipc:///tmp/x") and engine_binds("inproc://x")


# -- subscriber over real ZMQ sockets -----------------------------------------------------------


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def test_subscriber_binds_and_applies_in_order():
    port = free_ports(1)[0]
    ep = f"tcp://127.0.0.1:{port}"

    async def body():
        idx = ExactPrefixIndex(["w0"], BS)
        sub = KVEventSubscriber(idx, {"w0": ep}, topic="kv@w0")
        await sub.start()
        # the engine's side: vLLM connects to an endpoint without '*'
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(ep)
        try:
            assert await sub.wait_connected(5.0) == []  # and the subscription has reached the publisher
            a = list(range(8))
            for seq, payload in enumerate([vbatch(vstored([1, 2], None, a)), vbatch(VBlockRemoved([2], "GPU"))]):
                pub.send_multipart([b"kv@w0", seq.to_bytes(8, "big"), payload])
            pub.send_multipart([b"other", (2).to_bytes(8, "big"), vbatch(VAllBlocksCleared())])  # not our topic
            await until(lambda: idx.workers["w0"].batches == 2)
            assert idx.match("w0", chain_hashes_of(a, BS)) == 1
            # a lost batch (seq 2 never comes) is counted; a restarted engine (seq back to 0) empties the index
            pub.send_multipart([b"kv@w0", (3).to_bytes(8, "big"), vbatch(vstored([5], None, [9, 9, 9, 9]))])
            await until(lambda: idx.workers["w0"].batches == 3)
            assert idx.workers["w0"].gaps == 1 and idx.size("w0") == 2
            pub.send_multipart([b"kv@w0", (0).to_bytes(8, "big"), vbatch(vstored([6], None, [7, 7, 7, 7]))])
            await until(lambda: idx.workers["w0"].batches == 4)
            assert idx.workers["w0"].restarts == 1 and idx.size("w0") == 1
        finally:
            pub.close(linger=0)
            ctx.term()
            await sub.stop()

    run(body())


def test_subscriber_replays_a_gap_from_the_emulators_publisher():
    """The publisher (the emulator's, in vLLM's format) keeps batches for replay; a
    subscriber that missed some fetches them from the replay endpoint."""
    ep, rep = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))

    async def body():
        idx = ExactPrefixIndex(["w0"], BS)
        sub = KVEventSubscriber(idx, {"w0": ep}, replay={"w0": rep})
        pub = KVEventPublisher.from_config(json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep, "replay_endpoint": rep}))
        pub.start()
        a = list(range(16))
        try:
            pub.publish([BlockStored([1], None, a[:4], BS)])  # seq 0: nobody listens yet, lost to us
            await sub.start()
            assert await sub.wait_connected(5.0) == []
            pub.publish([BlockStored([2], 1, a[4:8], BS)])  # seq 1: the gap shows; 0 is replayed first
            await until(lambda: idx.workers["w0"].last_seq == 1)
            assert idx.match("w0", chain_hashes_of(a, BS)) == 2
            assert idx.workers["w0"].gaps == 0
        finally:
            await sub.stop()
            await pub.close()

    run(body())


# -- tokenizers -----------------------------------------------------------------------------


def test_word_tokenizer_is_the_emulators_and_caches_segments():
    tok = WordChatTokenizer()
    msgs = [{"role": "system", "content": text.system_text("s", 300)}, {"role": "user", "content": "hello there"}]
    assert tok.chat_ids(msgs) == text.chat_token_ids(msgs)
    assert tok.chat_ids(msgs) == text.chat_token_ids(msgs)  # from the cache
    assert request_ids(tok, "/v1/completions", {"prompt": "a b c"}) == text.tokenize("a b c")
    assert request_ids(tok, "/v1/completions", {"prompt": [5, 6]}) == [5, 6]
    with pytest.raises(ValueError):
        request_ids(tok, "/v1/chat/completions", {"messages": "nope"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A folder like the tiny model's tokenizer: byte-level BPE with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(text.VOCAB[i:i + 64]) for i in range(0, 4096, 64)] * 2, trainer)
    tok.save(str(d / "tokenizer.json"))
    template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")
    (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return d


def test_hf_tokenizer_segments_equal_whole_text(model_dir):
    from tokenizers import Tokenizer

    tok = HFChatTokenizer(model_dir)
    whole = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    chats = [
        [{"role": "system", "content": text.system_text("x", 200)}, {"role": "user", "content": text.user_text("c", 0, 30)}],
        [{"role": "user", "content": "Ünïcode, tabs\tand\nnewlines  <|im_end|> inside"},
         {"role": "assistant", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]},
         {"role": "user", "content": None}],
    ]
    for msgs in chats:
        rendered = tok.render(msgs)
        assert rendered.endswith("<|im_start|>assistant\n")
        ids = tok.chat_ids(msgs)
        assert ids == whole.encode(rendered, add_special_tokens=False).ids
        assert tok.chat_ids(msgs) == ids  # again, from the segment cache
    assert "part one\ntwo" in tok.render(chats[1])  # content parts joined as vLLM's string format does
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFChatTokenizer(model_dir / "missing")
