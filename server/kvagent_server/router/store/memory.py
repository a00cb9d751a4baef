"""An in-process handle store for a single router replica."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvagent_server.router.store.handle import (
    Handle,
    Retained,
    handle_blocks,
    handle_meta,
    pack_handle,
    unpack_handle,
)
from kvagent_server.router.store.records import Kind, MemoryRecords


class MemoryStore:
    """An in-process store, bounded by handle count and total retained tokens, and per
    tenant by `max_handles_per_tenant` (so one tenant's churn cannot evict another's).

    Every method runs without awaiting, so under asyncio each one is atomic: a claim can
    never be won twice. Expired handles are swept on write. Over a bound, the oldest handle
    of the tenant holding the most (handles for the count, tokens for the token bound) goes
    first: a flood evicts the flooding tenant's own handles, never those of a tenant
    holding less than it.
    """

    def __init__(self, *, max_handles: int = 10_000, max_tokens: int = 50_000_000,
                 max_handles_per_tenant: int | None = None,
                 max_records_per_tenant: int = 20_000, max_record_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.time) -> None:
        if max_handles < 1 or max_tokens < 1:
            raise ValueError("max_handles and max_tokens must be positive")
        if max_handles_per_tenant is not None and max_handles_per_tenant < 1:
            raise ValueError("max_handles_per_tenant must be positive")
        self._max_handles = max_handles
        self._max_per_tenant = max_handles_per_tenant
        #: tenant -> its handle ids, oldest stored first (for the per-tenant quota)
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        self._max_tokens = max_tokens
        self._clock = clock
        #: (tenant, handle_id) -> (packed handle, expires_at, session, decode_node, n tokens)
        self._handles: OrderedDict[tuple[str, str], tuple[bytes, float, str, str, int]] = (
            OrderedDict())
        self._latest: dict[tuple[str, str], str] = {}
        self._tokens = 0
        #: tenant -> the token ids its handles retain (for the token bound's choice)
        self._tenant_tokens: dict[str, int] = {}
        #: Stored Responses and the content index (`RecordStore`)
        self.records = MemoryRecords(max_per_tenant=max_records_per_tenant,
                                     max_bytes=max_record_bytes, clock=clock)

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def retained_tokens(self) -> int:
        return self._tokens

    def _remove(self, key: tuple[str, str]) -> tuple[bytes, float, str, str, int] | None:
        entry = self._handles.pop(key, None)
        if entry is None:
            return None
        self._tokens -= entry[4]
        left = self._tenant_tokens.get(key[0], 0) - entry[4]
        if left > 0:
            self._tenant_tokens[key[0]] = left
        else:
            self._tenant_tokens.pop(key[0], None)
        ids = self._by_tenant.get(key[0])
        if ids is not None:
            ids.pop(key[1], None)
            if not ids:
                del self._by_tenant[key[0]]
        latest_key = (key[0], entry[2])
        if self._latest.get(latest_key) == key[1]:
            del self._latest[latest_key]
        return entry

    def sweep(self) -> int:
        """Drop every expired handle; returns how many."""
        now = self._clock()
        dead = [key for key, entry in self._handles.items() if now >= entry[1]]
        for key in dead:
            self._remove(key)
        return len(dead)

    async def put(self, handle: Handle) -> list[Handle]:
        now = self._clock()
        if handle.expired(now):
            return []
        key = (handle.tenant, handle.handle_id)
        self._remove(key)
        n = len(handle.token_ids)
        self._handles[key] = (pack_handle(handle), handle.expires_at, handle.session,
                              handle.decode_node, n)
        self._tokens += n
        self._tenant_tokens[handle.tenant] = self._tenant_tokens.get(handle.tenant, 0) + n
        self._latest[(handle.tenant, handle.session)] = handle.handle_id
        mine = self._by_tenant.setdefault(handle.tenant, OrderedDict())
        mine[handle.handle_id] = None
        evicted: list[Handle] = []

        def evict(oldest: tuple[str, str]) -> None:
            entry = self._remove(oldest)
            if entry is not None and now < entry[1]:
                evicted.append(unpack_handle(entry[0]))  # the caller releases its blocks

        # The tenant's quota first, from its own oldest (never the one just stored).
        while self._max_per_tenant is not None and len(mine) > self._max_per_tenant:
            oldest_id = next(iter(mine))
            if oldest_id == handle.handle_id:
                break
            evict((handle.tenant, oldest_id))
        # Expired handles first (cheap: oldest first, stop at the first live one), then,
        # while over a bound, the biggest holder's oldest (never the one just stored).
        while self._handles:
            oldest = next(iter(self._handles))
            if oldest != key and now >= self._handles[oldest][1]:
                evict(oldest)
            else:
                break
        while len(self._handles) > self._max_handles:
            victim = self._biggest_holders_oldest(lambda t: len(self._by_tenant[t]), key)
            if victim is None:
                break
            evict(victim)
        while self._tokens > self._max_tokens:
            victim = self._biggest_holders_oldest(self._tenant_tokens.__getitem__, key)
            if victim is None:
                break
            evict(victim)
        return evicted

    def _biggest_holders_oldest(self, held: Callable[[str], int],
                                keep: tuple[str, str]) -> tuple[str, str] | None:
        """The oldest handle of the tenant that `held` most, ties to the tenant whose oldest
        expires first (the longest idle); never `keep`, the handle just stored."""
        best: tuple[str, str] | None = None
        best_rank: tuple[int, float] | None = None
        for tenant, ids in self._by_tenant.items():
            oldest = (tenant, next(iter(ids)))
            if oldest == keep:  # the tenant's only handle is the one just stored
                continue
            rank = (-held(tenant), self._handles[oldest][1])
            if best_rank is None or rank < best_rank:
                best, best_rank = oldest, rank
        return best

    def _take(self, key: tuple[str, str]) -> Handle | None:
        entry = self._remove(key)
        if entry is None or self._clock() >= entry[1]:
            return None
        return unpack_handle(entry[0])

    async def claim(self, tenant: str, handle_id: str) -> Handle | None:
        return self._take((tenant, handle_id))

    async def claim_latest(self, tenant: str, session: str) -> Handle | None:
        handle_id = self._latest.get((tenant, session))
        if handle_id is None:
            return None
        return self._take((tenant, handle_id))

    async def peek_latest(self, tenant: str, session: str) -> Handle | None:
        handle_id = self._latest.get((tenant, session))
        if handle_id is None:
            return None
        entry = self._handles.get((tenant, handle_id))
        if entry is None or self._clock() >= entry[1]:
            return None
        return unpack_handle(entry[0])

    async def drop_node(self, decode_node: str, *, keep_epoch: str | None = None) -> int:
        now = self._clock()
        dropped = 0
        for key, entry in list(self._handles.items()):
            if entry[3] != decode_node:
                continue
            if keep_epoch is not None and handle_meta(entry[0]).get(
                    "decode_epoch") == keep_epoch:
                continue
            self._remove(key)
            dropped += now < entry[1]
        return dropped

    async def evict_oldest(self, decode_node: str, min_blocks: int,
                           max_handles: int) -> list[Handle]:
        now = self._clock()
        out: list[Handle] = []
        freed = 0
        for key, entry in list(self._handles.items()):  # oldest stored first
            if len(out) >= max_handles or (min_blocks >= 0 and freed >= min_blocks):
                break
            if entry[3] != decode_node:
                continue
            self._remove(key)
            if now < entry[1]:
                handle = unpack_handle(entry[0])
                out.append(handle)
                freed += handle_blocks(handle)
        return out

    async def retained(self, decode_node: str, limit: int) -> list[Retained]:
        now = self._clock()
        live = sorted((entry for entry in self._handles.values()
                       if entry[3] == decode_node and now < entry[1]), key=lambda e: e[1])
        return [Retained.of_meta(handle_meta(entry[0])) for entry in live[:max(limit, 0)]]

    async def evict_handles(self, decode_node: str,
                            keys: Sequence[tuple[str, str]]) -> list[Handle]:
        out: list[Handle] = []
        for key in keys:
            entry = self._handles.get(key)
            if entry is None or entry[3] != decode_node:
                continue
            handle = self._take(key)
            if handle is not None:
                out.append(handle)
        return out

    async def put_records(self, tenant: str, kind: Kind, items: Sequence[tuple[str, bytes]],
                          ttl_s: float) -> None:
        await self.records.put_records(tenant, kind, items, ttl_s)

    async def get_record(self, tenant: str, kind: Kind, key: str) -> bytes | None:
        return await self.records.get_record(tenant, kind, key)

    async def find_record(self, tenant: str, kind: Kind,
                          keys: Sequence[str]) -> tuple[str, bytes] | None:
        return await self.records.find_record(tenant, kind, keys)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._handles.clear()
        self._latest.clear()
        self._by_tenant.clear()
        self._tenant_tokens.clear()
        self._tokens = 0
        self.records.clear()
