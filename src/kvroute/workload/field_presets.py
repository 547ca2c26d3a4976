"""The presets of :func:`kvroute.workload.field.field`: one documented parameter set per
source the field's router studies used, with the files it was read from and what was
assumed where the source is silent or the trace model differs (docs/workloads.md,
"Presets", has each against its source)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A named parameter set of ``field``: what it reproduces, from where, and what was
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
