r"""Technical note 4: the arithmetic of shared prefixes under routing.

Setting. ``n`` workers, each with its own prefix cache (no eviction). Every
conversation starts with one system prompt of ``S`` tokens shared by all
conversations; turn k adds a user message of ``u`` tokens and a reply of ``r``
tokens, so the history grows by ``g = u + r`` tokens a turn and the prompt of turn
k (0-based) is ``P_k = S + k g + u``.

What a worker holds. After serving turn j of a conversation, a worker holds the KV
of its first ``L_j = P_j + r - 1`` tokens (the prompt and every reply token but the
last, which is sampled and never fed back), in full blocks of ``B`` tokens. Any worker
that has served any request holds the system prompt. A turn routed to worker w finds
the longest prefix w holds, rounded down to whole blocks and capped at ``P_k - 1``
(the engine always recomputes the last prompt token):

    c_k(x) = min(B floor(x / B), B floor((P_k - 1) / B))

Where turn k lands, and what it finds there:

* sticky: the worker of turn k - 1, so it finds ``c_k(L_{k-1})`` (turn 0: ``c_0(S)``).
* random: an independent uniform worker. Its last visit by this conversation was
  turn j with probability ``(1/n) q^(k-1-j)`` (q = 1 - 1/n), never with ``q^k``:

      E[cached_k] = sum_j (1/n) q^(k-1-j) c_k(L_j) + q^k c_k(S)

* round-robin with many interleaved clients: between two turns of a conversation
  the router hands out a varying number of other requests, so the offset modulo n is
  close to uniform and round-robin behaves as random (the default, ``mixed``).
  With one client sending its turns back to back (``sequential``) turn k lands on the
  worker that served turn k - n: ``c_k(L_{k-n})`` for k >= n, else ``c_k(S)``. Two-turn
  trials alternating over two servers never return (the field notes' 0/20).

Continuous closed form (B = 1, dropping the one-token corrections). Summing
``sum_j (1/n) q^(k-1-j) (j+1)`` gives the history random routing reuses on turn k:

    E[reused history_k] = g (k - (n - 1)(1 - q^k))       (sticky: g k)

so random routing loses ``(n - 1)(1 - q^k)`` turns of history, at most n - 1 however
long the chat. Over a chat of T turns:

    H_sticky = [T S + g T(T-1)/2] / [T (S + u) + g T(T-1)/2]
    H_random = H_sticky - g (n - 1) [T - n (1 - q^T)] / [T (S + u) + g T(T-1)/2]

The shared prompt S appears in numerator and denominator alike: it lifts every
policy's hit rate towards 1, which is why round-robin still reuses most prompt tokens
when S is large against u. Cold start: the first request each worker serves finds no
system prompt either (:func:`trace_hit_rate` subtracts it).

:func:`run_sweep` checks these against the simulator (``kvroute.sim``) across n and S.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from kvroute.records import requests_table, summarize, write_csv, write_requests

POLICIES = ("random", "round_robin", "sticky")


@dataclass(frozen=True)
class ChatShape:
    """A uniform chat: shared system prompt, fixed user and reply sizes, T turns."""

    system_tokens: int
    user_tokens: int
    reply_tokens: int
    turns: int

    @property
    def growth(self) -> int:
        return self.user_tokens + self.reply_tokens

    @classmethod
    def of(cls, conversation) -> ChatShape:
        """The shape of a uniform conversation (a ``note2`` trace's), from its first turn."""
        c = conversation
        return cls(c.system_tokens, c.turns[0].user_tokens, c.turns[0].output_tokens, len(c.turns))


def _check(n: int, policy: str) -> None:
    if n < 1:
        raise ValueError(f"workers must be >= 1, got {n}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")


def return_times(n: int, policy: str, turns: int, rr_mode: str | Sequence[float] = "mixed") -> np.ndarray:
    """f[m] = P(the worker of turn k last served this conversation at turn k - m), m = 1..turns.

    A conversation walks over the workers: turn k lands ``d`` places after turn k-1
    (modulo n) with probability ``offsets[d]``. ``1 - f.sum()`` (up to m = k) is the
    chance the worker never served it.

    Args:
        n: workers.
        policy: ``sticky`` (f_1 = 1), ``random`` (uniform offsets) or ``round_robin``.
        turns: largest m needed.
        rr_mode: round-robin's offsets: ``mixed`` (uniform, many interleaved clients),
            ``sequential`` (always 1: one client, turns back to back), or a probability
            vector of length n (e.g. measured with :func:`offset_distribution`).
    """
    _check(n, policy)
    f = np.zeros(turns + 1)
    if n == 1 or policy == "sticky":
        f[1:2] = 1.0
        return f
    if policy == "random" or (isinstance(rr_mode, str) and rr_mode == "mixed"):
        m = np.arange(1, turns + 1)
        f[1:] = (1 / n) * (1 - 1 / n) ** (m - 1)
        return f
    if isinstance(rr_mode, str):
        if rr_mode != "sequential":
            raise ValueError(f"round-robin mode must be 'mixed', 'sequential' or offsets, got {rr_mode!r}")
        offsets = np.zeros(n)
        offsets[1 % n] = 1.0
    else:
        offsets = np.asarray(rr_mode, dtype=float)
        if offsets.shape != (n,) or np.any(offsets < 0) or not np.isclose(offsets.sum(), 1):
            raise ValueError(f"offsets must be {n} probabilities summing to 1")
    # first return to 0 of a walk on Z_n with step law `offsets` (walking backwards in turns)
    state = np.zeros(n)
    state[0] = 1.0
    for m in range(1, turns + 1):
        nxt = np.zeros(n)
        for d, p in enumerate(offsets):
            if p:
                nxt += p * np.roll(state, d)
        f[m] = nxt[0]
        nxt[0] = 0.0
        state = nxt
    return f


def expected_cached(
    system_tokens: int,
    user_tokens: Sequence[int],
    reply_tokens: Sequence[int],
    n: int,
    policy: str,
    block_size: int = 1,
    rr_mode: str | Sequence[float] = "mixed",
) -> np.ndarray:
    """Expected cached tokens of each turn of one conversation (exact expectation).

        E[cached_k] = sum_{m=1..k} f_m c_k(L_{k-m}) + (1 - sum_{m<=k} f_m) c_k(S)

    with f from :func:`return_times`.

    Args:
        system_tokens: S, the shared system prompt (held by every warm worker).
        user_tokens, reply_tokens: per-turn sizes (may vary by turn).
        n: workers.
        policy: ``random``, ``round_robin`` or ``sticky``.
        block_size: B; 1 for no block rounding.
        rr_mode: round-robin's offsets (see :func:`return_times`).

    Returns:
        Array of length T; assumes warm workers (see :func:`trace_hit_rate` for cold start).
    """
    B = int(block_size)
    users = np.asarray(user_tokens, dtype=np.int64)
    replies = np.asarray(reply_tokens, dtype=np.int64)
    T = len(users)
    f = return_times(n, policy, T, rr_mode)
    if T == 0:
        return np.zeros(0)
    prompts = system_tokens + np.concatenate([[0], np.cumsum(users + replies)[:-1]]) + users
    held = prompts + replies - 1  # L_j
    out = np.zeros(T)
    for k in range(T):
        cap = B * ((int(prompts[k]) - 1) // B)
        hist = np.minimum(B * (held[:k][::-1] // B), cap)  # L_{k-1}, L_{k-2}, ..., L_0
        sys_c = min(B * (system_tokens // B), cap)
        out[k] = float((f[1 : k + 1] * hist).sum() + (1 - f[1 : k + 1].sum()) * sys_c)
    return out


def offset_distribution(records: pd.DataFrame, n: int) -> np.ndarray:
    """Observed law of the worker offset between consecutive turns (workers named w0..w{n-1})."""
    d = records.sort_values(["conversation", "turn"])
    w = d["worker"].str.lstrip("w").astype(int)
    off = (w.groupby(d["conversation"]).diff().dropna().astype(int)) % n
    counts = np.bincount(off.to_numpy(), minlength=n).astype(float)
    return counts / counts.sum() if counts.sum() else np.full(n, 1 / n)


def prompt_tokens(shape: ChatShape) -> np.ndarray:
    k = np.arange(shape.turns)
    return shape.system_tokens + k * shape.growth + shape.user_tokens


def expected_cached_shape(shape: ChatShape, n: int, policy: str, block_size: int = 1, rr_mode: str | Sequence[float] = "mixed") -> np.ndarray:
    """:func:`expected_cached` for a uniform chat."""
    T = shape.turns
    return expected_cached(shape.system_tokens, [shape.user_tokens] * T, [shape.reply_tokens] * T,
                           n, policy, block_size, rr_mode)


def closed_form_hit_rate(shape: ChatShape, n: int, policy: str, rr_mode: str = "mixed") -> float:
    """The continuous closed form over one chat (no blocks, no one-token corrections)."""
    _check(n, policy)
    S, u, g, T = shape.system_tokens, shape.user_tokens, shape.growth, shape.turns
    pairs = T * (T - 1) / 2
    denom = T * (S + u) + g * pairs
    sticky = T * S + g * pairs
    if n == 1 or policy == "sticky":
        return sticky / denom
    if policy == "round_robin" and rr_mode == "sequential":
        lost = g * sum(min(k, n - 1) for k in range(T))  # turn k reuses k - n + 1 turns (k >= n) of its k
        return (sticky - lost) / denom
    q = 1 - 1 / n
    return (sticky - g * (n - 1) * (T - n * (1 - q**T))) / denom


def reuse_lag_turns(k: int | np.ndarray, n: int) -> np.ndarray:
    """Turns of history random routing loses on turn k: (n - 1)(1 - (1 - 1/n)^k)."""
    return (n - 1) * (1 - (1 - 1 / n) ** np.asarray(k, dtype=float))


def expected_workers_used(n: int, draws: int) -> float:
    """Expected distinct workers among ``draws`` independent uniform choices."""
    return n * (1 - (1 - 1 / n) ** draws)


def conversation_sizes(trace) -> list[tuple[int, list[int], list[int]]]:
    """(system_tokens, user sizes, reply sizes) of each of a trace's conversations:
    what :func:`trace_hit_rate` takes."""
    return [(c.system_tokens, [t.user_tokens for t in c.turns], [t.output_tokens for t in c.turns])
            for c in trace.conversations]


def trace_hit_rate(
    conversations: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    n: int,
    policy: str,
    block_size: int = 1,
    rr_mode: str | Sequence[float] = "mixed",
    cold_start: bool = True,
) -> float:
    """Expected hit rate (cached / prompt tokens) over a set of conversations.

    Args:
        conversations: (system_tokens, user sizes, reply sizes) per conversation.
        cold_start: subtract the system prompt for the first request on each worker
            (expected number of workers used: n for round-robin, the expected distinct
            draws for random (over all requests) and sticky (over conversations)).
    """
    cached = prompt = 0.0
    sys_cached = []
    for S, users, replies in conversations:
        cached += float(expected_cached(S, users, replies, n, policy, block_size, rr_mode).sum())
        prompt += float(S * len(users) + sum(np.cumsum(np.add(users, replies))[:-1]) + sum(users))
        sys_cached.append(min(block_size * (S // block_size), block_size * ((S + users[0] - 1) // block_size)))
    if cold_start and conversations:
        requests = sum(len(u) for _, u, _ in conversations)
        used = {"round_robin": min(n, requests), "random": expected_workers_used(n, requests),
                "sticky": expected_workers_used(n, len(conversations))}[policy]
        cached -= used * float(np.mean(sys_cached))
    return cached / prompt if prompt else math.nan


# --- the sweep that checks the arithmetic against the simulator ---------------------

#: what the sweep varies, and what it holds fixed (note 2's chat shape, scaled down)
SWEEP_WORKERS = (2, 4, 8)
SWEEP_SYSTEM_WORDS = (0, 600, 1800)
SWEEP_WORKLOAD = {"chats": 64, "turns": 8, "user_words": 150, "reply_tokens": 128, "ramp_s": 3.0}
SWEEP_HARDWARE = "a6000x4"
SWEEP_SEED = 4
EXPERIMENT = "tn4-arithmetic"


def sweep_hardware(n: int):
    """The A6000 profile with ``n`` workers, one per GPU."""
    from kvroute.hardware import load_hardware

    base = load_hardware(SWEEP_HARDWARE)
    return replace(base, name=f"a6000x{n}", gpus=n, workers=n, workers_per_gpu=1,
                   description=f"{n} x NVIDIA RTX A6000 (the a6000x4 profile with {n} workers)")


def run_sweep(
    out_dir: Path,
    workers: Sequence[int] = SWEEP_WORKERS,
    system_words: Sequence[int] = SWEEP_SYSTEM_WORDS,
    workload: dict | None = None,
    policies: Sequence[str] = POLICIES,
    seed: int = SWEEP_SEED,
) -> pd.DataFrame:
    """Simulate every (n, S, policy) and write requests.parquet, summary.csv, predictions.csv.

    Each configuration replays the same note2-style trace (per S) through a fresh
    :class:`~kvroute.sim.cluster.SimCluster` on :func:`sweep_hardware`. Records carry
    ``experiment = tn4-arithmetic``, ``hardware = a6000x{n}`` and the policy, plus the
    columns ``workers`` and ``system_tokens``; the summary's groups are told apart by
    ``system_tokens`` (summary key ``round`` = index of S). Deterministic; writes atomically.

    Returns:
        The predictions frame (also written as predictions.csv).
    """
    from kvroute.policies import make_policy
    from kvroute.sim.cluster import SimCluster
    from kvroute.sim.run import common_rng
    from kvroute.workload import generate

    wl = dict(SWEEP_WORKLOAD, **(workload or {}))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    extra: list[tuple[int, int]] = []
    preds: list[dict] = []
    summaries = []
    for si, words in enumerate(system_words):
        trace = generate("note2", seed, system_words=int(words), **wl)
        shape = ChatShape.of(trace.conversations[0])
        S = shape.system_tokens
        convs = conversation_sizes(trace)
        for n in workers:
            hw = sweep_hardware(n)
            B = hw.engine.block_size
            for spec in policies:
                rng = np.random.default_rng([seed, si, n, POLICIES.index(spec) if spec in POLICIES else 99])
                policy = make_policy(spec, rng)  # its own stream; the jitter is common to (seed, S)
                t0 = time.perf_counter()
                run_rows = SimCluster(trace, hw, policy, common_rng(seed, si), policy.default_exact).run()
                wall = time.perf_counter() - t0
                common = {"source": "sim", "experiment": EXPERIMENT, "hardware": hw.name, "policy": spec,
                          "round": si, "view": "exact" if policy.default_exact else "approx", "seed": seed}
                run_rows = sorted(run_rows, key=lambda r: (r["arrival_s"], r["conversation"], r["turn"]))
                rows.extend({**common, **r} for r in run_rows)
                extra.extend((n, S) for _ in run_rows)
                df = pd.DataFrame([{**common, **r} for r in run_rows])
                summ = summarize(df, {(EXPERIMENT, hw.name, spec, si): hw.worker_names})
                summ["workers"] = n
                summ["system_tokens"] = S
                sim_s = df["finish_s"].max() - df["arrival_s"].min()
                summ["sim_seconds_per_wall_second"] = sim_s / wall if wall else math.nan
                summaries.append(summ)
                preds.append({
                    "experiment": EXPERIMENT, "hardware": hw.name, "policy": spec, "round": si,
                    "workers": n, "system_tokens": S, "user_tokens": shape.user_tokens,
                    "reply_tokens": shape.reply_tokens, "turns": shape.turns, "chats": len(convs),
                    "block_size": B,
                    "predicted_hit_rate": trace_hit_rate(convs, n, spec, B),
                    "predicted_warm_hit_rate": trace_hit_rate(convs, n, spec, B, cold_start=False),
                    "closed_form_hit_rate": closed_form_hit_rate(shape, n, spec),
                })
    table = requests_table(rows)
    table = table.append_column("workers", pa.array([e[0] for e in extra], type=pa.int32()))
    table = table.append_column("system_tokens", pa.array([e[1] for e in extra], type=pa.int64()))
    write_requests(table, out_dir / "requests.parquet")
    write_csv(pd.concat(summaries, ignore_index=True), out_dir / "summary.csv")
    pred = pd.DataFrame(preds)
    write_csv(pred, out_dir / "predictions.csv")
    return pred
