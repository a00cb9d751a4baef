"""Which node serves a leg: least loaded, with session affinity on decode.

Affinity matters on decode because the node holding a session's retained blocks can
extend them without a transfer (`d_direct`) and a reuse pull from it stays local to it.
It yields to health and to overload: a recompute is cheaper than a queue.

Prefill without a handle to reuse may still find the prompt's prefix cached on a P node
(in GPU memory or a lower tier, as its KV events tell): `pick_prefill_by_tiers` weighs
those hits against load with `tiers.rank_nodes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.common.types import Role
from kvagent_server.router.kv.tiers import NodeTierHits, TierCosts, rank_nodes

#: Why a P node was chosen: by load alone, by a tier hit, by load after the index found
#: no hit, or none healthy.
PrefillReason = Literal["least_loaded", "tier_hit", "tier_miss", "no_healthy_node"]
DecodeReason = Literal[
    "affinity", "least_loaded", "affinity_unknown", "affinity_unhealthy",
    "affinity_overloaded", "affinity_busy", "no_healthy_node",
]


class NodeState(BaseModel):
    """A node as the router sees it right now (from health checks and its own counters)."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    url: str
    role: Role
    healthy: bool
    in_flight: int = Field(ge=0)
    epoch: str
    max_in_flight: int = Field(ge=1)

    @property
    def load(self) -> float:
        return self.in_flight / self.max_in_flight

    @property
    def saturated(self) -> bool:
        return self.in_flight >= self.max_in_flight


def _least_loaded(nodes: Sequence[NodeState]) -> NodeState | None:
    healthy = [n for n in nodes if n.healthy]
    if not healthy:
        return None
    # Relative load first, then absolute, then id: the same inputs always pick the same
    # node, so tests and replicas agree.
    return min(healthy, key=lambda n: (n.load, n.in_flight, n.node_id))


def pick_prefill(nodes: Sequence[NodeState]) -> NodeState | None:
    """The least loaded healthy prefill node; None when there is none."""
    return _least_loaded([n for n in nodes if n.role == "prefill"])


def consult_tiers(nodes: Sequence[NodeState], *, indexed: bool) -> bool:
    """Whether matching a prompt against the KV index can change the P choice.

    Matching needs the prompt's token ids (a `/tokenize` call for a text prompt), so it
    is only worth it with a choice to make (two or more healthy P nodes) and something
    to find (`indexed`: some P node is known to hold blocks).
    """
    return indexed and sum(1 for n in nodes if n.role == "prefill" and n.healthy) >= 2


def pick_prefill_by_tiers(
    nodes: Sequence[NodeState],
    hits: Mapping[str, NodeTierHits],
    *,
    prompt_tokens: int,
    costs: TierCosts | None = None,
    block_size: int = 1,
) -> tuple[NodeState | None, PrefillReason]:
    """The P node where this prompt is cheapest to prefill, and why.

    `hits` holds each node's per-tier prefix reach (nodes missing from it hold none);
    load enters as `in_flight` queue cost. Saturated nodes are passed over unless all
    are. Equal estimates go to the least loaded node. Without any hit it is exactly
    `pick_prefill` (reason `tier_miss`).
    """
    healthy = [n for n in nodes if n.role == "prefill" and n.healthy]
    if not healthy:
        return None, "no_healthy_node"
    pool = [n for n in healthy if not n.saturated] or healthy
    pool.sort(key=lambda n: (n.load, n.in_flight, n.node_id))
    least = pool[0]
    candidates = [dataclasses.replace(hits.get(n.node_id) or NodeTierHits(node=n.node_id),
                                      node=n.node_id, in_flight=n.in_flight) for n in pool]
    best = rank_nodes(candidates, prompt_tokens=prompt_tokens, costs=costs or TierCosts(),
                      block_size=block_size)[0]
    if best.tokens["recompute"] >= prompt_tokens:
        return least, "tier_miss"
    return next(n for n in pool if n.node_id == best.node), "tier_hit"


def pick_decode(
    nodes: Sequence[NodeState],
    *,
    affinity: str | None,
    overload_factor: float = 4.0,
) -> tuple[NodeState | None, DecodeReason]:
    """The decode node for a turn and why.

    `affinity` is the node id (or URL) holding the session's blocks. It is kept unless
    unhealthy, saturated (`in_flight >= max_in_flight`), or carrying more than
    `overload_factor` times the load of the least loaded node (counted as in_flight + 1,
    so an idle alternative does not evict a node with one stream).
    """
    if overload_factor < 1:
        raise ValueError("overload_factor must be at least 1")
    decode = [n for n in nodes if n.role == "decode"]
    best = _least_loaded(decode)
    if best is None:
        return None, "no_healthy_node"
    if affinity is None:
        return best, "least_loaded"
    preferred = next((n for n in decode if affinity in (n.node_id, n.url)), None)
    if preferred is None:
        return best, "affinity_unknown"
    if not preferred.healthy:
        return best, "affinity_unhealthy"
    if preferred is best:
        return preferred, "affinity"
    overloaded = (preferred.saturated and not best.saturated) or (
        (preferred.in_flight + 1) / preferred.max_in_flight
        > overload_factor * (best.in_flight + 1) / best.max_in_flight
    )
    if overloaded:
        return best, "affinity_overloaded"
    return preferred, "affinity"
