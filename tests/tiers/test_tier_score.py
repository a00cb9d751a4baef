"""tier_score / rank_nodes: prefill cost from per-tier prefix hits (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvagent_server.router.kv.tiers import NodeTierHits, TierCosts, rank_nodes, tier_score

COSTS = TierCosts(recompute_s_per_token=1e-3, gpu_s_per_token=0.0, cpu_s_per_token=1e-4,
                  disk_s_per_token=4e-4, queue_s_per_request=0.5)


def test_cold_node_recomputes_everything() -> None:
    s = tier_score(NodeTierHits("n"), prompt_tokens=1000, costs=COSTS)
    assert s.tokens == {"gpu": 0, "cpu": 0, "disk": 0, "recompute": 1000}
    assert s.est_s == pytest.approx(1.0) and s.saved_s == pytest.approx(0.0)


def test_lower_tiers_only_count_past_faster_ones() -> None:
    hits = NodeTierHits("n", gpu=300, cpu=600, disk=900)
    s = tier_score(hits, prompt_tokens=1000, costs=COSTS)
    assert s.tokens == {"gpu": 300, "cpu": 300, "disk": 300, "recompute": 100}
    assert s.est_s == pytest.approx(300 * 1e-4 + 300 * 4e-4 + 100 * 1e-3)


def test_a_shorter_lower_tier_adds_nothing() -> None:
    s = tier_score(NodeTierHits("n", gpu=500, cpu=200), prompt_tokens=1000, costs=COSTS)
    assert s.tokens["cpu"] == 0 and s.tokens["gpu"] == 500


def test_last_token_is_always_computed_and_blocks_align() -> None:
    s = tier_score(NodeTierHits("n", gpu=10_000), prompt_tokens=100, costs=COSTS,
                   block_size=16)
    assert s.tokens["gpu"] == 96 and s.tokens["recompute"] == 4


def test_tier_slower_than_recompute_is_skipped() -> None:
    slow = TierCosts(recompute_s_per_token=1e-4, cpu_s_per_token=1e-5, disk_s_per_token=2e-4)
    s = tier_score(NodeTierHits("n", cpu=100, disk=900), prompt_tokens=1000, costs=slow)
    assert s.tokens["disk"] == 0 and s.tokens["recompute"] == 900


def test_ranking_prefers_hits_but_not_a_saturated_node() -> None:
    nodes = [NodeTierHits("cold"), NodeTierHits("disk", disk=4000),
             NodeTierHits("cpu", cpu=4000), NodeTierHits("busy-gpu", gpu=4000, in_flight=8)]
    order = [s.node for s in rank_nodes(nodes, prompt_tokens=4096, costs=COSTS)]
    assert order == ["cpu", "disk", "cold", "busy-gpu"]


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        tier_score(NodeTierHits("n"), prompt_tokens=-1)


@given(gpu=st.integers(0, 5000), cpu=st.integers(0, 5000), disk=st.integers(0, 5000),
       prompt=st.integers(0, 5000), extra=st.integers(1, 2000))
def test_more_hits_never_cost_more(gpu: int, cpu: int, disk: int, prompt: int,
                                   extra: int) -> None:
    base = tier_score(NodeTierHits("n", gpu, cpu, disk), prompt_tokens=prompt, costs=COSTS)
    assert sum(base.tokens.values()) == prompt
    assert base.est_s <= prompt * COSTS.recompute_s_per_token + 1e-12
    for more in (NodeTierHits("n", gpu + extra, cpu, disk),
                 NodeTierHits("n", gpu, cpu + extra, disk),
                 NodeTierHits("n", gpu, cpu, disk + extra)):
        assert tier_score(more, prompt_tokens=prompt, costs=COSTS).est_s <= base.est_s + 1e-12
