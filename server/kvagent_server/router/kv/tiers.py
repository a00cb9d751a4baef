"""Tier scoring: what a prompt's prefill would cost on a node, given where its KV lives.

Pure functions over per-node, per-tier prefix hits (from KV events, see `kv.index`), and
the per-token load prices learned from the nodes' own counters (`TierCostLearner`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
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


# ------------------------------------------------------------------ measured load costs

_BY_SOURCE = re.compile(
    r'^vllm:prompt_tokens_cached_by_source(?:_total)?\{[^}]*\bsource="(\w+)"[^}]*\} (\S+)$',
    re.MULTILINE)
_LOAD_TIME = re.compile(r"^vllm:kv_offload_load_time(?:_total)?(?:\{[^}]*\})? (\S+)$",
                        re.MULTILINE)


@dataclass(frozen=True)
class TierLoads:
    """A node's cumulative tier-load counters, from its `/metrics`: prompt tokens served
    from its host tier and from disk (`vllm:prompt_tokens_cached_by_source`), and the
    seconds its offloading connector spent loading (`vllm:kv_offload_load_time`)."""

    host_tokens: float
    disk_tokens: float
    load_s: float


def parse_tier_loads(metrics_text: str) -> TierLoads | None:
    """The node's `TierLoads`, summed over its engines; None when it reports no load time
    (no offloading connector) or no per-source counts (an older vLLM)."""
    times = [float(v) for v in _LOAD_TIME.findall(metrics_text) if _finite(v)]
    by_source: dict[str, float] = {}
    for source, value in _BY_SOURCE.findall(metrics_text):
        if _finite(value):
            by_source[source] = by_source.get(source, 0.0) + float(value)
    if not times or not by_source:
        return None
    return TierLoads(host_tokens=by_source.get("host", 0.0),
                     disk_tokens=by_source.get("disk", 0.0), load_s=sum(times))


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


class TierCostLearner:
    """Per-token host and disk load costs learned from the nodes' counters (pure).

    Between two reads of one node, the load seconds that grew are divided by the tokens
    served from the tiers meanwhile: an interval with host tokens only teaches the host
    price, one with disk tokens only the disk price, a mixed one the disk price after the
    host part at the host price learned so far (a disk chunk is promoted through the host
    tier). Counters that go back (a restart) start the node over; intervals with fewer
    than `min_tokens` tier tokens teach nothing. Until a price is learned, `prior`'s."""

    def __init__(self, prior: TierCosts | None = None, *, alpha: float = 0.2,
                 min_tokens: float = 64) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.prior = prior or TierCosts()
        self.alpha, self.min_tokens = alpha, min_tokens
        self._last: dict[str, TierLoads] = {}
        self.cpu_s_per_token: float | None = None
        self.disk_s_per_token: float | None = None

    def observe(self, node: str, loads: TierLoads) -> None:
        prev, self._last[node] = self._last.get(node), loads
        if prev is None:
            return
        host = loads.host_tokens - prev.host_tokens
        disk = loads.disk_tokens - prev.disk_tokens
        took = loads.load_s - prev.load_s
        if min(host, disk, took) < 0 or host + disk < self.min_tokens:
            return
        if disk == 0:
            self.cpu_s_per_token = self._mean(self.cpu_s_per_token, took / host)
        elif host == 0:
            self.disk_s_per_token = self._mean(self.disk_s_per_token, took / disk)
        elif self.cpu_s_per_token is not None:
            rest = took - host * self.cpu_s_per_token
            if rest > 0:
                self.disk_s_per_token = self._mean(self.disk_s_per_token, rest / disk)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def costs(self) -> TierCosts:
        """`prior` with the prices learned so far."""
        return replace(
            self.prior,
            cpu_s_per_token=(self.prior.cpu_s_per_token if self.cpu_s_per_token is None
                             else self.cpu_s_per_token),
            disk_s_per_token=(self.prior.disk_s_per_token if self.disk_s_per_token is None
                              else self.disk_s_per_token))
