"""The step-time model: physical sanity and agreement between its fast and slow paths."""

import numpy as np
import pytest

from kvroute.costmodel import StepTimeModel
from kvroute.hardware import available_hardware, load_hardware


@pytest.fixture(params=["a6000x4", "a100x1", "cpu"])
def model(request):
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
