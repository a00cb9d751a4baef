"""Tier-aware P placement (pure): hits per tier weighed against load."""

from __future__ import annotations

from kvagent_server.router.kv.tiers import NodeTierHits, TierCosts
from kvagent_server.router.reuse.placement import (
    NodeState,
    consult_tiers,
    pick_prefill,
    pick_prefill_by_tiers,
)


def p(name: str, in_flight: int = 0, *, healthy: bool = True, cap: int = 8,
      role: str = "prefill") -> NodeState:
    return NodeState(node_id=name, url=f"http://{name}", role=role, healthy=healthy,  # type: ignore[arg-type]
                     in_flight=in_flight, epoch="s1", max_in_flight=cap)


COSTS = TierCosts(recompute_s_per_token=1e-4, cpu_s_per_token=5e-6, disk_s_per_token=4e-5,
                  queue_s_per_request=0.05)


def test_no_hit_is_the_least_loaded_choice() -> None:
    nodes = [p("p0", 3), p("p1", 1), p("d0", 0, role="decode")]
    chosen, reason = pick_prefill_by_tiers(nodes, {}, prompt_tokens=2000, costs=COSTS)
    assert chosen == pick_prefill(nodes)
    assert (chosen.node_id, reason) == ("p1", "tier_miss")


def test_a_cached_prefix_beats_a_lighter_load() -> None:
    nodes = [p("p0", 0), p("p1", 2)]
    hits = {"p1": NodeTierHits(node="p1", gpu=1536)}
    chosen, reason = pick_prefill_by_tiers(nodes, hits, prompt_tokens=2000, costs=COSTS,
                                           block_size=16)
    assert (chosen.node_id, reason) == ("p1", "tier_hit")


def test_a_prefix_only_in_a_lower_tier_still_counts() -> None:
    """The issue's case: the prefix survives only in p1's CPU tier."""
    nodes = [p("p0", 0), p("p1", 1)]
    hits = {"p1": NodeTierHits(node="p1", cpu=1900)}
    chosen, reason = pick_prefill_by_tiers(nodes, hits, prompt_tokens=2000, costs=COSTS)
    assert (chosen.node_id, reason) == ("p1", "tier_hit")
    # ... but the GPU copy on another node is cheaper still.
    hits["p0"] = NodeTierHits(node="p0", gpu=1900)
    chosen, reason = pick_prefill_by_tiers(nodes, hits, prompt_tokens=2000, costs=COSTS)
    assert (chosen.node_id, reason) == ("p0", "tier_hit")


def test_load_outweighs_a_small_hit() -> None:
    nodes = [p("p0", 0), p("p1", 6)]
    hits = {"p1": NodeTierHits(node="p1", gpu=256)}  # saves 0.026 s, queue costs 0.3 s
    chosen, reason = pick_prefill_by_tiers(nodes, hits, prompt_tokens=2000, costs=COSTS)
    assert (chosen.node_id, reason) == ("p0", "tier_miss")


def test_hits_report_in_flight_from_the_registry_not_the_index() -> None:
    nodes = [p("p0", 0), p("p1", 7)]
    stale = {"p1": NodeTierHits(node="p1", gpu=512, in_flight=0)}
    chosen, _ = pick_prefill_by_tiers(nodes, stale, prompt_tokens=2000, costs=COSTS)
    assert chosen.node_id == "p0"


def test_saturated_and_unhealthy_nodes_are_passed_over() -> None:
    big = {"p1": NodeTierHits(node="p1", gpu=4000)}
    chosen, _ = pick_prefill_by_tiers([p("p0"), p("p1", 8)], big, prompt_tokens=4096,
                                      costs=COSTS)
    assert chosen.node_id == "p0"  # p1 is saturated (8 of 8)
    chosen, _ = pick_prefill_by_tiers([p("p0"), p("p1", healthy=False)], big,
                                      prompt_tokens=4096, costs=COSTS)
    assert chosen.node_id == "p0"
    chosen, reason = pick_prefill_by_tiers([p("p0", 8), p("p1", 8)], big, prompt_tokens=4096,
                                           costs=COSTS)
    assert (chosen.node_id, reason) == ("p1", "tier_hit")  # all saturated: hits decide
    assert pick_prefill_by_tiers([p("p0", healthy=False)], big, prompt_tokens=1) == (
        None, "no_healthy_node")


def test_ties_go_to_the_least_loaded_node() -> None:
    hits = {"p0": NodeTierHits(node="p0", gpu=512), "p1": NodeTierHits(node="p1", gpu=512)}
    chosen, _ = pick_prefill_by_tiers([p("p0", 1), p("p1", 1, cap=16)], hits,
                                      prompt_tokens=2000, costs=COSTS)
    assert chosen.node_id == "p1"  # same queue, lower relative load


def test_matching_is_consulted_only_with_a_choice_and_something_indexed() -> None:
    two = [p("p0"), p("p1"), p("d0", role="decode")]
    assert consult_tiers(two, indexed=True)
    assert not consult_tiers(two, indexed=False)
    assert not consult_tiers([p("p0"), p("d0", role="decode")], indexed=True)
    assert not consult_tiers([p("p0"), p("p1", healthy=False)], indexed=True)
