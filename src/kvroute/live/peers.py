"""The production routers as peers: sglang-router and vllm-router, run in the gateway's place.

A peer spec names a router and its policy, ``ROUTER:POLICY``::

    sglang_router:cache_aware   sglang_router:round_robin   sglang_router:random   sglang_router:power_of_two
    vllm_router:cache_aware     vllm_router:consistent_hash vllm_router:round_robin vllm_router:power_of_two

``kvroute measure`` starts the router as a process fronting the engines and replays the
load through it, exactly as through kvroute's gateway; ``kvroute simulate`` cannot run
them (they are programs, not policy objects).

Both routers are Rust binaries from PyPI (sglang-router 0.3.2, vllm-router 0.1.17), kept
out of the analysis environment: ``make routers`` builds ``.venv-routers`` from
``envs/routers.lock``. :func:`routers_venv` finds it (``$KVROUTE_ROUTERS_VENV``, else
``.venv-routers`` in the working directory or the source checkout).

Readiness (field-notes.md, "Peers you can run here"):

* sglang-router answers GET /health before it has registered its workers (a request
  then gets 503 no_available_workers): it is ready when GET /workers lists every worker.
* vllm-router checks GET /health on every worker before it serves; it is ready when its
  own GET /health answers 200 (and GET /workers, where it answers, lists every worker).

Each router gets its own ``--prometheus-port`` (both default to 29000) and binds
127.0.0.1. It runs in its own process group, stopped (SIGTERM, then SIGKILL) when the
:func:`running_peer` block is left, also on an error or Ctrl-C. No module-level imports
beyond the standard library: :mod:`kvroute.experiment` checks specs with it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

#: router name in a spec -> the policies kvroute runs it with
PEER_POLICIES: dict[str, tuple[str, ...]] = {
    "sglang_router": ("cache_aware", "round_robin", "random", "power_of_two"),
    "vllm_router": ("cache_aware", "consistent_hash", "round_robin", "power_of_two"),
}
PEER_SPECS: tuple[str, ...] = tuple(f"{r}:{p}" for r, ps in PEER_POLICIES.items() for p in ps)
#: pinned versions (envs/routers.lock)
PEER_VERSIONS = {"sglang_router": "sglang-router 0.3.2", "vllm_router": "vllm-router 0.1.17"}
ROUTERS_VENV_ENV = "KVROUTE_ROUTERS_VENV"
ROUTERS_VENV_DIR = ".venv-routers"
READY_TIMEOUT_S = 60.0


class PeerError(RuntimeError):
    """A peer router cannot be found, started or reached; the message says what to do."""


def is_peer_spec(spec: str) -> bool:
    """Whether ``spec`` names a production router (``sglang_router:...``, ``vllm_router:...``)."""
    return isinstance(spec, str) and spec.partition(":")[0].strip() in PEER_POLICIES


def parse_peer_spec(spec: str) -> tuple[str, str]:
    """``(router, policy)`` of a peer spec; ValueError naming the valid ones otherwise."""
    router, _, policy = (s.strip() for s in spec.partition(":"))
    if router not in PEER_POLICIES:
        raise ValueError(f"{spec!r} is not a production router spec; valid: {', '.join(PEER_SPECS)}")
    if policy not in PEER_POLICIES[router]:
        raise ValueError(f"production router spec {spec!r}: unknown policy {policy!r} of {router}; "
                         f"valid: {', '.join(PEER_SPECS)}")
    return router, policy


# -- the routers' environment --------------------------------------------------------------


def _checkout_root() -> Path:
    return Path(__file__).resolve().parents[3]  # src/kvroute/live/peers.py -> the checkout


def routers_venv(venv: str | os.PathLike | None = None) -> Path:
    """The routers' virtual environment (built by ``make routers``); PeerError when absent."""
    if venv is not None:
        candidates = [Path(venv)]
    elif os.environ.get(ROUTERS_VENV_ENV):
        candidates = [Path(os.environ[ROUTERS_VENV_ENV])]
    else:
        candidates = [Path.cwd() / ROUTERS_VENV_DIR, _checkout_root() / ROUTERS_VENV_DIR]
    for c in candidates:
        if (c / "bin" / "python").exists() and (c / "bin" / "vllm-router").exists():
            return c
    where = " or ".join(str(c) for c in dict.fromkeys(candidates))
    raise PeerError(f"the production routers' environment is missing ({where}): run `make routers` "
                    f"(it builds {ROUTERS_VENV_DIR} from envs/routers.lock), or point ${ROUTERS_VENV_ENV} "
                    f"at a virtual environment with sglang-router and vllm-router")


def routers_available(venv: str | os.PathLike | None = None) -> bool:
    try:
        routers_venv(venv)
    except PeerError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def peer_command(spec: str, worker_urls: Sequence[str], *, venv: str | os.PathLike, host: str, port: int,
                 prometheus_port: int) -> list[str]:
    """The command line that starts ``spec``'s router fronting ``worker_urls``."""
    router, policy = parse_peer_spec(spec)
    venv = Path(venv)
    common = ["--host", host, "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
              "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
              "--worker-startup-check-interval", "1", "--log-level", "warn" if router == "sglang_router" else "warning"]
    if router == "sglang_router":
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common]
    return [str(venv / "bin" / "vllm-router"), *common]


# -- readiness -------------------------------------------------------------------------------


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (OSError, ValueError):
        return 0, b""


def listed_workers(body: bytes) -> set[str]:
    """Worker URLs in a router's GET /workers answer (either router's shape)."""
    try:
        data = json.loads(body)
    except ValueError:
        return set()
    found: set[str] = set()

    def walk(x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("url", "worker_url") and isinstance(v, str):
                    found.add(v.rstrip("/"))
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                if isinstance(v, str) and v.startswith("http"):
                    found.add(v.rstrip("/"))
                else:
                    walk(v)

    walk(data)
    return found


def _ready(router: str, url: str, worker_urls: Sequence[str]) -> bool:
    want = {u.rstrip("/") for u in worker_urls}
    status, body = _get(url + "/workers")
    if status == 200 and want <= listed_workers(body):
        return router == "sglang_router" or _get(url + "/health")[0] == 200
    if router == "vllm_router" and status in (404, 405):  # no /workers: its health gates on the workers
        return _get(url + "/health")[0] == 200
    return False


def _tail(path: Path | None, n: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_peer(p: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM to the router's process group, SIGKILL after ``timeout_s``."""
    if p.poll() is None:
        _signal_group(p, signal.SIGTERM)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("router pid %d did not stop within %.0f s: killing it", p.pid, timeout_s)
            _signal_group(p, signal.SIGKILL)
            p.wait(10)
    _signal_group(p, signal.SIGKILL)  # leftovers of its group


def start_peer(
    spec: str,
    worker_urls: Sequence[str],
    *,
    venv: str | os.PathLike | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    prometheus_port: int | None = None,
    log_file=None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> tuple[str, subprocess.Popen]:
    """Start ``spec``'s router in front of ``worker_urls`` and wait until it is ready.

    Returns its base URL and process (in its own process group: stop it with
    :func:`stop_peer`). ``log_file`` is an open binary file for its output (default:
    discarded). A router that exits or is not ready within ``ready_timeout_s`` is
    stopped and raises :class:`PeerError`.
    """
    router, _policy = parse_peer_spec(spec)
    venv = routers_venv(venv)
    worker_urls = [u.rstrip("/") for u in worker_urls]
    if not worker_urls:
        raise PeerError(f"{spec}: no workers to route to")
    port = port or free_port(host)
    prometheus_port = prometheus_port or free_port(host)
    cmd = peer_command(spec, worker_urls, venv=venv, host=host, port=port, prometheus_port=prometheus_port)
    url = f"http://{host}:{port}"
    env = {**os.environ, "NO_PROXY": "*", "no_proxy": "*"}
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    log.info("starting %s on %s: %s", spec, url, " ".join(cmd))
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log_file or subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise PeerError(f"cannot start {spec} ({cmd[0]}): {exc}; run `make routers`") from exc
    log_path = Path(log_file.name) if log_file is not None and hasattr(log_file, "name") else None
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(router, url, worker_urls):
            if proc.poll() is not None:
                raise PeerError(f"{spec} exited with code {proc.returncode} while starting"
                                + (f"; log {log_path}:\n{_tail(log_path)}" if log_path else ""))
            if time.monotonic() > deadline:
                raise PeerError(f"{spec} did not list its workers {worker_urls} within {ready_timeout_s:.0f} s"
                                + (f"; log {log_path}:\n{_tail(log_path)}" if log_path else ""))
            time.sleep(0.05)
    except BaseException:
        stop_peer(proc)
        raise
    log.info("%s ready on %s (pid %d)", spec, url, proc.pid)
    return url, proc


@contextmanager
def running_peer(
    spec: str,
    worker_urls: Sequence[str],
    *,
    venv: str | os.PathLike | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    prometheus_port: int | None = None,
    log_path: str | os.PathLike | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[str]:
    """Run ``spec``'s router in front of ``worker_urls``; yield its base URL once ready.

    Every worker must already answer GET /health. The router's output goes to
    ``log_path`` (default: discarded). It is stopped by process group on leaving the
    block, also on an error, Ctrl-C, or a router that never gets ready (PeerError with
    its log's tail).
    """
    parse_peer_spec(spec)
    routers_venv(venv)  # the clear error first, before any file is opened
    logf = None
    if log_path is not None:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(log_path, "ab")  # noqa: SIM115 - closed below
    try:
        url, proc = start_peer(spec, worker_urls, venv=venv, host=host, port=port, prometheus_port=prometheus_port,
                               log_file=logf, ready_timeout_s=ready_timeout_s)
        try:
            yield url
        finally:
            stop_peer(proc)
    finally:
        if logf is not None:
            logf.close()
