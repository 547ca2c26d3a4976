"""One seeded generator for the field's synthetic workloads, with a preset for each source.

The router studies kvroute is judged against each ran its own synthetic traffic:
SGLang's generated-shared-prefix, inference-perf's shared_prefix (as llm-d ran it),
vLLM's multi-turn benchmark generator and BLIS's multi-turn sessions. :func:`field`
expresses all of them with one parameter set (docs/workloads.md, "field"):

* **groups** of conversations sharing a prefix (``group_prefix_tokens``, one system
  prompt per group), their popularity (uniform: ``prompts_per_group`` each, shuffled or
  in order, cycled when more conversations are asked for; or Zipf with ``zipf_alpha``),
  a **common prefix** for all (``common_prefix_tokens``) and a unique
  **per-conversation prefix** in the first user message (``conversation_prefix_tokens``);
* **turns** per conversation (counted in user turns or, as vLLM does, in messages) with
  accumulated history, per-message **lengths** and **think time**, each a distribution
  (:mod:`kvroute.workload.distributions`);
* **arrivals**: all at once (``burst``), Poisson at ``rate_per_s``, evenly spaced
  (``constant``), a ``ladder`` of Poisson rates ``[[rate, duration_s], ...]``, or a
  closed loop at a ``concurrency``.

A preset is a named, documented parameter set (:mod:`kvroute.workload.field_presets`); each is also registered
as a generator of its own name, whose parameters default to the preset's values, so an
experiment says ``{generator: sglang_gsp, params: {rate_per_s: 8}}`` or, equally,
``{generator: field, params: {preset: sglang_gsp, rate_per_s: 8}}``. Overrides replace
the preset's values; naming any arrival (``arrival``, ``rate_per_s``, ``ladder``,
``concurrency``) replaces the preset's whole arrival.

The trace model shares prefixes only through ``system_id``/``system_tokens`` (one shared
prefix per conversation): a group prefix becomes one ``system_id`` per group; a common
prefix for all becomes one ``system_id`` shared by every conversation; the unique
per-conversation prefix is part of turn 0's user message. A common prefix together with
a distinct prefix per group would need two nested shared prefixes, which the trace model
cannot say yet: such parameters are rejected.

Randomness comes from independent named streams of one seed (arrivals, groups, turns,
user, reply, think, group_prefix, common_prefix, conversation_prefix), drawn in
conversation order: same seed, same trace; another rate or arrival process leaves every
length unchanged; a trace with more conversations extends the one with fewer. Ids carry
the seed (``<name>-s<seed>-c<index>``, system prompts ``<name>-s<seed>-g<group>`` or
``<name>-s<seed>-system``), so rounds against a live engine never share text.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.random import Generator

from kvroute.workload.common import float_param, int_param, named_streams, seed_param
from kvroute.workload.distributions import Dist, parse_dist
from kvroute.workload.field_presets import PRESETS, Preset
from kvroute.workload.trace import Conversation, Trace, Turn

_STREAMS = ("arrivals", "groups", "turns", "user", "reply", "think", "group_prefix",
            "common_prefix", "conversation_prefix")

#: Every parameter of :func:`field` and its default (a one-turn, one-group, open workload).
FIELD_DEFAULTS: dict[str, Any] = {
    "conversations": None,  # None: groups * prompts_per_group (a ladder: as many as it sends)
    "groups": 1,
    "prompts_per_group": 1,
    "group_popularity": "uniform",  # or "zipf"
    "zipf_alpha": None,
    "shuffle": True,  # uniform popularity: shuffle the groups' prompts (False: group-major)
    "group_prefix_tokens": 0,  # one shared prefix per group (its system prompt)
    "common_prefix_tokens": 0,  # one prefix shared by every conversation (drawn once)
    "conversation_prefix_tokens": 0,  # unique per conversation, in turn 0's user message
    "first_message_includes_common_prefix": False,  # vLLM: the common prefix uses turn 0's budget
    "turns": 1,
    "turns_unit": "user",  # or "messages" (vLLM: user + assistant, rounded up to even)
    "user_tokens": 128,
    "output_tokens": 128,
    "think_s": 0.0,
    "arrival": None,  # burst, poisson, constant, ladder, closed; None: from the keys given
    "rate_per_s": None,  # conversations (sessions) started per second
    "ladder": None,  # [[rate_per_s, duration_s], ...], Poisson within each step
    "concurrency": None,  # closed loop: chats at once
    "ramp_s": 0.0,  # closed loop: earliest starts uniform on [0, ramp_s)
}

ARRIVALS = ("burst", "poisson", "constant", "ladder", "closed")
#: Keys that each choose an arrival process (what a preset's arrival is replaced by).
_ARRIVAL_CHOICE = {"rate_per_s": "poisson", "ladder": "ladder", "concurrency": "closed"}
_ARRIVAL_KEYS = ("arrival", "rate_per_s", "ladder", "concurrency", "ramp_s")
_NEEDS = {"burst": None, "poisson": "rate_per_s", "constant": "rate_per_s",
          "ladder": "ladder", "closed": "concurrency"}


def resolve_params(preset: str | None, params: dict[str, Any]) -> dict[str, Any]:
    """Defaults, then the preset's values, then ``params`` (the caller's overrides).

    An override that chooses an arrival (``arrival``, ``rate_per_s``, ``ladder``,
    ``concurrency``) drops the preset's whole arrival (and its ``ramp_s``) first.
    """
    unknown = sorted(set(params) - set(FIELD_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for workload generator 'field'; "
                         f"valid: {sorted(FIELD_DEFAULTS)}")
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        base = copy.deepcopy(PRESETS[preset].params)
        if set(params) & ({"arrival"} | set(_ARRIVAL_CHOICE)):
            base = {k: v for k, v in base.items() if k not in _ARRIVAL_KEYS}
    return {**copy.deepcopy(FIELD_DEFAULTS), **base, **copy.deepcopy(params)}


# --- checks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Checked parameters, distributions parsed."""

    conversations: int | None
    groups: int
    prompts_per_group: int
    zipf_alpha: float | None
    shuffle: bool
    group_prefix: Dist
    common_prefix: Dist
    conversation_prefix: Dist
    first_message_includes_common_prefix: bool
    turns: Dist
    turns_unit: str
    user: Dist
    output: Dist
    think: Dist
    arrival: str
    rate_per_s: float | None
    ladder: tuple[tuple[float, float], ...] | None
    concurrency: int | None
    ramp_s: float

    def record(self) -> dict[str, Any]:
        """The parameters as plain JSON; ``field(seed, **record)`` makes the trace again."""
        return {
            "conversations": self.conversations, "groups": self.groups,
            "prompts_per_group": self.prompts_per_group,
            "group_popularity": "uniform" if self.zipf_alpha is None else "zipf",
            "zipf_alpha": self.zipf_alpha, "shuffle": self.shuffle,
            "group_prefix_tokens": self.group_prefix.to_dict(),
            "common_prefix_tokens": self.common_prefix.to_dict(),
            "conversation_prefix_tokens": self.conversation_prefix.to_dict(),
            "first_message_includes_common_prefix": self.first_message_includes_common_prefix,
            "turns": self.turns.to_dict(), "turns_unit": self.turns_unit,
            "user_tokens": self.user.to_dict(), "output_tokens": self.output.to_dict(),
            "think_s": self.think.to_dict(), "arrival": self.arrival,
            "rate_per_s": self.rate_per_s,
            "ladder": None if self.ladder is None else [list(s) for s in self.ladder],
            "concurrency": self.concurrency, "ramp_s": self.ramp_s,
        }


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")
    return value


def _ladder(value: Any) -> tuple[tuple[float, float], ...]:
    """``[[rate_per_s, duration_s], ...]`` (or ``{rate_per_s, duration_s}`` dicts)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"ladder must be a non-empty list of [rate_per_s, duration_s] steps, "
                         f"got {value!r}")
    steps = []
    for i, step in enumerate(value):
        if isinstance(step, dict):
            if set(step) != {"rate_per_s", "duration_s"}:
                raise ValueError(f"ladder[{i}] must have keys rate_per_s and duration_s, "
                                 f"got {sorted(step)}")
            step = (step["rate_per_s"], step["duration_s"])
        if not isinstance(step, (list, tuple)) or len(step) != 2:
            raise ValueError(f"ladder[{i}] must be [rate_per_s, duration_s], got {step!r}")
        steps.append((float_param(f"ladder[{i}] rate_per_s", step[0]),
                      float_param(f"ladder[{i}] duration_s", step[1], strict=True)))
    if sum(r * d for r, d in steps) <= 0:
        raise ValueError("ladder: every step has rate 0, so nothing would arrive")
    return tuple(steps)


def _arrival(p: dict[str, Any]) -> str:
    """The arrival process: named, or chosen by the one key of rate_per_s/ladder/concurrency."""
    given = [k for k in _ARRIVAL_CHOICE if p[k] is not None]
    arrival = p["arrival"]
    if arrival is None:
        if len(given) > 1:
            raise ValueError(f"arrival: {given} each choose an arrival process; give one, or "
                             "name the process with arrival")
        return _ARRIVAL_CHOICE[given[0]] if given else "burst"
    arrival = _choice("arrival", arrival, ARRIVALS)
    needs = _NEEDS[arrival]
    for key in given:
        if key != needs:
            raise ValueError(f"{key} does not apply to arrival {arrival!r}")
    if needs is not None and p[needs] is None:
        raise ValueError(f"arrival {arrival!r} needs {needs}")
    return arrival


def _plan(p: dict[str, Any]) -> _Plan:
    popularity = _choice("group_popularity", p["group_popularity"], ("uniform", "zipf"))
    alpha = p["zipf_alpha"]
    if popularity == "zipf":
        if alpha is None:
            raise ValueError("group_popularity 'zipf' needs zipf_alpha (a finite number > 0)")
        alpha = float_param("zipf_alpha", alpha, strict=True)
    elif alpha is not None:
        raise ValueError("zipf_alpha applies only with group_popularity 'zipf'")
    arrival = _arrival(p)
    ramp_s = float_param("ramp_s", p["ramp_s"])
    if ramp_s > 0 and arrival != "closed":
        raise ValueError(f"ramp_s applies to arrival 'closed' only (this one is {arrival!r})")
    turns_unit = _choice("turns_unit", p["turns_unit"], ("user", "messages"))
    plan = _Plan(
        conversations=None if p["conversations"] is None
        else int_param("conversations", p["conversations"]),
        groups=int_param("groups", p["groups"]),
        prompts_per_group=int_param("prompts_per_group", p["prompts_per_group"]),
        zipf_alpha=alpha,
        shuffle=_bool("shuffle", p["shuffle"]),
        group_prefix=parse_dist("group_prefix_tokens", p["group_prefix_tokens"]),
        common_prefix=parse_dist("common_prefix_tokens", p["common_prefix_tokens"]),
        conversation_prefix=parse_dist("conversation_prefix_tokens",
                                       p["conversation_prefix_tokens"]),
        first_message_includes_common_prefix=_bool(
            "first_message_includes_common_prefix", p["first_message_includes_common_prefix"]),
        turns=parse_dist("turns", p["turns"], floor=1),
        turns_unit=turns_unit,
        user=parse_dist("user_tokens", p["user_tokens"]),
        output=parse_dist("output_tokens", p["output_tokens"], floor=1),
        think=parse_dist("think_s", p["think_s"], integer=False),
        arrival=arrival,
        rate_per_s=None if p["rate_per_s"] is None
        else float_param("rate_per_s", p["rate_per_s"], strict=True),
        ladder=None if p["ladder"] is None else _ladder(p["ladder"]),
        concurrency=None if p["concurrency"] is None
        else int_param("concurrency", p["concurrency"]),
        ramp_s=ramp_s,
    )
    if plan.groups > 1 and not plan.group_prefix.is_zero and not plan.common_prefix.is_zero:
        raise ValueError(
            "common_prefix_tokens together with a distinct group_prefix_tokens per group is not "
            "expressible yet: the trace model shares one prefix per conversation "
            "(system_id/system_tokens), not a common prefix nested under group prefixes; use "
            "one of the two, or groups: 1")
    return plan


# --- drawing --------------------------------------------------------------------------


def _arrival_times(plan: _Plan, rng: Generator, n: int | None) -> np.ndarray:
    """Start times of ``n`` conversations (a ladder: every arrival it sends, at most ``n``)."""
    if plan.arrival == "ladder":
        return _ladder_arrivals(plan.ladder, rng, n)
    assert n is not None
    if plan.arrival == "burst":
        return np.zeros(n)
    if plan.arrival == "poisson":
        return np.cumsum(rng.exponential(1.0 / plan.rate_per_s, size=n))
    if plan.arrival == "constant":
        return np.arange(n) / plan.rate_per_s
    if plan.ramp_s == 0:  # closed loop
        return np.zeros(n)
    return rng.uniform(0.0, plan.ramp_s, size=n)


def _ladder_arrivals(steps: tuple[tuple[float, float], ...], rng: Generator,
                     cap: int | None) -> np.ndarray:
    """A Poisson process whose rate is constant within each step: unit-rate arrivals mapped
    through the inverse of the cumulative intensity (so a step's count is Poisson with
    mean rate x duration, and the arrivals within it are uniform)."""
    rates = np.array([r for r, _ in steps])
    ends = np.cumsum([d for _, d in steps])
    starts = ends - np.array([d for _, d in steps])
    intensity = np.concatenate([[0.0], np.cumsum(rates * (ends - starts))])
    total = intensity[-1]
    units: list[float] = []
    t = 0.0
    chunk = max(64, int(total * 1.1) + 64)
    while t < total and (cap is None or len(units) < cap):
        for gap in rng.exponential(1.0, size=chunk):
            t += gap
            if t >= total or (cap is not None and len(units) >= cap):
                break
            units.append(t)
    u = np.array(units)
    k = np.searchsorted(intensity, u, side="right") - 1  # the step each arrival falls in
    return starts[k] + (u - intensity[k]) / rates[k]


def _group_of(plan: _Plan, rng: Generator, n: int) -> np.ndarray:
    """Each conversation's group: Zipf draws, or the (shuffled) pool of groups x prompts,
    cycled when more conversations than prompts are asked for (as inference-perf does)."""
    g = plan.groups
    if plan.zipf_alpha is not None:
        weights = np.arange(1, g + 1, dtype=float) ** -plan.zipf_alpha  # group 0 hottest
        cdf = np.cumsum(weights / weights.sum())
        return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), g - 1)
    pool = np.repeat(np.arange(g), plan.prompts_per_group)
    if plan.shuffle:
        pool = rng.permutation(pool)
    return pool[np.arange(n) % len(pool)]


def _turn_counts(plan: _Plan, rng: Generator, n: int) -> np.ndarray:
    counts = plan.turns.sample(rng, n)
    if plan.turns_unit == "messages":  # vLLM: at least one user + assistant pair, even
        counts = np.maximum(counts, 2)
        counts = (counts + counts % 2) // 2
    return counts


def field(seed: int, preset: str | None = None, **params: Any) -> Trace:
    """The field's synthetic workloads: ``preset`` (a name in :data:`PRESETS`) and overrides.

    Parameters and their defaults: :data:`FIELD_DEFAULTS` (docs/workloads.md, "field").
    Raises ValueError naming the parameter for any bad value.
    """
    seed = seed_param(seed)
    plan = _plan(resolve_params(preset, params))
    name = preset or "field"
    rng = named_streams(seed, _STREAMS)
    pool = plan.groups * plan.prompts_per_group
    if plan.arrival == "ladder":
        arrivals = _arrival_times(plan, rng["arrivals"], plan.conversations)
    else:
        arrivals = _arrival_times(plan, rng["arrivals"], plan.conversations or pool)
    n = len(arrivals)
    if n == 0:
        raise ValueError("ladder: the draw sent no conversation; give it more rate or time")
    if plan.arrival == "closed" and plan.concurrency > n:
        raise ValueError(f"concurrency ({plan.concurrency}) must not exceed the "
                         f"conversations ({n})")
    groups = _group_of(plan, rng["groups"], n)
    counts = _turn_counts(plan, rng["turns"], n)
    total = int(counts.sum())
    users = plan.user.sample(rng["user"], total)
    replies = plan.output.sample(rng["reply"], total)
    thinks = plan.think.sample(rng["think"], total)
    group_prefix = plan.group_prefix.sample(rng["group_prefix"], plan.groups)
    common = int(plan.common_prefix.sample(rng["common_prefix"], 1)[0])
    own_prefix = plan.conversation_prefix.sample(rng["conversation_prefix"], n)
    per_group = plan.groups > 1 and not plan.group_prefix.is_zero
    convs, start = [], 0
    for i in range(n):
        k = int(counts[i])
        u = users[start:start + k].tolist()
        if plan.first_message_includes_common_prefix:
            u[0] = max(0, u[0] - common)
        u[0] += int(own_prefix[i])
        t = [0.0, *thinks[start + 1:start + k].tolist()]  # turn 0 follows no reply
        turns = tuple(Turn(a, b, c) for a, b, c in zip(u, replies[start:start + k].tolist(), t))
        g = int(groups[i])
        if per_group:
            system_id, system_tokens = f"{name}-s{seed}-g{g:04d}", int(group_prefix[g])
        else:
            system_id, system_tokens = f"{name}-s{seed}-system", common + int(group_prefix[0])
        convs.append(Conversation(f"{name}-s{seed}-c{i:05d}", system_id, system_tokens, turns,
                                  float(arrivals[i])))
        start += k
    closed = plan.arrival == "closed"
    meta = {
        "generator": "field", "preset": preset, "seed": seed, "params": plan.record(),
        "source": PRESETS[preset].source if preset else None,
        "assumptions": list(PRESETS[preset].assumptions) if preset else [],
        "derived": {"conversations": n, "requests": total, "common_prefix_tokens": common,
                    "system_prompts": len({c.system_id for c in convs})},
    }
    return Trace(name, "closed" if closed else "open", tuple(convs),
                 concurrency=plan.concurrency if closed else None, meta=meta).validate()


# --- the registry's entries -----------------------------------------------------------


def _signature(defaults: dict[str, Any], with_preset: bool) -> inspect.Signature:
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("seed", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=int)]
    if with_preset:
        params.append(inspect.Parameter("preset", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=None))
    params += [inspect.Parameter(k, kw, default=v) for k, v in defaults.items()]
    return inspect.Signature(params, return_annotation=Trace)


def _preset_generator(preset: Preset) -> Callable[..., Trace]:
    def generator(seed: int, **params: Any) -> Trace:
        return field(seed, preset=preset.name, **params)

    generator.__name__ = generator.__qualname__ = preset.name
    generator.__doc__ = preset.doc()
    generator.__signature__ = _signature(resolve_params(preset.name, {}), with_preset=False)
    return generator


field.__signature__ = _signature(FIELD_DEFAULTS, with_preset=True)  # type: ignore[attr-defined]

#: ``field`` and one generator per preset, for :data:`kvroute.workload.generators.GENERATORS`.
FIELD_GENERATORS: dict[str, Callable[..., Trace]] = {
    "field": field, **{name: _preset_generator(p) for name, p in PRESETS.items()},
}
