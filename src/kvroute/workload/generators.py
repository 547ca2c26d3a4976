"""Seeded synthetic workloads: the research note's chats, ShareGPT-like and agent traffic,
and the registry of every generator (the field's generator and its presets live in
:mod:`kvroute.workload.field`).

Every generator takes a ``seed`` (an int, turned into ``numpy.random.default_rng``
streams; there is no global random state) and returns a validated :class:`Trace`
whose ``meta`` records the generator, every parameter after defaults, the seed and the
tokens-per-word ratio, so a trace file says how to make it again.

Randomness is split into independent streams (arrivals, turn counts, user lengths,
reply lengths, think times), each drawn in conversation order: changing the arrival
rate leaves the lengths unchanged, and a trace with more conversations extends the
one with fewer (same seed). Conversation and system-prompt ids carry the seed, so
rounds run with different seeds against a live engine never find the previous round's
text in its cache.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.random import Generator

from kvroute.workload.common import float_param, int_param, named_streams, seed_param
from kvroute.workload.field import FIELD_GENERATORS
from kvroute.workload.trace import Conversation, Trace, Turn

#: Tokens per English word. Rule of thumb "a token is about three quarters of a word"
#: (OpenAI's tokenizer guidance: 100 tokens ~ 75 words), i.e. 4/3 tokens per word.
#: Used wherever a size is given in words (the note gives its prompts in words).
TOKENS_PER_WORD: float = 4 / 3

# --- ShareGPT fit: every constant of ``sharegpt_like``, with its source ---------------
# Source figures (docs/workloads.md, field notes "Workloads"): ShareGPT_V3_unfiltered_
# cleaned_split.json has about 94k conversations and 330k turns (3.5 turns on average);
# first prompts measured with the Qwen2.5 tokenizer have median ~145 and p95 ~940 tokens.
#: Fitted: user-message tokens ~ lognormal with this median (first-prompt median).
USER_TOKENS_MEDIAN: float = 145.0
#: Fitted: first-prompt p95; sigma = ln(p95 / median) / z_0.95.
USER_TOKENS_P95: float = 940.0
Z_95: float = 1.6448536269514722  # standard normal 0.95 quantile
USER_TOKENS_SIGMA: float = math.log(USER_TOKENS_P95 / USER_TOKENS_MEDIAN) / Z_95  # ~1.136
#: Fitted: mean turns per conversation, 330k / 94k.
TURNS_MEAN: float = 3.5
#: Assumed: the longest conversation the turn-count law allows (support 1..128).
TURNS_SUPPORT_MAX: int = 128
#: Assumed, NOT fitted (no reply figure in the sources): replies are longer than prompts
#: (ChatGPT answers); lognormal with median 250 tokens, sigma 0.9 (mean ~375, p95 ~1,100).
REPLY_TOKENS_MEDIAN: float = 250.0
REPLY_TOKENS_SIGMA: float = 0.9
#: Assumed clips (sane bounds; each cuts well under 0.1% of draws).
USER_TOKENS_MIN, USER_TOKENS_MAX = 1, 8192
REPLY_TOKENS_MIN, REPLY_TOKENS_MAX = 1, 4096
#: Qwen2.5-7B-Instruct's native context length (tokens): prompts plus reply must fit.
QWEN25_CONTEXT_TOKENS: int = 32768

_STREAMS = ("arrivals", "turns", "user", "reply", "think")


def _streams(seed: int) -> dict[str, Generator]:
    """Independent, named generators from one seed (see the module docstring)."""
    return named_streams(seed, _STREAMS)


# --- parameter checks: fail loudly, naming the parameter (kvroute.workload.common) -----

_int, _float, _seed = int_param, float_param, seed_param


def words_to_tokens(words: int, tokens_per_word: float) -> int:
    """Token count of a size given in words (rounded to nearest, as the note's sizes)."""
    return int(round(words * tokens_per_word))


def _ids(name: str, seed: int, n: int) -> tuple[str, list[str]]:
    return f"{name}-s{seed}-system", [f"{name}-s{seed}-c{i:05d}" for i in range(n)]


def _meta(generator: str, seed: int, params: dict[str, Any], ratio: float, **extra: Any) -> dict:
    return {"generator": generator, "seed": seed, "params": params, "tokens_per_word": ratio,
            **extra}


def _poisson_arrivals(rng: Generator, n: int, rate_per_s: float) -> list[float]:
    """Arrival times of a Poisson process started at 0 (exponential gaps)."""
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=n)).tolist()


def _ramp(rng: Generator, n: int, ramp_s: float) -> list[float]:
    """Closed-loop ramp-up: earliest start of each chat, uniform on [0, ramp_s).

    A closed-loop replayer starts a chat no earlier than its ``arrival_s``; spreading
    the starts avoids every chat's first prefill landing in the same engine step.
    """
    if ramp_s == 0:
        return [0.0] * n
    return rng.uniform(0.0, ramp_s, size=n).tolist()


def _think_times(rng: Generator, n_turns: int, mean_s: float) -> list[float]:
    """Exponential think times; turn 0 has none (there is no previous reply)."""
    if mean_s == 0 or n_turns == 0:
        return [0.0] * n_turns
    return [0.0, *rng.exponential(mean_s, size=n_turns - 1).tolist()]


# --- the research note ----------------------------------------------------------------


def note2(
    seed: int,
    chats: int = 64,
    turns: int = 6,
    system_words: int = 600,
    user_words: int = 150,
    reply_tokens: int = 128,
    tokens_per_word: float = TOKENS_PER_WORD,
    think_s: float = 0.0,
    ramp_s: float = 0.0,
) -> Trace:
    """Research note 2, Table 1: ``chats`` chats at once (closed loop), all identical.

    One system prompt of ``system_words`` shared by every chat, ``turns`` turns of
    ``user_words``-word messages, ``reply_tokens``-token replies; ``think_s`` between a
    reply and the next turn. With the default ``ramp_s=0`` every chat starts at once,
    as in the note, and nothing is random (the seed only salts the ids); ``ramp_s > 0``
    draws each chat's earliest start uniformly from [0, ramp_s) (see :func:`_ramp`).
    """
    seed = _seed(seed)
    params = {
        "chats": _int("chats", chats),
        "turns": _int("turns", turns),
        "system_words": _int("system_words", system_words, 0),
        "user_words": _int("user_words", user_words, 0),
        "reply_tokens": _int("reply_tokens", reply_tokens),
        "tokens_per_word": _float("tokens_per_word", tokens_per_word, strict=True),
        "think_s": _float("think_s", think_s),
        "ramp_s": _float("ramp_s", ramp_s),
    }
    system_tokens = words_to_tokens(system_words, tokens_per_word)
    user_tokens = words_to_tokens(user_words, tokens_per_word)
    chat = tuple(Turn(user_tokens, reply_tokens, think_s if i else 0.0) for i in range(turns))
    system_id, ids = _ids("note2", seed, chats)
    starts = _ramp(_streams(seed)["arrivals"], chats, ramp_s)
    convs = tuple(
        Conversation(cid, system_id, system_tokens, chat, start) for cid, start in zip(ids, starts)
    )
    meta = _meta("note2", seed, params, params["tokens_per_word"],
                 derived={"system_tokens": system_tokens, "user_tokens": user_tokens})
    return Trace("note2", "closed", convs, concurrency=chats, meta=meta).validate()


# --- ShareGPT-like --------------------------------------------------------------------


def turn_count_exponent(mean: float = TURNS_MEAN, support_max: int = TURNS_SUPPORT_MAX) -> float:
    """Exponent ``a`` of ``P(k) ~ k**-a`` on 1..support_max whose mean is ``mean``."""
    if not 1 <= mean <= support_max:
        raise ValueError(f"mean turns {mean} is outside 1..{support_max}")
    k = np.arange(1, support_max + 1, dtype=float)

    def mean_at(a: float) -> float:
        w = k**-a
        return float((k * w).sum() / w.sum())

    lo, hi = -20.0, 20.0  # the mean falls as a rises: bisect
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_at(mid) > mean else (lo, mid)
    return (lo + hi) / 2


def _turn_counts(rng: Generator, n: int, max_turns: int) -> list[int]:
    """Truncated power law fitted to the mean (inverse CDF), then clipped to max_turns."""
    k = np.arange(1, TURNS_SUPPORT_MAX + 1, dtype=float)
    w = k ** -turn_count_exponent()
    cdf = np.cumsum(w / w.sum())
    counts = np.searchsorted(cdf, rng.random(n), side="right") + 1
    return np.minimum(counts, max_turns).tolist()


def _lognormal_tokens(
    rng: Generator, n: int, median: float, sigma: float, lo: int, hi: int
) -> list[int]:
    draws = np.exp(np.log(median) + sigma * rng.standard_normal(n))
    return np.clip(np.rint(draws), lo, hi).astype(np.int64).tolist()


def _fit_context(
    system: int, users: list[int], replies: list[int], limit: int | None
) -> list[tuple[int, int]]:
    """Cut a conversation so every prompt plus its reply fits in ``limit`` tokens.

    The first turn is shortened to fit (reply first, then user message); a later turn
    that would overflow ends the conversation there.
    """
    if limit is None:
        return list(zip(users, replies))
    room = limit - system
    out = [(min(users[0], room - min(replies[0], room - 1)), min(replies[0], room - 1))]
    history = sum(out[0])
    for u, r in zip(users[1:], replies[1:]):
        if history + u + r > room:
            break
        out.append((u, r))
        history += u + r
    return out


def sharegpt_like(
    seed: int,
    conversations: int = 200,
    rate_per_s: float = 2.0,
    system_words: int = 0,
    tokens_per_word: float = TOKENS_PER_WORD,
    max_turns: int = TURNS_SUPPORT_MAX,
    max_context_tokens: int | None = QWEN25_CONTEXT_TOKENS,
    think_s_mean: float = 0.0,
) -> Trace:
    """Open-loop chat traffic shaped like ShareGPT (fit and sources: module constants).

    Conversations arrive as a Poisson process at ``rate_per_s``. Turn counts follow a
    power law on 1..128 with mean 3.5 (clipped to ``max_turns``); every user message
    is lognormal with the first-prompt median 145 / p95 940; replies are lognormal
    with an assumed median 250. ``system_words`` > 0 adds one system prompt shared
    by all conversations. ``max_context_tokens`` cuts conversations to the model's
    context (None: no cut). ``think_s_mean`` > 0 draws exponential think times; the
    default 0 replays turns back to back, as the dataset has no timings.
    """
    seed = _seed(seed)
    params = {
        "conversations": _int("conversations", conversations),
        "rate_per_s": _float("rate_per_s", rate_per_s, strict=True),
        "system_words": _int("system_words", system_words, 0),
        "tokens_per_word": _float("tokens_per_word", tokens_per_word, strict=True),
        "max_turns": _int("max_turns", max_turns),
        "max_context_tokens": (
            None if max_context_tokens is None else _int("max_context_tokens", max_context_tokens)
        ),
        "think_s_mean": _float("think_s_mean", think_s_mean),
    }
    system_tokens = words_to_tokens(system_words, tokens_per_word)
    if max_context_tokens is not None and max_context_tokens < system_tokens + 2:
        raise ValueError(f"max_context_tokens={max_context_tokens} leaves no room after a "
                         f"{system_tokens}-token system prompt")
    rng = _streams(seed)
    arrivals = _poisson_arrivals(rng["arrivals"], conversations, rate_per_s)
    counts = _turn_counts(rng["turns"], conversations, max_turns)
    users = _lognormal_tokens(rng["user"], sum(counts), USER_TOKENS_MEDIAN, USER_TOKENS_SIGMA,
                              USER_TOKENS_MIN, USER_TOKENS_MAX)
    replies = _lognormal_tokens(rng["reply"], sum(counts), REPLY_TOKENS_MEDIAN, REPLY_TOKENS_SIGMA,
                                REPLY_TOKENS_MIN, REPLY_TOKENS_MAX)
    system_id, ids = _ids("sharegpt_like", seed, conversations)
    convs, start = [], 0
    for cid, arrival, n in zip(ids, arrivals, counts):
        end = start + n
        kept = _fit_context(system_tokens, users[start:end], replies[start:end], max_context_tokens)
        think = _think_times(rng["think"], n, think_s_mean)  # drawn for n: later turns stay aligned
        turns = tuple(Turn(u, r, t) for (u, r), t in zip(kept, think))
        convs.append(Conversation(cid, system_id, system_tokens, turns, arrival))
        start = end
    meta = _meta("sharegpt_like", seed, params, params["tokens_per_word"], fit=sharegpt_fit(),
                 derived={"system_tokens": system_tokens})
    return Trace("sharegpt_like", "open", tuple(convs), meta=meta).validate()


def sharegpt_fit() -> dict[str, Any]:
    """The ShareGPT fit as plain data (recorded in every trace's meta)."""
    return {
        "user_tokens": "lognormal",
        "user_tokens_median": USER_TOKENS_MEDIAN,
        "user_tokens_p95": USER_TOKENS_P95,
        "user_tokens_sigma": USER_TOKENS_SIGMA,
        "user_tokens_clip": [USER_TOKENS_MIN, USER_TOKENS_MAX],
        "turns": "truncated power law",
        "turns_mean": TURNS_MEAN,
        "turns_support_max": TURNS_SUPPORT_MAX,
        "turns_exponent": turn_count_exponent(),
        "reply_tokens": "lognormal (assumed, not fitted)",
        "reply_tokens_median": REPLY_TOKENS_MEDIAN,
        "reply_tokens_sigma": REPLY_TOKENS_SIGMA,
        "reply_tokens_clip": [REPLY_TOKENS_MIN, REPLY_TOKENS_MAX],
    }


# --- agent traffic --------------------------------------------------------------------


def agent(
    seed: int,
    conversations: int = 32,
    concurrency: int = 8,
    first_prompt_tokens: int = 8000,
    last_prompt_tokens: int = 32000,
    min_turns: int = 8,
    max_turns: int = 16,
    system_words: int = 1500,
    reply_tokens_min: int = 16,
    reply_tokens_max: int = 128,
    tool_tokens_min: int = 64,
    tokens_per_word: float = TOKENS_PER_WORD,
    max_context_tokens: int = QWEN25_CONTEXT_TOKENS,
    think_s_mean: float = 0.0,
    ramp_s: float = 0.0,
) -> Trace:
    """Agent traffic (the note's "larger run"): long histories, short replies, closed loop.

    Each conversation opens with the shared agent system prompt (``system_words``,
    tool definitions) and a large first message (documents, a tool's output) so its
    first prompt is exactly ``first_prompt_tokens``. Every later turn is a tool output
    that grows the history; their sizes are a random (flat Dirichlet) split of the
    growth that makes the last prompt exactly ``last_prompt_tokens``, each at least
    ``tool_tokens_min``. Turns per conversation are uniform on [min_turns, max_turns],
    replies uniform on [reply_tokens_min, reply_tokens_max]; ``think_s_mean`` > 0 adds
    exponential tool-execution time between a reply and the next turn; ``ramp_s`` > 0
    spreads the chats' earliest starts over [0, ramp_s).
    """
    seed = _seed(seed)
    params = {
        "conversations": _int("conversations", conversations),
        "concurrency": _int("concurrency", concurrency),
        "first_prompt_tokens": _int("first_prompt_tokens", first_prompt_tokens),
        "last_prompt_tokens": _int("last_prompt_tokens", last_prompt_tokens),
        "min_turns": _int("min_turns", min_turns, 2),
        "max_turns": _int("max_turns", max_turns, 2),
        "system_words": _int("system_words", system_words, 0),
        "reply_tokens_min": _int("reply_tokens_min", reply_tokens_min),
        "reply_tokens_max": _int("reply_tokens_max", reply_tokens_max),
        "tool_tokens_min": _int("tool_tokens_min", tool_tokens_min, 0),
        "tokens_per_word": _float("tokens_per_word", tokens_per_word, strict=True),
        "max_context_tokens": _int("max_context_tokens", max_context_tokens),
        "think_s_mean": _float("think_s_mean", think_s_mean),
        "ramp_s": _float("ramp_s", ramp_s),
    }
    system_tokens = words_to_tokens(system_words, tokens_per_word)
    _check_agent(params, system_tokens)
    rng = _streams(seed)
    system_id, ids = _ids("agent", seed, conversations)
    starts = _ramp(rng["arrivals"], conversations, ramp_s)
    convs = []
    for cid, start in zip(ids, starts):
        n = int(rng["turns"].integers(min_turns, max_turns, endpoint=True))
        replies = rng["reply"].integers(reply_tokens_min, reply_tokens_max, n, endpoint=True)
        replies = replies.tolist()
        # the tool outputs must add exactly this much beyond their minimum sizes
        growth = (last_prompt_tokens - first_prompt_tokens - sum(replies[:-1])
                  - (n - 1) * tool_tokens_min)
        split = rng["user"].multinomial(growth, rng["user"].dirichlet(np.ones(n - 1)))
        users = [first_prompt_tokens - system_tokens, *(tool_tokens_min + split).tolist()]
        think = _think_times(rng["think"], n, think_s_mean)
        turns = tuple(Turn(u, r, t) for u, r, t in zip(users, replies, think))
        convs.append(Conversation(cid, system_id, system_tokens, turns, start))
    meta = _meta("agent", seed, params, params["tokens_per_word"],
                 derived={"system_tokens": system_tokens})
    return Trace("agent", "closed", tuple(convs), concurrency=concurrency, meta=meta).validate()


def _check_agent(p: dict[str, Any], system_tokens: int) -> None:
    """Reject parameters for which no conversation could meet the targets."""
    problems = []
    if p["concurrency"] > p["conversations"]:
        problems.append("concurrency must not exceed conversations")
    if p["min_turns"] > p["max_turns"]:
        problems.append("min_turns must not exceed max_turns")
    if p["reply_tokens_min"] > p["reply_tokens_max"]:
        problems.append("reply_tokens_min must not exceed reply_tokens_max")
    if p["first_prompt_tokens"] <= system_tokens:
        problems.append(f"first_prompt_tokens must exceed the {system_tokens}-token system prompt")
    worst = (p["max_turns"] - 1) * (p["reply_tokens_max"] + p["tool_tokens_min"])
    if p["last_prompt_tokens"] - p["first_prompt_tokens"] < worst:
        problems.append(f"last_prompt_tokens - first_prompt_tokens must be >= {worst} "
                        "((max_turns - 1) * (reply_tokens_max + tool_tokens_min))")
    if p["last_prompt_tokens"] + p["reply_tokens_max"] > p["max_context_tokens"]:
        problems.append("last_prompt_tokens + reply_tokens_max must fit in max_context_tokens")
    if problems:
        raise ValueError("agent: " + "; ".join(problems))


# --- registry -------------------------------------------------------------------------

GENERATORS: dict[str, Callable[..., Trace]] = {
    "note2": note2,
    "sharegpt_like": sharegpt_like,
    "agent": agent,
    **FIELD_GENERATORS,  # field and its presets (kvroute.workload.field)
}


def generator_params(name: str) -> dict[str, Any]:
    """A generator's parameters (besides ``seed``) and their defaults."""
    fn = _lookup(name)
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if k != "seed"}


def _lookup(name: str) -> Callable[..., Trace]:
    try:
        return GENERATORS[name]
    except (KeyError, TypeError):
        valid = sorted(GENERATORS)
        raise ValueError(f"unknown workload generator {name!r}; valid: {valid}") from None


def generate(name: str, seed: int, **params: Any) -> Trace:
    """Build a trace by generator name (what experiment configs call)."""
    fn = _lookup(name)
    valid = generator_params(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for workload generator {name!r}; "
            f"valid: {sorted(valid)}"
        )
    return fn(seed, **params)
