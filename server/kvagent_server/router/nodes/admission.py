"""Admit a turn to a decode node only when the node has KV room for it.

Every leg the router sends to a decode node waits here first, in arrival order per node,
until the node's free blocks (`nodes.ledger.LegLedger.free`) cover what the leg will
allocate; the blocks are then promised to the leg in the same ledger.
That is what keeps P and D from deadlocking under KV pressure: a P leg leases P's blocks
only for a D leg that D can take, so P's leases always end, and D's blocks held for P's
pulls are freed by P legs that always run.

A waiting turn may hold a claimed handle on the node (blocks it means to reuse). While
it waits those blocks are the gate's to take back: when the first turn in line cannot get
room any other way (the store's unclaimed handles evicted, nothing in flight on the node
to finish), the gate releases the newest waiter's handle, and that turn recomputes its
prompt (`Admitted.revoked`). Releasing is safe as always: the handle was claimed, so no
one else can present it. Room held by what the router cannot see (another router
replica's turns) is waited for up to `max_wait_s`, then the turn is refused (503).

Handles given up elsewhere (the watermark's round, another turn's room) leave the store
before their blocks leave the node's figure: until their release has been answered and
the node read since, the figure is short by what is on its way. A turn short of room
then waits for that read, up to `settle_s`, rather than evict by it: otherwise it takes
handles for nothing, last of all one of a session expected back from its tool any moment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvagent_server.router.nodes.ledger import LegLedger
from kvagent_server.router.nodes.legs import LegError
from kvagent_server.router.nodes.registry import Node

log = logging.getLogger("kvagent.router.room")


class NoRoom(LegError):
    """The node found no KV room for the turn within the wait (503: try again later)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503, leg="decode")


@dataclass
class Waiter:
    """A turn in line for a node's room."""

    blocks: int
    #: The decode request id of the handle it claimed on this node (None: none): blocks
    #: the gate may release to make room, the turn then recomputes.
    pinned: str | None = None
    #: Blocks that handle holds.
    pinned_blocks: int = 0
    #: Whether the turn's own P leg frees them before its D leg allocates (a pull reads
    #: them out, a recompute releases them); a `d_direct` leg reuses them in place.
    freed_by_p: bool = False
    revoked: bool = False

    @property
    def credit(self) -> int:
        return self.pinned_blocks if self.freed_by_p and not self.revoked else 0


@dataclass(frozen=True)
class Admitted:
    """The leg may go to the node: its blocks are promised to it in the ledger (`promised`
    False: the node's size is unknown, nothing to promise against)."""

    node: str
    promised: bool
    #: The turn's pinned handle was released while it waited: it must not be reused.
    revoked: bool = False


#: `make_room(node, blocks)` evicts and releases unclaimed handles of the node holding
#: about `blocks` blocks, in the retention policy's order (`nodes.retention`), returning the blocks freed; `refresh(node)` reads the
#: node's figure into the ledger; `release(node, ids)` frees decode request ids.
MakeRoom = Callable[[Node, int], Awaitable[int]]
Refresh = Callable[[Node], Awaitable[None]]
Release = Callable[[Node, list[str]], Awaitable[None]]


class DecodeGate:
    """Admits legs to decode nodes by their room, one node's turns in arrival order."""

    def __init__(self, ledger: LegLedger, *, make_room: MakeRoom, refresh: Refresh,
                 release: Release, max_wait_s: float, poll_s: float = 0.25,
                 settle_s: float = 3.0,
                 room_on_its_way: Callable[[str], bool] = lambda node: False,
                 clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[], None] = lambda: None,
                 on_revoke: Callable[[], None] = lambda: None) -> None:
        if max_wait_s <= 0 or poll_s <= 0 or settle_s < 0:
            raise ValueError("max_wait_s and poll_s must be positive, settle_s not negative")
        self.ledger = ledger
        self.make_room, self.refresh, self.release = make_room, refresh, release
        self.max_wait_s, self.poll_s, self.clock = max_wait_s, poll_s, clock
        self.settle_s, self.room_on_its_way = settle_s, room_on_its_way
        self._lines: dict[str, list[Waiter]] = {}
        self._turn: dict[str, asyncio.Lock] = {}
        self.on_wait, self.on_revoke = on_wait, on_revoke

    async def admit(self, node: Node, leg: int, blocks: int, *, pinned: str | None = None,
                    pinned_blocks: int = 0, freed_by_p: bool = False) -> Admitted:
        """Wait, in line, until `node` has room for `blocks` blocks, and promise them to
        `leg` (its ticket in the ledger, opened for `node` and not sent yet)."""
        me = Waiter(blocks, pinned, pinned_blocks if pinned else 0, freed_by_p)
        line = self._lines.setdefault(node.name, [])
        line.append(me)
        lock = self._turn.setdefault(node.name, asyncio.Lock())
        try:
            async with lock:  # one turn at a time takes room: the others keep their order
                return await self._take(node, leg, me)
        finally:
            line.remove(me)

    async def _take(self, node: Node, leg: int, me: Waiter) -> Admitted:
        deadline = self.clock() + self.max_wait_s
        refreshed = waited = False
        settle_until: float | None = None
        while True:
            now = self.clock()
            free, total = self.ledger.free(node.name, now), self.ledger.total(node.name)
            credit = me.credit
            # More than the node holds is not ours to wait for (vLLM refuses or preempts);
            # a node that reports no size leaves nothing to promise against.
            fits = free is not None and total is not None and (
                me.blocks > total or free + credit >= me.blocks)
            if fits or (free is None and refreshed):
                if free is not None:
                    self.ledger.promise(leg, me.blocks)
                return Admitted(node.name, free is not None, revoked=me.revoked)
            if not refreshed:  # not read yet, or read before legs that have ended since
                refreshed = True
                await self.refresh(node)
                continue
            assert free is not None
            if not waited:
                waited = True
                self.on_wait()
            if self.room_on_its_way(node.name):
                settle_until = settle_until if settle_until is not None else now + self.settle_s
                if now < settle_until:  # a release the figure does not show yet
                    await asyncio.sleep(self.poll_s)
                    await self.refresh(node)
                    continue
            short = me.blocks - credit - free
            freed = await self.make_room(node, short)
            if freed <= 0 and self._stuck(node):
                freed = await self._revoke(node, short)
            if freed <= 0:
                if now >= deadline:
                    raise NoRoom(f"decode node {node.name} had no KV room for "
                                 f"{me.blocks} blocks within {self.max_wait_s:.0f} s")
                await asyncio.sleep(self.poll_s)
            await self.refresh(node)

    async def top_up(self, node: Node, grown: int) -> int:
        """A leg's promise grew by `grown` blocks after it was admitted (a first turn's
        prompt is estimated from its body until P reports its size): evict unclaimed
        handles of the node for what it is now short, at once, since the D leg goes next
        with P's lease running. Without this a prompt that tokenizes denser than the
        estimate goes to a node without room for it, where it waits, nothing running, for
        retained blocks only their TTL frees. The node is read again first (after a
        release on its way, within `settle_s`): the last figure may predate room freed
        since. Returns the blocks freed."""
        free = self.ledger.free(node.name, self.clock())
        if grown <= 0 or free is None or free >= 0:
            return 0
        until = self.clock() + self.settle_s
        while self.room_on_its_way(node.name) and self.clock() < until:
            await asyncio.sleep(self.poll_s)
        await self.refresh(node)
        free = self.ledger.free(node.name, self.clock())
        if free is None or free >= 0:
            return 0
        freed = await self.make_room(node, min(grown, -free))
        if freed:
            log.info("decode %s: a prompt was %d blocks longer than estimated; evicted "
                     "%d blocks of retained handles for it", node.name, grown, freed)
        return freed

    def _stuck(self, node: Node) -> bool:
        """Nothing the router sent will free room by itself: the node is stalled (nothing
        runs, requests wait), or no leg runs there and none is on its way."""
        return self.ledger.stalled(node.name) or not (
            self.ledger.in_flight(node.name) or self.ledger.promised(node.name))

    async def _revoke(self, node: Node, short: int) -> int:
        """Release waiters' pinned handles, newest first, until about `short` blocks are
        freed; returns the blocks released."""
        freed = 0
        for waiter in reversed(self._lines.get(node.name, [])):
            if freed >= short:
                break
            if waiter.pinned is None or waiter.revoked:
                continue
            waiter.revoked = True
            self.on_revoke()
            await self.release(node, [waiter.pinned])
            freed += max(waiter.pinned_blocks, 1)
            log.info("decode %s: no KV room; released a waiting turn's handle (it "
                     "recomputes)", node.name)
        return freed
