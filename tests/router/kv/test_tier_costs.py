"""Tier load prices learned from the nodes' own counters (kv/tiers.py, pure)."""

from __future__ import annotations

import pytest
from kvagent_server.router.kv.tiers import (
    TierCostLearner,
    TierCosts,
    TierLoads,
    parse_tier_loads,
)
from kvagent_server.router.nodes.retention import parse_node_kv


def metrics(host: float, disk: float, load_s: float) -> str:
    """The lines vLLM 0.32 exposes, as its logger and the offloading connector name them."""
    labels = 'engine="0",model_name="m"'
    return "\n".join([
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.25",
        *(f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="{s}"}} {v}'
          for s, v in (("device", 900.0), ("host", host), ("disk", disk), ("p2p", 0.0))),
        f"vllm:kv_offload_load_time_total{{{labels}}} {load_s}",
        f"vllm:kv_offload_load_bytes_total{{{labels}}} 123456.0", ""])


def test_the_counters_are_read_from_a_nodes_metrics() -> None:
    loads = parse_tier_loads(metrics(512, 256, 0.5))
    assert loads == TierLoads(host_tokens=512, disk_tokens=256, load_s=0.5)
    kv = parse_node_kv(metrics(512, 256, 0.5))  # the retention guard's read carries them
    assert kv is not None and kv.usage == 0.25 and kv.loads == loads
    # no offloading connector: no load time, nothing to learn from
    assert parse_tier_loads("vllm:kv_cache_usage_perc 0.1\n") is None


def test_each_tier_is_priced_by_the_intervals_that_loaded_only_from_it() -> None:
    prior = TierCosts(cpu_s_per_token=1.0, disk_s_per_token=2.0)
    learner = TierCostLearner(prior, alpha=1.0)
    learner.observe("d0", TierLoads(0, 0, 0.0))
    assert learner.costs() == prior  # one read teaches nothing
    learner.observe("d0", TierLoads(1000, 0, 0.01))  # 1000 host tokens in 10 ms
    assert learner.costs().cpu_s_per_token == pytest.approx(1e-5)
    learner.observe("d0", TierLoads(1000, 500, 0.06))  # 500 disk tokens in 50 ms
    assert learner.costs().disk_s_per_token == pytest.approx(1e-4)
    # mixed: the host part at the host price, the rest is the disk's
    learner.observe("d0", TierLoads(2000, 1000, 0.06 + 0.01 + 0.1))
    assert learner.costs().disk_s_per_token == pytest.approx(2e-4)
    # too few tokens, or a counter that went back (a restart): nothing learned
    learner.observe("d0", TierLoads(2010, 1000, 5.0))
    learner.observe("d0", TierLoads(0, 0, 0.0))
    learner.observe("d0", TierLoads(10, 0, 9.0))
    assert learner.costs().cpu_s_per_token == pytest.approx(1e-5)
    assert learner.costs().recompute_s_per_token == prior.recompute_s_per_token
    with pytest.raises(ValueError):
        TierCostLearner(alpha=0)
