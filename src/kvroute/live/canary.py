"""A machine-speed canary: a fixed piece of CPU work timed on each core, while the engines idle.

The probe fits the engines at the machine's speed during its sessions; if the shared host
slows down between them (another tenant's load), the measurement runs slower than every
probe says, and nothing else in the records shows it. So ``kvroute measure`` times the same
fixed work on each engine's core before every run and at the start and end of every probe
session (the engines idle then), and ``kvroute validate`` sets the runs' times
beside the probes' (``machine.csv``): a ratio above 1 is a machine slower during the
measurement than while it was probed. It is reported, never used to correct anything.

Two kinds of work, since an engine step here is both: ``python`` (an interpreter loop, as
the API server and the engine's scheduler run) and ``numpy`` (passes of a numpy ufunc over
float32 arrays larger than a core's L2 cache, as the model's layers stream their weights;
a ufunc runs in the calling thread, where a BLAS product would start threads of its own on
other cores).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

#: the fastest of REPEATS, GAP_S apart: an idle engine still wakes now and then (its API
#: server's stats, the cache reset just sent), and a canary sharing the core with it ran
#: twice as long; spread over about 0.1 s, one repeat finds the core to itself
REPEATS = 8
GAP_S = 0.008
_LOOP = 50_000
_FLOATS = 1 << 20  # 4 MiB of float32
_PASSES = 2


def _python_work() -> int:
    total = 0
    for i in range(_LOOP):
        total += i * i % 7
    return total


_X = np.linspace(0.0, 1.0, _FLOATS, dtype=np.float32)
_Y = np.empty_like(_X)


def _numpy_work() -> None:
    for _ in range(_PASSES):
        np.multiply(_X, 1.0001, out=_Y)
        np.add(_Y, _X, out=_Y)


WORK = {"python": _python_work, "numpy": _numpy_work}


def _fastest_ms() -> dict[str, float]:
    """Each kind of work's fastest of REPEATS, the kinds taking turns in each repeat."""
    best = dict.fromkeys(WORK, float("inf"))
    for i in range(REPEATS):
        if i:
            time.sleep(GAP_S)
        for kind, fn in WORK.items():
            t0 = time.perf_counter()
            fn()
            best[kind] = min(best[kind], time.perf_counter() - t0)
    return {kind: round(v * 1e3, 3) for kind, v in best.items()}


def canary(cpus: Sequence[int]) -> list[dict]:
    """The canary's times on each of ``cpus`` (this thread pinned to each in turn, then
    given back its affinity): a row per CPU and kind of work, ``ms`` the fastest of
    :data:`REPEATS` (about 0.1 s per CPU). No CPUs (an unpinned profile): the CPUs this thread may use, as one."""
    before = os.sched_getaffinity(0)
    rows = []
    try:
        for cpu in list(cpus) or [None]:
            os.sched_setaffinity(0, {cpu} if cpu is not None else before)
            for kind, ms in _fastest_ms().items():
                rows.append({"cpu": -1 if cpu is None else int(cpu), "work": kind, "ms": ms})
    finally:
        os.sched_setaffinity(0, before)
    return rows


def engine_cpus(engines) -> list[int]:
    """The CPUs the running ``engines``' workers are pinned to (none: unpinned)."""
    return sorted({c for spec in engines.specs for c in spec.cpus})
