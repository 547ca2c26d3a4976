"""The trace model: conversations, their turns and how they arrive.

A trace is what every generator and converter produces and what the simulator and
the load generator replay. Token counts only: message text, where needed, is made
deterministically from the counts (or taken from the dataset) by the consumer.

Arrival modes:

* ``closed``: ``concurrency`` chats run at once; a chat sends its next turn when the
  previous reply ends plus that turn's ``think_s``; when a chat ends the next
  conversation of the trace starts (so ``len(conversations) >= concurrency``), but
  never before its ``arrival_s`` (a ramp-up: 0 means at once).
* ``open``: conversation ``c`` sends its first turn at ``c.arrival_s`` (Poisson
  arrivals for the synthetic generators); later turns follow the closed-loop rule
  within that conversation.
* ``replay``: every turn is sent at its own ``Turn.arrival_s`` (seconds from the
  trace's start), whether or not the conversation's previous reply has ended: a
  recorded production trace replayed open loop, request by request. ``think_s`` is
  0 there (the arrival times say it all) and ``Conversation.arrival_s`` is its first
  turn's.

Prompt content: a turn's prompt is implicitly the system prompt, every earlier
message and the new user message (the synthetic generators and ShareGPT). A turn
with ``hash_ids`` instead carries its prompt explicitly, as a trace with prefix
structure does (Mooncake's): one id per ``Trace.block_tokens``-token block, the last
block partial, ``user_tokens`` tokens in all (the whole prompt: nothing else is
added, not even the conversation's earlier turns). Equal ids are equal content, so
two prompts whose first k ids agree share their first ``k * block_tokens`` tokens,
and a partial block is a prefix of its id's full block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Literal

Mode = Literal["closed", "open", "replay"]
MODES: tuple[str, ...] = ("closed", "open", "replay")


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn: the new user message and the reply it asks for."""

    user_tokens: int  # with hash_ids: the whole prompt's tokens
    output_tokens: int
    think_s: float = 0.0  # delay between the previous reply's end and this turn
    arrival_s: float | None = None  # replay mode only: when this turn is sent
    hash_ids: tuple[int, ...] | None = None  # the prompt's blocks, explicitly (module docstring)

    @property
    def explicit(self) -> bool:
        """True when the prompt is given as blocks (``hash_ids``), not built from history."""
        return self.hash_ids is not None


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat: a system prompt (shared by id across conversations) and its turns."""

    id: str
    system_id: str
    system_tokens: int
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0  # open loop: when turn 0 is sent; closed loop: earliest start

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length of ``turn``: system + every earlier message + the new one
        (an explicit turn's own ``user_tokens``)."""
        t = self.turns[turn]
        if t.explicit:
            return t.user_tokens
        history = sum(t.user_tokens + t.output_tokens for t in self.turns[:turn])
        return self.system_tokens + history + t.user_tokens

    def prompt_lengths(self) -> list[int]:
        """Prompt length of every turn, in order (how the history grows)."""
        out, total = [], self.system_tokens
        for t in self.turns:
            out.append(t.user_tokens if t.explicit else total + t.user_tokens)
            total += t.user_tokens + t.output_tokens
        return out


@dataclass(frozen=True)
class Trace:
    """A whole workload; ``meta`` records generator name, parameters and ratios."""

    name: str
    mode: Mode
    conversations: tuple[Conversation, ...]
    concurrency: int | None = None  # closed loop only
    meta: dict = field(default_factory=dict)
    block_tokens: int | None = None  # tokens per hash id, when turns carry hash_ids

    @property
    def explicit(self) -> bool:
        """True when the turns carry their prompts as blocks (``hash_ids``)."""
        return any(t.explicit for c in self.conversations for t in c.turns)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def validate(self) -> Trace:
        """Raise ``ValueError`` naming the first thing a replayer could not run; else self.

        Checked: the mode and its concurrency (closed loop needs
        ``1 <= concurrency <= len(conversations)``, open loop none), unique
        conversation ids, at least one turn per conversation, one token count per
        shared ``system_id``, non-negative finite times, ``user_tokens >= 0`` and
        ``output_tokens >= 1`` (a reply needs a first token to have a TTFT). Replay
        mode: every turn has an ``arrival_s``, non-decreasing within its conversation,
        the first equal to the conversation's, and ``think_s == 0``; other modes: no
        turn has one. Explicit prompts: ``block_tokens >= 1`` is set exactly when some
        turn has ``hash_ids``; a conversation's turns all have them or none do, and it
        has no system prompt; each has ``ceil(user_tokens / block_tokens)`` ids (so
        ``user_tokens >= 1``), every id an int in ``[0, 2**63)``.
        """
        _check(isinstance(self.name, str) and self.name != "", "trace name must be a non-empty str")
        _check(self.mode in MODES, f"mode must be one of {', '.join(MODES)}: {self.mode!r}")
        n = len(self.conversations)
        _check(n > 0, f"trace {self.name!r} has no conversations")
        if self.mode == "closed":
            _check(
                _is_int(self.concurrency) and 1 <= self.concurrency <= n,
                f"closed-loop trace {self.name!r} needs 1 <= concurrency <= {n} "
                f"(its conversations), got {self.concurrency!r}",
            )
        else:
            kind = "open-loop" if self.mode == "open" else "replay"
            _check(
                self.concurrency is None,
                f"{kind} trace {self.name!r} takes no concurrency, got {self.concurrency!r}",
            )
        explicit = self.explicit
        if explicit:
            _check(
                _is_int(self.block_tokens) and self.block_tokens >= 1,
                f"trace {self.name!r} has turns with hash_ids: block_tokens must be an int >= 1, "
                f"got {self.block_tokens!r}",
            )
        else:
            _check(
                self.block_tokens is None,
                f"trace {self.name!r}: block_tokens is {self.block_tokens!r} but no turn has hash_ids",
            )
        seen: set[str] = set()
        system_sizes: dict[str, int] = {}
        for c in self.conversations:
            _check_conversation(c)
            _check_arrivals(c, self.mode)
            if explicit:
                _check_blocks(c, self.block_tokens)
            _check(c.id not in seen, f"duplicate conversation id {c.id!r}")
            seen.add(c.id)
            size = system_sizes.setdefault(c.system_id, c.system_tokens)
            _check(
                size == c.system_tokens,
                f"system_id {c.system_id!r} has {size} tokens elsewhere but {c.system_tokens} "
                f"in conversation {c.id!r}; a shared id means one shared prompt",
            )
        return self


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_time(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _check_conversation(c: Conversation) -> None:
    at = f"conversation {c.id!r}"
    _check(isinstance(c.id, str) and c.id != "", f"{at}: id must be a non-empty string")
    _check(isinstance(c.system_id, str), f"{at}: system_id must be a string")
    _check(
        _is_int(c.system_tokens) and c.system_tokens >= 0,
        f"{at}: system_tokens must be an int >= 0, got {c.system_tokens!r}",
    )
    _check(_is_time(c.arrival_s), f"{at}: arrival_s must be finite and >= 0, got {c.arrival_s!r}")
    _check(len(c.turns) > 0, f"{at} has no turns")
    for i, t in enumerate(c.turns):
        _check(
            _is_int(t.user_tokens) and t.user_tokens >= 0,
            f"{at} turn {i}: user_tokens must be an int >= 0, got {t.user_tokens!r}",
        )
        _check(
            _is_int(t.output_tokens) and t.output_tokens >= 1,
            f"{at} turn {i}: output_tokens must be an int >= 1, got {t.output_tokens!r}",
        )
        _check(
            _is_time(t.think_s),
            f"{at} turn {i}: think_s must be finite and >= 0, got {t.think_s!r}",
        )


def _check_arrivals(c: Conversation, mode: str) -> None:
    """Per-turn arrivals: every turn's in replay mode, in order; none otherwise."""
    at = f"conversation {c.id!r}"
    if mode != "replay":
        for i, t in enumerate(c.turns):
            _check(
                t.arrival_s is None,
                f"{at} turn {i}: arrival_s {t.arrival_s!r} is for mode 'replay' only (mode is {mode!r})",
            )
        return
    previous = None
    for i, t in enumerate(c.turns):
        _check(
            _is_time(t.arrival_s),
            f"{at} turn {i}: replay mode needs arrival_s finite and >= 0, got {t.arrival_s!r}",
        )
        _check(t.think_s == 0, f"{at} turn {i}: replay mode sends turns at arrival_s; think_s must be 0, got {t.think_s!r}")
        _check(
            previous is None or t.arrival_s >= previous,
            f"{at} turn {i}: arrival_s {t.arrival_s!r} is before turn {i - 1}'s {previous!r}",
        )
        previous = t.arrival_s
    _check(
        c.arrival_s == c.turns[0].arrival_s,
        f"{at}: arrival_s {c.arrival_s!r} must equal its first turn's arrival_s {c.turns[0].arrival_s!r}",
    )


_MAX_ID = 2**63  # ids are stored as int64


def _check_blocks(c: Conversation, block_tokens: int) -> None:
    """Explicit prompts: all turns or none, no system prompt, one id per block."""
    at = f"conversation {c.id!r}"
    if not c.turns[0].explicit:
        _check(not any(t.explicit for t in c.turns),
               f"{at}: turn 0 has no hash_ids but a later turn has; a conversation's turns all have them or none do")
        return
    _check(c.system_tokens == 0 and c.system_id == "",
           f"{at}: turns with hash_ids carry their whole prompt; system_id must be '' and system_tokens 0, "
           f"got {c.system_id!r} and {c.system_tokens!r}")
    for i, t in enumerate(c.turns):
        where = f"{at} turn {i}"
        _check(t.explicit, f"{where} has no hash_ids but turn 0 has; a conversation's turns all have them or none do")
        _check(isinstance(t.hash_ids, tuple), f"{where}: hash_ids must be a tuple of ints, got {type(t.hash_ids).__name__}")
        _check(t.user_tokens >= 1, f"{where}: a prompt given as hash_ids needs user_tokens >= 1, got {t.user_tokens}")
        want = -(-t.user_tokens // block_tokens)
        _check(
            len(t.hash_ids) == want,
            f"{where}: {len(t.hash_ids)} hash_ids for {t.user_tokens} tokens; "
            f"expected ceil({t.user_tokens} / {block_tokens}) = {want} (one per {block_tokens}-token block)",
        )
        bad = next((h for h in t.hash_ids if not (_is_int(h) and 0 <= h < _MAX_ID)), None)
        _check(bad is None, f"{where}: hash_ids must be ints in [0, 2**63), got {bad!r}")
