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

A preset is a named, documented parameter set (:data:`PRESETS`); each is also registered
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


# --- presets --------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A named parameter set of :func:`field`: what it reproduces, from where, and what was
    assumed where the source is silent."""

    name: str
    summary: str
    source: str
    params: dict[str, Any]
    assumptions: tuple[str, ...]

    def doc(self) -> str:
        lines = [self.summary, "", f"Source: {self.source}.", "",
                 "Assumed where the source is silent or the trace model differs:"]
        return "\n".join(lines + [f"- {a}" for a in self.assumptions])


#: llm-d's precise-scheduling run (benchmarking/73-capacity): Poisson stages (rate/s, s).
LLMD_LADDER: tuple[tuple[float, float], ...] = (
    (15, 50),  # warm-up: one full set of 750 prompts
    (3, 20), (10, 20), (15, 20), (20, 38), (22, 34), (25, 30), (30, 25), (35, 21), (40, 38),
    (43, 36), (46, 33), (49, 30), (52, 29), (55, 27), (57, 26), (60, 25),
)

_REPEATS = (
    "inference-perf cycles its shuffled prompts (data_index modulo the pool): a request "
    "after the first groups x prompts_per_group repeats an earlier prompt exactly, system "
    "prompt and question, so its whole prompt can hit the cache (llm-d sizes the resident "
    "set as 6,000 + 5 x 1,200 tokens per group). The trace model shares only the system "
    "prompt, so here a repeat keeps its group but gets a fresh question: a repeated "
    "request's reusable prefix is 6,000 of its 7,200 tokens. This understates the source's "
    "reuse whenever conversations exceed the pool."
)

_SGLANG = Preset(
    name="sglang_gsp",
    summary=(
        "SGLang bench_serving's generated-shared-prefix dataset with its defaults: 64 groups "
        "x 16 prompts (1,024 requests), one 2,048-token system prompt per group, 128-token "
        "questions, 256-token outputs, range ratio 1.0 (every length exact), one turn, "
        "requests shuffled, all sent at once (--request-rate inf); rate_per_s gives Poisson "
        "arrivals, group_popularity: zipf with zipf_alpha skews the groups."
    ),
    source=(
        "sgl-project/sglang python/sglang/bench_serving.py (--gsp-* defaults, --request-rate) "
        "and python/sglang/benchmark/datasets/generated_shared_prefix.py "
        "(sample_generated_shared_prefix_requests, _zipf_group_probs) with "
        "benchmark/datasets/common.py (compute_random_lens)"
    ),
    params={
        "groups": 64, "prompts_per_group": 16,
        "group_prefix_tokens": {"dist": "range_ratio", "value": 2048, "ratio": 1.0},
        "user_tokens": {"dist": "range_ratio", "value": 128, "ratio": 1.0},
        "output_tokens": {"dist": "range_ratio", "value": 256, "ratio": 1.0},
        "turns": 1, "shuffle": True, "arrival": "burst",
    },
    assumptions=(
        "The '\\n\\n' joining system prompt and question (a token or two) is not counted; "
        "random-token text re-tokenises to about the nominal length, which is what is used.",
        "A range ratio r < 1 draws each length uniformly on [max(int(L r), 1), L], per group "
        "for the system prompt, per request for question and output (compute_random_lens); "
        "give it per length, e.g. user_tokens: {dist: range_ratio, value: 128, ratio: 0.5}.",
        "Zipf popularity draws each request's group independently with P(rank k) ~ k^-alpha, "
        "group 0 hottest (SGLang draws one group per slot of the groups x prompts pool, then "
        "shuffles: the same law).",
        "With turns > 1 (--gsp-num-turns) SGLang keeps one output length for all of a "
        "conversation's turns; here each turn draws its own (identical at range ratio 1.0).",
    ),
)

_LLMD_PARAMS = {
    "groups": 150, "prompts_per_group": 5, "group_prefix_tokens": 6000,
    "user_tokens": 1200, "output_tokens": 1000, "turns": 1, "shuffle": True,
}
_LLMD_SOURCE = (
    "llm-d blog 'KV-cache wins you can see' (2025-09-24) and llm-d benchmarking/73-capacity "
    "(the inference-perf config: data.shared_prefix, load.type poisson, load.stages); "
    "kubernetes-sigs/inference-perf inference_perf/datagen/shared_prefix_datagen.py"
)
_LLMD = Preset(
    name="llmd_shared_prefix",
    summary=(
        "inference-perf's shared_prefix as llm-d's precise-scheduling test ran it: 150 groups "
        "x 5 prompts (750, one full set), one 6,000-token system prompt per group, 1,200-token "
        "questions, 1,000-token outputs (ignore_eos), Poisson arrivals; by default one full "
        "set at 15 requests/s (the run's warm-up stage, 15/s for 50 s). Each rate of the "
        "run's ladder (3 to 60/s) is meant as its own job: override rate_per_s."
    ),
    source=_LLMD_SOURCE,
    params={**_LLMD_PARAMS, "arrival": "poisson", "rate_per_s": 15.0},
    assumptions=(
        "One pass over the 750 prompts by default (conversations = groups x prompts); the "
        "run's main stages sent 60 to 1,548 requests each (rate x duration): set conversations "
        "to match a stage, or use llmd_shared_prefix_ladder for the whole run.",
        "Prompts are shuffled once and visited in that order (inference-perf's get_data).",
        _REPEATS,
        "Every reply is exactly output_tokens long (ignore_eos), as the trace's replies are.",
    ),
)
_LLMD_LADDER_PRESET = Preset(
    name="llmd_shared_prefix_ladder",
    summary=(
        "llmd_shared_prefix over llm-d's whole Poisson ladder in one trace: warm-up 15/s for "
        "50 s, then 3, 10, 15, 20, 22, 25, 30, 35, 40, 43, 46, 49, 52, 55, 57, 60 requests/s "
        "for 20-38 s each (17,084 requests expected in 502 s)."
    ),
    source=_LLMD_SOURCE,
    params={**_LLMD_PARAMS, "arrival": "ladder", "ladder": [list(s) for s in LLMD_LADDER]},
    assumptions=(
        "Stages follow each other without a gap, Poisson within each at its rate; the "
        "conversation count is what the ladder sends (conversations caps it).",
        _REPEATS,
        "Every reply is exactly output_tokens long (ignore_eos), as the trace's replies are.",
    ),
)
_INFERENCE_PERF = Preset(
    name="inference_perf_shared_prefix",
    summary=(
        "inference-perf's shared_prefix with its own defaults: 10 groups x 10 prompts, a "
        "100-token system prompt per group, 50-token questions, 50-token outputs; requests "
        "evenly spaced at 1/s (its example config.yml: load type constant, rate 1)."
    ),
    source=(
        "kubernetes-sigs/inference-perf inference_perf/config.py (class SharedPrefix "
        "defaults), inference_perf/datagen/shared_prefix_datagen.py, config.yml (load)"
    ),
    params={
        "groups": 10, "prompts_per_group": 10, "group_prefix_tokens": 100, "user_tokens": 50,
        "output_tokens": 50, "turns": 1, "shuffle": True, "arrival": "constant",
        "rate_per_s": 1.0,
    },
    assumptions=(
        "The example config runs one 30 s stage (30 requests); here one pass over the 100 "
        "prompts (100 s), so each prompt is sent once; set conversations for another count.",
        "enable_multi_turn_chat is off (its default): one turn per request.",
        _REPEATS.replace("6,000 of its 7,200", "100 of its 150").replace(
            " (llm-d sizes the resident set as 6,000 + 5 x 1,200 tokens per group)", ""),
    ),
)
_VLLM = Preset(
    name="vllm_multiturn",
    summary=(
        "vLLM benchmarks/multi_turn's generate_multi_turn.json: 24 conversations, a 500-token "
        "prefix common to all, a per-conversation lognormal prefix (average 1,000, max 5,000) "
        "in the first user message, num_turns uniform 12-18 counting user and assistant "
        "messages (6-9 user turns), user messages uniform 120-160 tokens, replies uniform "
        "80-120; closed loop with 2 clients (the README's --num-clients 2), no delay."
    ),
    source=(
        "vllm-project/vllm benchmarks/multi_turn/generate_multi_turn.json, bench_dataset.py "
        "(generate_conversations and the distributions), benchmark_serving_multi_turn.py "
        "(clients) and README.md"
    ),
    params={
        "conversations": 24, "groups": 1, "common_prefix_tokens": 500,
        "conversation_prefix_tokens": {"dist": "lognormal", "average": 1000, "max": 5000},
        "first_message_includes_common_prefix": True,
        "turns": {"dist": "uniform", "min": 12, "max": 18}, "turns_unit": "messages",
        "user_tokens": {"dist": "uniform", "min": 120, "max": 160},
        "output_tokens": {"dist": "uniform", "min": 80, "max": 120},
        "think_s": 0.0, "arrival": "closed", "concurrency": 2,
    },
    assumptions=(
        "num_turns counts user and assistant messages: each draw of 12-18 is raised to at "
        "least 2 and rounded up to even, then halved, so 6, 7, 8 or 9 user turns with "
        "probabilities 1/7, 2/7, 2/7, 2/7 (mean 54/7 = 7.71).",
        "The common prefix (the text file's first 498 tokens and '.') opens every "
        "conversation's first user message: it becomes one system prompt of 500 tokens "
        "shared by every conversation (one system_id).",
        "vLLM counts the common prefix against the first message's num_tokens, so with "
        "500 > 160 its first message carries the prefixes and no question text; here turn "
        "0's user message is the conversation's prefix plus max(0, drawn - 500) tokens. The "
        "boilerplate around each message ('<id> is a nice number... ', the rewrite "
        "instruction, about 17 tokens) is not counted apart: it is inside each drawn length.",
        "The lognormal prefix has mu = ln(0.85 x 1000), sigma = sqrt(2 ln(1/0.85)) = 0.570 "
        "(vLLM's default median_ratio 0.85), capped at 5,000. vLLM also rescales each batch "
        "so its sample mean is exactly 1,000 before the cap; here draws are independent (the "
        "population mean is 1,000), so more conversations extend fewer.",
        "Closed loop at concurrency 2 with one conversation per client at a time (the "
        "default --max-active-conversations = --num-clients). The README's 6 active "
        "conversations, each client cycling over 3, are not expressible: a chat sends its "
        "next turn as soon as its reply ends.",
        "--request-rate 0 (the default): no think time between a reply and the next turn.",
    ),
)
_BLIS = Preset(
    name="blis_multiturn",
    summary=(
        "BLIS (inference-sim) prefix-affinity hypothesis, multi-turn chat "
        "(examples/multiturn-chat-demo.yaml): sessions starting as a Poisson process at 500 "
        "per second, 5 rounds each, input Gaussian 128 +- 30 tokens clipped to [32, 512], "
        "output 64 +- 20 clipped to [16, 256], 500 ms think time, context accumulating; 100 "
        "sessions (num_requests 500 / 5 rounds). The high-load case: rate_per_s 5000, "
        "conversations 400."
    ),
    source=(
        "inference-sim/inference-sim examples/multiturn-chat-demo.yaml and "
        "hypotheses/prefix-affinity/run.sh (branch hypothesis-archive); sim/workload/"
        "generator.go, arrival.go, distribution.go, session.go"
    ),
    params={
        "conversations": 100, "groups": 1, "turns": 5,
        "user_tokens": {"dist": "normal", "mean": 128, "std": 30, "min": 32, "max": 512},
        "output_tokens": {"dist": "normal", "mean": 64, "std": 20, "min": 16, "max": 256},
        "think_s": 0.5, "arrival": "poisson", "rate_per_s": 500.0,
    },
    assumptions=(
        "Rate units: aggregate_rate is per second (normalizeRateFractions divides it by 1e6 "
        "for per-microsecond sampling), and generator.go's multi-turn path draws one "
        "inter-arrival per session, so 500 is session starts per second (the demo's own "
        "comment: 'Sessions start at 500/sec'), not requests per second.",
        "100 sessions = num_requests 500 / max_rounds 5. BLIS caps the request count after "
        "sorting by arrival time, which can cut the late rounds of some sessions; here every "
        "session has its 5 rounds. High load (run.sh experiment 2, num_requests 2000): "
        "rate_per_s 5000, conversations 400.",
        "Think time runs from a round's reply to the next round (session.go's closed-loop "
        "follow-ups: arrival = completion + think_time_us); the older reasoning.go put "
        "rounds on a fixed schedule instead.",
        "Gaussian draws are clipped, then rounded (distribution.go GaussianSampler).",
        "No shared prefix: the demo's client has no prefix_group, so a session shares only "
        "its own history.",
    ),
)

#: Every preset by name (docs/workloads.md has a table of each against its source).
PRESETS: dict[str, Preset] = {
    p.name: p for p in (_SGLANG, _LLMD, _LLMD_LADDER_PRESET, _INFERENCE_PERF, _VLLM, _BLIS)
}


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
