"""The KV identity core (router.reuse.identity) and its place in the planner: pure tests."""

from __future__ import annotations

from typing import Any

import pytest
from kvagent_server.router.nodes.prompt_ids import tokenize_request
from kvagent_server.router.reuse import identity
from kvagent_server.router.reuse.planner import Reason, plan_reuse
from kvagent_server.router.store.handle import Handle, pack_handle, unpack_handle

PNG_A = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
PNG_B = PNG_A.replace("nGNgYGD4", "nGNgYGD5")
PH = 9  # the placeholder token id of these tests


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*contents: Any, model: str = "m", **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": c} for c in contents]
    return {"model": model, "messages": msgs, "cache_salt": "salt", **extra}


def ident(body: dict[str, Any], ids: list[int] = (), **kw: Any) -> Any:  # type: ignore[assignment]
    return identity.identity_of(body, chat="messages" in body, prompt_ids=ids,
                                placeholder_ids=[PH] if ids else [], **kw)


# ------------------------------------------------------------------ the allow-list


def test_sampling_and_output_fields_are_ignored() -> None:
    body = chat("hi", temperature=0.3, top_p=0.9, max_tokens=5, stop=["x"], stream=True,
                stream_options={"include_usage": True}, logprobs=True, top_logprobs=2,
                response_format={"type": "json_object"}, tool_choice="auto", user="u",
                metadata={"a": "b"}, seed=1, n=1, priority=3, request_id="r",
                return_token_ids=True, tools=[], chat_template_kwargs={"x": 1},
                documents=[{"text": "d"}], reasoning_effort="low")
    assert identity.unverifiable_fields(body, chat=True) == ()


@pytest.mark.parametrize("field,value", [
    ("truncate_prompt_tokens", 10), ("mm_processor_kwargs", {"size": 3}),
    ("media_io_kwargs", {"image": {"mode": "L"}}), ("a_field_from_a_later_vllm", 1)])
def test_fields_that_may_shape_kv_are_unverifiable(field: str, value: Any) -> None:
    body = chat("hi", **{field: value})
    assert identity.unverifiable_fields(body, chat=True) == (field,)
    held = ident(chat("hi"))
    got = identity.check(held, ident(body))
    assert (got.reason, got.detail, got.cap) == ("unverifiable_input", field, 0)


def test_completion_fields() -> None:
    assert identity.unverifiable_fields({"prompt": "x", "add_special_tokens": True,
                                         "max_tokens": 3}, chat=False) == ()
    assert identity.unverifiable_fields({"prompt": "x", "prompt_embeds": "AAAA",
                                         "suffix": "s"}, chat=False) == ("prompt_embeds",
                                                                          "suffix")
    # `messages` is not a completion field: it is never silently ignored there
    assert identity.unverifiable_fields({"prompt": "x", "messages": []},
                                        chat=False) == ("messages",)


def test_none_values_are_absent_and_extra_fields_can_be_made_unverifiable() -> None:
    assert identity.unverifiable_fields(chat("hi", truncate_prompt_tokens=None),
                                        chat=True) == ()
    body = chat("hi", response_format={"type": "json_object"})
    assert identity.unverifiable_fields(body, chat=True,
                                        extra=["response_format"]) == ("response_format",)


def test_every_vllm_request_field_is_classified() -> None:
    """Each field of vLLM's chat and completion requests is ignored, rendered, part of the
    identity or unverifiable: a field vLLM adds lands in none of the first three, and is
    then unverifiable by default (this lists which ones are, so a new one is seen)."""
    chat_req = pytest.importorskip(
        "vllm.entrypoints.openai.chat_completion.protocol").ChatCompletionRequest
    comp_req = pytest.importorskip(
        "vllm.entrypoints.openai.completion.protocol").CompletionRequest
    chat_left = {f for f in chat_req.model_fields if f not in identity.IGNORED
                 and f not in identity.RENDERED_CHAT and f not in identity.IDENTITY_FIELDS}
    comp_left = {f for f in comp_req.model_fields if f not in identity.IGNORED
                 and f not in identity.RENDERED_COMPLETION and f not in identity.IDENTITY_FIELDS}
    assert chat_left == {"truncate_prompt_tokens", "media_io_kwargs", "mm_processor_kwargs"}
    assert comp_left == {"truncate_prompt_tokens", "prompt_embeds", "suffix"}
    # ignored because vLLM drops them: once vLLM takes one, it must be decided again
    assert not set(identity.OPENAI_ONLY) & (set(chat_req.model_fields)
                                            | set(comp_req.model_fields))


# ------------------------------------------------------------------ rendering fields


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"enable_thinking": True}),
    ("add_generation_prompt", False), ("continue_final_message", True),
    ("add_special_tokens", True), ("documents", [{"title": "t", "text": "x"}]),
    ("reasoning_effort", "high")])
def test_rendering_fields_reach_tokenize(field: str, value: Any) -> None:
    """Every rendering field changes the /tokenize request, so vLLM renders the ids the
    router compares with it (the fake-node tests show the ids then change)."""
    assert field in identity.RENDERED_CHAT
    base = chat("hi")
    assert tokenize_request({**base, field: value}, chat=True) != tokenize_request(
        base, chat=True)


def test_template_arguments_fold_like_vllm() -> None:
    req = tokenize_request(chat("hi", documents=[{"text": "d"}], reasoning_effort="none",
                                chat_template_kwargs={"x": 1}), chat=True)
    assert req["chat_template_kwargs"] == {"x": 1, "documents": [{"text": "d"}],
                                           "reasoning_effort": "none",
                                           "enable_thinking": False}
    # a client's own enable_thinking wins, as in vLLM
    req = tokenize_request(chat("hi", reasoning_effort="high",
                                chat_template_kwargs={"enable_thinking": False}), chat=True)
    assert req["chat_template_kwargs"]["enable_thinking"] is False


# ------------------------------------------------------------------ identity checks


def test_model_and_salt() -> None:
    held = ident(chat("hi"))
    assert identity.check(held, ident(chat("hi"))) == identity.IdentityCheck()
    got = identity.check(held, ident(chat("hi", model="adapter-b")))
    assert (got.reason, got.detail, got.cap) == ("identity_changed", "model", 0)
    got = identity.check(held, ident({**chat("hi"), "cache_salt": "other"}))
    assert (got.reason, got.detail) == ("identity_changed", "salt")
    assert identity.check(None, ident(chat("hi"))).detail == "unrecorded"


def test_a_handle_made_with_an_unverifiable_field_is_not_reused_without_it() -> None:
    held = ident(chat("hi", mm_processor_kwargs={"size": 2}))
    got = identity.check(held, ident(chat("hi")))
    assert (got.reason, got.detail, got.cap) == ("unverifiable_input", "mm_processor_kwargs", 0)


def test_placeholder_positions() -> None:
    assert identity.placeholder_starts([1, PH, PH, 2, PH, 3, PH], [PH]) == [1, 4, 6]
    body = chat([image(PNG_A), {"type": "text", "text": "x"}], [image(PNG_B)])
    got = ident(body, [1, PH, PH, 2, 3, PH, PH, 4])
    assert [m.placeholder for m in got.media] == [1, 5]
    assert [m.where for m in got.media] == ["messages[0].content[0]", "messages[1].content[0]"]
    assert all(m.inline for m in got.media)
    # more runs than items (or fewer): no position is trusted
    assert [m.placeholder for m in ident(body, [PH, 1, PH, 2, PH]).media] == [None, None]


def test_swapped_image_caps_reuse_at_its_placeholder() -> None:
    ids = [1] * 40 + [PH] * 8 + [2] * 40 + [PH] * 8 + [3]
    held = ident(chat([image(PNG_A)], [image(PNG_A)]), ids)
    same = identity.check(held, ident(chat([image(PNG_A)], [image(PNG_A)]), ids))
    assert same == identity.IdentityCheck()
    swapped = identity.check(held, ident(chat([image(PNG_A)], [image(PNG_B)]), ids))
    assert (swapped.reason, swapped.detail, swapped.cap) == ("multimodal_changed", "item_1", 88)
    first = identity.check(held, ident(chat([image(PNG_B)], [image(PNG_A)]), ids))
    assert first.cap == 40
    # positions unknown: nothing is reused
    unknown = identity.check(ident(chat([image(PNG_A)])), ident(chat([image(PNG_B)])))
    assert (unknown.reason, unknown.cap) == ("multimodal_changed", 0)


def test_removed_or_text_replaced_image_differs() -> None:
    ids = [1] * 40 + [PH] * 8 + [2]
    held = ident(chat([image(PNG_A)]), ids)
    gone = identity.check(held, ident(chat("text where the image was"), [1] * 49))
    assert (gone.reason, gone.cap) == ("multimodal_changed", 40)


def test_new_images_after_the_held_turn_are_not_a_difference() -> None:
    held = ident(chat([image(PNG_A)]))  # one message; its reply becomes messages[1]
    body = chat([image(PNG_A)])
    body["messages"] += [{"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [image(PNG_B)]}]
    assert identity.check(held, ident(body)) == identity.IdentityCheck()
    # an image added inside the held messages is a difference
    inside = chat([image(PNG_A), image(PNG_B)])
    assert identity.check(held, ident(inside)).reason == "multimodal_changed"


def test_url_media_is_not_proven_equal_unless_trusted() -> None:
    url = image("http://198.51.100.7/cat.png")
    ids = [1] * 40 + [PH] * 8 + [2]
    held = ident(chat([url]), ids)
    got = identity.check(held, ident(chat([url]), ids))
    assert (got.reason, got.detail, got.cap) == ("unverifiable_input", "media_url", 40)
    assert identity.check(held, ident(chat([url]), ids), trust_urls=True) == (
        identity.IdentityCheck())
    other = identity.check(held, ident(chat([image("http://198.51.100.7/dog.png")]), ids),
                           trust_urls=True)
    assert other.reason == "multimodal_changed"


def test_audio_and_file_parts_are_items() -> None:
    body = chat([{"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}},
                 {"type": "file", "file": {"file_data": "JVBER", "filename": "a.pdf"}},
                 {"type": "file", "file": {"file_id": "file-1"}}])
    media = ident(body).media
    assert [m.inline for m in media] == [True, True, False]


# ------------------------------------------------------------------ in the planner


def handle(ids: list[int], ident_: Any) -> Handle:
    return Handle(handle_id="h", tenant="t", session="s", decode_node="d", decode_epoch="e",
                  kv_transfer_params={"remote_num_tokens": len(ids),
                                      "remote_block_ids": [list(range(-(-len(ids) // 16)))]},
                  token_ids=ids, block_size=16, created_at=0, expires_at=100,
                  identity=ident_)


def test_planner_refuses_on_identity_and_caps_on_media() -> None:
    ids = list(range(200))
    h = handle(ids, None)
    refused = plan_reuse(ids + [7], h, threshold=16, now=1,
                         identity=identity.IdentityCheck(reason="identity_changed",
                                                         detail="model", cap=0))
    assert (refused.reason, refused.reuse_tokens, refused.label) == (
        Reason.IDENTITY_CHANGED, 0, "identity_changed:model")
    capped = plan_reuse(ids + [7], h, threshold=16, now=1,
                        identity=identity.IdentityCheck(reason="multimodal_changed",
                                                        detail="item_1", cap=100))
    assert (capped.reason, capped.reuse_tokens, capped.common_prefix) == (
        Reason.MULTIMODAL_CHANGED, 96, 100)
    # a cap past the token divergence changes nothing
    early = plan_reuse(ids[:50] + [7], h, threshold=16, now=1,
                       identity=identity.IdentityCheck(reason="multimodal_changed",
                                                       detail="item_1", cap=100))
    assert (early.reason, early.reuse_tokens) == (Reason.PREFIX_PARTIAL, 48)
    small = plan_reuse(ids + [7], h, threshold=64, now=1,
                       identity=identity.IdentityCheck(reason="multimodal_changed",
                                                       detail="item_0", cap=40))
    assert (small.reason, small.reuse_tokens) == (Reason.MULTIMODAL_CHANGED, 0)


def test_identity_survives_packing() -> None:
    ids = list(range(40))
    ident_ = ident(chat([image(PNG_A)]), [1] * 5 + [PH] * 3 + [2])
    h = handle(ids, ident_)
    assert unpack_handle(pack_handle(h)) == h
    old = handle(ids, None)  # a handle from a router that recorded no identity
    assert unpack_handle(pack_handle(old)).identity is None


# ---------------------------------------------------------------- messages that extend


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, **extra}


HELD = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
NEXT = [*HELD, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]


def _held(body: dict[str, Any]) -> Any:
    return identity.identity_of(body, chat=True, history=True)


def test_a_body_that_repeats_the_held_messages_extends_them() -> None:
    held = _held(_chat(HELD, tools=[{"type": "function", "function": {"name": "f"}}]))
    assert held.history is not None and held.messages == 2
    grown = _chat(NEXT, tools=[{"type": "function", "function": {"name": "f"}}])
    assert identity.extension_chars(held, grown) == identity.message_chars(NEXT[2:]) > 0


@pytest.mark.parametrize("change", [
    {"messages": [{"role": "system", "content": "be BRIEF"}, *NEXT[1:]]},  # an edit
    {"messages": HELD},  # nothing new
    {"messages": NEXT[:1]},  # fewer messages
    {"messages": NEXT, "tools": [{"type": "function", "function": {"name": "g"}}]},
    {"messages": NEXT, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": NEXT, "add_generation_prompt": False},
])
def test_any_change_to_what_rendered_the_held_messages_is_no_extension(
        change: dict[str, Any]) -> None:
    held = _held(_chat(HELD))
    assert identity.extension_chars(held, {"model": "m", **change}) is None


def test_a_handle_without_a_history_digest_is_never_extended() -> None:
    held = identity.identity_of(_chat(HELD), chat=True)  # recorded without `history`
    assert held.history is None
    assert identity.extension_chars(held, _chat(NEXT)) is None


def test_the_history_digest_ignores_fields_that_do_not_render() -> None:
    held = _held(_chat(HELD, temperature=0.7, max_tokens=5))
    assert identity.extension_chars(held, _chat(NEXT, temperature=0.0, stream=True))


def test_a_handle_without_history_packs_as_before_the_field_existed() -> None:
    """Replicas that predate `history` forbid unknown fields: leave it out unless set."""
    import json

    ident = identity.identity_of(_chat(HELD), chat=True)
    fields = {"handle_id": "h", "tenant": "t", "session": "s", "decode_node": "d",
              "decode_epoch": "e", "kv_transfer_params": {}, "token_ids": [1, 2],
              "block_size": 16, "created_at": 1.0, "expires_at": 2.0}
    plain = Handle(**fields, identity=ident)
    packed = pack_handle(plain)
    meta = json.loads(packed[4:4 + int.from_bytes(packed[:4], "little")])
    assert "history" not in meta["identity"]
    assert unpack_handle(packed) == plain
    recorded = Handle(**fields, identity=_held(_chat(HELD)))
    assert unpack_handle(pack_handle(recorded)).identity.history == recorded.identity.history


# ------------------------------------------------------------------ branches


def _turns() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """An owner's turns 1 and 2 (2 repeats 1 and its answer), and an intruder's turn chained
    onto turn 1's answer with its own question (what a `previous_response_id` of another
    conversation, or a shared session id, sends)."""
    sys_msg = {"role": "system", "content": "You are terse."}
    one = {"model": "m", "messages": [sys_msg, {"role": "user", "content": "hi"}]}
    answer = {"role": "assistant", "content": "hello"}
    two = {**one, "messages": [*one["messages"], answer, {"role": "user", "content": "more"}]}
    three = {**two, "messages": [*two["messages"], answer, {"role": "user", "content": "go"}]}
    intruder = {**one, "messages": [*one["messages"], answer,
                                    {"role": "user", "content": "something else"}]}
    return one, two, three, intruder


def test_a_turn_continues_the_held_turn_whose_messages_it_repeats() -> None:
    one, two, three, intruder = _turns()
    held_one = ident(one, history=True)
    held_two = ident(two, history=True)
    assert identity.continues(held_one, two) is True
    assert identity.continues(held_one, intruder) is True  # a fork of turn 1: it continues
    assert identity.continues(held_two, three) is True
    assert identity.continues(held_two, two) is True  # a retry of the same turn
    # The owner's turn 2 is held: a turn chained onto turn 1 does not continue it.
    assert identity.continues(held_two, intruder) is False
    # Another history under the same session id, and other rendering inputs.
    assert identity.continues(held_two, {**three, "messages": [
        {"role": "user", "content": "a different conversation"}]}) is False
    assert identity.continues(held_two, {**three, "tools": [
        {"type": "function", "function": {"name": "f"}}]}) is False


def test_without_a_recorded_digest_nothing_tells() -> None:
    one, two, _, _ = _turns()
    assert identity.continues(None, two) is None
    assert identity.continues(ident(one), two) is None  # history not recorded
    assert identity.continues(ident(one, history=True), {"prompt": "x"}) is None
