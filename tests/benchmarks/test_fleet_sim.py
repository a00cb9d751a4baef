"""The fleet simulator: seeded small runs over the router's real planner, store and
retention code (no nodes, no HTTP; seconds)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks.api import (
    FleetSpec,
    Profile,
    SimConfig,
    Simulation,
    calibrate,
    derive_from_reuse_report,
    gpu_profile,
)
from benchmarks.api import fleet_sim_run as run
from benchmarks.api import fleet_summarize as summarize


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
    s = _fleet(SimConfig(n_prefill=1, n_decode=2, settings={"nodes": {"kv_recompute_threshold": 10**6}}),
               SPEC)
    assert s["reuse_rate"] == 0
    assert set(s["miss_reasons"]) == {"below_threshold"}


def test_the_simulator_runs_the_routers_own_path_policy():
    """The policy the settings name decides each simulated turn (no copy of its rules)."""
    by_policy = {name: _fleet(SimConfig(n_prefill=1, n_decode=1,
                                        settings={"policy": {"name": name}}), SPEC)["paths"]
                 for name in ("pd_reuse", "d_direct")}
    assert by_policy["pd_reuse"].get("pd_reuse", 0) > 0 and "d_direct" not in by_policy["pd_reuse"]
    assert by_policy["d_direct"].get("d_direct", 0) > 0 and "pd_reuse" not in by_policy["d_direct"]
    always = _fleet(SimConfig(n_prefill=1, n_decode=1, settings={
        "policy": {"name": "cost_model", "params": {"fresh_on_decode": "always"}}}), SPEC)
    assert always["paths"].get("d_fresh", 0) > 0 and "pd_fresh" not in always["paths"]


def test_watermark_evicts_when_decode_memory_is_small():
    small = gpu_profile().d_kv_blocks // 4
    s = _fleet(SimConfig(n_prefill=1, n_decode=1, d_kv_blocks=small), SPEC)
    big = _fleet(SimConfig(n_prefill=1, n_decode=1), SPEC)
    assert s["watermark_evicted_handles"] > 0 and s["store_ops"].get("evict_handles", 0) > 0
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


def _recorded_profile() -> Profile:
    """The constants `run.py validate` fitted and recorded (results/validation.json)."""
    doc = json.loads((Path(run.HERE) / "results" / "validation.json").read_text())
    return Profile(**doc["profile"])


def test_simulator_matches_the_held_out_half_of_the_quiet_run():
    """The recorded constants, replayed on the quiet run's held-out conversations:
    median TTFT (all turns and later turns) within 25% with and without reuse."""
    prof = _recorded_profile()
    _, held = calibrate.split_conversations()
    rows = {r["config"]: r for r in calibrate.compare(prof, calibrate.QUIET, held,
                                                      set_name="held out")}
    assert set(rows) == set(calibrate.REPLAYED)
    for config in ("kvagent", "pd_noreuse_pcache_off"):
        r = rows[config]
        assert r["n"] == 16
        assert abs(r["err"]["p50"]) <= 0.25 and abs(r["err"]["later_p50"]) <= 0.25, r
    assert rows["kvagent"]["sim_paths"].get("d_direct", 0) >= 12


def test_validation_split_is_disjoint_and_seeded():
    fit, held = calibrate.split_conversations()
    assert fit and held and not (fit & held)
    assert fit | held == {f"conv-0-{i}" for i in range(4)}
    assert calibrate.split_conversations() == (fit, held)
    checks = calibrate.plan()
    judged_quiet = [c for c in checks if c.results == calibrate.QUIET and not c.in_sample]
    assert judged_quiet and all(not (c.judged & c.fit_set) for c in judged_quiet)
    assert all(c.held_out for c in checks if not c.in_sample)
    assert {c.fit_set for c in checks} == {fit, held}


def _perturbed(tmp_path: Path, convs: frozenset[str], factor: float) -> Path:
    """A copy of the quiet run with the recorded outcomes of `convs` scaled by `factor`
    (the workload, i.e. token counts, untouched)."""
    data = json.loads(calibrate.QUIET.read_text())
    for c in data["configs"]:
        for r in c["records"]:
            if r["conversation"] in convs:
                for key in ("ttft_s", "tpot_s", "e2e_s", "headers_s"):
                    if r.get(key) is not None:
                        r[key] *= factor
    out = tmp_path / f"{factor}-{'-'.join(sorted(convs))}" / "results.json"
    out.parent.mkdir()
    out.write_text(json.dumps(data))
    return out


def test_fit_never_sees_the_held_out_outcomes(tmp_path):
    """Scaling every held-out TTFT/TPOT by 3 leaves the fitted profile unchanged; scaling
    the fit half's changes it (so the test would catch a fit on held-out data)."""
    fit, held = calibrate.split_conversations()
    small = {"coarse": [0.05, 0.15], "fine_half": 1, "rounds": 1}

    def constants(results: Path) -> dict:
        p = calibrate.fit_profile(results, fit, **small).model_dump()
        p.pop("source")
        return p

    base = constants(calibrate.QUIET)
    assert constants(_perturbed(tmp_path, held, 3.0)) == base
    assert constants(_perturbed(tmp_path, fit, 3.0)) != base


def test_measured_constants_come_from_their_benchmarks():
    bw = calibrate.nixl_bytes_per_s()
    assert 8.4e9 < bw < 8.6e9  # tcp,self,sm, 256 KiB descriptors, quiet host
    _, p, q, n = calibrate.engine_compute()
    assert n == 17 and p > 0 and q > 0
    prof = _recorded_profile()
    assert prof.xfer_bytes_per_s == bw
    # a least-squares fit: the last digits depend on the machine's BLAS
    assert prof.prefill_per_token_s == pytest.approx(p, rel=1e-9)
    assert prof.per_token_per_context_s == pytest.approx(q, rel=1e-9)


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
