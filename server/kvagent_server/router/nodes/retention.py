"""Keep what decode nodes retain for the next turn within their memory.

A decode node keeps every finished turn's blocks until its TTL so the next turn can reuse
them. Bounded only by time, that fills the node's KV cache under sustained churn (the
soak run: 15% to 100% in three minutes), and then new decode legs cannot allocate blocks
and wait. Two things keep it bounded:

- A handle the router will never offer again is released at once: a `d_direct` turn names
  the handle it supersedes in its own D leg (`kvagent_release`, honoured by the kvagent
  vLLM plugin when that request finishes).
- A turn whose blocks no handle records (no session id, reuse off, the store down) is
  released on the next round: D retains every P/D request's blocks, wanted or not.
- A watermark per decode node: when its KV usage (`vllm:kv_cache_usage_perc`) reaches
  `retention_high_watermark`, handles on that node are evicted from the store (claimed,
  so no turn can use them any more) until the blocks they hold cover the excess over
  `retention_low_watermark`, and released with one small request to the node. Which
  go first is the retention policy's choice (`router.retention.policy`: by when each
  session is expected back, or by age); `PolicyEviction` asks it and claims its choice.

Releasing is only safe for handles no one can present again: every released handle has
first been removed from the store atomically (`evict_handles`, or the claim of the turn
that supersedes it), so a token naming it finds nothing and the turn recomputes.

`blocks_to_free`, `ReleaseQueue` and the handle helpers are pure; `PolicyEviction` and
`RetentionGuard` are the I/O shells.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from kvagent_server.router.common.periodic import Periodic
from kvagent_server.router.kv.tiers import TierLoads, parse_tier_loads
from kvagent_server.router.nodes.client import NodeHttp, UpstreamError
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import transfer
from kvagent_server.router.reuse.pauses import ToolPauses
from kvagent_server.router.reuse.retention_policy import RetentionFacts, RetentionPolicy
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.store.handle import Handle, handle_blocks

log = logging.getLogger("kvagent.router.retention")

_USAGE_RE = re.compile(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", re.MULTILINE)
_RUNNING_RE = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", re.MULTILINE)
_WAITING_RE = re.compile(r"^vllm:num_requests_waiting(?:\{[^}]*\})? (\S+)$", re.MULTILINE)
_BLOCKS_RE = re.compile(r'^vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', re.MULTILINE)


def remote_request_id(handle: Handle) -> str | None:
    """The decode node's id for the request whose blocks `handle` names."""
    rid = handle.kv_transfer_params.get(transfer.REMOTE_REQUEST_ID)
    return rid if isinstance(rid, str) and rid else None


@dataclass(frozen=True)
class NodeKV:
    """A decode node's KV cache as its `/metrics` reports it."""

    usage: float  # 0..1
    total_blocks: int | None
    #: Requests running and waiting (None: not reported).
    running: int | None = None
    waiting: int | None = None
    #: Its tier-load counters (None: no offloading connector: `kv.tiers.parse_tier_loads`).
    loads: TierLoads | None = None

    @property
    def stalled(self) -> bool:
        """Nothing runs while requests wait: the node has no blocks for any of them."""
        return self.running == 0 and bool(self.waiting)


def parse_node_kv(metrics_text: str) -> NodeKV | None:
    """`vllm:kv_cache_usage_perc` and the block count from a node's `/metrics`."""
    found = _USAGE_RE.search(metrics_text)
    if found is None:
        return None
    try:
        usage = float(found.group(1))
    except ValueError:
        return None
    blocks = _BLOCKS_RE.search(metrics_text)
    return NodeKV(usage=usage, total_blocks=int(blocks.group(1)) if blocks else None,
                  running=_count(_RUNNING_RE, metrics_text),
                  waiting=_count(_WAITING_RE, metrics_text),
                  loads=parse_tier_loads(metrics_text))


def _count(pattern: re.Pattern[str], text: str) -> int | None:
    found = pattern.search(text)
    if found is None:
        return None
    try:
        return int(float(found.group(1)))
    except ValueError:
        return None


def blocks_to_free(kv: NodeKV, *, high: float, low: float) -> int:
    """Blocks to free on a node: none below `high`; at or above it, the excess over `low`
    (at least one). -1 when the node does not report its block count: the caller then
    evicts a fixed number of handles per round, so repeated rounds converge."""
    if not 0 < low < high <= 1:
        raise ValueError("need 0 < low < high <= 1")
    if kv.usage < high:
        return 0
    if not kv.total_blocks:
        return -1
    return max(1, math.ceil((kv.usage - low) * kv.total_blocks - 1e-6))


class ReleaseQueue:
    """Decode request ids waiting to be released, per node (bounded: what falls off the
    end is freed by the node's TTL anyway).

    A release the node did not answer (busy past the timeout, restarting) is retried on
    the next round, up to `max_tries` sends per id: blocks nobody will claim would
    otherwise hold the node's memory until the TTL, exactly when it is short."""

    def __init__(self, max_per_node: int = 4096, *, max_tries: int = 3) -> None:
        if max_tries < 1:
            raise ValueError("max_tries must be at least 1")
        self._max = max_per_node
        self.max_tries = max_tries
        self._ids: dict[str, deque[str]] = {}
        self._tries: dict[tuple[str, str], int] = {}

    def add(self, node: str, ids: Iterable[str]) -> None:
        q = self._ids.setdefault(node, deque(maxlen=self._max))
        q.extend(i for i in ids if i)

    def failed(self, node: str, ids: Iterable[str]) -> list[str]:
        """The send of `ids` failed: those with tries left go back to the front of the
        queue; returns the ones given up (their blocks go at the node's TTL)."""
        again, dropped = [], []
        for rid in ids:
            tries = self._tries.get((node, rid), 0) + 1
            if tries < self.max_tries:
                self._tries[(node, rid)] = tries
                again.append(rid)
            else:
                self._tries.pop((node, rid), None)
                dropped.append(rid)
        q = self._ids.setdefault(node, deque(maxlen=self._max))
        q.extendleft(reversed(again))
        if len(self._tries) > 2 * self._max:  # ids that fell off a full queue
            queued = {(n, rid) for n, ids_ in self._ids.items() for rid in ids_}
            self._tries = {k: v for k, v in self._tries.items() if k in queued}
        return dropped

    def sent(self, node: str, ids: Iterable[str]) -> None:
        """The node took `ids`: forget their failed tries."""
        for rid in ids:
            self._tries.pop((node, rid), None)

    def drain(self, node: str, limit: int = transfer.MAX_RELEASES_PER_REQUEST) -> list[str]:
        q = self._ids.get(node)
        if not q:
            return []
        return [q.popleft() for _ in range(min(limit, len(q)))]

    def pending(self, node: str) -> int:
        return len(self._ids.get(node) or ())

    def nodes(self) -> list[str]:
        return [n for n, q in self._ids.items() if q]


#: `evict(node, min_blocks, max_handles)` atomically removes from the store and returns
#: live handles of the node holding `min_blocks` blocks (any number when negative), at
#: most `max_handles`.
Evict = Callable[[str, int, int], Awaitable[list[Handle]]]


class PolicyEviction:
    """Evicts what the retention policy chooses: reads the node's retained handles
    (`SessionStore.retained`, no token ids), lets the policy rank them on plain facts,
    and claims its choice (`SessionStore.evict_handles`). A handle a turn claimed in
    between is simply not evicted; another pass takes the next ones."""

    def __init__(self, store: SessionStore, policy: RetentionPolicy, pauses: ToolPauses, *,
                 scan_limit: int = 4096, clock: Callable[[], float] = time.time) -> None:
        self.store, self.policy, self.pauses = store, policy, pauses
        self.scan_limit, self.clock = scan_limit, clock

    async def __call__(self, node: str, min_blocks: int, max_handles: int, *,
                       for_waiting_turn: bool = False) -> list[Handle]:
        out: list[Handle] = []
        freed = 0
        for _ in range(3):  # a pass loses only what turns claimed meanwhile
            need = min_blocks - freed if min_blocks >= 0 else -1
            left = max_handles - len(out)
            if left <= 0 or (min_blocks >= 0 and need <= 0):
                break
            facts = RetentionFacts(
                handles=await self.store.retained(node, self.scan_limit), need_blocks=need,
                max_handles=left, now=self.clock(), pauses=self.pauses.view(),
                for_waiting_turn=for_waiting_turn)
            chosen = self.policy.choose(facts)
            if not chosen:
                break
            evicted = await self.store.evict_handles(node, [h.key for h in chosen])
            out += evicted
            freed += sum(map(handle_blocks, evicted))
            if len(evicted) == len(chosen):
                break
        return out

    async def for_turn(self, node: str, min_blocks: int, max_handles: int) -> list[Handle]:
        """For a turn waiting for room now: sessions expected back soon go too, last."""
        return await self(node, min_blocks, max_handles, for_waiting_turn=True)


class RetentionGuard:
    """Watches each decode node's KV usage and evicts/releases retained handles.

    `client(node)` is the named node's HTTP client; `evict` picks and claims what the
    watermark frees (`PolicyEviction`, or the store's `evict_oldest`) and
    `evict_for_turn` what a waiting turn's room frees (default: `evict`); `nodes()`
    yields (name, url, epoch) of the healthy decode nodes; `model()` the served model
    name for release requests.
    """

    def __init__(self, client: Callable[[str], NodeHttp], *,
                 nodes: Callable[[], Sequence[tuple[str, str, str]]],
                 evict: Evict, model: Callable[[], str | None],
                 evict_for_turn: Evict | None = None,
                 high: float, low: float, interval_s: float,
                 on_evicted: Callable[[int], None] = lambda n: None,
                 on_released: Callable[[bool, int], None] = lambda ok, n: None,
                 on_kv: Callable[[str, NodeKV, float], None] = lambda name, kv, at: None,
                 on_given_up: Callable[[list[Handle]], Awaitable[object]] | None = None,
                 scan_limit: int = 512, blind_batch: int = 16,
                 timeout_s: float = 30.0) -> None:
        blocks_to_free(NodeKV(usage=0.0, total_blocks=None), high=high, low=low)  # checks
        self.client = client
        self.nodes = nodes
        self.evict = evict
        self.evict_for_turn = evict_for_turn or evict
        self.model = model
        self.high, self.low, self.interval_s = high, low, interval_s
        self.on_evicted, self.on_released = on_evicted, on_released
        self.on_kv = on_kv
        self.on_given_up = on_given_up
        self.scan_limit = scan_limit
        self.blind_batch = blind_batch
        self.timeout_s = timeout_s
        self.queue = ReleaseQueue()
        #: Per node: releases being sent, when the last one ended, when the last read
        #: began (`room_on_its_way`).
        self._releasing: collections.Counter[str] = collections.Counter()
        self._released_at: dict[str, float] = {}
        self._read_began: dict[str, float] = {}
        self._periodic = Periodic(self.run_once, interval_s=interval_s,
                                  name="kvagent-retention", log=log, what="retention round")

    async def read_kv(self, name: str, url: str) -> NodeKV | None:
        """The node's KV figure, also handed to `on_kv` with the time the read began."""
        began = time.monotonic()
        try:
            resp = await self.client(name).get(f"{url}/metrics", timeout_s=self.timeout_s)
        except UpstreamError:
            return None
        kv = parse_node_kv(resp.text) if resp.status_code == 200 else None
        if kv is not None:
            self._read_began[name] = max(self._read_began.get(name, began), began)
            self.on_kv(name, kv, began)
        return kv

    def room_on_its_way(self, name: str) -> bool:
        """Handles of the node left the store and their blocks may still be in its last
        figure: a release is being sent, or ended after the last read began."""
        return self._releasing[name] > 0 or (
            self._released_at.get(name, -math.inf) > self._read_began.get(name, -math.inf))

    def _sent_releases(self, name: str, *, freed: bool) -> None:
        self._releasing[name] -= 1
        if freed:
            self._released_at[name] = time.monotonic()

    async def check(self, name: str, url: str, epoch: str) -> int:
        """One round for one node: returns how many handles were evicted."""
        kv = await self.read_kv(name, url)
        if kv is None:
            return 0
        need = blocks_to_free(kv, high=self.high, low=self.low)
        if need == 0:
            return 0
        evicted = await self._evict(name, url, epoch, need,
                                    self.scan_limit if need > 0 else self.blind_batch)
        if evicted:
            log.info("decode %s at %.0f%% KV: evicted %d retained handle(s) (%d blocks)",
                     name, kv.usage * 100, len(evicted), sum(map(handle_blocks, evicted)))
        return len(evicted)

    async def _evict(self, name: str, url: str, epoch: str, blocks: int,
                     max_handles: int, *, for_turn: bool = False) -> list[Handle]:
        """Evict unclaimed handles of the node holding `blocks` blocks from the store and
        release them on the node."""
        evict = self.evict_for_turn if for_turn else self.evict
        self._releasing[name] += 1  # what it evicts is out of the store from here on
        evicted: list[Handle] = []
        try:
            evicted = await evict(name, blocks, max_handles)
            if not evicted:
                return []
            ids = [rid for h in evicted if h.decode_epoch == epoch
                   and (rid := remote_request_id(h)) is not None]
            self.queue.add(name, ids)
            self.on_evicted(len(evicted))
            if self.on_given_up is not None:  # spilled to the node's tiers (nodes.spills)
                await self.on_given_up(evicted)
            await self.flush(name, url)
            return evicted
        finally:
            self._sent_releases(name, freed=bool(evicted))

    async def make_room(self, node: Node, blocks: int) -> int:
        """Free about `blocks` blocks on `node` for a turn waiting there (nodes.admission):
        unclaimed handles go, in the retention policy's order; returns the blocks they held."""
        evicted = await self._evict(node.name, node.url, node.epoch, max(blocks, 1),
                                    self.scan_limit, for_turn=True)
        if evicted:  # which sessions, and how their turns ended: what retention weighed
            log.info("decode %s: evicted %d retained handle(s) (%d blocks) for a waiting "
                     "turn: %s", node.name, len(evicted), sum(map(handle_blocks, evicted)),
                     ", ".join(f"{h.session} ({h.end.kind if h.end else 'unknown'})"
                               for h in evicted))
        return sum(map(handle_blocks, evicted))

    async def refresh(self, node: Node) -> None:
        await self.read_kv(node.name, node.url)

    async def release(self, node: Node, ids: list[str]) -> None:
        """Release decode request ids on `node` now (handles already out of the store)."""
        self._releasing[node.name] += 1
        try:
            self.queue.add(node.name, ids)
            await self.flush(node.name, node.url)
        finally:
            self._sent_releases(node.name, freed=bool(ids))

    async def flush(self, name: str, url: str) -> bool:
        """Send the node's queued releases in one tiny completion (not retained itself)."""
        ok = True
        while (ids := self.queue.drain(name)):
            model = self.model()
            if model is None:
                self.queue.add(name, ids)
                return False
            body = {"model": model, "prompt": ".", "max_tokens": 1, "stream": False,
                    "kv_transfer_params": {transfer.RELEASE_KEY: ids}}
            try:
                resp = await self.client(name).post(f"{url}/v1/completions", body,
                                                    stream=False, timeout_s=self.timeout_s)
                sent = resp.status_code == 200
            except UpstreamError:
                sent = False
            self.on_released(sent, len(ids))
            ok = ok and sent
            if not sent:
                dropped = self.queue.failed(name, ids)
                if dropped:
                    log.warning("could not release %d handle(s) on %s after %d tries: they "
                                "expire at the TTL", len(dropped), name, self.queue.max_tries)
                if len(dropped) < len(ids):
                    log.info("could not release %d handle(s) on %s: retrying next round",
                             len(ids) - len(dropped), name)
                return False
            self.queue.sent(name, ids)
        return ok

    async def check_and_flush(self, name: str, url: str, epoch: str) -> int:
        evicted = await self.check(name, url, epoch)
        if self.queue.pending(name):  # e.g. turns no handle records (no session)
            await self.flush(name, url)
        return evicted

    async def run_once(self) -> int:
        nodes = list(self.nodes())
        counts = await asyncio.gather(*(self.check_and_flush(*n) for n in nodes),
                                      return_exceptions=True)
        total = 0
        for node, n in zip(nodes, counts, strict=True):
            if isinstance(n, BaseException):
                log.warning("retention check of %s failed: %r", node[0], n)
            else:
                total += n
        return total

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
