"""The conversation driver against a scripted endpoint (httpx.MockTransport): what it sends
turn after turn, which token it carries, what it records. Real servers: test_quick_vllm.py."""

from __future__ import annotations

import json

import httpx

from benchmarks.api import WorkloadSpec, generate, parse_replay, run_workload


class Endpoint:
    """Answers every chat request with a stream naming the turn; issues tokens `tok-N`."""

    def __init__(self, fail_on: int | None = None, kvagent: bool = True) -> None:
        self.requests: list[tuple[dict, dict]] = []
        self.fail_on = fail_on
        self.kvagent = kvagent

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((body, dict(request.headers)))
        n = len(self.requests)
        if n == self.fail_on:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        final = {"choices": [], "usage": {"prompt_tokens": 100 * n, "completion_tokens": 2,
                                          "prompt_tokens_details": {"cached_tokens": 64}}}
        if self.kvagent:
            final["kvagent"] = {"cache_token": f"tok-{n}", "reused_tokens": 64,
                                "path": "pd_reuse", "expires_in": 400}
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"index": 0, "delta": {"content": f"answer {n}"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "!"}}]}, final]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        headers = {"content-type": "text/event-stream"}
        if self.kvagent:  # the router's opt-in per-stage budget
            headers["server-timing"] = "receive;dur=0.5, prefill;dur=40, total;dur=45.25"
        return httpx.Response(200, text=text, headers=headers)


def spec(**kw) -> WorkloadSpec:
    return WorkloadSpec(**{"conversations": 1, "turns": 4, "concurrency": 1,
                           "system_prompt_tokens": 30, "context_tokens": 50,
                           "tool_result_tokens": (10, 20), "user_turn_probability": 0.0,
                           "max_tokens": 7, **kw})


async def test_history_grows_by_answer_and_script_and_token_is_carried() -> None:
    ep = Endpoint()
    wl = generate(spec())
    records, wall = await run_workload("http://bench/v1", "m", wl, config="kvagent",
                                       run_id="r1", transport=httpx.MockTransport(ep))
    assert wall > 0 and len(records) == 4 and len(ep.requests) == 4
    conv = wl.conversations[0]
    for i, (body, headers) in enumerate(ep.requests):
        assert body["model"] == "m" and body["max_tokens"] == 7 and body["stream"] is True
        assert body["tools"] == conv.tools
        assert headers["x-session-id"] == f"r1.{conv.id}"
        assert headers.get("x-kvagent-cache-token") == (f"tok-{i}" if i else None)
        if i:
            prev = ep.requests[i - 1][0]["messages"]
            msgs = body["messages"]
            # exactly: previous prompt + the model's answer with the scripted tool calls +
            # the scripted tool results, earlier messages untouched
            assert msgs[:len(prev)] == prev
            assistant = msgs[len(prev)]
            assert assistant == {"role": "assistant", "content": f"answer {i}!",
                                 "tool_calls": conv.turns[i].assistant.tool_calls}
            assert msgs[len(prev) + 1:] == conv.turns[i].messages
    r = records[1]
    assert (r.turn, r.prompt_tokens, r.cached_tokens, r.reused_tokens, r.path) == (
        1, 200, 64, 64, "pd_reuse")
    assert r.sent_cache_token and r.got_cache_token and r.answer == "answer 2!"
    assert r.ttft_s is not None and r.e2e_s >= r.ttft_s and len(r.itl_s) == 1
    assert not records[0].sent_cache_token
    assert r.stages_s == {"receive": 0.0005, "prefill": 0.04, "total": 0.04525}
    assert r.headers_s is not None and r.headers_s <= r.ttft_s


async def test_plain_server_records_no_kvagent_fields() -> None:
    ep = Endpoint(kvagent=False)
    records, _ = await run_workload("http://bench/v1", "m", generate(spec(turns=2)),
                                    config="aggregated", run_id="r",
                                    transport=httpx.MockTransport(ep))
    assert all(r.reused_tokens is None and r.path is None for r in records)
    assert all(r.stages_s == {} and r.headers_s is not None for r in records)
    assert "x-kvagent-cache-token" not in ep.requests[1][1]
    assert records[1].cached_tokens == 64


async def test_failed_request_ends_its_conversation_only() -> None:
    ep = Endpoint(fail_on=2)
    wl = generate(spec(conversations=2, concurrency=1))
    records, _ = await run_workload("http://bench/v1", "m", wl, config="c", run_id="r",
                                    transport=httpx.MockTransport(ep))
    first = [r for r in records if r.conversation == wl.conversations[0].id]
    second = [r for r in records if r.conversation == wl.conversations[1].id]
    assert [r.error is None for r in first] == [True, False]
    assert first[1].status == 503 and "overloaded" in first[1].error
    assert len(second) == 4 and all(r.error is None for r in second)


async def test_replay_keep_recorded_answers() -> None:
    conv = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "recorded"},
            {"role": "user", "content": "q2"}]
    for keep, expected in ((True, "recorded"), (False, "answer 1!")):
        ep = Endpoint()
        await run_workload("http://bench/v1", "m", parse_replay([conv]), config="c",
                           run_id="r", keep_recorded_answers=keep,
                           transport=httpx.MockTransport(ep))
        assert ep.requests[1][0]["messages"][1] == {"role": "assistant", "content": expected}
        assert "tools" not in ep.requests[1][0]
