"""Decide which retained turns a decode node drops when it needs room. Pure.

A decode node keeps each finished turn's KV for the session's next turn. When it must
free blocks (its usage past the retention guard's high watermark, or a turn waiting for
room: `nodes.retention`, `nodes.admission`), a retention policy ranks the node's retained
handles, and the first ones covering the blocks needed are evicted from the store and
released. Policies are registered by name with their own parameters model;
`router.retention.policy` names one and gives its parameters:

- `expected_return` (the default) keeps what is expected back soonest. A session whose
  turn ended on a final answer may be over: those go first, the longest idle first.
  Then sessions overdue well past their tool's expected pause (the agent is gone); then
  turns that ended otherwise (cut by `max_tokens`, a completions prompt, a handle that
  records no end: no sign either way), the longest idle first; then sessions waiting
  on tools by how far away their expected return is, furthest first. The pause is
  learned per tool name (`reuse.pauses`), with a prior for a tool not seen yet. A
  session whose tool is expected back within `keep_soon_s` is not dropped to tidy up
  (the watermark), only, last of all, for a turn that waits for room now.
- `oldest_first`: the longest idle first (least recently stored), blind to how turns
  ended: what the router did before it knew, kept to compare against.

A policy only ranks; the store's eviction is the claim that makes dropping safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvagent_server.router.reuse.pauses import PauseStats, ToolKey
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.handle import Retained

#: The retention policy a router runs unless `router.retention.policy` names another.
DEFAULT = "expected_return"


@dataclasses.dataclass(frozen=True)
class RetentionFacts:
    """What a retention policy decides on: plain data, no I/O."""

    #: The node's live retained handles.
    handles: Sequence[Retained]
    #: Blocks to free (negative: the node's size is unknown, take `max_handles`).
    need_blocks: int
    max_handles: int
    now: float
    #: Learned tool pauses per (tenant, tool name).
    pauses: Mapping[ToolKey, PauseStats] = dataclasses.field(default_factory=dict)
    #: A turn is waiting for this room now (the decode gate), not a watermark's tidy-up.
    for_waiting_turn: bool = False


class RetentionPolicy(Protocol):
    @property
    def name(self) -> str:
        """What `router.retention.policy.name` calls it."""
        ...

    def choose(self, facts: RetentionFacts) -> list[Retained]:
        """The handles to drop, first first (pure)."""
        ...


def take(ranked: Sequence[Retained], need_blocks: int, max_handles: int) -> list[Retained]:
    """The first of `ranked` until they hold `need_blocks` blocks (any number when
    negative), at most `max_handles`."""
    out: list[Retained] = []
    freed = 0
    for handle in ranked:
        if len(out) >= max_handles or (need_blocks >= 0 and freed >= need_blocks):
            break
        out.append(handle)
        freed += handle.blocks
    return out


def _ended_at(handle: Retained) -> float:
    return handle.end.at if handle.end is not None else handle.created_at


class NoParams(BaseModel):
    """A policy without parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclasses.dataclass(frozen=True)
class OldestFirst:
    """The least recently stored handles first (module docstring)."""

    name: str = "oldest_first"

    def choose(self, facts: RetentionFacts) -> list[Retained]:
        ranked = sorted(facts.handles, key=lambda h: (h.created_at, h.key))
        return take(ranked, facts.need_blocks, facts.max_handles)


class ExpectedReturnParams(BaseModel):
    """`expected_return`'s parameters (`router.retention.policy.params`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unseen_tool_pause_s: float = Field(default=30.0, ge=0,
        description="The pause expected of a tool no turn has come back from yet.")
    keep_soon_s: float = Field(default=30.0, ge=0,
        description="A session expected back within this many seconds is not dropped by "
        "the watermark; a turn waiting for room takes it last. At least "
        "`unseen_tool_pause_s` keeps a session that just called a tool not seen yet (the "
        "watermark counts running requests too, and would otherwise drop it for a turn "
        "that is only decoding).")
    overdue_devs: float = Field(default=4.0, ge=0,
        description="A session counts as gone once this many mean deviations of its tool's "
        "pause, plus `overdue_grace_s`, have passed beyond its expected return.")
    overdue_grace_s: float = Field(default=30.0, ge=0,
        description="See `overdue_devs`.")


#: `ExpectedReturn.rank`'s classes, dropped in this order.
FINAL, GONE, UNKNOWN, AWAY, SOON = range(5)


@dataclasses.dataclass(frozen=True)
class ExpectedReturn:
    """Final answers first, then sessions gone past their tools' pauses, then turns that
    ended otherwise (the longest idle first), then the furthest expected return; the
    soonest back are kept (module docstring)."""

    params: ExpectedReturnParams = dataclasses.field(default_factory=ExpectedReturnParams)
    name: str = "expected_return"

    def expected_pause(self, tools: Sequence[str], tenant: str,
                       pauses: Mapping[ToolKey, PauseStats]) -> tuple[float, float]:
        """(mean, deviation) of the pause before the session's next turn: the slowest of
        the tools its turn called (they come back together), a prior for one unseen."""
        prior = self.params.unseen_tool_pause_s
        known = [pauses.get((tenant, tool)) for tool in tools] or [None]
        mean = max(s.mean_s if s is not None else prior for s in known)
        dev = max(s.dev_s if s is not None else prior / 2 for s in known)
        return mean, dev

    def rank(self, facts: RetentionFacts) -> list[tuple[tuple[int, float], Retained]]:
        """Every handle with its drop rank (lower goes first), in that order."""
        p, now = self.params, facts.now
        ranked: list[tuple[tuple[int, float], Retained]] = []
        for handle in facts.handles:
            end = handle.end
            ended = _ended_at(handle)
            if end is not None and end.kind == "final":
                rank = (FINAL, ended)  # the longest idle first
            elif end is None or end.kind != "tool_call":
                # Cut short, or not recorded: no sign either way, so by age, as before
                # the router knew how turns end; after those that called a tool.
                rank = (UNKNOWN, ended)
            else:
                mean, dev = self.expected_pause(end.tools, handle.tenant, facts.pauses)
                back_in = ended + mean - now  # negative: due already
                overdue = -back_in - p.overdue_devs * dev - p.overdue_grace_s
                if overdue > 0:
                    rank = (GONE, -overdue)  # the longest gone first
                elif back_in > p.keep_soon_s:
                    rank = (AWAY, -back_in)  # the furthest away first
                else:
                    rank = (SOON, -back_in)
            ranked.append((rank, handle))
        ranked.sort(key=lambda item: (item[0], item[1].created_at, item[1].key))
        return ranked

    def choose(self, facts: RetentionFacts) -> list[Retained]:
        ranked = [h for rank, h in self.rank(facts)
                  if rank[0] != SOON or facts.for_waiting_turn]
        return take(ranked, facts.need_blocks, facts.max_handles)


@dataclasses.dataclass(frozen=True)
class Registered:
    """A policy by name: its parameters model and how it is built from them."""

    params: type[BaseModel]
    build: Callable[[Any], RetentionPolicy]


RETENTION_POLICIES: dict[str, Registered] = {
    "expected_return": Registered(ExpectedReturnParams, lambda p: ExpectedReturn(p)),
    "oldest_first": Registered(NoParams, lambda p: OldestFirst()),
}


def register(name: str, params: type[BaseModel],
             build: Callable[[Any], RetentionPolicy]) -> None:
    """Add a retention policy under `name` (a plugin's, an experiment's)."""
    if name in RETENTION_POLICIES:
        raise ValueError(f"a retention policy named {name!r} is already registered")
    RETENTION_POLICIES[name] = Registered(params, build)


def retention_policy_for(settings: RouterSettings) -> RetentionPolicy:
    """The policy `router.retention.policy` names, built with its parameters; a
    ValueError names what is wrong with them."""
    chosen = settings.retention.policy
    try:
        registered = RETENTION_POLICIES[chosen.name]
    except KeyError:
        raise ValueError(f"unknown router.retention.policy.name {chosen.name!r}; known: "
                         f"{', '.join(sorted(RETENTION_POLICIES))}") from None
    try:
        params = registered.params.model_validate(chosen.params)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'params'}: {e['msg']}"
                             for e in exc.errors())
        raise ValueError(f"router.retention.policy.params for {chosen.name!r}: "
                         f"{problems}") from None
    return registered.build(params)
