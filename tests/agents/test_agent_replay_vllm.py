"""Recorded Claude Code and Codex sessions replayed against the router: before fake P/D
nodes (fast, always) and before the real bundle (marker `vllm`).

The fixtures (tests/agents/fixtures/, format in its README) hold what each client sends,
header for header; `replay.py` plays the client: it sends them in order, rebuilds each
answer as the client would and splices it into the later requests of the same agent. The
contract under test (docs/agents/index.md): every request succeeds; every later turn of the
main agent reuses KV (`kvagent.reused_tokens > 0` on `pd_reuse` or `d_direct`) whatever the
billing header's per-request `cch`; a subagent or child thread reuses its own history and
never takes the main agent's handle; after a compaction the turn is recomputed or reuses a
verified prefix, and never fails.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import replay
from client_targets import Target, client_bundle  # noqa: F401 - the module's `bundle`

FIXTURES = ("claude_code", "codex")


@pytest.fixture(scope="module")
def runs(bundle: Target) -> dict[str, list[replay.Result]]:
    """Each fixture replayed once per target (lazily, by `played`)."""
    return {}


def played(runs: dict[str, list[replay.Result]], target: Target,
           name: str) -> dict[str, replay.Result]:
    if name not in runs:
        runs[name] = replay.replay(replay.load_fixture(name), target.router_url,
                                   model=target.model)
    return {r.id: r for r in runs[name]}


def _requests(name: str) -> list[dict[str, Any]]:
    return replay.load_fixture(name)["requests"]


# ------------------------------------------------------------------ against the router


@pytest.mark.parametrize("name", FIXTURES)
def test_every_request_succeeds(runs: dict[str, Any], bundle: Target, name: str) -> None:
    results = played(runs, bundle, name)
    checked = [r for r in results.values() if r.kind != "resumed"]
    failed = [r for r in checked if not r.ok]
    assert not failed, replay.report(list(results.values()))
    for r in checked:
        if r.kind != "count_tokens":
            assert r.kvagent is not None, f"{r.id}: no kvagent report\n" + r.summary()
            assert r.path in replay.PATHS, r.summary()


@pytest.mark.parametrize("name", FIXTURES)
def test_every_later_turn_reuses(runs: dict[str, Any], bundle: Target, name: str) -> None:
    """Every request the fixture marks `reuse: required` (a later turn of the main agent, of
    a subagent or child thread, and the turn after a compaction's restart) reused KV, and its
    usage reports at least as many cached tokens."""
    results = played(runs, bundle, name)
    missed = [r for r in results.values() if r.reuse == "required"
              and not (r.ok and r.reused_tokens > 0 and r.path in replay.REUSE_PATHS)]
    assert not missed, replay.report(list(results.values()))
    for r in results.values():
        if r.reuse == "required":
            assert r.cached_tokens is not None and r.cached_tokens >= r.reused_tokens, \
                r.summary()


@pytest.mark.parametrize("name", FIXTURES)
def test_subagent_keeps_its_own_branch(runs: dict[str, Any], bundle: Target,
                                       name: str) -> None:
    """A subagent / child thread shares the session id but not the main agent's handle: its
    own later turns reuse its own history, and the main agent's first turn after it still
    reuses the main agent's."""
    results = played(runs, bundle, name)
    order = [r["id"] for r in _requests(name)]
    subagents = [i for i in order if results[i].kind == "subagent"]
    assert subagents
    after = max(order.index(i) for i in subagents)
    main_next = next(i for i in order[after + 1:] if results[i].agent == "main")
    r = results[main_next]
    assert r.ok and r.reused_tokens > 0 and r.path in replay.REUSE_PATHS, \
        replay.report(list(results.values()))
    for i in subagents:
        if results[i].reuse == "required":
            assert results[i].reused_tokens > 0, results[i].summary()


def _main_chains(name: str) -> list[list[str]]:
    """Runs of consecutive main-agent turns that must reuse (a compaction ends a run)."""
    chains: list[list[str]] = [[]]
    for q in _requests(name):
        if q["agent"] != "main":
            continue
        if q["kind"] == "turn" and q["reuse"] == "required":
            chains[-1].append(q["id"])
        else:
            chains.append([])
    return [c for c in chains if len(c) > 1]


@pytest.mark.parametrize("name", FIXTURES)
def test_reuse_grows_along_the_main_thread(runs: dict[str, Any], bundle: Target,
                                           name: str) -> None:
    """Each main turn extends the previous prompt, so the reused prefix grows turn by turn;
    a router that stopped at something every request changes (Claude Code's `cch`) would
    reuse the same short prefix every time."""
    results = played(runs, bundle, name)
    chains = _main_chains(name)
    assert chains
    for chain in chains:
        reused = [results[i].reused_tokens for i in chain]
        assert all(a < b for a, b in itertools.pairwise(reused)), \
            (chain, reused, replay.report(list(results.values())))


def test_billing_header_cch_does_not_stop_reuse(runs: dict[str, Any], bundle: Target) -> None:
    """Claude Code's first system block changes on every request (`cch=`); consecutive main
    turns still reuse past it, more on every turn."""
    by_id = {q["id"]: q for q in _requests("claude_code")}
    results = played(runs, bundle, "claude_code")
    for chain in _main_chains("claude_code"):
        assert len({_cch(by_id[i]) for i in chain}) == len(chain)
        reused = [results[i].reused_tokens for i in chain]
        assert reused[0] > 0 and all(a < b for a, b in itertools.pairwise(reused)), \
            (chain, reused, replay.report(list(results.values())))


@pytest.mark.parametrize("name", FIXTURES)
def test_compaction_never_fails(runs: dict[str, Any], bundle: Target, name: str) -> None:
    """The summary request and the turn that restarts from the summary both succeed; the
    restart is a recompute or reuses only what the router verified (no wrong KV)."""
    results = played(runs, bundle, name)
    for r in results.values():
        if r.kind in ("compaction", "after_compaction"):
            assert r.ok and r.path in replay.PATHS, r.summary()
    if bundle.stack is not None:
        assert not bundle.stack.cluster.events_of("wrong_kv")


def test_resumed_session_with_encrypted_reasoning(runs: dict[str, Any],
                                                  bundle: Target) -> None:
    """A Codex session resumed from api.openai.com resends OpenAI's encrypted reasoning,
    which no server but OpenAI can read. The router either answers (the item is opaque and
    skipped) and reuses on the next turn, or refuses with a clean 400 naming the encrypted
    content, as vLLM does; never a server error."""
    results = played(runs, bundle, "codex")
    resumed = [r for r in results.values() if r.kind == "resumed"]
    assert resumed
    for r in resumed:
        assert r.ok or (r.status == 400 and "ncrypted" in (r.error or "")), r.summary()
    if all(r.ok for r in resumed):
        assert resumed[-1].reused_tokens > 0, replay.report(resumed)


def test_count_tokens(runs: dict[str, Any], bundle: Target) -> None:
    results = played(runs, bundle, "claude_code")
    counted = [r for r in results.values() if r.kind == "count_tokens"]
    assert counted
    for r in counted:
        assert r.ok and isinstance(r.body, dict) and r.body.get("input_tokens", 0) > 0, \
            r.summary()


# ------------------------------------------------------------------ the fixtures themselves


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_is_sound(name: str) -> None:
    """Every placeholder names an earlier request of the same agent; ids are unique."""
    assert replay.check_fixture(replay.load_fixture(name)) == []


def _cch(req: dict[str, Any]) -> str:
    first = req["body"]["system"][0]["text"]
    assert first.startswith("x-anthropic-billing-header: cc_version=")
    assert "cc_entrypoint=cli;" in first
    return first.split("cch=")[1].rstrip(";")


def test_claude_code_fixture_carries_what_claude_code_sends() -> None:
    fixture = replay.load_fixture("claude_code")
    session = fixture["vars"]["SESSION"]
    turns = [q for q in fixture["requests"] if q["kind"] != "count_tokens"]
    assert len({_cch(q) for q in turns}) == len(turns)  # a new cch on every request
    for q in fixture["requests"]:
        h = q["headers"]
        assert h["X-Claude-Code-Session-Id"] == session
        assert h["anthropic-version"] == "2023-06-01" and "anthropic-beta" in h
        assert h["User-Agent"].startswith("claude-cli/") and h["x-app"] == "cli"
        assert "x-api-key" in h or h.get("Authorization", "").startswith("Bearer ")
        if q["kind"] == "count_tokens":
            assert q["path"] == "/v1/messages/count_tokens" and "stream" not in q["body"]
            continue
        body = q["body"]
        assert body["stream"] is True and body["max_tokens"] > 0 and "temperature" in body
        assert json.loads(body["metadata"]["user_id"])["session_id"] == session
        assert any("cache_control" in b for b in body["system"])
        assert any("cache_control" in b for b in body["messages"][-1]["content"])
        assert {t["name"] for t in body["tools"]} >= {"Bash", "Read"}
        assert all("input_schema" in t for t in body["tools"])
        if q["kind"] == "subagent":
            assert h["X-Claude-Code-Agent-Id"] == q["agent"]
        else:
            assert "X-Claude-Code-Agent-Id" not in h
    nested = [q for q in fixture["requests"] if "X-Claude-Code-Parent-Agent-Id" in q["headers"]]
    assert nested and all(q["headers"]["X-Claude-Code-Parent-Agent-Id"]
                          == fixture["vars"]["AGENT_1"] for q in nested)


def test_codex_fixture_carries_what_codex_sends() -> None:
    fixture = replay.load_fixture("codex")
    session = fixture["vars"]["SESSION"]
    windows: list[str] = []
    for q in fixture["requests"]:
        h, body = q["headers"], q["body"]
        assert h["Authorization"].startswith("Bearer ") and h["originator"] == "codex_cli_rs"
        assert body["store"] is False and body["stream"] is True
        assert body["tool_choice"] == "auto" and "parallel_tool_calls" in body
        assert body["include"] == ["reasoning.encrypted_content"] and "reasoning" in body
        assert all(t["type"] == "function" for t in body["tools"])
        if q["agent"] == "resumed":
            assert h["session-id"] == h["thread-id"] == fixture["vars"]["RESUMED_SESSION"]
            continue
        if q["agent"] == "legacy":
            assert h["session_id"] == fixture["vars"]["LEGACY_SESSION"] == body["prompt_cache_key"]
            assert h["OpenAI-Beta"] == "responses=experimental" and "thread-id" not in h
            continue
        assert h["session-id"] == session
        thread = h["thread-id"]
        assert body["prompt_cache_key"] == thread
        assert h["x-codex-window-id"].rsplit(":", 1)[0] == thread
        meta = json.loads(h["x-codex-turn-metadata"])
        assert meta["session_id"] == session and meta["thread_id"] == thread
        assert meta["window_id"] == h["x-codex-window-id"]
        assert meta["request_kind"] == ("compaction" if q["kind"] == "compaction" else "turn")
        if q["agent"] == "main":
            assert thread == session
            windows.append(h["x-codex-window-id"])
        else:
            assert thread != session and h["x-codex-parent-thread-id"] == session
    assert windows[-1] == f"{session}:1" and windows[0] == f"{session}:0"
    reasoning = [item for q in fixture["requests"] for item in q["body"]["input"]
                 if item.get("type") == "reasoning"]
    assert reasoning and all(r["encrypted_content"] for r in reasoning)
    assert {q["agent"] for q in fixture["requests"] if any(
        item.get("type") == "reasoning" for item in q["body"]["input"])} == {"resumed"}


# ------------------------------------------------------------------ the harness itself


def _sse(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines: list[str] = []
    for name, data in events:
        lines += [f"event: {name}", f"data: {json.dumps(data)}", ""]
    return lines


def test_messages_reader_rebuilds_text_and_tool_use() -> None:
    report = {"path": "pd_reuse", "reused_tokens": 2048}
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "usage": {"input_tokens": 12, "cache_read_input_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Run "}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "it."}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
            "type": "input_json_delta", "partial_json": '{"command": "l'}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
            "type": "input_json_delta", "partial_json": 's"}'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                           "usage": {"output_tokens": 9, "cache_read_input_tokens": 2048},
                           "kvagent": report}),
        ("message_stop", {"type": "message_stop"}),
    ]
    reader = replay.MessagesReader()
    for _name, event in replay.sse_events(iter(_sse(events))):
        reader.feed(event)
    result = replay.Result("x", "main", "turn", "any", 200)
    reader.fill(result)
    assert result.answer == [{"type": "text", "text": "Run it."},
                             {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                              "input": {"command": "ls"}}]
    assert result.text == "Run it." and result.kvagent == report
    assert result.cached_tokens == 2048 and result.reused_tokens == 2048


def test_responses_reader_rebuilds_output_items() -> None:
    report = {"path": "d_direct", "reused_tokens": 512}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}
    call = {"id": "fc_1", "type": "function_call", "status": "completed", "name": "shell",
            "arguments": '{"command":["ls"]}', "call_id": "call_1"}
    completed = {"id": "resp_1", "output": [message, call], "kvagent": report,
                 "usage": {"input_tokens": 700, "input_tokens_details": {"cached_tokens": 512}}}
    events = [
        ("response.created", {"type": "response.created", "response": {"id": "resp_1"}}),
        ("response.output_item.done", {"type": "response.output_item.done",
                                       "output_index": 0, "item": message}),
        ("response.output_item.done", {"type": "response.output_item.done",
                                       "output_index": 1, "item": call}),
        ("response.completed", {"type": "response.completed", "response": completed}),
    ]
    reader = replay.ResponsesReader()
    for _name, event in replay.sse_events(iter(_sse(events))):
        reader.feed(event)
    result = replay.Result("x", "main", "turn", "any", 200)
    reader.fill(result)
    assert result.answer == [
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Done."}]},
        {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}',
         "call_id": "call_1"}]
    assert result.text == "Done." and result.response_id == "resp_1"
    assert result.kvagent == report and result.cached_tokens == 512


def test_placeholders_splice_the_named_answer() -> None:
    done = {"a1": replay.Result("a1", "main", "turn", "first", 200,
                                answer=[{"type": "text", "text": "hi"}], text="hi",
                                response_id="resp_9")}
    body = {"model": "{{model}}", "previous_response_id": "{{response_id:a1}}", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "{{answer:a1}}",
         "after": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "got {{answer_text:a1}}"}]}],
        "input": [{"type": "{{answer:a1}}", "before": [{"type": "reasoning"}]}]}
    out = replay.materialize(body, done, model="m")
    assert out["model"] == "m" and out["previous_response_id"] == "resp_9"
    assert out["messages"][1] == {"role": "assistant", "content": [
        {"type": "text", "text": "hi"}, {"type": "tool_use", "id": "t", "name": "Bash",
                                         "input": {}}]}
    assert out["messages"][2]["content"][0]["content"] == "got hi"
    assert out["input"] == [{"type": "reasoning"}, {"type": "text", "text": "hi"}]


def test_fresh_ids_replace_every_occurrence() -> None:
    fixture = replay.load_fixture("codex")
    fresh = replay.with_fresh_ids(fixture)
    text = json.dumps(fresh)
    for value in fixture["vars"].values():
        assert value not in text
    assert replay.check_fixture(fresh) == []
    main = [q for q in fresh["requests"] if q["agent"] == "main"]
    assert len({q["headers"]["session-id"] for q in main}) == 1
