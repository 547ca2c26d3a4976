# The two commands: `make paper` and `make test`.
# Each builds .venv from the pinned lock when it is missing or older than the lock.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LOCK   := envs/requirements.lock
STAMP  := $(VENV)/.kvroute-installed

.PHONY: paper latex test bench lock clean-venv

# LaTeX for the notes (Debian/Ubuntu packages). Installed automatically when running as
# root with apt-get; otherwise `make paper` stops and prints this command.
TEX_INSTALL := apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends texlive-latex-recommended texlive-science latexmk
SNAKEMAKE_FLAGS ?= --show-failed-logs $(if $(CI),--quiet rules,)

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r $(LOCK)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

# Every figure, table, number and note: results/paper/*.pdf (see docs/pipeline.md).
paper: $(STAMP) latex
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake paper --profile workflow/profiles/default --cores 8 $(SNAKEMAKE_FLAGS)

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/note2_fidelity.py
	$(BIN)/python benchmarks/gateway_latency.py

# Re-pin every dependency from pyproject.toml into the lock (run after changing dependencies).
lock:
	rm -rf /tmp/kvroute-lock && $(PYTHON) -m venv /tmp/kvroute-lock
	/tmp/kvroute-lock/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
	/tmp/kvroute-lock/bin/pip freeze --exclude-editable --disable-pip-version-check | grep -v '^kvroute' > $(LOCK)

clean-venv:
	rm -rf $(VENV)
