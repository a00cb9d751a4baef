"""Decide: a turn's path from its facts, by a path policy chosen by name. Pure.

A policy turns `TurnFacts` into a `TurnPlan`: the path, the reuse, the nodes to try
first and how each leg's transfer params are built (`TurnPlan.legs`); it never awaits and
never touches the router's state, so each is tested on plain data. Policies are
registered by name with a parameters model of their own (`register`;
`turns.policy_params` holds the models and the protocol); `router.policy` names one and
gives its `params`, so a benchmark arm or an operator names a policy instead of flipping
switches:

- `cost_model` (the default): the learned per-path costs and the work in flight on
  each node choose between `pd_reuse` and `d_direct`, and between `pd_fresh` and
  `d_fresh` for a first turn (docs/router.md, "Paths").
- `pd_reuse`: every prompt is computed on P; a verified prefix is pulled from D (what
  P/D with bidirectional transfer does without kvagent's D-side paths).
- `d_direct`: the decode node holding a conversation's KV extends every later turn
  itself (what a session-affine aggregated node does); first turns go through P.
- `single`: no P leg ever; the decode node computes every prompt, extending a verified
  prefix it holds (`d_direct`) or computing the prompt whole (`d_fresh`). The policy of
  the `single` topology (no prefill node), chosen by `policy_for`.
- `replicas`: `single` on several symmetric nodes (the `replicas` topology): a session
  stays on the node holding its KV unless that node is busy, and then moves, its KV
  pulled along (`d_pull`; `turns.replicas`).

Whatever the policy, only a verified prefix is ever reused: `planner.plan_reuse` decides
how much, the policy only where it is computed.

A policy whose plan depends on the prompt's token ids (a reuse to verify) answers
`NEED_PROMPT_IDS` while the facts lack them, unless the turn may skip `/tokenize`: its
messages extend the held turn's and the policy takes one path for any delta they
suggest (`untokenized_plan`). The pipeline then gathers the ids and asks again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from kvagent_server.common.types import Topology
from kvagent_server.router.reuse import identity, paths, placement, planner
from kvagent_server.router.reuse.queue import IDLE
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.turns import replicas, tier_path
from kvagent_server.router.turns.leg_choices import (  # noqa: F401 (the policy's API)
    forwards_first_token,
    forwards_prompt_ids,
    leg_choices,
)
from kvagent_server.router.turns.policy_params import (
    CostModelParams,
    CostParams,
    Decision,
    LegParams,
    PathPolicy,
    PolicyParams,
    Registered,
    ReplicasParams,
    ReuseParams,
    Shared,
)
from kvagent_server.router.turns.shapes import (
    NEED_PROMPT_IDS,
    LegChoices,  # noqa: F401 (with `leg_choices`, what a plan's legs carry)
    TurnFacts,
    TurnPlan,
)

#: The path policy a router runs unless `router.policy.name` names another.
DEFAULT = "cost_model"
#: Turns whose prompt tokens per message byte were learned before a turn may estimate its
#: delta from its messages' size (and skip `/tokenize`).
MIN_RATIO_SAMPLES = 3

class _Decides:
    """Every policy's `decide`: its own `_decide`, then the legs' transfer choices; and
    what every policy declares to the stages (`PathPolicy`)."""

    reuse: ReuseParams
    legs: LegParams

    @property
    def skips_tokenize(self) -> bool:
        return self.reuse.skip_tokenize

    @property
    def counts_work(self) -> bool:
        # Legs in flight are counted for every policy (a turn's place in its node's
        # queue); only the cost model may be told to price paths blind to them.
        return True

    def _decide(self, facts: TurnFacts) -> Decision:
        raise NotImplementedError

    def _place(self, facts: TurnFacts) -> TurnFacts:
        return place(facts)

    def decide(self, facts: TurnFacts) -> Decision:
        facts = self._place(facts)
        decision = self._decide(facts)
        if isinstance(decision, TurnPlan) and decision.path != "decode_only":
            return dataclasses.replace(decision, legs=leg_choices(facts, self.legs))
        return decision


def reuse_plan(facts: TurnFacts, params: ReuseParams) -> planner.ReusePlan:
    """How much of the handle's KV the prompt may reuse (all policies alike)."""
    if facts.tokenize_failed:
        return planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.TOKENIZE_FAILED)
    return planner.plan_reuse(
        list(facts.prompt_ids), facts.handle, threshold=params.threshold, now=facts.now,
        tenant=facts.req.tenant.name, session=facts.session,
        node_healthy=facts.handle_node_healthy, node_epoch=facts.handle_node_epoch,
        enabled=params.reuse, rejected=facts.rejected,
        prefill_block_size=facts.prefill_block_size, identity=facts.identity)


def place(facts: TurnFacts) -> TurnFacts:
    """decide's first choice: the P node (least loaded, or where the prompt's prefix is
    cached when no D handle is reused: `placement.pick_prefill_by_tiers`) and the D node
    (the session's affinity unless it is unhealthy or overloaded:
    `placement.pick_decode`), from the candidates gather saw; the facts with the placed
    fields filled in. Facts without candidates come placed and are returned as they are."""
    if not facts.candidates:
        return facts
    states = [c.state for c in facts.candidates]
    by_name = {c.node.name: c for c in facts.candidates}
    p_reason: placement.PrefillReason | None = None
    picked_p = None
    if any(st.role == "prefill" for st in states):  # none in the `single` topology
        tiers = facts.tiers
        if facts.holder is None and tiers is not None:
            picked_p, p_reason = placement.pick_prefill_by_tiers(
                states, tiers.hits, prompt_tokens=tiers.prompt_tokens, costs=tiers.costs,
                block_size=tiers.block_size)
        else:
            picked_p = placement.pick_prefill(states)
            p_reason = "least_loaded" if picked_p is not None else "no_healthy_node"
    picked_d, d_reason = placement.pick_decode(states, affinity=facts.affinity)
    p = by_name[picked_p.node_id] if picked_p is not None else None
    d = by_name[picked_d.node_id] if picked_d is not None else None
    idle = IDLE if facts.counts_work else None
    return dataclasses.replace(
        facts, p_first=p.node if p else None, d_first=d.node if d else None,
        d_holds=d is not None and d.node is facts.holder,
        d_healthy=d is not None and d.node.healthy,
        d_kv_usage=d.kv_usage if d is not None else None,
        prefill_block_size=p.block_size if p is not None else facts.prefill_block_size,
        p_work=p.work if p is not None else idle, d_work=d.work if d is not None else idle,
        p_reason=p_reason, d_reason=d_reason)


def _plan(facts: TurnFacts, path: paths.Path, reuse: planner.ReusePlan,
          prompt_len: int) -> TurnPlan:
    return TurnPlan(path=path, reuse=reuse, handle=facts.handle, holder=facts.holder,
                    p_first=facts.p_first, d_first=facts.d_first, prompt_len=prompt_len,
                    p_work=facts.p_work, d_work=facts.d_work, p_reason=facts.p_reason,
                    d_reason=facts.d_reason)


def _decode_only() -> TurnPlan:
    return TurnPlan(path="decode_only", reuse=planner.ReusePlan(
        reuse_tokens=0, reason=planner.Reason.UNSUPPORTED_SHAPE))


def _settled_early(policy: PathPolicy, facts: TurnFacts,
                   params: ReuseParams) -> Decision | None:
    """What every policy answers before weighing anything: a request P/D cannot split
    goes whole to D; a reuse whose plan depends on token ids the facts lack takes the
    path an untokenized extension allows (`untokenized_plan`), else asks for the ids."""
    if not facts.req.splittable:
        return _decode_only()
    if facts.ids_matter and not facts.ids_gathered:
        if facts.d_holds and (plan := untokenized_plan(policy, facts, params)) is not None:
            return plan
        if facts.tokenizable:
            return NEED_PROMPT_IDS
    return None


def untokenized_plan(policy: PathPolicy, facts: TurnFacts,
                     params: ReuseParams) -> TurnPlan | None:
    """The plan of a turn that may skip `/tokenize`, or None (then it is tokenized and
    verified as usual).

    It may when its messages repeat the held turn's exactly under the same rendering
    inputs (`identity.extension_chars`), identities agree with no media involved (media
    positions need the ids), and, for any delta from half to twice what the new messages'
    size suggests (past D's last whole block), the policy would take one path
    (`PathPolicy.untokenized_path`): `d_direct`, or `pd_reuse` on a P node that checks
    what it pulls. Either way the node matches the real tokens itself (D's prefix cache;
    P's `pull_check` against the blocks' digests), so the answer is the one a recompute
    gives; a wrong estimate costs time, not correctness."""
    req, ident, handle, new = facts.req, facts.identity, facts.handle, facts.new_identity
    learned = facts.learned
    if (not params.skip_tokenize or not req.chat or ident is None
            or ident.reason is not None or handle is None or new is None or new.media
            or handle.identity is None or handle.identity.media
            or learned.message_samples < MIN_RATIO_SAMPLES or learned.tokenize_s is None):
        return None
    chars = identity.extension_chars(handle.identity, req.body)
    if chars is None:
        return None
    plan = planner.extension_plan(handle, threshold=params.threshold)
    if not plan.reuses:
        return None
    # The delta: D's retained tokens past the last whole block (known), then the new
    # messages' tokens (estimated; their bytes include the answer D already holds).
    tail = plan.cached_tokens - plan.reuse_tokens
    new_tokens = max(1, learned.message_tokens(chars))
    path = policy.untokenized_path(
        facts, plan, (tail + max(1, new_tokens // 2), tail + 2 * new_tokens),
        learned.tokenize_s)
    if path is None:
        return None
    return _plan(facts, path, plan, plan.reuse_tokens + tail + new_tokens)


@dataclasses.dataclass(frozen=True)
class CostModelPolicy(_Decides):
    """The learned costs and queues choose the path (module docstring)."""

    reuse: ReuseParams
    costs: CostParams
    name: str = "cost_model"
    legs: LegParams = dataclasses.field(default_factory=LegParams)

    @property
    def counts_work(self) -> bool:
        return self.costs.queue_aware

    def _decide(self, facts: TurnFacts) -> Decision:
        if (early := _settled_early(self, facts, self.reuse)) is not None:
            return early
        c = self.costs
        d_free = not self.d_full(facts)
        reuse = reuse_plan(facts, self.reuse)
        prompt_len = len(facts.prompt_ids)
        path = paths.choose_path(
            reuse, prompt_len, facts.costs, skip_prefill_max_tokens=c.skip_prefill_max_tokens,
            d_healthy=facts.d_holds and d_free, p_work=facts.p_work, d_work=facts.d_work,
            d_stall_max_s=c.d_stall_max_s)
        plan = _plan(facts, path, reuse, prompt_len)
        # Not with reuse switched off: D's prefix cache would then reuse earlier turns' KV
        # by the back door, and `reuse: false` is the P/D-without-reuse baseline.
        if (path == "pd_fresh" and reuse.reason == planner.Reason.NO_HANDLE
                and c.fresh_on_decode != "never"):
            fresh = paths.fresh_path(
                facts.est_tokens, facts.costs, policy=c.fresh_on_decode,
                d_healthy=facts.d_healthy and d_free,
                p_work=facts.p_work if facts.p_first is not None else None,
                d_work=facts.d_work, d_stall_max_s=c.d_stall_max_s,
                d_prompt_step_tokens=c.decode_prompt_step_tokens)
            plan = dataclasses.replace(plan, path=fresh, est_tokens=facts.est_tokens)
        return tier_path.with_spill(facts, plan, threshold=self.reuse.threshold, d_free=d_free,
                                    d_stall_max_s=c.d_stall_max_s,
                                    skip_prefill_max_tokens=c.skip_prefill_max_tokens)

    def d_full(self, facts: TurnFacts) -> bool:
        """D's KV cache is at the retention guard's high watermark: D computes no prompt.

        A prompt D computes waits in D's queue for blocks, and so does the release of the
        handle it supersedes, while D's retained turns fill the cache: a turn can wait for
        their TTL. A `pd_reuse` turn's pull frees D's blocks without D's queue, and P
        computes what D would have."""
        high, usage = self.costs.d_kv_high, facts.d_kv_usage
        return high is not None and usage is not None and usage >= high

    def untokenized_path(self, facts: TurnFacts, plan: planner.ReusePlan,
                         deltas: tuple[int, int], tokenize_s: float) -> paths.Path | None:
        c = self.costs
        if self.d_full(facts):
            return None  # tokenized, the turn goes to P (`decide`)
        return paths.untokenized_path(
            plan, deltas, facts.costs, tokenize_s,
            skip_prefill_max_tokens=c.skip_prefill_max_tokens,
            prefill_checks_pulls=facts.p_first is not None and facts.learned.node_checks_pulls(
                facts.p_first.name, facts.p_first.epoch),
            p_work=facts.p_work, d_work=facts.d_work, d_stall_max_s=c.d_stall_max_s)


@dataclasses.dataclass(frozen=True)
class FixedPolicy(_Decides):
    """A verified reuse served always by P (`pd_reuse`: P computes every prompt and pulls
    the prefix from D) or, where D holds the prefix, always by D (`d_direct`: the holding
    decode node extends every later turn it can; first turns use P)."""

    reuse: ReuseParams
    name: str
    on_decode: bool
    legs: LegParams = dataclasses.field(default_factory=LegParams)

    def _decide(self, facts: TurnFacts) -> Decision:
        if (early := _settled_early(self, facts, self.reuse)) is not None:
            return early
        reuse = reuse_plan(facts, self.reuse)
        path = paths.choose_path(reuse, len(facts.prompt_ids), facts.costs,
                                 skip_prefill_max_tokens=(1 << 30) if self.on_decode else 0,
                                 d_healthy=self.on_decode and facts.d_holds)
        return _plan(facts, path, reuse, len(facts.prompt_ids))

    def untokenized_path(self, facts: TurnFacts, plan: planner.ReusePlan,
                         deltas: tuple[int, int], tokenize_s: float) -> paths.Path | None:
        # D's own prefix cache matches the real tokens; an offer to P the router verifies
        return "d_direct" if self.on_decode else None


@dataclasses.dataclass(frozen=True)
class SinglePolicy(_Decides):
    """One node serves every turn (the `single` topology): a verified prefix the decode
    node holds is extended there (`d_direct`), and so is one the router gave up to that
    node's KV tiers (`d_direct`, `hit:tier_host`: `tier_path.on_the_node`); any other
    turn's prompt it computes whole (`d_fresh`), as an aggregated node would. Never a P
    leg."""

    reuse: ReuseParams
    name: str = "single"
    legs: LegParams = dataclasses.field(default_factory=LegParams)

    def _decide(self, facts: TurnFacts) -> Decision:
        if (early := _settled_early(self, facts, self.reuse)) is not None:
            return early
        reuse = reuse_plan(facts, self.reuse)
        prompt_len = len(facts.prompt_ids)
        if reuse.reuses and facts.d_holds:
            return _plan(facts, "d_direct", reuse, prompt_len)
        path: paths.Path = "d_fresh"
        if reuse.reuses:  # verified, but held on a node this turn does not go to
            path, reuse = self._moved(facts, reuse)
        plan = _plan(facts, path, reuse, prompt_len)
        plan = dataclasses.replace(plan, est_tokens=prompt_len or facts.est_tokens)
        # a conversation given up to the node's tiers: loaded there, and said so
        return tier_path.on_the_node(facts, plan, threshold=self.reuse.threshold)

    def _moved(self, facts: TurnFacts, reuse: planner.ReusePlan
               ) -> tuple[paths.Path, planner.ReusePlan]:
        return "d_fresh", planner.ReusePlan(
            reuse_tokens=0, reason=planner.Reason.NODE_UNHEALTHY, detail="not_placed",
            cached_tokens=reuse.cached_tokens)

    def untokenized_path(self, facts: TurnFacts, plan: planner.ReusePlan,
                         deltas: tuple[int, int], tokenize_s: float) -> paths.Path | None:
        return "d_direct"  # D's own prefix cache matches the real tokens


@dataclasses.dataclass(frozen=True)
class ReplicasPolicy(SinglePolicy):
    """`single` on symmetric nodes: the node for a turn and whether a moving session's KV
    follows it are `turns.replicas`' (`place`, `moved`)."""

    moves: ReplicasParams = dataclasses.field(default_factory=ReplicasParams)
    name: str = "replicas"

    def _place(self, facts: TurnFacts) -> TurnFacts:
        return replicas.place(facts, self.moves)

    def _moved(self, facts: TurnFacts, reuse: planner.ReusePlan
               ) -> tuple[paths.Path, planner.ReusePlan]:
        return replicas.moved(facts, reuse, self.moves)


def _cost_model(p: CostModelParams, shared: Shared) -> PathPolicy:
    return CostModelPolicy(shared.reuse, CostParams.of(p, shared.d_kv_high), legs=shared.legs)


#: Policy name -> its parameters model and builder.
POLICIES: dict[str, Registered] = {
    "cost_model": Registered(CostModelParams, _cost_model),
    "pd_reuse": Registered(PolicyParams, lambda p, sh: FixedPolicy(
        sh.reuse, "pd_reuse", on_decode=False, legs=sh.legs)),
    "d_direct": Registered(PolicyParams, lambda p, sh: FixedPolicy(
        sh.reuse, "d_direct", on_decode=True, legs=sh.legs)),
    "single": Registered(PolicyParams, lambda p, sh: SinglePolicy(sh.reuse, legs=sh.legs)),
    "replicas": Registered(ReplicasParams, lambda p, sh: ReplicasPolicy(
        sh.reuse, legs=sh.legs, moves=p)),
}

#: Policies that send turns to a prefill node: refused where there is none.
NEEDS_PREFILL: frozenset[str] = frozenset({"pd_reuse", "d_direct"})


def register(name: str, params: type[BaseModel],
             build: Callable[[Any, Shared], PathPolicy]) -> None:
    """Add a policy under `name` (a plugin's, an experiment's): its parameters model
    (checked at start-up against `router.policy.params`) and how it is built."""
    if name in POLICIES:
        raise ValueError(f"a path policy named {name!r} is already registered")
    POLICIES[name] = Registered(params, build)


def policy_name(settings: RouterSettings, topology: Topology = "pd") -> str:
    """The policy a router of `topology` runs: `router.policy.name`, except that the
    `single` and `replicas` topologies run their own where it names the default
    `cost_model` (with no P there is nothing to weigh), and refuse a policy that needs a
    prefill node, or (`replicas` on one node) several decode nodes."""
    name = settings.policy.name
    if topology == "pd":
        return name
    if name == DEFAULT:
        return topology
    if name in NEEDS_PREFILL or (name == "replicas" and topology == "single"):
        need = "several decode nodes" if name == "replicas" else "a prefill node"
        raise ValueError(f"router.policy.name {name!r} needs {need}; the router serves "
                         f"the {topology} topology: set it to '{topology}' or leave it "
                         f"'{DEFAULT}'")
    return name


def policy_for(settings: RouterSettings, topology: Topology = "pd") -> PathPolicy:
    """The policy a router of `topology` runs (`policy_name`), built with its parameters;
    a ValueError names what is wrong with them."""
    configured, params = settings.policy.name, dict(settings.policy.params)
    name = policy_name(settings, topology)
    try:
        registered = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown router.policy.name {name!r}; known: "
                         f"{', '.join(sorted(POLICIES))}") from None
    if name != configured:  # `single` in place of the default: the cost model's are moot
        params = {k: v for k, v in params.items() if k in registered.params.model_fields}
    try:
        return registered(settings, params)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'params'}: {e['msg']}"
                             for e in exc.errors())
        raise ValueError(f"router.policy.params for {name!r}: {problems}") from None
