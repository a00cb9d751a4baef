"""What the router learns from the turns it serves, in one place; pure.

Every figure a later turn decides on that an earlier turn taught: the per-path TTFT lines
(`paths.CostModel`), the tokens per byte of what the router did not tokenize
(`queue.CharsPerToken`, three of them), each tool's pause (`pauses.ToolPauses`), the
`/tokenize` round trip, and which prefill nodes were seen checking what they pull.

Only settle writes it (`turns.settle`, from the executed turn and its answer); gather
reads a frozen `LearnedView` of it into the turn's facts, and decide reads that. So a
decision never sees a figure change under it, and no other stage learns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvagent_server.router.reuse.paths import CostModel
from kvagent_server.router.reuse.pauses import ToolPauses
from kvagent_server.router.reuse.queue import CharsPerToken

#: Weight of the newest `/tokenize` round trip in the running mean of it.
TOKENIZE_EWMA_ALPHA = 0.2


@dataclass(frozen=True)
class LearnedView:
    """The learned figures one turn decides on, as they were when it was gathered."""

    #: Tokens per body byte of a prompt the router did not tokenize (what P computes).
    tokens_per_char: float = 0.25
    #: The whole prompt's tokens (cached or not) per body byte: the room it needs on D.
    prompt_tokens_per_char: float = 1 / 3
    #: Prompt tokens per byte of a chat turn's messages, and from how many turns.
    tokens_per_message_char: float = 0.25
    message_samples: int = 0
    #: The `/tokenize` round trip, seconds (None: none made yet).
    tokenize_s: float | None = None
    #: Node name -> the epoch in which it was seen checking what it pulls.
    checks_pulls: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def estimate_tokens(self, chars: int) -> int:
        """A prompt the router did not tokenize, from its body's size (`CharsPerToken`)."""
        return max(0, round(chars * self.tokens_per_char))

    def estimate_prompt(self, chars: int) -> int:
        """The whole prompt's tokens, estimated from the body's size (room on D)."""
        return max(0, round(chars * self.prompt_tokens_per_char))

    def message_tokens(self, chars: int) -> int:
        return max(0, round(chars * self.tokens_per_message_char))

    def node_checks_pulls(self, name: str, epoch: str) -> bool:
        """Seen, in this incarnation, to pull only blocks its own prompt repeats."""
        return self.checks_pulls.get(name) == epoch


class Learned:
    """The router's learned state: `view()` (and `costs.snapshot()`) for the facts;
    settle alone calls the writers (`costs.observe`, the ratios' `observe`, `pauses`,
    `observe_tokenize`, `observe_checks_pulls`)."""

    def __init__(self, *, costs: CostModel | None = None) -> None:
        self.costs = costs or CostModel()
        #: Tokens per body character of P legs whose prompt the router did not tokenize.
        self.chars = CharsPerToken()
        #: Prompt tokens (all of them, cached or not) per body character of untokenized
        #: turns: the blocks a decode node must hold for one (nodes/admission.py). Starts high
        #: (1 token per 3 bytes): too much room promised makes a turn wait, too little
        #: can stall D.
        self.prompt_chars = CharsPerToken(prior=1 / 3)
        #: Prompt tokens per byte of a chat turn's messages (a turn that skips `/tokenize`
        #: estimates its delta from its new messages with it).
        self.message_chars = CharsPerToken()
        #: How long each tenant's tools keep a session away (retention keeps a waiting
        #: session's KV by it: `router.retention.policy`).
        self.pauses = ToolPauses()
        #: The `/tokenize` round trip, seconds (running mean; None until one was made).
        self.tokenize_s: float | None = None
        self._checks_pulls: dict[str, str] = {}

    def view(self) -> LearnedView:
        return LearnedView(tokens_per_char=self.chars.ratio,
                           prompt_tokens_per_char=self.prompt_chars.ratio,
                           tokens_per_message_char=self.message_chars.ratio,
                           message_samples=self.message_chars.samples,
                           tokenize_s=self.tokenize_s,
                           checks_pulls=MappingProxyType(dict(self._checks_pulls)))

    def checks_pulls(self, name: str, epoch: str) -> bool:
        return self._checks_pulls.get(name) == epoch

    def observe_tokenize(self, seconds: float) -> None:
        self.tokenize_s = seconds if self.tokenize_s is None else (
            self.tokenize_s + TOKENIZE_EWMA_ALPHA * (seconds - self.tokenize_s))

    def observe_checks_pulls(self, name: str, epoch: str) -> None:
        """The node's P leg answered with the tokens it verified (its `pull_check`)."""
        self._checks_pulls[name] = epoch
