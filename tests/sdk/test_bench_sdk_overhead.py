"""The SDK overhead benchmark runs and measures what it says (numbers live in its README)."""

from __future__ import annotations

from kvagent import Session
from kvagent._sse import SSEDecoder

from benchmarks.api import build_stream
from benchmarks.api import sdk_overhead_run as run


def test_benchmark_stream_is_a_valid_vllm_stream() -> None:
    pieces = build_stream(20)
    assert len(pieces) == 20 + 4
    decoder = SSEDecoder()
    assert sum(len(decoder.feed(p)) for p in pieces) == len(pieces)


def test_benchmark_runs_all_variants_on_the_same_bytes() -> None:
    out = run(chunks=30, rounds=1)
    assert set(out["us_per_chunk"]) == {
        f"{mode} {name}" for mode in ("sync", "async")
        for name in ("httpx bytes", "httpx + json", "kvagent")}
    assert all(0 < v["min"] <= v["median"] for v in out["us_per_chunk"].values())
    assert set(out["ratios"]) == {"sync", "async"}


def test_the_sdk_variant_really_parses_the_stream() -> None:
    import httpx

    from benchmarks.api import transport

    with httpx.Client(transport=transport(build_stream(25))) as client:
        session = Session("http://bench.local/v1", "kvagent-demo", http_client=client)
        result = session.send("hi")
    assert result.usage.completion_tokens == 25 and result.cache_token_received
    assert result.text.count(" tok") == 25


def test_connection_benchmark_compares_one_connection_with_one_per_turn() -> None:
    from benchmarks.api import connection_run as run_connection

    out = run_connection(turns=4)
    # the warm-up turn included: one connection in all, against one per turn
    assert out["connections"] == {"reuse": 1, "no reuse": 5}
    assert all(0 < v["min"] <= v["median"] <= v["p90"] for v in out["ttfb_ms"].values())
