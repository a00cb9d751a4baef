"""The floor script's I/O-free parts: it rebuilds exactly the requests the driver sent."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from test_mt_driver import Endpoint, spec

from benchmarks.api import (
    FloorSample,
    PairedFloor,
    generate,
    kv_bytes_per_token,
    pick,
    requests_by_turn,
    run_workload,
    summarise,
)


async def test_rebuilt_requests_equal_the_sent_ones() -> None:
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
    from benchmarks.api import RequestRecord

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
    def sample(measured: float, floor: float, new: int) -> FloorSample:
        return FloorSample(conversation="c", turn=1, path="pd_reuse", reused_tokens=1000,
                           prompt_tokens=1000 + new, engine_ttft_s=floor - 0.05,
                           transfer_s=0.05, measured_ttft_s=measured)

    s = summarise([sample(0.3, 0.2, 100), sample(0.2, 0.2, 2000)])
    assert set(s) == {"pd_reuse"}
    assert s["pd_reuse"]["ratio_mean"] == pytest.approx(1.25)
    bins = s["pd_reuse"]["by_new_tokens"]
    assert set(bins) == {"0-500", "1500-"}
    assert bins["0-500"]["ratio_p50"] == pytest.approx(1.5)
    assert bins["0-500"]["excess_p50_s"] == pytest.approx(0.1)
    assert bins["1500-"]["n"] == 1


class FloorNode:
    """A stock node as the floor sees it: /tokenize, the warming completion, the timed chat."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append((request.url.path, body))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": list(range(300))})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "y"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 1,
                                            "prompt_tokens_details": {"cached_tokens": 64}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


async def test_paired_floor_times_each_reused_turn_right_after_it() -> None:
    bundle, node = Endpoint(), FloorNode()
    wl = generate(spec(conversations=1, turns=4))
    floor = PairedFloor("http://floor", "m", wl, kv_bytes_per_token=1000, bandwidth=1e9,
                        settle_s=0, transport=httpx.MockTransport(node))
    order: list[str] = []

    def on_record(r):
        order.append(f"turn {r.turn}")
        got = floor.on_record(r)
        assert (got is None) == (r.turn == 0)  # the first turn reuses nothing
        if got is not None:
            order.append(f"floor {got.turn}")

    records, _ = await run_workload("http://bench/v1", "m", wl, config="kvagent", run_id="r",
                                    transport=httpx.MockTransport(bundle),
                                    on_record=on_record)
    # each floor is taken before the next turn is sent
    assert order == ["turn 0", "turn 1", "floor 1", "turn 2", "floor 2", "turn 3", "floor 3"]
    assert [(s.conversation, s.turn) for s in floor.samples] == [
        (r.conversation, r.turn) for r in records[1:]]
    chats = [b for path, b in node.calls if path == "/v1/chat/completions"]
    warms = [b for path, b in node.calls if path == "/v1/completions"]
    assert len(chats) == len(warms) == 3 + 2  # two untimed rounds on the fresh node
    for (sent, _), timed, warm in zip(bundle.requests[1:], chats[2:], warms[2:], strict=True):
        assert timed["messages"] == sent["messages"] and timed["tools"] == sent["tools"]
        assert warm["prompt"] == list(range(64))  # exactly the reused prefix
        assert warm["cache_salt"] == timed["cache_salt"]
    assert len({c["cache_salt"] for c in chats}) == len(chats)
    s = floor.samples[0]
    assert s.path == "pd_reuse" and s.reused_tokens == 64 and s.prompt_tokens == 300
    assert s.transfer_s == pytest.approx(64 * 1000 / 1e9)
    assert s.ratio == pytest.approx(records[1].ttft_s / s.floor_s)


def test_paired_floor_needs_one_conversation_at_a_time() -> None:
    from benchmarks.api import multiturn_run as run

    with pytest.raises(SystemExit, match="--concurrency 1"):
        run.main(["--quick", "--paired-floor", "1"])  # --quick runs 2 at a time
