"""Decide, for a turn whose session spilled to a decode node's KV tiers: where its prompt
is computed, loading the spilled prefix from a tier. Pure (docs/tiers.md, "Spilled, not
gone").

A path policy calls `with_spill` (`on_the_node` where no P leg is weighed) on the plan it
made without the spill (a turn with no
handle is `pd_fresh`, `d_fresh` or `recompute`): when the prompt repeats whole chunks of
what the tiers got (`spill.plan_spill`), `paths.spill_path` prices a load from the
holding node's tiers (`d_direct` there), P loading what its own cache and tiers hold of
the prompt (`spill.plan_on_prefill`: its KV events), and P recomputing.
The path names stay the protocol's: a tier-served turn says where its prefix came from
in its reason's detail (`hit:tier_host`, `hit:tier_disk`), and every tier load
planned is set on the turn's span (`kvagent.reuse_source`) and counted
(`kvagent_router_tier_reuse_total{source}`).
"""

from __future__ import annotations

import dataclasses

from kvagent_server.router.kv.tiers import NodeTiers
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import paths, planner, spill
from kvagent_server.router.turns.shapes import TurnFacts, TurnPlan


def with_spill(facts: TurnFacts, plan: TurnPlan, *, threshold: int, d_free: bool,
               d_stall_max_s: float | None = None,
               skip_prefill_max_tokens: int | None = None) -> TurnPlan:
    """`plan`, or where a spilled prefix makes a tier load pay, the plan that loads it:
    `d_direct` on the holding node (`d_free`: its KV cache is below the watermark; and
    the delta it computes within `skip_prefill_max_tokens` where that is set, as for
    any `d_direct`), or the same P path loading what P's cache and tiers hold of it
    (`hit:tier_host` or `hit:tier_disk` on that path)."""
    spilled = facts.spilled
    if (spilled is None or plan.reuse.reuses or not facts.prompt_ids
            or plan.path == "decode_only"):
        return plan
    tier = spill.plan_spill(facts.prompt_ids, spilled, threshold=threshold,
                            identity=facts.identity)
    p = facts.p_first
    p_tier = spill.plan_on_prefill(
        facts.prompt_ids, spilled, p.name, p.epoch, tier=tier, threshold=threshold,
        identity=facts.identity) if p is not None and plan.path not in paths.ON_DECODE else None
    if tier is None and p_tier is None:
        return plan
    d = facts.d_first
    d_ok = (tier is not None and d_free and facts.d_healthy and d is not None
            and d.name == tier.node and d.epoch == tier.epoch
            and (skip_prefill_max_tokens is None
                 or len(facts.prompt_ids) - tier.tokens <= skip_prefill_max_tokens))
    choice = paths.spill_path(
        tier, len(facts.prompt_ids), facts.costs, spilled.costs, d_ok=d_ok, p_tier=p_tier,
        p_work=facts.p_work if p is not None else None, d_work=facts.d_work,
        d_stall_max_s=d_stall_max_s)
    if choice == "d_direct":
        assert d is not None and tier is not None  # `d_ok`
        return _loaded_on(d, plan, tier)
    if choice == "p_tier" and p_tier is not None:
        return _loaded(plan, p_tier)
    return plan


def on_the_node(facts: TurnFacts, plan: TurnPlan, *, threshold: int) -> TurnPlan:
    """`plan`, or for a turn with no P leg to weigh (`single`, `replicas`) whose spilled
    prefix is in the tiers of the node it is placed on: `d_direct` there, loading it.

    Nothing is priced: that node computes the prompt either way, and what its engine
    finds in its own tiers it loads instead (vLLM's lookup, by block hash). The plan says
    so, verified against the spill record, where a `d_fresh` would hide it."""
    spilled, d = facts.spilled, facts.d_first
    if (spilled is None or plan.reuse.reuses or not facts.prompt_ids or d is None
            or plan.path != "d_fresh" or not facts.d_healthy):
        return plan
    tier = spill.plan_spill(facts.prompt_ids, spilled, threshold=threshold,
                            identity=facts.identity)
    if tier is None or d.name != tier.node or d.epoch != tier.epoch:
        return plan
    return _loaded_on(d, plan, tier)


def _loaded_on(d: Node, plan: TurnPlan, tier: spill.TierReuse) -> TurnPlan:
    """`d_direct` on the node whose tiers hold the spilled prefix."""
    return dataclasses.replace(_loaded(plan, tier), path="d_direct", holder=d)


def _loaded(plan: TurnPlan, tier: spill.TierReuse) -> TurnPlan:
    """`plan` loading `tier` on its node (`hit:tier_host`, or `hit:tier_disk` where only
    a disk tier has it); on a P path P's connector finds it, nothing else changes."""
    source: spill.Source = "tier_host" if tier.host_tokens else "tier_disk"
    reuse = planner.ReusePlan(reuse_tokens=tier.tokens, reason=planner.Reason.HIT,
                              detail=source, common_prefix=tier.common_prefix,
                              cached_tokens=tier.tokens)
    return dataclasses.replace(plan, reuse=reuse, tier=tier, tier_source=source)


def reloaded(plan: TurnPlan, tiers: NodeTiers | None, *, threshold: int,
             now: float) -> TurnPlan | None:
    """A `d_direct` turn whose own handle was given up for another turn's room while it
    waited (`nodes.admission`), on a node with tiers and no P to go to: `d_direct` on the
    same node, loading the prefix it had verified from the tiers the blocks went to
    (`hit:tier_host`), instead of a fresh prompt. None: nothing to load (no tiers, not a
    `d_direct` of a handle, or what the tiers got of it is below `threshold`)."""
    handle, d = plan.handle, plan.holder
    if plan.path != "d_direct" or handle is None or d is None or tiers is None:
        return None
    given_up = spill.spill_of(handle, tiers, now)
    if given_up is None:
        return None
    tokens = min(plan.reuse.reuse_tokens, given_up.stored_tokens)
    tokens -= tokens % given_up.chunk_tokens
    if tokens < max(threshold, 1):
        return None
    tier = spill.TierReuse(node=d.name, epoch=d.epoch, host_tokens=tokens if tiers.host else 0,
                           disk_tokens=tokens if tiers.disk else 0, shared=given_up.shared,
                           common_prefix=plan.reuse.common_prefix)
    return _loaded_on(d, dataclasses.replace(plan, handle=None), tier)
