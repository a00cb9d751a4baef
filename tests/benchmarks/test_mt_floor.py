"""The floor script's I/O-free parts: it rebuilds exactly the requests the driver sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_mt_driver import Endpoint, spec

from benchmarks.multiturn.driver import run_workload
from benchmarks.multiturn.floor import kv_bytes_per_token, pick, requests_by_turn, summarise
from benchmarks.multiturn.workload import generate


async def test_rebuilt_requests_equal_the_sent_ones() -> None:
    import httpx

    ep = Endpoint()
    wl = generate(spec(conversations=2, turns=3, concurrency=2))
    records, _ = await run_workload("http://bench/v1", "m", wl, config="kvagent",
                                    run_id="r", transport=httpx.MockTransport(ep))
    rebuilt = requests_by_turn(wl, records, "m", keep=False)
    assert len(rebuilt) == len(ep.requests) == 6
    turns: dict[str, int] = {}
    for body, headers in ep.requests:  # the k-th request of a session is its turn k
        conv = headers["x-session-id"].removeprefix("r.")
        k = turns[conv] = turns.get(conv, -1) + 1
        want = rebuilt[(conv, k)]
        assert want["max_tokens"] == 1
        assert (want["messages"], want.get("tools")) == (body["messages"], body.get("tools"))


def test_pick_spreads_and_filters() -> None:
    from benchmarks.multiturn.results import RequestRecord

    def rec(i: int, path: str, reused: int = 64, turn: int = 1) -> RequestRecord:
        return RequestRecord(config="k", conversation=f"c{i}", turn=turn, start_s=0,
                             ttft_s=0.1, path=path, reused_tokens=reused)

    rows = [rec(i, "d_direct") for i in range(10)] + [rec(20, "pd_reuse"),
                                                      rec(21, "pd_reuse", reused=0),
                                                      rec(22, "pd_reuse", turn=0)]
    got = pick(rows, 3)
    assert [r.conversation for r in got] == ["c20", "c0", "c3", "c6"]


def test_kv_bytes_and_ratio(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 256,
        "num_hidden_layers": 4, "torch_dtype": "float32"}))
    assert kv_bytes_per_token(tmp_path) == 2 * 4 * 4 * 32 * 4
    s = summarise([{"path": "pd_reuse", "measured_ttft_s": 0.3, "floor_s": 0.2,
                    "engine_ttft_s": 0.15, "transfer_s": 0.05},
                   {"path": "pd_reuse", "measured_ttft_s": 0.2, "floor_s": 0.2,
                    "engine_ttft_s": 0.15, "transfer_s": 0.05}])
    assert set(s) == {"pd_reuse"}
    assert s["pd_reuse"]["ratio_mean"] == pytest.approx(1.25)
