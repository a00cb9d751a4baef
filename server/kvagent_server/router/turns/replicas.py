"""Decide on symmetric nodes (the `replicas` topology): which node serves a session's
turn, and whether the session's KV follows it there. Pure; the `replicas` path policy
(`turns.policy.ReplicasPolicy`) calls it.

Every node computes prompts, decodes and keeps a finished turn's blocks for the next. A
session stays on the node holding its KV (`d_direct` there) unless that node is
unhealthy, saturated or overloaded (`placement.pick_decode`), or busy: the wait for the
work queued on it exceeds `move_cost_ratio` times the wait on the least busy other node
plus pulling the session's KV over. A session that moves takes its verified prefix along
(`d_pull`: the new node pulls it from the holder over NIXL, as a P node pulls from D,
then computes the rest, decodes and keeps the whole), or, with `pull_on_move` off, the
new node computes the prompt and the holder releases its blocks (`d_fresh`, reason
`moved`). A first turn goes to the least loaded node.
"""

from __future__ import annotations

import dataclasses

from kvagent_server.router.reuse import paths, placement, planner
from kvagent_server.router.reuse.paths import PathCosts
from kvagent_server.router.reuse.placement import DecodeReason
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from kvagent_server.router.turns.policy_params import ReplicasParams
from kvagent_server.router.turns.shapes import NodeFacts, TurnFacts


def wait_s(costs: PathCosts, work: NodeWork | None, tokens: int) -> float:
    """Seconds until `tokens` of a new prompt are computed behind `work` on a node: the
    learned `d_direct` line over the work queued there and the turn's own tokens."""
    return costs.d_direct(paths.tokens_ahead("d_direct", work or IDLE) + tokens)


def busy_move(holder: NodeFacts, others: list[NodeFacts], costs: PathCosts, *,
              held_tokens: int, delta: int, ratio: float) -> NodeFacts | None:
    """The node a turn should move to because its holder is busy, or None (it stays).

    The holder's wait for the delta against, on each healthy, unsaturated other node, the
    wait for the delta plus pulling `held_tokens` of KV over: the turn moves to the
    cheapest other node when the holder's wait is more than `ratio` times that. Equal
    estimates go to the least loaded node, then by name (every replica picks the same)."""
    pool = [o for o in others if o.state.healthy and not o.state.saturated]
    if not pool:
        return None
    best = min(pool, key=lambda o: (wait_s(costs, o.work, delta), o.state.load,
                                    o.state.in_flight, o.node.name))
    there = wait_s(costs, best.work, delta) + costs.pull(held_tokens)
    return best if wait_s(costs, holder.work, delta) > ratio * there else None


def pick(facts: TurnFacts, params: ReplicasParams) -> tuple[NodeFacts | None, DecodeReason]:
    """The node for this turn and why: `pick_decode`'s choice (the session's node unless
    unhealthy, saturated or overloaded; else, or for a new session, the least loaded),
    then, while it stays on its node, the move of a busy holder (`busy_move`)."""
    nodes = [c for c in facts.candidates if c.state.role == "decode"]
    picked, reason = placement.pick_decode([c.state for c in nodes], affinity=facts.affinity)
    chosen = next((c for c in nodes if picked is not None
                   and c.node.name == picked.node_id), None)
    handle = facts.handle
    if (chosen is None or reason != "affinity" or params.move_cost_ratio is None
            or facts.holder is None or chosen.node is not facts.holder or handle is None):
        return chosen, reason
    held = len(handle.token_ids)
    delta = max(0, len(facts.prompt_ids) - held)  # 0 until tokenized: the same on both
    moved = busy_move(chosen, [c for c in nodes if c is not chosen], facts.costs,
                      held_tokens=held, delta=delta, ratio=params.move_cost_ratio)
    return (moved, "affinity_busy") if moved is not None else (chosen, reason)


def place(facts: TurnFacts, params: ReplicasParams) -> TurnFacts:
    """decide's first choice on replicas: the one node that serves the turn (`pick`), in
    the placed fields of the facts (no P node). Facts without candidates come placed."""
    if not facts.candidates:
        return facts
    d, reason = pick(facts, params)
    idle = IDLE if facts.counts_work else None
    return dataclasses.replace(
        facts, p_first=None, d_first=d.node if d else None,
        d_holds=d is not None and d.node is facts.holder,
        d_healthy=d is not None and d.node.healthy,
        d_kv_usage=d.kv_usage if d is not None else None,
        p_work=None, d_work=d.work if d is not None and d.work is not None else idle,
        p_reason=None, d_reason=reason)


def moved(facts: TurnFacts, reuse: planner.ReusePlan,
          params: ReplicasParams) -> tuple[paths.Path, planner.ReusePlan]:
    """A verified reuse whose session moved off the (live) node holding it: the new node
    pulls the prefix (`d_pull`), or, with `pull_on_move` off or the holder unreachable,
    computes the prompt (`d_fresh`, reason `moved` with why it moved)."""
    holder = facts.holder
    if params.pull_on_move and holder is not None and holder.healthy:
        return "d_pull", reuse
    return "d_fresh", planner.ReusePlan(
        reuse_tokens=0, reason=planner.Reason.MOVED, detail=facts.d_reason,
        cached_tokens=reuse.cached_tokens)
