"""The work in flight on each node, counted in tokens by the router itself; pure.

The router sees every leg it sends: a P leg will compute some prompt tokens, a D leg of a
`d_direct` turn computes the uncached delta and then decodes, a D leg of a P/D turn pulls
its KV and decodes. Counting that work per node gives what a turn sent there now waits
for, which a TTFT line learned after the fact cannot know (it lags the queue, and it sees
only the path that was taken). Nothing here reads a clock or does I/O: `now` is passed in.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class NodeWork(BaseModel):
    """What is ahead of a new request on one node."""

    model_config = ConfigDict(frozen=True)

    #: Prompt tokens the node still has to compute for the legs already there.
    prefill_tokens: float = Field(default=0.0, ge=0)
    #: Streams decoding (or about to) on the node: each takes a slot in every step.
    streams: int = Field(default=0, ge=0)
    #: Legs whose prompt the node has not reported computed. A fact, where
    #: `prefill_tokens` is an estimate that reads 0 once the node runs slower than its
    #: per-token line (as it does under load) while those legs are still computing.
    prompts: int = Field(default=0, ge=0)


IDLE = NodeWork()


@dataclass
class _Leg:
    node: str
    tokens: int  # prompt tokens to compute on the node; 0 once computed
    stream: bool
    started: float


class WorkLedger:
    """Legs in flight per node: prompt tokens still to compute and decode streams.

    A node is taken to compute its prompts one after another (one core, or vLLM's token
    budget per step), so the part of the queued tokens already done is the time since the
    node last finished a prompt, or since its oldest queued prompt arrived if later, at
    the node's per-token cost. Legs older than `max_age_s` are forgotten (a leg whose end
    was never reported must not inflate a node's queue forever).
    """

    def __init__(self, *, max_age_s: float = 600.0) -> None:
        if max_age_s <= 0:
            raise ValueError("max_age_s must be positive")
        self.max_age_s = max_age_s
        self._legs: dict[int, _Leg] = {}
        self._last_done: dict[str, float] = {}
        self._ids = itertools.count(1)

    def begin(self, node: str, *, prefill_tokens: int, stream: bool, now: float) -> int:
        """A leg was sent to `node`; returns its ticket for `prefilled` and `end`."""
        if prefill_tokens < 0:
            raise ValueError("prefill_tokens must be non-negative")
        ticket = next(self._ids)
        self._legs[ticket] = _Leg(node, prefill_tokens, stream, now)
        return ticket

    def prefilled(self, ticket: int, now: float) -> None:
        """The leg's prompt is computed (its first token came); a stream goes on decoding."""
        leg = self._legs.get(ticket)
        if leg is None:
            return
        if leg.tokens:
            leg.tokens = 0
            self._last_done[leg.node] = max(self._last_done.get(leg.node, now), now)
        if not leg.stream:
            del self._legs[ticket]

    def end(self, ticket: int, now: float) -> None:
        """The leg is over (answered, failed or cancelled); idempotent."""
        if ticket in self._legs:
            self.prefilled(ticket, now)
            self._legs.pop(ticket, None)

    def work(self, node: str, *, now: float, per_token_s: float) -> NodeWork:
        """What a request sent to `node` at `now` finds ahead of it."""
        for ticket in [t for t, leg in self._legs.items()
                       if now - leg.started > self.max_age_s]:
            del self._legs[ticket]
        legs = [leg for leg in self._legs.values() if leg.node == node]
        queued = [leg for leg in legs if leg.tokens]
        tokens = float(sum(leg.tokens for leg in queued))
        if queued and per_token_s > 0:
            since = max(min(leg.started for leg in queued),
                        self._last_done.get(node, float("-inf")))
            tokens = max(0.0, tokens - max(0.0, now - since) / per_token_s)
        return NodeWork(prefill_tokens=tokens, streams=sum(leg.stream for leg in legs),
                        prompts=len(queued))


class CharsPerToken:
    """Tokens per character (byte of JSON) of what the router did not tokenize, learned
    online (EWMA).

    The router keeps two: a first turn is not tokenized (there is nothing to verify
    against), so its P leg's work is estimated from the body's size, with a ratio
    learned from P legs' usage that also absorbs what P's own prefix cache saves; and a
    turn that skips `/tokenize` because its messages extend the held ones estimates its
    delta from the new messages' size, with a ratio of prompt tokens to message bytes.
    """

    def __init__(self, *, prior: float = 0.25, alpha: float = 0.2) -> None:
        if prior <= 0 or not 0 < alpha <= 1:
            raise ValueError("prior must be positive and alpha in (0, 1]")
        self.ratio = prior
        self.alpha = alpha
        self.samples = 0

    def observe(self, chars: int, computed_tokens: int) -> None:
        if chars <= 0 or computed_tokens < 0:
            return
        self.ratio += self.alpha * (computed_tokens / chars - self.ratio)
        self.samples += 1

    def tokens(self, chars: int) -> int:
        return max(0, round(chars * self.ratio))
