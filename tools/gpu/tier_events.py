"""The placement half of the GPU tier check (`tier_events` in check_tiers.py).

The router places a fresh prompt on the P node whose tiers hold its prefix, as the
nodes' KV events tell. This module asks, with the router's own parts, whether that works
against a real offloading node: the router's `KVEventSubscriber` feeds a `KVIndex` from
the node's `--kv-events-config` socket, `BlockHasher` hashes prompt A's token ids (from
the node's `/tokenize`) with the node's hash settings, and once A has left GPU memory
for the CPU tier:

(a) the index holds every full block of A under the `cpu` tier (`medium` CPU) and none
    under `gpu`, and a salted variant of A (another tenant) matches nothing;
(b) `TierPlacement.hits` + `tiers.rank_nodes` + `placement.pick_prefill_by_tiers` rank
    the node above an idle node that holds nothing (ties would go to the idle node).

`judge` is pure; `EventListener` runs the asyncio subscriber on a background loop for the
synchronous script; `synthetic_check` runs both against vLLM-encoded events on the
rendered endpoint (the `--dry-run` path, no GPU).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import zmq
import zmq.asyncio
from kvagent_server.router.kv.events import KVEventSubscriber
from kvagent_server.router.kv.hashing import BlockHasher
from kvagent_server.router.kv.index import KVEventSource, KVIndex
from kvagent_server.router.kv.tiers import TierCosts, rank_nodes
from kvagent_server.router.nodes.tier_placement import TierPlacement
from kvagent_server.router.reuse.placement import NodeState, pick_prefill_by_tiers

#: The node-to-beat in (b): healthy, idle, holds nothing. Sorts before "prefill-0", so
#: an estimate tie goes to it and the checked node must win outright.
EMPTY_NODE = "empty-node"
#: Negative control: A under another tenant's salt hashes differently, so must not match.
OTHER_SALT = "kvagent-tiercheck-other-tenant"

T = TypeVar("T")


def event_source(router_settings: dict[str, Any], node_url: str) -> KVEventSource:
    """The router's source for a rendered node, exactly as the bundle writes it into the
    router settings (`router.engine.kv_events`); a clear error when the node does not publish."""
    raw = (router_settings.get("engine", {}).get("kv_events") or {}).get(node_url)
    if raw is None:
        raise SystemExit(f"the rendered node {node_url} publishes no KV events "
                         "(kv_events.enabled false, or its role not in kv_events.roles)")
    return KVEventSource.model_validate(raw)


def _state(name: str) -> NodeState:
    return NodeState(node_id=name, url=f"http://{name}.invalid", role="prefill",
                     healthy=True, in_flight=0, epoch="tiercheck", max_in_flight=4)


def a_in_cpu(index: KVIndex, name: str, keys: Sequence[int]) -> bool:
    """The condition (a) waits for: all of A's blocks in the CPU tier, none on GPU."""
    nb = index.nodes.get(name)
    if nb is None or not keys:
        return False
    return all(k in nb.tiers["cpu"] for k in keys) and index.prefix_blocks(name, keys)["gpu"] == 0


def judge(index: KVIndex, name: str, source: KVEventSource, token_ids: Sequence[int], *,
          block_size: int, costs: TierCosts | None = None) -> dict[str, Any]:
    """Checks (a) and (b) on the index as it stands; `ok` and the numbers behind it."""
    costs = costs or TierCosts()
    hasher = BlockHasher(source.hash_algo, source.hash_seed)
    keys = hasher.keys(token_ids, block_size)
    nb = index.nodes.get(name)
    held = {t: (set(nb.tiers[t]) if nb else set()) for t in ("gpu", "cpu", "disk")}
    reach = index.prefix_blocks(name, keys)
    other = hasher.keys(token_ids, block_size, cache_salt=OTHER_SALT)
    phantom = max(index.prefix_blocks(name, other).values())

    states = [_state(EMPTY_NODE), _state(name)]
    tiers = TierPlacement(index, {name: source, EMPTY_NODE: source}, costs=costs,
                          block_size=block_size)
    hits, bs = tiers.hits(states, token_ids, cache_salt=None, default_block_size=block_size)
    ranked = rank_nodes([hits[EMPTY_NODE], hits[name]], prompt_tokens=len(token_ids),
                        costs=costs, block_size=bs)
    chosen, reason = pick_prefill_by_tiers(states, hits, prompt_tokens=len(token_ids),
                                           costs=costs, block_size=bs)
    in_cpu = sum(k in held["cpu"] for k in keys)
    a_ok = bool(keys) and in_cpu == len(keys) and reach["gpu"] == 0 \
        and reach["cpu"] == len(keys) and phantom == 0
    b_ok = (ranked[0].node == name and ranked[0].est_s < ranked[1].est_s
            and chosen is not None and chosen.node_id == name and reason == "tier_hit")
    return {
        "ok": a_ok and b_ok, "index_ok": a_ok, "placement_ok": b_ok,
        "a_blocks": len(keys), "a_blocks_in_cpu": in_cpu,
        "a_blocks_in_disk": sum(k in held["disk"] for k in keys),
        "a_blocks_on_gpu": sum(k in held["gpu"] for k in keys),
        "reach_blocks": reach, "other_salt_reach_blocks": phantom,
        "index_blocks": {t: len(v) for t, v in held.items()},
        "index_block_size": index.block_size(name),
        "hits_tokens": {n: {"gpu": h.gpu, "cpu": h.cpu, "disk": h.disk}
                        for n, h in hits.items()},
        "ranked": [{"node": s.node, "est_s": s.est_s, "tokens": s.tokens} for s in ranked],
        "chosen": chosen.node_id if chosen else None, "reason": reason,
    }


def snapshot(index: KVIndex, name: str, keys: Sequence[int]) -> dict[str, Any]:
    """What the index knows of `name` (for the report; no verdict)."""
    nb = index.nodes.get(name)
    return {"reach_blocks": index.prefix_blocks(name, keys), "a_blocks": len(keys),
            "index_blocks": {t: len(v) for t, v in nb.tiers.items()} if nb else {},
            "seq": nb.seq if nb else None, "resets": nb.resets if nb else 0}


class EventListener:
    """The router's `KVEventSubscriber` for one node, on an event loop of its own thread.

    All index reads go through that loop (`read`), so they never race the subscriber.
    """

    def __init__(self, name: str, source: KVEventSource) -> None:
        self.name = name
        self.source = source
        self.index = KVIndex()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="tiercheck-kv-events", daemon=True)
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: KVEventSubscriber | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = KVEventSubscriber(self.index, {self.name: self.source}, context=self._ctx)
        self._sub.start()

    async def _stop(self) -> None:
        if self._sub is not None:
            await self._sub.stop()
        if self._ctx is not None:
            self._ctx.term()

    def start(self) -> None:
        self._thread.start()
        self._call(self._start())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    @property
    def bad_messages(self) -> int:
        return self._sub.bad_messages if self._sub else 0

    def read(self, fn: Callable[[KVIndex], T]) -> T:
        """`fn(index)`, run on the subscriber's loop."""
        async def call() -> T:
            return fn(self.index)
        return self._call(call())

    def wait_for(self, predicate: Callable[[KVIndex], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self.read(predicate):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


# ------------------------------------------------------------------ dry run


def vllm_keys(token_ids: Sequence[int], block_size: int, source: KVEventSource) -> list[int]:
    """A's block hashes as vLLM's own scheduler code computes and publishes them, under
    the node's algorithm and PYTHONHASHSEED (not the router's `kv.hashing`)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as u

    fn = get_hash_fn_by_name(source.hash_algo)
    saved = os.environ.get("PYTHONHASHSEED")
    try:
        if source.hash_seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = source.hash_seed
        u.init_none_hash(fn)
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
    parent, out = None, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = u.hash_block_tokens(fn, parent, token_ids[start:start + block_size], None)
        out.append(u.maybe_convert_block_hash(parent))
    return out


def synthetic_batches(a_ids: Sequence[int], b_ids: Sequence[int], block_size: int,
                      source: KVEventSource) -> list[bytes]:
    """vLLM-encoded event batches of the real run's story, as the node would publish
    them: A stored on GPU; A's blocks offloaded to the CPU tier (self-describing: one
    event per one-block chunk); B stored on GPU and A evicted from it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    a, b = vllm_keys(a_ids, block_size, source), vllm_keys(b_ids, block_size, source)

    def stored(keys: list[int], ids: Sequence[int], medium: str) -> BlockStored:
        return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=list(ids),
                           block_size=block_size, lora_id=None, medium=medium,
                           lora_name=None, group_idx=0)

    n = len(a)
    cpu = [stored([k], a_ids[i * block_size:(i + 1) * block_size], "CPU")
           for i, k in enumerate(a)]
    batches = [[stored(a, a_ids[:n * block_size], "GPU")], cpu,
               [stored(b, b_ids[:len(b) * block_size], "GPU"),
                BlockRemoved(block_hashes=a, medium="GPU", group_idx=0)]]
    import msgspec
    enc = msgspec.msgpack.Encoder()
    return [enc.encode(KVEventBatch(ts=time.time(), events=evs)) for evs in batches]


def synthetic_check(name: str, source: KVEventSource, *, block_size: int,
                    a_tokens: int = 400) -> dict[str, Any]:
    """`tier_events` against vLLM-encoded synthetic events, over real ZMQ: a PUB socket
    bound on the rendered endpoint (as vLLM binds it), the router's subscriber on it."""
    a_ids = [1000 + i for i in range(a_tokens)]
    b_ids = [50000 + i for i in range(a_tokens)]
    endpoint = source.endpoint
    if endpoint.startswith("ipc://"):
        Path(endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
    elif endpoint.startswith("tcp://"):
        endpoint = "tcp://*:" + endpoint.rsplit(":", 1)[1]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.bind(endpoint)
        with EventListener(name, source) as listener:
            time.sleep(1.0)  # the SUB socket joins before the first batch (slow joiner)
            for seq, payload in enumerate(synthetic_batches(a_ids, b_ids, block_size, source)):
                pub.send_multipart((source.topic.encode(), seq.to_bytes(8, "big"), payload))
            keys = BlockHasher(source.hash_algo, source.hash_seed).keys(a_ids, block_size)
            arrived = listener.wait_for(lambda idx: a_in_cpu(idx, name, keys), timeout=10)
            out = listener.read(lambda idx: judge(idx, name, source, a_ids,
                                                  block_size=block_size))
            out["events_arrived"] = arrived
            out["bad_messages"] = listener.bad_messages
            out["ok"] = out["ok"] and arrived and listener.bad_messages == 0
            return out
    finally:
        pub.close(linger=0)
        ctx.term()
