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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Literal

Mode = Literal["closed", "open"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn: the new user message and the reply it asks for."""

    user_tokens: int
    output_tokens: int
    think_s: float = 0.0  # delay between the previous reply's end and this turn


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat: a system prompt (shared by id across conversations) and its turns."""

    id: str
    system_id: str
    system_tokens: int
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0  # open loop: when turn 0 is sent; closed loop: earliest start

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length of ``turn``: system + every earlier message + the new one."""
        history = sum(t.user_tokens + t.output_tokens for t in self.turns[:turn])
        return self.system_tokens + history + self.turns[turn].user_tokens

    def prompt_lengths(self) -> list[int]:
        """Prompt length of every turn, in order (how the history grows)."""
        out, total = [], self.system_tokens
        for t in self.turns:
            out.append(total + t.user_tokens)
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

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def validate(self) -> Trace:
        """Raise ``ValueError`` naming the first thing a replayer could not run; else self.

        Checked: the mode and its concurrency (closed loop needs
        ``1 <= concurrency <= len(conversations)``, open loop none), unique
        conversation ids, at least one turn per conversation, one token count per
        shared ``system_id``, non-negative finite times, ``user_tokens >= 0`` and
        ``output_tokens >= 1`` (a reply needs a first token to have a TTFT).
        """
        _check(isinstance(self.name, str) and self.name != "", "trace name must be a non-empty str")
        _check(self.mode in ("closed", "open"), f"mode must be 'closed' or 'open': {self.mode!r}")
        n = len(self.conversations)
        _check(n > 0, f"trace {self.name!r} has no conversations")
        if self.mode == "closed":
            _check(
                _is_int(self.concurrency) and 1 <= self.concurrency <= n,
                f"closed-loop trace {self.name!r} needs 1 <= concurrency <= {n} "
                f"(its conversations), got {self.concurrency!r}",
            )
        else:
            _check(
                self.concurrency is None,
                f"open-loop trace {self.name!r} takes no concurrency, got {self.concurrency!r}",
            )
        seen: set[str] = set()
        system_sizes: dict[str, int] = {}
        for c in self.conversations:
            _check_conversation(c)
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
