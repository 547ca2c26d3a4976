"""Chained block hashes: the one definition of "the same prefix" in kvroute.

A block's identity is ``hash((seed, parent_hash, content))`` where ``content`` is a
tuple of ints describing the block's tokens. Chaining makes a block's hash depend on
every token before it, so equal hashes mean equal prefixes (as in vLLM's
``hash_block_tokens``). The simulator's pool and the gateway's prefix index both hash
through :func:`chain_hashes`, so a "hit" means the same thing in both worlds.

Python's ``hash`` of a tuple of ints is deterministic across processes (unlike str and
bytes, which ``PYTHONHASHSEED`` salts); text is turned into ints by :func:`text_key`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

ROOT_HASH = 0  # parent of the first block
DEFAULT_SEED = 0x6B76  # "kv"


def block_hash(parent: int, content: tuple, seed: int = DEFAULT_SEED) -> int:
    """Hash of one full block given its parent's hash and a tuple of ints."""
    return hash((seed, parent, content))


def chain_hashes(
    blocks: Iterable[tuple], parent: int = ROOT_HASH, seed: int = DEFAULT_SEED
) -> list[int]:
    """Hash a sequence of full blocks, each chained to the one before."""
    out: list[int] = []
    for content in blocks:
        parent = hash((seed, parent, content))
        out.append(parent)
    return out


def token_blocks(tokens: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    """Split token ids into full blocks (a trailing partial block is dropped)."""
    n = len(tokens) // block_size
    return [tuple(tokens[i * block_size : (i + 1) * block_size]) for i in range(n)]


def text_key(text: str) -> int:
    """A process-independent int for a piece of text (CRC-32 of its UTF-8)."""
    return zlib.crc32(text.encode("utf-8"))
