"""Tier scoring: what a prompt's prefill would cost on a node, given where its KV lives.

Pure functions over per-node, per-tier prefix hits (from KV events, see `kv.index`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TierName = Literal["gpu", "cpu", "disk"]


class NodeTiers(BaseModel):
    """The KV tiers one node's bundle gave it, as the router is told (the bundle writes
    them into `router.engine.kv_tiers` by node URL): where a decode node's blocks go when
    the router gives its retained copy up (docs/tiers.md, "How the router uses it")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: bool = Field(default=False, description="A host-memory (`cpu`) tier.")
    disk: bool = Field(default=False, description="A disk tier.")
    shared: bool = Field(default=False, description="The disk tier is one directory every "
                         "tiered node reads (`kv_tiers.disk.shared`).")
    chunk_tokens: int = Field(default=16, ge=1, description="The offload chunk in tokens "
                              "(`kv_tiers.min_prefix_tokens`): only whole chunks are stored.")
    prompt_only: bool = Field(default=True, description="Only prompt blocks are stored "
                              "(`kv_tiers.offload_prompt_only`), not generated ones.")

    @property
    def holds(self) -> bool:
        """A given-up copy lands somewhere: the node has a tier."""
        return self.host or self.disk


@dataclass(frozen=True)
class TierCosts:
    """Seconds per token to bring KV from each tier into GPU memory, and to recompute it.

    Defaults are order-of-magnitude placeholders for a ~8B model (128 KiB KV per token):
    measure them (tools/gpu) and pass real ones.
    """

    recompute_s_per_token: float = 1.0e-4
    gpu_s_per_token: float = 0.0
    cpu_s_per_token: float = 5.0e-6
    disk_s_per_token: float = 4.0e-5
    queue_s_per_request: float = 0.05

    def for_tier(self, tier: TierName) -> float:
        return {"gpu": self.gpu_s_per_token, "cpu": self.cpu_s_per_token,
                "disk": self.disk_s_per_token}[tier]


@dataclass(frozen=True)
class NodeTierHits:
    """One node's view of a prompt: the longest prefix (tokens) each tier holds, and load.

    From KV events (`BlockStored.medium`: GPU, CPU, STORAGE) matched against the prompt's
    block hashes, or from a lookup; `in_flight` counts requests queued or running there.
    """

    node: str
    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    in_flight: int = 0


@dataclass(frozen=True)
class TierScore:
    """Estimated prefill cost of a prompt on one node (lower is better)."""

    node: str
    est_s: float
    tokens: dict[str, int]  # served per tier, plus "recompute"
    saved_s: float  # versus recomputing everything on an idle node


_TIER_ORDER: tuple[TierName, ...] = ("gpu", "cpu", "disk")


def tier_score(hits: NodeTierHits, *, prompt_tokens: int, costs: TierCosts = TierCosts(),
               block_size: int = 1) -> TierScore:
    """Cost of prefilling `prompt_tokens` on a node with these per-tier prefix hits.

    Prefixes chain, so a slower tier only helps past the faster tiers' reach: tokens from
    tier t = reach(t) - max(reach of faster tiers), block-aligned. vLLM always computes the
    last prompt token, so at most `prompt_tokens - 1` are served from cache. A tier slower
    than recomputing is skipped (its tokens are recomputed).
    """
    if prompt_tokens < 0 or block_size < 1:
        raise ValueError("prompt_tokens must be >= 0 and block_size >= 1")
    cap = max(prompt_tokens - 1, 0)
    served: dict[str, int] = {}
    covered = 0
    est = 0.0
    for tier in _TIER_ORDER:
        reach = min(getattr(hits, tier), cap)
        reach -= reach % block_size
        extra = max(reach - covered, 0)
        per_token = costs.for_tier(tier)
        if extra and per_token < costs.recompute_s_per_token:
            served[tier] = extra
            est += extra * per_token
            covered = reach
        else:
            served[tier] = 0
    served["recompute"] = prompt_tokens - covered
    est += served["recompute"] * costs.recompute_s_per_token
    est += max(hits.in_flight, 0) * costs.queue_s_per_request
    baseline = prompt_tokens * costs.recompute_s_per_token
    return TierScore(node=hits.node, est_s=est, tokens=served, saved_s=baseline - est)


def rank_nodes(nodes: Sequence[NodeTierHits], *, prompt_tokens: int,
               costs: TierCosts = TierCosts(), block_size: int = 1) -> list[TierScore]:
    """Nodes ordered best first (lowest estimated cost; ties keep the given order)."""
    scores = [tier_score(n, prompt_tokens=prompt_tokens, costs=costs, block_size=block_size)
              for n in nodes]
    return sorted(scores, key=lambda s: s.est_s)
