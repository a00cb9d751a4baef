"""The work in flight on a node as the path policy prices it, and the token estimates
that feed it; pure.

The router sees every leg it sends: a P leg will compute some prompt tokens, a D leg of a
`d_direct` turn computes the uncached delta and then decodes, a D leg of a P/D turn pulls
its KV and decodes. The router's one ledger of legs (`nodes.ledger.LegLedger`) sums them
per node into a `NodeWork`: what a turn sent there now waits for, which a TTFT line
learned after the fact cannot know (it lags the queue, and it sees only the path taken).
"""

from __future__ import annotations

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
