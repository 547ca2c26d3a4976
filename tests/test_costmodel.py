"""The step-time model: physical sanity and agreement between its fast and slow paths."""

from pathlib import Path

import numpy as np
import pytest

from dataclasses import replace

from kvroute.costmodel import StepTimeModel
from kvroute.hardware import available_hardware, load_hardware


def with_attention(name: str, cached: float, chunk: float):
    """Profile ``name`` with attention at rates of its own (as the CPU probe fits them)."""
    hw = load_hardware(name)
    return replace(hw, coefficients=replace(hw.coefficients, attn_cached_efficiency=cached, attn_chunk_efficiency=chunk))


@pytest.fixture(params=["a6000x4", "a100x1", "cpu", "cpu-attention"])
def model(request):
    if request.param == "cpu-attention":  # both rates unlike the body's: every path takes the split
        return StepTimeModel.from_hardware(with_attention("cpu", 0.9, 2.5))
    return StepTimeModel.from_hardware(load_hardware(request.param))


def test_decode_steps_match_step_time(model):
    """The vectorised decode run equals the per-step formula summed."""
    n, ctx0, k = 12, 12 * 900, 40
    ends = model.decode_steps(n, ctx0, k)
    slow = np.cumsum([model.step_time(n, ctx0 + i * n) for i in range(k)])
    assert np.allclose(ends, slow, rtol=1e-12)


def test_step_time_grows_with_work(model):
    base = model.step_time(8, 8 * 1000)
    assert model.step_time(16, 16 * 1000) >= base
    assert model.step_time(8, 8 * 4000) >= base
    assert model.step_time(8, 8 * 1000, [(2048, 0)]) > base


def test_sharing_a_device_scales_time(model):
    assert model.step_time(4, 4000, share=2.0) == pytest.approx(2 * model.step_time(4, 4000))


def test_a6000_decode_is_memory_bound_near_published_speed():
    """Note 2: about 30 tokens/s per user with 16 chats per A6000 -> ~33 ms a step."""
    m = StepTimeModel.from_hardware(load_hardware("a6000x4"))
    t = m.step_time(16, 16 * 1500)
    assert 0.020 < t < 0.040
    floor = load_hardware("a6000x4").model.weight_bytes / (768e9)  # all weights at full bandwidth
    assert t > floor


def test_prefill_time_is_monotone(model):
    assert model.prefill_time(0) == 0
    assert model.prefill_time(100) < model.prefill_time(1000) < model.prefill_time(1000, context=4000)


def test_attention_at_the_body_s_rate_is_the_model_without_the_split():
    """Efficiencies equal to compute_efficiency give the unsplit model's times (to rounding):
    the split only moves attention's pairs to rates of their own."""
    hw = load_hardware("cpu")
    eff = hw.coefficients.compute_efficiency
    plain, split = StepTimeModel.from_hardware(hw), StepTimeModel.from_hardware(with_attention("cpu", eff, eff))
    assert plain.attn_cached_s_per_pair is None and split.attn_cached_s_per_pair is not None
    for args in ((4, 4 * 2000, ()), (0, 0, [(2048, 0)]), (2, 900, [(964, 2048), (100, 30)])):
        assert split.step_time(*args) == pytest.approx(plain.step_time(*args), rel=1e-12)
    assert split.decode_steps(4, 4000, 50) == pytest.approx(plain.decode_steps(4, 4000, 50), rel=1e-12)
    assert split.prefill_time(3000, 500) == pytest.approx(plain.prefill_time(3000, 500), rel=1e-12)


def test_each_attention_rate_prices_its_own_pairs():
    """Cached-KV pairs (decode context, a chunk against earlier tokens) at one rate, a chunk's
    causal pairs within itself at the other: slowing one leaves the other's work unchanged."""
    base = StepTimeModel.from_hardware(with_attention("cpu", 1.0, 1.0))
    slow_cached = StepTimeModel.from_hardware(with_attention("cpu", 0.5, 1.0))
    slow_chunk = StepTimeModel.from_hardware(with_attention("cpu", 1.0, 0.5))
    q, c = 1000, 2000
    extra = base.attn_flops_per_pair / base.peak * load_hardware("cpu").coefficients.compute_efficiency
    # compute-bound prefill: the difference is exactly the pairs at the halved rate
    assert slow_cached.step_time(0, 0, [(q, c)]) - base.step_time(0, 0, [(q, c)]) == pytest.approx(extra * q * c, rel=1e-9)
    assert slow_chunk.step_time(0, 0, [(q, c)]) - base.step_time(0, 0, [(q, c)]) == pytest.approx(extra * q * q / 2, rel=1e-9)
    assert slow_chunk.prefill_time(q, c) - base.prefill_time(q, c) == pytest.approx(extra * q * q / 2, rel=1e-9)
    # a decode step's pairs are all against the cache
    assert slow_chunk.decode_steps(4, 4 * 3000, 10) == base.decode_steps(4, 4 * 3000, 10)


def test_one_attention_rate_alone_is_refused():
    with pytest.raises(ValueError, match="come together"):
        StepTimeModel.from_hardware(with_attention("cpu", 0.9, None))
    with pytest.raises(ValueError, match="attn_chunk_efficiency must be above 0"):
        StepTimeModel.from_hardware(with_attention("cpu", 0.9, 0.0))


def test_unknown_hardware_lists_valid_names():
    with pytest.raises(ValueError) as exc:
        load_hardware("tpu-v9")
    for name in available_hardware():
        assert name in str(exc.value)


def test_profiles_have_kv_room():
    for name in available_hardware():
        hw = load_hardware(name)
        assert hw.num_blocks * hw.engine.block_size > 16_000, name
    assert load_hardware("cpu").engine.block_size == 128
    assert load_hardware("a6000x4").engine.block_size == 16


def test_engine_dtype_sets_the_bytes_per_element(tmp_path):
    """The cpu profile serves its model in float32: 4 bytes per weight and KV element,
    so half the KV tokens of bfloat16 fit its fixed budget; an unknown dtype is an error."""
    import shutil

    import yaml

    cpu = load_hardware("cpu")
    assert cpu.engine.dtype == "float32" and cpu.model.dtype_bytes == 4
    assert cpu.num_blocks * cpu.engine.block_size == cpu.kv_cache_bytes // cpu.model.kv_bytes_per_token
    assert load_hardware("a6000x4").engine.dtype == "auto" and load_hardware("a6000x4").model.dtype_bytes == 2

    def with_dtype(dtype: str):
        d = tmp_path / dtype  # one folder per variant: profiles are cached by folder
        d.mkdir()
        for name in ("cpu", "models", "coefficients"):
            shutil.copy(Path(__file__).resolve().parents[1] / "hardware" / f"{name}.yaml", d)
        raw = yaml.safe_load((d / "cpu.yaml").read_text())
        raw["engine"]["dtype"] = dtype
        (d / "cpu.yaml").write_text(yaml.safe_dump(raw))
        return load_hardware("cpu", d)

    bf16 = with_dtype("bfloat16")
    assert bf16.model.dtype_bytes == 2 and bf16.num_blocks == 2 * cpu.num_blocks
    with pytest.raises(ValueError, match="engine.dtype 'int3'"):
        with_dtype("int3")


def test_profiles_are_checked_against_the_schema_naming_the_key(tmp_path):
    """The cpu profile pins each worker's process tree to its own core; a misspelt key, an
    unknown cpu_affinity, or per_worker on a GPU profile is rejected before anything runs."""
    import shutil

    import yaml

    assert load_hardware("cpu").engine.cpu_affinity == "per_worker"
    assert load_hardware("cpu").to_dict()["cpu_affinity"] == "per_worker"
    assert load_hardware("a6000x4").engine.cpu_affinity == "none"

    def variant(tag: str, profile: str, change) -> None:
        d = tmp_path / tag  # one folder per variant: profiles are cached by folder
        d.mkdir()
        for name in (profile, "models", "coefficients"):
            shutil.copy(Path(__file__).resolve().parents[1] / "hardware" / f"{name}.yaml", d)
        raw = yaml.safe_load((d / f"{profile}.yaml").read_text())
        change(raw)
        (d / f"{profile}.yaml").write_text(yaml.safe_dump(raw))
        load_hardware(profile, d)

    with pytest.raises(ValueError, match=r"key engine.cpu_affinity: 'per_core' is not one of"):
        variant("unknown", "cpu", lambda raw: raw["engine"].update(cpu_affinity="per_core"))
    with pytest.raises(ValueError, match=r"key engine.cpu_afinity|'cpu_afinity' was unexpected"):
        variant("misspelt", "cpu", lambda raw: raw["engine"].update(cpu_afinity="per_worker"))
    with pytest.raises(ValueError, match=r"key engine.cpu_affinity: 'per_worker' places vllm-cpu workers"):
        variant("gpu", "a6000x4", lambda raw: raw["engine"].update(cpu_affinity="per_worker"))
    with pytest.raises(ValueError, match=r"key workers: 0 is less than the minimum of 1"):
        variant("workers", "cpu", lambda raw: raw.update(workers=0))
    # the client is pinned to a worker's core, so it needs per_worker and a worker that exists
    assert load_hardware("cpu").engine.client_worker == 1 and load_hardware("a6000x4").engine.client_worker is None
    with pytest.raises(ValueError, match=r"key engine.client_worker: pins the client .* needs engine.cpu_affinity"):
        variant("client-unpinned", "cpu", lambda raw: raw["engine"].update(cpu_affinity="none"))
    with pytest.raises(ValueError, match=r"key engine.client_worker: 2 names no worker \(workers: 2\)"):
        variant("client-range", "cpu", lambda raw: raw["engine"].update(client_worker=2))
    variant("none", "cpu", lambda raw: (raw["engine"].update(cpu_affinity="none"),  # the other valid value
                                        raw["engine"].pop("client_worker")))
