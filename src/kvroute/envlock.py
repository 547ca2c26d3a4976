"""Pinned pip locks of conda env files for a platform this machine is not: envs/engine-gpu.yaml
(vLLM 0.11.0 and its CUDA wheels) resolved for Linux x86-64 by ``uv pip compile``, which reads
only the package index's metadata and downloads no wheel.

The lock's header records what it was resolved from (the env file's sha256) and how (platform,
Python, uv's version and an upload cut-off), so that it can be resolved again and compared
(tests/test_envs.py). The cut-off, uv's ``--exclude-newer``, keeps releases published after the
lock out, but not releases an index mirror adds later with an earlier upload date (the CI run of
5dc5f30 found httpx 0.29.0, uvicorn 0.55.0 and opencv 5.1 dated before a lock that had
resolved to 0.28.1, 0.54.0 and 5.0). So the check resolves the env file again with the lock's
own pins as constraints: it passes when the pins are still a resolution of the env file and
every pinned file is on the index with the lock's hashes, and fails when the env file, a
dependency's metadata or a file has changed.

    python -m kvroute.envlock envs/engine-gpu.yaml envs/engine-gpu.lock --uv .venv-uv/bin/uv
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import click
import yaml

from kvroute.records import write_atomic

#: the GPU machines' platform: manylinux_2_28 covers the CUDA 12.8 builds vLLM 0.11.0 uses
PLATFORM = "x86_64-manylinux_2_28"
PYTHON = "3.11"
#: header keys, in their order; each line reads ``# key: value``
HEADER_KEYS = ("env-sha256", "python-platform", "python-version", "exclude-newer", "uv")
#: what uv prints when it cannot reach an index (DNS, refused or timed-out connections)
UNREACHABLE = re.compile(r"error sending request|dns error|tcp connect error|connection refused|"
                         r"network is unreachable|timed out|failed to fetch", re.I)
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


class ResolveError(RuntimeError):
    """uv could not resolve the env file; ``unreachable`` when the index did not answer."""

    def __init__(self, message: str, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class LockSpec:
    """How a lock is resolved: the header's fields but the digest."""

    exclude_newer: str
    python_platform: str = PLATFORM
    python_version: str = PYTHON

    def __post_init__(self) -> None:
        try:
            datetime.strptime(self.exclude_newer, "%Y-%m-%dT%H:%M:%SZ")
        except ValueError as exc:
            raise ValueError(f"exclude_newer must be a UTC time YYYY-MM-DDTHH:MM:SSZ, got {self.exclude_newer!r}") from exc


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_requirements(env_file: Path) -> list[str]:
    """The ``pip:`` entries of a conda env file, as written (options such as an extra index too)."""
    env = yaml.safe_load(Path(env_file).read_text())
    deps = env.get("dependencies") if isinstance(env, dict) else None
    if not isinstance(deps, list):
        raise ValueError(f"{env_file}: no 'dependencies' list")
    reqs = [str(r) for d in deps if isinstance(d, dict) for r in d.get("pip") or []]
    if not reqs:
        raise ValueError(f"{env_file}: 'dependencies' has no 'pip' list to lock")
    return reqs


def env_digest(env_file: Path) -> str:
    return hashlib.sha256(Path(env_file).read_bytes()).hexdigest()


def uv_version(uv: str) -> str:
    out = subprocess.run([uv, "--version"], capture_output=True, text=True, check=True).stdout.split()
    return out[1] if len(out) > 1 else out[0]


def compile_args(spec: LockSpec, requirements: Path, index_url: str | None = None) -> list[str]:
    """``uv pip compile``'s arguments (after the executable) for ``requirements``."""
    args = ["pip", "compile", str(requirements), "--generate-hashes", "--no-header", "--quiet",
            "--python-platform", spec.python_platform, "--python-version", spec.python_version,
            "--exclude-newer", spec.exclude_newer]
    return args + (["--index-url", index_url] if index_url else [])


def resolve(env_file: Path, spec: LockSpec, uv: str, index_url: str | None = None, timeout_s: float = 300,
            constraints: dict[str, str] | None = None) -> str:
    """The env file's pip entries resolved by uv: the pinned, hashed requirements (no header).

    ``constraints`` (``{name: version}``, a lock's :func:`pins`) holds the resolution to those
    versions, as uv's ``--constraint``.

    Raises:
        ResolveError: uv failed; ``unreachable`` is true when the index did not answer.
    """
    with tempfile.TemporaryDirectory(prefix="kvroute-envlock-") as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("\n".join(pip_requirements(env_file)) + "\n")
        args = compile_args(spec, req, index_url)
        if constraints:
            cons = Path(tmp) / "constraints.txt"
            cons.write_text("".join(f"{name}=={version}\n" for name, version in sorted(constraints.items())))
            args += ["--constraint", str(cons)]
        try:
            proc = subprocess.run([uv, *args], capture_output=True, text=True,
                                  timeout=timeout_s, env=_uv_env())
        except subprocess.TimeoutExpired as exc:
            raise ResolveError(f"uv pip compile took over {timeout_s:g} s", unreachable=True) from exc
    if proc.returncode != 0:
        msg = proc.stderr.strip() or proc.stdout.strip()
        raise ResolveError(f"uv pip compile of {env_file} failed: {msg}", unreachable=bool(UNREACHABLE.search(msg)))
    return proc.stdout


def _uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("UV_HTTP_RETRIES", "1")  # an unreachable index fails in a second, not after minutes
    return env


def header(env_file: Path, spec: LockSpec, uv: str) -> str:
    """The lock's first lines: what it came from and how, for :func:`read_header`."""
    values = dict(zip(HEADER_KEYS, (env_digest(env_file), spec.python_platform, spec.python_version,
                                    spec.exclude_newer, uv_version(uv))))
    lines = [f"# {Path(env_file).as_posix()}'s pip packages resolved for {spec.python_platform}, "
             f"Python {spec.python_version}, by `python -m kvroute.envlock` (make engine-gpu-lock); do not edit.",
             *(f"# {k}: {v}" for k, v in values.items())]
    return "\n".join(lines) + "\n"


def read_header(text: str) -> dict[str, str]:
    """The header fields of a lock; ValueError naming the first one missing."""
    found = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        key, sep, value = line[1:].strip().partition(": ")
        if sep and key in HEADER_KEYS:
            found[key] = value.strip()
    for key in HEADER_KEYS:
        if key not in found:
            raise ValueError(f"lock header lacks '# {key}: ...'")
    return found


def spec_of(text: str) -> LockSpec:
    """The :class:`LockSpec` a lock was resolved with, from its header."""
    h = read_header(text)
    return LockSpec(h["exclude-newer"], h["python-platform"], h["python-version"])


def pins(text: str) -> dict[str, str]:
    """``{normalized name: version}`` of a requirements text (hash and comment lines skipped)."""
    out = {}
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def write_lock(env_file: Path, out: Path, uv: str, exclude_newer: str | None = None) -> tuple[int, float]:
    """Resolve ``env_file`` into ``out`` (atomically); returns (pins, seconds the resolution took)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    spec = LockSpec(exclude_newer or now)
    start = time.perf_counter()
    body = resolve(env_file, spec, uv)
    took = time.perf_counter() - start
    text = header(env_file, spec, uv) + body
    write_atomic(Path(out), lambda tmp: Path(tmp).write_text(text))
    return len(pins(body)), took


@click.command()
@click.argument("env_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--uv", default="uv", show_default=True, help="The uv executable.")
@click.option("--exclude-newer", help="Upload cut-off, YYYY-MM-DDTHH:MM:SSZ (default: now).")
def main(env_file: Path, out: Path, uv: str, exclude_newer: str | None) -> None:
    """Resolve ENV_FILE's pip packages for Linux x86-64 into the hashed lock OUT."""
    try:
        n, took = write_lock(env_file, out, uv, exclude_newer)
    except (ResolveError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{out}: {n} pins, resolved in {took:.1f} s")


if __name__ == "__main__":
    main()
