"""Agent frameworks and API clients nobody here wrote, unmodified, with only a base URL.

Each runs its default API against the router (before fake P/D nodes, and with marker
`vllm` the real bundle, a `single`-topology router in front of its decode node, and a
bundle of the `replicas` topology): the OpenAI Agents SDK and pydantic-ai speak Responses, `anthropic`
speaks Messages, langchain-openai and LangGraph speak chat completions. None of them
sends a kvagent header or knows the cache token; every later model call must still reuse
KV, as the client itself reports it (its usage's cached or cache-read tokens) and as the
router counts it (one reuse hit per later turn). A first turn may reuse too: the router
finds an earlier test's held turn that shares its system prompt (verified, so only the
shared prefix), and the nodes' own prefix caches hold that prompt as well.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import openai
import pytest
from client_targets import REAL, REPLICAS, SINGLE, Target, cached_tokens, reuse_hits, targets

SYSTEM = ("You are a weather assistant. Answer briefly; call the weather tool when asked "
          "about a city. ") * 10
# Bounded arguments: a random-weight model made to call a tool then writes a whole call
# (demo_model.demo_serve_env); tool calls get room for the call's JSON.
City = Literal["oslo", "lima", "perth"]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string",
                                                         "enum": ["oslo", "lima", "perth"]}},
               "required": ["city"]}
MAX_TOKENS = 48


@pytest.fixture(name="bundle", scope="module", params=["fake", REAL, SINGLE, REPLICAS])
def agent_clients_bundle(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The P/D router before fake nodes and the real bundle, the one-node router, and a
    bundle of two replicas."""
    yield from targets(request)


def ask(question: str) -> str:
    """A question no earlier test asked: the module's router holds their turns, and a
    prompt that repeats one of them whole would rightly reuse it."""
    return f"[{uuid.uuid4().hex[:8]}] {question}"


def weather(city: City) -> str:
    """The weather in a city."""
    return f"sunny in {city}, 21C"


# ------------------------------------------------------------------ OpenAI Agents SDK


def _agents_run_config(bundle: Any) -> Any:
    from agents import RunConfig
    from agents.models.openai_provider import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=bundle.base_url, api_key="none", max_retries=0)
    return RunConfig(model_provider=OpenAIProvider(openai_client=client),
                     tracing_disabled=True)


def _weather_agent(bundle: Any) -> Any:
    from agents import Agent, ModelSettings, function_tool

    if not bundle.real:  # the fake model answers in text, in full
        return Agent(name="weather", instructions=SYSTEM, model=bundle.model,
                     tools=[function_tool(weather)],
                     model_settings=ModelSettings(max_tokens=400, temperature=0.0))
    # The SDK fails a run whose model stopped at `max_tokens`, and the demo model's text
    # answers (33..224 tokens) run past this cap: it is made to call the tool once (a call
    # is complete when its JSON is; with parallel calls it would add calls until the
    # limit), and the tool's result is the run's answer.
    return Agent(name="weather", instructions=SYSTEM, model=bundle.model,
                 tools=[function_tool(weather)], tool_use_behavior="stop_on_first_tool",
                 model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0.0,
                                              tool_choice="required",
                                              parallel_tool_calls=False))


async def test_openai_agents_sdk_default_model_reuses(bundle: Any) -> None:
    from agents import Runner

    agent, config = _weather_agent(bundle), _agents_run_config(bundle)
    first = await Runner.run(agent, ask("How is the weather in Oslo?"), run_config=config)
    before = reuse_hits(bundle.router_url)
    second = await Runner.run(agent, [*first.to_input_list(),
                                      {"role": "user", "content": "And in Lima?"}],
                              run_config=config)
    calls = [*first.raw_responses, *second.raw_responses]
    assert len(calls) >= 2
    cached = [c.usage.input_tokens_details.cached_tokens for c in calls]
    assert all(n > 0 for n in cached[1:]), cached  # every call after the first reused
    assert reuse_hits(bundle.router_url) - before == len(second.raw_responses)


async def test_openai_agents_sdk_chains_by_previous_response_id(bundle: Any) -> None:
    from agents import Runner

    agent, config = _weather_agent(bundle), _agents_run_config(bundle)
    first = await Runner.run(agent, ask("How is the weather in Perth?"), run_config=config)
    assert first.last_response_id
    second = await Runner.run(agent, "And tomorrow?", run_config=config,
                              previous_response_id=first.last_response_id)
    assert second.raw_responses[0].usage.input_tokens_details.cached_tokens > 0


# ------------------------------------------------------------------ pydantic-ai


async def test_pydantic_ai_default_openai_model_reuses(bundle: Any) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(bundle.model, provider=OpenAIProvider(
        base_url=bundle.base_url, api_key="none"))
    agent = Agent(model, instructions=SYSTEM,
                  model_settings={"max_tokens": MAX_TOKENS, "temperature": 0.0})
    agent.tool_plain(weather)
    first = await agent.run(ask("How is the weather in Oslo?"))
    second = await agent.run("And in Lima?", message_history=first.all_messages())
    assert second.usage.cache_read_tokens > 0, second.usage


# ------------------------------------------------------------------ anthropic


def _anthropic_turns(bundle: Any, headers: dict[str, str]) -> list[tuple[Any, float, Any]]:
    """Three streamed turns with tools: (final message, reuse hits it added, the
    `kvagent` report of its `message_delta` event) each."""
    client = anthropic.Anthropic(base_url=bundle.router_url, api_key="none", max_retries=0,
                                 default_headers=headers)
    tools = [{"name": "weather", "description": "The weather in a city.",
              "input_schema": CITY_SCHEMA}]
    messages: list[dict[str, Any]] = []
    finals = []
    for question in (ask("How is the weather in Oslo?"), "And in Lima?", "And in Perth?"):
        messages.append({"role": "user", "content": question})
        before = reuse_hits(bundle.router_url)
        with client.messages.stream(model=bundle.model, max_tokens=MAX_TOKENS,
                                    system=[{"type": "text", "text": SYSTEM}],
                                    messages=messages, tools=tools) as stream:
            report = None
            for event in stream:
                if event.type == "message_delta":
                    report = (event.model_extra or {}).get("kvagent")
            final = stream.get_final_message()
        finals.append((final, reuse_hits(bundle.router_url) - before, report))
        content = [b.model_dump(exclude_none=True) for b in final.content] or [
            {"type": "text", "text": "(nothing)"}]
        messages.append({"role": "assistant", "content": content})
        calls = [b for b in final.content if b.type == "tool_use"]
        if calls:  # answer every tool call, as a tool loop does
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": weather("oslo")}
                for c in calls]})
    return finals


@pytest.mark.parametrize("identity", ["none", "claude_code"])
def test_anthropic_client_streams_tools_and_reuses(bundle: Any, identity: str) -> None:
    headers = ({"X-Claude-Code-Session-Id": str(uuid.uuid4())} if identity == "claude_code"
               else {})
    turns = _anthropic_turns(bundle, headers)
    # what each turn was (path, reason, reuse) and said, should a later turn miss
    seen = [(report, final.stop_reason, [b.model_dump(exclude_none=True) for b in final.content])
            for final, _, report in turns]
    assert [hits for _, hits, _ in turns][1:] == [1, 1], seen
    for final, _, report in turns[1:]:
        assert final.usage.cache_read_input_tokens > 0, final.usage
        assert report["path"] in ("pd_reuse", "d_direct"), report


# ------------------------------------------------------------------ openai-python Responses


def test_openai_responses_streamed_and_chained(bundle: Any) -> None:
    client = openai.OpenAI(base_url=bundle.base_url, api_key="none", max_retries=0)
    previous = None
    usages, hits = [], []
    for question in (ask("Summarise the weather in Oslo."), "And in Lima?", "And in Perth?"):
        before = reuse_hits(bundle.router_url)
        with client.responses.create(model=bundle.model, instructions=SYSTEM, input=question,
                                     previous_response_id=previous, max_output_tokens=16,
                                     temperature=0.0, stream=True) as events:
            done = [e for e in events if e.type == "response.completed"]
        assert len(done) == 1
        response = done[0].response
        hits.append(reuse_hits(bundle.router_url) - before)
        usages.append(response.usage.input_tokens_details.cached_tokens)
        assert client.responses.retrieve(response.id).id == response.id
        previous = response.id
    assert hits[1:] == [1, 1] and all(n > 0 for n in usages[1:]), (hits, usages)


# ------------------------------------------------------------------ LangChain / LangGraph


def test_langchain_chat_openai_without_any_header_reuses(bundle: Any) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=bundle.model, base_url=bundle.base_url, api_key="none",
                     max_tokens=16, temperature=0.0, max_retries=0)
    history: list[Any] = [SystemMessage(SYSTEM)]
    reads, hits = [], []
    for question in (ask("How is the weather in Oslo?"), "And in Lima?", "And in Perth?"):
        history.append(HumanMessage(question))
        before = reuse_hits(bundle.router_url)
        answer = llm.invoke(history)
        hits.append(reuse_hits(bundle.router_url) - before)
        reads.append((answer.usage_metadata or {}).get("input_token_details", {}).get(
            "cache_read", 0))
        history.append(answer)
    assert hits[1:] == [1, 1] and all(n > 0 for n in reads[1:]), (hits, reads)


def test_langgraph_react_agent_reuses_across_a_thread(bundle: Any) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(model=bundle.model, base_url=bundle.base_url, api_key="none",
                     max_tokens=16, temperature=0.0, max_retries=0)
    agent = create_react_agent(llm, [tool(weather)], prompt=SYSTEM,
                               checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": "t1"}}
    before = cached_tokens(bundle.router_url)
    agent.invoke({"messages": [("user", ask("How is the weather in Oslo?"))]}, thread)
    agent.invoke({"messages": [("user", "And in Lima?")]}, thread)
    assert cached_tokens(bundle.router_url) > before
