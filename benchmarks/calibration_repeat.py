"""Is the probe calibration reproducible? Two calibrations of the same engines, compared
coefficient by coefficient against their stated uncertainty.

`kvroute calibrate --probe --hardware cpu` fits the cpu family from probe requests of its
own and states a standard error per coefficient (kvroute.probefit: the largest of the
fit's own, a block jackknife and a leave-one-engine-process-out jackknife) with its degrees
of freedom. The fidelity issue asks that two calibrations agree within it. For each fitted
and measured coefficient this prints both values, their difference, the combined standard
error sqrt(se_a^2 + se_b^2) and z = difference / combined. A coefficient agrees when the
difference lies within the combined 95% interval: |z| below Student's t(0.975) on the
Welch-Satterthwaite degrees of freedom of the two errors (a jackknife over four engine
processes has 3, so its 2-se band would cover only 86%). The count within the plain 2-se
band is printed beside it. Exits 1 when fewer than all but one agree.

Usage:
    python benchmarks/calibration_repeat.py              # run the probe twice (about 6.5 min; needs make engine-cpu)
    python benchmarks/calibration_repeat.py A.yaml B.yaml  # compare two earlier calibrations (results/calibration/probe/cpu.yaml)
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from kvroute.probefit import interval95

ROOT = Path(__file__).resolve().parents[1]
Z = 2.0


def entries(path: Path) -> dict[str, tuple[float, float, float]]:
    """coefficient -> (value, se, dof) of a probe calibration file's fitted and measured terms
    (dof infinite where the file states none)."""
    data = yaml.safe_load(Path(path).read_text())
    (family, entry), = data.items()
    prov = entry["provenance"]
    return {k: (float(v["value"]), float(v["se"]), float(v.get("dof", math.inf)))
            for part in ("fitted", "measured") for k, v in prov[part].items()}


def welch_dof(sa: float, da: float, sb: float, db: float) -> float:
    """Welch-Satterthwaite degrees of freedom of sqrt(sa^2 + sb^2)."""
    terms = [s ** 4 / d for s, d in ((sa, da), (sb, db)) if math.isfinite(d) and d > 0]
    den = sum(terms)
    return (sa * sa + sb * sb) ** 2 / den if den > 0 else math.inf


def compare(a: Path, b: Path) -> list[dict]:
    ea, eb = entries(a), entries(b)
    rows = []
    for k in ea:
        if k not in eb:
            continue
        (va, sa, da), (vb, sb, db) = ea[k], eb[k]
        se = math.hypot(sa, sb)
        z = (vb - va) / se if se > 0 else math.inf
        dof = welch_dof(sa, da, sb, db)
        q = interval95(1.0, dof)  # t(0.975, dof): the half-width of a unit error's 95% interval
        rows.append({"coefficient": k, "a": va, "se_a": sa, "b": vb, "se_b": sb, "diff": vb - va, "se": se,
                     "z": z, "dof": dof, "q": q, "agree": abs(z) < q, "within_2se": abs(z) < Z})
    return rows


def calibrate(out: Path) -> Path:
    kvroute = str(Path(sys.executable).parent / "kvroute")
    if not (ROOT / "results/models/tiny-qwen2/config.json").is_file():  # the cpu profile's model (rule tiny_model)
        subprocess.run([kvroute, "model", "tiny", "results/models/tiny-qwen2"], cwd=ROOT, check=True, timeout=600)
    subprocess.run([kvroute, "calibrate", "--probe", "--hardware", "cpu", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=900)
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2:
        a, b = Path(argv[0]), Path(argv[1])
    elif not argv:
        tmp = Path(tempfile.mkdtemp(prefix="kvroute-cal-"))
        a, b = calibrate(tmp / "a.yaml"), calibrate(tmp / "b.yaml")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    rows = compare(a, b)
    print(f"## Probe calibration, twice: {a} against {b}\n")
    print("| coefficient | first (se) | second (se) | difference | z | dof | t(0.975) | within 95% | within 2 se |")
    print("|---|---|---|---|---|---|---|---|---|")
    yes = {True: "yes", False: "no"}
    for r in rows:
        print(f"| {r['coefficient']} | {r['a']:.4g} ({r['se_a']:.2g}) | {r['b']:.4g} ({r['se_b']:.2g}) | "
              f"{r['diff']:+.3g} | {r['z']:+.2f} | {r['dof']:.3g} | {r['q']:.2f} | {yes[r['agree']]} | "
              f"{yes[r['within_2se']]} |")
    agree = sum(r["agree"] for r in rows)
    print(f"\n{agree} of {len(rows)} coefficients agree within their combined 95% intervals "
          f"(t on Welch degrees of freedom); {sum(r['within_2se'] for r in rows)} of {len(rows)} within two combined "
          f"standard errors")
    return 0 if agree >= len(rows) - 1 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
