"""Engines: emulator workers as real subprocesses, teardown, and the vLLM command builders."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from kvroute.hardware import load_hardware
from kvroute.live.engines import (
    CPU_MAX_MODEL_LEN,
    PIN_EXEC,
    THREAD_VARIABLES,
    Engines,
    EngineError,
    WorkerSpec,
    group_affinity,
    hf_snapshot,
    parse_cpu_list,
    pinned_command,
    pinned_process,
    plan_workers,
    resolve_model_dir,
    running_engines,
    served_model_name,
    vllm_command,
    vllm_cpu_command,
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_two_emulator_workers_start_serve_reset_and_stop(tmp_path):
    with running_engines("cpu", kind="emulator", run_dir=tmp_path, time_scale=0) as eng:
        pids = eng.pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
        assert eng.names == ["w0", "w1"]
        assert eng.check_health() == {"w0": True, "w1": True}
        body = {"messages": [{"role": "user", "content": " ".join(["word"] * 300)}], "max_tokens": 2}
        url = eng.urls[0] + "/v1/chat/completions"
        post(url, body)
        assert post(url, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        eng.reset_prefix_cache()
        assert post(url, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        with urllib.request.urlopen(eng.urls[1] + "/v1/models", timeout=5) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == served_model_name(load_hardware("cpu"))
        # a restart is the other way to a cold cache
        post(url, body)
        eng.restart(0)
        assert eng.pids[1] == pids[1] and eng.pids[0] != pids[0] and not alive(pids[0])
        assert post(url, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        pids = eng.pids
    assert not any(alive(p) for p in pids)
    assert eng.pids == []
    assert (tmp_path / "w0.log").read_text().startswith("kvroute emulator (EMULATED) w0 of cpu")


def test_workers_are_torn_down_on_an_exception(tmp_path):
    pids = []
    with pytest.raises(RuntimeError, match="boom"):
        with running_engines("cpu", kind="emulator", run_dir=tmp_path, time_scale=0) as eng:
            pids = eng.pids
            assert all(alive(p) for p in pids)
            raise RuntimeError("boom")
    assert len(pids) == 2
    assert not any(alive(p) for p in pids)


def test_a_worker_that_dies_while_starting_is_reported_with_its_log(tmp_path):
    bad = WorkerSpec("w0", 0, "emulator", "127.0.0.1", 1, (sys.executable, "-c", "print('no engine here'); raise SystemExit(3)"))
    eng = Engines([bad], tmp_path, health_timeout_s=10)
    with pytest.raises(EngineError, match=r"w0 exited with code 3(.|\n)*no engine here"):
        with eng:
            pass
    assert eng.pids == []


def test_an_emulator_on_a_busy_port_fails_fast(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        spec = plan_workers(load_hardware("cpu"), "emulator", run_dir=tmp_path, ports=[s.getsockname()[1], 1])[0]
        eng = Engines([spec], tmp_path, health_timeout_s=15)
        with pytest.raises(EngineError, match="w0 exited with code 1(.|\n)*cannot serve on"):
            with eng:
                pass
        assert eng.pids == []
    finally:
        s.close()


# -- command builders (no vLLM here: commands only) ---------------------------------------------


def test_vllm_cpu_command_has_the_documented_flags_and_environment(tmp_path):
    hw = load_hardware("cpu")
    cmd, env = vllm_cpu_command(hw, 1, 8101, model_dir=Path("/m/tiny"), run_dir=tmp_path, python="/env/bin/python")
    assert cmd[:3] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    args = cmd[3:]

    def value(flag):
        return args[args.index(flag) + 1]

    assert value("--model") == "/m/tiny"
    assert value("--served-model-name") == served_model_name(hw)
    assert value("--host") == "127.0.0.1" and value("--port") == "8101"
    assert value("--max-model-len") == str(CPU_MAX_MODEL_LEN) == "4096"
    assert value("--dtype") == hw.engine.dtype == "float32"
    assert value("--max-num-seqs") == "4"
    assert value("--max-num-batched-tokens") == str(hw.engine.max_num_batched_tokens) == "2048"  # vLLM CPU's default
    assert value("--kv-cache-memory-bytes") == "268435456"
    for flag in ("--enable-prefix-caching", "--enforce-eager", "--enable-prompt-tokens-details"):
        assert flag in args
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"  # one core per worker
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["TMPDIR"].startswith(str(tmp_path)) and env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_vllm_cpu_plan_unsets_the_kv_space_override(tmp_path, monkeypatch):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    for var in THREAD_VARIABLES:  # what Snakemake exports to an 8-thread job
        monkeypatch.setenv(var, "8")
    specs = plan_workers(load_hardware("cpu"), run_dir=tmp_path, ports=[9001, 9002], model_dir=model, check=False)
    assert [s.kind for s in specs] == ["vllm-cpu", "vllm-cpu"]
    assert [s.port for s in specs] == [9001, 9002]
    env = specs[0].environ()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    allowed = sorted(os.sched_getaffinity(0))
    cores = [allowed[i % len(allowed)] for i in range(2)]
    assert [s.environ()["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == [str(c) for c in cores]
    # cpu_affinity per_worker: each worker's process tree on its OMP core, nothing else moved
    assert [s.cpus for s in specs] == [(c,) for c in cores] and [s.device for s in specs] == cores
    assert [s.model_dir for s in specs] == [str(model), str(model)] and [s.kv_events for s in specs] == [None, None]
    for var in THREAD_VARIABLES:  # one thread on its one core, whatever the caller set
        assert [s.environ()[var] for s in specs] == ["1", "1"], var


def test_without_cpu_affinity_the_workers_keep_the_parents_cpus(tmp_path):
    import dataclasses

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    hw = load_hardware("cpu")
    hw = dataclasses.replace(hw, engine=dataclasses.replace(hw.engine, cpu_affinity="none"))
    specs = plan_workers(hw, run_dir=tmp_path, ports=[9001, 9002], model_dir=model, check=False)
    assert [s.cpus for s in specs] == [(), ()]
    assert pinned_command(specs[0].cmd, specs[0].cpus) == list(specs[0].cmd)
    assert pinned_command(["x", "-y"], (3, 1)) == [sys.executable, "-c", PIN_EXEC, "3,1", "x", "-y"]
    assert parse_cpu_list("0-2,5\n") == {0, 1, 2, 5} and parse_cpu_list("1") == {1}


#: a worker with a child process and a second thread that answers GET /health: what a vLLM
#: server's tree looks like (API server, EngineCore child, threads), in a fraction of a second
FORKING_WORKER = """
import http.server, subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell two pinned workers apart")
def test_each_pinned_workers_whole_tree_runs_on_its_own_cpu(tmp_path):
    """Every thread of every process of worker i's group (its child included, which
    inherits the affinity) may run on CPU i only; this process is not moved."""
    from kvroute.live.engines import free_ports

    cores = sorted(os.sched_getaffinity(0))[:2]
    ports = free_ports(2)
    specs = [WorkerSpec(f"w{i}", i, "emulator", "127.0.0.1", port, (sys.executable, "-c", FORKING_WORKER, str(port)),
                        cpus=(core,)) for i, (port, core) in enumerate(zip(ports, cores))]
    before = os.sched_getaffinity(0)
    with Engines(specs, tmp_path, health_timeout_s=30) as eng:
        trees = [group_affinity(pid) for pid in eng.pids]
        for tree, core in zip(trees, cores):
            assert len(tree) >= 3, tree  # main thread, its second thread, the child
            assert all(cpus == {core} for cpus in tree.values()), (core, tree)
        assert eng.cpu_affinity() == {"w0": [cores[0]], "w1": [cores[1]]}
    assert os.sched_getaffinity(0) == before


def test_vllm_gpu_command_pins_devices_and_shares_memory(tmp_path):
    hw = load_hardware("a100x1-2workers")
    cmds = [vllm_command(hw, i, 8000 + i, model_dir=Path("/m"), run_dir=tmp_path, python="py") for i in range(2)]
    for cmd, env in cmds:
        assert env["CUDA_VISIBLE_DEVICES"] == "0"  # both share the one A100
        assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.45"
        assert cmd[cmd.index("--block-size") + 1] == "16"
        assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
        assert env["VLLM_SERVER_DEV_MODE"] == "1"
    hw4 = load_hardware("a6000x4")
    devices = [vllm_command(hw4, i, 1, model_dir=Path("/m"), run_dir=tmp_path)[1]["CUDA_VISIBLE_DEVICES"] for i in range(4)]
    assert devices == ["0", "1", "2", "3"]


def test_missing_engine_python_or_vllm_or_model_is_a_clear_error(tmp_path, monkeypatch):
    hw = load_hardware("cpu")
    monkeypatch.delenv("KVROUTE_MODEL_DIR", raising=False)
    monkeypatch.delenv("KVROUTE_ENGINE_PYTHON", raising=False)
    with pytest.raises(EngineError, match="engine python .* does not exist.*envs/engine-cpu.yaml"):
        plan_workers(hw, run_dir=tmp_path, ports=[1, 2], python=str(tmp_path / "nope/bin/python"))
    if __import__("importlib").util.find_spec("vllm") is None:
        with pytest.raises(EngineError, match="vLLM is not installed"):
            plan_workers(hw, run_dir=tmp_path, ports=[1, 2], python=sys.executable)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineError, match="kvroute model tiny"):
        resolve_model_dir(hw, "vllm-cpu")
    with pytest.raises(EngineError, match="no config.json"):
        resolve_model_dir(hw, "vllm-cpu", tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(EngineError, match="Qwen/Qwen2.5-7B-Instruct is not in the local Hugging Face cache"):
        resolve_model_dir(load_hardware("a6000x4"), "vllm")


def test_the_gpu_model_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    root = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct"
    snap = root / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("KVROUTE_MODEL_DIR", raising=False)
    assert hf_snapshot("Qwen/Qwen2.5-7B-Instruct") == snap
    assert resolve_model_dir(load_hardware("a6000x4"), "vllm") == snap


def test_unknown_kind_and_wrong_port_count_are_rejected(tmp_path):
    hw = load_hardware("cpu")
    with pytest.raises(EngineError, match="unknown engine kind 'sglang'"):
        plan_workers(hw, "sglang", run_dir=tmp_path)
    with pytest.raises(EngineError, match="2 workers but 1 ports"):
        plan_workers(hw, "emulator", run_dir=tmp_path, ports=[1])


def test_a_deep_run_folder_gets_a_short_tmpdir_removed_at_stop(tmp_path):
    """vLLM binds IPC sockets at TMPDIR/<uuid>, and a Unix socket path holds 107 bytes:
    a run folder deep enough to overflow it (a CI checkout's) gets a short TMPDIR in the
    system's temporary directory, which stopping the workers removes."""
    from kvroute.live.engines import MAX_TMPDIR_CHARS, worker_tmpdir

    assert worker_tmpdir(Path("/r"), "w0") == Path("/r/w0/tmp")
    deep = tmp_path / ("d" * 60) / "results" / "measure" / "explainer-two-replicas" / "cpu" / "engines"
    short = worker_tmpdir(deep, "w0")
    assert len(str(short)) <= MAX_TMPDIR_CHARS and short != worker_tmpdir(deep, "w1")
    assert short == worker_tmpdir(deep, "w0")  # the same run folder, the same place
    cmd, env = vllm_cpu_command(load_hardware("cpu"), 0, 8100, model_dir=Path("/m"), run_dir=deep, python="/p")
    assert env["TMPDIR"] == str(short)
    spec = WorkerSpec("w0", 0, "emulator", "127.0.0.1", 1, (sys.executable, "-c", "raise SystemExit(3)"),
                      env={"TMPDIR": str(short)})
    with pytest.raises(EngineError):
        with Engines([spec], deep, health_timeout_s=10):
            pass
    assert not short.exists()


def _thread_cpus() -> dict[int, set[int]]:
    """Each live thread's allowed CPUs; a thread that ends while this reads is left out."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            lines = (task / "status").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in lines:
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return out


def test_pinned_process_confines_every_thread_and_gives_each_its_own_back():
    """The client's pin (kvroute measure, the probe): every thread of this process, one that
    was running before and one started inside, on the chosen CPU; afterwards each as before,
    and one started inside as this thread was."""
    import threading

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this process may use one CPU only: pinning to it changes nothing a test could see")
    cpu = max(os.sched_getaffinity(0))
    stop = threading.Event()
    old = threading.Thread(target=stop.wait, daemon=True)
    old.start()
    before = _thread_cpus()
    try:
        with pinned_process([cpu]) as cpus:
            assert cpus == [cpu]
            new = threading.Thread(target=stop.wait, daemon=True)
            new.start()
            inside = _thread_cpus()
            assert {old.native_id, new.native_id, threading.get_native_id()} <= set(inside)
            assert all(v == {cpu} for v in inside.values()), inside
        after = _thread_cpus()
        assert {t: after[t] for t in before if t in after} == before
        assert after[new.native_id] == before[threading.get_native_id()]
    finally:
        stop.set()
    with pinned_process([]) as cpus:  # nothing to pin to: nothing changes
        assert cpus == [] and _thread_cpus()[threading.get_native_id()] == before[threading.get_native_id()]


def test_kv_event_ports_are_never_the_workers_http_ports(tmp_path, monkeypatch):
    """The kernel may offer a just-released port again: a KV-event port equal to a worker's
    HTTP port once left `kvroute measure --kv-events` waiting for ever. The kernel's choice
    is replayed here (a socket whose bind(0) yields the ports listed, the first a repeat)."""
    import kvroute.live.engines as engines

    offered = iter([9002, 9001, 9003, 9004])

    class Replayed:
        def __init__(self, *_args):
            self.port = None

        def bind(self, _addr):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(engines.socket, "socket", Replayed)
    specs = plan_workers(load_hardware("cpu"), "emulator", run_dir=tmp_path, ports=[9001, 9002], kv_events=True)
    assert [s.kv_events for s in specs] == ["tcp://127.0.0.1:9003", "tcp://127.0.0.1:9004"]
    assert engines.free_ports(0) == []
