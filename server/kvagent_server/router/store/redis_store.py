"""`SessionStore` on Redis, shared by router replicas.

Keys (tenant, session and node names are percent-encoded, so `:` in them cannot collide):

- `{prefix}:{tenant}:h:{handle_id}`: the packed handle; expires with the handle.
- `{prefix}:{tenant}:l:{session}`: the session's latest handle id; expires with it.
- `{prefix}:node:{node}`: sorted set of handle keys on a decode node, scored by expiry,
  so a lost node's handles can be dropped.
- `{prefix}:{tenant}:q`: sorted set of the tenant's handle keys, scored by expiry, for
  the per-tenant quota (`max_handles_per_tenant`): a put past it evicts the oldest.
- `{prefix}:{tenant}:r:{kind}:{key}`: a record (`store.records`: a stored Response, a
  content-index entry); expires by itself.
- `{prefix}:{tenant}:rq`: sorted set of the tenant's record keys, scored by expiry, for
  its record bound (`max_records_per_tenant`, oldest expiry first).

Claims are single Redis commands or Lua scripts, so they are atomic across replicas:
of any number of concurrent claims of one handle, exactly one gets it. The scripts build
handle keys from the pointer they read, so this layout needs a single (non-cluster) Redis.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar, cast
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.store.base import StoreUnavailable
from kvagent_server.router.store.handle import (
    Handle,
    Retained,
    handle_blocks,
    handle_meta,
    pack_handle,
    unpack_handle,
)
from kvagent_server.router.store.records import Kind

log = logging.getLogger(__name__)

# KEYS = handle, latest pointer, node index, tenant index; ARGV = packed handle, handle
# id, ttl ms, expires_at, now, tenant quota. One script, so a reader never sees the pointer
# without the handle; the indexes live as long as their longest-lived handle (no PEXPIRE
# GT: Redis 6.2 works). Returns the packed handles the quota evicted (each one claimed).
_PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
for i = 3, 4 do
  redis.call('ZADD', KEYS[i], ARGV[4], KEYS[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[5])
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[3]) then
    redis.call('PEXPIRE', KEYS[i], ARGV[3])
  end
end
local evicted = {}
local over = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[6])
while over > 0 do
  local oldest = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
  if (not oldest) or oldest == KEYS[1] then break end
  redis.call('ZREM', KEYS[4], oldest)
  local value = redis.call('GET', oldest)
  if value then
    redis.call('DEL', oldest)
    table.insert(evicted, value)
  end
  over = over - 1
end
return evicted
"""

# KEYS[1] = latest pointer, KEYS[2] = tenant index; ARGV[1] = handle key prefix.
# Pointer and handle go together.
_CLAIM_LATEST = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
redis.call('DEL', KEYS[1])
local key = ARGV[1] .. id
local value = redis.call('GET', key)
if value then redis.call('DEL', key) end
redis.call('ZREM', KEYS[2], key)
return value
"""

# KEYS[1] = latest pointer; ARGV[1] = handle key prefix.
_PEEK_LATEST = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
return redis.call('GET', ARGV[1] .. id)
"""

# KEYS[1] = node index; ARGV = now, limit. The JSON part of each live handle on the node
# (after its 4-byte little-endian length), soonest to expire first: no token ids cross.
_RETAINED = """
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf',
                           'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, key in ipairs(members) do
  local head = redis.call('GETRANGE', key, 0, 3)
  if #head == 4 then
    local n = struct.unpack('<I4', head)
    table.insert(out, redis.call('GETRANGE', key, 4, 3 + n))
  end
end
return out
"""

# KEYS[1] = node index; ARGV = handle keys. Claims (GETDEL) each named handle still
# indexed on this node, in one script: of this and any claim of a handle, one wins.
_EVICT = """
local out = {}
for _, key in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], key) == 1 then
    local value = redis.call('GETDEL', key)
    if value then table.insert(out, value) end
  end
end
return out
"""

# KEYS[1] = the tenant's record index; ARGV = ttl ms, expires_at, now, max per tenant,
# then key/value pairs. Each record expires by itself; the index (scored by expiry) bounds
# the tenant's count, oldest expiry first.
_PUT_RECORDS = """
local ttl, expires, now, cap = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
for i = 5, #ARGV, 2 do
  redis.call('SET', ARGV[i], ARGV[i + 1], 'PX', ttl)
  redis.call('ZADD', KEYS[1], expires, ARGV[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local over = redis.call('ZCARD', KEYS[1]) - cap
if over > 0 then
  for _, key in ipairs(redis.call('ZRANGE', KEYS[1], 0, over - 1)) do
    redis.call('DEL', key)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
end
if redis.call('PTTL', KEYS[1]) < tonumber(ttl) then redis.call('PEXPIRE', KEYS[1], ttl) end
return 0
"""

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _unavailable(
    method: Callable[_P, Coroutine[Any, Any, _T]],
) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """Redis and socket errors leave the store as `StoreUnavailable`, the store contract's
    one error, so callers never depend on the Redis client's exception types."""

    @functools.wraps(method)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await method(*args, **kwargs)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    return wrapper


def _q(part: str) -> str:
    return quote(part, safe="")


class RedisStore:
    """Handles in Redis with TTLs; every claim is atomic (GETDEL or a Lua script)."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "kva",
                 max_handles_per_tenant: int = 5_000, max_records_per_tenant: int = 20_000,
                 clock: Callable[[], float] = time.time) -> None:
        if max_handles_per_tenant < 1:
            raise ValueError("max_handles_per_tenant must be positive")
        self._r = client
        self._max_per_tenant = max_handles_per_tenant
        self._max_records = max_records_per_tenant
        self._prefix = prefix
        self._clock = clock
        self._put = client.register_script(_PUT)
        self._claim_latest = client.register_script(_CLAIM_LATEST)
        self._peek_latest = client.register_script(_PEEK_LATEST)
        self._put_records = client.register_script(_PUT_RECORDS)
        self._retained = client.register_script(_RETAINED)
        self._evict = client.register_script(_EVICT)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisStore:
        client = aioredis.Redis.from_url(url, decode_responses=False,
                                         health_check_interval=30)
        return cls(client, **kwargs)

    # -------------------------------------------------------------- key layout

    def _handle_prefix(self, tenant: str) -> str:
        return f"{self._prefix}:{_q(tenant)}:h:"

    def _handle_key(self, tenant: str, handle_id: str) -> str:
        return self._handle_prefix(tenant) + handle_id

    def _latest_key(self, tenant: str, session: str) -> str:
        return f"{self._prefix}:{_q(tenant)}:l:{_q(session)}"

    def _tenant_key(self, tenant: str) -> str:
        return f"{self._prefix}:{_q(tenant)}:q"

    def _record_key(self, tenant: str, kind: Kind, key: str) -> str:
        return f"{self._prefix}:{_q(tenant)}:r:{kind}:{_q(key)}"

    def _record_index(self, tenant: str) -> str:
        return f"{self._prefix}:{_q(tenant)}:rq"

    def _node_key(self, decode_node: str) -> str:
        return f"{self._prefix}:node:{_q(decode_node)}"

    # -------------------------------------------------------------- SessionStore

    def _live(self, data: bytes | None) -> Handle | None:
        """The handle, unless absent or expired by this replica's clock."""
        if data is None:
            return None
        handle = unpack_handle(data)
        return None if handle.expired(self._clock()) else handle

    @_unavailable
    async def put(self, handle: Handle) -> list[Handle]:
        now = self._clock()
        ttl_ms = int((handle.expires_at - now) * 1000)
        if ttl_ms <= 0:
            return []
        if "/" in handle.handle_id or ":" in handle.handle_id:
            raise ValueError("handle ids must not contain ':' or '/'")
        hkey = self._handle_key(handle.tenant, handle.handle_id)
        evicted = await self._put(
            keys=[hkey, self._latest_key(handle.tenant, handle.session),
                  self._node_key(handle.decode_node), self._tenant_key(handle.tenant)],
            args=[pack_handle(handle), handle.handle_id, ttl_ms, repr(handle.expires_at),
                  repr(now), self._max_per_tenant])
        return [h for value in evicted or () if (h := self._live(value)) is not None]

    @_unavailable
    async def claim(self, tenant: str, handle_id: str) -> Handle | None:
        if not handle_id or ":" in handle_id or "/" in handle_id:
            return None
        key = self._handle_key(tenant, handle_id)
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.getdel(key)  # the claim: one winner
            pipe.zrem(self._tenant_key(tenant), key)  # no longer counts against the quota
            value, _ = await pipe.execute()
        return self._live(cast(bytes | None, value))

    @_unavailable
    async def claim_latest(self, tenant: str, session: str) -> Handle | None:
        data = await self._claim_latest(keys=[self._latest_key(tenant, session),
                                              self._tenant_key(tenant)],
                                        args=[self._handle_prefix(tenant)])
        return self._live(data)

    @_unavailable
    async def peek_latest(self, tenant: str, session: str) -> Handle | None:
        data = await self._peek_latest(keys=[self._latest_key(tenant, session)],
                                       args=[self._handle_prefix(tenant)])
        return self._live(data)

    @_unavailable
    async def drop_node(self, decode_node: str, *, keep_epoch: str | None = None) -> int:
        nkey = self._node_key(decode_node)
        members = cast(list[bytes], await self._r.zrange(nkey, 0, -1))
        if not members:
            return 0
        values = await self._r.mget(members)
        now = self._clock()
        doomed: list[bytes] = []  # index entries to forget (gone, or being dropped)
        dropped: list[bytes] = []  # live handles among them
        for member, value in zip(members, values, strict=True):
            if value is None:
                doomed.append(member)
                continue
            meta = handle_meta(cast(bytes, value))
            if keep_epoch is not None and meta.get("decode_epoch") == keep_epoch:
                continue
            doomed.append(member)
            if meta["expires_at"] > now:
                dropped.append(member)
        if doomed:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.delete(*doomed)
                pipe.zrem(nkey, *doomed)
                await pipe.execute()
        return len(dropped)

    @_unavailable
    async def evict_oldest(self, decode_node: str, min_blocks: int,
                           max_handles: int) -> list[Handle]:
        nkey = self._node_key(decode_node)
        out: list[Handle] = []
        freed = 0
        batch = 8
        while len(out) < max_handles and (min_blocks < 0 or freed < min_blocks):
            # Scored by expiry: with one TTL, the lowest scores are the oldest handles.
            # A whole batch is taken (may overshoot by a few: they are the oldest anyway).
            n = min(batch, max_handles - len(out))
            members = cast(list[bytes], await self._r.zrange(nkey, 0, n - 1))
            if not members:
                break
            async with self._r.pipeline(transaction=False) as pipe:
                for member in members:
                    pipe.getdel(member)  # each GETDEL is the claim: one winner
                values = await pipe.execute()
            await self._r.zrem(nkey, *members)
            for member, value in zip(members, values, strict=True):
                handle = self._live(value)
                if handle is not None:
                    await self._r.zrem(self._tenant_key(handle.tenant), member)
                    out.append(handle)
                    freed += handle_blocks(handle)
        return out

    @_unavailable
    async def retained(self, decode_node: str, limit: int) -> list[Retained]:
        if limit <= 0:
            return []
        metas = await self._retained(keys=[self._node_key(decode_node)],
                                     args=[repr(self._clock()), limit])
        return [Retained.of_meta(json.loads(meta)) for meta in metas or ()]

    @_unavailable
    async def evict_handles(self, decode_node: str,
                            keys: Sequence[tuple[str, str]]) -> list[Handle]:
        members = [self._handle_key(tenant, hid) for tenant, hid in keys
                   if hid and ":" not in hid and "/" not in hid]
        if not members:
            return []
        values = await self._evict(keys=[self._node_key(decode_node)], args=members)
        out = [h for value in values or () if (h := self._live(value)) is not None]
        if out:
            async with self._r.pipeline(transaction=False) as pipe:
                for handle in out:  # no longer counts against the tenant's quota
                    pipe.zrem(self._tenant_key(handle.tenant),
                              self._handle_key(handle.tenant, handle.handle_id))
                await pipe.execute()
        return out

    # -------------------------------------------------------------- RecordStore

    @_unavailable
    async def put_records(self, tenant: str, kind: Kind, items: Sequence[tuple[str, bytes]],
                          ttl_s: float) -> None:
        if ttl_s <= 0 or not items:
            return
        now = self._clock()
        args: list[Any] = [int(ttl_s * 1000), now + ttl_s, now, self._max_records]
        for key, value in items:
            args += [self._record_key(tenant, kind, key), value]
        await self._put_records(keys=[self._record_index(tenant)], args=args)

    @_unavailable
    async def get_record(self, tenant: str, kind: Kind, key: str) -> bytes | None:
        value = await self._r.get(self._record_key(tenant, kind, key))
        return cast(bytes | None, value)

    @_unavailable
    async def find_record(self, tenant: str, kind: Kind,
                          keys: Sequence[str]) -> tuple[str, bytes] | None:
        if not keys:
            return None
        values = await self._r.mget([self._record_key(tenant, kind, k) for k in keys])
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                return key, cast(bytes, value)
        return None

    async def ping(self) -> bool:
        try:
            return bool(await self._r.ping())
        except (RedisError, OSError) as exc:
            log.warning("redis ping failed: %s", exc)
            return False

    async def close(self) -> None:
        await self._r.aclose()

    # -------------------------------------------------------------- shared signing key

    # Replicas without configured keys share theirs through one hash (kid -> hex key) and
    # sign with the key named by `active`. Every replica keeps re-publishing its keys
    # (`publish_key_ring`), so a Redis restarted empty learns them again, and a replica
    # that started while Redis was empty and made its own key is learned by the others.

    def _keys_key(self) -> str:
        return f"{self._prefix}:signing_keys"

    def _active_key(self) -> str:
        return f"{self._prefix}:signing_active"

    @_unavailable
    async def shared_key_ring(self) -> KeyRing:
        """Every replica's keys; the active one is the first replica's (set once)."""
        kid, key = f"s{secrets.token_hex(4)}", secrets.token_bytes(32)
        await self._r.hsetnx(self._keys_key(), kid, key.hex())
        await self._r.set(self._active_key(), kid, nx=True)
        stored = await self._r.get(self._active_key())
        keys = await self._stored_keys()
        keys.setdefault(kid, key)  # ours, even if Redis was emptied in between
        active = stored.decode() if isinstance(stored, bytes) else kid
        return KeyRing(keys, active if active in keys else kid)

    @_unavailable
    async def publish_key_ring(self, ring: KeyRing) -> KeyRing:
        """Make sure Redis holds `ring`'s keys (and an active kid); return `ring` plus every
        key other replicas published."""
        mapping = {kid: (ring.key(kid) or b"").hex() for kid in ring.kids}
        async with self._r.pipeline(transaction=False) as pipe:
            for kid, hex_key in mapping.items():
                pipe.hsetnx(self._keys_key(), kid, hex_key)
            pipe.set(self._active_key(), ring.active_kid, nx=True)
            await pipe.execute()
        return ring.merged(await self._stored_keys())

    async def _stored_keys(self) -> dict[str, bytes]:
        raw = cast(dict[bytes, bytes], await self._r.hgetall(self._keys_key()))
        out: dict[str, bytes] = {}
        for kid, hex_key in raw.items():
            try:
                out[kid.decode()] = bytes.fromhex(hex_key.decode())
            except ValueError:
                log.warning("ignoring a malformed shared signing key %r", kid)
        return out
