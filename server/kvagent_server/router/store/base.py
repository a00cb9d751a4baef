"""The store interface every handle store implements, and the one error type it raises.

`MemoryStore` (`store.memory`) serves one router process; `RedisStore` (`store.redis_store`)
lets several replicas share handles, with claims that stay atomic across replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.store.handle import Handle, Retained
from kvagent_server.router.store.records import RecordStore


class StoreUnavailable(Exception):
    """The store could not be reached or answered with an error; callers degrade (recompute)."""


@runtime_checkable
class SessionStore(RecordStore, Protocol):
    """Where handles live between turns, and the records beside them (`records`). All
    methods are safe under concurrent tasks."""

    async def put(self, handle: Handle) -> list[Handle]:
        """Store `handle` and make it its session's latest (no-op if already expired).

        Returns the live handles this put evicted (the tenant's quota, the store's bounds):
        they are claimed, so no turn can use them, and the caller releases their blocks."""

    async def claim(self, tenant: str, handle_id: str) -> Handle | None:
        """Take the handle: exactly one caller ever gets it; None if unknown/claimed/expired."""

    async def claim_latest(self, tenant: str, session: str) -> Handle | None:
        """Claim the session's latest handle (clients that send no token)."""

    async def peek_latest(self, tenant: str, session: str) -> Handle | None:
        """The session's latest unclaimed handle, without claiming it (decode affinity)."""

    async def drop_node(self, decode_node: str, *, keep_epoch: str | None = None) -> int:
        """Forget a lost node's handles (except `keep_epoch`'s); returns how many were live."""

    async def evict_oldest(self, decode_node: str, min_blocks: int,
                           max_handles: int) -> list[Handle]:
        """Remove and return the node's oldest live handles until they pin `min_blocks`
        blocks (when negative: just `max_handles` of them), at most `max_handles`.
        Each removal is a claim: a later turn presenting one of them recomputes."""

    async def retained(self, decode_node: str, limit: int) -> list[Retained]:
        """The node's live handles as retention weighs them (no token ids), at most
        `limit`, soonest to expire first. A read: nothing is claimed."""

    async def evict_handles(self, decode_node: str,
                            keys: Sequence[tuple[str, str]]) -> list[Handle]:
        """Claim the named handles (tenant, handle id) of the node that are still there
        and live, and return them: each removal is a claim, so of a turn presenting one
        and this eviction exactly one gets it."""

    async def ping(self) -> bool:
        """True when the store answers (readiness)."""

    async def close(self) -> None:
        """Release connections."""


@runtime_checkable
class SharesKeys(Protocol):
    """A store through which replicas agree on one signing key (Redis)."""

    async def shared_key_ring(self) -> KeyRing:
        """The key ring every replica behind this store uses."""

    async def publish_key_ring(self, ring: KeyRing) -> KeyRing:
        """Re-publish `ring`'s keys; return it plus the keys other replicas published."""

