"""The per-turn time budget: stages in spans and (opt-in) in `Server-Timing`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakeCluster, router_stack
from kvagent_server.router.telemetry.budget import TurnBudget, parse_server_timing
from router_client import FIRST, chat_body, events, second


def test_budget_adds_up_and_renders() -> None:
    b = TurnBudget(arrived=10.0)
    b.add("receive", 0.001)
    b.add("decode", 0.020)
    b.add("decode", 0.005)  # a retried leg adds up
    b.add("prefill", -1.0)  # clock noise never goes negative
    assert b.stages == {"receive": 0.001, "decode": 0.025, "prefill": 0.0}
    header = b.server_timing(now=10.1)
    # in stage order, not insertion order, and the total since arrival last
    assert header == "receive;dur=1.00, prefill;dur=0.00, decode;dur=25.00, total;dur=100.00"
    b.add("finalize", 0.5)
    b.add_remainder("first_token", now=10.1)  # what no stage before counted
    assert b.stages["first_token"] == pytest.approx(0.1 - 0.026)
    with pytest.raises(ValueError):
        b.add("coffee", 1.0)


def test_parse_server_timing() -> None:
    got = parse_server_timing('receive;dur=1.5, cache;desc="Cache Read";dur=23.2, miss, '
                              'total;dur=100')
    assert got == pytest.approx({"receive": 0.0015, "cache": 0.0232, "total": 0.1})
    assert parse_server_timing(None) == {}
    assert parse_server_timing("garbage;;, ;dur=3") == {}


async def _post(st: Any, messages: list[dict], **headers: str) -> tuple[Any, list[Any]]:
    r = await st.client.post("/v1/chat/completions", json=chat_body(messages),
                             headers={"X-Session-ID": "budget", **headers})
    assert r.status_code == 200, r.text
    return r, events(r.text)


async def test_server_timing_per_path_on_fake_nodes() -> None:
    """P's delay lands in `prefill`, only paths with a P leg have one, and the stages
    before the headers never exceed the total."""
    cluster = FakeCluster(prefill_delay_s=0.12)
    async with router_stack(cluster=cluster, server_timing=True,
                            policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        r, evs = await _post(st, FIRST)
        t = parse_server_timing(r.headers["server-timing"])
        assert evs[-2]["kvagent"]["path"] == "pd_fresh"
        assert t["prefill"] >= 0.12
        assert {"receive", "plan", "decode", "total"} <= t.keys()
        assert "tokenize" not in t  # no handle to verify against: no /tokenize
        assert sum(v for k, v in t.items() if k != "total") <= t["total"] + 1e-4
        answer = "".join(e["choices"][0]["delta"].get("content") or ""
                         for e in evs[:-1] if e.get("choices"))
        token = evs[-2]["kvagent"]["cache_token"]
        r, evs = await _post(st, second(answer), **{"X-KVAgent-Cache-Token": token})
        t = parse_server_timing(r.headers["server-timing"])
        assert evs[-2]["kvagent"]["path"] == "pd_reuse"
        assert t["tokenize"] > 0 and t["prefill"] >= 0.12
        assert "first_token" not in t  # after the headers: spans only

    async with router_stack(cluster=FakeCluster(prefill_delay_s=0.12), server_timing=True,
                            policy={"params": {"skip_prefill_max_tokens": 100_000}}) as st:
        r, evs = await _post(st, FIRST)
        answer = "".join(e["choices"][0]["delta"].get("content") or ""
                         for e in evs[:-1] if e.get("choices"))
        token = evs[-2]["kvagent"]["cache_token"]
        r, evs = await _post(st, second(answer), **{"X-KVAgent-Cache-Token": token})
        assert evs[-2]["kvagent"]["path"] == "d_direct"
        t = parse_server_timing(r.headers["server-timing"])
        assert "prefill" not in t and t["tokenize"] > 0
        assert t["total"] < 0.12  # P's delay is nowhere on this path


async def test_no_server_timing_by_default() -> None:
    """Off by default: a client sees the headers a vLLM node would send."""
    async with router_stack() as st:
        r, _ = await _post(st, FIRST)
        assert "server-timing" not in r.headers
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=False))
        assert "server-timing" not in r.headers


async def test_whole_response_header_counts_finalize() -> None:
    async with router_stack(server_timing=True) as st:
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=False),
                                 headers={"X-Session-ID": "whole"})
        t = parse_server_timing(r.headers["server-timing"])
        assert {"receive", "plan", "prefill", "decode", "finalize", "total"} <= t.keys()


async def test_stages_on_the_turn_span(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvagent_server.router.telemetry import spans as telemetry
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    async with router_stack(cluster=FakeCluster(prefill_delay_s=0.08)) as st:
        await _post(st, FIRST)
        # The streamed turn's span ends after the last byte (up to 10 s on a loaded host).
        for _ in range(500):
            if any(s.name == "kvagent.turn" for s in exporter.get_finished_spans()):
                break
            await asyncio.sleep(0.02)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "kvagent.turn"]
    attrs = span.attributes
    for stage in ("receive", "plan", "prefill", "decode", "first_token", "finalize"):
        assert attrs[f"kvagent.stage.{stage}_ms"] >= 0
    assert attrs["kvagent.stage.prefill_ms"] >= 80
    stages_ms = sum(v for k, v in attrs.items() if k.startswith("kvagent.stage."))
    assert stages_ms <= (span.end_time - span.start_time) / 1e6 + 1
