"""A spilled conversation's next turn, on plain facts: the tier-load price
(`paths.spill_path`) and what decide makes of it (`tier_path.with_spill` in the cost
model's decide, `tier_path.on_the_node` in the single and replicas policies)."""

from __future__ import annotations

import dataclasses

import pytest
from kvagent_server.router.kv.tiers import NodeTierHits, NodeTiers, TierCosts
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import paths, planner
from kvagent_server.router.reuse.identity import IdentityCheck
from kvagent_server.router.reuse.paths import LinearCost, PathCosts
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from kvagent_server.router.reuse.spill import Spilled, TierReuse, spill_of
from kvagent_server.router.turns import policy, policy_params, tier_path
from kvagent_server.router.turns.settle import settle
from kvagent_server.router.turns.shapes import NEED_PROMPT_IDS, Capture, TurnFacts
from test_stages import COST_MODEL, HELD, PROMPT, _facts, _handle, _params, _plan, _router, _turn

D0 = Node(name="d0", url="http://d0", role="decode", healthy=True, epoch="c1")
P0 = Node(name="p0", url="http://p0", role="prefill", healthy=True)
#: Loading a token from the host tier costs less than computing it, on P or on D.
COSTS = PathCosts(prefill=LinearCost(fixed_s=0.05, per_token_s=1e-3),
                  d_direct=LinearCost(fixed_s=0.0, per_token_s=1.2e-3))
TIERS = TierCosts(cpu_s_per_token=1e-5, disk_s_per_token=1e-4)


def tier(host: int = 128, disk: int = 0, shared: bool = False) -> TierReuse:
    return TierReuse(node="d0", epoch="c1", host_tokens=host, disk_tokens=disk,
                     shared=shared, common_prefix=max(host, disk))


def on_p(host: int = 0, disk: int = 0) -> TierReuse:
    return TierReuse(node="p0", epoch="c1", host_tokens=host, disk_tokens=max(host, disk),
                     shared=False, common_prefix=max(host, disk))


# ------------------------------------------------------------------ the price


def test_the_holding_nodes_host_tier_beats_recomputing_a_long_prefix() -> None:
    assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=True) == "d_direct"
    # not placed there (unhealthy, restarted, at its watermark): P, which has no copy
    assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=False) == "recompute"
    # what P's own cache and tiers hold (it computed the earlier prompts), or the shared
    # disk: P loads it
    for held in (on_p(host=128), on_p(host=64, disk=128), on_p(disk=128)):
        assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=False,
                                p_tier=held) == "p_tier"
        assert paths.spill_path(None, 160, COSTS, TIERS, d_ok=False, p_tier=held) == "p_tier"
    # where D may take it, the two loads are priced on their own lines (D's here)
    assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=True,
                            p_tier=on_p(host=128)) == "d_direct"


def test_a_load_that_costs_more_than_computing_is_not_paid() -> None:
    slow = TierCosts(cpu_s_per_token=5e-3, disk_s_per_token=5e-3)  # above both lines
    assert paths.spill_path(tier(), 160, COSTS, slow, d_ok=True) == "recompute"
    assert paths.spill_path(tier(disk=128, shared=True), 160, COSTS, slow, d_ok=False,
                            p_tier=on_p(disk=128)) == "recompute"


def test_the_stall_cap_and_the_queues_weigh_a_tier_load_as_they_weigh_d_direct() -> None:
    busy_d = NodeWork(prefill_tokens=0, streams=4)
    # D streaming: computing a 2000-token delta there stalls them past the cap
    long = tier(host=2048)
    assert paths.spill_path(long, 4096, COSTS, TIERS, d_ok=True, d_work=busy_d,
                            d_stall_max_s=0.05) == "recompute"
    assert paths.spill_path(long, 4096, COSTS, TIERS, d_ok=True, d_work=busy_d) in (
        "d_direct", "recompute")
    # P buried under queued prompts, D idle: the node holding the spill takes it
    busy_p = NodeWork(prefill_tokens=50_000, streams=0)
    assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=True, p_work=busy_p,
                            d_work=IDLE) == "d_direct"
    with pytest.raises(ValueError):
        paths.spill_path(tier(host=160), 160, COSTS, TIERS, d_ok=True)
    with pytest.raises(ValueError):
        paths.spill_path(None, 160, COSTS, TIERS, d_ok=False, p_tier=on_p(disk=160))


# ------------------------------------------------------------------ decide


def spilled_facts(tiers: NodeTiers, **kw: object) -> TurnFacts:
    """A session whose handle the watermark gave up on d0: no handle, its spill found."""
    handle = _handle(prompt_tokens=len(HELD))
    spill = spill_of(handle, tiers, now=0.0)
    assert spill is not None and spill.epoch == "c1"
    fields: dict[str, object] = {
        "handle": None, "d_holds": False, "d_first": D0, "d_healthy": True,
        "p_first": P0, "spilled": Spilled(spill, handle, costs=TIERS), "costs": COSTS,
        "identity": IdentityCheck()}
    return _facts(**(fields | kw))


def test_a_spilled_turn_goes_d_direct_to_the_node_whose_host_tier_holds_it() -> None:
    facts = spilled_facts(NodeTiers(host=True, chunk_tokens=16))
    plan = _plan(COST_MODEL.decide(facts))
    assert (plan.path, plan.reuse.label, plan.tier_source) == (
        "d_direct", "hit:tier_host", "tier_host")
    assert plan.holder is D0 and plan.handle is None and plan.reuse.reuse_tokens == 128
    assert plan.tier is not None and plan.tier.host_tokens == 128
    # D frees nothing (no handle) and keeps the new sequence for the next turn
    assert plan.decode_params(D0) == {"do_remote_prefill": False, "do_remote_decode": False}


def test_a_spilled_turn_that_cannot_go_to_its_node_loads_the_shared_disk_on_p() -> None:
    shared = NodeTiers(host=True, disk=True, shared=True, chunk_tokens=16)
    elsewhere = Node(name="d1", url="http://d1", role="decode", healthy=True, epoch="x")
    watermark = policy.CostModelPolicy(policy_params.ReuseParams(),
                                       policy_params.CostParams(d_kv_high=0.8))
    for facts in (spilled_facts(shared, d_first=elsewhere),  # placed on another node
                  spilled_facts(shared, d_first=dataclasses.replace(D0, epoch="c2")),
                  spilled_facts(shared, d_kv_usage=0.99)):  # D at its watermark
        plan = _plan(watermark.decide(facts))
        assert plan.path == "pd_fresh" and plan.tier_source == "tier_disk", plan
        # P's connector loads it: the plan says so, and settle counts what P reports
        assert plan.reuse.label == "hit:tier_disk" and plan.reuse.reuse_tokens == 128
        assert plan.tier is not None and plan.tier.node == "p0"
        assert plan.prefill_params() == {"do_remote_prefill": False,
                                         "do_remote_decode": True}
    # a host tier only: nothing P can read
    plan = _plan(COST_MODEL.decide(spilled_facts(NodeTiers(host=True, chunk_tokens=16),
                                                 d_first=elsewhere)))
    assert plan.path == "pd_fresh" and plan.tier_source is None


def test_a_spilled_turn_on_p_loads_what_ps_own_cache_and_tiers_hold() -> None:
    """D at its watermark: P computed the conversation's earlier prompts, and its KV
    events show its engine memory and host tier holding most of this one. The P path
    loads it (`hit:tier_host`), whole chunks below the prompt's last token."""
    tiers = NodeTiers(host=True, chunk_tokens=16)
    watermark = policy.CostModelPolicy(policy_params.ReuseParams(),
                                       policy_params.CostParams(d_kv_high=0.8))

    def with_p(facts: TurnFacts, hits: NodeTierHits | None) -> TurnFacts:
        assert facts.spilled is not None
        reach = {"p0": hits} if hits is not None else {}
        return dataclasses.replace(facts, spilled=dataclasses.replace(facts.spilled,
                                                                      p_reach=reach))

    full = NodeTierHits(node="p0", gpu=32, cpu=len(PROMPT), disk=len(PROMPT))
    plan = _plan(watermark.decide(with_p(spilled_facts(tiers, d_kv_usage=0.99), full)))
    assert (plan.path, plan.reuse.label, plan.tier_source) == (
        "pd_fresh", "hit:tier_host", "tier_host"), plan
    whole = (len(PROMPT) - 1) // 16 * 16
    assert plan.reuse.reuse_tokens == whole and plan.tier is not None
    assert (plan.tier.node, plan.tier.host_tokens) == ("p0", whole)
    assert plan.prefill_params() == {"do_remote_prefill": False, "do_remote_decode": True}
    # P's events show nothing of it, or less than the threshold: P recomputes, unlabelled
    for hits in (NodeTierHits(node="p0"), NodeTierHits(node="p0", cpu=16, disk=16)):
        plan = _plan(watermark.decide(with_p(spilled_facts(tiers, d_kv_usage=0.99), hits)))
        assert plan.path == "pd_fresh" and plan.tier is None
        assert plan.reuse.reason == planner.Reason.NO_HANDLE
    # another identity (the salt changed): nothing loaded, whatever P's events say
    salt = IdentityCheck(reason="identity_changed", detail="salt", cap=0)
    plan = _plan(watermark.decide(with_p(spilled_facts(tiers, d_kv_usage=0.99,
                                                       identity=salt), full)))
    assert plan.tier is None and plan.reuse.reuse_tokens == 0
    # D may take it from its host tier: D's line is priced below P's here
    plan = _plan(COST_MODEL.decide(with_p(spilled_facts(tiers), full)))
    assert plan.path == "d_direct" and plan.tier is not None and plan.tier.node == "d0"
    # unless D may compute no delta that long (`skip_prefill_max_tokens`, 0: never)
    for skip in (0, 16):
        never = policy.CostModelPolicy(policy_params.ReuseParams(),
                                       policy_params.CostParams(skip_prefill_max_tokens=skip))
        plan = _plan(never.decide(with_p(spilled_facts(tiers), full)))
        assert (plan.path, plan.reuse.label) == ("pd_fresh", "hit:tier_host"), (skip, plan)
        assert plan.tier is not None and plan.tier.node == "p0"
    within = policy.CostModelPolicy(policy_params.ReuseParams(),
                                    policy_params.CostParams(skip_prefill_max_tokens=4096))
    assert _plan(within.decide(with_p(spilled_facts(tiers), full))).path == "d_direct"


async def test_a_p_tier_load_counts_as_reused_only_as_far_as_p_reports_it_cached() -> None:
    tiers = NodeTiers(host=True, chunk_tokens=16)
    watermark = policy.CostModelPolicy(policy_params.ReuseParams(),
                                       policy_params.CostParams(d_kv_high=0.8))
    facts = spilled_facts(tiers, d_kv_usage=0.99)
    assert facts.spilled is not None
    hits = NodeTierHits(node="p0", cpu=len(PROMPT), disk=len(PROMPT))
    loaded = dataclasses.replace(facts, spilled=dataclasses.replace(facts.spilled,
                                                                    p_reach={"p0": hits}))
    planned = _plan(watermark.decide(loaded))
    plain = _plan(watermark.decide(facts))
    assert planned.tier is not None and plain.tier is None
    r = _router()
    for plan, cached, reused in ((planned, 64, 64), (planned, len(PROMPT) - 1,
                                                     planned.reuse.reuse_tokens),
                                 (plain, 64, 0)):
        turn = _turn(r, plan, loaded)
        final = await settle(r, turn, Capture(
            kv_params=_params(len(PROMPT)), prompt_token_ids=PROMPT, choices={0},
            usage={"prompt_tokens": len(PROMPT),
                   "prompt_tokens_details": {"cached_tokens": cached}}))
        assert final.reused == reused, (plan.reuse.label, cached)
        assert final.kvagent["path"] == "pd_fresh"
        assert final.kvagent["reason"] == plan.reuse.label


def test_only_a_verified_prefix_of_the_same_identity_is_loaded() -> None:
    tiers = NodeTiers(host=True, chunk_tokens=16)
    other = (999, *PROMPT[1:])  # diverged at 0
    assert _plan(COST_MODEL.decide(spilled_facts(tiers, prompt_ids=other))).tier is None
    salt = IdentityCheck(reason="identity_changed", detail="salt", cap=0)
    assert _plan(COST_MODEL.decide(spilled_facts(tiers, identity=salt))).tier is None
    # the KV events show the host tier lost it: not offered (a recompute, not a miss)
    facts = spilled_facts(tiers)
    assert facts.spilled is not None
    gone = dataclasses.replace(facts, spilled=dataclasses.replace(facts.spilled, host_reach=0))
    assert _plan(COST_MODEL.decide(gone)).path == "pd_fresh"


def test_a_spill_needs_the_prompt_ids() -> None:
    facts = spilled_facts(NodeTiers(host=True), prompt_ids=(), tokenizable=True)
    assert facts.ids_matter
    assert COST_MODEL.decide(facts) is NEED_PROMPT_IDS


# ------------------------------------------------------------------ no P to weigh


SINGLE = policy.SinglePolicy(policy_params.ReuseParams())


def test_single_loads_a_spilled_turn_on_its_node_whatever_the_costs() -> None:
    """One node computes every prompt: a spill verified against its record goes
    `d_direct` there with the tier's reason, even where a recompute on a (missing) P
    would price lower or the node is at its watermark."""
    tiers = NodeTiers(host=True, disk=True, chunk_tokens=16)
    slow = TierCosts(cpu_s_per_token=5e-3, disk_s_per_token=5e-3)
    for facts in (spilled_facts(tiers, p_first=None),
                  spilled_facts(tiers, p_first=None, d_kv_usage=0.99),
                  spilled_facts(tiers, p_first=None, costs=COSTS,
                                d_work=NodeWork(prefill_tokens=0, streams=60))):
        assert facts.spilled is not None
        facts = dataclasses.replace(facts,
                                    spilled=dataclasses.replace(facts.spilled, costs=slow))
        plan = _plan(SINGLE.decide(facts))
        assert (plan.path, plan.reuse.label, plan.tier_source) == (
            "d_direct", "hit:tier_host", "tier_host"), plan
        assert plan.holder is D0 and plan.handle is None and plan.reuse.reuse_tokens == 128
        assert plan.decode_params(D0) == {"do_remote_prefill": False,
                                          "do_remote_decode": False}
    disk_only = _plan(SINGLE.decide(spilled_facts(NodeTiers(disk=True, chunk_tokens=16),
                                                  p_first=None)))
    assert (disk_only.path, disk_only.reuse.label) == ("d_direct", "hit:tier_disk")


def test_single_recomputes_a_spill_it_cannot_verify_or_that_another_node_holds() -> None:
    tiers = NodeTiers(host=True, chunk_tokens=16)
    other = Node(name="d1", url="http://d1", role="decode", healthy=True, epoch="x")
    salt = IdentityCheck(reason="identity_changed", detail="salt", cap=0)
    for facts in (spilled_facts(tiers, p_first=None, prompt_ids=(999, *PROMPT[1:])),
                  spilled_facts(tiers, p_first=None, identity=salt),
                  spilled_facts(tiers, p_first=None, d_first=other),  # another replica
                  spilled_facts(tiers, p_first=None,
                                d_first=dataclasses.replace(D0, epoch="c2")),  # restarted
                  spilled_facts(tiers, p_first=None, d_healthy=False)):
        plan = _plan(SINGLE.decide(facts))
        assert plan.path == "d_fresh" and plan.tier is None and plan.tier_source is None
        assert plan.reuse.reuse_tokens == 0
    assert SINGLE.decide(spilled_facts(tiers, p_first=None, prompt_ids=(),
                                       tokenizable=True)) is NEED_PROMPT_IDS


def test_a_turn_whose_handle_was_given_up_while_it_waited_loads_it_back() -> None:
    """`single`: the turn's own handle went for another turn's room (the admission gate)
    before its leg was sent; on a node with tiers the turn stays `d_direct` there, loading
    what it had verified from the tiers, and pins and frees no handle."""
    facts = _facts(d_first=D0, p_first=None, handle=_handle(prompt_tokens=len(HELD)))
    plan = dataclasses.replace(_plan(SINGLE.decide(facts)), holder=D0)
    assert plan.path == "d_direct" and plan.handle is not None
    verified = plan.reuse.reuse_tokens
    back = tier_path.reloaded(plan, NodeTiers(host=True, chunk_tokens=16), threshold=64,
                              now=0.0)
    assert back is not None and (back.path, back.reuse.label) == ("d_direct", "hit:tier_host")
    assert back.handle is None and back.holder is D0 and back.tier_source == "tier_host"
    # the prompt's whole chunks of what was verified (prompt-only tiers)
    assert back.reuse.reuse_tokens == min(verified, len(HELD) - len(HELD) % 16)
    assert back.decode_params(D0) == {"do_remote_prefill": False, "do_remote_decode": False}
    disk = tier_path.reloaded(plan, NodeTiers(disk=True, chunk_tokens=16), threshold=64,
                              now=0.0)
    assert disk is not None and disk.reuse.label == "hit:tier_disk"
    # nothing to load: no tiers, a chunk above what was verified, or not a d_direct reuse
    assert tier_path.reloaded(plan, None, threshold=64, now=0.0) is None
    assert tier_path.reloaded(plan, NodeTiers(), threshold=64, now=0.0) is None
    assert tier_path.reloaded(plan, NodeTiers(host=True, chunk_tokens=4096), threshold=64,
                              now=0.0) is None
    fresh = _plan(SINGLE.decide(_facts(handle=None, prompt_ids=(), identity=None,
                                       d_holds=False, est_tokens=500)))
    assert tier_path.reloaded(fresh, NodeTiers(host=True), threshold=64, now=0.0) is None
