"""The multi-turn workload generator and replay parser, without any server."""

from __future__ import annotations

import json

import pytest

from benchmarks.api import (
    AssistantScript,
    ReplayError,
    WorkloadSpec,
    assistant_message,
    generate,
    load_replay,
    parse_replay,
    tool_definitions,
)


def small(**kw) -> WorkloadSpec:
    base = {"seed": 7, "conversations": 3, "turns": 6, "system_prompt_tokens": 60,
            "context_tokens": 200, "tool_result_tokens": (30, 90), "user_turn_tokens": (10, 20)}
    return WorkloadSpec(**{**base, **kw})


def test_same_seed_same_workload() -> None:
    a, b = generate(small()), generate(small())
    assert a.model_dump() == b.model_dump()
    assert a.fingerprint() == b.fingerprint()


def test_other_seed_other_workload() -> None:
    a, b = generate(small(seed=1)), generate(small(seed=2))
    assert a.fingerprint() != b.fingerprint()
    assert a.conversations[0].turns[0].messages[1] != b.conversations[0].turns[0].messages[1]


def test_counts_and_shape() -> None:
    w = generate(small(conversations=4, turns=5, concurrency=3, max_tokens=9))
    assert len(w.conversations) == 4 and w.concurrency == 3 and w.max_tokens == 9
    assert len({c.id for c in w.conversations}) == 4
    system_prompts = set()
    for conv in w.conversations:
        assert len(conv.turns) == 5
        first = conv.turns[0]
        assert first.assistant is None
        assert [m["role"] for m in first.messages] == ["system", "user"]
        system_prompts.add(first.messages[0]["content"])
        assert conv.tools == tool_definitions()
        for turn in conv.turns[1:]:
            assert turn.assistant is not None
            roles = [m["role"] for m in turn.messages]
            if turn.assistant.tool_calls:
                # one tool result per call, answering it by id
                assert roles == ["tool"] * len(turn.assistant.tool_calls)
                ids = [c["id"] for c in turn.assistant.tool_calls]
                assert [m["tool_call_id"] for m in turn.messages] == ids
                for call in turn.assistant.tool_calls:
                    json.loads(call["function"]["arguments"])
            else:
                assert roles == ["user"]
    assert len(system_prompts) == 1  # shared across conversations


def test_first_user_message_differs_per_conversation() -> None:
    w = generate(small())
    firsts = {c.turns[0].messages[1]["content"] for c in w.conversations}
    assert len(firsts) == len(w.conversations)


@pytest.mark.parametrize("seed", range(5))
def test_sizes_within_bounds(seed: int) -> None:
    spec = small(seed=seed, turns=12, tool_result_tokens=(40, 120), context_tokens=500,
                 user_turn_tokens=(15, 30))
    cpt = spec.chars_per_token
    w = generate(spec)
    kinds = set()
    for conv in w.conversations:
        doc = conv.turns[0].messages[1]["content"]
        # the document plus a one-line preamble and a code fence
        assert 500 * cpt <= len(doc) <= 500 * cpt + 300
        for turn in conv.turns[1:]:
            for m in turn.messages:
                n = len(m["content"])
                if m["role"] == "tool":
                    assert round(40 * cpt) <= n <= round(120 * cpt), n
                else:
                    assert round(15 * cpt) <= n <= round(30 * cpt), n
            for call in turn.assistant.tool_calls:
                kinds.add(call["function"]["name"])
    assert len(kinds) >= 3  # a mix of tool result kinds


def test_json_tool_results_are_valid_json() -> None:
    w = generate(small(turns=20, conversations=2))
    checked = 0
    for conv in w.conversations:
        for turn in conv.turns[1:]:
            for call, msg in zip(turn.assistant.tool_calls, turn.messages, strict=False):
                if call["function"]["name"] in ("search_code", "list_directory", "http_get"):
                    json.loads(msg["content"])
                    checked += 1
    assert checked > 0


def test_user_turn_probability_extremes() -> None:
    never = generate(small(user_turn_probability=0.0))
    always = generate(small(user_turn_probability=1.0))
    assert all(t.assistant.tool_calls for c in never.conversations for t in c.turns[1:])
    assert not any(t.assistant.tool_calls for c in always.conversations for t in c.turns[1:])


def test_bad_ranges_rejected() -> None:
    with pytest.raises(ValueError, match="tool_result_tokens"):
        WorkloadSpec(tool_result_tokens=(50, 10))
    with pytest.raises(ValueError):
        WorkloadSpec(conversations=0)


def test_quick_is_small() -> None:
    w = generate(WorkloadSpec.quick())
    assert len(w.conversations) == 2 and all(len(c.turns) == 4 for c in w.conversations)
    chars = sum(len(m["content"]) for c in w.conversations[:1] for t in c.turns
                for m in t.messages)
    assert chars / WorkloadSpec.quick().chars_per_token < 2000


def test_assistant_message_uses_model_answer_and_scripted_calls() -> None:
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "read_file", "arguments": "{}"}}]
    script = AssistantScript(tool_calls=calls, recorded_content="recorded")
    assert assistant_message(script, "model says", keep_recorded=False) == {
        "role": "assistant", "content": "model says", "tool_calls": calls}
    assert assistant_message(script, "model says", keep_recorded=True)["content"] == "recorded"
    plain = assistant_message(AssistantScript(), "hi", keep_recorded=True)
    assert plain == {"role": "assistant", "content": "hi"}


# ---------------------------------------------------------------------------- replay

CONV = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "let me look",
     "tool_calls": [{"id": "t1", "type": "function",
                     "function": {"name": "read_file", "arguments": "{\"path\": \"a\"}"}}]},
    {"role": "tool", "tool_call_id": "t1", "content": "file body"},
    {"role": "assistant", "content": "done"},
    {"role": "user", "content": "thanks, one more"},
]


def test_replay_splits_turns_at_answers() -> None:
    w = parse_replay([CONV], max_tokens=8, concurrency=1)
    (conv,) = w.conversations
    assert [[m["role"] for m in t.messages] for t in conv.turns] == [
        ["system", "user"], ["tool"], ["user"]]
    assert conv.turns[0].assistant is None
    assert conv.turns[1].assistant.recorded_content == "let me look"
    assert conv.turns[1].assistant.tool_calls[0]["id"] == "t1"
    assert conv.turns[2].assistant.recorded_content == "done"
    assert conv.turns[2].assistant.tool_calls == []
    assert w.max_tokens == 8 and w.concurrency == 1


def test_replay_trailing_answer_is_dropped_and_object_forms() -> None:
    data = {"tools": [{"type": "function", "function": {"name": "f"}}],
            "conversations": [{"id": "x", "messages": CONV[:5]}, CONV[:2]]}
    w = parse_replay(data)
    assert [c.id for c in w.conversations] == ["x", "replay-1"]
    assert len(w.conversations[0].turns) == 2  # the final assistant answer is never sent
    assert w.conversations[1].tools[0]["function"]["name"] == "f"


def test_replay_leading_assistant_is_context() -> None:
    conv = [{"role": "assistant", "content": "How can I help?"},
            {"role": "user", "content": "hi"}]
    (c,) = parse_replay([conv]).conversations
    assert [m["role"] for m in c.turns[0].messages] == ["assistant", "user"]


def test_replay_content_parts_become_text() -> None:
    conv = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]},
            {"role": "user", "content": "q2"}]
    (c,) = parse_replay([conv]).conversations
    assert c.turns[1].assistant.recorded_content == "ab"


@pytest.mark.parametrize(("data", "match"), [
    ([], "non-empty list"),
    ({"convs": []}, "conversations"),
    ([[{"role": "wizard", "content": "x"}]], "conversation 0 message 0"),
    ([[{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]], "tool_call_id"),
    ([[{"role": "system", "content": "only"}]], "no user or tool message"),
    ([{"id": "a"}], "'messages' list"),
    ([[{"role": "user", "content": "x"}], "nope"], "conversation 1"),
])
def test_replay_rejects_bad_input(data, match: str) -> None:
    with pytest.raises(ReplayError, match=match):
        parse_replay(data)


def test_load_replay_file(tmp_path) -> None:
    path = tmp_path / "convs.json"
    path.write_text(json.dumps([CONV]))
    w = load_replay(path)
    assert w.source == "convs.json" and len(w.conversations[0].turns) == 3
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ReplayError, match="invalid JSON"):
        load_replay(bad)
    with pytest.raises(ReplayError, match="cannot read"):
        load_replay(tmp_path / "missing.json")
