"""Small keyed records beside the handles: stored Responses and the content index.

Three things a turn may look up besides its session's handle:

- `RESPONSES`: a stored Response (`store: true`) and the conversation it ends, so a turn
  that names it in `previous_response_id` gets its history and its session back;
- `CONTENT`: block-hash keys of a held turn's tokens -> its session, so a caller that
  sends no conversation id at all still finds the turn its prompt extends;
- `SPILLED`: a session whose retained copy was given up to its decode node's KV tiers
  (`reuse.spill`), so its next turn loads from there instead of recomputing.

Records are per tenant, expire (TTL), and are bounded per tenant (count) and, in memory,
in bytes overall; the oldest go first, and over the byte bound the oldest of the tenant
holding the most bytes, so one tenant's large records never evict another's. A stored
Response counts whole: its history, its output and the request fields it echoes
(`metadata` among them, bounded by the Responses translation). `MemoryRecords` serves one router process; the
Redis store implements the same three methods (`redis_store`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

Kind = Literal["responses", "content", "spilled"]
RESPONSES: Kind = "responses"
CONTENT: Kind = "content"
#: A session's conversation once its decode copy was given up to the node's KV tiers
#: (`reuse.spill`): the session -> the spill and the handle it was.
SPILLED: Kind = "spilled"


@runtime_checkable
class RecordStore(Protocol):
    """Per-tenant records with a TTL. All methods are safe under concurrent tasks."""

    async def put_records(self, tenant: str, kind: Kind, items: Sequence[tuple[str, bytes]],
                          ttl_s: float) -> None:
        """Store each `(key, value)`, replacing what a key held."""

    async def get_record(self, tenant: str, kind: Kind, key: str) -> bytes | None:
        """The live value of `key`, or None."""

    async def find_record(self, tenant: str, kind: Kind,
                          keys: Sequence[str]) -> tuple[str, bytes] | None:
        """The first of `keys` (in the order given) that holds a live value, with it."""


class MemoryRecords:
    """`RecordStore` in one process: an LRU by insertion, bounded per tenant and in bytes
    (over the byte bound, the biggest holder's oldest record goes first).

    Under asyncio every method runs without awaiting, so each is atomic."""

    def __init__(self, *, max_per_tenant: int = 20_000, max_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.time) -> None:
        if max_per_tenant < 1 or max_bytes < 1:
            raise ValueError("max_per_tenant and max_bytes must be positive")
        self._max_per_tenant = max_per_tenant
        self._max_bytes = max_bytes
        self._clock = clock
        #: (tenant, kind, key) -> (value, expires_at), oldest stored first
        self._items: OrderedDict[tuple[str, str, str], tuple[bytes, float]] = OrderedDict()
        #: tenant -> its keys, oldest stored first (for the per-tenant bound)
        self._by_tenant: dict[str, OrderedDict[tuple[str, str, str], None]] = {}
        #: tenant -> the bytes its records hold
        self._tenant_bytes: dict[str, int] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def _drop(self, full: tuple[str, str, str]) -> None:
        entry = self._items.pop(full, None)
        if entry is None:
            return
        size = len(entry[0]) + len(full[2])
        self._bytes -= size
        self._tenant_bytes[full[0]] -= size
        mine = self._by_tenant[full[0]]
        del mine[full]
        if not mine:
            del self._by_tenant[full[0]]
            del self._tenant_bytes[full[0]]

    async def put_records(self, tenant: str, kind: Kind, items: Sequence[tuple[str, bytes]],
                          ttl_s: float) -> None:
        if ttl_s <= 0:
            return
        now = self._clock()
        for key, value in items:
            full = (tenant, kind, key)
            self._drop(full)
            self._items[full] = (value, now + ttl_s)
            self._by_tenant.setdefault(tenant, OrderedDict())[full] = None
            self._bytes += len(value) + len(key)
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + len(value) + len(
                key)
        while self._items:  # expired first: oldest stored first, stop at a live one
            oldest = next(iter(self._items))
            if now < self._items[oldest][1]:
                break
            self._drop(oldest)
        mine = self._by_tenant.get(tenant)
        while mine and len(mine) > self._max_per_tenant:
            self._drop(next(iter(mine)))
        while self._bytes > self._max_bytes and self._items:
            biggest = max(self._tenant_bytes, key=self._tenant_bytes.__getitem__)
            self._drop(next(iter(self._by_tenant[biggest])))

    async def get_record(self, tenant: str, kind: Kind, key: str) -> bytes | None:
        entry = self._items.get((tenant, kind, key))
        if entry is None:
            return None
        if self._clock() >= entry[1]:
            self._drop((tenant, kind, key))
            return None
        return entry[0]

    async def find_record(self, tenant: str, kind: Kind,
                          keys: Sequence[str]) -> tuple[str, bytes] | None:
        for key in keys:
            value = await self.get_record(tenant, kind, key)
            if value is not None:
                return key, value
        return None

    def clear(self) -> None:
        self._items.clear()
        self._by_tenant.clear()
        self._tenant_bytes.clear()
        self._bytes = 0
