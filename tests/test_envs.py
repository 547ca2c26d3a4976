"""envs/engine-gpu.lock against envs/engine-gpu.yaml: resolved from the file as it is now, with
its pins, again to the same pins and hashes by uv (held to the lock's pins: kvroute.envlock
says why), and holding every library `kvroute measure` imports.

The re-resolution asks the package index (metadata only, about 2 s here): unreachable, it
fails under CI=true and skips elsewhere, naming what was missing.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from kvroute.envlock import (LockSpec, ResolveError, env_digest, normalize, pins, pip_requirements, read_header,
                             resolve, spec_of)

ROOT = Path(__file__).resolve().parents[1]
ENV = ROOT / "envs/engine-gpu.yaml"
LOCK = ROOT / "envs/engine-gpu.lock"
SRC = ROOT / "src"
#: what vLLM brings and the yaml need not name: torch (vLLM pins its CUDA build)
ENGINE_PROVIDED = {"torch"}
RELOCK = "run `make engine-gpu-lock`"


def _lock_text() -> str:
    return LOCK.read_text()


def _uv() -> str:
    """uv: the Makefile's (.venv-uv, any `make` target builds it) or one on PATH."""
    for cand in (ROOT / ".venv-uv/bin/uv", shutil.which("uv")):
        if cand and os.access(cand, os.X_OK):
            return str(cand)
    _unavailable("uv is missing (`make .venv-uv/bin/uv`, or any make target, installs it into .venv-uv)")


def _unavailable(msg: str) -> None:
    """Fail under CI (it must check), skip elsewhere; either way naming what is missing."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {msg}")
    pytest.skip(f"not checked here: {msg}")


def _hashed(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """``{name: (version, hashes)}`` of a hashed requirements text."""
    out: dict[str, tuple[str, set[str]]] = {}
    name = None
    for line in text.splitlines():
        pin = pins(line)
        if pin:
            (name, version), = pin.items()
            out[name] = (version, set())
        stripped = line.strip().rstrip("\\").strip()
        if name and stripped.startswith("--hash="):
            out[name][1].add(stripped.removeprefix("--hash="))
    return {k: (v, frozenset(h)) for k, (v, h) in out.items()}


# ------------------------------------------------------------------ the lock and its env file

def test_lock_was_resolved_from_the_current_env_file():
    head = read_header(_lock_text())
    assert head["env-sha256"] == env_digest(ENV), f"envs/engine-gpu.yaml changed since the lock: {RELOCK}"
    assert head["python-platform"].startswith("x86_64-manylinux") and head["python-version"] == "3.11"


def test_every_pin_of_the_env_file_is_in_the_lock():
    locked = pins(_lock_text())
    reqs = [r for r in pip_requirements(ENV) if not r.startswith("-")]
    assert any(r.startswith("vllm==") for r in reqs)
    for req in reqs:
        name, _, version = req.partition("==")
        key = normalize(name.strip())
        assert key in locked, f"{name} is in envs/engine-gpu.yaml but not in the lock: {RELOCK}"
        if version:
            assert locked[key] == version.strip(), f"{name}: yaml {version}, lock {locked[key]}: {RELOCK}"


def test_lock_pins_cuda_wheels_with_hashes():
    """The point of the lock: vLLM's CUDA build, installable with pip's --require-hashes."""
    locked = _hashed(_lock_text())
    assert locked["vllm"][0] == "0.11.0" and "+cpu" not in locked["torch"][0]
    assert any(name.startswith("nvidia-") and name.endswith("-cu12") for name in locked), "no CUDA runtime wheels"
    unhashed = sorted(name for name, (_, hashes) in locked.items() if not hashes)
    assert not unhashed, f"pins without hashes: {unhashed}"


def test_lock_resolves_again_to_the_same_pins_and_hashes():
    text = _lock_text()
    try:
        again = resolve(ENV, spec_of(text), _uv(), constraints=pins(text))
    except ResolveError as exc:
        if exc.unreachable:
            _unavailable(f"the package index is unreachable (uv: {str(exc).splitlines()[-1].strip()})")
        raise
    before, after = _hashed(text), _hashed(again)
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    assert not changed, f"re-resolving envs/engine-gpu.yaml changes {changed[:10]}: {RELOCK}"


def test_pins_that_no_longer_resolve_fail_the_check(tmp_path):
    """What the constrained check catches: a pin the env file's requirements exclude."""
    env = tmp_path / "env.yaml"
    env.write_text("dependencies:\n  - pip:\n      - httpx==0.28.1\n")
    try:
        resolve(env, spec_of(_lock_text()), _uv(), constraints={"httpx": "0.27.0"})
    except ResolveError as exc:
        if exc.unreachable:
            _unavailable(f"the package index is unreachable (uv: {str(exc).splitlines()[-1].strip()})")
        assert "httpx" in str(exc)
    else:
        pytest.fail("httpx==0.28.1 resolved under the constraint httpx==0.27.0")


def test_an_unreachable_index_is_told_apart_from_a_failed_resolution(tmp_path):
    """What the skip/fail above depends on: a refused connection (port 9 on loopback, where
    nothing listens) is `unreachable`, and a requirement no index has is not."""
    env = tmp_path / "env.yaml"
    env.write_text("dependencies:\n  - pip:\n      - vllm==0.11.0\n")
    with pytest.raises(ResolveError) as refused:
        resolve(env, spec_of(_lock_text()), _uv(), index_url="http://127.0.0.1:9/simple")
    assert refused.value.unreachable, str(refused.value)
    env.write_text("dependencies:\n  - python=3.11\n")
    with pytest.raises(ValueError, match="no 'pip' list"):
        pip_requirements(env)


def test_bad_headers_and_cut_offs_are_named():
    with pytest.raises(ValueError, match="exclude_newer"):
        LockSpec("yesterday")
    with pytest.raises(ValueError, match="env-sha256"):
        read_header("# python-platform: x86_64-manylinux_2_28\nvllm==0.11.0\n")


# ------------------------------------------------------------------ what `kvroute measure` imports

def _module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports(nodes: list[ast.AST], module: str, is_package: bool) -> set[str]:
    """Absolute names imported anywhere in ``nodes`` (relative imports resolved)."""
    out = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[:len(parts) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from kvroute.live import gateway`
    return out


def measure_imports() -> tuple[set[str], set[str]]:
    """(kvroute modules, third-party top-level names) that `kvroute measure` may import.

    From kvroute.cli, its module-level imports and the `measure` command's; from every module
    of kvroute.live (the gateway, emulator, load generator, ... that measure starts as
    processes), all of them, then the kvroute modules those reach, transitively.
    """
    cli = ast.parse((SRC / "kvroute/cli.py").read_text())
    roots = [n for n in cli.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    roots += [n for n in cli.body if isinstance(n, ast.FunctionDef) and n.name == "measure"]
    assert len(roots) > 1 and isinstance(roots[-1], ast.FunctionDef), "kvroute.cli has no `measure` command"
    todo = sorted(_imports(roots, "kvroute.cli", False))
    todo += [f"kvroute.live.{p.stem}" for p in sorted((SRC / "kvroute/live").glob("*.py"))]
    seen, third = set(), set()
    while todo:
        name = todo.pop()
        top = name.split(".")[0]
        if top != "kvroute":
            if top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
            continue
        path = _module_file(name)
        if path is None or name in seen:
            continue  # `from kvroute.x import function`: its module is followed already
        seen.add(name)
        todo += sorted(_imports([ast.parse(path.read_text())], name, path.name == "__init__.py"))
    return seen, third


def distributions_of(import_names: set[str], available: set[str]) -> dict[str, str | None]:
    """``{import name: the distribution among ``available`` that provides it, or None}``.

    The installed distributions say which provides a name (yaml: PyYAML, zmq: pyzmq); a name
    not installed here (torch, transformers: the engine's) is taken to be its distribution's.
    """
    installed = packages_distributions()
    out = {}
    for name in sorted(import_names):
        cands = [normalize(d) for d in installed.get(name, [])] + [normalize(name)]
        out[name] = next((d for d in cands if d in available), None)
    return out


def test_the_lock_provides_every_import_of_kvroute_measure():
    modules, third = measure_imports()
    assert {"kvroute.live.gateway", "kvroute.live.measure", "kvroute.experiment"} <= modules
    assert {"aiohttp", "redis", "prometheus_client", "zmq", "yaml"} <= third  # the scan sees the live stack
    provided = distributions_of(third, set(pins(_lock_text())))
    missing = sorted(name for name, dist in provided.items() if dist is None)
    assert not missing, f"`kvroute measure` imports {missing}, which no package of envs/engine-gpu.lock provides"


def test_the_env_file_names_every_library_kvroute_measure_imports():
    """Not only through vLLM's dependencies: the yaml pins what kvroute imports itself."""
    _, third = measure_imports()
    named = {normalize(r.partition("==")[0].strip()) for r in pip_requirements(ENV) if not r.startswith("-")}
    provided = distributions_of(third, named | ENGINE_PROVIDED)
    missing = sorted(name for name, dist in provided.items() if dist is None)
    assert not missing, f"envs/engine-gpu.yaml does not name what provides {missing}"


def test_an_import_no_package_provides_is_reported():
    provided = distributions_of({"yaml", "zmq", "surely_not_a_module"}, {"pyyaml", "pyzmq"})
    assert provided == {"surely_not_a_module": None, "yaml": "pyyaml", "zmq": "pyzmq"}
