"""Deterministic message text and the word tokenizer the emulator and load generator share.

A trace gives token counts only; the load generator needs text. This module makes text
of an exact size in *its* tokenizer, and the emulator counts tokens with the same
tokenizer, so on the emulator a message of ``n`` trace tokens is ``n`` prompt tokens.

Tokenizer: the special tokens ``<|im_start|>`` and ``<|im_end|>`` are one token each;
everything else is split on whitespace, one token per word. Ids::

    0 <|im_start|>   1 <|im_end|>   2 system   3 user   4 assistant   (5..15 reserved)
    16 .. 16+4095    the 4,096 vocabulary words ("baba" .. "zozo")
    WORD_BASE+4096.. any other word: CRC-32 of its UTF-8, modulo 2**20

Chat template (ChatML-like, as Qwen2's)::

    <|im_start|>system\\n{system}<|im_end|>\\n       one message: 3 tokens + its content
    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n                       generation prompt: 2 tokens

so a prompt has ``content + 3 * messages + 2`` tokens (:func:`chat_prompt_tokens`). The
generation prompt is the head of the assistant message that the next turn's history
holds, so a turn's prompt plus its reply is a token prefix of the next turn's prompt,
and chained block hashes (:func:`block_hashes`) hit across turns.

Message text: ``n`` words drawn from the vocabulary by SHAKE-256 of a key (the
system-prompt id, or ``conversation id + turn``), so equal keys give equal text in
every process and Python version, and different keys share no blocks. On a real
engine the words are real text for its tokenizer, which may split a word into several
tokens: the records then carry the engine's own counts (from ``usage``).

Explicit prompts (a recorded trace's ``hash_ids``, :func:`explicit_prompt`): one chunk
per id, the id's own words (:func:`block_text`), each word after a space. SHAKE-256's
output for a shorter length is a prefix of a longer one's, so a partial last block is a
prefix of its id's full block; and every chunk boundary is a space before a word, where
any GPT-style pre-tokenizer (Qwen2's byte-level BPE included) starts a new token, so
prompts whose first k ids agree agree in their first k chunks' tokens on the engine
too. Here, and in the tiny model's tokenizer (every vocabulary word after a space is
one token), a prompt of ``n`` trace tokens is exactly ``n`` tokens.
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence

from kvroute.kvcache.hashing import DEFAULT_SEED, chain_hashes, token_blocks

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_IDS: dict[str, int] = {IM_START: 0, IM_END: 1, "system": 2, "user": 3, "assistant": 4}
ROLES = ("system", "user", "assistant")
WORD_BASE = 16
_CONSONANTS = "bdfghjklmnprstvz"  # 16
_VOWELS = "aeio"  # 4: 64 syllables, 64 x 64 two-syllable words
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]
#: the 4,096 words message text is made of, each one token here
VOCAB: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)
VOCAB_IDS: dict[str, int] = {w: WORD_BASE + i for i, w in enumerate(VOCAB)}
_UNKNOWN_BASE = WORD_BASE + len(VOCAB)
_UNKNOWN_MOD = 1 << 20
TEMPLATE_TOKENS_PER_MESSAGE = 3  # <|im_start|> role ... <|im_end|>
GENERATION_PROMPT_TOKENS = 2  # <|im_start|> assistant


def chat_template():
    """This tokenizer's template as the simulator counts one (:class:`kvroute.hardware.ChatTemplate`):
    ``<|im_start|>`` and the role open a message, ``<|im_end|>`` closes it (newlines are
    whitespace, no token), and the generation prompt is the reply's two-token head. A
    simulation of an emulated run uses it in place of the profile's model's."""
    from kvroute.hardware import ChatTemplate

    head, close = TEMPLATE_TOKENS_PER_MESSAGE - 1, 1
    return ChatTemplate(system_open=head, system_close=close, user_open=head, user_close=close,
                        generation_prompt=GENERATION_PROMPT_TOKENS, assistant_close=close)
_SPECIAL_RE = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")


# -- tokenizer ---------------------------------------------------------------------------


def _word_id(word: str) -> int:
    i = SPECIAL_IDS.get(word)
    if i is not None:
        return i
    i = VOCAB_IDS.get(word)
    if i is not None:
        return i
    return _UNKNOWN_BASE + zlib.crc32(word.encode("utf-8")) % _UNKNOWN_MOD


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: special tokens, then one id per whitespace-separated word."""
    ids: list[int] = []
    for piece in _SPECIAL_RE.split(text):
        if piece == IM_START:
            ids.append(0)
        elif piece == IM_END:
            ids.append(1)
        elif piece:
            ids.extend(_word_id(w) for w in piece.split())
    return ids


def count_tokens(text: str) -> int:
    """Number of tokens :func:`tokenize` gives (without building the list)."""
    n = 0
    for piece in _SPECIAL_RE.split(text):
        if piece in (IM_START, IM_END):
            n += 1
        elif piece:
            n += len(piece.split())
    return n


def word_of(token_id: int) -> str:
    """The word of a vocabulary id (the emulator's reply tokens); ValueError otherwise."""
    i = token_id - WORD_BASE
    if not 0 <= i < len(VOCAB):
        raise ValueError(f"token id {token_id} is not a vocabulary word")
    return VOCAB[i]


def content_text(content: object) -> str:
    """The text of an OpenAI message ``content``: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("message content parts must be {'type': 'text', 'text': str}")
            parts.append(p["text"])
        return "\n".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, not {type(content).__name__}")


def render_chat(messages: Iterable[Mapping], add_generation_prompt: bool = True) -> str:
    """The ChatML-like prompt text of ``messages`` (see the module docstring)."""
    out = []
    for m in messages:
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in ROLES:
            raise ValueError(f"message role must be one of {', '.join(ROLES)}, got {role!r}")
        out.append(f"{IM_START}{role}\n{content_text(m.get('content'))}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def chat_token_ids(messages: Iterable[Mapping], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the rendered chat (what the emulator prefills)."""
    return tokenize(render_chat(messages, add_generation_prompt))


def chat_prompt_tokens(content_tokens: int, messages: int) -> int:
    """Prompt length of ``messages`` messages holding ``content_tokens`` tokens in all."""
    return content_tokens + TEMPLATE_TOKENS_PER_MESSAGE * messages + GENERATION_PROMPT_TOKENS


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int = DEFAULT_SEED) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (kvroute.kvcache.hashing)."""
    return chain_hashes(token_blocks(token_ids, block_size), seed=seed)


# -- deterministic text -----------------------------------------------------------------


def word_indices(key: str, n: int) -> list[int]:
    """``n`` vocabulary indices drawn from SHAKE-256 of ``key`` (stable everywhere)."""
    if n <= 0:
        return []
    raw = hashlib.shake_256(key.encode("utf-8")).digest(2 * n)
    # 4,096 divides 65,536: masking keeps the draw uniform
    return [int.from_bytes(raw[2 * i : 2 * i + 2], "little") & 0xFFF for i in range(n)]


def words(key: str, n: int) -> str:
    """``n`` space-separated vocabulary words for ``key``: exactly ``n`` tokens here."""
    return " ".join(VOCAB[i] for i in word_indices(key, n))


def system_text(system_id: str, n: int) -> str:
    """The system prompt shared by every conversation with ``system_id``."""
    return words(f"system:{system_id}", n)


def user_text(conversation: str, turn: int, n: int) -> str:
    """Turn ``turn``'s user message of ``conversation``."""
    return words(f"user:{conversation}:{turn}", n)


@functools.lru_cache(maxsize=1 << 16)
def _block_words(hash_id: int, block_tokens: int) -> tuple[str, ...]:
    return tuple(VOCAB[i] for i in word_indices(f"block:{hash_id}", block_tokens))


def block_text(hash_id: int, n: int, block_tokens: int | None = None) -> str:
    """The first ``n`` words of hash id ``hash_id``'s block (of ``block_tokens`` words,
    default ``n``), each after a space: the same text for the same id in every prompt,
    a partial block a prefix of the full one."""
    if n <= 0:
        return ""
    full = _block_words(hash_id, max(n, block_tokens or n))
    return "".join(" " + w for w in full[:n])


def explicit_prompt(hash_ids: Sequence[int], n_tokens: int, block_tokens: int) -> str:
    """The text of a prompt given as blocks: ``block_tokens`` words per id, the last
    block cut to the ``n_tokens`` left (``len(hash_ids) == ceil(n_tokens / block_tokens)``).
    ``n_tokens`` tokens in this module's tokenizer and the tiny model's."""
    if len(hash_ids) != -(-n_tokens // block_tokens):
        raise ValueError(f"{len(hash_ids)} hash_ids for {n_tokens} tokens of {block_tokens}-token blocks; "
                         f"expected {-(-n_tokens // block_tokens)}")
    last = n_tokens - block_tokens * (len(hash_ids) - 1)
    return "".join(block_text(h, block_tokens if j < len(hash_ids) - 1 else last, block_tokens)
                   for j, h in enumerate(hash_ids))


def placeholder_reply(conversation: str, turn: int, n: int) -> str:
    """Stand-in for a reply that never came (a failed turn), so later turns keep their size."""
    return words(f"reply:{conversation}:{turn}", n)


def reply_token_ids(prompt_ids: Sequence[int], n: int) -> list[int]:
    """The emulator's reply to a prompt: ``n`` vocabulary ids, fixed by the prompt (temperature 0)."""
    key = f"emulated-reply:{len(prompt_ids)}:{hash(tuple(prompt_ids))}"
    return [WORD_BASE + i for i in word_indices(key, n)]
