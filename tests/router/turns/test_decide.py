"""Every decision of the decide stage on plain facts (no I/O): when it asks for the
prompt's ids, the untokenized extension, and each leg's transfer params."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kvagent_server.router.kv.tiers import NodeTierHits
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import planner, transfer
from kvagent_server.router.reuse.identity import IdentityCheck
from kvagent_server.router.reuse.learned import LearnedView
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.turns import policy, policy_params
from kvagent_server.router.turns.shapes import (
    NEED_PROMPT_IDS,
    NodeFacts,
    TierFacts,
    TurnFacts,
    TurnPlan,
)
from pydantic import BaseModel, ConfigDict
from test_stages import COST_MODEL, D_CHEAP, PROMPT, _extension_facts, _facts, _plan, _req

HOLDER = Node(name="d0", url="http://d0", role="decode", healthy=True)
OTHER = Node(name="d1", url="http://d1", role="decode", healthy=True)
PD_REUSE = policy.FixedPolicy(policy_params.ReuseParams(), "pd_reuse", on_decode=False)
SINGLE = policy.SinglePolicy(policy_params.ReuseParams())


# ------------------------------------------------------------------ the prompt's ids


def test_a_reuse_to_verify_asks_for_the_prompt_ids_once() -> None:
    facts = _facts(holder=HOLDER, prompt_ids=(), tokenizable=True)
    for p in (COST_MODEL, PD_REUSE, SINGLE):
        assert p.decide(facts) is NEED_PROMPT_IDS
    gathered = dataclasses.replace(facts, prompt_ids=tuple(PROMPT), ids_gathered=True)
    assert _plan(COST_MODEL.decide(gathered)).reuse.reuse_tokens == 128
    failed = dataclasses.replace(facts, tokenize_failed=True, ids_gathered=True)
    assert _plan(COST_MODEL.decide(failed)).reuse.reason == planner.Reason.TOKENIZE_FAILED


def test_no_ids_are_asked_for_where_they_cannot_change_the_reuse() -> None:
    # no live holder (a first turn, a stale handle), or no node to tokenize
    assert isinstance(COST_MODEL.decide(_facts(prompt_ids=())), TurnPlan)
    no_tokenizer = _facts(holder=HOLDER, prompt_ids=(), tokenizable=False)
    assert isinstance(COST_MODEL.decide(no_tokenizer), TurnPlan)
    # an identity refusal that positions cannot lift (another model)
    other_model = _extension_facts(identity=IdentityCheck(reason="identity_changed",
                                                          detail="model", cap=0))
    assert _plan(COST_MODEL.decide(other_model)).path == "recompute"


def test_an_extension_skips_tokenize_only_when_one_path_fits_every_delta() -> None:
    fixed = policy.CostModelPolicy(policy_params.ReuseParams(),
                                   policy_params.CostParams(skip_prefill_max_tokens=10_000))
    plan = _plan(fixed.decide(_extension_facts()))
    assert (plan.path, plan.reuse.tokenized, plan.reuse.reuse_tokens) == ("d_direct", False,
                                                                          128)
    # not learned enough yet, or switched off, or a policy that never skips: ask
    unlearned = _extension_facts(learned=LearnedView(message_samples=2, tokenize_s=0.01))
    assert fixed.decide(unlearned) is NEED_PROMPT_IDS
    off = policy.CostModelPolicy(policy_params.ReuseParams(skip_tokenize=False),
                                 policy_params.CostParams(skip_prefill_max_tokens=10_000))
    assert off.decide(_extension_facts()) is NEED_PROMPT_IDS
    assert PD_REUSE.decide(_extension_facts()) is NEED_PROMPT_IDS
    never = policy.CostModelPolicy(policy_params.ReuseParams(),
                                   policy_params.CostParams(skip_prefill_max_tokens=0))
    assert never.decide(_extension_facts()) is NEED_PROMPT_IDS
    # D not holding the prefix: the turn is verified by its ids
    assert fixed.decide(_extension_facts(d_holds=False)) is NEED_PROMPT_IDS


# ------------------------------------------------------------------ the legs' params


def test_a_pulled_prefix_offers_d_exactly_the_reused_blocks() -> None:
    plan = _plan(PD_REUSE.decide(_facts(holder=HOLDER, ids_gathered=True)))
    params = plan.prefill_params()
    assert params[transfer.REMOTE_NUM_TOKENS] == 128
    assert params[transfer.REMOTE_BLOCK_IDS] == [list(range(8))]
    assert params[transfer.DO_REMOTE_DECODE] and not params[transfer.DO_REMOTE_PREFILL]


def test_a_claimed_handle_not_reused_is_released_by_the_turns_own_leg() -> None:
    diverged = _facts(holder=HOLDER, ids_gathered=True, prompt_ids=tuple(range(9000, 9160)))
    plan = _plan(COST_MODEL.decide(diverged))
    assert plan.path == "recompute"
    assert plan.prefill_params()[transfer.REMOTE_NUM_TOKENS] == 0  # P tells D to free it
    keep = policy.CostModelPolicy(policy_params.ReuseParams(), policy_params.CostParams(),
                                  legs=policy_params.LegParams(release_unused=False))
    assert _plan(keep.decide(diverged)).prefill_params() == transfer.fresh()
    # with no P (single), the d_fresh leg frees it, on the node that holds it only
    fresh = _plan(SINGLE.decide(dataclasses.replace(diverged, d_first=HOLDER)))
    assert fresh.path == "d_fresh"
    assert fresh.decode_params(HOLDER)[transfer.RELEASE_KEY] == ["rid-1"]
    assert transfer.RELEASE_KEY not in fresh.decode_params(OTHER)
    # its room given up while waiting: nothing is left to free
    assert fresh.without_room().decode_params(HOLDER) == transfer.d_direct()
    assert plan.without_room().prefill_params() == transfer.fresh()


def test_d_direct_frees_the_handle_it_supersedes() -> None:
    plan = _plan(COST_MODEL.decide(_facts(costs=D_CHEAP, holder=HOLDER, ids_gathered=True)))
    assert plan.path == "d_direct"
    assert plan.decode_params(HOLDER) == transfer.with_release(transfer.d_direct(),
                                                               ["rid-1"])
    after = plan.without_room()  # given up for room: P recomputes, nothing to free
    assert after.path == "recompute" and after.prefill_params() == transfer.fresh()


def test_an_unverified_offer_with_no_checking_p_node_releases_whatever_the_setting() -> None:
    keep = dataclasses.replace(
        _plan(PD_REUSE.decide(_facts(holder=HOLDER, ids_gathered=True))),
        legs=policy.LegChoices(release_unused=False))
    recomputed = keep.recomputed(planner.Reason.NODE_UNHEALTHY, "prefill", release=True)
    assert recomputed.prefill_params()[transfer.REMOTE_NUM_TOKENS] == 0


def test_what_d_takes_from_ps_answer() -> None:
    legs = policy_params.LegParams.of(RouterSettings())
    chat = policy.leg_choices(_facts(), legs)
    assert chat.forward_prompt_ids and chat.forward_first_token and not chat.shift_blocks
    assert chat.read_within_s == 25.0
    n2 = policy.leg_choices(_facts(req=_req({"model": "m", "n": 2, "messages": []})), legs)
    assert not n2.forward_first_token
    shifted = _facts(req=_req(shift_blocks=True))
    assert not policy.leg_choices(shifted, legs).shift_blocks  # the hook is off
    hooked = policy_params.LegParams.of(RouterSettings(test_shift_blocks_header=True))
    assert policy.leg_choices(shifted, hooked).shift_blocks
    plan = _plan(policy.FixedPolicy(policy_params.ReuseParams(), "pd_reuse", on_decode=False,
                                    legs=hooked).decide(dataclasses.replace(
                                        shifted, holder=HOLDER, ids_gathered=True)))
    assert plan.prefill_params() == transfer.shifted_blocks(
        transfer.reuse_transfer_params(plan.handle, 128))  # type: ignore[arg-type]


# ------------------------------------------------------------------ policies by name


def test_the_policy_section_names_a_policy_and_its_own_parameters() -> None:
    chosen = policy.policy_for(RouterSettings(policy={
        "name": "cost_model", "params": {"skip_prefill_max_tokens": 0,
                                         "fresh_on_decode": "never"}}))
    assert isinstance(chosen, policy.CostModelPolicy)
    assert (chosen.costs.skip_prefill_max_tokens, chosen.costs.fresh_on_decode) == (0, "never")
    assert chosen.costs.d_stall_max_s == 0.055  # left out: its default
    assert chosen.counts_work and chosen.skips_tokenize
    assert policy.policy_for(RouterSettings(policy={"name": "pd_reuse"})).name == "pd_reuse"
    # the older flat form keeps working (moved into `policy`), and means the same
    flat = policy.policy_for(RouterSettings(skip_prefill_max_tokens=0, fresh_on_decode="never"))
    assert flat == chosen
    blind = policy.policy_for(RouterSettings(policy={"params": {
        "queue_aware_paths": False, "skip_tokenize_extensions": False}}))
    assert not blind.counts_work and not blind.skips_tokenize
    fixed = policy.policy_for(RouterSettings(policy={
        "name": "d_direct", "params": {"skip_tokenize_extensions": False}}))
    assert fixed.counts_work and not fixed.skips_tokenize  # its legs are still queued


def test_bad_policy_settings_name_what_is_wrong_and_where() -> None:
    with pytest.raises(ValueError, match=r"router.policy.params for 'cost_model': "
                                         r"fresh_on_decode"):
        policy.policy_for(RouterSettings(policy={"name": "cost_model",
                                                 "params": {"fresh_on_decode": "often"}}))
    with pytest.raises(ValueError, match="router.policy.params for 'pd_reuse': typo"):
        policy.policy_for(RouterSettings(policy={"name": "pd_reuse", "params": {"typo": 1}}))
    with pytest.raises(ValueError, match="unknown router.policy.name 'fastest'"):
        policy.policy_for(RouterSettings(policy={"name": "fastest"}))
    # a parameter the named policy does not take is refused, moved flat key or not
    with pytest.raises(ValueError, match="router.policy.params for 'pd_reuse': "
                                         "skip_prefill_max_tokens"):
        policy.policy_for(RouterSettings(path_policy="pd_reuse", skip_prefill_max_tokens=0))
    # a bundle writes every key out: what it writes reads back the same
    written = RouterSettings(policy={"name": "d_direct"}).model_dump(mode="python")
    assert policy.policy_for(RouterSettings.model_validate(written)).name == "d_direct"
    # with no prefill node the default runs as `single`, keeping the parameters it takes
    single = RouterSettings(policy={"name": "cost_model", "params": {
        "fresh_on_decode": "never", "skip_tokenize_extensions": False}})
    chosen = policy.policy_for(single, "single")
    assert chosen.name == "single" and not chosen.skips_tokenize
    with pytest.raises(ValueError, match="router.policy.name 'pd_reuse' needs a prefill"):
        policy.policy_for(RouterSettings(policy={"name": "pd_reuse"}), "single")


def test_a_registered_policy_brings_its_own_parameters() -> None:
    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        on_decode: bool = False

    def build(p: Params, shared: policy_params.Shared) -> policy_params.PathPolicy:
        return policy.FixedPolicy(shared.reuse, "test_fixed", on_decode=p.on_decode,
                                  legs=shared.legs)

    policy.register("test_fixed", Params, build)
    try:
        chosen = policy.policy_for(RouterSettings(policy={"name": "test_fixed",
                                                          "params": {"on_decode": True}}))
        assert isinstance(chosen, policy.FixedPolicy) and chosen.on_decode
        with pytest.raises(ValueError, match="already registered"):
            policy.register("test_fixed", Params, build)
    finally:
        del policy.POLICIES["test_fixed"]


# ------------------------------------------------------------------ which nodes


def _candidate(name: str, role: str, in_flight: int = 0, healthy: bool = True,
               **kw: Any) -> NodeFacts:
    node = Node(name=name, url=f"http://{name}", role=role,  # type: ignore[arg-type]
                healthy=healthy)
    return NodeFacts(node=node, state=node.state(in_flight), **kw)


def _unplaced(candidates: tuple[NodeFacts, ...], **kw: Any) -> TurnFacts:
    return _facts(**({"candidates": candidates, "p_first": None, "d_first": None,
                      "d_holds": False, "p_work": None, "d_work": None} | kw))


def test_decide_places_the_turn_least_loaded_p_and_the_sessions_d() -> None:
    p0, p1 = _candidate("p0", "prefill", 3), _candidate("p1", "prefill", 1, block_size=32)
    d0, d1 = _candidate("d0", "decode", 2, kv_usage=0.5), _candidate("d1", "decode", 0)
    facts = policy.place(_unplaced((p0, p1, d0, d1), affinity="d0", holder=d0.node))
    assert (facts.p_first, facts.d_first) == (p1.node, d0.node)
    assert (facts.p_reason, facts.d_reason) == ("least_loaded", "affinity")
    assert facts.d_holds and facts.d_kv_usage == 0.5 and facts.prefill_block_size == 32
    # the holder overloaded: D elsewhere, and so no d_direct
    busy = _candidate("d0", "decode", 60)
    moved = policy.place(_unplaced((p0, busy, d1), affinity="d0", holder=busy.node))
    assert moved.d_first is d1.node and moved.d_reason == "affinity_overloaded"
    assert not moved.d_holds
    assert _plan(COST_MODEL.decide(dataclasses.replace(
        _unplaced((p0, busy, d1), affinity="d0", holder=busy.node), ids_gathered=True,
        costs=D_CHEAP))).path == "pd_reuse"


def test_work_in_flight_follows_the_placed_nodes() -> None:
    p0 = _candidate("p0", "prefill", work=NodeWork(prefill_tokens=500, prompts=2))
    d0 = _candidate("d0", "decode", work=NodeWork(streams=3))
    facts = policy.place(_unplaced((p0, d0), counts_work=True))
    assert facts.p_work == p0.work and facts.d_work == d0.work
    single = policy.place(_unplaced((d0,), counts_work=True, prefill_block_size=16))
    assert single.p_first is None and single.p_reason is None  # no P to place
    assert single.p_work == IDLE and single.prefill_block_size == 16


def test_with_no_handle_to_reuse_p_is_where_the_prompt_is_cached() -> None:
    p0, p1 = _candidate("p0", "prefill", 0), _candidate("p1", "prefill", 1)
    d0 = _candidate("d0", "decode")
    tiers = TierFacts(hits={"p1": NodeTierHits(node="p1", gpu=4096)}, block_size=16,
                      prompt_tokens=4200)
    facts = policy.place(_unplaced((p0, p1, d0), tiers=tiers))
    assert facts.p_first is p1.node and facts.p_reason == "tier_hit"
    miss = policy.place(_unplaced((p0, p1, d0), tiers=dataclasses.replace(tiers, hits={})))
    assert miss.p_first is p0.node and miss.p_reason == "tier_miss"
    # a D handle to reuse: P is chosen by load, whatever the tiers say
    held = policy.place(_unplaced((p0, p1, d0), tiers=tiers, holder=d0.node))
    assert held.p_first is p0.node and held.p_reason == "least_loaded"
