"""How long agents' tools run: learned per tool name from the gaps between turns. Pure.

A turn that ends on tool calls leaves its session waiting while the agent runs them; the
session's next turn carries their results. The time between the two is the tool's pause,
and retention keeps a waiting session's KV by when it is expected back
(`router.retention.policy`). Learned per tenant and tool name (tool names are the
client's own: two tenants' `search` need not be the same tool), as a running mean and
mean deviation (the estimator TCP uses for round trips), so one odd pause moves it a
little and a tool that varies a lot is given room before it counts as overdue.

Bounded: at most `max_tools` (tenant, tool) pairs and `max_sessions` sessions' last ends
are kept, the least recently used going first. The router's only instance lives on
`turns.context.Router` and only `turns.settle` writes it; each replica learns from the
turns it serves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from kvagent_server.router.store.handle import TurnEnd


@dataclass(frozen=True)
class PauseStats:
    """A tool's learned pause, seconds: running mean and mean deviation."""

    mean_s: float
    dev_s: float
    samples: int


#: (tenant, tool name)
ToolKey = tuple[str, str]


class ToolPauses:
    """Learned pauses per (tenant, tool name), and each session's last turn end."""

    def __init__(self, *, max_tools: int = 512, max_sessions: int = 20_000,
                 gain: float = 0.25, max_pause_s: float = 86_400.0) -> None:
        if max_tools < 1 or max_sessions < 1 or not 0 < gain <= 1 or max_pause_s <= 0:
            raise ValueError("need positive bounds and 0 < gain <= 1")
        self.max_tools, self.max_sessions = max_tools, max_sessions
        self.gain, self.max_pause_s = gain, max_pause_s
        self._tools: OrderedDict[ToolKey, PauseStats] = OrderedDict()
        #: (tenant, session) -> how its last turn ended (the next turn learns from it).
        self._ends: OrderedDict[tuple[str, str], TurnEnd] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tools)

    def ended(self, tenant: str, session: str, end: TurnEnd) -> None:
        """A turn of `session` ended as `end` (its handle records the same)."""
        key = (tenant, session)
        self._ends.pop(key, None)
        self._ends[key] = end
        while len(self._ends) > self.max_sessions:
            self._ends.popitem(last=False)

    def resumed(self, tenant: str, session: str, at: float,
                end: TurnEnd | None = None) -> float | None:
        """The session's next turn arrived at `at`: if its last turn ended on tool calls
        (as recorded here, else as `end`, the claimed handle's, says: another replica
        may have served it), learn the pause for each tool it called. Returns the pause
        learned (None: nothing to learn)."""
        last = self._ends.pop((tenant, session), None) or end
        if last is None or last.kind != "tool_call" or not last.tools:
            return None
        pause = at - last.at
        if not 0 <= pause <= self.max_pause_s:  # clocks apart, or a session left for days
            return None
        for tool in last.tools:  # parallel calls: each waited for the slowest
            self._observe((tenant, tool), pause)
        return pause

    def _observe(self, key: ToolKey, pause: float) -> None:
        old = self._tools.pop(key, None)
        if old is None:
            stats = PauseStats(mean_s=pause, dev_s=pause / 2, samples=1)
        else:
            g = self.gain
            stats = PauseStats(mean_s=old.mean_s + g * (pause - old.mean_s),
                               dev_s=old.dev_s + g * (abs(pause - old.mean_s) - old.dev_s),
                               samples=old.samples + 1)
        self._tools[key] = stats
        while len(self._tools) > self.max_tools:
            self._tools.popitem(last=False)

    def get(self, tenant: str, tool: str) -> PauseStats | None:
        return self._tools.get((tenant, tool))

    def view(self) -> Mapping[ToolKey, PauseStats]:
        """A copy for a policy to decide on (plain facts: later learning does not move it)."""
        return dict(self._tools)
