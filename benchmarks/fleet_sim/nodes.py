"""Simulated P and D nodes: queues, KV blocks, retained sequences (pure state, no clock of
their own: every method takes the simulated time)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class PNode:
    name: str
    url: str
    epoch: str = "e0"
    free_at: float = 0.0  # one prefill at a time
    in_flight: int = 0
    warm_prefix: bool = False  # holds the shared system prompt in its prefix cache
    session_prefix: dict[str, int] = field(default_factory=dict)  # session -> cached tokens
    busy_s: float = 0.0

    def compute(self, ready: float, seconds: float) -> float:
        """Queue a prefill that can start at `ready`; returns when it ends."""
        start = max(ready, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at


@dataclass
class DNode:
    """A decode node's KV cache: blocks of running sequences plus retained ones."""

    name: str
    url: str
    capacity: int
    ttl_s: float
    epoch: str = "e0"
    free_at: float = 0.0  # d_direct prefills, one at a time
    in_flight: int = 0
    running: int = 0
    used: int = 0
    retained: dict[str, int] = field(default_factory=dict)  # request id -> blocks
    retained_blocks: int = 0
    _expiry: list[tuple[float, str]] = field(default_factory=list)
    _waiting: deque[tuple[int, Callable[[float], None]]] = field(default_factory=deque)
    # statistics
    last_t: float = 0.0
    retained_area: float = 0.0  # block-seconds
    used_area: float = 0.0
    peak_used: int = 0
    peak_retained: int = 0
    ttl_freed: int = 0
    released: int = 0  # retained sequences freed by a release request or a pull
    admission_waits: int = 0

    def _tick(self, now: float) -> None:
        dt = max(0.0, now - self.last_t)
        self.retained_area += self.retained_blocks * dt
        self.used_area += self.used * dt
        self.last_t = max(self.last_t, now)

    def usage(self, now: float) -> float:
        self.expire(now)
        return self.used / self.capacity

    def admit(self, now: float, blocks: int, then: Callable[[float], None]) -> None:
        """Allocate `blocks` now, or when enough are freed (FIFO); then call `then`."""
        self.expire(now)
        blocks = min(blocks, self.capacity)
        if not self._waiting and self.used + blocks <= self.capacity:
            self._alloc(now, blocks)
            then(now)
        else:
            self.admission_waits += 1
            self._waiting.append((blocks, then))

    def take(self, now: float, blocks: int) -> None:
        """Allocate without waiting (a prefix hit that vanished after admission)."""
        self._alloc(now, blocks)

    def _alloc(self, now: float, blocks: int) -> None:
        self._tick(now)
        self.used += blocks
        self.peak_used = max(self.peak_used, self.used)

    def _free(self, now: float, blocks: int) -> None:
        self._tick(now)
        self.used -= blocks
        while self._waiting and self.used + self._waiting[0][0] <= self.capacity:
            need, then = self._waiting.popleft()
            self._alloc(now, need)
            then(now)

    def finish(self, now: float, rid: str, allocated: int, keep: int) -> float:
        """A sequence ends: it keeps `keep` of its `allocated` blocks for the TTL; returns
        when they expire."""
        self._tick(now)
        keep = min(keep, allocated)
        self.retained[rid] = keep
        self.retained_blocks += keep
        self.peak_retained = max(self.peak_retained, self.retained_blocks)
        expires = now + self.ttl_s
        heapq.heappush(self._expiry, (expires, rid))
        self._free(now, allocated - keep)
        return expires

    def borrow(self, now: float, rid: str, blocks: int) -> int:
        """A `d_direct` turn extends retained sequence `rid`: its first `blocks` blocks now
        belong to the new sequence. Returns how many were there to borrow."""
        have = self.retained.get(rid)
        if have is None:
            return 0
        self._tick(now)
        take = min(have, blocks)
        self.retained[rid] = have - take
        self.retained_blocks -= take
        return take

    def release(self, now: float, rid: str, *, ttl: bool = False) -> int:
        """Free a retained sequence (release request, P's read, or the TTL)."""
        blocks = self.retained.pop(rid, None)
        if blocks is None:
            return 0
        self._tick(now)
        self.retained_blocks -= blocks
        if ttl:
            self.ttl_freed += 1
        else:
            self.released += 1
        self._free(now, blocks)
        return blocks

    def expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, rid = heapq.heappop(self._expiry)
            self.release(now, rid, ttl=True)
