"""Record and find spilled conversations in the session store (the shell of `reuse.spill`).

`record` is called with the handles the router gives up (the retention guard's evictions,
for the watermark or a waiting turn's room, and the store's own evictions past its
bounds); each one on a decode node with KV tiers leaves a `SPILLED` record under its
session, for `router.retention.spill_ttl_s`. `find` reads a session's record back for a
turn that found no handle. Both stores keep records alike (a TTL, a per-tenant bound),
so Redis replicas share them as they share handles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from kvagent_server.router.kv.tiers import NodeTiers
from kvagent_server.router.reuse.spill import Spill, pack_spill, spill_of, unpack_spill
from kvagent_server.router.store.base import SessionStore, StoreUnavailable
from kvagent_server.router.store.handle import Handle
from kvagent_server.router.store.records import SPILLED

log = logging.getLogger("kvagent.router.spills")


class Spills:
    """Where given-up conversations went, per session (`tiers`: each tiered decode
    node's tiers, by node name)."""

    def __init__(self, store: SessionStore, tiers: Mapping[str, NodeTiers], *, ttl_s: float,
                 clock: Callable[[], float] = time.time,
                 on_spilled: Callable[[int], None] = lambda n: None) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.store, self.tiers, self.ttl_s = store, dict(tiers), ttl_s
        self.clock, self.on_spilled = clock, on_spilled

    async def record(self, handles: Iterable[Handle]) -> int:
        """Record each given-up handle on a tiered node as its session's spill; returns
        how many. Best effort: a store down loses the record (the turn recomputes)."""
        now = self.clock()
        by_tenant: dict[str, list[tuple[str, bytes]]] = {}
        for handle in handles:
            spill = spill_of(handle, self.tiers.get(handle.decode_node), now)
            if spill is not None:
                by_tenant.setdefault(handle.tenant, []).append(
                    (handle.session, pack_spill(spill, handle)))
        done = 0
        for tenant, items in by_tenant.items():
            try:
                await self.store.put_records(tenant, SPILLED, items, self.ttl_s)
            except StoreUnavailable:
                log.info("session store unavailable: %d spill(s) not recorded", len(items))
                continue
            done += len(items)
        if done:
            self.on_spilled(done)
        return done

    async def find(self, tenant: str, session: str) -> tuple[Spill, Handle] | None:
        """The session's spill, if one is recorded and live (a store down: None)."""
        try:
            data = await self.store.get_record(tenant, SPILLED, session)
        except StoreUnavailable:
            return None
        if data is None:
            return None
        try:
            return unpack_spill(data)
        except ValueError:  # written by another router version: forget it
            log.info("unreadable spill record for a session: ignored")
            return None
