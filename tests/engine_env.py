"""The vLLM CPU engine environment the real-engine tests need, found once for all of them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _engine_python() -> str | None:
    for cand in (os.environ.get("KVROUTE_ENGINE_PYTHON"), str(ROOT / ".venv-engine-cpu" / "bin" / "python")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') and u.find_spec('transformers') else 3)"
            if subprocess.run([cand, "-c", probe], check=False, capture_output=True, timeout=120).returncode == 0:
                return cand
    return None


ENGINE_PY = _engine_python()
#: module marks of a real-engine test file: slow, and skipped naming the missing environment
ENGINE_MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(ENGINE_PY is None, reason="no vLLM CPU engine environment: run `make engine-cpu` "
                       "(builds .venv-engine-cpu) or set KVROUTE_ENGINE_PYTHON"),
]
