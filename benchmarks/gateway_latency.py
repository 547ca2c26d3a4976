"""Gateway added latency: streaming chats over kept-alive connections, direct vs routed.

Runs, in one sitting and side by side (this machine is small and noisy, so the
targets take turns round by round instead of one after another):

* two trivial local streaming backends (this script's ``--serve-backend``: an aiohttp
  server that answers every chat with ``--chunks`` SSE events at once; it is a test
  backend, not an engine), each in its own process, and two EMULATED-pace backends: the
  same server on an engine's clock without an engine's work. Like a vLLM step, a tick
  every ``--pace-itl-ms`` sends one event to every request in progress at once; a
  request's first event goes out on the first tick ``--pace-ttft-ms`` after it arrived
  (the numbers are the load's, not a model's: nothing here is a measured engine);
* the targets: ``direct`` (the client picks the backend itself, one per chat),
  ``kvroute`` (``kvroute gateway`` in its own process, uvloop, ``--policy``),
  ``kvroute-redis`` (the same gateway keeping its session table in a local redis-server
  as well, ``--redis``: research note 2's gateway first added 50 ms per turn writing to
  Redis one write after another; only with ``--targets``, and left out with a note when
  no redis-server is installed), and the
  production routers ``sglang-router`` and ``vllm-router`` (Rust, from ``.venv-routers``,
  built by ``make routers``; ``--peer-policy``, cache_aware by default, like kvroute's
  kv_aware a prefix-cache-aware policy); without that environment the peers are left out
  with a note. More routers can be added to ``TARGETS`` (a name and a function that
  starts it and returns its URL and process);
* three loads per round, each chat ``--turns`` turns with growing messages and an
  ``X-Session-ID`` over kept-alive connections. Each chat's system prompt starts with
  its own id, so no two chats share a prefix and a cache-aware router spreads them over
  the backends as the direct client does (column ``busier``: the share of requests on
  the busier backend, from the backends' own counts):

  - ``sequential``: ``--sequential`` chats one after another (instant backends);
  - ``saturated``: ``--concurrent`` chats at once (64 by default) on the instant
    backends: every process runs flat out, so on a small machine this is a throughput
    stress, where added latency is mostly time spent waiting for a core;
  - ``paced``: the same ``--concurrent`` chats on the emulated-pace backends: 64 chats
    in flight the way an engine serves them (replies take time, tokens leave in bursts
    of one per request per step), where the router's own latency shows. The chats
    start spread over one reply's duration, as chats that were not all opened in the
    same millisecond are: the turns then arrive spread out rather than 64 in lockstep.
    Each target has its own router process for this load, on the paced backends.

For every target it reports TTFT (send -> first body byte) and E2E (send -> last byte)
p50 / p99, transit (TTFT less the backend's own time from taking the request to sending
its first event, which the backend stamps into that event), and the added latency: the
target's transit percentile minus direct's. Then the
ratios: each router's p50 / p99 added latency over the best other router's, when
there is one, and kvroute's over the better Rust router's. Goal (issue 4): p50 added
latency at most 1 ms (judged on the sequential and paced loads; the saturated load is
reported beside them) and at most 1.5 times the better Rust router's. It also prints the
CPU seconds per request of each router process (all its threads, from /proc) and of
this client, per load: with many concurrent chats on a few cores, added latency is
mostly CPU per request and time waiting for a core, and the client's share shows that
every target was driven alike (a router that coalesces a reply into fewer writes also
saves the client reads). Exit status 1 when kvroute missed a goal on a judged load.

``--csv FILE`` also writes one row per load and target (the table's figures and the
router's CPU per request, with the run's settings) for the pipeline: rule
``gateway_latency`` runs a short version into ``results/gateway/latency.csv``, which
research note 2 cites. ``--no-goals`` exits 0 whatever the goals (the pipeline reports
the figures; it does not judge them on a machine shared with other jobs' leftovers).

Usage: python benchmarks/gateway_latency.py [--rounds 5] [--sequential 40] [--turns 4]
       [--concurrent 64] [--pace-ttft-ms 50] [--pace-itl-ms 20] [--pace-chunks 32]
       [--policy kv_aware] [--peer-policy cache_aware] [--targets kvroute,vllm-router]
       [--loads sequential,paced] [--csv FILE] [--no-goals]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


#: the first event's field with the backend's (request in, first event out) monotonic times
STAMP = "kvroute_bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the trivial backend (its own process) ------------------------------------------


def serve_backend(port: int, chunks: int, ttft_s: float = 0.0, itl_s: float = 0.0) -> None:
    """A trivial streaming backend: ``chunks`` SSE events, then [DONE]; written at once,
    or (emulated pace, ``itl_s`` > 0) one per tick of a clock ticking every ``itl_s``,
    from the first tick ``ttft_s`` after the request: requests in progress get their
    events on the same ticks, as a batch's tokens leave an engine step together.
    Headers go out first, as vLLM's streaming responses do."""
    import math

    from aiohttp import web

    origin = time.monotonic()  # the backend's step clock (asyncio's loop clock is monotonic)

    async def until_tick(after: float) -> None:
        """Sleep to the first tick at or after ``after`` (monotonic seconds)."""
        tick = origin + math.ceil((after - origin) / itl_s) * itl_s
        await asyncio.sleep(max(0.0, tick - time.monotonic()))

    events = [
        b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}).encode() + b"\n\n"
        for i in range(chunks)
    ]
    done = b"data: [DONE]\n\n"
    served = [0]  # completions answered, for the balance column (GET /bench/served)

    def first_event(t_recv: float, t_sent: float) -> bytes:
        ev = {"choices": [{"index": 0, "delta": {"content": "t0 "}}], STAMP: [t_recv, t_sent]}
        return b"data: " + json.dumps(ev).encode() + b"\n\n"

    async def complete(request: web.Request) -> web.StreamResponse:
        t_recv = time.monotonic()
        served[0] += 1
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        due = t_recv + ttft_s
        for i, e in enumerate(events):
            if itl_s:
                await until_tick(due)
                due = time.monotonic() + itl_s / 2  # the next tick
            if i == 0:  # stamped: when the request came in and when its first event left
                e = first_event(t_recv, time.monotonic())
            await resp.write(e)
        await resp.write(done)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def count(request: web.Request) -> web.Response:
        return web.Response(text=str(served[0]))

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    app.router.add_get("/bench/served", count)
    app.router.add_get("/v1/models", models)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=lambda *_: None)


def start_process(args: list[str], url: str, timeout_s: float = 30.0) -> subprocess.Popen:
    """Start a server process and wait until GET /health answers."""
    import urllib.request

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[:3]} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{args[:3]} did not answer {url}/health in {timeout_s} s")


def stop_process(proc: subprocess.Popen) -> None:
    also = getattr(proc, "kvroute_also_stop", None)  # a process that goes with this one (its redis-server)
    if also is not None:
        try:
            _stop(proc)
        finally:
            _stop(also)
        return
    _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if getattr(proc, "kvroute_peer", False):
        from kvroute.live.peers import stop_peer

        stop_peer(proc)
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- targets -------------------------------------------------------------------------


def start_kvroute(backends: list[str], policy: str, redis_url: str | None = None) -> tuple[str, subprocess.Popen]:
    port = free_port()
    code = "from kvroute.live.gateway import gateway_command; gateway_command()"
    args = [sys.executable, "-c", code, "--policy", policy, "--port", str(port)]
    for i, b in enumerate(backends):
        args += ["--worker", f"w{i}={b}"]
    if redis_url:
        args += ["--redis", redis_url]
    url = f"http://127.0.0.1:{port}"
    return url, start_process(args, url)


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


def start_redis() -> tuple[str, subprocess.Popen]:
    """A throwaway local redis-server (no persistence) on a free port, answering PING."""
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0", proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"redis-server did not answer on port {port}")


def start_kvroute_redis(backends: list[str], policy: str) -> tuple[str, subprocess.Popen]:
    """kvroute's gateway with its session table in Redis too (the redis-server stops with it)."""
    redis_url, redis = start_redis()
    try:
        url, proc = start_kvroute(backends, policy, redis_url)
    except BaseException:
        stop_process(redis)
        raise
    proc.kvroute_also_stop = redis
    return url, proc


PEER_POLICY = "cache_aware"  # set from --peer-policy


def _start_peer(router: str):
    def start(backends: list[str], _policy: str) -> tuple[str, subprocess.Popen]:
        from kvroute.live.peers import start_peer

        url, proc = start_peer(f"{router}:{PEER_POLICY}", backends)
        proc.kvroute_peer = True  # stopped by process group
        return url, proc

    return start


#: name -> starter(backend URLs, policy) -> (URL, process); "direct" needs none.
TARGETS: dict[str, Callable[[list[str], str], tuple[str, subprocess.Popen]]] = {
    "kvroute": start_kvroute,
    "kvroute-redis": start_kvroute_redis,
    "sglang-router": _start_peer("sglang_router"),
    "vllm-router": _start_peer("vllm_router"),
}
RUST_ROUTERS = ("sglang-router", "vllm-router")
#: measured only when --targets names them
OPT_IN = ("kvroute-redis",)


def default_targets() -> list[str]:
    from kvroute.live.peers import routers_available

    if routers_available():
        return [t for t in TARGETS if t not in OPT_IN]
    print("note: .venv-routers is missing (`make routers` builds it): measuring kvroute without the "
          "production routers", file=sys.stderr)
    return [t for t in TARGETS if t not in RUST_ROUTERS and t not in OPT_IN]


# -- the client ----------------------------------------------------------------------


def chat_turns(chat: int, turns: int) -> list[list[dict]]:
    """A chat's message lists, turn by turn. Its system prompt starts with the chat's own
    id, so no two chats share a prefix: a cache-aware router then spreads them over the
    backends as the direct client does (with one shared prompt kv_aware and the Rust
    routers' cache_aware put every chat on one backend, and the paced bursts double)."""
    msgs = [{"role": "system", "content": f"Chat {chat}. " + "You are a benchmark. " * 20}]
    out = []
    for t in range(turns):
        msgs = msgs + [{"role": "user", "content": f"chat {chat} turn {t}: " + "words " * 30}]
        out.append(msgs)
        msgs = msgs + [{"role": "assistant", "content": "t0 t1 t2 t3 " * 4}]
    return out


async def one_chat(session, url: str, chat: int, turns: int, out: list[tuple[float, float, float]]) -> None:
    """One chat's turns; per turn (TTFT, E2E, transit) seconds: transit is TTFT less the
    backend's own time from taking the request to sending its first event (the stamps
    of :func:`serve_backend`, on the machine's one monotonic clock)."""
    for msgs in chat_turns(chat, turns):
        body = json.dumps({"model": "bench", "messages": msgs, "stream": True, "max_tokens": 8}).encode()
        headers = {"Content-Type": "application/json", "X-Session-ID": f"chat-{chat}"}
        t0 = time.monotonic()
        async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
            first = None
            head = b""  # the body up to the end of the first event
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.monotonic()
                if b"\n\n" not in head:
                    head += chunk
        end = time.monotonic()
        try:
            t_recv, t_sent = json.loads(head.split(b"\n\n", 1)[0][len(b"data: "):])[STAMP]
        except (ValueError, KeyError) as exc:
            raise RuntimeError(f"{url}: the first event lost the backend's {STAMP!r} stamp: {head[:300]!r}") from exc
        out.append((first - t0, end - t0, first - t0 - (t_sent - t_recv)))


async def staggered(delay_s: float, chat):
    await asyncio.sleep(delay_s)
    await chat


async def measure(url_of_chat: Callable[[int], str], chats: int, turns: int, concurrent: bool,
                  first_chat: int, spread_s: float = 0.0) -> list[tuple[float, float, float]]:
    """Run the chats (one after another, or all at once with their starts spread evenly
    over ``spread_s``); returns (TTFT, E2E, transit) seconds per request."""
    import aiohttp

    out: list[tuple[float, float, float]] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as s:
        # warm the connections (kept alive for the measured requests)
        await one_chat(s, url_of_chat(first_chat), first_chat, 1, [])
        ids = range(first_chat, first_chat + chats)
        if concurrent:
            await asyncio.gather(*(staggered(k * spread_s / chats, one_chat(s, url_of_chat(c), c, turns, out))
                                   for k, c in enumerate(ids)))
        else:
            for c in ids:
                await one_chat(s, url_of_chat(c), c, turns, out)
    return out


def served_counts(backends: list[str]) -> list[int]:
    """Completions each backend has answered so far."""
    import urllib.request

    out = []
    for b in backends:
        with urllib.request.urlopen(b + "/bench/served", timeout=10) as r:
            out.append(int(r.read()))
    return out


def cpu_s(proc: subprocess.Popen | None) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    if proc is None:
        return 0.0
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_s(proc: subprocess.Popen | None) -> float:
    """Seconds a process's threads have spent runnable but waiting for a core (Linux schedstat)."""
    if proc is None:
        return 0.0
    total = 0
    try:
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that just ended
    except OSError:
        return float("nan")
    return total / 1e9


def pin(proc: subprocess.Popen, cpus: set[int]) -> None:
    """Pin every thread of a router (and of the processes of its process group) to ``cpus``."""
    pids = {proc.pid}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a process that just ended
        if int(fields[2]) == proc.pid:  # its process group
            pids.add(int(stat.parent.name))
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that just ended
                os.sched_setaffinity(int(task.name), cpus)


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``x1.23``; n/a when ``b`` is not a positive latency (noise around 0)."""
    return f"x{a / b:.2f}" if b > 0 else f"n/a ({b:.3f} ms)"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


#: (load, chats per round and target from args, concurrent?, backend set)
LOADS = (("sequential", "sequential", False, "instant"), ("saturated", "concurrent", True, "instant"),
         ("paced", "concurrent", True, "paced"))
#: the loads the 1 ms goal is judged on (the saturated one measures throughput on this machine)
GOAL_LOADS = ("sequential", "paced")


def main() -> int:
    global PEER_POLICY
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds; targets take turns within each")
    p.add_argument("--sequential", type=int, default=40, help="sequential chats per round and target")
    p.add_argument("--concurrent", type=int, default=64, help="concurrent chats per round and target")
    p.add_argument("--turns", type=int, default=4, help="turns per chat")
    p.add_argument("--chunks", type=int, default=8, help="SSE events per reply (instant backends)")
    p.add_argument("--pace-chunks", type=int, default=32, help="SSE events per reply (paced backends)")
    p.add_argument("--pace-ttft-ms", type=float, default=50.0, help="paced backends: first event after this")
    p.add_argument("--pace-itl-ms", type=float, default=20.0, help="paced backends: events this far apart")
    p.add_argument("--policy", default="kv_aware", help="kvroute gateway policy spec")
    p.add_argument("--peer-policy", default=PEER_POLICY,
                   help="policy of sglang-router and vllm-router (cache_aware, round_robin, power_of_two)")
    p.add_argument("--targets", help=f"comma-separated routers to measure, of {', '.join(TARGETS)} "
                   "(default: all; the Rust routers only when .venv-routers exists)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                   help="give each router the last CPU to itself, this client and the backends the others, "
                   "as a router is deployed (default: on with 2 CPUs or more)")
    p.add_argument("--loads", help=f"comma-separated loads to run, of {', '.join(m for m, *_ in LOADS)} (default: all)")
    p.add_argument("--csv", type=Path, metavar="FILE", help="also write one row per load and target to FILE")
    p.add_argument("--goals", action=argparse.BooleanOptionalAction, default=True,
                   help="exit 1 when kvroute misses a goal on a judged load (--no-goals: report only)")
    p.add_argument("--serve-backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_backend:
        serve_backend(args.serve_backend, args.chunks, args.pace_ttft_ms / 1e3, args.pace_itl_ms / 1e3)
        return 0
    PEER_POLICY = args.peer_policy
    targets = [t for t in args.targets.split(",") if t] if args.targets else default_targets()
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown target(s) {', '.join(unknown)}; valid: {', '.join(TARGETS)}")
    if "kvroute-redis" in targets and redis_server_binary() is None:
        print("note: redis-server is not installed (apt-get install redis-server): leaving out kvroute-redis",
              file=sys.stderr)
        targets.remove("kvroute-redis")
    loads = [m for m in args.loads.split(",") if m] if args.loads else [m for m, *_ in LOADS]
    bad = [m for m in loads if m not in {m_ for m_, *_ in LOADS}]
    if bad or not loads:
        p.error(f"--loads: unknown load(s) {', '.join(bad) or '(none given)'}; valid: {', '.join(m for m, *_ in LOADS)}")
    run_loads = [load for load in LOADS if load[0] in loads]
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    modes = [m for m, *_ in run_loads]
    kinds = {kind for *_, kind in run_loads}
    procs: list[subprocess.Popen] = []
    cpus = sorted(os.sched_getaffinity(0))
    router_cpus = {cpus[-1]} if args.pin else set(cpus)
    if args.pin:
        os.sched_setaffinity(0, set(cpus[:-1]))  # this client, and the backends it starts
    try:
        backend_sets: dict[str, list[str]] = {}
        backend_procs: list[subprocess.Popen] = []
        for kind, chunks, ttft, itl in (("instant", args.chunks, 0.0, 0.0),
                                        ("paced", args.pace_chunks, args.pace_ttft_ms, args.pace_itl_ms)):
            if kind not in kinds:
                continue
            backend_sets[kind] = []
            for _ in range(2):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = start_process([sys.executable, str(HERE), "--serve-backend", str(port), "--chunks", str(chunks),
                                      "--pace-ttft-ms", str(ttft), "--pace-itl-ms", str(itl)], url)
                procs.append(proc)
                backend_procs.append(proc)
                backend_sets[kind].append(url)
        # (target, backend set) -> URL of chat c, router process
        urls: dict[tuple[str, str], Callable[[int], str]] = {}
        router_proc: dict[tuple[str, str], subprocess.Popen | None] = {}
        for kind, backends in backend_sets.items():
            urls[("direct", kind)] = lambda c, backends=backends: backends[c % len(backends)]
            router_proc[("direct", kind)] = None
            for name in targets:
                url, proc = TARGETS[name](backends, args.policy)
                procs.append(proc)
                pin(proc, router_cpus)
                router_proc[(name, kind)] = proc
                urls[(name, kind)] = lambda c, url=url: url
        names = ["direct", *targets]
        # paced chats start spread over one reply (first event, then the rest a tick apart)
        spread = {"instant": 0.0, "paced": (args.pace_ttft_ms + (args.pace_chunks - 1) * args.pace_itl_ms) / 1e3}
        cpu = {(t, mode): 0.0 for t in names for mode in modes}
        client_cpu = dict.fromkeys(cpu, 0.0)
        waited = dict.fromkeys(cpu, 0.0)
        results: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in cpu}
        spread_of = {k: [0, 0] for k in cpu}  # requests per backend (balance)
        backend_cpu0 = sum(cpu_s(b) for b in backend_procs)
        chat = 0
        t_start = time.monotonic()
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for mode, size, concurrent, kind in run_loads:
                n = getattr(args, size)
                for t in order:
                    proc = router_proc[(t, kind)]
                    c0, k0, w0 = cpu_s(proc), time.process_time(), wait_s(proc)
                    s0 = served_counts(backend_sets[kind])
                    results[(t, mode)] += asyncio.run(
                        measure(urls[(t, kind)], n, args.turns, concurrent, chat, spread[kind]))
                    for i, (a, b) in enumerate(zip(s0, served_counts(backend_sets[kind]))):
                        spread_of[(t, mode)][i] += b - a
                    cpu[(t, mode)] += cpu_s(proc) - c0
                    waited[(t, mode)] += wait_s(proc) - w0
                    client_cpu[(t, mode)] += time.process_time() - k0
                    chat += n + 1
        wall = time.monotonic() - t_start
        backend_cpu = sum(cpu_s(b) for b in backend_procs) - backend_cpu0
    finally:
        for proc in procs:
            stop_process(proc)
    return report(args, names, modes, results, cpu, client_cpu, waited, backend_cpu, wall, spread_of)


def report(args, names, modes, results, cpu, client_cpu, waited, backend_cpu, wall, spread_of) -> int:
    """Print the tables, ratios and goals (see the module docstring); 1 when kvroute missed
    a goal on a judged load (``GOAL_LOADS``), else 0."""
    missed = False
    print(f"gateway latency benchmark: {args.rounds} rounds, {args.turns} turns per chat, "
          f"{args.chunks} SSE events per reply (paced: {args.pace_chunks}, EMULATED engine pace: first on the "
          f"first {args.pace_itl_ms:g} ms tick {args.pace_ttft_ms:g} ms after the request, one per tick after; "
          f"chats start spread over a reply), policy {args.policy}"
          f"{f', routers pinned to CPU {max(os.sched_getaffinity(0)) + 1}, client and backends to the others' if args.pin else ''}"
          f"{f', Rust routers {args.peer_policy}' if any(t in RUST_ROUTERS for t in names) else ''}, {wall:.1f} s, "
          f"{os.cpu_count()} CPUs")
    print("transit: TTFT less the backend's own time from taking the request to sending the first event; "
          "added: the transit percentile less direct's; busier: the share of requests (warm-up included) "
          "on the busier of the two backends")
    print(f"{'load':<11} {'target':<13} {'n':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} {'E2E p99':>8} "
          f"{'transit p50':>11} {'transit p99':>11} {'added p50':>10} {'added p99':>10} {'busier':>7}   (ms)")
    added: dict[tuple[str, str], tuple[float, float]] = {}
    for mode in modes:
        d = [x[2] for x in results[("direct", mode)]]
        d50, d99 = pct(d, 50), pct(d, 99)
        for t in names:
            r = results[(t, mode)]
            ttft, e2e, transit = ([x[i] for x in r] for i in range(3))
            a50, a99 = pct(transit, 50) - d50, pct(transit, 99) - d99
            if t != "direct":
                added[(t, mode)] = (a50, a99)
            print(f"{mode:<11} {t:<13} {len(r):>6} {pct(ttft, 50):>9.3f} {pct(ttft, 99):>9.3f} "
                  f"{pct(e2e, 50):>8.3f} {pct(e2e, 99):>8.3f} {pct(transit, 50):>11.3f} {pct(transit, 99):>11.3f} "
                  f"{'' if t == 'direct' else f'{a50:10.3f}':>10} {'' if t == 'direct' else f'{a99:10.3f}':>10} "
                  f"{max(spread_of[(t, mode)]) / max(1, sum(spread_of[(t, mode)])):>7.0%}")
    routers = [t for t in names if t != "direct"]
    served = sum(len(r) + args.rounds for r in results.values())
    print(f"backends: {backend_cpu / served * 1e3:.3f} ms of backend CPU per request (reference)")
    print("CPU per request (ms; router: the router process, all its threads; client: this script, "
          "the same for every target; wait: the router's threads runnable but waiting for a core, saturated load):")
    print(f"  {'target':<13} " + " ".join(f"{'router ' + m[:4]:>11}" for m in modes)
          + " " + " ".join(f"{'client ' + m[:4]:>11}" for m in modes) + f" {'wait satu':>10}")
    for t in names:
        n = {m: len(results[(t, m)]) + args.rounds for m in modes}
        r = " ".join(f"{cpu[(t, m)] / n[m] * 1e3:>11.3f}" if t != "direct" else f"{'-':>11}" for m in modes)
        k = " ".join(f"{client_cpu[(t, m)] / n[m] * 1e3:>11.3f}" for m in modes)
        wait = (f"{waited[(t, 'saturated')] / n['saturated'] * 1e3:>10.3f}" if t != "direct" and "saturated" in modes
                else f"{'-':>10}")
        print(f"  {t:<13} {r} {k} {wait}")
    print("ratios (transit through the router / direct, p50 and p99):")
    for mode in modes:
        d = [x[2] for x in results[("direct", mode)]]
        for t in routers:
            r = [x[2] for x in results[(t, mode)]]
            print(f"  {mode:<11} {t:<13} p50 x{pct(r, 50) / pct(d, 50):.2f}  p99 x{pct(r, 99) / pct(d, 99):.2f}")
    if len(routers) > 1:
        print("ratios (added latency / the best other router's added latency):")
        for mode in modes:
            for t in routers:
                others = [added[(o, mode)] for o in routers if o != t]
                b50 = min(o[0] for o in others)
                b99 = min(o[1] for o in others)
                a50, a99 = added[(t, mode)]
                print(f"  {mode:<11} {t:<13} p50 {ratio(a50, b50)}  p99 {ratio(a99, b99)}")
    rust = [t for t in routers if t in RUST_ROUTERS]
    if "kvroute" in routers and rust:
        print("kvroute vs the better Rust router (added latency; goal: p50 at most x1.5):")
        for mode in modes:
            a50, a99 = added[("kvroute", mode)]
            best = min(rust, key=lambda t: added[(t, mode)][0])
            b50, b99 = added[(best, mode)]
            goal = "met" if a50 <= 1.5 * b50 or a50 <= 0 else "NOT met"
            missed |= goal != "met" and mode in GOAL_LOADS
            print(f"  {mode:<11} kvroute p50 {a50:.3f} ms vs {best} {b50:.3f} ms: {ratio(a50, b50)} ({goal});"
                  f"  p99 {a99:.3f} ms vs {b99:.3f} ms: {ratio(a99, b99)}")
    for mode in modes:
        a50 = added[("kvroute", mode)][0] if ("kvroute", mode) in added else float("nan")
        judged = "" if mode in GOAL_LOADS else " [not judged: every process flat out on this machine's cores]"
        print(f"goal p50 added <= 1 ms ({mode}): {'met' if a50 <= 1.0 else 'NOT met'} ({a50:.3f} ms){judged}")
        missed |= not a50 <= 1.0 and mode in GOAL_LOADS and "kvroute" in names
    if args.csv:
        write_csv(args, names, modes, results, cpu, wall)
        print(f"wrote {args.csv}")
    return 1 if missed and args.goals else 0


#: the columns of --csv, one row per load and target
CSV_COLUMNS = ("load", "target", "requests", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
               "transit_p50_ms", "transit_p99_ms", "added_p50_ms", "added_p99_ms", "router_cpu_ms_per_request",
               "rounds", "turns", "chats", "pace_ttft_ms", "pace_itl_ms", "events_per_reply", "policy", "pinned",
               "cpus", "wall_s")


def write_csv(args, names, modes, results, cpu, wall) -> None:
    """The report's figures as CSV (``CSV_COLUMNS``), written atomically: ``added`` is a
    target's transit percentile less direct's (empty for direct), the router's CPU per
    request all its threads (empty for direct)."""
    import csv

    rows = []
    for mode in modes:
        size, kind = next((size, kind) for m, size, _, kind in LOADS if m == mode)
        d = [x[2] for x in results[("direct", mode)]]
        for t in names:
            r = results[(t, mode)]
            ttft, e2e, transit = ([x[i] for x in r] for i in range(3))
            routed = t != "direct"
            rows.append({
                "load": mode, "target": t, "requests": len(r),
                "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "e2e_p50_ms": pct(e2e, 50),
                "e2e_p99_ms": pct(e2e, 99), "transit_p50_ms": pct(transit, 50), "transit_p99_ms": pct(transit, 99),
                "added_p50_ms": pct(transit, 50) - pct(d, 50) if routed else "",
                "added_p99_ms": pct(transit, 99) - pct(d, 99) if routed else "",
                "router_cpu_ms_per_request": cpu[(t, mode)] / (len(r) + args.rounds) * 1e3 if routed else "",
                "rounds": args.rounds, "turns": args.turns, "chats": getattr(args, size),
                "pace_ttft_ms": args.pace_ttft_ms if kind == "paced" else 0.0,
                "pace_itl_ms": args.pace_itl_ms if kind == "paced" else 0.0,
                "events_per_reply": args.pace_chunks if kind == "paced" else args.chunks,
                "policy": args.policy, "pinned": bool(args.pin), "cpus": os.cpu_count(), "wall_s": round(wall, 1),
            })
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.csv.with_name(f".{args.csv.name}.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, args.csv)


if __name__ == "__main__":
    sys.exit(main())
