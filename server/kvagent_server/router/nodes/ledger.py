"""The router's one ledger of the legs it sends to its nodes; pure (no clock, no I/O).

Every leg the router sends is in it from the moment it is opened until it ends, with
what it carries: its node and role, the prompt tokens the node still has to compute for
it, whether it decodes a stream, and the decode KV blocks promised to it. Every count the
router keeps of its legs is a view of it:

- `in_flight(node)`: legs sent there and not ended (placement's load, `max_in_flight`);
- `work(node)`: what a new leg queues behind there (the path policy's queue-aware prices);
- `free(node)`: a decode node's KV room, its last reported figure less the blocks
  promised to legs it cannot show yet (the decode gate, `nodes.admission`).

`open` is the only way in and `close` the only way out: a leg's owner closes it once,
whatever happened to it (answered, failed, cancelled, its client gone), and a second
close changes nothing. A leg whose close never came is forgotten after `max_age_s`.

A node computes its queued prompts one after another (one core, or vLLM's token budget
per step), so the part of its queued tokens already done is the time since it last
finished a prompt, or since its oldest queued prompt was sent if later, at its per-token
cost: a TTFT line learned after the fact lags the queue a turn is about to join.

A node's KV figure (`vllm:kv_cache_usage_perc` times its block count) lags too: a leg
sent a moment ago is not in it yet. So a leg's promised blocks count against the node
until a figure read after the leg allocated them (its first token) shows them, even once
the leg has ended. Over-counting is the safe side: a turn waits a little; under-counting
lets the P/D deadlock back in (docs/router.md, "KV room on decode nodes").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from kvagent_server.common.types import Role
from kvagent_server.router.reuse.queue import NodeWork


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a sequence of `tokens` tokens occupies (its last block partial), plus the
    block its first generated tokens go to."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return math.ceil(max(tokens, 0) / block_size) + 1


@dataclass
class _Leg:
    node: str
    role: Role
    #: Prompt tokens the node still has to compute for the leg; 0 once computed.
    tokens: int
    #: The leg decodes after its first token (a D leg), taking a slot in every step.
    stream: bool
    opened: float
    #: When the leg was sent to `node` (None: admitted, not sent yet).
    sent: float | None = None
    #: Decode blocks promised to the leg that the node's figure does not show yet.
    blocks: int = 0
    promised: bool = False
    #: When its first token came: its prompt is computed and its blocks allocated.
    first_token: float | None = None
    ended: bool = False


@dataclass(frozen=True)
class _Reading:
    total: int
    used: int
    #: Nothing ran while requests waited (no blocks for any of them).
    stalled: bool
    #: When the read of the node's figure began: an allocation before it is in the figure.
    at: float


class LegLedger:
    """The legs in flight on every node, and each decode node's last KV figure."""

    def __init__(self, *, max_age_s: float = 900.0) -> None:
        if max_age_s <= 0:
            raise ValueError("max_age_s must be positive")
        self.max_age_s = max_age_s
        self._legs: dict[int, _Leg] = {}
        self._last_done: dict[str, float] = {}
        self._readings: dict[str, _Reading] = {}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ a leg's life

    def open(self, node: str, *, role: Role, now: float, tokens: int = 0,
             stream: bool = False, sent: bool = True) -> int:
        """A leg for `node` carrying `tokens` prompt tokens to compute (`stream`: it
        decodes after); `sent=False` for one admitted ahead of its sending (a D leg
        waiting for its P leg). Returns its ticket, the leg's name until `close`."""
        if tokens < 0:
            raise ValueError("tokens must be non-negative")
        ticket = next(self._ids)
        self._legs[ticket] = _Leg(node, role, tokens, stream, now, now if sent else None)
        return ticket

    def sent(self, ticket: int, node: str, now: float) -> None:
        """The leg goes to `node` now (its first try, or a retry elsewhere: its work and
        promised blocks go with it)."""
        leg = self._live(ticket)
        if leg is not None and (leg.sent is None or leg.node != node):
            leg.node, leg.sent = node, now

    def promise(self, ticket: int, blocks: int) -> None:
        """`blocks` of the leg's decode node are spoken for (the gate admitted it)."""
        if blocks < 0:
            raise ValueError("blocks must be non-negative")
        leg = self._live(ticket)
        if leg is not None:
            leg.blocks, leg.promised = blocks, True

    def resize(self, ticket: int, blocks: int) -> int:
        """The promise's real size, once known (a first turn's prompt was estimated).
        Returns the blocks it grew by (0: it shrank, or nothing was promised)."""
        leg = self._live(ticket)
        if leg is None or not leg.promised or leg.first_token is not None:
            return 0
        grown = max(0, blocks) - leg.blocks
        leg.blocks = max(0, blocks)
        return max(0, grown)

    def first_token(self, ticket: int, now: float) -> None:
        """The leg's first token came: its prompt is computed, its blocks allocated (the
        next figure read after `now` shows them)."""
        leg = self._live(ticket)
        if leg is None or leg.first_token is not None:
            return
        leg.first_token = now
        self._computed(leg, now)

    def close(self, ticket: int, now: float) -> bool:
        """The leg is over (answered, failed, cancelled, its client gone). True the one
        time it ends the leg; False for a leg already closed, forgotten or never opened."""
        leg = self._live(ticket)
        if leg is None:
            return False
        if leg.sent is not None:  # its node is done with the prompt either way
            self._computed(leg, now)
        leg.ended = True
        if not (leg.promised and leg.blocks and leg.first_token is not None):
            del self._legs[ticket]  # nothing it allocated is left to show
        return True

    def _computed(self, leg: _Leg, now: float) -> None:
        if leg.tokens:
            leg.tokens = 0
            self._last_done[leg.node] = max(self._last_done.get(leg.node, now), now)

    def _live(self, ticket: int) -> _Leg | None:
        leg = self._legs.get(ticket)
        return leg if leg is not None and not leg.ended else None

    # ------------------------------------------------------------ the nodes' figures

    def observe(self, node: str, *, total_blocks: int, usage: float, read_at: float,
                stalled: bool = False) -> None:
        """The decode node reported `usage` (0..1) of `total_blocks` (and whether it is
        `stalled`), read from `read_at` on: blocks allocated before then are in it."""
        if total_blocks <= 0:
            return
        last = self._readings.get(node)
        if last is not None and last.at > read_at:
            return  # an older read answered late
        used = min(total_blocks, max(0, round(usage * total_blocks)))
        self._readings[node] = _Reading(total_blocks, used, stalled, read_at)
        for ticket, leg in list(self._legs.items()):
            if (leg.node == node and leg.promised and leg.first_token is not None
                    and leg.first_token <= read_at):
                leg.blocks = 0
                if leg.ended:
                    del self._legs[ticket]

    # ------------------------------------------------------------ the views

    def in_flight(self, node: str, now: float | None = None) -> int:
        """Legs sent to `node` and not ended."""
        if now is not None:
            self._expire(now)
        return len(self._sent_to(node))

    def work(self, node: str, *, now: float, per_token_s: float) -> NodeWork:
        """What a leg sent to `node` at `now` finds ahead of it (legs sent, not ended)."""
        self._expire(now)
        legs = self._sent_to(node)
        queued = [leg for leg in legs if leg.tokens]
        tokens = float(sum(leg.tokens for leg in queued))
        if queued and per_token_s > 0:
            since = max(min(leg.sent or leg.opened for leg in queued),
                        self._last_done.get(node, float("-inf")))
            tokens = max(0.0, tokens - max(0.0, now - since) / per_token_s)
        return NodeWork(prefill_tokens=tokens, streams=sum(leg.stream for leg in legs),
                        prompts=len(queued))

    def _sent_to(self, node: str) -> list[_Leg]:
        """Legs sent to `node` and not ended: what its load and its queue are made of."""
        return [leg for leg in self._legs.values()
                if leg.node == node and leg.sent is not None and not leg.ended]

    def total(self, node: str) -> int | None:
        """The decode node's KV blocks (None until it reported them)."""
        reading = self._readings.get(node)
        return reading.total if reading is not None else None

    def stalled(self, node: str) -> bool:
        """At its last read, nothing ran on the node while requests waited."""
        reading = self._readings.get(node)
        return reading is not None and reading.stalled

    def promised(self, node: str) -> int:
        """Blocks promised on `node` that its figure does not show yet."""
        return sum(leg.blocks for leg in self._legs.values() if leg.node == node)

    def free(self, node: str, now: float) -> int | None:
        """Blocks nothing holds or was promised on `node`; None until it reported its size."""
        reading = self._readings.get(node)
        if reading is None:
            return None
        self._expire(now)
        return reading.total - reading.used - self.promised(node)

    def __len__(self) -> int:
        """Entries held: legs not ended, and ended ones whose blocks no figure shows yet."""
        return len(self._legs)

    def _expire(self, now: float) -> None:
        for ticket in [t for t, leg in self._legs.items() if now - leg.opened > self.max_age_s]:
            del self._legs[ticket]
