"""Common random numbers: within a round every policy sees the same draws, request by request."""

import dataclasses

import numpy as np
import pandas as pd
import pytest
import yaml

from kvroute.experiment import load_experiment
from kvroute.hardware import load_hardware
from kvroute.policies import make_policy
from kvroute.sim.cluster import SimCluster
from kvroute.sim.run import common_rng, simulate_experiment
from kvroute.workload import generate

#: open-loop traffic that queues on a6000x4, so TTFTs depend on every arrival's timing
WORKLOAD = {"generator": "sharegpt_like", "params": {"conversations": 120, "rate_per_s": 6.0}}


def _records(tmp_path, policies):
    raw = {"name": "crn", "seed": 11, "rounds": 1, "workload": WORKLOAD,
           "runs": [{"hardware": "a6000x4", "policies": policies}]}
    path = tmp_path / "crn.yaml"
    path.write_text(yaml.safe_dump(raw))
    simulate_experiment(load_experiment(path), tmp_path / "o")
    df = pd.read_parquet(tmp_path / "o/requests.parquet")
    return [df[df.policy == p].sort_values(["conversation", "turn"]).reset_index(drop=True) for p in policies]


def test_policies_that_route_alike_give_identical_ttfts(tmp_path):
    """A threshold no queue reaches makes hybrid_sticky route as sticky; then every
    timing must be equal, bit for bit (before the jitter was common, ~all TTFTs differed)."""
    sticky, hybrid = _records(tmp_path, ["sticky", "hybrid_sticky:threshold_ms=1000000000"])
    assert len(sticky) == len(hybrid) > 300
    assert sticky[["conversation", "turn", "worker"]].equals(hybrid[["conversation", "turn", "worker"]])
    assert sticky.queue_ms.max() > 0, "the test needs queueing: then any timing difference compounds"
    for col in ["ttft_ms", "arrival_s", "e2e_ms", "cached_tokens"]:
        assert sticky[col].tolist() == hybrid[col].tolist(), col


class _Recording(SimCluster):
    """Records each request's router-to-engine delay as the simulation applied it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.delays: dict[tuple[str, int], float] = {}
        self.prompts: dict[tuple[str, int], int] = {}
        self.busy: dict[tuple[str, int], bool] = {}  # its engine ran when it was routed
        self.shares: list[float] = []  # every engine time share set

    def route(self, conv, index, turn, stream, prompt, output):
        done = super().route(conv, index, turn, stream, prompt, output)
        p = self.pending[self._next_rid - 1]
        self.prompts[(conv.id, turn)] = prompt
        self.busy[(conv.id, turn)] = not self.engines[p.worker].idle
        return done

    def _deliver(self, i, ereq, *rest):
        p = self.pending[ereq.rid]
        self.delays[(p.conversation.id, p.turn)] = self.env.now - p.arrival_s
        super()._deliver(i, ereq, *rest)

    def _set_share(self, i):
        super()._set_share(i)
        self.shares.append(self.engines[i].share)


def test_a_request_gets_the_same_api_delay_under_every_policy():
    """round_robin and kv_aware route differently, so they route requests in a different
    order; each request still waits the same API-server delay under both."""
    hw = load_hardware("a6000x4")
    trace = generate("note2", 5, chats=24, turns=4, system_words=300, user_words=60, reply_tokens=32, ramp_s=2.0)
    runs = {}
    for spec in ["round_robin", "kv_aware"]:
        cluster = _Recording(trace, hw, make_policy(spec, np.random.default_rng(0)), common_rng(5, 0), True)
        rows = cluster.run()
        runs[spec] = (cluster, {(r["conversation"], r["turn"]): r["worker"] for r in rows})
    (a, workers_a), (b, workers_b) = runs["round_robin"], runs["kv_aware"]
    assert sum(workers_a[k] != workers_b[k] for k in workers_a) > len(workers_a) / 4, "the policies must disagree"
    assert a.delays.keys() == b.delays.keys() and len(a.delays) == 24 * 4
    c = hw.coefficients
    lo, hi = (c.api_overhead_ms - c.api_jitter_ms) * 1e-3, (c.api_overhead_ms + c.api_jitter_ms) * 1e-3
    assert lo < hi, "the profile needs jitter for the test to mean anything"
    for i, conv in enumerate(trace.conversations):
        for k in range(len(conv.turns)):
            drawn = a.api_delay_s[i][k]
            assert b.api_delay_s[i][k] == drawn and lo <= drawn <= hi
            # applied as drawn (clock arithmetic at different arrival times rounds differently)
            assert a.delays[(conv.id, k)] == pytest.approx(drawn, abs=1e-12)
            assert b.delays[(conv.id, k)] == pytest.approx(drawn, abs=1e-12)
    assert len({round(d, 9) for d in a.delays.values()}) > len(a.delays) / 2, "delays should vary by request"


def test_common_draws_do_not_depend_on_the_hardware_or_a_new_round():
    """Another profile scales the same uniforms into its own range; another round draws anew."""
    trace = generate("note2", 2, chats=4, turns=3)
    hw = load_hardware("a6000x4")
    wide = dataclasses.replace(hw, coefficients=dataclasses.replace(hw.coefficients, api_overhead_ms=10.0, api_jitter_ms=10.0))
    policy = make_policy("round_robin", np.random.default_rng(0))
    u = np.array(SimCluster(trace, wide, policy, common_rng(2, 0), True).api_delay_s) / 20e-3
    c = hw.coefficients
    lo, hi = (c.api_overhead_ms - c.api_jitter_ms) * 1e-3, (c.api_overhead_ms + c.api_jitter_ms) * 1e-3
    assert np.array(SimCluster(trace, hw, policy, common_rng(2, 0), True).api_delay_s) == pytest.approx(lo + (hi - lo) * u)
    assert SimCluster(trace, hw, policy, common_rng(2, 1), True).api_delay_s != SimCluster(trace, hw, policy, common_rng(2, 0), True).api_delay_s


def _cpu(**coefficients):
    hw = load_hardware("cpu")
    return dataclasses.replace(hw, coefficients=dataclasses.replace(hw.coefficients, **coefficients))


def _cpu_run(hw, seed=4):
    trace = generate("note2", seed, chats=8, turns=4, system_words=300, user_words=60, reply_tokens=32, ramp_s=1.0)
    cluster = _Recording(trace, hw, make_policy("round_robin", np.random.default_rng(0)), common_rng(seed, 0), True)
    rows = cluster.run()
    return trace, cluster, rows


def test_the_api_delay_grows_with_the_prompt_and_beside_a_running_engine():
    """The CPU probes' two API terms: per prompt token, and the stretch beside a busy engine.
    The API work runs at 1/f of its speed while its engine runs (re-timed when the engine
    starts or stops), so a delay lies between its idle length and f times that."""
    per_token, f = 0.004, 1.5
    trace, cluster, _ = _cpu_run(_cpu(api_per_prompt_token_ms=per_token, api_busy_factor=f))
    stretched = idle_only = 0
    for i, conv in enumerate(trace.conversations):
        for k in range(len(conv.turns)):
            key = (conv.id, k)
            idle = cluster.api_delay_s[i][k] + per_token * cluster.prompts[key] * 1e-3
            delay = cluster.delays[key]
            assert idle - 1e-12 <= delay <= f * idle + 1e-12, key
            stretched += delay == pytest.approx(f * idle, abs=1e-12)
            idle_only += delay == pytest.approx(idle, abs=1e-12)
    assert stretched and idle_only, "the run needs requests beside a running engine and beside an idle one"
    # two processes share the core fairly: the API's work on it is f - 1 of its delay, and
    # the engine runs at 1/f beside it (f/(f - 1) beyond f = 2)
    assert max(cluster.shares) == pytest.approx(f) and min(cluster.shares) == 1.0
    assert max(_cpu_run(_cpu(api_busy_factor=3.0))[1].shares) == pytest.approx(3.0 / 2.0)


def test_an_api_server_beside_the_engine_slows_the_engine():
    """Same draws and routing: a stretched API window costs the engine time, so replies end later."""
    _, plain, rows = _cpu_run(_cpu())
    _, shared, rows_shared = _cpu_run(_cpu(api_busy_factor=2.0))
    assert not plain.shares and not any(plain.api_jobs), "f = 1: no API job beside the engine, no share"
    assert max(r["finish_s"] for r in rows_shared) > max(r["finish_s"] for r in rows)
    assert sum(e.busy_s for e in shared.engines) > sum(e.busy_s for e in plain.engines)


class _ByChat:
    """Routes chat i to worker i % 2, whatever the load: two runs route alike."""

    name = "by_chat"
    index_on_finish = False
    asks_every_worker = False

    def __init__(self, trace):
        self.worker = {c.id: f"w{i % 2}" for i, c in enumerate(trace.conversations)}

    def choose(self, req, view):
        return self.worker[req.session_id]


CLIENT = {"client_cpu_per_request_ms": 1.0, "client_cpu_per_prompt_token_ms": 0.001, "client_cpu_per_token_ms": 0.2}


def _client_run(hw, seed=4):
    trace = generate("note2", seed, chats=8, turns=4, system_words=300, user_words=60, reply_tokens=32, ramp_s=1.0)
    cluster = SimCluster(trace, hw, _ByChat(trace), common_rng(seed, 0), True)
    rows = pd.DataFrame(cluster.run()).set_index(["conversation", "turn"]).sort_index()
    return trace, cluster, rows


def test_the_clients_cpu_slows_only_the_engine_on_its_core():
    """The cpu profile pins the gateway and load generator to w1's core (engine.client_worker):
    the probe-measured client CPU delays w1's engine and nothing else. Chats stay on their
    worker, so w0's requests are timed exactly as without a client; w1's finish later, by
    no more than all the client's work; a profile without a client worker ignores the costs."""
    hw = _cpu()
    assert hw.engine.client_worker == 1
    _, plain, base = _client_run(hw)
    trace, charged, rows = _client_run(_cpu(**CLIENT))
    assert charged.client_core == 1 and plain.client_core is None
    assert (rows.worker == base.worker).all() and set(rows.worker) == {"w0", "w1"}
    w0, w1 = rows.worker == "w0", rows.worker == "w1"
    for col in ("ttft_ms", "e2e_ms", "finish_s"):
        assert rows.loc[w0, col].tolist() == pytest.approx(base.loc[w0, col].tolist(), abs=1e-9), col
    # later on the whole (one request may gain: a delayed run can batch a newcomer sooner)
    late = rows.loc[w1, "finish_s"] - base.loc[w1, "finish_s"]
    assert late.mean() > 0 and (late > 0).mean() > 0.5
    assert rows.loc[w1, "e2e_ms"].mean() > base.loc[w1, "e2e_ms"].mean()
    work = sum(CLIENT["client_cpu_per_request_ms"] + CLIENT["client_cpu_per_prompt_token_ms"] * p
               for p in rows.prompt_tokens) + CLIENT["client_cpu_per_token_ms"] * rows.output_tokens.sum()
    assert rows.loc[w1, "finish_s"].max() - base.loc[w1, "finish_s"].max() <= work * 1e-3
    assert charged.engines[0].busy_s == pytest.approx(plain.engines[0].busy_s)
    # no client worker: the same costs charge nobody
    unpinned = dataclasses.replace(hw, engine=dataclasses.replace(hw.engine, client_worker=None))
    unpinned = dataclasses.replace(unpinned, coefficients=_cpu(**CLIENT).coefficients)
    _, free, same = _client_run(unpinned)
    assert free.client_core is None and same.equals(base)


def test_the_client_interference_scales_what_the_clients_cpu_costs_its_engine():
    """client_interference k: each second of the client's CPU costs the engine beside it k
    seconds. k = 0 charges nothing (the records of a run without client costs); k = 2 is
    the same run as k = 1 with every client cost doubled; k = 1 is the default."""
    assert load_hardware("cpu").coefficients.client_interference == 1.0
    _, _, base = _client_run(_cpu())
    _, _, none = _client_run(_cpu(**CLIENT, client_interference=0.0))
    assert none.equals(base)
    _, _, twice = _client_run(_cpu(**CLIENT, client_interference=2.0))
    _, _, doubled = _client_run(_cpu(**{k: 2 * v for k, v in CLIENT.items()}))
    _, _, once = _client_run(_cpu(**CLIENT))
    for col in ("ttft_ms", "e2e_ms", "finish_s"):
        assert twice[col].tolist() == pytest.approx(doubled[col].tolist(), rel=1e-9, abs=1e-9), col
    w1 = twice.worker == "w1"
    assert twice.loc[w1, "finish_s"].max() > once.loc[w1, "finish_s"].max() > base.loc[w1, "finish_s"].max()


class _AllOnW0(_ByChat):
    """Every chat on w0: its neighbour w1 never runs."""

    def __init__(self, trace):
        self.worker = {c.id: "w0" for c in trace.conversations}


def test_a_worker_beside_a_busy_neighbour_runs_neighbour_slowdown_times_slower():
    """The probes time every term with the other workers idle and measure how much slower an
    engine runs beside a busy one (neighbour_slowdown s). With every chat on w0, its
    neighbour never runs and nothing changes; with chats on both, each engine's steps run s
    times as long while the other is busy, so it is busy between 1 and s times as long as at
    s = 1; s = 1 (every GPU family) changes nothing."""
    assert load_hardware("cpu").coefficients.neighbour_slowdown == 1.0
    trace = generate("note2", 4, chats=8, turns=4, system_words=300, user_words=60, reply_tokens=32, ramp_s=1.0)

    def run(hw, policy):
        cluster = SimCluster(trace, hw, policy(trace), common_rng(4, 0), True)
        rows = pd.DataFrame(cluster.run()).set_index(["conversation", "turn"]).sort_index()
        return cluster, rows

    s = 1.25
    plain, base = run(_cpu(), _AllOnW0)
    same, rows = run(_cpu(neighbour_slowdown=1.0), _AllOnW0)
    assert rows.equals(base)
    alone, alone_rows = run(_cpu(neighbour_slowdown=s), _AllOnW0)
    assert alone_rows.equals(base) and alone.engines[1].busy_s == 0.0  # w1 never runs: w0 never slowed
    both_plain, both_base = run(_cpu(), _ByChat)
    both, both_rows = run(_cpu(neighbour_slowdown=s), _ByChat)
    for i in (0, 1):
        assert both_plain.engines[i].busy_s < both.engines[i].busy_s < both_plain.engines[i].busy_s * s
    assert both_rows.e2e_ms.mean() > both_base.e2e_ms.mean()
    # two single requests sent at once, one per worker, the same size: their runs overlap but
    # for the API servers' jitter, so each engine is busy more than 1 + (s - 1) / 2 times as
    # long, and never more than s times
    two = generate("note2", 4, chats=2, turns=1, system_words=300, user_words=60, reply_tokens=32, ramp_s=0.0)
    pair = [SimCluster(two, _cpu(neighbour_slowdown=x), _ByChat(two), common_rng(4, 0), True) for x in (1.0, s)]
    for c in pair:
        c.run()
    for i in (0, 1):
        ratio = pair[1].engines[i].busy_s / pair[0].engines[i].busy_s
        assert 1 + (s - 1) / 2 < ratio <= s * (1 + 1e-9)


class _AskingByChat(_ByChat):
    """_ByChat that first asks every worker, as vllm-router's cache_aware asks each to render."""

    asks_every_worker = True


def test_a_policy_that_asks_every_worker_charges_each_core_its_refusals():
    """vllm-router's cache_aware posts every request to every worker first (vLLM refuses):
    with the probe-measured cost per refusal each engine finishes later, by no more than all
    the refusals' work; without it, or where the API server has a core of its own (GPU
    families: api_busy_factor 1), routing alike gives identical records."""
    refused, f = 2.0, 1.5  # ms a refusal; the API server shares its engine's core, as the probes find
    hw = _cpu(api_busy_factor=f)
    trace = generate("note2", 4, chats=8, turns=4, system_words=300, user_words=60, reply_tokens=32, ramp_s=1.0)

    def run(hw, policy):
        cluster = SimCluster(trace, hw, policy(trace), common_rng(4, 0), True)
        return pd.DataFrame(cluster.run()).set_index(["conversation", "turn"]).sort_index()

    base = run(hw, _ByChat)
    assert run(hw, _AskingByChat).equals(base)  # no measured cost: nothing charged
    assert run(_cpu(api_refused_request_ms=refused, api_busy_factor=f), _ByChat).equals(base)  # one that does not ask
    rows = run(_cpu(api_refused_request_ms=refused, api_busy_factor=f), _AskingByChat)
    assert (rows.worker == base.worker).all() and set(rows.worker) == {"w0", "w1"}
    for w in ("w0", "w1"):  # both engines, though each serves only its own chats
        on = rows.worker == w
        late = rows.loc[on, "finish_s"] - base.loc[on, "finish_s"]
        assert late.mean() > 0 and late.max() <= len(rows) * refused * 1e-3, (w, late.describe())
    gpu_like = _cpu(api_refused_request_ms=refused, api_busy_factor=1.0)
    assert run(gpu_like, _AskingByChat).equals(run(gpu_like, _ByChat))
