"""Session state: handles to KV blocks retained on decode nodes, claimed once.

A `Handle` is the router's record of one finished turn: which decode node holds the KV,
which token ids that KV covers, and the decode node's `kv_transfer_params` needed to pull
it. Clients only ever see a token naming the handle. Handles are single use because the
decode node frees the blocks as soon as a prefill node has read (or declined) them.

`MemoryStore` serves one router process; `RedisStore` (in `state_redis`) lets several
replicas share handles, with claims that stay atomic across replicas.
"""

from __future__ import annotations

import json
import logging
import secrets
import struct
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger("kvagent.router.state")

if TYPE_CHECKING:
    from .keys import KeyRing
    from .settings import RouterSettings

TokenId = Annotated[int, Field(ge=0, lt=2**32)]


class Handle(BaseModel):
    """KV blocks a decode node retains for a session's next turn (internal, never sent out)."""

    model_config = ConfigDict(extra="forbid")

    handle_id: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    session: str = Field(min_length=1)
    #: Node id (or base URL) of the decode node that holds the blocks.
    decode_node: str
    #: The node's incarnation: a restarted node has a new epoch and none of the old blocks.
    decode_epoch: str
    #: The decode node's params from its final chunk; rewritten for the next P leg.
    kv_transfer_params: dict[str, Any]
    #: The token ids whose KV the decode node retains (what reuse is verified against).
    token_ids: list[TokenId]
    block_size: int = Field(ge=1)
    created_at: float  # router wall clock
    expires_at: float  # router wall clock, safety margin already subtracted

    @model_validator(mode="after")
    def _check_times(self) -> Handle:
        if self.expires_at < self.created_at:
            raise ValueError("expires_at precedes created_at")
        return self

    def expired(self, now: float) -> bool:
        return now >= self.expires_at


def new_handle_id() -> str:
    """An unguessable handle id (128 bits, URL-safe)."""
    return secrets.token_urlsafe(16)


# ------------------------------------------------------------------ compact serialisation
#
# token_ids dominate a handle's size (a long agent conversation holds tens of thousands),
# so both stores keep them as packed little-endian uint32 after the JSON of the rest:
# 4 bytes a token instead of ~6 as JSON text or ~36 as a Python list.

_LEN = struct.Struct("<I")


def pack_handle(handle: Handle) -> bytes:
    meta = handle.model_dump_json(exclude={"token_ids"}).encode()
    ids = array("I", handle.token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return _LEN.pack(len(meta)) + meta + ids.tobytes()


def unpack_handle(data: bytes) -> Handle:
    (meta_len,) = _LEN.unpack_from(data)
    meta = json.loads(data[_LEN.size:_LEN.size + meta_len])
    ids = array("I")
    ids.frombytes(data[_LEN.size + meta_len:])
    if sys.byteorder == "big":
        ids.byteswap()
    # The bytes were produced by pack_handle from a validated Handle: skip re-validating
    # tens of thousands of ints, validate the rest.
    handle = Handle.model_validate({**meta, "token_ids": []})
    return handle.model_copy(update={"token_ids": ids.tolist()})


def handle_meta(data: bytes) -> dict[str, Any]:
    """The JSON part of a packed handle (node, epoch, ...) without unpacking the tokens."""
    (meta_len,) = _LEN.unpack_from(data)
    return json.loads(data[_LEN.size:_LEN.size + meta_len])


def handle_blocks(handle: Handle) -> int:
    """Blocks the handle pins on its decode node (first KV cache group; an upper bound,
    since blocks shared with other sequences are not freed by releasing one of them)."""
    groups = handle.kv_transfer_params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups:
        return 0
    first = groups[0]
    return len(first) if isinstance(first, list) else len(groups)


# ------------------------------------------------------------------ the store interface


@runtime_checkable
class SessionStore(Protocol):
    """Where handles live between turns. All methods are safe under concurrent tasks."""

    async def put(self, handle: Handle) -> None:
        """Store `handle` and make it its session's latest (no-op if already expired)."""

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

    async def ping(self) -> bool:
        """True when the store answers (readiness)."""

    async def close(self) -> None:
        """Release connections."""


class MemoryStore:
    """An in-process store, bounded by handle count and total retained tokens.

    Every method runs without awaiting, so under asyncio each one is atomic: a claim can
    never be won twice. Oldest handles are evicted first; expired ones are swept on write.
    """

    def __init__(self, *, max_handles: int = 10_000, max_tokens: int = 50_000_000,
                 clock: Callable[[], float] = time.time) -> None:
        if max_handles < 1 or max_tokens < 1:
            raise ValueError("max_handles and max_tokens must be positive")
        self._max_handles = max_handles
        self._max_tokens = max_tokens
        self._clock = clock
        #: (tenant, handle_id) -> (packed handle, expires_at, session, decode_node, n tokens)
        self._handles: OrderedDict[tuple[str, str], tuple[bytes, float, str, str, int]] = (
            OrderedDict())
        self._latest: dict[tuple[str, str], str] = {}
        self._tokens = 0

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

    async def put(self, handle: Handle) -> None:
        now = self._clock()
        if handle.expired(now):
            return
        key = (handle.tenant, handle.handle_id)
        self._remove(key)
        n = len(handle.token_ids)
        self._handles[key] = (pack_handle(handle), handle.expires_at, handle.session,
                              handle.decode_node, n)
        self._tokens += n
        self._latest[(handle.tenant, handle.session)] = handle.handle_id
        # Expired handles first (cheap: oldest first, stop at the first live one), then
        # the least recently stored while over a bound (never the one just stored).
        while self._handles:
            oldest = next(iter(self._handles))
            entry = self._handles[oldest]
            over = len(self._handles) > self._max_handles or self._tokens > self._max_tokens
            if oldest != key and (now >= entry[1] or over):
                self._remove(oldest)
            else:
                break

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

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._handles.clear()
        self._latest.clear()
        self._tokens = 0


def make_store(settings: RouterSettings) -> SessionStore:
    """Redis when `redis_url` is set (several replicas), else an in-process store."""
    if settings.redis_url:
        from .state_redis import RedisStore

        return RedisStore.from_url(settings.redis_url)
    return MemoryStore()


async def key_ring_for(settings: RouterSettings, store: SessionStore) -> KeyRing:
    """The signing keys: configured ones, else one shared through Redis, else a random one.

    Replicas behind one Redis must verify each other's tokens, so without configured keys
    they agree on a key stored in Redis (whoever can write Redis can forge handles anyway).
    """
    from .keys import KeyRing

    if settings.signing_keys:
        return KeyRing.from_settings(settings)
    shared = getattr(store, "shared_key_ring", None)
    if shared is not None:
        try:
            return await shared()
        except (OSError, TimeoutError, _store_errors()) as exc:
            # Redis down at start-up must not keep the router down: routing works without
            # it. Until a restart with Redis up, this replica's tokens are its own (another
            # replica's token fails verification and that turn recomputes).
            log.warning("no shared signing key (%s: %s): using a key of this process only; "
                        "configure router.signing_keys to share keys without Redis",
                        type(exc).__name__, exc)
    return KeyRing.generate()


def _store_errors() -> type[BaseException]:
    try:
        from redis.exceptions import RedisError
    except ImportError:  # pragma: no cover - redis is a server dependency
        return OSError
    return RedisError
