"""`make bench`'s gateway and Mooncake benchmarks still run end to end (a small load or
window, kvroute only).

The figures are not judged here (timing on a shared machine belongs to the benchmark's
own run); this checks that every load is measured, that the report has its tables and
goal lines, and that the chats are spread over both backends as the direct client does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gateway_latency_benchmark_runs_and_reports_every_load():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gateway_latency.py"), "--rounds", "1", "--sequential", "3",
         "--concurrent", "8", "--turns", "2", "--pace-chunks", "4", "--pace-ttft-ms", "10", "--pace-itl-ms", "5",
         "--targets", "kvroute"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    text = out.stdout
    missed = re.search(r"^goal p50 added <= 1 ms \((sequential|paced)\): NOT met", text, re.M)
    assert out.returncode == (1 if missed else 0), out.stderr[-3000:]  # exit 1: a judged goal missed
    rows = {(m.group(1), m.group(2)): m.group(0) for m in re.finditer(r"^(sequential|saturated|paced)\s+(direct|kvroute)\s.*$", text, re.M)}
    assert set(rows) == {(load, t) for load in ("sequential", "saturated", "paced") for t in ("direct", "kvroute")}
    for (load, target), row in rows.items():
        n = int(row.split()[2])
        assert n == (3 if load == "sequential" else 8) * 2, row  # chats x turns
        busier = int(row.split()[-1].rstrip("%"))
        if load != "sequential":  # concurrent chats with prompts of their own: both backends used
            assert busier <= 75, row
    assert "CPU per request" in text
    for load in ("sequential", "saturated", "paced"):
        assert re.search(rf"^goal p50 added <= 1 ms \({load}\): (met|NOT met) \(-?\d", text, re.M), text


def test_mooncake_speed_benchmark_runs_and_reports_every_policy():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/mooncake_speed.py"), "--duration-s", "20"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    rows = re.findall(r"^  (\S+)\s+(\d+)\s+\d+\s+[\d.]+\s+\d+\s+[\d.]+%\s+\d+$", text, re.M)
    assert [p for p, _ in rows] == ["round_robin", "least_loaded", "sticky", "kv_aware", "cost_aware"], text
    assert len({n for _, n in rows}) == 1 and int(rows[0][1]) > 0  # every policy replays the same requests
    assert "prefix-reuse bound" in text and re.search(r"^goal under 30 s per policy: not judged", text, re.M), text


def test_calibration_repeat_compares_two_calibrations_against_their_errors(tmp_path):
    """Two probe calibration files: a coefficient agrees when it moved by less than the
    combined 95% interval (Student's t on Welch's degrees of freedom); the script exits 1
    when more than one does not."""
    def write(path, fitted, measured):
        entry = {"provenance": {"fitted": {k: {"value": v, "se": s} for k, (v, s) in fitted.items()},
                                "measured": {k: {"value": v, "se": s} for k, (v, s) in measured.items()}}}
        path.write_text(__import__("yaml").safe_dump({"cpu-provisional": entry}))
        return path
    a = write(tmp_path / "a.yaml", {"compute_efficiency": (1.0, 0.05), "step_overhead_ms": (4.0, 0.5)},
              {"api_cost_ms": (4.4, 0.3)})
    b = write(tmp_path / "b.yaml", {"compute_efficiency": (1.05, 0.05), "step_overhead_ms": (9.0, 0.5)},
              {"api_cost_ms": (4.5, 0.3)})
    script = [sys.executable, str(ROOT / "benchmarks/calibration_repeat.py")]
    out = subprocess.run([*script, str(a), str(b)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr  # one of three off: still "all but one"
    assert "| step_overhead_ms | 4 (0.5) | 9 (0.5) | +5 | +7.07 | inf | 1.96 | no | no |" in out.stdout
    assert "2 of 3 coefficients agree within their combined 95% intervals" in out.stdout
    # with 3 degrees of freedom each (a jackknife over four processes) z = 2.4 is inside the
    # 95% interval (t = 2.45 on Welch's 6) but outside two standard errors
    d = write(tmp_path / "d.yaml", {"compute_efficiency": (1.0, 0.05), "step_overhead_ms": (4.0, 0.5)},
              {"api_cost_ms": (4.4, 0.3)})
    e = write(tmp_path / "e.yaml", {"compute_efficiency": (1.0, 0.05), "step_overhead_ms": (4.0 + 2.4 * 0.5 * 2 ** 0.5, 0.5)},
              {"api_cost_ms": (4.4, 0.3)})
    for path in (d, e):
        data = __import__("yaml").safe_load(path.read_text())
        data["cpu-provisional"]["provenance"]["fitted"]["step_overhead_ms"]["dof"] = 3
        path.write_text(__import__("yaml").safe_dump(data))
    out = subprocess.run([*script, str(d), str(e)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "| +2.40 | 6 | 2.45 | yes | no |" in out.stdout, out.stdout
    assert "3 of 3 coefficients agree within their combined 95% intervals" in out.stdout
    assert "2 of 3 within two combined standard errors" in out.stdout
    c = write(tmp_path / "c.yaml", {"compute_efficiency": (2.0, 0.05), "step_overhead_ms": (9.0, 0.5)},
              {"api_cost_ms": (4.5, 0.3)})
    assert subprocess.run([*script, str(a), str(c)], capture_output=True, timeout=60, cwd=ROOT).returncode == 1


def test_gateway_latency_benchmark_writes_its_csv(tmp_path):
    """The pipeline's short run (rule gateway_latency): chosen loads and targets, one row per
    load and target in --csv, exit 0 with --no-goals; kvroute-redis only where a
    redis-server is installed, and a note naming it where not."""
    import shutil

    import pandas as pd

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    csv = tmp_path / "gateway" / "latency.csv"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gateway_latency.py"), "--rounds", "1", "--sequential", "2",
         "--concurrent", "4", "--turns", "2", "--pace-chunks", "3", "--pace-ttft-ms", "10", "--pace-itl-ms", "5",
         "--targets", "kvroute,kvroute-redis", "--loads", "sequential,paced", "--no-goals", "--csv", str(csv)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    df = pd.read_csv(csv)
    have_redis = shutil.which("redis-server") is not None or os.path.exists("/usr/bin/redis-server")
    targets = ["direct", "kvroute"] + (["kvroute-redis"] if have_redis else [])
    assert list(zip(df["load"], df["target"])) == [(load, t) for load in ("sequential", "paced") for t in targets]
    if not have_redis:
        assert "redis-server is not installed" in out.stderr
    assert (df["requests"] == df["load"].map({"sequential": 2 * 2, "paced": 4 * 2})).all()
    routed = df[df["target"] != "direct"]
    # CPU from /proc in clock ticks: a few requests may round to zero
    assert routed["added_p50_ms"].notna().all() and (routed["router_cpu_ms_per_request"] >= 0).all()
    assert df[df["target"] == "direct"]["added_p50_ms"].isna().all()
    assert (df[df["load"] == "paced"]["pace_ttft_ms"] == 10).all() and (df[df["load"] == "sequential"]["pace_ttft_ms"] == 0).all()
    assert "saturated" not in out.stdout.split("CPU per request")[0]  # only the loads asked for


def test_gateway_latency_benchmark_rejects_an_unknown_load():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/gateway_latency.py"), "--loads", "sequential,burst"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 2 and "--loads: unknown load(s) burst" in out.stderr



@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_every_benchmark_imports(path):
    """Each benchmark loads as `python benchmarks/X.py` would (its folder on sys.path), so one
    that imports a helper another benchmark no longer has fails here, not in `make bench`."""
    import importlib.util

    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_engine_restarts_tells_a_process_draw_from_noise_within_it():
    """benchmarks/engine_restarts.py's arithmetic: starts 10% apart with reps 1% apart give
    a between-start spread of 1.1 and a small ANOVA p; starts alike give p near 1."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("engine_restarts", ROOT / "benchmarks/engine_restarts.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    jitter = (1.0, 1.01, 0.995, 1.005)
    drawn = [{"start": s, "rep": r, "worker": "w0", "itl_ms": base * j}
             for s, base in enumerate((3.0, 3.3)) for r, j in enumerate(jitter)]
    f = bench.spreads(drawn, "w0")
    assert f["between"] == pytest.approx(1.1, rel=1e-3) and f["within"] == pytest.approx(1.01 / 0.995)
    assert f["p"] < 1e-4
    alike = [dict(r, itl_ms=3.0 * jitter[r["rep"]]) for r in drawn]
    assert bench.spreads(alike, "w0")["p"] > 0.99
