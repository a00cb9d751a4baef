"""Subscribe to the nodes' KV events (vLLM's ZMQ publisher) and feed the `KVIndex`.

The wire format (vLLM 0.32, `vllm/distributed/kv_events.py`): each batch is a
three-frame message `(topic, seq as 8-byte big-endian, msgpack payload)`; the payload is
an array `[ts, events, dp_rank]` and each event a map tagged by `"type"`
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Decoding is lenient: unknown event
types and fields are skipped, so a newer vLLM degrades placement, never the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvagent_server.router.kv.hashing import event_key
from kvagent_server.router.kv.index import Cleared, Event, KVEventSource, KVIndex, Removed, Stored

log = logging.getLogger("kvagent.router.kv_events")
_SEQ_BYTES = 8


class BadBatch(ValueError):
    """A message that is not a vLLM KV event batch."""


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one msgpack-encoded `KVEventBatch`."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadBatch(f"not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadBatch("not an event batch ([ts, events, ...])")
    out: list[Event] = []
    for raw in batch[1]:
        event = _event(raw)
        if event is not None:
            out.append(event)
    return out


def _event(raw: Any) -> Event | None:
    if not isinstance(raw, dict):
        return None
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None
    hashes = tuple(event_key(h) for h in raw.get("block_hashes") or ()
                   if isinstance(h, int | bytes))
    medium, group = raw.get("medium"), raw.get("group_idx")
    if kind == "BlockRemoved":
        return Removed(hashes=hashes, medium=medium, group=group)
    if raw.get("lora_name") or raw.get("lora_id") is not None:
        return None  # LoRA blocks hash differently; the router never matches them
    size = raw.get("block_size")
    return Stored(hashes=hashes, medium=medium, group=group,
                  block_size=size if isinstance(size, int) and size > 0 else None)


def parse_message(frames: list[bytes]) -> tuple[int, list[Event]]:
    """`(seq, events)` of one published message."""
    if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
        raise BadBatch(f"expected (topic, seq, payload), got {len(frames)} frame(s)")
    return int.from_bytes(frames[1], "big", signed=True), decode_batch(frames[2])


class KVEventSubscriber:
    """One SUB socket per node; each feeds the shared index from its own task.

    ZMQ reconnects by itself when a node restarts; the index notices the restart from
    the sequence numbers and forgets the node's old blocks.
    """

    def __init__(self, index: KVIndex, sources: Mapping[str, KVEventSource], *,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.index = index
        self.sources = dict(sources)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._tasks: list[asyncio.Task[None]] = []
        self.bad_messages = 0

    def start(self) -> None:
        if self._tasks:
            return
        for name, source in self.sources.items():
            self._tasks.append(asyncio.create_task(self._run(name, source),
                                                   name=f"kvagent-kv-events-{name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _run(self, name: str, source: KVEventSource) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # also reaches IPv4 endpoints
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sock.connect(source.endpoint)
        log.info("KV events of %s from %s", name, source.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    seq, events = parse_message(frames)
                except BadBatch as exc:
                    self.bad_messages += 1
                    log.warning("KV events of %s: %s", name, exc)
                    continue
                if seq < 0:
                    continue  # the replay end marker; not on the PUB socket, but harmless
                result = self.index.apply(name, seq, events)
                if result in ("gap", "restart"):
                    log.info("KV events of %s: %s at seq %d; relearning its blocks",
                             name, result, seq)
        finally:
            sock.close(linger=0)
