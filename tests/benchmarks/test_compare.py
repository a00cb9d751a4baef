"""`python -m benchmarks compare` without vLLM: the run order, the arms' flags, the
workloads, and the summary's schema and report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.api import COMPARE_ARMS as ARMS
from benchmarks.api import (
    DEFAULT_TIERS,
    WORKLOADS,
    KvBudget,
    RequestRecord,
    aggregated_step_args,
    benchmarks_main,
    flag_rows,
    generate,
    parse_arms,
    sticky_round_robin,
)
from benchmarks.api import compare_parser as parser
from benchmarks.api import compare_summary as sm
from benchmarks.api import compare_workload as workload


def test_order_is_abba_so_no_arm_always_runs_first() -> None:
    order = sm.run_order(["a", "b", "c"], 4)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                     (2, "a"), (2, "b"), (2, "c"), (3, "c"), (3, "b"), (3, "a")]
    positions = {a: [i % 3 for i, (_, x) in enumerate(order) if x == a] for a in "abc"}
    assert all(sum(p) == sum(positions["a"]) for p in positions.values())  # balanced
    with pytest.raises(ValueError):
        sm.run_order(["a"], 0)


def test_arms_parse_and_sessions_stick_to_one_node() -> None:
    assert [a.name for a in parse_arms("kvagent,aggregated")] == ["kvagent", "aggregated"]
    for bad in ("", "kvagent,nope", "kvagent,kvagent"):
        with pytest.raises(ValueError):
            parse_arms(bad)
    route = sticky_round_robin(["u0", "u1"])
    assert [route(i, None) for i in range(5)] == ["u0", "u1", "u0", "u1", "u0"]


def test_kv_budget_is_the_same_in_all_for_every_arm() -> None:
    kv = workload("pressure", quick=True).kv
    assert kv.node_gib(1) == 2 and kv.node_gib(2) == 1
    assert kv.node_args(1)[-1] == "272" and kv.node_args(2)[-1] == "136"
    assert 136 * 128 >= 16_384  # the longest prompt fits one node's cap
    assert KvBudget(gib=4).node_args(2) == []
    with pytest.raises(ValueError):
        KvBudget(gib=3).node_gib(2)


def test_aggregated_nodes_get_the_step_flags_of_kvagents_decode_node() -> None:
    rows = flag_rows(list(ARMS.values()), kv=KvBudget(gib=4), model=None)
    d = next(r for r in rows if r["arm"] == "kvagent-pd" and r["node"].startswith("decode"))
    step = ("--max-num-batched-tokens", "--long-prefill-token-threshold", "--block-size",
            "KVAGENT_PLUGIN", "KVAGENT_SPIN_MS", "KVAGENT_SPIN_NAP_US")
    for r in rows:
        if r["arm"] in ("aggregated", "affine-2"):
            assert {k: r[k] for k in step} == {k: d[k] for k in step}, r
    assert "--long-prefill-token-threshold" in aggregated_step_args()
    kv_space = {r["arm"]: r["VLLM_CPU_KVCACHE_SPACE"] for r in rows}
    assert kv_space["aggregated"] == "4" and kv_space["kvagent-pd"] == "2"
    assert kv_space["affine-2"] == "2" and kv_space["pd-noreuse"] == "2"
    # `kvagent` is what `up` runs here: one node holding the whole budget where that is
    # `single`, the P/D split otherwise.
    single = ARMS["kvagent"].resolved_topology == "single"
    assert kv_space["kvagent"] == ("4" if single else "2")


def test_the_kvagent_arm_runs_what_up_picks_on_the_machine(monkeypatch) -> None:
    from kvagent_server.bundle import inputs
    from kvagent_server.bundle.topology import HostFacts

    arm = ARMS["kvagent"]
    for gpus, topology, nodes in ((0, "single", 1), (1, "single", 1), (2, "pd", 2)):
        monkeypatch.setattr(inputs, "detect_host",
                            lambda g=gpus: HostFacts(cpu_cores=(0, 1), gpu_count=g))
        assert (arm.resolved_topology, arm.nodes) == (topology, nodes)
        assert arm.bench_config(KvBudget(gib=4)).topology == topology
        assert arm.memory(KvBudget(gib=4), DEFAULT_TIERS)["topology"] == topology
    monkeypatch.setattr(inputs, "detect_host", lambda: HostFacts(cpu_cores=(0, 1), gpu_count=0))
    rows = [r for r in flag_rows([arm, ARMS["kvagent-pd"]], kv=KvBudget(gib=4), model=None)]
    assert [(r["arm"], r["node"]) for r in rows] == [
        ("kvagent", "decode-0"), ("kvagent-pd", "prefill-0"), ("kvagent-pd", "decode-0")]
    assert ARMS["kvagent-pd"].resolved_topology == "pd" and ARMS["aggregated"].nodes == 1


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("quick", [True, False])
def test_every_workload_generates(name: str, quick: bool) -> None:
    nw = workload(name, quick=quick)
    wl = generate(nw.spec)
    assert len(wl.conversations) == nw.spec.conversations and nw.kv.gib % 2 == 0
    if name == "long-wait":
        assert nw.think_s > 0
    if nw.kv.tokens is not None:  # the sessions' first prompts alone overflow the cap
        s = nw.spec
        assert s.conversations * (s.system_prompt_tokens + s.context_tokens) > nw.kv.tokens


def _rec(conv: str, turn: int, ttft: float, gaps: list[float], **kw: object) -> RequestRecord:
    return RequestRecord(config="x", conversation=conv, turn=turn, start_s=0.0, ttft_s=ttft,
                         e2e_s=ttft + sum(gaps), itl_s=gaps, prompt_tokens=1000,
                         cached_tokens=800, **kw)  # type: ignore[arg-type]


def _runs() -> list[sm.ArmRun]:
    fast = [_rec("c0", 0, 0.5, [0.01] * 5), _rec("c0", 1, 0.1, [0.01] * 5, reused_tokens=900),
            _rec("c1", 0, 0.5, [0.01] * 5), _rec("c1", 1, 0.1, [0.09] * 5, reused_tokens=900)]
    slow = [_rec("c0", 0, 0.4, [0.01] * 5), _rec("c0", 1, 3.0, [0.01] * 5)]
    return [sm.ArmRun("kvagent", 0, 0, records=fast, wall_s=60.0, startup_s=30.0),
            sm.ArmRun("aggregated", 0, 1, records=slow, wall_s=60.0, startup_s=20.0),
            sm.ArmRun("aggregated", 1, 2, records=slow, wall_s=60.0),
            sm.ArmRun("kvagent", 1, 3, status="failed", error="boom")]


def test_summary_follows_schema_2_and_names_where_kvagent_loses() -> None:
    runs = _runs()
    s = sm.summary(command=["python", "-m", "benchmarks", "compare"], commit="abc",
                   machine={"cpu": "Test CPU", "cores": 2}, date="2026-01-01T00:00:00+00:00",
                   workload={"name": "agent", "why": "w", "kv_gib": 4, "kv_tokens": None},
                   slo=sm.Slo(ttft_ms=2000, itl_ms=40), arms={"aggregated": "a", "kvagent": "k"},
                   order=[{"position": r.position, "rep": r.rep, "arm": r.arm,
                           "status": r.status, "error": r.error} for r in runs],
                   flags=[], runs=runs, subject="kvagent", raw_records="/tmp/x.jsonl.gz")
    s = json.loads(json.dumps(s))  # what summary.json holds
    assert s["schema"] == sm.SCHEMA == 2
    for key in ("command", "commit", "machine", "date", "slo", "arms", "order", "workload",
                "vs_best_baseline", "does_not_help"):
        assert key in s
    k = s["arms"]["kvagent"]["figures"]
    assert k["runs"] == 2 and k["failed_runs"] == 1
    assert k["goodput"]["ttft"] == {"sessions_met": 2, "sessions": 2, "fraction": 1.0,
                                    "per_min": 2.0}  # one minute of workload ran
    assert k["goodput"]["itl"]["sessions_met"] == 1  # c1's gaps are 90 ms
    assert k["reuse_ratio"] == pytest.approx(0.9)
    agg = s["arms"]["aggregated"]["figures"]
    assert agg["goodput"]["ttft"]["sessions_met"] == 0 and agg["reuse_ratio"] is None
    cmp = s["vs_best_baseline"]
    assert cmp["later-turn TTFT p50"]["ratio"] == pytest.approx(100 / 3000)
    assert "first-turn TTFT p90: aggregated" in s["does_not_help"]
    assert "ITL p99: aggregated" in s["does_not_help"]
    md = sm.report_md(s)
    assert md.index("SLOs (set before the run)") < md.index("| arm |")
    assert "Test CPU" in md and "/tmp/x.jsonl.gz" in md and "boom" in md
    assert sm.later_ttft_p50_ms(runs[1]) == pytest.approx(3000)
    # kvagent's rep 0 turn 1 of c0 (0.1 s) against aggregated's (3.0 s); c1 has no pair,
    # nor has kvagent's failed rep 1
    assert s["paired_later_ttft"] == {"aggregated": {
        "n": 1, "median_diff_ms": pytest.approx(-2900), "subject_faster": 1.0}}
    assert "1 pairs): kvagent − aggregated TTFT median -2,900 ms; kvagent faster in 100 %" in md


def test_a_failed_session_meets_no_slo() -> None:
    recs = [_rec("c", 0, 0.1, [0.01]), _rec("c", 1, 0.1, [], error="HTTP 500")]
    assert sm.session_verdicts(recs, sm.Slo(ttft_ms=1e9, itl_ms=1e9)) == {
        "ttft": False, "itl": False, "both": False}


def test_the_command_parses_and_the_dispatcher_lists_it(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    args = parser().parse_args(["--quick", "--workload", "pressure", "--arms", "kvagent"])
    assert args.quick and args.workload == "pressure" and args.itl_ms == 40.0
    assert benchmarks_main(["--help"]) == 0
    assert "compare" in capsys.readouterr().err
    assert benchmarks_main(["nope"]) == 2


def test_the_command_writes_one_report_even_when_interrupted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole command with each arm's run faked: ABBA order, report and summary in
    `--out`, the records under its raw/, an interruption reported, not lost."""
    from benchmarks.api import compare_run as run_mod

    seen: list[str] = []

    def fake_drive(arm, nw, wl, run, work_dir, args, kv, tiers) -> None:  # type: ignore[no-untyped-def]
        if run.position == 3:
            raise KeyboardInterrupt
        seen.append(arm.name)
        run.startup_s, run.wall_s = 1.0, 2.0
        run.records = [_rec(c.id, t, 0.1, [0.01] * 3) for c in wl.conversations
                       for t in range(len(c.turns))]

    monkeypatch.setattr(run_mod, "drive_arm", fake_drive)
    monkeypatch.setattr(run_mod, "flag_rows", lambda arms, **kw: [
        {"arm": a.name, "node": "n", "--block-size": "128"} for a in arms])
    rc = run_mod.main(["--quick", "--arms", "aggregated,kvagent", "--out", str(tmp_path)])
    assert rc == 130 and seen == ["aggregated", "kvagent", "kvagent"]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["schema"] == 2 and s["command"][:4] == ["python", "-m", "benchmarks", "compare"]
    assert [(o["arm"], o["status"]) for o in s["order"]] == [
        ("aggregated", "ok"), ("kvagent", "ok"), ("kvagent", "ok"),
        ("aggregated", "interrupted")]
    assert s["slo"] == {"ttft_later_p90_ms": 2000.0, "itl_p99_ms": 40.0,
                        "judged": "per session; goodput = sessions meeting the SLO"}
    assert (tmp_path / "raw" / "records.jsonl.gz").exists()
    assert "| `--block-size` | 128 | 128 |" in (tmp_path / "report.md").read_text()
