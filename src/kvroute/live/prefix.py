"""Request text -> chained block hashes, for the gateway's approximate prefix index.

The gateway never sees tokens, only the request's JSON. It cuts the prompt text into
fixed-size character chunks (64 characters by default, like llm-d's prefix scorer;
SGLang's router matches raw characters too) and hashes them with the one chained-hash
module the simulator uses (:func:`kvroute.kvcache.hashing.chain_hashes`, each chunk's
content being ``(text_key(chunk),)``). Only full chunks are hashed, as only full KV
blocks are cached. Turn k+1 of a chat resends turn k's messages followed by the reply
and the new user message, so its text extends turn k's and its first hashes are turn
k's hashes::

    turn 1 text: [system ........][user 1 ....]
    turn 2 text: [system ........][user 1 ....][assistant 1 ...][user 2 ..]
    chunks:      |  64  |  64  |  64  |  64  |  64  |  64  |  64  | (tail dropped)

Token counts are estimated from characters (``chars_per_token``, 4 by default), and
one chunk counts as ``block_chars / chars_per_token`` tokens (16 for the defaults,
vLLM's GPU block size), so matches and prompt lengths are in the same unit.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvroute.kvcache.hashing import DEFAULT_SEED, ROOT_HASH, chain_hashes, text_key

DEFAULT_BLOCK_CHARS = 64  # llm-d's prefix scorer chunk
DEFAULT_CHARS_PER_TOKEN = 4.0  # the usual English rule of thumb for BPE tokenizers
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class PromptError(ValueError):
    """The request body has no usable prompt; the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class PromptDigest:
    """What the router keeps of one request's prompt."""

    text: str  # the prompt as one string (chat messages joined with role markers)
    prompt_tokens: int  # estimated from characters
    block_hashes: tuple[int, ...]  # chained hashes of the full chunks
    turn: int  # 0-based: earlier user messages in a chat, 0 for completions


@dataclass(frozen=True, slots=True)
class PrefixHasher:
    """Cuts prompt text into ``block_chars`` chunks and estimates tokens.

    Args:
        block_chars: characters per hashed chunk (> 0).
        chars_per_token: characters per estimated token (> 0).
    """

    block_chars: int = DEFAULT_BLOCK_CHARS
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN

    def __post_init__(self) -> None:
        if self.block_chars <= 0:
            raise ValueError(f"block_chars must be > 0, got {self.block_chars}")
        if not (self.chars_per_token > 0 and math.isfinite(self.chars_per_token)):
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")

    @property
    def block_tokens(self) -> int:
        """Estimated tokens per chunk: the view's ``block_size`` (at least 1)."""
        return max(1, round(self.block_chars / self.chars_per_token))

    def estimate_tokens(self, text: str) -> int:
        """Estimated token count of ``text``: ``ceil(len / chars_per_token)``."""
        return math.ceil(len(text) / self.chars_per_token)

    def block_hashes(self, text: str) -> list[int]:
        """Chained hashes of the full ``block_chars`` chunks of ``text`` (tail dropped).

        The values of ``chain_hashes((text_key(chunk),) for chunk in chunks)``, computed
        in one loop; ASCII text (the usual case) is encoded once and its byte chunks
        are the character chunks.
        """
        n = self.block_chars
        end = len(text) - n + 1
        if end <= 0:
            return []
        if text.isascii():
            data = text.encode("ascii")
            crc = zlib.crc32
            seed = DEFAULT_SEED
            parent = ROOT_HASH
            out = []
            append = out.append
            for i in range(0, end, n):
                parent = hash((seed, parent, (crc(data[i : i + n]),)))
                append(parent)
            return out
        return chain_hashes((text_key(text[i : i + n]),) for i in range(0, end, n))

    def digest(self, path: str, body: Mapping) -> PromptDigest:
        """The :class:`PromptDigest` of a parsed request body sent to ``path``.

        Raises :class:`PromptError` when the body lacks ``messages`` (chat) or
        ``prompt`` (completions), or they have the wrong shape.
        """
        if path == CHAT_PATH:
            text, turn = chat_text(body)
        elif path == COMPLETIONS_PATH:
            text, turn = completion_text(body), 0
        else:
            raise PromptError(f"no prompt rules for path {path!r}")
        return PromptDigest(text, self.estimate_tokens(text), tuple(self.block_hashes(text)), turn)


def _content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:  # an image or audio part: hash its JSON so equal parts match
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    raise PromptError(f"{where}: 'content' must be a string or a list of parts")


def chat_text(body: Mapping) -> tuple[str, int]:
    """A chat request's prompt text and turn index (earlier user messages).

    Each message becomes ``<|role|>content`` in order, so a later turn's text
    extends an earlier turn's.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("chat request needs a non-empty 'messages' list")
    out: list[str] = []
    users = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise PromptError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise PromptError(f"messages[{i}] needs a string 'role'")
        users += role == "user"
        out.append(f"<|{role}|>")
        out.append(_content_text(msg.get("content"), f"messages[{i}]"))
    return "".join(out), max(0, users - 1)


def completion_text(body: Mapping) -> str:
    """A completions request's prompt text (a list of strings is joined)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, int) for p in prompt):
        return " ".join(map(str, prompt))  # token ids: hash their decimal text
    raise PromptError("completions request needs a 'prompt' string (or list of strings)")
