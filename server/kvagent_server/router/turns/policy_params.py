"""What a path policy is and what it is built with: the `PathPolicy` protocol, each
built-in policy's parameters model (`router.policy.params`, checked at start-up), and the
router-wide settings every policy also reads (`Shared`). The policies themselves and
their registry are in `turns.policy`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.router.reuse import paths, planner
from kvagent_server.router.reuse.paths import FreshPolicy
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.turns.shapes import NeedPromptIds, TurnFacts, TurnPlan

#: What a policy answers: the plan, or that it needs the prompt's token ids first.
Decision = TurnPlan | NeedPromptIds


class PathPolicy(Protocol):
    @property
    def name(self) -> str:
        """What `router.policy.name` calls it."""
        ...

    @property
    def skips_tokenize(self) -> bool:
        """It may send an extension of the held turn's messages without `/tokenize`
        (settle then learns what that estimate needs)."""
        ...

    @property
    def counts_work(self) -> bool:
        """It reads the work in flight on each node (gather then counts it)."""
        ...

    def decide(self, facts: TurnFacts) -> Decision:
        """The turn's plan, or `NEED_PROMPT_IDS` (pure)."""
        ...

    def untokenized_path(self, facts: TurnFacts, plan: planner.ReusePlan,
                         deltas: tuple[int, int], tokenize_s: float) -> paths.Path | None:
        """The path of an extension whose uncached delta is only known to lie in
        `deltas`, if this policy would choose it for any delta there (the turn then
        skips `/tokenize`); None: tokenize to choose."""
        ...


class PolicyParams(BaseModel):
    """Every built-in path policy's parameters (`router.policy.params`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    skip_tokenize_extensions: bool = Field(default=True,
        description="A chat turn whose messages repeat the held turn's exactly (same "
        "rendering inputs) and add new ones takes its path without the router's "
        "`/tokenize` when the policy would choose it for any delta near the one its new "
        "messages' size suggests: the node matches the tokens itself. False: tokenize "
        "every reused turn.")


class CostModelParams(PolicyParams):
    """`cost_model`'s parameters (`router.policy.params`)."""

    skip_prefill_max_tokens: int | None = Field(default=None, ge=0,
        description="Skip the P leg when the uncached delta is at most this many tokens "
        "(0: never skip, None: decide from the learned costs).")
    queue_aware_paths: bool = Field(default=True,
        description="With `skip_prefill_max_tokens` None: price each path with the work in "
        "flight on its node (prompt tokens queued on P, D's queued deltas and decode "
        "streams) and the stall a `d_direct` delta puts on D's streams. False: each path's "
        "learned TTFT line alone, blind to the queues (docs/benchmarks.md runs 5 and 9-11).")
    d_direct_stall_max_ms: float | None = Field(default=55.0, gt=0,
        description="With `queue_aware_paths`: while streams decode on the D node, a turn "
        "whose prompt work D would compute for longer than this (its learned `d_direct` "
        "cost: a reused turn's delta, or a `d_fresh` prompt) goes to P instead, so no "
        "other turn's prefill stalls D's streams past this gap. None: the summed costs "
        "alone decide (docs/benchmarks.md runs 15, 17 and 18). The default is one step of "
        "D computing a prompt at its CPU cap of 128 tokens per step at the built-in "
        "models' longest context (16,384 tokens): a 7.8 ms decode step plus 128 x "
        "(20.2 us + 21.1 ns per token of context), ~55 ms (docs/router.md).")
    fresh_on_decode: FreshPolicy = Field(default="auto",
        description="Where a turn with nothing to reuse (a first turn) computes its "
        "prompt. `auto`, with `queue_aware_paths`: on the decode node itself (`d_fresh`) "
        "while work is queued on P and the costs say D, the stall on its streams "
        "included, answers sooner, or, with `decode_prompt_step_tokens`, while P computes "
        "other legs and D no prompt. `never`: P computes every such prompt (`pd_fresh`). "
        "`always`: D does. Not with `reuse` off, whose turns all stay P/D.")
    decode_prompt_step_tokens: int | None = Field(default=None, ge=1,
        description="The most tokens of a prompt a decode node computes per step while "
        "other requests share it (vLLM's --long-prefill-token-threshold on D; the bundle "
        "fills it in). Known, `fresh_on_decode: auto` also sends a first turn to D "
        "whenever P is computing other legs and D no prompt of its own (docs/benchmarks.md "
        "run 22). None: the costs and the stall cap decide.")


class ReplicasParams(PolicyParams):
    """`replicas`' parameters (`router.policy.params`): when a session leaves its node,
    and whether its KV follows it (`turns.replicas`)."""

    move_cost_ratio: float | None = Field(default=2.0, gt=1,
        description="A session's turn moves off the node holding its KV when the wait "
        "there (the learned `d_direct` line over the prompt work queued on it, one token "
        "per stream decoding) exceeds this many times the wait on the least busy other "
        "node plus pulling the session's KV over. None: only a node saturated "
        "(`router.nodes.max_in_flight`), unhealthy or overloaded (4x the least loaded "
        "node's legs) loses its sessions.")
    pull_on_move: bool = Field(default=True,
        description="A session that moves takes its KV along: the new node pulls the "
        "verified prefix from the node that held it (`d_pull`), computes the rest and "
        "keeps the whole for the next turn. False: the new node computes the prompt "
        "(`d_fresh`) and the old node's blocks are released.")


class ReuseParams(BaseModel):
    """How much may be reused: every policy's."""

    model_config = ConfigDict(frozen=True)

    #: Reuse off: every turn computes its prompt (the P/D-without-reuse baseline).
    reuse: bool = True
    #: Verified prefixes shorter than this many tokens are recomputed.
    threshold: int = 64
    #: An extension of the held turn's messages may skip `/tokenize` (`untokenized_plan`).
    skip_tokenize: bool = True

    @classmethod
    def of(cls, settings: RouterSettings, params: BaseModel | None = None) -> ReuseParams:
        """From the router's settings and the policy's `params` (a plugin's model without
        `skip_tokenize_extensions` keeps the default)."""
        return cls(reuse=settings.reuse, threshold=settings.nodes.kv_recompute_threshold,
                   skip_tokenize=getattr(params, "skip_tokenize_extensions", True))


class CostParams(BaseModel):
    """The cost model's knobs, as it uses them (built from `CostModelParams`)."""

    model_config = ConfigDict(frozen=True)

    skip_prefill_max_tokens: int | None = None
    #: Work in flight on each node is counted and priced (`queue_aware_paths`).
    queue_aware: bool = True
    d_stall_max_s: float | None = None
    #: At this share of D's KV cache in use (the retention guard's high watermark), D
    #: computes no prompt (None: no limit).
    d_kv_high: float | None = None
    fresh_on_decode: FreshPolicy = "auto"
    decode_prompt_step_tokens: int | None = None

    @classmethod
    def of(cls, params: CostModelParams, d_kv_high: float | None = None) -> CostParams:
        ms = params.d_direct_stall_max_ms
        return cls(skip_prefill_max_tokens=params.skip_prefill_max_tokens,
                   queue_aware=params.queue_aware_paths,
                   d_stall_max_s=None if ms is None else ms / 1000, d_kv_high=d_kv_high,
                   fresh_on_decode=params.fresh_on_decode,
                   decode_prompt_step_tokens=params.decode_prompt_step_tokens)


class LegParams(BaseModel):
    """How the legs' transfer params are built: every policy's (router-wide settings)."""

    model_config = ConfigDict(frozen=True)

    release_unused: bool = True
    forward_prompt_ids: bool = True
    forward_first_token: bool = True
    #: The largest node answer the router reads (P's answer carries the prompt's ids).
    max_upstream_body_bytes: int = 64 * 1024 * 1024
    #: P's lease on its blocks less the margin a D leg must start reading within.
    read_within_s: float = 25.0
    #: The test-only shifted-blocks header is honoured (`test_shift_blocks_header`).
    shift_blocks: bool = False

    @classmethod
    def of(cls, settings: RouterSettings) -> LegParams:
        return cls(release_unused=settings.retention.release_unused_handles,
                   forward_prompt_ids=settings.engine.forward_prompt_ids,
                   forward_first_token=settings.engine.forward_first_token,
                   max_upstream_body_bytes=settings.limits.max_upstream_body_bytes,
                   read_within_s=(settings.retention.prefill_lease_s
                                  - settings.retention.prefill_lease_margin_s),
                   shift_blocks=settings.test_shift_blocks_header)


@dataclasses.dataclass(frozen=True)
class Shared:
    """What every policy is built with besides its own parameters: router-wide settings
    (and `skip_tokenize_extensions`, every built-in policy's parameter)."""

    reuse: ReuseParams
    legs: LegParams
    #: The retention guard's high watermark: at this share of D's KV cache in use, D
    #: computes no prompt (None: no limit).
    d_kv_high: float | None = None

    @classmethod
    def of(cls, settings: RouterSettings, params: BaseModel | None = None) -> Shared:
        return cls(ReuseParams.of(settings, params), LegParams.of(settings),
                   settings.retention.high_watermark)


@dataclasses.dataclass(frozen=True)
class Registered:
    """A path policy by name: its parameters model and how it is built from them."""

    params: type[BaseModel]
    build: Callable[[Any, Shared], PathPolicy]

    def __call__(self, settings: RouterSettings,
                 params: Mapping[str, Any] | None = None) -> PathPolicy:
        """The policy for `settings` with `params` (a `ValidationError` names a bad one)."""
        checked = self.params.model_validate(dict(params or {}))
        return self.build(checked, Shared.of(settings, checked))
