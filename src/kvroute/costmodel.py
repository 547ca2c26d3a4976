"""Step time of a vLLM-like engine from a hardware profile (a roofline with overheads).

One engine step processes a batch: ``n_decode`` sequences decoding one token each and
prefill chunks of ``q`` new tokens on top of ``c`` already-computed tokens. Its time is

    step = (step_overhead + per_seq_overhead * seqs) * 1e-3
           + max(bytes / (bw * mem_efficiency), flops / (peak * compute_efficiency))
    bytes = read_bytes + kv_bytes_per_token * (context read by every sequence)
    flops = 2 * body_params * tokens + 2 * head_params * seqs
            + 4 * layers * heads * head_dim * (query x context pairs)

``read_bytes`` is the body and the LM head (the embedding table is only looked up);
the LM head's FLOPs are paid once per sequence (vLLM computes logits only at the
positions it samples), the body's once per token. A model profile without ``vocab``
counts every parameter as body, as the model did before the split.

Attention runs at the body's rate unless a profile's coefficients give it rates of its own
(``attn_cached_efficiency``, ``attn_chunk_efficiency``; the CPU probe fits them, no GPU
family has them). Then its query x key pairs split in two, each at its own effective rate:

    attention = 4 * layers * heads * head_dim * (cached pairs / (peak * attn_cached_efficiency)
                                                 + chunk pairs / (peak * attn_chunk_efficiency))
    cached pairs = decode context + q * c per prefill chunk   (against KV already in the cache)
    chunk pairs  = q * q / 2 per prefill chunk                (causal, within the new chunk)

vLLM's CPU build runs the two through different kernels (a dense SDPA over the new chunk,
a paged-KV kernel against the cache), and on a model as small as the cpu profile's the
attention of a 3,000-token prompt costs as much as its body, so one rate for all of it
bends every long prefill (docs/costmodel.md, "Prefill and attention on CPU").

multiplied by ``share`` when several workers time-share one device. This is the one
place latency comes from: the engine model never hard-codes a duration.

A worker spanning ``tp`` GPUs (tensor parallelism) reads ``1/tp`` of the weights and of
the KV on each and does ``1/tp`` of the FLOPs, so ``bw`` and ``peak`` are ``tp`` GPUs'
worth, and it all-reduces each layer's activations twice (after attention and after the
MLP), ``tokens x hidden x dtype_bytes`` each, over the ``gpu.interconnect``: a ring
all-reduce sends ``2 (tp - 1) / tp`` of the bytes through each GPU's link, plus a fixed
latency per collective. That time is added to the step, not overlapped with it:

    comm = 2 * layers * (latency + 2 (tp - 1) / tp * tokens * hidden * dtype_bytes / link_bw)

With ``tp`` = 1 there is no communication and the model is the one above, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvroute.hardware import Hardware, Model

TFLOP = 1e12
GBPS = 1e9


@dataclass(frozen=True)
class StepTimeModel:
    """Roofline step time with fixed overheads, built from a :class:`Hardware` profile."""

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float  # 2 x body params
    head_flops_per_seq: float  # 2 x LM-head params
    attn_flops_per_pair: float  # 4 x layers x heads x head_dim
    bw: float  # effective bytes/s
    peak: float  # effective FLOP/s
    step_overhead_s: float
    per_seq_overhead_s: float
    # tensor parallelism's all-reduces (zero on one GPU): their latencies, paid once a step,
    # and their transfer time per token in the step
    comm_step_s: float = 0.0
    comm_per_token_s: float = 0.0
    #: seconds per attention pair against cached KV and within a prefill chunk, where the
    #: coefficients give attention its own rates (both or neither); None: ``attn_flops_per_pair
    #: / peak``, the body's rate, by the expression the model always had (the same bits)
    attn_cached_s_per_pair: float | None = None
    attn_chunk_s_per_pair: float | None = None
    #: seconds a step spends admitting each request that starts in it (``Coefficients.admission_ms``)
    admission_s: float = 0.0

    @classmethod
    def from_hardware(cls, hw: Hardware) -> StepTimeModel:
        m, c, tp = hw.model, hw.coefficients, hw.tensor_parallel
        comm_step, comm_token = 0.0, 0.0
        if tp > 1:
            if hw.interconnect is None:
                raise ValueError(f"hardware {hw.name!r}: tensor_parallel {tp} needs gpu.interconnect")
            link = hw.interconnect
            collectives = allreduces_per_step(m)
            comm_step = collectives * allreduce_s(0, tp, link.bw_gbps, link.latency_us)
            comm_token = collectives * allreduce_s(m.hidden * m.dtype_bytes, tp, link.bw_gbps, 0.0)
        return cls(
            weight_bytes=m.read_bytes_per_step,
            kv_bytes_per_token=hw.kv_bytes_per_token,
            flops_per_token=2.0 * m.body_params,
            head_flops_per_seq=2.0 * m.head_params,
            attn_flops_per_pair=4.0 * m.layers * m.heads * m.head_dim,
            # each of the tp GPUs reads 1/tp of the bytes and does 1/tp of the FLOPs
            bw=hw.mem_bw_gbps * GBPS * c.mem_efficiency * tp,
            peak=hw.tflops * TFLOP * c.compute_efficiency * tp,
            step_overhead_s=c.step_overhead_ms * 1e-3,
            per_seq_overhead_s=c.per_seq_overhead_ms * 1e-3,
            comm_step_s=comm_step,
            comm_per_token_s=comm_token,
            admission_s=c.admission_ms * 1e-3,
            **attention_rates(4.0 * m.layers * m.heads * m.head_dim, hw.tflops * TFLOP * tp,
                              c.attn_cached_efficiency, c.attn_chunk_efficiency),
        )

    def comm_time(self, tokens: int) -> float:
        """Seconds a step of ``tokens`` tokens spends in tensor parallelism's all-reduces."""
        return self.comm_step_s + self.comm_per_token_s * tokens

    def step_time(
        self,
        n_decode: int,
        decode_ctx: int,
        prefills: Iterable[tuple[int, int]] = (),
        share: float = 1.0,
        admissions: int = 0,
    ) -> float:
        """Seconds for one step.

        Args:
            n_decode: sequences decoding one token.
            decode_ctx: total context tokens those sequences attend to.
            prefills: ``(q, c)`` pairs: q new prompt tokens after c computed ones.
            share: how many workers are time-sharing the device right now.
            admissions: requests admitted in this step (their first chunk is among ``prefills``).
        """
        seqs, tokens, ctx, pairs = n_decode, n_decode, decode_ctx, float(decode_ctx)
        if self.attn_cached_s_per_pair is None:
            for q, c in prefills:
                seqs += 1
                tokens += q
                ctx += c + q
                pairs += q * (c + q / 2.0)
            comp = (self.flops_per_token * tokens + self.head_flops_per_seq * seqs
                    + self.attn_flops_per_pair * pairs) / self.peak
        else:  # attention at its own rates: pairs against the cache, and within each chunk
            chunk = 0.0
            for q, c in prefills:
                seqs += 1
                tokens += q
                ctx += c + q
                pairs += q * c
                chunk += q * q / 2.0
            comp = ((self.flops_per_token * tokens + self.head_flops_per_seq * seqs) / self.peak
                    + self.attn_cached_s_per_pair * pairs + self.attn_chunk_s_per_pair * chunk)
        mem = (self.weight_bytes + self.kv_bytes_per_token * ctx) / self.bw
        fixed = self.step_overhead_s + self.per_seq_overhead_s * seqs
        if self.comm_step_s or self.comm_per_token_s:  # tensor parallel (kept out on one GPU: same bits)
            fixed += self.comm_step_s + self.comm_per_token_s * tokens
        if admissions:
            fixed += self.admission_s * admissions
        return share * (fixed + max(mem, comp))

    def decode_steps(self, n: int, ctx0: int, k: int, share: float = 1.0) -> list[float]:
        """Cumulative end times of ``k`` pure-decode steps of ``n`` sequences.

        The context grows by ``n`` tokens a step; step ``i`` reads ``ctx0 + i * n``.
        Closed form when one roofline term bounds every step (in plain floats for a
        short run, where numpy's per-call cost would dominate; vectorised for a long
        one, the same operations in the same order so the same bits), so the
        simulator can advance many steps at once.
        """
        fixed = self.step_overhead_s + self.per_seq_overhead_s * n
        if self.comm_step_s or self.comm_per_token_s:  # n tokens a step: a constant all-reduce time
            fixed += self.comm_step_s + self.comm_per_token_s * n
        # both roofline terms are linear in the step index i: t_i = base + slope * i
        mem0 = (self.weight_bytes + self.kv_bytes_per_token * ctx0) / self.bw
        mem_slope = self.kv_bytes_per_token * n / self.bw
        per_decode = self.flops_per_token + self.head_flops_per_seq  # one token and one sampled position
        if self.attn_cached_s_per_pair is None:
            comp0 = (per_decode * n + self.attn_flops_per_pair * ctx0) / self.peak
            comp_slope = self.attn_flops_per_pair * n / self.peak
        else:  # a decode token's pairs are all against the cache
            comp0 = per_decode * n / self.peak + self.attn_cached_s_per_pair * ctx0
            comp_slope = self.attn_cached_s_per_pair * n
        last = k - 1
        for t0, slope, o0, oslope in ((mem0, mem_slope, comp0, comp_slope), (comp0, comp_slope, mem0, mem_slope)):
            if t0 >= o0 and t0 + slope * last >= o0 + oslope * last:  # one term bounds every step
                # share * ((fixed + t0) * i + slope * i * (i - 1) / 2) for steps done i = 1..k,
                # with the exact halving folded into slope
                half, per_step = 0.5 * slope, fixed + t0
                if k <= 32:
                    ends = [half * i * (i - 1.0) + per_step * i for i in map(float, range(1, k + 1))]
                    return [e * share for e in ends] if share != 1.0 else ends
                a = np.arange(k + 1, dtype=np.float64)
                i = a[1:]
                out = half * i
                out *= a[:-1]
                out += per_step * i
                if share != 1.0:
                    out *= share
                return out.tolist()
        ctx = ctx0 + n * np.arange(k, dtype=np.float64)
        mem = (self.weight_bytes + self.kv_bytes_per_token * ctx) / self.bw
        if self.attn_cached_s_per_pair is None:
            comp = (per_decode * n + self.attn_flops_per_pair * ctx) / self.peak
        else:
            comp = per_decode * n / self.peak + self.attn_cached_s_per_pair * ctx
        return np.cumsum(share * (fixed + np.maximum(mem, comp))).tolist()

    def prefill_time(self, tokens: int, context: int = 0) -> float:
        """Estimated extra time to prefill ``tokens`` (compute-bound marginal cost).

        Used by the routers' view (cost_aware's "prefill saved by reuse"); the
        engine itself always goes through :meth:`step_time`.
        """
        if tokens <= 0:
            return 0.0
        if self.attn_cached_s_per_pair is None:
            pairs = tokens * (context + tokens / 2.0)
            compute = (self.flops_per_token * tokens + self.head_flops_per_seq
                       + self.attn_flops_per_pair * pairs) / self.peak
        else:
            compute = ((self.flops_per_token * tokens + self.head_flops_per_seq) / self.peak
                       + self.attn_cached_s_per_pair * tokens * context
                       + self.attn_chunk_s_per_pair * tokens * tokens / 2.0)
        if self.comm_per_token_s:  # the tokens' share of the all-reduces' transfers
            compute += self.comm_per_token_s * tokens
        return compute


def attention_rates(attn_flops_per_pair: float, nominal_peak: float, cached_efficiency: float | None,
                    chunk_efficiency: float | None) -> dict[str, float | None]:
    """:class:`StepTimeModel`'s seconds per attention pair at ``nominal_peak`` (FLOP/s) times
    each efficiency: against cached KV and within a prefill chunk. Both or neither: a
    profile with one alone is an error (which rate would the other pairs run at?)."""
    if cached_efficiency is None and chunk_efficiency is None:
        return {"attn_cached_s_per_pair": None, "attn_chunk_s_per_pair": None}
    if cached_efficiency is None or chunk_efficiency is None:
        raise ValueError("attn_cached_efficiency and attn_chunk_efficiency come together: "
                         f"got {cached_efficiency!r} and {chunk_efficiency!r}")
    for name, eff in (("attn_cached_efficiency", cached_efficiency), ("attn_chunk_efficiency", chunk_efficiency)):
        if not eff > 0:
            raise ValueError(f"{name} must be above 0, got {eff!r}")
    return {"attn_cached_s_per_pair": attn_flops_per_pair / (nominal_peak * cached_efficiency),
            "attn_chunk_s_per_pair": attn_flops_per_pair / (nominal_peak * chunk_efficiency)}


def allreduces_per_step(model: Model) -> int:
    """All-reduces of a tensor-parallel step: two per transformer layer (after attention's
    output projection and after the MLP's down projection, Megatron-style as vLLM splits them)."""
    return 2 * model.layers


def allreduce_s(nbytes: float, tp: int, bw_gbps: float, latency_us: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``tp`` GPUs: ``latency`` plus
    ``2 (tp - 1) / tp`` of the bytes through each GPU's link of ``bw_gbps`` (GB/s, per
    direction): a reduce-scatter and an all-gather, ``tp - 1`` steps of ``nbytes / tp`` each."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    if tp == 1:
        return 0.0
    return latency_us * 1e-6 + 2.0 * (tp - 1) / tp * nbytes / (bw_gbps * GBPS)
