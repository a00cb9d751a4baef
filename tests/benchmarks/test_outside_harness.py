"""The outside harness's pure parts: aiperf's command line, its per-request export read
back (lines shaped as aiperf 0.13 writes `profile_export.jsonl`), the figures and ratios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.api import outside_harness as h

AIPERF_VERSION, SESSION_HEADER, Shape = h.AIPERF_VERSION, h.SESSION_HEADER, h.Shape
aiperf_argv, markdown, parse_record = h.aiperf_argv, h.markdown, h.parse_record
ratios, read_records, summarize = h.ratios, h.read_records, h.summarize


def line(conv: str, turn: int, ttft: float, *, itl: float = 20.0, prompt: int = 900,
         cached: int = 0, phase: str = "profiling", error: dict[str, Any] | None = None
         ) -> str:
    metrics = {"time_to_first_token": {"value": ttft, "unit": "ms"},
               "inter_token_latency": {"value": itl, "unit": "ms"},
               "usage_prompt_tokens": {"value": prompt, "unit": "tokens"},
               "usage_prompt_cache_read_tokens": {"value": cached, "unit": "tokens"}}
    return json.dumps({"metadata": {"conversation_id": conv, "turn_index": turn,
                                    "benchmark_phase": phase, "was_cancelled": False},
                       "metrics": {} if error else metrics, "error": error})


def test_argv_runs_every_turn_with_the_session_header(tmp_path: Path) -> None:
    shape = Shape(conversations=8, turns=5, concurrency=4, isl=800, osl=64, delay_ms=500)
    argv = aiperf_argv("aiperf", shape, url="http://127.0.0.1:8000", model="m",
                       tokenizer="/models/m", artifact_dir=tmp_path)

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert argv[:2] == ["aiperf", "profile"]
    assert flag("--request-count") == "40"  # every turn of every conversation, no more
    assert flag("--session-header") == SESSION_HEADER
    assert flag("--concurrency") == "4" and flag("--conversation-turn-mean") == "5"
    assert "ignore_eos:true" in argv and "temperature:0" in argv and "--streaming" in argv
    assert flag("--tokenizer") == "/models/m"  # never the hub


@pytest.mark.parametrize("field", ["conversations", "turns", "concurrency", "isl", "osl"])
def test_shape_refuses_zero(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Shape(**{field: 0})


def test_records_skip_warmup_and_keep_errors() -> None:
    lines = [line("a", 0, 400.0), line("w", 0, 1.0, phase="warmup"),
             line("a", 1, 100.0, prompt=1800, cached=900),
             line("b", 1, 0.0, error={"code": 500, "type": "HTTPError", "message": "boom"}),
             ""]
    recs = read_records(lines)
    assert [(r.conversation, r.turn) for r in recs] == [("a", 0), ("a", 1), ("b", 1)]
    assert recs[1].cached_tokens == 900 and recs[1].ttft_ms == 100.0
    assert recs[2].error == "boom" and recs[2].ttft_ms is None
    s = summarize(recs)
    assert s["errors"] == 1 and s["first_error"] == "boom"
    assert s["later_ttft_ms"]["p90"] == 100.0  # the failed later turn counts nowhere
    assert s["first_ttft_ms"]["p50"] == 400.0
    assert s["later_cached_ratio"] == 0.5


def test_a_cancelled_record_is_not_counted() -> None:
    raw = json.loads(line("a", 1, 5.0))
    raw["metadata"]["was_cancelled"] = True
    assert parse_record(json.dumps(raw)) is None


def test_later_turn_percentiles_and_ratios() -> None:
    fast = summarize(read_records([line("a", 0, 900.0)] + [
        line("a", t, 100.0 * t, itl=10.0 * t) for t in range(1, 11)]))
    slow = summarize(read_records([line("a", 0, 900.0)] + [
        line("a", t, 200.0 * t, itl=10.0 * t) for t in range(1, 11)]))
    assert fast["later_ttft_ms"]["p50"] == pytest.approx(550.0)
    assert fast["later_ttft_ms"]["p90"] == pytest.approx(910.0)
    r = ratios(fast, slow)
    assert r["later_ttft_ms.p90"] == pytest.approx(0.5)
    assert r["tpot_ms.p99"] == pytest.approx(1.0)


def test_markdown_states_the_harness_shape_and_ratios() -> None:
    s = summarize(read_records([line("a", 0, 300.0), line("a", 1, 80.0)]))
    report = {"aiperf": AIPERF_VERSION, "date": "d", "command": "python -m benchmarks outside",
              "machine": {"cpu": "x"}, "commit": "c", "foreign_vllm_max": 0,
              "shape": Shape().__dict__, "subject": "kvagent",
              "arms": {"aggregated": {"summary": s}, "kvagent": {"summary": s},
                       "kvagent-pd": {"error": "RuntimeError: no"}},
              "ratios": {"aggregated": ratios(s, s)}}
    text = markdown(report)
    assert f"aiperf {AIPERF_VERSION}" in text and "16 conversations x 5 turns" in text
    assert "| kvagent-pd | failed: RuntimeError: no |" in text
    assert "kvagent / aggregated: later_ttft_ms.p50 1.00x" in text


def test_the_run_index_takes_an_outside_run(tmp_path: Path) -> None:
    from benchmarks.api import index

    s = summarize(read_records([line("a", 0, 300.0, itl=12.6), line("a", 1, 80.4, itl=12.6)]))
    folder = tmp_path / "20261207T120000Z-outside"
    folder.mkdir()
    summary = {"aiperf": AIPERF_VERSION, "command": "python -m benchmarks outside",
               "date": "2026-12-07 12:00 UTC", "commit": "abc", "machine": None,
               "foreign_vllm_max": 0, "arms": {"kvagent": {"summary": s},
                                               "aggregated": {"error": "x"}}}
    run = index.entry_from_outside(folder, summary, root=tmp_path, label="outside")
    assert run.kind == "outside" and run.quiet is True
    assert run.figures["kvagent.later_ttft_p90_ms"] == 80
    assert run.figures["kvagent.tpot_p99_ms"] == 13
    assert "aggregated.later_ttft_p90_ms" not in run.figures
