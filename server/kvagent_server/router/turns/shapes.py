"""The data of one turn, one shape per stage (docs/architecture.md, "One turn").

    TurnRequest --gather--> TurnFacts --decide--> TurnPlan --execute--> Turn
        --relay--> Capture --settle--> Final

Decide may instead answer `NEED_PROMPT_IDS` (the plan depends on token ids the facts do
not hold yet): the pipeline then gathers them (`gather.with_prompt_ids`) and decides
again, so the line never runs backwards into a stage that called ahead.

Each stage is a module of `turns` that reads the shape before it and builds the next one;
no stage module imports another (`tests/test_import_graph.py`), so none can call back
into a stage already left. `turns.pipeline` strings them together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvagent_server.router.auth.tenancy import Tenant
from kvagent_server.router.common import fastjson
from kvagent_server.router.kv.tiers import NodeTierHits, TierCosts
from kvagent_server.router.nodes.ledger import LegLedger
from kvagent_server.router.nodes.legs import DecodeStart, PrefillResult
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import identity, planner, transfer
from kvagent_server.router.reuse.learned import LearnedView
from kvagent_server.router.reuse.paths import Path, PathCosts
from kvagent_server.router.reuse.placement import DecodeReason, NodeState, PrefillReason
from kvagent_server.router.reuse.queue import NodeWork
from kvagent_server.router.reuse.spill import Source, Spilled, TierReuse
from kvagent_server.router.store.handle import Handle, KVIdentity
from kvagent_server.router.telemetry.budget import TurnBudget

# ------------------------------------------------------------------ the request


@dataclass(frozen=True)
class TurnRequest:
    """A client's turn as the router forwards it: the body is read-only and built once
    (cleaned of the client's transfer fields, the tenant's `cache_salt` set); every leg
    builds its own copy from it."""

    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    body: Mapping[str, Any]
    tenant: Tenant
    #: The conversation as the store knows it (scoped to the caller's key), or None.
    session: str | None
    token: str | None
    #: What named the conversation (`http.conversation.Source`); None: nothing did, and
    #: with `content_reuse` the router finds it by the prompt's tokens (`reuse.content`).
    source: str | None = None
    #: Test-only: shift the pulled blocks (settings.test_shift_blocks_header).
    shift_blocks: bool = False
    span: Any = None  # the turn's OpenTelemetry span (parent of the leg spans)
    budget: TurnBudget = field(default_factory=TurnBudget)  # time per stage
    #: The body's JSON size in bytes (what a prompt the router does not tokenize is
    #: estimated from), measured once.
    body_chars: int = 0

    @classmethod
    def build(cls, *, endpoint: str, body: dict[str, Any], **kwargs: Any) -> TurnRequest:
        """Freeze `body` (the caller gives it up) and measure it once."""
        return cls(endpoint=endpoint, body=MappingProxyType(body),
                   body_chars=len(fastjson.dumps(body)), **kwargs)

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("chat/completions")

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def splittable(self) -> bool:
        """One sequence from one prompt: what a P/D transfer (one handle per request)
        serves. Several samples (`n`, `best_of`) or a batch of prompts go to one node
        whole (`decode_only`)."""
        body = self.body
        prompt = body.get("prompt")
        batch = (isinstance(prompt, list) and len(prompt) > 1
                 and not all(isinstance(t, int) for t in prompt))
        return (body.get("n") or 1) == 1 and (body.get("best_of") or 1) == 1 and not batch

    def dict_body(self) -> dict[str, Any]:
        """A shallow copy to build a leg's body from."""
        return dict(self.body)


# ------------------------------------------------------------------ gather's facts


@dataclass(frozen=True)
class NodeFacts:
    """One node as gather saw it: the node (for execute) and what placement weighs."""

    node: Node
    state: NodeState
    #: Work in flight there (None: not counted, the policy does not read it).
    work: NodeWork | None = None
    #: The share of its KV cache in use at the retention guard's last read (decode).
    kv_usage: float | None = None
    #: Its KV block size (the router's setting, else the node's own; None: unknown).
    block_size: int | None = None


@dataclass(frozen=True)
class TierFacts:
    """Where the prompt's prefix is cached on each P node, by tier (its KV events): what
    tier-aware P placement weighs against load (`placement.pick_prefill_by_tiers`)."""

    hits: Mapping[str, NodeTierHits]
    block_size: int
    prompt_tokens: int
    costs: TierCosts = field(default_factory=TierCosts)


@dataclass(frozen=True)
class TurnFacts:
    """Everything a path policy decides on, gathered before any leg runs.

    `gather` is the only stage that awaits the store or a node's `/tokenize`; the nodes
    are referenced for `execute`, their state at gathering time is copied here
    (`candidates`), and so is what earlier turns taught (`costs`, `learned`). Which P and
    D nodes serve the turn is decide's first choice (`policy.place`): it fills the
    placed fields below (`p_first` ... `prefill_block_size`) from the candidates, the
    session's `affinity` and the prompt's `tiers`; facts built without candidates (a
    test's, a simulator's) come placed."""

    req: TurnRequest
    #: The conversation after a content lookup named it (else `req.session`).
    session: str | None
    source: str | None
    #: The claimed handle and, without one, why the presented token was refused.
    handle: Handle | None = None
    rejected: str | None = None
    #: The handle's decode node as registered (None: unknown) and its state.
    handle_node_healthy: bool = False
    handle_node_epoch: str | None = None
    #: The decode node holding the handle's blocks, if alive, current and unexpired.
    holder: Node | None = None
    #: Every node, as gather saw it (empty: the facts come placed).
    candidates: tuple[NodeFacts, ...] = ()
    #: The decode node holding the session's blocks (its handle's, or its latest).
    affinity: str | None = None
    #: Where P nodes cache the prompt's prefix (None: not looked up).
    tiers: TierFacts | None = None
    #: Without a handle, the session's conversation spilled to a decode node's KV tiers
    #: (`reuse.spill`; None: none recorded). `identity` is then checked against it.
    spilled: Spilled | None = None
    #: Work in flight is counted (`PathPolicy.counts_work`): a missing node's is idle.
    counts_work: bool = False
    #: Why `p_first` and `d_first` were placed there (None: not placed by decide).
    p_reason: PrefillReason | None = None
    d_reason: DecodeReason | None = None
    p_first: Node | None = None
    d_first: Node | None = None
    #: `d_first` is the holder (and so healthy).
    d_holds: bool = False
    #: `d_first` is healthy.
    d_healthy: bool = False
    #: The share of `d_first`'s KV cache in use at the last read (None: not known).
    d_kv_usage: float | None = None
    #: P block size, when the router knows it (settings or the node).
    prefill_block_size: int | None = None
    costs: PathCosts = field(default_factory=PathCosts)
    #: The other learned figures (token ratios, the `/tokenize` round trip, ...).
    learned: LearnedView = field(default_factory=LearnedView)
    #: Work in flight on `p_first` and `d_first` (None: not counted).
    p_work: NodeWork | None = None
    d_work: NodeWork | None = None
    #: The prompt's KV identity (positions filled in once tokenized) and its check
    #: against the handle's (None: no handle).
    new_identity: KVIdentity | None = None
    identity: identity.IdentityCheck | None = None
    #: The prompt's token ids as a node tokenized them (empty: not tokenized).
    prompt_ids: tuple[int, ...] = ()
    tokenize_failed: bool = False
    #: Gather has done what it can for `prompt_ids` (tokenized, failed, or had them):
    #: decide never asks for them again.
    ids_gathered: bool = False
    #: A node can tokenize the prompt, should decide ask for its ids.
    tokenizable: bool = False
    #: The prompt tokens a first turn is estimated at from its body's size.
    est_tokens: int = 0
    now: float = field(default_factory=time.time)

    @property
    def ids_matter(self) -> bool:
        """Whether the prompt's token ids can change the reuse: a handle held on a live,
        current node, and no identity refusal that positions cannot lift (model, salt,
        an unverifiable field)."""
        ident = self.identity
        final = ident is not None and ident.cap == 0 and ident.detail != "media_url" and (
            ident.reason != "multimodal_changed")
        return (self.holder is not None or self.spilled is not None) and not final


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class NeedPromptIds:
    """Decide's answer when its plan depends on the prompt's token ids and the facts do
    not hold them yet: gather them (`gather.with_prompt_ids`) and decide again."""


NEED_PROMPT_IDS = NeedPromptIds()


@dataclass(frozen=True)
class LegChoices:
    """How decide chose to build the legs' transfer params (`TurnPlan.prefill_params`,
    `TurnPlan.decode_params`) and what the D leg after a P leg takes from P's answer."""

    #: A claimed handle the turn does not reuse is freed by the turn's own leg (P tells
    #: D, or the `d_fresh` leg on its node), not left to the TTL.
    release_unused: bool = True
    #: Test-only negative control: P is handed D's blocks shifted (wrong KV on purpose).
    shift_blocks: bool = False
    #: D takes the prompt ids P computed (and P is asked for them), and P's first token.
    forward_prompt_ids: bool = False
    forward_first_token: bool = False
    #: A D leg must start reading P's blocks within this many seconds of P's answer
    #: (P's lease, less a margin).
    read_within_s: float = 25.0


@dataclass(frozen=True)
class TurnPlan:
    """What a path policy decided: the path, the reuse, the nodes to try first, and how
    each leg's transfer params are built (`legs`)."""

    path: Path
    reuse: planner.ReusePlan
    handle: Handle | None = None
    holder: Node | None = None
    p_first: Node | None = None
    d_first: Node | None = None
    #: Prompt tokens as tokenized, or as estimated for an untokenized extension (0: not
    #: known, a first turn).
    prompt_len: int = 0
    #: A first turn's tokens to compute, estimated from its body's size (0: not estimated).
    est_tokens: int = 0
    p_work: NodeWork | None = None
    d_work: NodeWork | None = None
    #: Why the P and D nodes were chosen (metrics; None: not placed by decide).
    p_reason: PrefillReason | None = None
    d_reason: DecodeReason | None = None
    #: Decode nodes a failed `d_fresh` or `d_direct` leg was sent to: tried last.
    d_failed: tuple[str, ...] = ()
    legs: LegChoices = field(default_factory=LegChoices)
    #: A spilled prefix the serving node loads from a KV tier (`reuse.spill`), and from
    #: which (`tier_host`: `d_direct` on the node holding it; `tier_disk`: the shared
    #: disk, or the holding node's own disk): None, no tier load was planned.
    tier: TierReuse | None = None
    tier_source: Source | None = None

    def prefill_params(self) -> dict[str, Any]:
        """The P leg's `kv_transfer_params`: pull the verified prefix from D
        (`pd_reuse`), tell D to free a claimed handle it does not reuse, or fresh."""
        handle = self.handle
        if self.path == "pd_reuse":
            assert handle is not None
            params = transfer.reuse_transfer_params(handle, self.reuse.reuse_tokens)
            return transfer.shifted_blocks(params) if self.legs.shift_blocks else params
        if handle is not None and self.holder is not None and self.legs.release_unused:
            return transfer.release_transfer_params(handle)
        return transfer.fresh()

    def decode_params(self, node: Node | None) -> dict[str, Any]:
        """The `kv_transfer_params` of a leg whose prompt the decode node `node` computes
        (`d_direct`, `d_fresh`, `d_pull`): D keeps the finished sequence, and frees the
        handle the turn supersedes (`d_direct`) or claimed and does not reuse, when it is
        there; on `d_pull` it first pulls the verified prefix from the holder, which frees
        it once read."""
        if self.path == "d_pull":
            assert self.handle is not None
            params = transfer.pull_and_retain_params(self.handle, self.reuse.reuse_tokens)
            return transfer.shifted_blocks(params) if self.legs.shift_blocks else params
        rid = _request_id(self.handle) if self.handle is not None else None
        if self.path == "d_direct" or (
                node is not None and node is self.holder and self.legs.release_unused):
            return transfer.with_release(transfer.d_direct(), [rid] if rid else [])
        return transfer.d_direct()

    def after_decode_failure(self, tried: tuple[str, ...]) -> TurnPlan:
        """The plan once a `d_fresh`, `d_direct` or `d_pull` leg failed before its first
        byte: P computes the prompt (`pd_fresh`), or recomputes it (the handle's blocks
        are unreachable; after a `d_pull` the holder is kept, to be told to free them)."""
        if self.path == "d_fresh":
            return dataclasses.replace(self, path="pd_fresh", d_failed=tried)
        if self.path == "d_pull":
            return dataclasses.replace(
                self, path="recompute", d_first=None, d_failed=tried,
                reuse=planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.DECODE_FAILED))
        return dataclasses.replace(
            self, path="recompute", holder=None, d_first=None, d_failed=tried,
            reuse=planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.DECODE_FAILED),
            tier=None, tier_source=None)

    def without_room(self) -> TurnPlan:
        """The plan once the handle it would reuse or release was given up for another
        turn's room (`nodes.admission`): its blocks are gone (nothing to offer or free), and a
        reuse becomes a recompute."""
        if self.path not in ("pd_reuse", "d_direct", "d_pull"):
            return dataclasses.replace(self, holder=None)
        return dataclasses.replace(
            self, path="recompute", holder=None, tier=None, tier_source=None,
            reuse=planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.NO_ROOM))

    def recomputed(self, reason: planner.Reason, detail: str | None = None, *,
                   release: bool = False) -> TurnPlan:
        """The plan when its reuse cannot happen after all: P recomputes the prompt
        (`release`: and tells D to free the handle's blocks, whatever the setting)."""
        plan = dataclasses.replace(self, path="recompute", tier=None, tier_source=None,
                                   reuse=planner.ReusePlan(reuse_tokens=0, reason=reason,
                                                           detail=detail))
        if release:
            plan = dataclasses.replace(plan, legs=dataclasses.replace(plan.legs,
                                                                      release_unused=True))
        return plan


def _request_id(handle: Handle) -> str | None:
    """The decode node's id for the request whose blocks `handle` names."""
    rid = handle.kv_transfer_params.get(transfer.REMOTE_REQUEST_ID)
    return rid if isinstance(rid, str) and rid else None


# ------------------------------------------------------------------ the open turn


@dataclass
class Turn:
    """An executed turn whose decode leg is open, until its answer is relayed."""

    #: The router's ledger of legs in flight, where the D leg is (`leg`).
    ledger: LegLedger
    facts: TurnFacts
    #: The plan as executed (after any fallback: `path` is what served the turn).
    plan: TurnPlan
    prefill: PrefillResult | None
    decode: DecodeStart
    started: float
    first_byte_at: float | None = None
    #: Tokens of work ahead on the node that computed the prompt when the turn was sent
    #: (what `CostModel.observe` learns the TTFT against; 0 without queue-aware costs).
    ahead: float = 0.0
    #: The D leg's ticket in the ledger: the turn owns it and closes it (`end_leg`).
    leg: int | None = None
    #: The body bytes the P leg's prompt tokens were estimated from (0: tokenized, or
    #: not counted): settle learns the ratio from P's answer.
    p_chars: int = 0

    @property
    def req(self) -> TurnRequest:
        return self.facts.req

    @property
    def path(self) -> Path:
        return self.plan.path

    def mark_first_byte(self) -> float:
        """The client's first byte: D's prompt work is done, it decodes from now on."""
        self.first_byte_at = time.perf_counter()
        if self.leg is not None:  # its prompt is computed, its blocks allocated
            self.ledger.first_token(self.leg, time.monotonic())
        return self.first_byte_at

    def end_leg(self) -> None:
        """The D leg is over (idempotent): it leaves the ledger (room promised to it that
        it never allocated is free again)."""
        if self.leg is not None:
            self.ledger.close(self.leg, time.monotonic())
            self.leg = None

    async def close(self) -> None:
        """Idempotent: the D leg is over; closing D's response aborts its request if it
        is still running (a client gone, a cut stream)."""
        self.end_leg()
        await self.decode.response.aclose()


# ------------------------------------------------------------------ relay and settle


@dataclass
class Capture:
    """What the router learned from D's answer (choice 0 only: reuse needs n == 1)."""

    kv_params: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    #: The tools choice 0 called, in order (`relay`).
    tool_names: list[str] = field(default_factory=list)
    choices: set[int] = field(default_factory=set)
    template: dict[str, Any] = field(default_factory=dict)  # id/object/created/model

    @property
    def sequence(self) -> list[int] | None:
        """Prompt plus generated ids: the tokens whose KV D retained (None if unknown)."""
        if self.prompt_token_ids is None or len(self.choices) > 1:
            return None
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass(frozen=True)
class Final:
    """What settling the turn adds to its last chunk (or the non-streamed response)."""

    kvagent: dict[str, Any]
    cached_tokens: int | None

    @property
    def reused(self) -> int:
        return int(self.kvagent.get("reused_tokens") or 0)
