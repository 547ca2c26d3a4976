"""``kvroute fit-gpu``: the GPU families' step-time coefficients from independent measurements.

The coefficients of :mod:`kvroute.costmodel` are fitted to published measurements of
the profiles' GPUs that no note rebuilds (``hardware/measurements/gpu.yaml``, each with
its source), so that research note 2's tables are predictions, not fits. Per GPU the
fit finds the memory and compute efficiencies (fractions of the datasheet's bandwidth
and dense BF16 peak); the engine's step and per-sequence overheads are the software's,
shared by every GPU of the family, and only whole-step timings (the A6000 decode sweep)
pin them down.

Each observation is predicted by the same roofline the simulator runs: a whole decode
step through :class:`~kvroute.costmodel.StepTimeModel`, a prefill slope as the
difference of two prefill steps, an operator timing (linear layers, one layer's
attention) as the roofline of that operator's bytes and FLOPs, without overheads.
The loss is the sum of squared log ratios predicted/measured (a ratio weighs the same
at any scale), minimised by ``scipy.optimize.least_squares`` within physical bounds;
standard errors come from its Jacobian. Coefficients the data cannot give (the API
server's overhead, its jitter, the activation reserve) are taken from the file's
``stated`` section, each with its source. Deterministic: same file, same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from kvroute.costmodel import GBPS, TFLOP, StepTimeModel
from kvroute.hardware import Model, hardware_dir, load_hardware, load_model
from kvroute.yamlfile import read_yaml

#: fitted per GPU (fractions of the datasheet) and shared by the family (the engine's software)
PER_GPU = ("mem_efficiency", "compute_efficiency")
SHARED = ("step_overhead_ms", "per_seq_overhead_ms")
STATED = ("api_overhead_ms", "api_jitter_ms", "activation_reserve_gb")
#: (lower, upper, start) of each coefficient: efficiencies cannot pass the datasheet
BOUNDS = {"mem_efficiency": (0.05, 1.0, 0.7), "compute_efficiency": (0.05, 1.0, 0.6),
          "step_overhead_ms": (0.0, 50.0, 2.0), "per_seq_overhead_ms": (0.0, 5.0, 0.05)}
KINDS = ("decode_step", "prefill_slope", "linear_layers", "decode_attention", "prefill_attention")
#: the measurement's key that states how big the work was, per kind
SIZE_KEYS = {"decode_step": ("seqs", "context"), "prefill_slope": ("from", "to"), "linear_layers": ("tokens",),
             "decode_attention": ("batch", "context"), "prefill_attention": ("tokens",)}


def default_measurements() -> Path:
    return hardware_dir() / "measurements" / "gpu.yaml"


@dataclass(frozen=True)
class Observation:
    """One measured timing: what ran, on which GPU, and how long it took (ms or ms/token)."""

    gpu: str
    source: str
    kind: str
    model: str
    size: dict[str, int]
    measured: float
    use: bool = True
    why: str = ""

    @property
    def label(self) -> str:
        return f"{self.kind} " + " ".join(f"{k}={v}" for k, v in self.size.items())


@dataclass(frozen=True)
class Gpu:
    name: str
    profile: str
    family: str
    bw: float  # bytes/s, datasheet
    peak: float  # FLOP/s, datasheet


@dataclass
class GpuFit:
    """The fit's outcome: coefficients per family, their standard errors, every residual."""

    coefficients: dict[str, dict[str, float]]
    errors: dict[str, dict[str, float]]
    residuals: list[dict] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    stated: dict[str, dict] = field(default_factory=dict)


def read_measurements(path: Path) -> tuple[dict[str, Gpu], list[Observation], dict, dict[str, str]]:
    """The file's GPUs, observations, stated coefficients and sources; ValueError naming a bad entry."""
    raw = read_yaml(path)
    sources = {k: " ".join(str(v).split()) for k, v in raw["sources"].items()}
    gpus = {}
    for name, g in raw["gpus"].items():
        hw = load_hardware(g["profile"])
        gpus[name] = Gpu(name, g["profile"], g["family"], hw.mem_bw_gbps * GBPS, hw.tflops * TFLOP)
    obs = []
    for i, o in enumerate(raw["observations"]):
        where = f"{path}: observations.{i}"
        kind = o.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if o.get("gpu") not in gpus:
            raise ValueError(f"{where}: gpu {o.get('gpu')!r} is not in gpus ({', '.join(gpus)})")
        if o.get("source") not in sources:
            raise ValueError(f"{where}: source {o.get('source')!r} is not in sources")
        missing = [k for k in SIZE_KEYS[kind] if k not in o]
        if missing:
            raise ValueError(f"{where}: a {kind} needs {', '.join(missing)}")
        value = o["ms_per_token"] if kind == "prefill_slope" else o["ms"]
        obs.append(Observation(o["gpu"], o["source"], kind, o["model"], {k: int(o[k]) for k in SIZE_KEYS[kind]},
                               float(value), bool(o.get("use", True)), " ".join(str(o.get("why", "")).split())))
    stated = raw["stated"]
    for key in STATED:
        if key not in stated:
            raise ValueError(f"{path}: stated.{key} is missing")
        if stated[key]["source"] not in sources and stated[key]["source"] != "assumption":
            raise ValueError(f"{path}: stated.{key}.source {stated[key]['source']!r} is not in sources")
    return gpus, obs, stated, sources


def _roofline(nbytes: float, flops: float, bw: float, peak: float) -> float:
    return max(nbytes / bw, flops / peak)


def predict(o: Observation, model: Model, gpu: Gpu, coef: dict[str, float]) -> float:
    """The model's time for observation ``o`` (ms, or ms per token for a slope)."""
    bw, peak = gpu.bw * coef["mem_efficiency"], gpu.peak * coef["compute_efficiency"]
    s = o.size
    if o.kind in ("decode_step", "prefill_slope"):
        m = step_model(model, bw, peak, coef)
        if o.kind == "decode_step":
            return 1e3 * m.step_time(s["seqs"], s["seqs"] * s["context"])
        lo, hi = s["from"], s["to"]
        return 1e3 * (m.step_time(0, 0, [(hi, 0)]) - m.step_time(0, 0, [(lo, 0)])) / (hi - lo)
    per_layer_kv = model.kv_bytes_per_token / model.layers
    attn = 4.0 * model.heads * model.head_dim  # FLOPs per (query, key) pair in one layer
    if o.kind == "linear_layers":
        body = model.body_params
        return 1e3 * _roofline(body * model.dtype_bytes, 2.0 * body * s["tokens"], bw, peak)
    if o.kind == "decode_attention":
        pairs = s["batch"] * s["context"]
        return 1e3 * _roofline(per_layer_kv * pairs, attn * pairs, bw, peak)
    q = s["tokens"]  # prefill_attention: causal, empty cache
    return 1e3 * _roofline(per_layer_kv * q, attn * q * q / 2.0, bw, peak)


def step_model(model: Model, bw: float, peak: float, coef: dict[str, float],
               attention: dict[str, float | None] | None = None) -> StepTimeModel:
    """The simulator's step-time model of ``model`` at effective ``bw`` (bytes/s) and ``peak``
    (FLOP/s) with ``coef``'s overheads, and attention at ``attention``'s rates
    (:func:`kvroute.costmodel.attention_rates`; None: the body's): what every fit here predicts through."""
    return StepTimeModel(
        weight_bytes=model.read_bytes_per_step, kv_bytes_per_token=model.kv_bytes_per_token,
        flops_per_token=2.0 * model.body_params, head_flops_per_seq=2.0 * model.head_params,
        attn_flops_per_pair=4.0 * model.layers * model.heads * model.head_dim, bw=bw, peak=peak,
        step_overhead_s=coef["step_overhead_ms"] * 1e-3, per_seq_overhead_s=coef["per_seq_overhead_ms"] * 1e-3,
        **(attention or {}))


def fit_least_squares(residuals, x0, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """Minimise ``sum(residuals(x)**2)`` within ``[lo, hi]``; the optimum and its standard errors.

    The errors come from the Jacobian at the optimum, scaled by the residual variance
    (sum of squares over the degrees of freedom): they say how well the observations pin
    each coefficient down, assuming independent residuals of one common spread. A
    coefficient no residual depends on at the optimum (a zero Jacobian column: its term
    never binds) has no standard error: NaN, not the pseudo-inverse's 0.
    """
    res = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac")
    dof = max(1, res.fun.size - len(x0))
    cov = np.linalg.pinv(res.jac.T @ res.jac) * float(res.fun @ res.fun) / dof
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    flat = np.linalg.norm(res.jac, axis=0) <= 1e-12 * max(1.0, float(np.abs(res.jac).max(initial=0.0)))
    return res.x, np.where(flat, np.nan, se)


def fit_gpus(path: Path | None = None) -> GpuFit:
    """Fit every GPU of the measurement file; see the module docstring."""
    path = Path(path or default_measurements())
    gpus, obs, stated, sources = read_measurements(path)
    used = [o for o in obs if o.use]
    models = {name: load_model(name) for name in sorted({o.model for o in obs})}
    names = [(g, k) for g in gpus for k in PER_GPU] + [("*", k) for k in SHARED]
    lo = [BOUNDS[k][0] for _, k in names]
    hi = [BOUNDS[k][1] for _, k in names]
    x0 = [BOUNDS[k][2] for _, k in names]

    def coef_of(x, gpu: str) -> dict[str, float]:
        return {k: x[names.index((gpu, k) if k in PER_GPU else ("*", k))] for k in PER_GPU + SHARED}

    def residuals(x, which=used):
        return np.array([np.log(predict(o, models[o.model], gpus[o.gpu], coef_of(x, o.gpu)) / o.measured)
                         for o in which])

    x, se = fit_least_squares(residuals, x0, lo, hi)
    coefficients, errors = {}, {}
    for g, gpu in gpus.items():
        c = coef_of(x, g)
        coefficients[gpu.family] = {k: float(v) for k, v in c.items()}
        errors[gpu.family] = {k: float(se[names.index((g, k) if k in PER_GPU else ("*", k))]) for k in c}
    rows = []
    for o in obs:
        pred = predict(o, models[o.model], gpus[o.gpu], coef_of(x, o.gpu))
        rows.append({"family": gpus[o.gpu].family, "source": o.source, "observation": o.label, "model": o.model,
                     "measured": o.measured, "predicted": float(pred), "rel_error": float(pred / o.measured - 1),
                     "used": o.use, "why": o.why})
    return GpuFit(coefficients, errors, rows, sources, stated)


def _sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def signed_percent(x: float) -> str:
    """``x`` as a signed percentage to 0.1%; a zero is "+0.0%" whatever its floating-point
    sign, so a provenance line does not flip between machines on the last bit of a fit."""
    return f"{round(x * 100, 1) + 0.0:+.1f}%"


def residual_line(r: dict) -> str:
    """One residual as a line of the provenance: what, where from, measured, predicted, error."""
    unit = "ms/token" if r["observation"].startswith("prefill_slope") else "ms"
    line = (f"{r['observation']} ({r['model']}, {r['source']}): measured {r['measured']:.4g} {unit}, "
            f"predicted {r['predicted']:.4g} ({signed_percent(r['rel_error'])})")
    return line if r["used"] else f"{line}; left out: {r['why']}"


def coefficient_entries(fit: GpuFit, measurements: str = "hardware/measurements/gpu.yaml") -> dict[str, dict]:
    """``hardware/coefficients.yaml`` entries: values (3 significant digits) and their provenance."""
    out = {}
    families = list(fit.coefficients)
    for fam, c in fit.coefficients.items():
        rows = [r for r in fit.residuals if r["family"] == fam]
        used_sources = sorted({r["source"] for r in rows if r["used"]})
        entry = {k: _sig(c[k]) for k in PER_GPU + SHARED}
        entry.update({k: float(fit.stated[k]["value"]) for k in STATED})
        entry["provenance"] = {
            "method": f"kvroute fit-gpu {measurements}: least squares on log(predicted / measured)",
            "inputs": {s: fit.sources[s] for s in used_sources},
            "fitted": {k: {"value": _sig(c[k]), "se": _sig(fit.errors[fam][k], 2)} for k in PER_GPU + SHARED},
            "shared": (f"{', '.join(SHARED)} are the engine's, fitted on every GPU's whole-step timings and "
                       f"shared by {', '.join(families)}"),
            "stated": {k: {"value": float(fit.stated[k]["value"]),
                           "source": (fit.sources.get(fit.stated[k]["source"], "assumption")),
                           **({"why": " ".join(str(fit.stated[k]["why"]).split())} if "why" in fit.stated[k] else {})}
                       for k in STATED},
            "residuals": [residual_line(r) for r in rows],
        }
        out[fam] = entry
    return out
