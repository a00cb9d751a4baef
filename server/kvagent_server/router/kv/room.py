"""Free KV blocks on each decode node, as the router can know them; no I/O here.

A P/D turn leases P's blocks until its D leg pulls them, and that D leg needs blocks on D.
If the router sends P legs whose D legs D cannot allocate, P fills with leases nobody
reads while D fills with retained turns whose next turns wait for P: a deadlock that
only the TTLs end. So the router promises D's blocks to a P/D turn *before* its P leg
(`nodes.admission.DecodeGate`), and this ledger says how many are still free.

A node's own figure (`vllm:kv_cache_usage_perc` times its block count) lags: a leg the
router sent a moment ago is not in it yet. So free blocks are the node's last figure less
every promise it cannot yet show: promises whose leg has not allocated (no first token),
and those whose leg allocated after the figure was read. Over-counting is the safe side:
a turn waits a little; under-counting lets the deadlock back in.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a sequence of `tokens` tokens occupies (its last block partial), plus the
    block its first generated tokens go to."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return math.ceil(max(tokens, 0) / block_size) + 1


@dataclass
class _Promise:
    node: str
    blocks: int
    made: float
    #: When the leg's blocks were allocated on the node (its first token); None: not yet.
    allocated: float | None = None


@dataclass(frozen=True)
class _Reading:
    total: int
    used: int
    #: Nothing ran while requests waited (no blocks for any of them).
    stalled: bool
    #: When the read of the node's figure began: an allocation before it is in the figure.
    at: float


class DecodeRoom:
    """Each decode node's free blocks: its last reported figure less the promises made
    since that it cannot show yet. Promises older than `max_age_s` are dropped (a leg
    whose end was never reported must not hold a node's room forever)."""

    def __init__(self, *, max_age_s: float = 900.0) -> None:
        if max_age_s <= 0:
            raise ValueError("max_age_s must be positive")
        self.max_age_s = max_age_s
        self._readings: dict[str, _Reading] = {}
        self._promises: dict[int, _Promise] = {}
        self._ids = itertools.count(1)

    def observe(self, node: str, *, total_blocks: int, usage: float, read_at: float,
                stalled: bool = False) -> None:
        """The node reported `usage` (0..1) of `total_blocks` (and whether it is
        `stalled`), read from `read_at` on."""
        if total_blocks <= 0:
            return
        used = min(total_blocks, max(0, round(usage * total_blocks)))
        last = self._readings.get(node)
        if last is not None and last.at > read_at:
            return  # an older read answered late
        self._readings[node] = _Reading(total_blocks, used, stalled, read_at)
        for ticket in [t for t, p in self._promises.items()
                       if p.node == node and p.allocated is not None and p.allocated <= read_at]:
            del self._promises[ticket]

    def total(self, node: str) -> int | None:
        reading = self._readings.get(node)
        return reading.total if reading is not None else None

    def stalled(self, node: str) -> bool:
        """At its last read, nothing ran on the node while requests waited."""
        reading = self._readings.get(node)
        return reading is not None and reading.stalled

    def free(self, node: str, now: float) -> int | None:
        """Blocks nothing holds or was promised on `node`; None until it reported its size."""
        reading = self._readings.get(node)
        if reading is None:
            return None
        self._expire(now)
        promised = sum(p.blocks for p in self._promises.values() if p.node == node)
        return reading.total - reading.used - promised

    def promise(self, node: str, blocks: int, now: float) -> int:
        """`blocks` of `node` are spoken for by a leg on its way; returns the ticket."""
        if blocks < 0:
            raise ValueError("blocks must be non-negative")
        ticket = next(self._ids)
        self._promises[ticket] = _Promise(node, blocks, now)
        return ticket

    def resize(self, ticket: int, blocks: int) -> None:
        """The leg's real size, once known (a first turn's prompt was estimated)."""
        promise = self._promises.get(ticket)
        if promise is not None and promise.allocated is None:
            promise.blocks = max(0, blocks)

    def allocated(self, ticket: int, now: float) -> None:
        """The leg's blocks are on the node (its first token came): the next figure read
        after `now` shows them, and the promise ends there."""
        promise = self._promises.get(ticket)
        if promise is not None and promise.allocated is None:
            promise.allocated = now

    def cancel(self, ticket: int) -> None:
        """The leg never allocated (refused, failed, moved to another node); idempotent."""
        promise = self._promises.get(ticket)
        if promise is not None and promise.allocated is None:
            del self._promises[ticket]

    def promised(self, node: str) -> int:
        return sum(p.blocks for p in self._promises.values() if p.node == node)

    def _expire(self, now: float) -> None:
        for ticket in [t for t, p in self._promises.items() if now - p.made > self.max_age_s]:
            del self._promises[ticket]
