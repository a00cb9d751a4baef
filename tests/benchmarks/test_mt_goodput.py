"""The load mode's pure parts: arrival schedule, SLO from the idle probe, which sessions
met it, a level's summary, the goals, the report files (no server)."""

from __future__ import annotations

import random

import pytest

from benchmarks.api import (
    LevelResult,
    LoadConfigResult,
    LoadReport,
    RequestRecord,
    Slo,
    goodput,
    report,
)


def rec(conv: str, turn: int, ttft: float | None = 0.1, *, itl=(0.01, 0.01, 0.01),
        error: str | None = None, tpot: float | None = 0.01, path: str | None = None,
        completion: int = 4) -> RequestRecord:
    return RequestRecord(config="c", conversation=conv, turn=turn, start_s=0.0, ttft_s=ttft,
                         e2e_s=(ttft or 0) + 0.1, itl_s=list(itl), tpot_s=tpot,
                         completion_tokens=completion, path=path, error=error)


SLO = Slo(probe_config="aggregated", probe_requests=8, idle_ttft_first_p90_s=0.5,
          idle_ttft_later_p90_s=0.2, idle_decode_step_s=0.02, ttft_factor=2.0,
          itl_factor=3.0)


# ---------------------------------------------------------------------------- schedule

def test_arrivals_are_seeded_bounded_and_at_the_offered_rate() -> None:
    kw = {"session_s": 10.0, "window_s": 60.0, "max_sessions": 1000}
    a = goodput.arrival_offsets(4, rng=random.Random(7), **kw)
    assert a == goodput.arrival_offsets(4, rng=random.Random(7), **kw)
    assert a != goodput.arrival_offsets(4, rng=random.Random(8), **kw)
    assert a == sorted(a) and all(0 <= t < 60 for t in a)
    # rate = level / session_s = 0.4/s: 24 arrivals expected in 60 s, averaged over draws
    counts = [len(goodput.arrival_offsets(4, rng=random.Random(s), **kw)) for s in range(300)]
    assert sum(counts) / len(counts) == pytest.approx(24, rel=0.05)
    doubled = [len(goodput.arrival_offsets(8, rng=random.Random(s), **kw)) for s in range(300)]
    assert sum(doubled) / len(doubled) == pytest.approx(48, rel=0.05)


def test_arrivals_capped_and_never_empty() -> None:
    many = goodput.arrival_offsets(100, session_s=1.0, window_s=60.0, max_sessions=5,
                                   rng=random.Random(0))
    assert len(many) == 5
    # rate 1/1000 s in a 1 s window: almost surely no draw, still one session at 0
    assert goodput.arrival_offsets(1, session_s=1000.0, window_s=1.0, max_sessions=5,
                                   rng=random.Random(0)) == [0.0]
    with pytest.raises(ValueError):
        goodput.arrival_offsets(0, session_s=1.0, window_s=1.0, max_sessions=1,
                                rng=random.Random(0))


def test_think_times_count_cap_and_zero() -> None:
    ts = goodput.think_times(2000, 1.5, random.Random(1))
    assert len(ts) == 1999
    assert max(ts) <= goodput.THINK_CAP_FACTOR * 1.5 and min(ts) >= 0
    assert sum(ts) / len(ts) == pytest.approx(1.5, rel=0.1)
    assert goodput.think_times(4, 0.0, random.Random(1)) == [0.0, 0.0, 0.0]
    assert goodput.think_times(1, 1.0, random.Random(1)) == []


def test_nominal_session_and_level_seed() -> None:
    assert goodput.nominal_session_s(4, 1.5, 0.5) == pytest.approx(6.5)
    assert goodput.nominal_session_s(1, 1.5, 0.5) == pytest.approx(0.5)
    assert len({goodput.level_seed(0, lv) for lv in (0, 1, 2, 4, 8)}) == 5


# ---------------------------------------------------------------------------- SLO

def test_idle_slo_from_probe_records() -> None:
    probe = [rec("a", 0, 0.4, tpot=0.02), rec("a", 1, 0.1, tpot=0.02),
             rec("b", 0, 0.6, tpot=0.03), rec("b", 1, 0.3, tpot=0.01),
             rec("b", 2, 9.0, error="boom")]  # failed requests do not set the bounds
    slo = goodput.idle_slo(probe, probe_config="aggregated", ttft_factor=2, itl_factor=3)
    assert slo.probe_requests == 5
    assert slo.idle_ttft_first_p90_s == pytest.approx(0.58)  # p90 of 0.4, 0.6
    assert slo.idle_ttft_later_p90_s == pytest.approx(0.28)
    assert slo.idle_decode_step_s == pytest.approx(0.02)
    assert (slo.ttft_first_s, slo.ttft_later_s, slo.itl_s) == pytest.approx((1.16, 0.56, 0.06))
    dumped = slo.model_dump()
    assert dumped["itl_s"] == pytest.approx(0.06)  # the bounds used are in the JSON
    assert Slo.model_validate(dumped) == slo


def test_idle_slo_needs_both_turn_classes_and_decode_times() -> None:
    with pytest.raises(ValueError, match="later turns"):
        goodput.idle_slo([rec("a", 0)], probe_config="x")
    with pytest.raises(ValueError):
        goodput.idle_slo([rec("a", 0, tpot=None), rec("a", 1, tpot=None)], probe_config="x")


@pytest.mark.parametrize(("record", "meets"), [
    (rec("a", 0, 0.99), True),  # first turn: bound 1.0
    (rec("a", 0, 1.01), False),
    (rec("a", 1, 0.39), True),  # later turn: bound 0.4
    (rec("a", 1, 0.41), False),
    (rec("a", 1, None), False),
    (rec("a", 1, 0.1, error="HTTP 503"), False),
])
def test_turn_meets_ttft(record, meets) -> None:
    assert goodput.turn_meets_ttft(record, SLO) is meets


def test_session_itl_p99_pools_the_turns() -> None:
    # 4 turns x 31 gaps, one stall of 0.2 s: the pooled p99 tolerates it, the stalled
    # turn's own p99 (31 gaps) would not
    turns = [rec("a", t, itl=[0.01] * 30 + [0.2 if t == 2 else 0.01]) for t in range(4)]
    assert goodput.session_itl_p99(turns) == pytest.approx(0.01)
    assert goodput.session_itl_p99(turns[2:3]) > SLO.itl_s
    assert goodput.session_itl_p99([rec("a", 0, itl=())]) is None


def test_session_outcomes() -> None:
    records = [rec("met", 0), rec("met", 1),
               rec("slow", 0), rec("slow", 1, 5.0),
               rec("jerky", 0, itl=[0.01, 0.3]), rec("jerky", 1, itl=[0.01, 0.3]),
               rec("single", 0, itl=()), rec("single", 1, itl=()),
               rec("fail", 0), rec("fail", 1, error="boom"),
               rec("cut", 0)]
    out = goodput.session_outcomes(
        records, ["met", "slow", "jerky", "single", "fail", "cut", "never"], 2,
        ["cut", "never"], SLO)
    assert out == {"met": "met", "slow": "missed", "jerky": "missed", "single": "met",
                   "fail": "failed", "cut": "cancelled", "never": "cancelled"}


# ---------------------------------------------------------------------------- a level

def test_summarize_level_goodput_throughput_and_distributions() -> None:
    records = [rec("a", 0, 0.5, path="pd_fresh"), rec("a", 1, 0.1, path="d_direct"),
               rec("b", 0, 0.6, path="pd_fresh"), rec("b", 1, 0.9, path="d_direct"),
               rec("c", 0, 0.4, path="pd_fresh")]
    lv = goodput.summarize_level(2, records, sessions=["a", "b", "c"], turns=2,
                                 cancelled=["c"], window_s=30.0, wall_s=10.0, slo=SLO,
                                 max_error_rate=0.1)
    assert (lv.sessions, lv.sessions_met, lv.sessions_finished, lv.sessions_cancelled) == (
        3, 1, 2, 1)
    assert lv.goodput_sessions_per_min == pytest.approx(2.0)  # 1 session in half a minute
    assert lv.offered_sessions_per_min == pytest.approx(6.0)
    assert lv.turns_within_ttft == 4 and lv.requests == 5 and lv.errors == 0
    assert lv.turns_per_s == pytest.approx(0.5)
    assert lv.output_tokens_per_s == pytest.approx(2.0)
    assert lv.paths == {"d_direct": 2, "pd_fresh": 3}
    assert lv.ttft_first_s.n == 3 and lv.ttft_later_s.n == 2
    assert lv.itl_s.n == 15 and lv.itl_s.p99 == pytest.approx(0.01)
    # later-turn p90 (0.82) is over its 0.4 bound: the level as a whole misses the SLO
    assert not lv.slo_met_level and not lv.broken and lv.broken_reason is None
    assert len(lv.records) == 5


def test_level_broken_without_goodput_or_with_errors() -> None:
    kw = {"sessions": ["a", "b"], "turns": 1, "cancelled": [], "window_s": 60.0,
          "wall_s": 5.0, "slo": SLO}
    slow = goodput.summarize_level(1, [rec("a", 0, 3.0), rec("b", 0, 3.0)],
                                   max_error_rate=0.5, **kw)
    assert slow.broken and slow.broken_reason == "no session met the SLO"
    errs = goodput.summarize_level(1, [rec("a", 0), rec("b", 0, error="x")],
                                   max_error_rate=0.1, **kw)
    assert errs.goodput_sessions_per_min == pytest.approx(1.0)
    assert errs.broken and "50% of requests failed" in (errs.broken_reason or "")
    assert errs.error_rate == pytest.approx(0.5)
    fine = goodput.summarize_level(1, [rec("a", 0), rec("b", 0)], max_error_rate=0.1, **kw)
    assert not fine.broken and fine.slo_met_level
    none = goodput.summarize_level(1, [], max_error_rate=0.1,
                                   **{**kw, "cancelled": ["a", "b"]})
    assert none.broken and none.error_rate == 0 and not none.slo_met_level


# ---------------------------------------------------------------------------- goals

def level(n: int, goodput_per_min: float, itl_p99: float | None = 0.05,
          broken: bool = False) -> LevelResult:
    lv = goodput.summarize_level(n, [rec("a", 0)], sessions=["a"], turns=1, cancelled=[],
                                 window_s=60.0, wall_s=1.0, slo=SLO, max_error_rate=0.1)
    upd = {"goodput_sessions_per_min": goodput_per_min, "broken": broken,
           "broken_reason": "no session met the SLO" if broken else None,
           "itl_s": lv.itl_s.model_copy(update={"p99": itl_p99})}
    return lv.model_copy(update=upd)


def cfg(name: str, *levels: LevelResult) -> LoadConfigResult:
    return LoadConfigResult(name=name, description=name, status="ok", levels=list(levels),
                            stopped_at=levels[-1].level if levels else None)


def test_load_targets() -> None:
    configs = [
        cfg("aggregated", level(1, 6, 0.03), level(2, 10, 0.08), level(4, 4, 0.2, True)),
        cfg("kvagent", level(1, 6, 0.03), level(2, 12, 0.04), level(4, 20, 0.05),
            level(8, 0, 0.3, True)),
        cfg("pd_noreuse_pcache_on", level(1, 6), level(2, 8, broken=True)),
        cfg("kvagent_always_d_direct", level(1, 6), level(2, 16)),
        cfg("kvagent_always_pd_reuse", level(1, 6), level(2, 25)),
        cfg("kvagent_2p", level(1, 6), level(2, 30)),  # not a baseline
    ]
    t = goodput.load_targets(configs)
    assert t.peak_goodput["kvagent"] == 20 and t.best_baseline == "aggregated"
    assert t.kvagent_over_best_baseline == pytest.approx(2.0)
    assert t.met["kvagent peak goodput >= 1.5x best baseline"] is True
    # highest level both ran: 4 (aggregated broke there but it ran)
    assert (t.itl_p99_level, t.kvagent_itl_p99_s, t.aggregated_itl_p99_s) == (4, 0.05, 0.2)
    assert t.met["kvagent ITL p99 < aggregated's under load"] is True
    assert t.cost_model_over == pytest.approx({"kvagent_always_d_direct": 1.25,
                                               "kvagent_always_pd_reuse": 0.8})
    assert t.met["cost model peak goodput >= kvagent_always_d_direct"] is True
    assert t.met["cost model peak goodput >= kvagent_always_pd_reuse"] is False


def test_load_targets_partial_runs() -> None:
    t = goodput.load_targets([cfg("aggregated", level(1, 0, broken=True)),
                              cfg("kvagent", level(1, 3))])
    assert t.kvagent_over_best_baseline is None  # over zero: no ratio, but the goal is met
    assert t.met["kvagent peak goodput >= 1.5x best baseline"] is True
    assert t.cost_model_over == {}
    empty = goodput.load_targets([cfg("kvagent")])
    assert empty.best_baseline is None and empty.itl_p99_level is None and empty.met == {}


def test_sign_test_p() -> None:
    assert goodput.sign_test_p(0, 5) == goodput.sign_test_p(5, 5) == pytest.approx(1 / 16)
    assert goodput.sign_test_p(1, 10) == pytest.approx(2 * 11 / 1024)
    assert goodput.sign_test_p(2, 4) == goodput.sign_test_p(0, 0) == 1.0
    assert goodput.sign_test_p(3, 7) == goodput.sign_test_p(4, 7) == 1.0
    with pytest.raises(ValueError):
        goodput.sign_test_p(3, 2)


def judged(n: int, met: str, missed: str = "", failed: str = "", cancelled: str = ""
           ) -> LevelResult:
    """Level `n` of one-turn sessions named by letters: those in `met` met the SLO, those
    in `missed` answered too late, `failed` errored, `cancelled` left no answer."""
    records = ([rec(s, 0) for s in met] + [rec(s, 0, 5.0) for s in missed]
               + [rec(s, 0, error="x") for s in failed])
    return goodput.summarize_level(n, records, sessions=list(met + missed + failed + cancelled),
                                   turns=1, cancelled=list(cancelled), window_s=60.0,
                                   wall_s=1.0, slo=SLO, max_error_rate=1.0)


def test_paired_sessions() -> None:
    # level 1: both meet a; only x meets b and d; neither meets c; level 2 only x ran
    x = cfg("kvagent", judged(1, "abd", "c"), judged(2, "ab"))
    y = cfg("kvagent_always_d_direct", judged(1, "a", "c", "b", "d"))
    assert y.levels[0].session_outcome == {"a": "met", "c": "missed", "b": "failed",
                                           "d": "cancelled"}
    p = goodput.paired_sessions(x, y)
    assert p is not None and p.levels == [1]
    assert (p.sessions, p.both, p.only_a, p.only_b, p.neither) == (4, 1, 2, 0, 1)
    assert p.p_value == pytest.approx(0.5)
    back = goodput.paired_sessions(y, x)
    assert back is not None and (back.only_a, back.only_b) == (0, 2)
    assert goodput.paired_sessions(x, cfg("kvagent_always_pd_reuse", judged(4, "a"))) is None
    old = y.model_copy(update={"levels": [y.levels[0].model_copy(
        update={"session_outcome": {}})]})
    assert goodput.paired_sessions(x, old) is None  # recorded before outcomes were kept


def test_load_targets_pair_each_cost_model_with_each_fixed_policy() -> None:
    configs = [cfg("aggregated", judged(1, "a", "bc")),
               cfg("kvagent", judged(1, "abc")),
               cfg("kvagent_queue_aware", judged(1, "ab", "c")),
               cfg("kvagent_always_d_direct", judged(1, "a", "bc")),
               cfg("kvagent_always_pd_reuse", judged(1, "", "abc"))]
    t = goodput.load_targets(configs)
    assert [(p.a, p.b, p.only_a, p.only_b) for p in t.paired] == [
        ("kvagent", "kvagent_always_d_direct", 2, 0),
        ("kvagent", "kvagent_always_pd_reuse", 3, 0),
        ("kvagent_queue_aware", "kvagent_always_d_direct", 1, 0),
        ("kvagent_queue_aware", "kvagent_always_pd_reuse", 2, 0),
        ("kvagent", "aggregated", 2, 0)]
    assert goodput.load_targets(configs[:2]).paired[0].b == "aggregated"
    assert goodput.load_targets(configs[1:3]).paired == []


# ---------------------------------------------------------------------------- report

def test_load_report_files(tmp_path) -> None:
    configs = [cfg("aggregated", level(1, 6, 0.03), level(2, 0, 0.2, True)),
               cfg("kvagent", level(1, 6, 0.03),
                   level(2, 12, 0.04).model_copy(update={"placements": {"prefill:tier_hit": 2}})),
               LoadConfigResult(name="kvagent_2p", description="x", status="failed",
                                error="RuntimeError: no")]
    rep = LoadReport(created_at="2026-12-01T00:00:00+00:00", command=["python", "-m", "x"],
                     machine={"cores": 2}, versions={"python": "3.11"},
                     load={"levels": [1, 2], "level_s": 60}, slo=SLO,
                     idle_probe=[rec("p", 0)], configs=configs,
                     targets=goodput.load_targets(configs))
    paths = report.write_load(rep, tmp_path)
    assert LoadReport.model_validate_json(paths["json"].read_text()) == rep
    small = LoadReport.model_validate_json(paths["levels_json"].read_text())
    assert small.targets == rep.targets and small.slo == rep.slo and not small.idle_probe
    assert [len(lv.records) for c in small.configs for lv in c.levels] == [0] * 4
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["summary"].read_text()
    assert "**1000 ms**" in md and "**400 ms**" in md and "**60 ms**" in md  # the bounds
    assert "| kvagent | 2 | 1 | 1 | 0 | **12.0** |" in md
    assert "| aggregated | 2 |" in md and "no session met the SLO" in md
    assert "**kvagent_2p** failed: RuntimeError: no" in md
    assert "kvagent / best baseline (aggregated) peak goodput = 2.00" in md
    assert "foreign_vllm_max = 0 in every level." in md
    assert "- kvagent level 2: prefill:tier_hit 2" in md
    assert "| kvagent | aggregated | 1, 2 | 2 | 2 | 0 | 0 | 0 | 1.000 |" in md


METRICS = """\
# HELP kvagent_router_prefill_placements_total P-node choices by reason.
# TYPE kvagent_router_prefill_placements_total counter
kvagent_router_prefill_placements_total{reason="least_loaded"} 3.0
kvagent_router_prefill_placements_total{reason="tier_hit"} 5.0
# HELP kvagent_router_decode_placements_total D-node choices by reason.
# TYPE kvagent_router_decode_placements_total counter
kvagent_router_decode_placements_total{reason="affinity"} 7.0
# HELP kvagent_router_turns_total Turns.
# TYPE kvagent_router_turns_total counter
kvagent_router_turns_total{path="d_direct"} 9.0
"""


def test_placement_counts_and_delta() -> None:
    after = goodput.placement_counts(METRICS)
    assert after == {"prefill:least_loaded": 3.0, "prefill:tier_hit": 5.0,
                     "decode:affinity": 7.0}
    assert goodput.placement_counts("") == {}
    before = {"prefill:least_loaded": 3.0, "decode:affinity": 2.0}
    assert goodput.counter_delta(before, after) == {"decode:affinity": 5.0,
                                                    "prefill:tier_hit": 5.0}


def test_missed_by_names_each_bound() -> None:
    records = [rec("a", 0, 1.5), rec("a", 1, 0.1),  # first turn slow
               rec("b", 0, 0.1), rec("b", 1, 0.5, itl=[0.01, 0.3]),  # later turn + ITL
               rec("c", 0), rec("c", 1)]  # met: not counted
    assert goodput.missed_by(records, ["a", "b"], SLO) == {
        "first_turn_ttft": 1, "itl_p99": 1, "later_turn_ttft": 1}
    lv = goodput.summarize_level(1, records, sessions=["a", "b", "c"], turns=2, cancelled=[],
                                 window_s=60, wall_s=5, slo=SLO, max_error_rate=0.1)
    assert lv.missed_by == {"first_turn_ttft": 1, "itl_p99": 1, "later_turn_ttft": 1}


def _recorded_run() -> LoadReport:
    records = [rec("a", 0, 0.9), rec("a", 1, 0.5), rec("b", 0, 0.2), rec("b", 1, 0.2),
               rec("c", 0, 0.2)]  # c cut at the drain cap after its first turn
    lv = goodput.summarize_level(2, records, sessions=["a", "b", "c", "d"], turns=2,
                                 cancelled=["c", "d"], window_s=60, wall_s=30, slo=SLO,
                                 max_error_rate=0.1)
    lv = lv.model_copy(update={"foreign_vllm_max": 0, "placements": {"prefill:x": 1.0},
                               "load_avg_max": 2.5, "steal_s": 0.25,
                               "other_cpu_s": {"cc1": 3.0, "make": 0.5}})
    configs = [cfg("kvagent", lv),
               cfg("aggregated", lv.model_copy(update={"steal_s": None, "other_cpu_s": {}}))]
    return LoadReport(created_at="t", command=["x"], machine={}, versions={},
                      load={"turns": 2, "max_error_rate": 0.1}, slo=SLO, configs=configs,
                      targets=goodput.load_targets(configs))


def test_rescore_rejudges_the_recorded_requests() -> None:
    rep = _recorded_run()
    lv = rep.configs[0].levels[0]
    assert (lv.sessions_met, lv.sessions_cancelled, lv.goodput_sessions_per_min) == (1, 2, 1)
    loose = goodput.rescore(rep, ttft_factor=4.0, itl_factor=3.0)
    lv2 = loose.configs[0].levels[0]
    assert (lv2.sessions, lv2.sessions_met, lv2.sessions_cancelled) == (4, 2, 2)
    assert lv2.goodput_sessions_per_min == 2 and lv2.placements == {"prefill:x": 1.0}
    assert lv2.foreign_vllm_max == 0 and lv2.load_avg_max == 2.5 and len(lv2.records) == 5
    assert lv2.steal_s == 0.25 and lv2.other_cpu_s == {"cc1": 3.0, "make": 0.5}
    assert loose.slo is not None and loose.slo.ttft_later_s == pytest.approx(0.8)
    assert loose.targets.peak_goodput == {"kvagent": 2.0, "aggregated": 2.0}
    assert loose.rescored == {"ttft_factor": 4.0, "itl_factor": 3.0,
                              "original": {"ttft_factor": 2.0, "itl_factor": 3.0}}
    # the same factors give back the recorded judgement
    same = goodput.rescore(rep, ttft_factor=2.0, itl_factor=3.0)
    assert same.configs[0].levels[0].model_dump() == lv.model_dump()
    with pytest.raises(ValueError):
        goodput.rescore(rep.model_copy(update={"slo": None}), ttft_factor=1, itl_factor=1)


def test_rescore_a_run_recorded_before_outcomes_were_kept() -> None:
    rep = _recorded_run()
    old = rep.model_copy(update={"configs": [c.model_copy(update={"levels": [
        lv.model_copy(update={"session_outcome": {}}) for lv in c.levels]})
        for c in rep.configs]})
    lv = goodput.rescore(old, ttft_factor=4.0, itl_factor=3.0).configs[0].levels[0]
    # d left no record: it keeps its place as a cancelled session under another name
    assert (lv.sessions, lv.sessions_met, lv.sessions_cancelled) == (4, 2, 2)
    assert lv.session_outcome == {"a": "met", "b": "met", "c": "cancelled",
                                  "(no record 0)": "cancelled"}


def test_rescore_cli(tmp_path) -> None:
    from benchmarks.api import load

    src = tmp_path / "run"
    report.write_load(_recorded_run(), src)
    assert load.main(["--rescore", str(src / "results.json"), "--ttft-factor", "4"]) == 0
    out = src / "rescored-4x-3x"
    md = (out / "summary.md").read_text()
    assert "**Re-judged**" in md and (out / "goodput.png").exists()
    assert "Highest 1-minute load average per level (cores: ?): kvagent 2: 2.5" in md
    assert ("kvagent 2: steal 0.2 s, others 3.5 s (cc1 3.0, make 0.5); "
            "aggregated 2: steal ?, others 0.0 s") in md
    assert LoadReport.model_validate_json((out / "results.json").read_text()).rescored
