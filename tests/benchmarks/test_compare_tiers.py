"""The tiered arms of `python -m benchmarks compare` without vLLM: what each node is
rendered with, the same budgets for every tiered arm, and the memory the report states."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.api import COMPARE_ARMS as ARMS
from benchmarks.api import (
    COMPARE_DEFAULT_ARMS,
    DEFAULT_TIERS,
    TIER_DIR,
    TierBudget,
    bundle_settings,
    flag_rows,
    parse_arms,
)
from benchmarks.api import compare_parser as parser
from benchmarks.api import compare_run as run_mod
from benchmarks.api import compare_subject_of as subject_of
from benchmarks.api import compare_summary as sm
from benchmarks.api import compare_workload as workload

TIERED = ("aggregated-tier", "kvagent-tiers", "kvagent-pd-tiers")


def _bundle_nodes(arm: str, tmp_path: Path) -> dict[str, dict]:
    """The bundle arm planned as `serve_arm` starts it: node name -> its parsed
    `--kv-transfer-config` and its argv."""
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.render import last_flag, plan
    from kvagent_server.config import validate_config

    kv = workload("long-wait", quick=True).kv
    a = ARMS[arm]
    config = a.bench_config(kv, DEFAULT_TIERS, tmp_path / "run" / TIER_DIR)
    cfg = validate_config(bundle_settings(
        config, tmp_path / "run", list(range(1, 6)), cores=sorted(os.sched_getaffinity(0)),
        kv_cache_gib=kv.node_gib(a.nodes), startup_timeout_s=1.0, model=None))
    return {s.name: {"ktc": json.loads(last_flag(s.argv, "--kv-transfer-config") or "{}"),
                     "argv": list(s.argv)}
            for s in plan(cfg, gather_inputs(cfg, build_model=False)).nodes}


def _offloading(ktc: dict) -> dict:
    children = ktc.get("kv_connector_extra_config", {}).get("connectors") or [ktc]
    return next(c for c in children if c["kv_connector"] == "OffloadingConnector")


def test_tier_arms_are_named_not_run_by_default() -> None:
    assert [a.name for a in parse_arms(",".join(TIERED))] == list(TIERED)
    default = parser().parse_args([]).arms.split(",")
    assert default == list(COMPARE_DEFAULT_ARMS) and not set(TIERED) & set(default)
    assert {ARMS[a].tier for a in TIERED} == {"local", "shared"}
    assert all(ARMS[a].tier is None for a in default)
    # the report measures kvagent with tiers when it runs, against every other arm
    assert subject_of(["aggregated-tier", "kvagent-tiers"]) == "kvagent-tiers"
    assert subject_of(["kvagent", "kvagent-tiers"]) == "kvagent-tiers"
    assert subject_of(default) == "kvagent"
    assert subject_of(["aggregated-tier", "kvagent-pd-tiers"]) == "kvagent-pd-tiers"


def test_kvagent_pd_tiers_gives_p_and_d_one_shared_disk_after_nixl(tmp_path: Path) -> None:
    nodes = _bundle_nodes("kvagent-pd-tiers", tmp_path)
    assert sorted(nodes) == ["decode-0", "prefill-0"]
    tiers = []
    for name, n in nodes.items():
        ktc = n["ktc"]
        assert ktc["kv_connector"] == "MultiConnector", name
        first, second = ktc["kv_connector_extra_config"]["connectors"]
        assert first["kv_connector"] == "NixlConnector" and "engine_id" not in second
        extra = second["kv_connector_extra_config"]
        assert extra["offload_prompt_only"] is False  # D's generated tokens reach the tier
        assert extra["spec_name"] == "KvagentTieringSpec"
        (disk,) = extra["secondary_tiers"]
        tiers.append((extra["cpu_bytes_to_use"], disk["root_dir"], disk["locality"],
                      disk["size_bytes"], disk["hash_algo"]))
        assert n["argv"][n["argv"].index("--prefix-caching-hash-algo") + 1] == "sha256"
    # the same directory, budget and hash algorithm on both: P finds what D stored
    assert tiers[0] == tiers[1]
    host, root, locality, size, _ = tiers[0]
    assert root == str(tmp_path / "run" / TIER_DIR) and locality == "REMOTE"
    assert host == (1 << 30) // 2 and size == 4 << 30  # 1 GiB split over two nodes


def test_kvagent_tiers_is_what_up_runs_here_with_the_same_budget(tmp_path: Path) -> None:
    """`kvagent-tiers` is the `kvagent` arm (topology auto) with tiers: its nodes are
    kvagent's on this machine, the host budget is split over them, and its disk tier is
    shared only when there are P and D to share it."""
    nodes = _bundle_nodes("kvagent-tiers", tmp_path)
    assert len(nodes) == ARMS["kvagent-tiers"].nodes == ARMS["kvagent"].nodes
    assert sorted(nodes) == sorted(_bundle_nodes("kvagent", tmp_path / "plain"))
    for n in nodes.values():
        extra = _offloading(n["ktc"])["kv_connector_extra_config"]
        (disk,) = extra["secondary_tiers"]
        assert extra["cpu_bytes_to_use"] == (1 << 30) // len(nodes)
        assert disk["locality"] == ("REMOTE" if len(nodes) > 1 else "LOCAL")
        assert extra["offload_prompt_only"] is False


def test_untiered_kvagent_keeps_plain_nixl(tmp_path: Path) -> None:
    for n in _bundle_nodes("kvagent", tmp_path).values():
        assert n["ktc"]["kv_connector"] == "NixlConnector"
        assert "--prefix-caching-hash-algo" not in n["argv"]


def test_aggregated_tier_gets_the_same_tiers_on_its_own(tmp_path: Path) -> None:
    kv = workload("pressure", quick=True).kv
    bc = ARMS["aggregated-tier"].bench_config(kv, DEFAULT_TIERS, tmp_path / "t")
    plain = ARMS["aggregated"].bench_config(kv)
    args = list(bc.node_args)
    assert args[:len(plain.node_args)] == list(plain.node_args)  # same step flags and cap
    ktc = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "OffloadingConnector" and ktc["kv_role"] == "kv_both"
    extra = ktc["kv_connector_extra_config"]
    (disk,) = extra["secondary_tiers"]
    assert extra["cpu_bytes_to_use"] == 1 << 30 and disk["size_bytes"] == 4 << 30
    assert disk["locality"] == "LOCAL" and disk["root_dir"] == str(tmp_path / "t")
    assert extra["offload_prompt_only"] is False
    assert bc.node_env == plain.node_env  # sha256 needs no PYTHONHASHSEED
    # the whole budget: one node's host tier equals the bundle's two halves
    bundle = _bundle_nodes("kvagent-pd-tiers", tmp_path)
    assert sum(_offloading(n["ktc"])["kv_connector_extra_config"]["cpu_bytes_to_use"]
               for n in bundle.values()) == extra["cpu_bytes_to_use"]


def test_flags_table_shows_each_nodes_tiers() -> None:
    kv = workload("long-wait", quick=True).kv
    rows = flag_rows([ARMS[a] for a in ("aggregated", "aggregated-tier", "kvagent-pd",
                                         "kvagent-pd-tiers")], kv=kv, model=None)
    cell = {(r["arm"], r["node"]): r["KV tiers"] for r in rows}
    assert cell[("aggregated", "node")] == "none"
    assert cell[("kvagent-pd", "decode-0")] == "none"
    assert cell[("aggregated-tier", "node")] == (
        "host 1 GiB, disk 4 GiB local, generated tokens too")
    for node in ("prefill-0", "decode-0"):
        assert cell[("kvagent-pd-tiers", node)] == (
            "host 0.5 GiB, disk 4 GiB shared, generated tokens too")
    blocks = {r["arm"]: r["--num-gpu-blocks-override"] for r in rows}
    assert blocks["aggregated-tier"] == blocks["aggregated"] == "272"
    assert blocks["kvagent-pd-tiers"] == blocks["kvagent-pd"] == "136"


def test_every_tiered_arm_has_the_same_budgets() -> None:
    kv = workload("pressure", quick=False).kv
    tiers = TierBudget(host_gib=2.0, disk_gib=8.0)
    mem = {a: ARMS[a].memory(kv, tiers) for a in ARMS}
    for a in TIERED:
        assert (mem[a]["host_tier_gib"], mem[a]["disk_tier_gib"]) == (2.0, 8.0)
    for a in ("aggregated", "affine-2", "pd-noreuse", "kvagent"):
        assert (mem[a]["host_tier_gib"], mem[a]["disk_tier_gib"]) == (0.0, 0.0)
    assert {(m["engine_kv_gib"], m["engine_kv_tokens"]) for m in mem.values()} == {
        (2, 34_816)}
    with pytest.raises(ValueError):
        TierBudget(host_gib=0, disk_gib=1)
    with pytest.raises(SystemExit):
        run_mod.main(["--quick", "--arms", "kvagent-tiers", "--tier-disk-gib", "0"])


def _summary(runs: list[sm.ArmRun], memory: dict | None) -> dict:
    s = sm.summary(command=["python", "-m", "benchmarks", "compare"], commit="abc",
                   machine={"cpu": "Test CPU", "cores": 2}, date="2026-01-01T00:00:00+00:00",
                   workload={"name": "long-wait", "why": "w", "kv_gib": 2, "kv_tokens": 34816},
                   slo=sm.Slo(ttft_ms=2000, itl_ms=40),
                   arms={"aggregated": "a", "kvagent-tiers": "k"},
                   order=[{"position": r.position, "rep": r.rep, "arm": r.arm,
                           "status": r.status, "error": r.error,
                           "disk_used_bytes": r.disk_used_bytes,
                           "tier_counters": r.tier_counters} for r in runs],
                   flags=[], runs=runs, subject="kvagent-tiers", raw_records=None,
                   memory=memory)
    return json.loads(json.dumps(s))


def test_the_report_states_the_memory_each_arm_used() -> None:
    kv = workload("long-wait", quick=True).kv
    tiers = DEFAULT_TIERS
    runs = [sm.ArmRun("aggregated", 0, 0, wall_s=1.0),
            sm.ArmRun("kvagent-tiers", 0, 1, wall_s=1.0, disk_used_bytes=3 << 28,
                      tier_counters={"prefill-0": {"disk": 1536.0, "device": 0.0},
                                     "decode-0": {"external_hits": 4096.0}}),
            sm.ArmRun("kvagent-tiers", 1, 2, wall_s=1.0, disk_used_bytes=1 << 28)]
    # the P/D arm's memory under the subject's name: the table must not depend on the host
    s = _summary(runs, {"aggregated": ARMS["aggregated"].memory(kv, tiers),
                        "kvagent-tiers": ARMS["kvagent-pd-tiers"].memory(kv, tiers)})
    m = s["arms"]["kvagent-tiers"]["memory"]
    assert m["disk_used_gib_max"] == pytest.approx(0.75)
    assert s["arms"]["aggregated"]["memory"]["disk_used_gib_max"] is None
    md = sm.report_md(s)
    assert "| aggregated | 1 | 2 GiB (≤ 34,816 tokens) | none | none | - | 2 GiB |" in md
    assert ("| kvagent-tiers | 2 (pd) | 2 GiB (≤ 34,816 tokens) | 1 GiB | 4 GiB shared | "
            "0.75 GiB | 7 GiB |") in md
    assert md.index("| arm | nodes | engine KV") < md.index("| arm | runs |")
    assert "#1 kvagent-tiers: prefill-0: device 0, disk 1,536; decode-0: external_hits 4,096" \
        in md


def test_a_schema_1_summary_still_reports() -> None:
    s = _summary([sm.ArmRun("aggregated", 0, 0, wall_s=1.0)], None)
    for a in s["arms"].values():  # what a schema 1 summary.json holds
        del a["memory"]
    s["schema"] = 1
    assert "Memory per arm: not recorded" in sm.report_md(s)


def test_tier_counters_read_vllms_metrics() -> None:
    family = "vllm:prompt_tokens_cached_by_source_total"
    lines = [f"# HELP {family} Prompt tokens cached, by source.",
             f"# TYPE {family} counter",
             f'{family}{{engine="0",model_name="m",source="host"}} 512.0',
             f'{family}{{engine="0",model_name="m",source="disk"}} 1024.0',
             f'{family}{{engine="1",model_name="m",source="disk"}} 128.0',
             "# HELP vllm:external_prefix_cache_hits_total External hits.",
             "# TYPE vllm:external_prefix_cache_hits_total counter",
             'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1536.0',
             "# HELP vllm:num_requests_running Running.",
             "# TYPE vllm:num_requests_running gauge",
             'vllm:num_requests_running{engine="0",model_name="m"} 1.0']
    text = "\n".join(lines) + "\n"
    assert run_mod.parse_tier_counters(text) == {"host": 512.0, "disk": 1152.0,
                                                 "external_hits": 1536.0}
    assert run_mod.tier_counters({"node": "http://127.0.0.1:9"}) == {}  # nothing listens


def test_kvagent_replicas_runs_two_kv_both_nodes_one_core_each(tmp_path: Path) -> None:
    from kvagent_server.config import validate_config

    from benchmarks.api import KvBudget, port_count

    arm = ARMS["kvagent-replicas"]
    kv = KvBudget(gib=4)
    config = arm.bench_config(kv)
    assert arm.nodes == 2 and config.topology == "replicas"
    settings = bundle_settings(config, tmp_path / "run", list(range(20000, 20000 + port_count(
        config))), cores=[0, 1], kv_cache_gib=kv.node_gib(arm.nodes), startup_timeout_s=60)
    cfg = validate_config(settings)
    assert cfg.topology == "replicas" and cfg.decode.count == 2
    rows = [r for r in flag_rows([arm], kv=kv, model=None, tiers=DEFAULT_TIERS)
            if r["arm"] == "kvagent-replicas"]
    assert [r["VLLM_CPU_OMP_THREADS_BIND"] for r in rows] == ["0", "1"]
    assert {r["VLLM_CPU_KVCACHE_SPACE"] for r in rows} == {"2"}  # the budget, split
