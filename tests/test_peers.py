"""The production routers as peers: specs, the routers' environment, and each router
fronting two emulated workers (the explainer's two-turn test, scaled down).

The integration tests need ``.venv-routers`` (``make routers``); without it they skip.
Each prints its per-worker load beside its turn-2 hit rate (``pytest -s`` shows it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.experiment import ExperimentError, load_experiment, validate_policy_spec
from kvroute.live.peers import (
    PEER_SPECS,
    PeerError,
    is_peer_spec,
    listed_workers,
    parse_peer_spec,
    peer_command,
    routers_available,
    routers_venv,
)

needs_routers = pytest.mark.skipif(
    not routers_available(),
    reason="the production routers' environment .venv-routers is missing: run `make routers` to build it",
)

# -- specs (no routers needed) --------------------------------------------------------------


def test_peer_specs_name_both_routers_and_their_policies():
    assert set(PEER_SPECS) == {
        "sglang_router:cache_aware", "sglang_router:round_robin", "sglang_router:random", "sglang_router:power_of_two",
        "vllm_router:cache_aware", "vllm_router:consistent_hash", "vllm_router:round_robin", "vllm_router:power_of_two",
    }
    assert all(is_peer_spec(s) for s in PEER_SPECS)
    assert not is_peer_spec("round_robin") and not is_peer_spec("hybrid_sticky:threshold_ms=5000")
    assert parse_peer_spec("vllm_router:consistent_hash") == ("vllm_router", "consistent_hash")
    with pytest.raises(ValueError, match="unknown policy 'sticky' of sglang_router"):
        parse_peer_spec("sglang_router:sticky")
    for spec in PEER_SPECS:
        validate_policy_spec(spec)  # an experiment may list them


def test_peer_command_lines(tmp_path):
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    sg = peer_command("sglang_router:cache_aware", urls, venv=tmp_path, host="127.0.0.1", port=5, prometheus_port=6)
    assert sg[:3] == [str(tmp_path / "bin/python"), "-m", "sglang_router.launch_router"]
    assert sg[sg.index("--worker-urls") + 1: sg.index("--worker-urls") + 3] == urls
    assert sg[sg.index("--prometheus-port") + 1] == "6" and sg[sg.index("--policy") + 1] == "cache_aware"
    vl = peer_command("vllm_router:consistent_hash", urls, venv=tmp_path, host="127.0.0.1", port=5, prometheus_port=7)
    assert vl[0] == str(tmp_path / "bin/vllm-router") and vl[vl.index("--policy") + 1] == "consistent_hash"
    assert vl[vl.index("--prometheus-port") + 1] == "7"


def test_missing_routers_environment_names_make_routers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVROUTE_ROUTERS_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(PeerError, match="make routers"):
        routers_venv()


def test_workers_listing_of_either_router():
    sg = {"workers": [{"id": "x", "url": "http://a:1", "is_healthy": True}], "total": 1}
    assert listed_workers(json.dumps(sg).encode()) == {"http://a:1"}
    assert listed_workers(b'["http://a:1/", "http://b:2"]') == {"http://a:1", "http://b:2"}
    assert listed_workers(b"not json") == set()


def _exp(tmp_path, policies, **params):
    wl = {"conversations": 6, "concurrency": 1, "system_words": 0, "first_prompt_tokens": 500,
          "last_prompt_tokens": 580, "min_turns": 2, "max_turns": 2, "reply_tokens_min": 8, "reply_tokens_max": 8,
          "tool_tokens_min": 60, "max_context_tokens": 4096, **params}
    exp = {"name": "peers", "seed": 5, "rounds": 1, "workload": {"generator": "agent", "params": wl},
           "runs": [{"hardware": "cpu", "policies": policies}]}
    p = tmp_path / "peers.yaml"
    p.write_text(yaml.safe_dump(exp))
    return p


def test_simulate_runs_production_routers_as_their_counterparts(tmp_path):
    """A router the experiment lists is measured as itself and simulated as its kvroute
    counterpart (once, however many routers share it; left out without one), as the
    workflow does; naming one with --policy is an error that names the counterpart."""
    path = _exp(tmp_path, ["round_robin", "vllm_router:cache_aware", "sglang_router:cache_aware",
                           "sglang_router:power_of_two"])
    exp = load_experiment(path)  # valid for measuring
    assert [r.policy for r in exp.expand(measured=True)] == ["round_robin", "vllm_router:cache_aware",
                                                             "sglang_router:cache_aware", "sglang_router:power_of_two"]
    vllm = "vllm_cache_aware:prefix_match=false"
    assert [r.policy for r in exp.expand()] == ["round_robin", vllm, "sglang_cache_aware"]
    res = CliRunner().invoke(main, ["simulate", str(path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert set(pd.read_parquet(tmp_path / "o" / "requests.parquet")["policy"]) == {"round_robin", vllm, "sglang_cache_aware"}
    res = CliRunner().invoke(main, ["simulate", str(path), "--out", str(tmp_path / "p"),
                                    "--policy", "vllm_router:cache_aware"])
    assert res.exit_code != 0
    assert ("'vllm_router:cache_aware' is a production router: it can be measured (kvroute measure), not simulated;"
            f" simulate its counterpart with --policy {vllm}") in res.output
    with pytest.raises(ExperimentError, match="not simulated"):
        load_experiment(_exp(tmp_path, ["sticky"])).expand(["sglang_router:round_robin"])


def test_bad_peer_policy_is_rejected_with_the_valid_specs(tmp_path):
    with pytest.raises(ExperimentError, match="runs.0.policies.0.*sglang_router:cache_aware"):
        load_experiment(_exp(tmp_path, ["sglang_router:consistent_hash"]))


# -- the routers in front of two emulated workers ------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from kvroute.live.engines import running_engines

    with running_engines("cpu", kind="emulator", run_dir=tmp_path_factory.mktemp("peer-engines"),
                         time_scale=0.05) as eng:
        yield eng


def _two_turn_trace(conversations=8):
    from kvroute.workload import generate

    # the explainer's test, scaled down: per trial a prompt unique to it (no shared system
    # prompt), turn 2 its history plus a short message; one trial at a time
    return generate("agent", 7, conversations=conversations, concurrency=1, system_words=0,
                    first_prompt_tokens=600, last_prompt_tokens=680, min_turns=2, max_turns=2,
                    reply_tokens_min=8, reply_tokens_max=8, tool_tokens_min=60, max_context_tokens=4096)


def _replay_through(spec, engines, tmp_path):
    from kvroute.hardware import load_hardware
    from kvroute.live.engines import served_model_name
    from kvroute.live.loadgen import WORKER_FIELD, run_load
    from kvroute.live.measure import per_worker_load
    from kvroute.live.peers import running_peer

    engines.reset_prefix_cache()
    trace = _two_turn_trace()
    with running_peer(spec, engines.urls, log_path=tmp_path / "router.log") as url:
        result = asyncio.run(asyncio.wait_for(
            run_load(trace, url, metrics_urls=engines.urls, model=served_model_name(load_hardware("cpu")),
                     worker_field=WORKER_FIELD, progress_every_s=None), 30))
    rows = pd.DataFrame(result.rows)
    load = per_worker_load(result, engines.names, engines.urls)
    turn2 = rows[rows.turn == 1]
    hit_rate = float(turn2.cached_tokens.sum() / turn2.prompt_tokens.sum())
    warm = int((turn2.cached_tokens > 0).sum())
    counts = {w: int(v["metrics_requests"]) for w, v in load.items()}
    print(f"\n{spec}: turn-2 warm {warm}/{len(turn2)}, turn-2 hit rate {hit_rate:.3f}, "
          f"requests per worker (engine /metrics) {counts}, "
          f"sessions per worker {rows[rows.turn == 0].worker.value_counts().to_dict()}")
    return rows, load


@needs_routers
@pytest.mark.parametrize("spec", ["sglang_router:round_robin", "vllm_router:round_robin"])
def test_round_robin_peer_sends_turn_two_cold(spec, engines, tmp_path):
    rows, load = _replay_through(spec, engines, tmp_path)
    assert (rows.status == "ok").all() and len(rows) == 16
    assert set(rows.worker) == {"w0", "w1"}  # attributed from the emulator's body field
    for _conv, g in rows.groupby("conversation"):
        t1, t2 = g.sort_values("turn").itertuples()
        assert t1.worker != t2.worker  # one trial at a time: turns alternate workers
        assert t2.cached_tokens == 0
    # the engines' own counters agree with the attribution, and the load is even
    for v in load.values():
        assert v["metrics_requests"] == v["records_requests"] == 8


@needs_routers
@pytest.mark.parametrize("spec", ["sglang_router:cache_aware", "vllm_router:cache_aware",
                                  "vllm_router:consistent_hash"])
def test_cache_aware_and_hashing_peers_keep_turn_two_warm(spec, engines, tmp_path):
    rows, load = _replay_through(spec, engines, tmp_path)
    assert (rows.status == "ok").all() and len(rows) == 16
    for _conv, g in rows.groupby("conversation"):
        t1, t2 = g.sort_values("turn").itertuples()
        assert t1.worker == t2.worker
        assert t2.cached_tokens >= 4 * 128  # its 600-token history, in 128-token blocks
    assert sum(v["metrics_requests"] for v in load.values()) == 16
    for v in load.values():
        assert v["metrics_requests"] == v["records_requests"]


@needs_routers
def test_measure_runs_a_peer_in_the_gateways_place(tmp_path):
    path = _exp(tmp_path, ["vllm_router:consistent_hash", "sglang_router:round_robin"])
    out = tmp_path / "out"
    t = time.monotonic()
    res = CliRunner().invoke(main, ["measure", str(path), "--hardware", "cpu", "--engine", "emulator",
                                    "--time-scale", "0.05", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_parquet(out / "requests.parquet")
    assert len(df) == 2 * 6 * 2 and (df.status == "ok").all()
    assert (df.view == "peer").all() and (df.source == "emulated").all()
    assert set(df.policy) == {"vllm_router:consistent_hash", "sglang_router:round_robin"}
    assert set(df.worker) <= {"w0", "w1"}
    later = df[df.turn == 1]
    sticky = later[later.policy == "vllm_router:consistent_hash"]
    rr = later[later.policy == "sglang_router:round_robin"]
    assert (sticky.cached_tokens > 0).all() and (rr.cached_tokens == 0).all()
    load = json.loads((out / "load.json").read_text())["per_worker"]
    for key in ("vllm_router:consistent_hash round 0", "sglang_router:round_robin round 0"):
        assert sum(v["metrics_requests"] for v in load[key].values()) == 12
    assert list((out / "routers").glob("*.log"))
    print(f"\nmeasure with two peers: {time.monotonic() - t:.1f} s")


def test_measure_without_the_routers_environment_stops_before_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("KVROUTE_ROUTERS_VENV", str(tmp_path / "nowhere"))
    path = _exp(tmp_path, ["round_robin", "sglang_router:cache_aware"])
    res = CliRunner().invoke(main, ["measure", str(path), "--hardware", "cpu", "--engine", "emulator",
                                    "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and "make routers" in res.output
    assert not (tmp_path / "o" / "engines").exists()


async def _sessions_per_worker(url: str, requests: int = 8) -> list[int]:
    """One new chat at a time, each text sharing no prefix with the others (every one a
    cache miss) and longer than the last: how many land on each worker, largest first."""
    import aiohttp

    from kvroute.hardware import load_hardware
    from kvroute.live.engines import served_model_name
    from kvroute.live.loadgen import WORKER_FIELD

    where = []
    async with aiohttp.ClientSession() as c:
        for i in range(requests):
            body = {"model": served_model_name(load_hardware("cpu")), "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"{chr(ord('a') + i)} " * (300 + 200 * i)}]}
            async with c.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": f"s{i}"}) as r:
                assert r.status == 200
                where.append((await r.json())[WORKER_FIELD])
    return sorted(Counter(where).values(), reverse=True)


@needs_routers
@pytest.mark.parametrize("spec", ["sglang_router:cache_aware", "vllm_router:cache_aware"])
def test_cache_aware_counterpart_sends_misses_where_its_router_does(spec, engines, tmp_path):
    """On a miss both routers take the least loaded worker (every one idle here, so the
    same one each time), not the smallest tree, which would alternate: the counterpart
    must do the same, and prefix_approx (older SGLang source) must not."""
    from kvroute.live.gateway import Gateway
    from kvroute.live.peers import running_peer
    from kvroute.policies import counterpart

    async def through_gateway(policy: str) -> list[int]:
        gw = Gateway(list(zip(engines.names, engines.urls)), policy)
        await gw.start()
        try:
            return await _sessions_per_worker(gw.url)
        finally:
            await gw.stop()

    engines.reset_prefix_cache()
    with running_peer(spec, engines.urls, log_path=tmp_path / "router.log") as url:
        peer = asyncio.run(_sessions_per_worker(url))
    assert peer == [8]
    assert asyncio.run(through_gateway(counterpart(spec))) == peer
    assert asyncio.run(through_gateway("prefix_approx")) == [4, 4]


async def _mid_flight_placement(url: str) -> tuple[bool, bool]:
    """A streams a long reply; B (sharing A's long system prompt) is sent after A's first
    token, C after A has finished: (B went where A went, C went where A went)."""
    import json

    import aiohttp

    from kvroute.hardware import load_hardware
    from kvroute.live.engines import served_model_name
    from kvroute.live.loadgen import WORKER_FIELD

    model = served_model_name(load_hardware("cpu"))
    system = "lorem " * 600

    def body(i: int, **kw) -> dict:
        return {"model": model, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": f"{chr(97 + i)}x " * 75}], **kw}

    async with aiohttp.ClientSession() as c:
        first, where = asyncio.Event(), {}

        async def stream_a():
            async with c.post(url + "/v1/chat/completions", json=body(0, max_tokens=120, stream=True),
                              headers={"X-Session-ID": "a"}) as r:
                async for line in r.content:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        where.setdefault("a", json.loads(line[5:]).get(WORKER_FIELD))
                        first.set()

        task = asyncio.create_task(stream_a())
        await first.wait()
        async with c.post(url + "/v1/chat/completions", json=body(1, max_tokens=4), headers={"X-Session-ID": "b"}) as r:
            where["b"] = (await r.json())[WORKER_FIELD]
        assert not task.done(), "A finished before B was sent: slow the emulator down"
        await task
        async with c.post(url + "/v1/chat/completions", json=body(2, max_tokens=4), headers={"X-Session-ID": "c"}) as r:
            where["c"] = (await r.json())[WORKER_FIELD]
    return where["b"] == where["a"], where["c"] == where["a"]


@needs_routers
@pytest.mark.parametrize("spec", ["sglang_router:cache_aware", "vllm_router:cache_aware"])
def test_cache_aware_counterpart_learns_a_prefix_when_its_router_does(spec, tmp_path):
    """sglang-router 0.3.2 learns a request's text when it routes it (B and C follow A);
    through vllm-router 0.1.17, B goes to the other worker and C to A's, which learning at
    the finish and matching nothing both give (test_vllm_router_sends_a_known_prefix_to_the_least_loaded
    tells them apart): the counterpart, through the gateway, places B and C as the router does."""
    from kvroute.live.engines import running_engines
    from kvroute.live.gateway import Gateway
    from kvroute.live.peers import running_peer
    from kvroute.policies import counterpart

    async def through_gateway(urls, names) -> tuple[bool, bool]:
        gw = Gateway(list(zip(names, urls)), counterpart(spec))
        await gw.start()
        try:
            return await _mid_flight_placement(gw.url)
        finally:
            await gw.stop()

    # time_scale 1: A's 120 tokens stream for seconds, long enough to send B meanwhile
    with running_engines("cpu", kind="emulator", run_dir=tmp_path / "engines", time_scale=1.0) as eng:
        with running_peer(spec, eng.urls, log_path=tmp_path / "router.log") as url:
            peer = asyncio.run(_mid_flight_placement(url))
        eng.reset_prefix_cache()
        ours = asyncio.run(through_gateway(eng.urls, eng.names))
    assert peer == ((True, True) if spec.startswith("sglang") else (False, True))
    assert ours == peer


async def _known_prefix_placement(url: str) -> dict[str, str]:
    """L1 streams on one worker; A (a long system prompt) goes to the other and finishes;
    L2 streams there; L1 finishes; then B, sharing A's long prefix, is sent while the
    worker that served A is one request busier than the other: {request: worker}."""
    import aiohttp

    from kvroute.hardware import load_hardware
    from kvroute.live.engines import served_model_name
    from kvroute.live.loadgen import WORKER_FIELD

    model = served_model_name(load_hardware("cpu"))

    def body(system: str, user: str, **kw) -> dict:
        return {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                **kw}

    where: dict[str, str] = {}
    async with aiohttp.ClientSession() as c:
        async def stream(name: str, b: dict, started: asyncio.Event) -> None:
            async with c.post(url + "/v1/chat/completions", json=b, headers={"X-Session-ID": name}) as r:
                async for line in r.content:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        worker = json.loads(line[5:]).get(WORKER_FIELD)
                        if worker:
                            where.setdefault(name, worker)
                        started.set()

        async def once(name: str, b: dict) -> None:
            async with c.post(url + "/v1/chat/completions", json=b, headers={"X-Session-ID": name}) as r:
                where[name] = (await r.json())[WORKER_FIELD]

        s1, s2 = asyncio.Event(), asyncio.Event()
        l1 = asyncio.create_task(stream("l1", body("alpha " * 600, "one", max_tokens=60, stream=True), s1))
        await s1.wait()
        await once("a", body("lorem " * 600, "ax " * 50, max_tokens=4))
        await asyncio.sleep(0.5)  # A's completion reaches the router before L2 is routed
        l2 = asyncio.create_task(stream("l2", body("gamma " * 600, "two", max_tokens=400, stream=True), s2))
        await s2.wait()
        await l1
        await asyncio.sleep(0.5)
        assert not l2.done(), "L2 finished before B was sent: slow the emulator down"
        await once("b", body("lorem " * 600, "ax " * 50 + "more " * 10, max_tokens=4))
        await l2
    return where


@needs_routers
def test_vllm_router_sends_a_known_prefix_to_the_least_loaded(tmp_path):
    """In front of workers that refuse its /render posts, vllm-router 0.1.17 sends B to
    the least-loaded worker, not to the one that served B's long prefix (one request
    busier): it matched nothing. Its counterpart (``prefix_match=false``) does the same;
    the rule with prefix matching on would follow the prefix."""
    from kvroute.live.engines import running_engines
    from kvroute.live.gateway import Gateway
    from kvroute.live.peers import running_peer
    from kvroute.policies import counterpart

    async def through_gateway(urls, names, policy) -> dict[str, str]:
        gw = Gateway(list(zip(names, urls)), policy)
        await gw.start()
        try:
            return await _known_prefix_placement(gw.url)
        finally:
            await gw.stop()

    def followed(where: dict[str, str]) -> bool:
        assert where["a"] != where["l1"] and where["l2"] == where["a"], where  # the setup held
        return where["b"] == where["a"]

    with running_engines("cpu", kind="emulator", run_dir=tmp_path / "engines", time_scale=1.0) as eng:
        with running_peer("vllm_router:cache_aware", eng.urls, log_path=tmp_path / "router.log") as url:
            peer = asyncio.run(_known_prefix_placement(url))
        eng.reset_prefix_cache()
        ours = asyncio.run(through_gateway(eng.urls, eng.names, counterpart("vllm_router:cache_aware")))
        eng.reset_prefix_cache()
        rule = asyncio.run(through_gateway(eng.urls, eng.names, "vllm_cache_aware"))
    assert not followed(peer), peer
    assert not followed(ours), ours
    assert followed(rule), rule
