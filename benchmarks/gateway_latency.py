"""Gateway added latency: streaming chats over kept-alive connections, direct vs routed.

Runs, in one sitting and side by side (this machine is small and noisy, so the
targets take turns round by round instead of one after another):

* two trivial local streaming backends (this script's ``--serve-backend``: an aiohttp
  server that answers every chat with ``--chunks`` SSE events at once; it is a test
  backend, not an engine), each in its own process;
* the targets: ``direct`` (the client picks the backend itself, one per chat),
  ``kvroute`` (``kvroute gateway`` in its own process, uvloop, ``--policy``), and the
  production routers ``sglang-router`` and ``vllm-router`` (Rust, from ``.venv-routers``,
  built by ``make routers``; ``--peer-policy``, cache_aware by default, like kvroute's
  kv_aware a prefix-cache-aware policy); without that environment the peers are left out
  with a note. More routers can be added to ``TARGETS`` (a name and a function that
  starts it and returns its URL and process);
* two loads per round: ``--sequential`` chats one after another, then ``--concurrent``
  chats at once (64 by default), each chat ``--turns`` turns with growing messages and
  an ``X-Session-ID``; the client keeps its connections alive.

For every target it reports TTFT (send -> first body byte) and E2E (send -> last byte)
p50 / p99, and the added latency: the target's percentile minus direct's. Then the
ratios: each router's p50 / p99 added latency over the best other router's, when
there is one, and kvroute's over the better Rust router's. Goal (issue 4): p50 added
latency at most 1 ms and at most 1.5 times the better Rust router's. It also prints the
CPU seconds per request of each router process (all its threads, from /proc) and of
this client, per load: with many concurrent chats on a few cores, added latency is
mostly CPU per request and time waiting for a core, and the client's share shows that
every target was driven alike (a router that coalesces a reply into fewer writes also
saves the client reads).

Usage: python benchmarks/gateway_latency.py [--rounds 5] [--sequential 40] [--turns 4]
       [--concurrent 64] [--policy kv_aware] [--peer-policy cache_aware] [--targets kvroute,vllm-router]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the trivial backend (its own process) ------------------------------------------


def serve_backend(port: int, chunks: int) -> None:
    """A trivial streaming backend: ``chunks`` SSE events written at once, then [DONE]."""
    from aiohttp import web

    events = [
        b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}).encode() + b"\n\n"
        for i in range(chunks)
    ]
    done = b"data: [DONE]\n\n"

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(e)
        await resp.write(done)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
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


def start_kvroute(backends: list[str], policy: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    code = "from kvroute.live.gateway import gateway_command; gateway_command()"
    args = [sys.executable, "-c", code, "--policy", policy, "--port", str(port)]
    for i, b in enumerate(backends):
        args += ["--worker", f"w{i}={b}"]
    url = f"http://127.0.0.1:{port}"
    return url, start_process(args, url)


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
    "sglang-router": _start_peer("sglang_router"),
    "vllm-router": _start_peer("vllm_router"),
}
RUST_ROUTERS = ("sglang-router", "vllm-router")


def default_targets() -> list[str]:
    from kvroute.live.peers import routers_available

    if routers_available():
        return list(TARGETS)
    print("note: .venv-routers is missing (`make routers` builds it): measuring kvroute without the "
          "production routers", file=sys.stderr)
    return [t for t in TARGETS if t not in RUST_ROUTERS]


# -- the client ----------------------------------------------------------------------


def chat_turns(chat: int, turns: int) -> list[list[dict]]:
    msgs = [{"role": "system", "content": "You are a benchmark. " * 20}]
    out = []
    for t in range(turns):
        msgs = msgs + [{"role": "user", "content": f"chat {chat} turn {t}: " + "words " * 30}]
        out.append(msgs)
        msgs = msgs + [{"role": "assistant", "content": "t0 t1 t2 t3 " * 4}]
    return out


async def one_chat(session, url: str, chat: int, turns: int, out: list[tuple[float, float]]) -> None:
    for msgs in chat_turns(chat, turns):
        body = json.dumps({"model": "bench", "messages": msgs, "stream": True, "max_tokens": 8}).encode()
        headers = {"Content-Type": "application/json", "X-Session-ID": f"chat-{chat}"}
        t0 = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
            first = None
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
        out.append((first - t0, time.perf_counter() - t0))


async def measure(url_of_chat: Callable[[int], str], chats: int, turns: int, concurrent: bool,
                  first_chat: int) -> list[tuple[float, float]]:
    import aiohttp

    out: list[tuple[float, float]] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as s:
        # warm the connections (kept alive for the measured requests)
        await one_chat(s, url_of_chat(first_chat), first_chat, 1, [])
        ids = range(first_chat, first_chat + chats)
        if concurrent:
            await asyncio.gather(*(one_chat(s, url_of_chat(c), c, turns, out) for c in ids))
        else:
            for c in ids:
                await one_chat(s, url_of_chat(c), c, turns, out)
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


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``x1.23``; n/a when ``b`` is not a positive latency (noise around 0)."""
    return f"x{a / b:.2f}" if b > 0 else f"n/a ({b:.3f} ms)"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> None:
    global PEER_POLICY
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds; targets take turns within each")
    p.add_argument("--sequential", type=int, default=40, help="sequential chats per round and target")
    p.add_argument("--concurrent", type=int, default=64, help="concurrent chats per round and target")
    p.add_argument("--turns", type=int, default=4, help="turns per chat")
    p.add_argument("--chunks", type=int, default=8, help="SSE events per reply")
    p.add_argument("--policy", default="kv_aware", help="kvroute gateway policy spec")
    p.add_argument("--peer-policy", default=PEER_POLICY,
                   help="policy of sglang-router and vllm-router (cache_aware, round_robin, power_of_two)")
    p.add_argument("--targets", help=f"comma-separated routers to measure, of {', '.join(TARGETS)} "
                   "(default: all; the Rust routers only when .venv-routers exists)")
    p.add_argument("--serve-backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_backend:
        serve_backend(args.serve_backend, args.chunks)
        return
    PEER_POLICY = args.peer_policy
    targets = [t for t in args.targets.split(",") if t] if args.targets else default_targets()
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown target(s) {', '.join(unknown)}; valid: {', '.join(TARGETS)}")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    procs: list[subprocess.Popen] = []
    try:
        backends = []
        for _ in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            procs.append(start_process([sys.executable, str(HERE), "--serve-backend", str(port),
                                        "--chunks", str(args.chunks)], url))
            backends.append(url)
        urls: dict[str, Callable[[int], str]] = {"direct": lambda c: backends[c % len(backends)]}
        router_proc: dict[str, subprocess.Popen | None] = {"direct": None}
        for name in targets:
            url, proc = TARGETS[name](backends, args.policy)
            procs.append(proc)
            router_proc[name] = proc
            urls[name] = lambda c, url=url: url
        cpu = {(t, mode): 0.0 for t in urls for mode in ("sequential", "concurrent")}
        client_cpu = dict.fromkeys(cpu, 0.0)
        waited = dict.fromkeys(cpu, 0.0)
        results = {(t, mode): [] for t in urls for mode in ("sequential", "concurrent")}
        backend_procs = procs[:2]
        backend_cpu0 = sum(cpu_s(b) for b in backend_procs)
        chat = 0
        t_start = time.monotonic()
        for rnd in range(args.rounds):
            order = list(urls) if rnd % 2 == 0 else list(urls)[::-1]
            for mode, n in (("sequential", args.sequential), ("concurrent", args.concurrent)):
                for t in order:
                    c0, k0, w0 = cpu_s(router_proc[t]), time.process_time(), wait_s(router_proc[t])
                    results[(t, mode)] += asyncio.run(measure(urls[t], n, args.turns, mode == "concurrent", chat))
                    cpu[(t, mode)] += cpu_s(router_proc[t]) - c0
                    waited[(t, mode)] += wait_s(router_proc[t]) - w0
                    client_cpu[(t, mode)] += time.process_time() - k0
                    chat += n + 1
        wall = time.monotonic() - t_start
        backend_cpu = sum(cpu_s(b) for b in backend_procs) - backend_cpu0
    finally:
        for proc in procs:
            stop_process(proc)

    print(f"gateway latency benchmark: {args.rounds} rounds, {args.turns} turns per chat, "
          f"{args.chunks} SSE events per reply, policy {args.policy}"
          f"{f', Rust routers {args.peer_policy}' if any(t in RUST_ROUTERS for t in urls) else ''}, {wall:.1f} s, "
          f"{os.cpu_count()} CPUs")
    print(f"{'load':<11} {'target':<13} {'n':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} "
          f"{'E2E p99':>8} {'added p50':>10} {'added p99':>10}   (ms)")
    added: dict[tuple[str, str], tuple[float, float]] = {}
    for mode in ("sequential", "concurrent"):
        d = results[("direct", mode)]
        d50, d99 = pct([x[0] for x in d], 50), pct([x[0] for x in d], 99)
        for t in urls:
            r = results[(t, mode)]
            ttft = [x[0] for x in r]
            e2e = [x[1] for x in r]
            a50, a99 = pct(ttft, 50) - d50, pct(ttft, 99) - d99
            if t != "direct":
                added[(t, mode)] = (a50, a99)
            print(f"{mode:<11} {t:<13} {len(r):>6} {pct(ttft, 50):>9.3f} {pct(ttft, 99):>9.3f} "
                  f"{pct(e2e, 50):>8.3f} {pct(e2e, 99):>8.3f} "
                  f"{'' if t == 'direct' else f'{a50:10.3f}'} {'' if t == 'direct' else f'{a99:10.3f}'}")
    routers = [t for t in urls if t != "direct"]
    served = sum(len(r) + args.rounds for r in results.values())
    print(f"backends: {backend_cpu / served * 1e3:.3f} ms of backend CPU per request (reference)")
    print("CPU per request (ms; router: the router process, all its threads; client: this script, "
          "the same for every target; wait: the router's threads runnable but waiting for a core):")
    print(f"  {'target':<13} {'router seq':>10} {'router conc':>11} {'router all':>10} "
          f"{'client seq':>10} {'client conc':>11} {'wait conc':>10}")
    for t in urls:
        n = {m: len(results[(t, m)]) + args.rounds for m in ("sequential", "concurrent")}
        r = {m: cpu[(t, m)] / n[m] * 1e3 for m in n}
        k = {m: client_cpu[(t, m)] / n[m] * 1e3 for m in n}
        r_all = sum(cpu[(t, m)] for m in n) / sum(n.values()) * 1e3
        router = (f"{r['sequential']:>10.3f} {r['concurrent']:>11.3f} {r_all:>10.3f}" if t != "direct"
                  else f"{'-':>10} {'-':>11} {'-':>10}")
        wait = f"{waited[(t, 'concurrent')] / n['concurrent'] * 1e3:>10.3f}" if t != "direct" else f"{'-':>10}"
        print(f"  {t:<13} {router} {k['sequential']:>10.3f} {k['concurrent']:>11.3f} {wait}")
    print("ratios (TTFT through the router / direct, p50 and p99):")
    for mode in ("sequential", "concurrent"):
        d = [x[0] for x in results[("direct", mode)]]
        for t in routers:
            r = [x[0] for x in results[(t, mode)]]
            print(f"  {mode:<11} {t:<13} p50 x{pct(r, 50) / pct(d, 50):.2f}  p99 x{pct(r, 99) / pct(d, 99):.2f}")
    if len(routers) > 1:
        print("ratios (added latency / the best other router's added latency):")
        for mode in ("sequential", "concurrent"):
            for t in routers:
                others = [added[(o, mode)] for o in routers if o != t]
                b50 = min(o[0] for o in others)
                b99 = min(o[1] for o in others)
                a50, a99 = added[(t, mode)]
                print(f"  {mode:<11} {t:<13} p50 {ratio(a50, b50)}  p99 {ratio(a99, b99)}")
    rust = [t for t in routers if t in RUST_ROUTERS]
    if "kvroute" in routers and rust:
        print("kvroute vs the better Rust router (added latency; goal: p50 at most x1.5):")
        for mode in ("sequential", "concurrent"):
            a50, a99 = added[("kvroute", mode)]
            best = min(rust, key=lambda t: added[(t, mode)][0])
            b50, b99 = added[(best, mode)]
            goal = "met" if a50 <= 1.5 * b50 or a50 <= 0 else "NOT met"
            print(f"  {mode:<11} kvroute p50 {a50:.3f} ms vs {best} {b50:.3f} ms: {ratio(a50, b50)} ({goal});"
                  f"  p99 {a99:.3f} ms vs {b99:.3f} ms: {ratio(a99, b99)}")
    for mode in ("sequential", "concurrent"):
        a50 = added[("kvroute", mode)][0] if ("kvroute", mode) in added else float("nan")
        print(f"goal p50 added <= 1 ms ({mode}): {'met' if a50 <= 1.0 else 'NOT met'} ({a50:.3f} ms)")


if __name__ == "__main__":
    main()
