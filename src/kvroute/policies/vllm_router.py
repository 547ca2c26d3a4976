"""vllm-router's ``cache_aware`` and ``consistent_hash`` over the view, with its defaults.

vllm-router (PyPI ``vllm-router``, repository vllm-project/router) is a fork of
sglang-router's Rust code. These classes are the simulated counterparts of its measured
rows (``vllm_router:cache_aware``, ``vllm_router:consistent_hash``): the same rule and
the defaults that its ``vllm-router`` command line starts with. The live runs use
vllm-router 0.1.17 (``envs/routers.lock``); the rules were read from the repository's
``src/policies/*.rs`` and ``src/routers/http/router.rs``, and the defaults from the
0.1.17 wheel's ``vllm_router/router_args.py``.
"""

from __future__ import annotations

from typing import ClassVar

from kvroute.policies.base import ClusterView, RouteRequest, up_workers
from kvroute.policies.sglang import PrefixApproxPolicy
from kvroute.policies.sticky import StickyPolicy

#: ``VIRTUAL_NODES_PER_WORKER`` in src/policies/consistent_hash.rs (factory.rs hard-codes it)
VLLM_ROUTER_VNODES = 160


class VllmCacheAwarePolicy(PrefixApproxPolicy):
    """vllm-router ``cache_aware``: SGLang's rules, except that a cache miss goes to the least loaded.

    With load(w) = ``view.in_flight(w)`` over the up workers:

    1. imbalanced if ``max - min > balance_abs_threshold`` and
       ``max > min * balance_rel_threshold``: the least-loaded worker;
    2. else, if the best match rate ``matched_tokens / prompt_tokens`` is
       ``> cache_threshold``: the best-matching worker (ties -> least loaded);
    3. else the least-loaded worker. This is where it differs from ``prefix_approx``:
       SGLang takes the smallest tree.

    Ties after that go to the lowest index, as Rust's ``min_by_key`` keeps the first.
    The rules come from ``src/policies/cache_aware.rs`` in vllm-project/router. The
    header comment there still says "smallest tree size", but the code takes the least
    loaded (``low_match_min_load``). Only available workers are passed in, and ``load``
    counts the requests in flight, which ``route_typed_request`` raises for
    ``cache_aware`` only (``src/routers/http/router.rs``).

    Parameters (the ``vllm-router`` command-line defaults, ``RouterArgs`` in
    ``vllm_router/router_args.py``): ``cache_threshold`` 0.3, ``balance_abs_threshold``
    64, ``balance_rel_threshold`` 1.5. They equal SGLang's Python CLI defaults. The Python
    ``Router()`` constructor documents other defaults (0.5, 32, 1.0001), but the command
    line passes its own.

    Deviations. vllm-router matches raw characters of the request text in one radix
    tree with every worker as a tenant. Here the match is in tokens of full blocks, from
    the view. On a tie the tree returns one of the tied tenants, and here the least
    loaded wins. The tree is pruned to ``max_tree_size`` (2**25 characters per worker)
    every ``eviction_interval_secs`` (120). Those bounds belong to the router-side index,
    not to this policy (:class:`kvroute.kvcache.index.ApproxPrefixIndex`: a TTL and a
    capacity). The newest repository source also keeps an exact session-id map for chat
    requests that carry a history fallback. The 0.1.17 binary has no trace of it (no
    ``session_id_match`` decision), so it is left out.

    Defined over a router-side approximate index (``default_exact`` False, inherited).
    The caller records every decision there, including imbalanced ones, as vllm-router
    does, but only when the request has finished (``index_on_finish``). That reading came
    from the 0.1.17 binary with two emulated workers: a request sent while an earlier one
    sharing its long system prompt still streams goes to the other worker, and one sent
    after it finished goes to its worker (sglang-router 0.3.2 matches at once,
    ``tests/test_peers.py``). A router that matches nothing routes those two the same
    way, and that is what the binary did there (``prefix_match`` below).

    Before routing, vllm-router posts each request to every worker's
    ``/v1/chat/completions/render``. vLLM refuses it (403 without ``--enable-scale-out``),
    and routing goes on, but each refusal is work on that worker (``asks_every_worker``: the
    simulator charges the probe-measured ``api_refused_request_ms`` to every worker's core,
    where its API server shares the engine's, as on the CPU build).

    ``prefix_match`` (default true: the rules above). Measured on the 0.1.17 binary in
    front of workers that refuse ``/render`` (vLLM's CPU build, and the emulator), a
    request goes to the least-loaded worker even where another worker served its prefix
    and is only one request busier (``tests/test_peers.py``,
    ``test_vllm_router_sends_a_known_prefix_to_the_least_loaded``); in note 2's CPU rerun
    its per-engine counters read like least-loaded's, chats moving between workers. So it
    matched nothing there, most likely for want of the rendered text. False: every request
    takes rule 3, the least loaded: ``vllm_cache_aware:prefix_match=false``, the
    counterpart of the measured ``vllm_router:cache_aware`` (``COUNTERPARTS``).
    """

    name: ClassVar[str] = "vllm_cache_aware"
    index_on_finish: ClassVar[bool] = True
    asks_every_worker: ClassVar[bool] = True  # POST /v1/chat/completions/render to each (docs/live.md)
    params: ClassVar[dict[str, tuple[type, object]]] = {
        "cache_threshold": (float, 0.3),
        "balance_abs_threshold": (int, 64),
        "balance_rel_threshold": (float, 1.5),
        "prefix_match": (bool, True),
    }

    prefix_match: bool

    def choose(self, request: RouteRequest, view: ClusterView) -> str:
        """Rules 1-3; with ``prefix_match`` false, rule 3 for every request (no text to match)."""
        if self.prefix_match:
            return super().choose(request, view)
        up = up_workers(view)
        return self.low_match_worker(up, {w: view.in_flight(w) for w in up}, view)

    def low_match_worker(self, up: list[str], load: dict[str, int], view: ClusterView) -> str:
        """Rule 3, below the cache threshold: the least-loaded worker (ties -> lowest index)."""
        return min(up, key=load.__getitem__)


class SglangCacheAwarePolicy(VllmCacheAwarePolicy):
    """sglang-router 0.3.2 ``cache_aware``: vllm-router's rules (a miss goes to the least
    loaded, checked against both binaries in ``tests/test_peers.py``), with the tree
    learning a request's text when it is routed, not when it finishes: a request sent
    while an earlier one sharing its prefix still streams goes where that one went.
    Defaults: sglang-router's command line, the same as vllm-router's."""

    name: ClassVar[str] = "sglang_cache_aware"
    index_on_finish: ClassVar[bool] = False
    asks_every_worker: ClassVar[bool] = False
    # it matches its own text (no /render): always rules 1-3, no prefix_match parameter
    params: ClassVar[dict[str, tuple[type, object]]] = PrefixApproxPolicy.params
    choose = PrefixApproxPolicy.choose


class ConsistentHashPolicy(StickyPolicy):
    """vllm-router ``consistent_hash``: a hash ring on the session id, 160 virtual nodes per worker.

    The rule is :class:`~kvroute.policies.sticky.StickyPolicy`'s. A session belongs to
    the first ring point clockwise from its hash whose worker is up, so when a worker goes
    down only its sessions move, and they move back when it returns. vllm-router hands the
    policy only available workers and rebuilds its ring when that set changes, which is
    the same as skipping a down worker's points. That is why the "first healthy worker"
    fallback in ``src/policies/consistent_hash.rs`` never runs there.

    Parameters: none. ``virtual_nodes`` is 160 (``VIRTUAL_NODES_PER_WORKER``). The
    ``PolicyConfig`` field exists, but ``src/policies/factory.rs`` ignores it.

    Key: vllm-router hashes the first non-empty one of the X-Session-ID header (then
    x-user-id, ...) or the body's session fields or ``user``
    (``src/policies/hash_key.rs``), else the request body. kvroute's gateway takes
    X-Session-ID, else ``user``, as ``request.session_id``, and with neither it uses a
    fresh id per request, which scatters turns as a body hash does.

    Deviation: vllm-router places points with ``fbi_hash`` (mcrouter's furc hash and
    MurmurHash64A) of ``"{url}:{i}"``, and the session key ``"header:x-session-id:{id}"``.
    Here it is blake2b of ``"{worker}#{i}"`` and of the id. Simulated workers have names,
    not the live URLs, so no hash could reproduce the live assignment anyway. The ring's
    properties are the same, but which sessions share a worker differs.
    """

    name: ClassVar[str] = "consistent_hash"
    vnodes: ClassVar[int] = VLLM_ROUTER_VNODES
