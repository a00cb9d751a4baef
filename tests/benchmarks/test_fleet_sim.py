"""The fleet simulator: seeded small runs over the router's real planner, store and
retention code (no nodes, no HTTP; seconds)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.fleet_sim import run
from benchmarks.fleet_sim.profiles import derive_from_reuse_report, gpu_profile
from benchmarks.fleet_sim.sim import SimConfig, Simulation, summarize
from benchmarks.fleet_sim.workload import FleetSpec


def _fleet(config: SimConfig, spec: FleetSpec, profile=None) -> dict:
    sim = Simulation(profile or gpu_profile(), config)
    records = asyncio.run(sim.run_fleet(spec))
    return summarize(sim, records, span_s=sim.now)


SPEC = FleetSpec(seed=1, sessions=20, turns_per_s=4.0, duration_s=60.0)


def test_smoke_slice_reuse_beats_no_reuse_and_is_seeded():
    rows = run.sweep([(gpu_profile(), run.SMOKE_BASE, run.SMOKE_AXES)], seed=3, duration_s=60.0)
    assert [r["value"] for r in rows] == [20, 60]
    for r in rows:
        on, off = r["reuse"], r["no_reuse"]
        assert on["turns"] > 100 and off["turns"] > 100
        assert on["reuse_rate"] > 0.5 and off["reuse_rate"] == 0
        assert on["ttft_p50"] < off["ttft_p50"]
        assert on["transfer_bytes_per_turn"] < off["transfer_bytes_per_turn"]
        assert on["store_ops_per_turn"] >= 2  # a claim (or peek) and a put per turn
        assert on["router_cpu_us_per_turn"] > 0
    again = run.sweep([(gpu_profile(), run.SMOKE_BASE, {"sessions": [20]})], seed=3,
                      duration_s=60.0)[0]["reuse"]
    first = rows[0]["reuse"]
    for key in ("turns", "paths", "reuse_rate", "ttft_p50", "store_ops"):
        assert again[key] == first[key]


def test_router_threshold_decides_reuse():
    """The planner is the router's: its recompute threshold, set above every prompt,
    turns all reuse off with the planner's own reason."""
    s = _fleet(SimConfig(n_prefill=1, n_decode=2, settings={"kv_recompute_threshold": 10**6}),
               SPEC)
    assert s["reuse_rate"] == 0
    assert set(s["miss_reasons"]) == {"below_threshold"}


def test_watermark_evicts_when_decode_memory_is_small():
    small = gpu_profile().d_kv_blocks // 4
    s = _fleet(SimConfig(n_prefill=1, n_decode=1, d_kv_blocks=small), SPEC)
    big = _fleet(SimConfig(n_prefill=1, n_decode=1), SPEC)
    assert s["watermark_evicted_handles"] > 0 and s["store_ops"].get("evict_oldest", 0) > 0
    assert s["reuse_rate"] < big["reuse_rate"]
    assert s["d_used_peak"] <= 1.0


def test_reuse_off_releases_unrecorded_blocks():
    """Without handles the retention guard's release queue frees D's blocks each round."""
    off = _fleet(SimConfig(n_prefill=1, n_decode=1, reuse=False), SPEC)
    on = _fleet(SimConfig(n_prefill=1, n_decode=1), SPEC)
    assert off["ttl_freed"] == 0  # every sequence released within a round, none at the TTL
    assert off["d_retained_mean"] < on["d_retained_mean"] / 2


def test_gpu_constants_reproduce_the_published_figures():
    p, x = derive_from_reuse_report(tokens=24_000, ttft_noreuse_s=0.778, ttft_reuse_s=0.460,
                                    new_tokens=1000, fixed_s=0.03)
    assert 0.03 + 24_000 * (p + x) == pytest.approx(0.778)
    assert 0.03 + 23_000 * x + 1000 * (p + x) == pytest.approx(0.460)


def test_simulator_matches_the_recorded_full_run():
    """The recorded 4 x 8-turn run replayed: later-turn median TTFT within 25%."""
    sim = run.replay(run.machine_profile(), run.FULL, config="kvagent", reuse=True,
                     p_prefix_cache=True)
    real = run.recorded(run.FULL, "kvagent")
    assert sim["turns"] == 32 and sim["reuse_rate"] == 1.0
    assert abs(sim["ttft_later_p50"] / real["ttft_later_p50"] - 1) <= 0.25
    assert abs(sim["ttft_p50"] / real["ttft_p50"] - 1) <= 0.25


@pytest.mark.redis
def test_redis_store_drives_the_same_fleet(redis_server):
    """The router's RedisStore on a real Redis (its own database): the same turns, every
    turn a put, and reuse as with the in-process store."""
    import redis

    url = f"redis://127.0.0.1:{redis_server.port}/7"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        sim = Simulation(gpu_profile(), SimConfig(n_prefill=1, n_decode=2, redis_url=url))
        records = asyncio.run(sim.run_fleet(SPEC))
        s = summarize(sim, records, span_s=sim.now)
        memory = _fleet(SimConfig(n_prefill=1, n_decode=2), SPEC)
        assert s["turns"] == memory["turns"]
        assert s["store_ops"]["put"] == s["turns"]
        assert s["reuse_rate"] > 0.8 and memory["reuse_rate"] > 0.8
        assert client.dbsize() > 0  # the handles really went to Redis
    finally:
        client.flushdb()
        client.close()
