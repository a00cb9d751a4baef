"""A discrete-event simulation of a P/D fleet whose routing decisions are the router's own.

Per turn the simulator calls, in the order a real turn does (`router.turns.pipeline`):
the cache-token codec and the store's claim (`auth.cache_token`, `store`): that is
gather, whose `TurnFacts` it builds from the simulated nodes; then the router's own path
policy (`turns.policy.policy_for`, by the name and parameters the settings give)
decides on those facts: P and D placement, the reuse plan, the path and each leg's
transfer params (`TurnPlan.prefill_params`, `decode_params`); after the D leg the cost
model learns the TTFT, and the new `Handle`, `store.put` and a new token.
The retention guard (`nodes.retention.RetentionGuard`, with its `blocks_to_free` watermark
math and `ReleaseQueue`) runs every `retention.check_interval_s` against the simulated
decode nodes through a simulated `NodeHttp` client that answers `/metrics` and release
requests from the simulated KV state. Only the nodes are simulated: compute, transfers,
KV blocks, TTLs (`nodes.py`, priced by a `profiles.Profile`).

`pipeline.open_turn` itself is not called: gather and execute read the wall clock
(`time.time()`) and drive the legs over HTTP (`Legs`, `tokenize`), so the simulator
gathers the facts itself (the prompt's ids are known: it asks no node for them) and
runs the decision the router runs, with the simulated clock as the facts' `now`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from kvagent_server.router.auth.cache_token import TokenCodec, TokenError, verify_binding
from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.auth.tenancy import Tenant
from kvagent_server.router.nodes.client import NodeResponse
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.nodes.retention import (
    PolicyEviction,
    RetentionGuard,
    remote_request_id,
)
from kvagent_server.router.reuse import paths, placement, transfer
from kvagent_server.router.reuse.pauses import ToolPauses
from kvagent_server.router.reuse.retention_policy import retention_policy_for
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.handle import Handle, new_handle_id
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.store.redis_store import RedisStore
from kvagent_server.router.turns.policy import policy_for
from kvagent_server.router.turns.shapes import NodeFacts, TurnFacts, TurnPlan, TurnRequest

from benchmarks.fleet_sim.nodes import DNode, PNode
from benchmarks.fleet_sim.profiles import Profile
from benchmarks.fleet_sim.workload import FleetSpec, Script

TENANT = "sim"
_TENANT = Tenant(name=TENANT, cache_salt="sim", max_concurrent_streams=1 << 20)
_STORE_OPS = ("put", "claim", "claim_latest", "peek_latest", "retained", "evict_handles",
              "drop_node")


class CountingStore:
    """Counts the calls the router makes on its store (one call = one round trip on Redis)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in _STORE_OPS:
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops[name] += 1
            return await attr(*args, **kwargs)
        return counted


@dataclass
class TurnRecord:
    session: int
    turn: int
    start: float
    path: str
    reason: str
    prompt: int
    reused: int
    ttft: float = math.nan
    e2e: float = math.nan
    pull_bytes: int = 0
    push_bytes: int = 0
    router_cpu_s: float = 0.0
    store_ops: int = 0
    waited: bool = False


@dataclass
class SimConfig:
    n_prefill: int = 1
    n_decode: int = 1
    reuse: bool = True
    #: P's prefix cache: holds the shared system prompt once it has computed it.
    p_prefix_cache: bool = True
    #: ... and also each session's last prompt (whole blocks; no eviction: for replaying
    #: a few recorded conversations, where P's cache holds them all).
    p_session_cache: bool = False
    d_kv_blocks: int | None = None  # None: the profile's
    ttl_s: float = 480.0
    settings: dict[str, Any] = field(default_factory=dict)  # RouterSettings overrides
    seed: int = 0
    #: A Redis URL: the router's `RedisStore` against a real Redis (else `MemoryStore`).
    redis_url: str | None = None


@dataclass
class _Session:
    sid: int
    name: str
    script: Script
    history: bytes = b""  # token ids < 256: one byte each
    turn: int = 0
    token: str | None = None
    on_done: Callable[[float], None] | None = None


class Simulation:
    """One run: a profile, a fleet shape, a workload. `await run_fleet(...)` or
    `await run_replay(...)` returns the turn records; `summary()` the aggregates."""

    def __init__(self, profile: Profile, config: SimConfig) -> None:
        self.profile = profile
        self.cfg = config
        overrides = dict(config.settings)
        retention = {"decode_blocks_ttl_s": config.ttl_s} | overrides.pop("retention", {})
        nodes = {"block_size": profile.block_size} | overrides.pop("nodes", {})
        self.settings = RouterSettings(reuse=config.reuse, retention=retention, nodes=nodes,
                                       **overrides)
        self.now = 0.0
        def clock() -> float:  # the store judges expiry by simulated time
            return self.now
        inner: Any = (RedisStore.from_url(config.redis_url, clock=clock) if config.redis_url
                      else MemoryStore(clock=clock))
        self.store = CountingStore(inner)
        self.codec = TokenCodec(KeyRing.generate())
        self.costs = paths.CostModel()
        self.rng = random.Random(config.seed)
        blocks = config.d_kv_blocks or profile.d_kv_blocks
        self.p_nodes = [PNode(f"prefill-{i}", f"http://p{i}.sim") for i in range(config.n_prefill)]
        self.d_nodes = [DNode(f"decode-{i}", f"http://d{i}.sim", capacity=blocks,
                              ttl_s=config.ttl_s) for i in range(config.n_decode)]
        self.by_name: dict[str, PNode | DNode] = {n.name: n for n in self.p_nodes}
        self.by_name.update({n.name: n for n in self.d_nodes})
        # The nodes as the router's facts and plans name them.
        self.router_nodes = {n.name: Node(name=n.name, url=n.url, role=role, healthy=True)
                             for role, ns in (("prefill", self.p_nodes),
                                              ("decode", self.d_nodes)) for n in ns}
        # The router's own path policy, by the name and parameters the settings give.
        self.policy = policy_for(self.settings)
        self._events: list[tuple[float, int, Callable[[], Any]]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self.records: list[TurnRecord] = []
        self.evicted_handles = 0
        self.guard_cpu_s = 0.0
        self.guard_rounds = 0
        self._shared = b""
        # The router's own retention policy, by the name the settings give.
        evict = PolicyEviction(self.store, retention_policy_for(self.settings), ToolPauses(),
                               clock=clock)
        self.guard = (RetentionGuard(
            lambda name: _SimNodeHttp(self, self.by_name[name]),
            nodes=lambda: [(d.name, d.url, d.epoch) for d in self.d_nodes],
            evict=evict, evict_for_turn=evict.for_turn, model=lambda: "sim",
            high=self.settings.retention.high_watermark,
            low=self.settings.retention.low_watermark,
            interval_s=self.settings.retention.check_interval_s,
            on_evicted=self._count_evicted)
            if self.settings.retention.high_watermark is not None else None)

    # ------------------------------------------------------------------ event loop

    def at(self, t: float, fn: Callable[[], Any]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    async def _loop(self, until: float = math.inf,
                    done: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order until `done()`, or past `until` with nothing in flight."""
        while self._events and not done():
            t, _, fn = heapq.heappop(self._events)
            if t > until and not self._busy():
                break
            self.now = max(self.now, t)
            out = fn()
            if asyncio.iscoroutine(out):
                await out

    def _busy(self) -> bool:
        return any(n.in_flight for n in self.p_nodes) or any(n.in_flight for n in self.d_nodes)

    # ------------------------------------------------------------------ the nodes' HTTP

    def _count_evicted(self, n: int) -> None:
        self.evicted_handles += n

    def node_metrics(self, node: Any) -> NodeResponse:
        """A decode node's answer to the retention guard's `/metrics` read."""
        text = (f'vllm:kv_cache_usage_perc{{model_name="sim"}} {node.usage(self.now)}\n'
                f'vllm:cache_config_info{{num_gpu_blocks="{node.capacity}"}} 1.0\n')
        return NodeResponse.of(200, text.encode())

    def node_release(self, node: Any, body: dict[str, Any]) -> NodeResponse:
        """A decode node's answer to the retention guard's release request."""
        for rid in body.get("kv_transfer_params", {}).get(transfer.RELEASE_KEY, []):
            node.release(self.now, rid)
        return NodeResponse.of(200, orjson.dumps({"choices": []}))

    async def _guard_round(self) -> None:
        assert self.guard is not None
        t0 = time.thread_time()
        await self.guard.run_once()
        self.guard_cpu_s += time.thread_time() - t0
        self.guard_rounds += 1
        if self._events:
            self.at(self.now + self.guard.interval_s, self._guard_round)

    # ------------------------------------------------------------------ a turn

    def _states(self) -> list[placement.NodeState]:
        cap = self.settings.nodes.max_in_flight
        return ([placement.NodeState(node_id=n.name, url=n.url, role="prefill", healthy=True,
                                     in_flight=n.in_flight, epoch=n.epoch, max_in_flight=cap)
                 for n in self.p_nodes]
                + [placement.NodeState(node_id=n.name, url=n.url, role="decode", healthy=True,
                                       in_flight=n.in_flight, epoch=n.epoch, max_in_flight=cap)
                   for n in self.d_nodes])

    def _tokens(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def _node(self, name: str) -> Node:
        node = self.router_nodes[name]
        node.epoch = self.by_name[name].epoch
        return node

    async def _gather(self, s: _Session, prompt: list[int]) -> TurnFacts:
        """The turn's facts, as the router's gather collects them (the simulated clock as
        `now`; the prompt's ids are known, so verifying a reuse asks no node for them)."""
        st, now = self.settings, self.now
        handle, rejected = None, None
        if st.reuse:
            if s.token is None:
                handle = await self.store.claim_latest(TENANT, s.name)
            else:
                try:
                    claims = self.codec.decode(s.token, now=now)
                except TokenError as exc:
                    rejected = exc.reason
                else:
                    rejected = verify_binding(claims, TENANT, s.name)
                    if rejected is None:
                        handle = await self.store.claim(TENANT, claims.handle)
                        rejected = None if handle is not None else "already_used"
        holder_node = self.by_name.get(handle.decode_node) if handle is not None else None
        holder = holder_node if (handle is not None and isinstance(holder_node, DNode)
                                 and holder_node.epoch == handle.decode_epoch
                                 and not handle.expired(now)) else None
        if handle is not None:
            affinity: str | None = handle.decode_node
        elif st.reuse:
            latest = await self.store.peek_latest(TENANT, s.name)
            affinity = latest.decode_node if latest is not None else None
        else:
            affinity = None
        candidates = tuple(NodeFacts(node=self._node(state.node_id), state=state,
                                     block_size=st.nodes.block_size) for state in self._states())
        req = TurnRequest.build(endpoint="/v1/completions", body={"model": "sim", "prompt": [0]},
                                tenant=_TENANT, session=s.name, token=s.token)
        return TurnFacts(
            req=req, session=s.name, source="kvagent", handle=handle, rejected=rejected,
            handle_node_healthy=holder_node is not None,
            handle_node_epoch=holder_node.epoch if holder_node else None,
            holder=self._node(holder.name) if holder is not None else None,
            candidates=candidates, affinity=affinity, prefill_block_size=st.nodes.block_size,
            costs=self.costs.snapshot(),
            prompt_ids=tuple(prompt) if holder is not None else (), ids_gathered=True,
            est_tokens=len(prompt), now=now)

    async def _decide(self, s: _Session, prompt: list[int]) -> tuple[
            Handle | None, TurnPlan, PNode, DNode, dict[str, Any]]:
        """The router's choices for one turn: its facts, and its own policy's decision."""
        facts = await self._gather(s, prompt)
        plan = self.policy.decide(facts)
        assert isinstance(plan, TurnPlan)  # the facts hold the ids it could ask for
        assert plan.p_first is not None and plan.d_first is not None
        p_node, d_node = self.by_name[plan.p_first.name], self.by_name[plan.d_first.name]
        if plan.path in paths.ON_DECODE:
            on = plan.holder if plan.path == "d_direct" else plan.d_first
            params = plan.decode_params(on)
            if on is not None:
                d_node = self.by_name[on.name]
        else:
            params = plan.prefill_params()
        assert isinstance(p_node, PNode) and isinstance(d_node, DNode)
        return facts.handle, plan, p_node, d_node, params

    async def _finish_router(self, s: _Session, rec: TurnRecord, d: DNode, rid: str,
                             sequence: list[int], kept_blocks: int, computed: int) -> None:
        """After the D leg: learn the TTFT, store the handle, mint the next token."""
        st = self.settings
        t0 = time.thread_time()
        ops0 = sum(self.store.ops.values())
        try:
            self.costs.observe(rec.path, computed, rec.ttft, reused_tokens=rec.reused)
        except ValueError:
            pass
        ttl = int(st.retention.decode_blocks_ttl_s - st.token_safety_margin_s)
        s.token = None
        if st.reuse and ttl > 0:
            params = {transfer.DO_REMOTE_DECODE: True, transfer.DO_REMOTE_PREFILL: False,
                      transfer.REMOTE_BLOCK_IDS: [list(range(kept_blocks))],
                      transfer.REMOTE_ENGINE_ID: d.name, transfer.REMOTE_REQUEST_ID: rid,
                      transfer.REMOTE_HOST: d.url, transfer.REMOTE_PORT: 5700,
                      transfer.REMOTE_NUM_TOKENS: len(sequence) - 1}
            handle = Handle(handle_id=new_handle_id(), tenant=TENANT, session=s.name,
                            decode_node=d.name, decode_epoch=d.epoch, kv_transfer_params=params,
                            token_ids=sequence, block_size=st.nodes.block_size or 1,
                            created_at=self.now, expires_at=self.now + ttl)
            if transfer.retained_tokens(handle) is not None:
                await self.store.put(handle)
                s.token = self.codec.encode(tenant=TENANT, session=s.name,
                                            handle=handle.handle_id, iat=int(self.now),
                                            exp=int(self.now) + ttl)
        elif self.guard is not None:  # no handle records these blocks: release them
            self.guard.queue.add(d.name, [rid])
        rec.router_cpu_s += time.thread_time() - t0
        rec.store_ops += sum(self.store.ops.values()) - ops0

    async def _turn(self, s: _Session) -> None:
        prof, bs = self.profile, self.profile.block_size
        start = self.now
        new = s.script.new_tokens[s.turn]
        if s.turn == 0:
            new_ids = self._shared[:new] + self._tokens(max(0, new - len(self._shared)))
        else:
            new_ids = self._tokens(new)
        prompt_b = s.history + new_ids
        prompt = list(prompt_b)
        t0 = time.thread_time()
        ops0 = sum(self.store.ops.values())
        handle, plan, p, d, params = await self._decide(s, prompt)
        path = plan.path
        rec = TurnRecord(session=s.sid, turn=s.turn, start=start, path=path,
                         reason=plan.reuse.reason, prompt=len(prompt), reused=0)
        rec.router_cpu_s = time.thread_time() - t0
        rec.store_ops = sum(self.store.ops.values()) - ops0
        self.records.append(rec)
        answer = self._tokens(self.max_tokens)
        sequence_b = prompt_b + answer
        alloc = math.ceil((len(prompt) + self.max_tokens) / bs)
        keep = math.ceil((len(sequence_b) - 1) / bs)
        rid = f"r{next(self._rid)}"

        def first_token(t_first: float, computed: int) -> None:
            rec.ttft = t_first - start
            end = t_first + (self.max_tokens - 1) * prof.step_s(d.running)
            d.running += 1

            async def done() -> None:
                d.running -= 1
                d.in_flight -= 1
                for old in params.get(transfer.RELEASE_KEY, []):  # kvagent_release
                    d.release(self.now, old)
                d.finish(self.now, rid, alloc, keep)
                self.at(self.now + d.ttl_s, lambda: d.expire(self.now))
                rec.e2e = self.now - start
                s.history = sequence_b
                await self._finish_router(s, rec, d, rid, list(sequence_b), keep, computed)
                s.turn += 1
                if s.on_done is not None:
                    s.on_done(self.now)
            self.at(end, done)

        d.in_flight += 1
        if path in paths.ON_DECODE:  # d_direct, or d_fresh (D computes the prompt whole)
            reuse = plan.reuse.reuse_tokens if path == "d_direct" else 0
            rec.reused = reuse
            old = (remote_request_id(handle) if handle is not None and path == "d_direct"
                   else None)
            # The prefix blocks are D's retained ones (a prefix-cache hit): only the rest is
            # allocated, and the hit takes them over when the request is scheduled.
            shared = min(d.retained.get(old, 0), reuse // bs) if old else 0
            delta = len(prompt) - reuse

            def admitted(t: float) -> None:
                got = d.borrow(t, old, shared) if old else 0
                if got < shared:  # gone meanwhile (TTL): allocate them after all
                    d.take(t, shared - got)
                begin = max(t, d.free_at)
                d.free_at = begin + prof.d_direct_s(delta, reuse)
                self.at(d.free_at, lambda: first_token(self.now, delta))
            d.admit(start, alloc - shared, admitted)
            return

        # P leg: pull from D (pd_reuse) or release D's blocks (recompute), then prefill.
        p.in_flight += 1
        holder = (self.by_name.get(handle.decode_node) if handle is not None else None)
        pulled = int(params.get(transfer.REMOTE_NUM_TOKENS) or 0) if path == "pd_reuse" else 0
        old_rid = params.get(transfer.REMOTE_REQUEST_ID)
        ready = start
        if pulled:
            rec.reused = pulled
            rec.pull_bytes = pulled * prof.kv_bytes_per_token
            ready = start + prof.xfer_s(pulled)
            assert isinstance(holder, DNode)
            self.at(ready, lambda: holder.release(self.now, old_rid))  # read: D frees them
        elif transfer.offers_remote_blocks(params) and isinstance(holder, DNode):
            holder.release(start, old_rid)  # declined: P tells D to free them
        cached = 0
        if pulled == 0 and self.cfg.p_prefix_cache:
            if p.warm_prefix:
                cached = len(self._shared) // bs * bs
            if self.cfg.p_session_cache:  # this session's last prompt, whole blocks
                cached = max(cached, p.session_prefix.get(s.name, 0))
        computed = len(prompt) - pulled - cached
        # The fixed part is latency (HTTP, scheduling), not P's compute.
        p_done = (p.compute(ready, prof.prefill_compute_s(computed, pulled + cached))
                  + prof.prefill_fixed_s)
        if self.cfg.p_prefix_cache:
            p.warm_prefix = True
            if self.cfg.p_session_cache:
                p.session_prefix[s.name] = len(prompt) // bs * bs
        # D's own prefix cache still holds what P pulled from it when D is the holder.
        moved = len(prompt) - (pulled if d is holder else 0)
        rec.push_bytes = moved * prof.kv_bytes_per_token

        def p_finished() -> None:
            p.in_flight -= 1

            def admitted(t: float) -> None:
                self.at(t + prof.xfer_s(moved), lambda: first_token(
                    self.now + prof.step_s(d.running), computed))
            d.admit(self.now, alloc, admitted)
        self.at(p_done, p_finished)

    # ------------------------------------------------------------------ drivers

    async def _close(self) -> None:
        self.store_handles_end = (len(self.store.inner)
                                  if isinstance(self.store.inner, MemoryStore) else None)
        if isinstance(self.store.inner, RedisStore):
            await self.store.inner.close()

    def _session(self, sid: int, script: Script) -> _Session:
        return _Session(sid=sid, name=f"s{sid}-{self.rng.getrandbits(32):08x}", script=script)

    async def run_replay(self, scripts: list[Script], *, concurrency: int, max_tokens: int,
                         shared_prefix: int) -> list[TurnRecord]:
        """Recorded conversations, `concurrency` at a time, each turn right after the last."""
        self.max_tokens = max_tokens
        self._shared = self._tokens(shared_prefix)
        queue = list(enumerate(scripts))
        finished = [0]

        def launch(t: float) -> None:
            if not queue:
                return
            sid, script = queue.pop(0)
            s = self._session(sid, script)

            def next_turn(t2: float) -> None:
                if s.turn < len(s.script.new_tokens):
                    self.at(t2, lambda: self._turn(s))
                else:
                    finished[0] += 1
                    launch(t2)
            s.on_done = next_turn
            self.at(t, lambda: self._turn(s))

        for _ in range(concurrency):
            launch(0.0)
        if self.guard is not None:
            self.at(self.guard.interval_s, self._guard_round)
        await self._loop(done=lambda: finished[0] == len(scripts))
        await self._close()
        return self.records

    async def run_fleet(self, spec: FleetSpec) -> list[TurnRecord]:
        """`spec.sessions` sessions taking turns with exponential think times for
        `spec.duration_s` simulated seconds; a finished conversation is replaced."""
        self.max_tokens = spec.max_tokens
        wl = random.Random(spec.seed)
        self._shared = self._tokens(spec.shared_prefix)
        next_sid = itertools.count()

        def start_session(t: float) -> None:
            s = self._session(next(next_sid), spec.script(wl))

            def next_turn(t2: float) -> None:
                s.history = s.history if s.turn < len(s.script.new_tokens) else b""
                if s.turn < len(s.script.new_tokens):
                    go = t2 + wl.expovariate(1 / spec.think_s)
                    if go < spec.duration_s:
                        self.at(go, lambda: self._turn(s))
                else:
                    start_session(t2 + wl.expovariate(1 / spec.think_s))
            s.on_done = next_turn
            if t < spec.duration_s:
                self.at(t, lambda: self._turn(s))

        for _ in range(spec.sessions):
            start_session(wl.uniform(0, spec.think_s))
        if self.guard is not None:
            self.at(self.guard.interval_s, self._guard_round)
        await self._loop(until=spec.duration_s)
        self.now = max(self.now, spec.duration_s)
        await self._close()
        return self.records


def _pct(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (as the multi-turn benchmark's summaries)."""
    return float(np.percentile(values, q * 100)) if values else math.nan


def summarize(sim: Simulation, records: list[TurnRecord], *, span_s: float) -> dict[str, Any]:
    """Aggregates of one run (times in seconds, bytes per turn, D memory as fractions)."""
    done = [r for r in records if not math.isnan(r.ttft)]
    later = [r for r in done if r.turn > 0]
    for d in sim.d_nodes:
        d.expire(sim.now)
        d._tick(sim.now)
    cap = sum(d.capacity for d in sim.d_nodes)
    n = max(1, len(done))
    paths = Counter(r.path for r in done)
    reasons = Counter(r.reason for r in later if r.reused == 0)
    return {
        "turns": len(done),
        "turns_per_s": len(done) / span_s if span_s > 0 else math.nan,
        "reuse_rate": sum(1 for r in later if r.reused > 0) / len(later) if later else 0.0,
        "paths": dict(paths),
        "miss_reasons": dict(reasons),
        "ttft_p50": _pct([r.ttft for r in done], 0.5),
        "ttft_p90": _pct([r.ttft for r in done], 0.9),
        "ttft_p99": _pct([r.ttft for r in done], 0.99),
        "ttft_later_p50": _pct([r.ttft for r in later], 0.5),
        "ttft_later_p90": _pct([r.ttft for r in later], 0.9),
        "ttft_quantiles": [_pct([r.ttft for r in done], q / 100) for q in range(1, 100)],
        "ttft_by_turn_p50": {t: _pct([r.ttft for r in done if r.turn == t], 0.5)
                             for t in sorted({r.turn for r in done})},
        "prompt_later_p50": _pct([float(r.prompt) for r in later], 0.5),
        "d_retained_mean": sum(d.retained_area for d in sim.d_nodes) / (cap * span_s),
        "d_used_mean": sum(d.used_area for d in sim.d_nodes) / (cap * span_s),
        "d_retained_peak": max(d.peak_retained / d.capacity for d in sim.d_nodes),
        "d_used_peak": max(d.peak_used / d.capacity for d in sim.d_nodes),
        "watermark_evicted_handles": sim.evicted_handles,
        "ttl_freed": sum(d.ttl_freed for d in sim.d_nodes),
        "admission_waits": sum(d.admission_waits for d in sim.d_nodes),
        "transfer_bytes_per_turn": sum(r.pull_bytes + r.push_bytes for r in done) / n,
        "pull_bytes_per_turn": sum(r.pull_bytes for r in done) / n,
        "router_cpu_us_per_turn": 1e6 * sum(r.router_cpu_s for r in done) / n,
        "router_cpu_us_p99": 1e6 * _pct([r.router_cpu_s for r in done], 0.99),
        "retention_cpu_us_per_turn": 1e6 * sim.guard_cpu_s / n,
        "store_ops_per_turn": sum(r.store_ops for r in done) / n,
        "store_ops": dict(sim.store.ops),
        "store_handles_end": sim.store_handles_end,
    }


class _SimNodeHttp:
    """A simulated decode node's HTTP, as the retention guard reaches it (`NodeHttp`)."""

    def __init__(self, sim: Any, node: Any) -> None:
        self.sim, self.node = sim, node

    async def get(self, url: str, *, timeout_s: float | None = None) -> NodeResponse:
        return self.sim.node_metrics(self.node)

    async def post(self, url: str, body: dict[str, Any], *, stream: bool,
                   headers: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> NodeResponse:
        return self.sim.node_release(self.node, body)
