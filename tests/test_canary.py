"""The machine-speed canary (kvroute.live.canary): real timed work on each CPU, affinity given back."""

import os

from kvroute.live.canary import WORK, canary


def test_the_canary_times_each_kind_of_work_on_each_cpu_and_gives_the_affinity_back():
    before = os.sched_getaffinity(0)
    cpus = sorted(before)[:2]
    rows = canary(cpus)
    assert [(r["cpu"], r["work"]) for r in rows] == [(c, w) for c in cpus for w in WORK]
    assert all(r["ms"] > 0 for r in rows)
    assert os.sched_getaffinity(0) == before


def test_an_unpinned_canary_runs_once_on_the_cpus_this_thread_may_use():
    rows = canary([])
    assert [r["cpu"] for r in rows] == [-1] * len(WORK) and all(r["ms"] > 0 for r in rows)
