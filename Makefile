# The two commands: `make test` and (once the pipeline lands) `make paper`.
# Each builds .venv from the pinned lock when it is missing or older than the lock.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LOCK   := envs/requirements.lock
STAMP  := $(VENV)/.kvroute-installed

.PHONY: test bench lock clean-venv

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r $(LOCK)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/note2_fidelity.py

# Re-pin every dependency from pyproject.toml into the lock (run after changing dependencies).
lock:
	rm -rf /tmp/kvroute-lock && $(PYTHON) -m venv /tmp/kvroute-lock
	/tmp/kvroute-lock/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
	/tmp/kvroute-lock/bin/pip freeze --exclude-editable --disable-pip-version-check | grep -v '^kvroute' > $(LOCK)

clean-venv:
	rm -rf $(VENV)
