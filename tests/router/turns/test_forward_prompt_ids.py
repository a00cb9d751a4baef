"""D takes P's prompt token ids instead of rendering the chat again (router setting
`forward_prompt_ids`, vLLM's `kv_transfer_params.prompt_token_ids`).

Against fake nodes that honour the key as vLLM 0.32 does (the forwarded ids replace the
rendered chat, except with `echo` or media). The same on real vLLM, answers equal to a
recompute: tests/router/turns/test_forward_prompt_ids_vllm.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fakes import router_stack
from kvagent_server.router.auth.tenancy import Tenant
from kvagent_server.router.nodes.legs import sampled_token
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.turns.policy import forwards_first_token, forwards_prompt_ids
from kvagent_server.router.turns.policy_params import LegParams
from kvagent_server.router.turns.shapes import TurnRequest
from router_client import FIRST, no_wrong_kv, turn

CHAT = "/v1/chat/completions"


def _request(body: dict[str, Any], endpoint: str = CHAT) -> TurnRequest:
    tenant = Tenant(name="t", cache_salt="salt", max_concurrent_streams=4)
    return TurnRequest.build(endpoint=endpoint, body=body, tenant=tenant, session="s",
                             token=None)


async def _conversation(st: Any, turns: int) -> list[dict[str, Any]]:
    messages, token, out = list(FIRST), None, []
    for i in range(turns):
        kva, answer, _ = await turn(st, messages, token=token)
        out.append(kva)
        token = kva["cache_token"]
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"step {i} done, what next?"}]
    return out


async def test_each_decode_leg_after_a_prefill_leg_takes_ps_prompt_ids() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kvas = await _conversation(st, 4)
        assert [k["path"] for k in kvas] == ["pd_fresh"] + ["pd_reuse"] * 3
        p, d = st.prefill[0], st.decode[0]
        assert all(b.get("return_token_ids") for b in p.requests)
        # One forwarded prompt per turn, and each is exactly what D would have rendered.
        assert len(d.forwarded_prompts) == 4
        assert all(ids == rendered for ids, rendered in d.forwarded_prompts)
        # And the token P sampled, which is the one D samples first for that prompt.
        assert len(d.first_tokens) == 4
        assert all(given == own for given, own in d.first_tokens)
        no_wrong_kv(st)


async def test_setting_off_lets_d_render() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            engine={"forward_prompt_ids": False}) as st:
        kvas = await _conversation(st, 3)
        assert kvas[-1]["path"] == "pd_reuse"
        assert not any(b.get("return_token_ids") for b in st.prefill[0].requests)
        assert st.decode[0].forwarded_prompts == []
        assert st.decode[0].first_tokens == []  # it rides on the same `return_token_ids`
        no_wrong_kv(st)


async def test_first_token_setting_off_keeps_the_ids() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            engine={"forward_first_token": False}) as st:
        await _conversation(st, 2)
        assert len(st.decode[0].forwarded_prompts) == 2
        assert st.decode[0].first_tokens == []
        no_wrong_kv(st)


async def test_d_direct_turns_have_no_prefill_leg_to_forward_from() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 1_000_000}}) as st:
        kvas = await _conversation(st, 3)
        assert [k["path"] for k in kvas[1:]] == ["d_direct"] * 2
        assert len(st.decode[0].forwarded_prompts) == 1  # the first turn's P/D recompute
        no_wrong_kv(st)


@pytest.mark.parametrize(("body", "endpoint", "settings", "want"), [
    ({"messages": FIRST}, CHAT, {}, True),
    ({"messages": FIRST}, CHAT, {"forward_prompt_ids": False}, False),
    ({"prompt": "hello"}, "/v1/completions", {}, False),  # vLLM forwards chat ids only
    ({"messages": FIRST, "echo": True}, CHAT, {}, False),  # vLLM renders for echo
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     CHAT, {}, False),  # and for media
    # P's answer must stay within the cap: one id per body byte would not.
    ({"messages": [{"role": "user", "content": "x" * 4000}]}, CHAT,
     {"max_upstream_body_bytes": 64 * 1024}, False),
    ({"messages": [{"role": "user", "content": "x" * 100}]}, CHAT,
     {"max_upstream_body_bytes": 128 * 1024}, True),
])
def test_which_turns_forward(body: dict[str, Any], endpoint: str, settings: dict[str, Any],
                             want: bool) -> None:
    assert forwards_prompt_ids(LegParams.of(RouterSettings(**settings)),
                               _request(body, endpoint)) is want


@pytest.mark.parametrize(("value", "want"), [
    ([1, 0, 151935], [1, 0, 151935]), ([], None), (None, None), ([1, True], None),
    ([1, -1], None), ([1, "2"], None), ([1.0], None), ("1,2", None),
])
def test_only_a_list_of_token_ids_is_taken_from_ps_answer(value: object, want: object) -> None:
    from kvagent_server.router.nodes.legs import token_ids
    assert token_ids(value) == want


@pytest.mark.parametrize(("answer", "want"), [
    ({"choices": [{"finish_reason": "length", "token_ids": [17]}]}, 17),
    ({"choices": [{"finish_reason": "stop", "token_ids": [2]}]}, None),  # EOS: nothing after
    ({"choices": [{"finish_reason": "length"}]}, None),
    ({"choices": [{"finish_reason": "length", "token_ids": [17, 18]}]}, None),
    ({"choices": [{"finish_reason": "length", "token_ids": [True]}]}, None),
    ({"choices": [{"finish_reason": "length", "token_ids": [1]},
                  {"finish_reason": "length", "token_ids": [2]}]}, None),
    ({"choices": "x"}, None), ({}, None),
])
def test_the_sampled_token_is_read_only_from_a_one_token_answer(answer: dict[str, Any],
                                                                 want: int | None) -> None:
    assert sampled_token(answer) == want


@pytest.mark.parametrize(("body", "settings", "want"), [
    ({"messages": FIRST}, {}, True),
    ({"messages": FIRST, "n": 1}, {}, True),
    ({"messages": FIRST, "n": 3, "temperature": 0.8}, {}, False),  # each sample its own
    ({"messages": FIRST}, {"forward_first_token": False}, False),
])
def test_which_turns_forward_ps_token(body: dict[str, Any], settings: dict[str, Any],
                                      want: bool) -> None:
    assert forwards_first_token(LegParams.of(RouterSettings(**settings)), _request(body)) is want
