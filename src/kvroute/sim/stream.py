"""Token identity for simulated conversations, as chained block hashes.

The simulator never materialises token ids. A conversation's token stream is a list
of segments (system prompt, then user and assistant messages in order); a block's
content is the tuple of ``(segment key, start, end)`` pieces it covers. Equal
content means equal tokens, so the shared system prompt hashes the same in every
conversation and a conversation's history the same in every turn. Hashes are
extended incrementally (the stream only grows), so each block is hashed once.

The chat template's tokens (:class:`kvroute.hardware.ChatTemplate`) are segments of
their own around each message, keyed by role and part, as the engine sees them after
rendering: ``[system open, system, system close]``, then per turn ``[user open, user,
user close, generation prompt]`` (the prompt ends there), the reply, and the reply's
close (which the next turn's prompt holds).

A prompt given explicitly as block ids (a trace's ``hash_ids``, :meth:`add_blocks`)
is one segment per id, keyed ``(BLOCK, id)`` and ``block_tokens`` long, the last one
cut to what is left: equal leading ids are equal segments, so their engine blocks
hash alike at any engine block size, and a partial last block is a prefix of its
id's full content (offsets from 0), shared as far as it goes.
"""

from __future__ import annotations

from kvroute.hardware import NO_TEMPLATE, ChatTemplate
from kvroute.kvcache.hashing import DEFAULT_SEED, ROOT_HASH, text_key

SYSTEM, USER, ASSISTANT = 0, 1, 2
TEMPLATE = 3  # key (TEMPLATE, role, part): the same template text wherever it appears
OPEN, CLOSE = 0, 1
BLOCK = 4  # key (BLOCK, hash_id): an explicit prompt's block


class ConversationStream:
    """The growing token stream of one conversation and its block-hash chain."""

    __slots__ = ("block_size", "template", "segments", "length", "hashes", "_parent", "_seg_i", "_seg_off")

    def __init__(self, system_id: str, system_tokens: int, block_size: int, template: ChatTemplate = NO_TEMPLATE):
        self.block_size = block_size
        self.template = template
        self.segments: list[tuple[tuple[int, ...], int]] = []  # (key, length)
        self.length = 0
        self.hashes: list[int] = []
        self._parent = ROOT_HASH
        self._seg_i = 0  # segment where the next unhashed block starts
        self._seg_off = 0
        if system_tokens > 0:
            self._append((TEMPLATE, SYSTEM, OPEN), template.system_open)
            self._append((SYSTEM, text_key(system_id)), system_tokens)
            self._append((TEMPLATE, SYSTEM, CLOSE), template.system_close)

    def _append(self, key: tuple[int, ...], n: int) -> None:
        if n > 0:
            self.segments.append((key, n))
            self.length += n

    def add_user(self, conv_index: int, turn: int, n: int) -> None:
        """The new user message and the generation prompt: the stream is then the turn's prompt."""
        t = self.template
        self._append((TEMPLATE, USER, OPEN), t.user_open)
        self._append((USER, conv_index, turn), n)
        self._append((TEMPLATE, USER, CLOSE), t.user_close)
        self._append((TEMPLATE, ASSISTANT, OPEN), t.generation_prompt)

    def add_assistant(self, conv_index: int, turn: int, n: int) -> None:
        """The reply (``n`` generated tokens), then its close as the next prompt holds it."""
        self._append((ASSISTANT, conv_index, turn), n)
        self._append((TEMPLATE, ASSISTANT, CLOSE), self.template.assistant_close)

    def add_blocks(self, hash_ids: tuple[int, ...], n: int, block_tokens: int) -> None:
        """Append an explicit prompt of ``n`` tokens: ``block_tokens`` per id, the last
        id's block cut to the tokens left (``len(hash_ids) == ceil(n / block_tokens)``)."""
        if len(hash_ids) != -(-n // block_tokens):
            raise ValueError(f"{len(hash_ids)} hash_ids for {n} tokens of {block_tokens}-token blocks")
        segments = self.segments
        for h in hash_ids[:-1]:
            segments.append(((BLOCK, h), block_tokens))
        if hash_ids:
            segments.append(((BLOCK, hash_ids[-1]), n - block_tokens * (len(hash_ids) - 1)))
        self.length += n

    def chain(self, n_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first ``n_tokens`` tokens (a list prefix view)."""
        bs = self.block_size
        want = min(n_tokens, self.length) // bs
        hashes = self.hashes
        if len(hashes) < want:
            segments, seed, append = self.segments, DEFAULT_SEED, hashes.append
            i, off, parent = self._seg_i, self._seg_off, self._parent
            while len(hashes) < want:
                key, length = segments[i]
                # the common case, blocks inside one segment (counted first, so the loop
                # does no bookkeeping per block); hash() is block_hash inlined
                n = min((length - off) // bs, want - len(hashes))
                if n > 0:
                    end = off + n * bs
                    for o in range(off, end, bs):
                        parent = hash((seed, parent, (*key, o, o + bs)))
                        append(parent)
                    off = end
                if off == length:
                    i, off = i + 1, 0
                    continue
                if len(hashes) == want:
                    break
                content: list[int] = []  # a block straddling segments
                need = bs
                while need:
                    key, length = segments[i]
                    take = min(need, length - off)
                    content.extend(key)
                    content.append(off)
                    content.append(off + take)
                    need -= take
                    off += take
                    if off == length:
                        i, off = i + 1, 0
                parent = hash((seed, parent, tuple(content)))
                hashes.append(parent)
            self._seg_i, self._seg_off, self._parent = i, off, parent
        return hashes[:want]
