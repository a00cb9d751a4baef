"""Drive a workload against one OpenAI-compatible endpoint and record every request.

Conversations run concurrently (up to `Workload.concurrency` in flight); the turns of one
conversation run in order. With the chat API (the default) each turn sends the whole
history, the session id and the cache token the previous turn returned (a plain vLLM node
simply ignores both headers); the other APIs send the same conversation in their own shape
and identify it their clients' way (`apis`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from kvagent.protocol import RESPONSE_CACHE_TOKEN, RESPONSE_PATH, RESPONSE_REUSED_TOKENS

from .apis import CHAT, PATHS, ConversationRequests
from .client import meter_for, stream_request
from .results import RequestRecord
from .workload import Conversation, Message, Workload, assistant_message


async def run_workload(base_url: str, model: str, workload: Workload, *, config: str,
                       run_id: str, keep_recorded_answers: bool = False,
                       timeout_s: float = 600.0,
                       on_record: Callable[[RequestRecord], None] | None = None,
                       transport: httpx.AsyncBaseTransport | None = None,
                       text_with_tool_calls: bool = True, api: str = CHAT,
                       route: Callable[[int, Conversation], str] | None = None,
                       ) -> tuple[list[RequestRecord], float]:
    """Run every conversation; return the records (conversation, turn order) and wall time.

    A failed request ends its conversation: later turns would not be the same workload.
    `api`: which client API sends it (`apis.APIS`). `transport` is the test seam
    (httpx.MockTransport). `route(i, conversation)`: the base URL the i-th conversation
    (in workload order) is sent to, for every turn, instead of `base_url` (client-side
    session affinity over several endpoints).
    """
    url = base_url.rstrip("/")
    sem = asyncio.Semaphore(workload.concurrency)
    limits = httpx.Limits(max_connections=workload.concurrency + 2)
    t_start = time.perf_counter()

    async def one(i: int, conv: Conversation) -> list[RequestRecord]:
        target = url if route is None else route(i, conv).rstrip("/")
        async with sem:
            return await _conversation(client, target, model, conv, workload.max_tokens,
                                       config=config, session_id=f"{run_id}.{conv.id}",
                                       keep=keep_recorded_answers, t_start=t_start,
                                       on_record=on_record,
                                       text_with_tool_calls=text_with_tool_calls, api=api)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 limits=limits, transport=transport) as client:
        results = await asyncio.gather(*(one(i, c) for i, c in
                                         enumerate(workload.conversations)))
    wall = time.perf_counter() - t_start
    return [r for rs in results for r in rs], wall


@dataclass(frozen=True)
class ScheduledSession:
    """One conversation of the load mode: when it arrives and how long the agent "thinks"
    (runs its tools) before each later turn."""

    conversation: Conversation
    start_s: float  # after the level starts
    think_s: Sequence[float] = field(default_factory=tuple)  # before turns 1, 2, ...


async def run_sessions(base_url: str, model: str, sessions: Sequence[ScheduledSession],
                       max_tokens: int, *, config: str, run_id: str, deadline_s: float,
                       timeout_s: float = 600.0,
                       on_record: Callable[[RequestRecord], None] | None = None,
                       transport: httpx.AsyncBaseTransport | None = None,
                       text_with_tool_calls: bool = True,
                       route: Callable[[int, Conversation], str] | None = None,
                       ) -> tuple[list[RequestRecord], list[str], float]:
    """Open arrival: each session starts at its own offset whatever the others are doing,
    and waits its think time before each later turn. Sessions still running `deadline_s`
    after the start are cancelled (their open request closed), so a level is bounded
    in time however slow the configuration. Returns the records of the turns that ended,
    the ids of the cancelled conversations, and the wall time. `route`: as `run_workload`'s.
    """
    url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=len(sessions) + 2)
    records: list[RequestRecord] = []
    unfinished = {s.conversation.id for s in sessions}
    t_start = time.perf_counter()

    async def one(i: int, s: ScheduledSession) -> None:
        target = url if route is None else route(i, s.conversation).rstrip("/")
        await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t_start)))
        await _conversation(client, target, model, s.conversation, max_tokens, config=config,
                            session_id=f"{run_id}.{s.conversation.id}", keep=False,
                            t_start=t_start, on_record=on_record,
                            text_with_tool_calls=text_with_tool_calls, think_s=s.think_s,
                            records=records)
        unfinished.discard(s.conversation.id)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 limits=limits, transport=transport) as client:
        tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(sessions)]
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                t.result()  # a bug in the driver surfaces, a failed request does not raise
    wall = time.perf_counter() - t_start
    return records, sorted(unfinished), wall


async def _conversation(client: httpx.AsyncClient, url: str, model: str, conv: Conversation,
                        max_tokens: int, *, config: str, session_id: str, keep: bool,
                        t_start: float, on_record: Callable[[RequestRecord], None] | None,
                        text_with_tool_calls: bool = True, think_s: Sequence[float] = (),
                        records: list[RequestRecord] | None = None,
                        api: str = CHAT) -> list[RequestRecord]:
    """`url`: the base URL (`.../v1`). `think_s[i - 1]`: seconds to wait before turn i.
    `records`: append there as each turn ends (a cancelled conversation keeps its finished
    turns)."""
    history: list[Message] = []
    requests = ConversationRequests(api, model, session_id, conv.tools, max_tokens)
    answer = ""
    records = [] if records is None else records
    for i, turn in enumerate(conv.turns):
        if i > 0 and i - 1 < len(think_s) and think_s[i - 1] > 0:
            await asyncio.sleep(think_s[i - 1])
        new: list[Message] = []
        if turn.assistant is not None:
            new.append(assistant_message(turn.assistant, answer, keep_recorded=keep,
                                         text_with_tool_calls=text_with_tool_calls))
        new.extend(turn.messages)
        history.extend(new)
        req = requests.request(history, new)
        token = requests.cache_token
        start = time.perf_counter() - t_start
        res = await stream_request(client, url + PATHS[api], req.body, req.headers,
                                   meter_for(api))
        m = res.meter
        kva = m.kvagent or {}
        new_token = kva.get(RESPONSE_CACHE_TOKEN)
        completion = m.completion_tokens()
        rec = RequestRecord(
            config=config, conversation=conv.id, turn=i, start_s=start, ttft_s=m.ttft_s,
            first_chunk_s=m.first_chunk_s, e2e_s=res.e2e_s, headers_s=res.headers_s,
            stages_s=res.stages_s, itl_s=m.itl_s, tpot_s=m.tpot_s(completion),
            prompt_tokens=m.prompt_tokens(), completion_tokens=completion,
            cached_tokens=m.cached_tokens(),
            reused_tokens=kva.get(RESPONSE_REUSED_TOKENS) if m.kvagent is not None else None,
            path=kva.get(RESPONSE_PATH), reason=_str(kva.get("reason")),
            sent_cache_token=token is not None, got_cache_token=bool(new_token),
            answer=m.answer, status=res.status, error=res.error)
        records.append(rec)
        if on_record is not None:
            on_record(rec)
        if res.error is not None:
            break
        answer = m.answer
        requests.answered(cache_token=new_token if isinstance(new_token, str) else None,
                          response_id=m.response_id)
    return records


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None
