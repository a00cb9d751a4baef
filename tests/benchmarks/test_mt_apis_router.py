"""The benchmark's client APIs end to end: the same seeded workload through the router
before fake P/D nodes (tests/fakes/nodes.py), once per API, each on a stack of its own.

Every request is accepted and recorded with its `kvagent` report and the API's cached
tokens; later turns reuse; each API names the conversation its clients' way (never
kvagent's session header outside chat); Messages and full Responses render the very
prompt chat does, so their answers are the same."""

from __future__ import annotations

import json

import httpx
from fakes import router_stack
from fakes.threaded import MODEL

from benchmarks.api import APIS, RequestRecord, WorkloadSpec, generate, run_workload

PATHS = ("pd_reuse", "d_direct", "pd_fresh", "d_fresh", "recompute", "decode_only")


class Recording(httpx.AsyncBaseTransport):
    """Real HTTP, with each request's path, headers and body kept."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sent: list[tuple[str, dict[str, str], dict]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, dict(request.headers), json.loads(request.content)))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _run(api: str) -> tuple[list[RequestRecord], Recording]:
    wl = generate(WorkloadSpec(conversations=2, turns=4, concurrency=2, seed=3,
                               system_prompt_tokens=60, context_tokens=200,
                               tool_result_tokens=(20, 60), user_turn_probability=0.3,
                               max_tokens=8))
    spy = Recording()
    async with router_stack() as st:
        records, _ = await run_workload(st.url + "/v1", MODEL, wl, config=api, run_id="r",
                                        api=api, transport=spy)
    return records, spy


async def test_every_api_runs_the_workload_through_the_router_and_reuses() -> None:
    runs = {api: await _run(api) for api in APIS}
    by_turn = {api: {(r.conversation, r.turn): r for r in recs}
               for api, (recs, _) in runs.items()}
    for api, (records, spy) in runs.items():
        assert len(records) == 8 and all(r.error is None for r in records), (api, records)
        for r in records:
            assert r.status == 200 and r.ttft_s is not None and r.e2e_s >= r.ttft_s, (api, r)
            assert r.path in PATHS and r.reason and r.reused_tokens is not None, (api, r)
            assert r.prompt_tokens and r.completion_tokens and r.answer, (api, r)
            assert r.stages_s == {}  # the fake stack's router has no Server-Timing
            if r.turn == 0:
                assert r.reused_tokens == 0 and r.path in ("pd_fresh", "d_fresh"), (api, r)
            else:  # every later turn found its conversation and reused its KV
                assert r.reused_tokens > 0 and r.path in ("pd_reuse", "d_direct"), (api, r)
                assert r.cached_tokens is not None and r.cached_tokens > 0, (api, r)
        assert [p for p, _, _ in spy.sent] == [{"chat": "/v1/chat/completions",
                                                "messages": "/v1/messages"}.get(
                                                    api, "/v1/responses")] * 8
        for _, headers, _ in spy.sent:
            assert ("x-session-id" in headers) == (api == "chat")
            assert ("x-claude-code-session-id" in headers) == (api == "messages")
    # same prompt, same greedy answer: Messages and full Responses render chat's prompt
    for api in ("messages", "responses-full"):
        for key, r in by_turn[api].items():
            chat = by_turn["chat"][key]
            assert (r.prompt_tokens, r.answer) == (chat.prompt_tokens, chat.answer), (api, key)


async def test_chained_responses_name_the_previous_response() -> None:
    records, spy = await _run("responses")
    bodies = {}
    for _, _, body in spy.sent:
        doc = body["input"][0]
        bodies.setdefault(body.get("previous_response_id") is None, []).append(body)
        assert body["instructions"].startswith("You are a coding agent")
        assert body["tools"][0]["type"] == "function"
        assert isinstance(doc, dict)
    firsts, chained = bodies[True], bodies[False]
    assert len(firsts) == 2 and len(chained) == 6  # each conversation's first turn only
    assert all(r.path in ("pd_reuse", "d_direct") for r in records if r.turn)
    # a chained turn sends only what is new: never the first user message again
    for body in chained:
        assert all(i.get("role") != "user" or not str(i.get("content")).startswith(
            "I am working on") for i in body["input"])
        assert body["previous_response_id"].startswith("resp_")
