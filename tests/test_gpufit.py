"""The GPU families' coefficients come from independent measurements, reproducibly.

``kvroute fit-gpu`` fits them to hardware/measurements/gpu.yaml; the entries checked into
hardware/coefficients.yaml must be what a fresh fit writes (no hand edits), and their
provenance must name no result of a note the model is judged against.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.costmodel import StepTimeModel
from kvroute.gpufit import (
    PER_GPU,
    SHARED,
    coefficient_entries,
    default_measurements,
    fit_gpus,
    predict,
    read_measurements,
)
from kvroute.hardware import hardware_dir, load_hardware, load_model

ROOT = Path(__file__).resolve().parents[1]
#: what research note 2 publishes as results (the checks), never an input of a fit
#: (the note's "Results" section by its capitalised heading: the stated-facts source says "not results")
NOTE_RESULTS = re.compile(r"(?i:Table\s*[23]|least-loaded|hit rate|time to complete|later-turn|tokens/s per user)|\bResults\b")


def _checked_in() -> dict:
    return yaml.safe_load((hardware_dir() / "coefficients.yaml").read_text())


def test_checked_in_coefficients_are_a_fresh_fit():
    fresh = coefficient_entries(fit_gpus())
    stored = _checked_in()
    for family, entry in fresh.items():
        assert stored[family] == entry, f"{family}: hardware/coefficients.yaml differs from `kvroute fit-gpu`"


def test_provenance_names_no_note_result():
    """Every input and stated value of every fitted family, and the measurement file itself."""
    for family, entry in _checked_in().items():
        prov = entry.get("provenance") or {}
        text = yaml.safe_dump({k: prov.get(k) for k in ("inputs", "stated", "fitted", "method")})
        assert not NOTE_RESULTS.search(text), f"{family}'s provenance names a note result: {NOTE_RESULTS.search(text)}"
    _, obs, stated, sources = read_measurements(default_measurements())
    for name, text in sources.items():
        assert not NOTE_RESULTS.search(text), name
    assert all(o.source in sources for o in obs)
    assert {s["source"] for s in stated.values()} <= {*sources, "assumption"}


def test_research_note_profiles_use_the_fitted_families():
    fitted = set(fit_gpus().coefficients)
    for name in ("a6000x4", "a100x1", "a100x1-2workers"):
        assert load_hardware(name).coefficients_name in fitted, name


def test_fit_recovers_known_coefficients(tmp_path):
    """Observations made by the model itself, with known coefficients, give them back."""
    truth = {"mem_efficiency": 0.8, "compute_efficiency": 0.55, "step_overhead_ms": 3.0, "per_seq_overhead_ms": 0.07}
    gpus, obs, _, _ = read_measurements(default_measurements())
    raw = yaml.safe_load(default_measurements().read_text())
    for o, row in zip(obs, raw["observations"]):
        value = predict(o, load_model(o.model), gpus[o.gpu], truth)
        row["ms_per_token" if o.kind == "prefill_slope" else "ms"] = float(value)
        row["use"] = True  # every observation is exact here
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    fit = fit_gpus(path)
    for family, c in fit.coefficients.items():
        for k in PER_GPU + SHARED:
            assert c[k] == pytest.approx(truth[k], rel=0.02), (family, k)
    assert max(abs(r["rel_error"]) for r in fit.residuals) < 1e-3


def test_a_bad_observation_is_named(tmp_path):
    raw = yaml.safe_load(default_measurements().read_text())
    raw["observations"][3]["kind"] = "warp_drive"
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"observations\.3: kind 'warp_drive'"):
        fit_gpus(path)
    res = CliRunner().invoke(main, ["fit-gpu", str(path), "--out", str(tmp_path / "c.yaml")])
    assert res.exit_code != 0 and "warp_drive" in res.output


def test_fit_gpu_command_writes_entries_and_residuals(tmp_path):
    out = tmp_path / "coefficients.yaml"
    res = CliRunner().invoke(main, ["fit-gpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    entries = yaml.safe_load(out.read_text())
    assert set(entries) == {"gpu-a6000", "gpu-a100"}
    table = out.with_suffix(".csv").read_text().splitlines()
    assert len(table) == 1 + len(read_measurements(default_measurements())[1])


def test_the_vocabulary_splits_the_head_from_the_body(tmp_path):
    """Qwen2.5-7B: the body is about 6.5 B parameters; a step reads body and head, not the
    embedding table. A model without ``vocab`` counts every parameter as body (as before)."""
    qwen = load_model("qwen2.5-7b")
    assert 6.4e9 < qwen.body_params < 6.6e9
    assert qwen.read_bytes_per_step == pytest.approx((qwen.params - qwen.vocab * qwen.hidden) * qwen.dtype_bytes)
    tiny = load_model("tiny-qwen2")
    assert tiny.body_params == tiny.params and tiny.read_bytes_per_step == tiny.weight_bytes
    d = tmp_path / "hw"
    shutil.copytree(hardware_dir(), d)
    models = yaml.safe_load((d / "models.yaml").read_text())
    models["qwen2.5-7b"]["tied_embeddings"] = True
    (d / "models.yaml").write_text(yaml.safe_dump(models))
    tied = load_model("qwen2.5-7b", d)
    assert tied.body_params == pytest.approx(qwen.body_params + qwen.head_params)


def test_lm_head_costs_once_per_sequence():
    """Prefill of q tokens pays the body q times and the head once; a decode step pays both
    once per sequence."""
    m = StepTimeModel.from_hardware(load_hardware("a6000x4"))
    one = m.prefill_time(1000)
    more = m.prefill_time(2000)
    head = m.head_flops_per_seq / m.peak
    assert head > 0
    assert more - one == pytest.approx(1000 * m.flops_per_token / m.peak + m.attn_flops_per_pair * (2000**2 - 1000**2) / 2 / m.peak)
    assert one == pytest.approx((1000 * m.flops_per_token + m.head_flops_per_seq + m.attn_flops_per_pair * 1000**2 / 2) / m.peak)
