"""Under KV pressure, concurrent conversations on real vLLM all finish, and every greedy
answer equals the same request recomputed.

P and D get 24 blocks of 128 tokens each; four conversations of ~1,000-token prompts run
at once. Each retained turn takes a third of D or more; each P leg leases as much of P
to its D leg. Before the router admitted legs by D's room, D filled with retained
turns whose next turns waited on P to pull them, while P filled with blocks leased to D
legs that D could not allocate: nothing moved until the 480 s TTL. Now the router
evicts, waits or gives a waiting turn's handle up (docs/router.md, "KV room on decode
nodes") and the run takes a minute or two.

The same small D shows retention that knows agents: a session that stopped on a tool call
keeps its KV while sessions that ended on a final answer give theirs up for room.
"""

from __future__ import annotations

import concurrent.futures
import random
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support import (
    bundle_config,
    free_port,
    metric_sum,
    recomputed_answer,
    session_chat,
    start_bundle,
    vllm_available,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCKS = 24
CONVERSATIONS = 4
TURNS = 3
#: Far longer than any answer here takes: a turn that needs it is a deadlock.
REQUEST_TIMEOUT_S = 150
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


class Served:
    def __init__(self, handle: Any) -> None:
        self.base_url, self.router_url = handle.base_url, handle.router_url
        self.prefill_url, self.model = handle.prefill_urls[0], handle.model
        self.router_log = handle.run_dir / "logs" / "router.log"

    def evictions(self) -> list[str]:
        """The router's log lines of what it evicted, and why."""
        return [line for line in self.router_log.read_text().splitlines()
                if "kvagent.router.retention" in line]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    nodes = {"extra_args": ["--num-gpu-blocks-override", str(BLOCKS)]}
    config = bundle_config(
        tmp_path_factory.mktemp("pressure"), max_model_len=2048,
        prefill={"ports": [free_port()], "side_channel_ports": [free_port()], **nodes},
        decode={"ports": [free_port()], "side_channel_ports": [free_port()], **nodes},
        router={"port": free_port(), "retention": {"decode_room_wait_s": 120}})
    handle, bundle = start_bundle(config)
    try:
        yield Served(handle)
    finally:
        bundle.stop()


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 7)))
                    for _ in range(n))


def _conversation(s: Served, seed: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Its turns, one after another: (request body, answer)."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a terse agent. Read the document."},
        {"role": "user", "content": f"Document {seed}: {_words(rng, 240)}"}]
    session, token, turns = uuid.uuid4().hex, None, []
    for _ in range(TURNS):
        body = {"model": s.model, "messages": list(messages), **GREEDY}
        headers = {"X-Session-ID": session, **({"X-KVAgent-Cache-Token": token} if token
                                               else {})}
        r = httpx.post(f"{s.base_url}/chat/completions", json=body, headers=headers,
                       timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, r.text
        out = r.json()
        token = out["kvagent"]["cache_token"]
        turns.append((body, out))
        messages += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Tool result: {_words(rng, 50)}"}]
    return turns


def chat(s: Any, session: str, request: dict[str, Any], token: str | None = None
         ) -> dict[str, Any]:
    return session_chat(s.base_url, session, request, token, timeout=REQUEST_TIMEOUT_S)


def recomputed(s: Any, request: dict[str, Any]) -> str:
    return recomputed_answer(s.prefill_url, request, timeout=REQUEST_TIMEOUT_S)


#: Bounded arguments: a random-weight model made to call a tool writes a whole call.
BUILD_TOOL = [{"type": "function", "function": {
    "name": "run_build", "description": "Build the project.",
    "parameters": {"type": "object", "properties": {"target": {
        "type": "string", "enum": ["all", "docs"]}}, "required": ["target"]}}}]
#: A final answer that ends by itself (`stop`, not `length`): a random-weight model
#: constrained to one JSON string ends where the grammar does.
FINAL = {"temperature": 0.0, "max_tokens": 16, "response_format": {
    "type": "json_schema", "json_schema": {"name": "verdict", "schema": {
        "type": "string", "enum": ["done"]}}}}


# First in the module, on a fresh D: after the concurrent test D can hold blocks nobody
# will claim until their TTL (a release sent while D stalled on a pull timed out), and
# the room then has to come from the waiting session too.
def test_a_session_waiting_on_a_tool_keeps_its_kv_while_finished_ones_go(
        served: Served) -> None:
    """D holds about two of these conversations. The first one stops on a tool call (it
    will be back), the next three end on a final answer: each needs room, and the router
    gives it the finished sessions' blocks, not the waiting one's, which is older. Its
    next turn then reuses on real vLLM and equals the request recomputed."""
    rng = random.Random(7)
    doc = [{"role": "system", "content": "You are a terse agent. Read the document."},
           {"role": "user", "content": f"Document: {_words(rng, 240)}"}]
    first = {"model": served.model, "messages": doc, "tools": BUILD_TOOL,
             "tool_choice": "required", "parallel_tool_calls": False,
             "temperature": 0.0, "max_tokens": 48}
    waiting = chat(served, "waits-on-a-tool", first)
    calls = waiting["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["run_build"], waiting
    finished = []
    for i in range(3):
        body = {"model": served.model, **FINAL, "messages": [
            {"role": "system", "content": "You are a terse agent. Read the document."},
            {"role": "user", "content": f"Document {i}: {_words(rng, 240)}"}]}
        out = chat(served, f"finished-{i}", body)
        assert out["choices"][0]["finish_reason"] == "stop", out
        assert out["usage"]["prompt_tokens"] > 900
        finished.append((f"finished-{i}", body, out))
    # Room was made on D for them (the gate or the watermark evicted retained turns).
    assert metric_sum(served.router_url, "kvagent_router_retention_evictions_total") >= 1
    nxt = {**first, "tool_choice": "none", "max_tokens": 8, "messages": [
        *doc, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "build ok"}]}
    back = chat(served, "waits-on-a-tool", nxt, waiting["kvagent"]["cache_token"])
    kva = back["kvagent"]
    assert kva["reused_tokens"] > 900, (kva["reason"], kva["path"], kva["reused_tokens"],
                                        served.evictions())
    assert back["choices"][0]["message"]["content"] == recomputed(served, nxt)
    # The first finished session's KV went for the others' room: it recomputes.
    session, body, out = finished[0]
    again = {**body, "messages": [*body["messages"], {
        "role": "assistant", "content": out["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And then?"}]}
    later = chat(served, session, again, out["kvagent"]["cache_token"])
    assert later["kvagent"]["reason"] == "token_rejected:already_used", later["kvagent"]


def test_concurrent_conversations_under_kv_pressure_finish_and_match(served: Served) -> None:
    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
        runs = list(pool.map(lambda seed: _conversation(served, seed), range(CONVERSATIONS)))
    firsts = [run[0][1]["usage"]["prompt_tokens"] for run in runs]
    # The shape that deadlocked: one turn of each conversation does not fit on D.
    assert sum(firsts) > BLOCKS * 128 and min(firsts) > 900, firsts
    # The router had to wait for D's room: the pressure was real.
    assert metric_sum(served.router_url, "kvagent_router_decode_room_waits_total") >= 1
    for run in runs:
        for body, out in run:
            assert out["choices"][0]["message"]["content"] == recomputed(served, body), (
                out["kvagent"])
