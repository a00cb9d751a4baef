"""``ChatKVAgent`` against the real router: LangChain's standard integration tests, plus
reuse observed across a LangChain conversation that resends its whole history.

The bundle serves the demo model: random weights, deterministic, gibberish text. With
``tool_choice="required"`` vLLM's structured outputs make its tool calls valid JSON, but
nothing makes them *sensible*; the standard tests that check what the model said (the
right argument value, a joke with a punchline) are skipped below, each with its reason.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import pytest

pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")
pytest.importorskip("langchain_tests", reason="langchain-tests (extra dev) not installed")

from kvagent.integrations.langchain import ChatKVAgent
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_tests.integration_tests import ChatModelIntegrationTests

pytestmark = pytest.mark.vllm

RANDOM_ARGS = ("demo model has random weights: a forced tool call's argument values are random "
               "tokens that run on to max_tokens (a string never closes, an integer never "
               "ends), so the call is cut off or holds the wrong value")
RANDOM_TEXT = ("demo model has random weights: the string fields of a structured answer are "
               "random tokens that run on to max_tokens, so the JSON never completes")
UNFORCED = ("demo model has random weights: it calls a tool only when forced, and this test "
            "expects a call under tool_choice='auto'")
# Standard tests of features the bundle does not serve. langchain-tests skips them from its
# feature flags; an xfail that never runs states why here, so CI's every-real-test-runs rule
# (tests/conftest.py) tells them from an engine that failed to start.
ONE_MODEL = "the bundle serves one model; a request for another is a 404, not an override"
TEXT_ONLY = "the demo model is text-only: no image, audio or PDF content parts"
NOT_SERVED = {
    "test_invoke_with_model_override": ONE_MODEL,
    "test_ainvoke_with_model_override": ONE_MODEL,
    "test_stream_with_model_override": ONE_MODEL,
    "test_astream_with_model_override": ONE_MODEL,
    "test_image_inputs": TEXT_ONLY,
    "test_image_tool_message": TEXT_ONLY,
    "test_audio_inputs": TEXT_ONLY,
    "test_pdf_inputs": TEXT_ONLY,
    "test_pdf_tool_message": TEXT_ONLY,
    "test_anthropic_inputs": "Anthropic-format content blocks are for Anthropic chat models",
    "test_stream_time": "a VCR cassette benchmark; the live bundle is not recorded",
}
# A long, stable system prompt so that reuse covers whole KV blocks.
SYSTEM = "You are a helpful assistant that answers briefly and uses tools when asked. " * 12


class TestChatKVAgentIntegration(ChatModelIntegrationTests):
    """The standard suite, pointed at the bundle's router."""

    _params: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(autouse=True)
    def _point_at_bundle(self, bundle: Any) -> None:
        # Some standard tests build the model from `chat_model_params` themselves.
        type(self)._params = {"base_url": bundle.base_url, "model": bundle.model,
                              "max_tokens": 48, "temperature": 0.0, "max_retries": 1}

    @property
    def chat_model_class(self) -> type[ChatKVAgent]:
        return ChatKVAgent

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return dict(self._params)

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        # The bundle serves one model; a request for another is a 404, not an override.
        return False

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A second turn of a conversation: its prompt's prefix is the first turn's KV."""
        llm = ChatKVAgent(**self.chat_model_params)
        history = [SystemMessage(SYSTEM), HumanMessage("Hello")]
        history += [llm.invoke(history), HumanMessage("And then?")]
        if not stream:
            return llm.invoke(history)
        full = None
        for chunk in llm.stream(history):
            full = chunk if full is None else full + chunk
        assert full is not None
        return full

    # -------------------------------------------------------------- what a random model
    # cannot do. langchain-tests requires an overridden standard test to carry an xfail
    # reason; the body skips, so the report shows the reason and nothing runs in vain.

    @pytest.mark.xfail(reason=RANDOM_ARGS)
    def test_tool_calling(self, model: Any) -> None:
        pytest.skip(RANDOM_ARGS)

    @pytest.mark.xfail(reason=RANDOM_ARGS)
    async def test_tool_calling_async(self, model: Any) -> None:
        pytest.skip(RANDOM_ARGS)

    @pytest.mark.xfail(reason=RANDOM_ARGS)
    def test_tool_choice(self, model: Any) -> None:
        pytest.skip(RANDOM_ARGS)

    @pytest.mark.xfail(reason=RANDOM_ARGS)
    def test_bind_runnables_as_tools(self, model: Any) -> None:
        pytest.skip(RANDOM_ARGS)

    @pytest.mark.xfail(reason=RANDOM_ARGS)
    def test_unicode_tool_call_integration(self, model: Any, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        pytest.skip(RANDOM_ARGS)

    @pytest.mark.xfail(reason=UNFORCED)
    def test_agent_loop(self, model: Any) -> None:
        pytest.skip(UNFORCED)

    @pytest.mark.xfail(reason=RANDOM_TEXT)
    def test_structured_output(self, model: Any) -> None:
        pytest.skip(RANDOM_TEXT)

    @pytest.mark.xfail(reason=RANDOM_TEXT)
    async def test_structured_output_async(self, model: Any) -> None:
        pytest.skip(RANDOM_TEXT)

    @pytest.mark.xfail(reason=RANDOM_TEXT)
    def test_structured_output_pydantic_2_v1(self, model: Any) -> None:
        pytest.skip(RANDOM_TEXT)

    @pytest.mark.xfail(reason=RANDOM_TEXT)
    def test_structured_output_optional_param(self, model: Any) -> None:
        pytest.skip(RANDOM_TEXT)

    @pytest.mark.xfail(reason=RANDOM_TEXT)
    def test_json_mode(self, model: Any) -> None:
        pytest.skip(RANDOM_TEXT)


@tool
def lookup(key: Literal["alpha", "beta", "gamma"]) -> str:
    """Look a key up in the table."""
    return f"value-of-{key}"


def test_langchain_history_resent_whole_keeps_reusing(bundle: Any) -> None:
    """A LangChain tool loop (the caller resends everything each call): from the second
    request on, each request carries the last answer's token and the router reuses KV."""
    llm = ChatKVAgent(base_url=bundle.base_url, model=bundle.model, max_tokens=64,
                      temperature=0.0)
    forced = llm.bind_tools([lookup], tool_choice="any", parallel_tool_calls=False)
    free = llm.bind_tools([lookup])
    history: list[Any] = [SystemMessage(SYSTEM), HumanMessage("Look up beta, then summarise.")]
    answers: list[AIMessage] = []
    for step in range(3):
        ai = (forced if step < 2 else free).invoke(history)
        answers.append(ai)
        history.append(ai)
        for call in ai.tool_calls:
            history.append(ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"]))
        if not ai.tool_calls:
            history.append(HumanMessage("Thanks. One more time?"))
    assert all(a.tool_calls for a in answers[:2]), "tool_choice='any' must force a call"
    carriers = [a.response_metadata["kvagent"] for a in answers]
    assert len({c["session_id"] for c in carriers}) == 1
    assert all(c["cache_token"] for c in carriers), carriers
    cached = [a.usage_metadata["input_token_details"]["cache_read"] for a in answers]
    assert cached[0] == 0 or carriers[0]["path"] != "pd_reuse"
    assert all(c > 0 for c in cached[1:]), f"later turns reused nothing: {cached}"
    assert all(c["path"] in ("pd_reuse", "d_direct") for c in carriers[1:]), carriers


async def test_langchain_async_stream_reuses(bundle: Any) -> None:
    llm = ChatKVAgent(base_url=bundle.base_url, model=bundle.model, max_tokens=16,
                      temperature=0.0)
    history: list[Any] = [SystemMessage(SYSTEM), HumanMessage("Hello")]
    history.append(await llm.ainvoke(history))
    history.append(HumanMessage("Go on."))
    full = None
    async for chunk in llm.astream(history):
        full = chunk if full is None else full + chunk
    assert full is not None and full.chunk_position == "last"
    assert full.usage_metadata["input_token_details"]["cache_read"] > 0
    assert full.response_metadata["kvagent"]["cache_token"]
