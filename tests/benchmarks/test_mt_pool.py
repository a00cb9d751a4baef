"""Recorded load draws pooled: per-draw counts from a report, the pooled ratio, the sign
test and the bootstrap interval over draws, one set of idle figures for every draw, the
command line."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.api import (
    LevelResult,
    LoadConfigResult,
    LoadReport,
    RequestRecord,
    Slo,
    goodput,
    pool,
    report,
)

SLO = Slo(probe_config="aggregated", probe_requests=8, idle_ttft_first_p90_s=0.5,
          idle_ttft_later_p90_s=0.2, idle_decode_step_s=0.02, ttft_factor=2.0,
          itl_factor=3.0)


def level(n: int, met: str, missed: str, *, foreign: int | None = 0) -> LevelResult:
    """Level `n` of one-turn sessions named by letters: `met` within the SLO, `missed`
    answered too late."""
    records = [RequestRecord(config="c", conversation=s, turn=0, start_s=0.0,
                             ttft_s=0.1 if s in met else 5.0, e2e_s=5.1, itl_s=[0.01],
                             tpot_s=0.01, completion_tokens=2) for s in met + missed]
    lv = goodput.summarize_level(n, records, sessions=list(met + missed), turns=1,
                                 cancelled=[], window_s=60.0, wall_s=1.0, slo=SLO,
                                 max_error_rate=1.0)
    return lv.model_copy(update={"foreign_vllm_max": foreign})


def load_report(seed: int, *configs: tuple[str, list[LevelResult]], slo: Slo = SLO
                ) -> LoadReport:
    results = [LoadConfigResult(name=name, description=name, status="ok", levels=levels)
               for name, levels in configs]
    return LoadReport(created_at=f"2026-12-05T0{seed % 10}:00:00+00:00", command=["x"],
                      machine={}, versions={},
                      load={"seed": seed, "turns": 1, "max_error_rate": 1.0}, slo=slo,
                      configs=results, targets=goodput.load_targets(results))


def draw(met_a: int, met_b: int, *, only_a: int = 0, only_b: int = 0) -> pool.Draw:
    return pool.Draw(source="x", created_at="t", seed=1, level=2, offered=40, met_a=met_a,
                     met_b=met_b, only_a=only_a, only_b=only_b, foreign_vllm_max=0)


def test_draw_of_pairs_sessions_at_the_highest_common_level() -> None:
    rep = load_report(7, ("aggregated", [level(1, "ab", "c"), level(2, "ab", "cde")]),
                      ("kvagent", [level(1, "abc", ""), level(2, "acd", "be", foreign=2)]),
                      ("kvagent_2p", [level(3, "a", "")]))
    d = pool.draw_of(rep, "seed7")
    assert (d.seed, d.level, d.offered, d.met_a, d.met_b) == (7, 2, 5, 3, 2)
    assert (d.only_a, d.only_b, d.foreign_vllm_max) == (2, 1, 2)  # c, d / b
    back = pool.draw_of(rep, "seed7", a="aggregated", b="kvagent")
    assert (back.met_a, back.only_a, back.only_b) == (2, 1, 2)
    with pytest.raises(ValueError, match="no configuration pd_noreuse"):
        pool.draw_of(rep, "seed7", b="pd_noreuse")
    with pytest.raises(ValueError, match="no level in common"):
        pool.draw_of(rep, "seed7", b="kvagent_2p")


def test_pool_sums_draws_and_tests_the_discordant_sessions() -> None:
    p = pool.pool([draw(20, 10, only_a=12, only_b=2), draw(9, 10, only_a=1, only_b=2)],
                  resamples=200)
    assert (p.met_a, p.met_b, p.offered) == (29, 20, 80)
    assert p.ratio == pytest.approx(1.45)
    assert (p.only_a, p.only_b) == (13, 4)
    assert p.p_value == pytest.approx(goodput.sign_test_p(13, 17))
    assert p.draws_at_goal == 1 and p.foreign_vllm_max == 0
    with pytest.raises(ValueError):
        pool.pool([])


def test_bootstrap_interval_is_seeded_and_spans_the_draws() -> None:
    draws = [draw(12, 10), draw(30, 10), draw(15, 10), draw(22, 10)]
    lo, hi = pool.bootstrap_interval(draws, resamples=2000, confidence=0.95, seed=3)
    assert 1.2 <= lo < 1.975 < hi <= 3.0  # within the extreme draws, around the pooled ratio
    assert (lo, hi) == pool.bootstrap_interval(draws, resamples=2000, confidence=0.95, seed=3)
    narrow = pool.bootstrap_interval(draws, resamples=2000, confidence=0.5, seed=3)
    assert narrow is not None and lo <= narrow[0] <= narrow[1] <= hi
    same = [draw(15, 10)] * 5  # draws that agree leave nothing to resample
    assert pool.bootstrap_interval(same, resamples=100, confidence=0.95, seed=0) == (1.5, 1.5)
    assert pool.bootstrap_interval(draws[:1], resamples=100, confidence=0.95, seed=0) is None
    zero = pool.bootstrap_interval([draw(3, 0), draw(3, 0)], resamples=10,
                                   confidence=0.9, seed=0)
    assert zero == (float("inf"), float("inf"))
    with pytest.raises(ValueError):
        pool.bootstrap_interval(draws, resamples=100, confidence=1.0, seed=0)


def test_every_draw_judged_against_one_set_of_idle_figures() -> None:
    rep = load_report(1, ("aggregated", [level(2, "a", "bc")]),
                      ("kvagent", [level(2, "ab", "c")]))
    assert (pool.draw_of(rep, "x").met_a, pool.draw_of(rep, "x").met_b) == (2, 1)
    loose = {"idle_ttft_first_p90_s": 3.0, "idle_ttft_later_p90_s": 3.0,
             "idle_decode_step_s": 0.02}  # first-turn bound 6 s: the 5 s answers meet it
    judged = pool.with_idle(rep, loose)
    assert judged.slo is not None and judged.slo.ttft_first_s == pytest.approx(6.0)
    assert judged.slo.ttft_factor == SLO.ttft_factor
    d = pool.draw_of(judged, "x")
    assert (d.met_a, d.met_b, d.only_a, d.only_b) == (3, 3, 0, 0)
    assert rep.configs[0].levels[0].sessions_met == 1  # the recorded report is untouched
    other = load_report(2, slo=SLO.model_copy(update={"idle_decode_step_s": 0.04,
                                                     "idle_ttft_first_p90_s": 0.7}))
    third = load_report(3, slo=SLO.model_copy(update={"idle_decode_step_s": 0.01}))
    assert pool.median_idle([rep, other, third]) == pytest.approx(
        {"idle_ttft_first_p90_s": 0.5, "idle_ttft_later_p90_s": 0.2,
         "idle_decode_step_s": 0.02})
    with pytest.raises(ValueError, match="idle figures"):
        pool.with_idle(rep, {"idle_decode_step_s": 0.0})
    with pytest.raises(ValueError, match="no report has an SLO"):
        pool.median_idle([rep.model_copy(update={"slo": None})])


def test_command_line_pools_recorded_folders(tmp_path, capsys) -> None:
    folders = []
    for seed, (agg, kva) in enumerate([(("ab", "cd"), ("abc", "d")),
                                       (("a", "bcd"), ("abcd", ""))], start=40):
        rep = load_report(seed, ("aggregated", [level(2, *agg)]),
                          ("kvagent", [level(2, *kva)]))
        folders.append(report.write_load(rep, tmp_path / f"seed{seed}")["json"].parent)
    out = tmp_path / "pooled.json"
    assert pool.main([*map(str, folders), "--resamples", "100", "--json", str(out)]) == 0
    md = capsys.readouterr().out
    assert "| 40 | seed40 | 4 | 2 | 3 | 1.50 | 1 / 0 |" in md
    assert "| pooled (2 draws) | | 8 | 3 | 7 | **2.33** | 4 / 0 (p = 0.12) |" in md
    assert "Draws at 1.5x or more: 2 of 2" in md
    saved = json.loads(out.read_text())
    assert (saved["met_a"], saved["met_b"], len(saved["draws"])) == (7, 3, 2)
    assert pool.main([str(tmp_path / "missing")]) == 2
    assert "no results.json" in capsys.readouterr().err
    assert pool.main([*map(str, folders), "--resamples", "10", "--idle", "3000,3000,20"]) == 0
    md = capsys.readouterr().out
    assert "| pooled (2 draws) | | 8 | 8 | 8 | **1.00** |" in md
    assert "idle_ttft_first_p90_s 3000.0 ms" in md
    assert pool.main([*map(str, folders), "--idle", "median"]) == 0
    assert "idle_decode_step_s 20.0 ms" in capsys.readouterr().out
    assert pool.main([*map(str, folders), "--idle", "1,2"]) == 2
    assert "--idle takes 'median' or 3 numbers" in capsys.readouterr().err


def test_a_committed_folder_is_read_from_its_gzipped_results(tmp_path) -> None:
    rep = load_report(40, ("aggregated", [level(2, "ab", "cd")]),
                      ("kvagent", [level(2, "abc", "d")]))
    plain = report.write_load(rep, tmp_path / "seed40")["json"]
    before = pool.read_report(plain.parent)
    (plain.parent / "results.json.gz").write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    assert pool.read_report(plain.parent) == before
    assert pool.read_report(plain.parent / "results.json.gz") == before
