"""`kvagent demo --agent openai-agents`: the demo's agent as a stock OpenAI Agents SDK agent.

The same on-call scenario and tools as the SDK demo (`agent`), but run by `agents.Agent`
with its default model (the Responses API), pointed at the router by a base URL and
nothing else: no session id, no cache token. The router finds each turn's conversation by
its content (docs/agents/index.md), and the table shows what the SDK itself reports: its
usage's cached tokens, and the router's `kvagent` report from `response.completed`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from rich.live import Live

from kvagent_server.demo.agent import TOOLS, USER_TURNS, Row, console, system_prompt, table

#: Events of a Responses stream that carry the first generated token.
_FIRST_TOKEN_EVENTS = ("response.output_text.delta", "response.function_call_arguments.delta",
                       "response.output_item.added")


def _installed() -> bool:
    try:
        import agents  # noqa: F401
    except ImportError:
        return False
    return True


def missing_message() -> str | None:
    """Why this mode cannot run here, or None."""
    if _installed():
        return None
    return ("the OpenAI Agents SDK is not installed: pip install 'kvagent[agents]' "
            "(./dev demo installs it)")


async def _turns(router_url: str, model: str, turns: int, rows: list[Row], live: Live) -> None:
    import openai
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0,
                                timeout=600)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client),
                       tracing_disabled=True)
    # Random demo weights only finish a tool call when made to (and the SDK fails a run
    # cut at `max_tokens`): each turn makes one call, and the tool's result answers it.
    agent = Agent(name="on-call", instructions=system_prompt(), model=model,
                  tools=[function_tool(f) for f in TOOLS],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48,
                                               temperature=0.0, parallel_tool_calls=False))
    history: list[Any] = []
    for text in USER_TURNS[:turns]:
        history.append({"role": "user", "content": text})
        result = Runner.run_streamed(agent, history, run_config=config)
        sent = time.perf_counter()
        first: float | None = None
        async for event in result.stream_events():
            if event.type != "raw_response_event":
                continue
            data = event.data
            if first is None and data.type in _FIRST_TOKEN_EVENTS:
                first = time.perf_counter() - sent
            if data.type == "response.completed":
                response = data.response
                report = (response.model_extra or {}).get("kvagent") or {}
                usage = response.usage
                cached = usage.input_tokens_details.cached_tokens if usage else 0
                names = ",".join(o.name for o in response.output
                                 if o.type == "function_call") or "text"
                rows.append(Row(index=len(rows) + 1, kind=f"tool call ({names})",
                                prompt_tokens=usage.input_tokens if usage else 0,
                                reused=int(report.get("reused_tokens") or cached),
                                path=str(report.get("path") or "-"),
                                ttft=first if first is not None else time.perf_counter() - sent,
                                ttft_recompute=None))
                live.update(table(rows))
                if not console.is_terminal:
                    r = rows[-1]
                    console.print(f"call {r.index} {r.kind}: prompt {r.prompt_tokens} tok, "
                                  f"reused {r.reused}, path {r.path}, "
                                  f"TTFT {r.ttft * 1000:.0f} ms")
                sent = time.perf_counter()
                first = None
        history = result.to_input_list()


def run_agent(router_url: str, model: str, turns: int) -> Sequence[Row]:
    """Run the OpenAI Agents SDK agent for `turns` user turns; one row per model call."""
    rows: list[Row] = []
    live = Live(table(rows), console=console, refresh_per_second=4,
                transient=not console.is_terminal)
    with live:
        asyncio.run(_turns(router_url, model, turns, rows, live))
    if not console.is_terminal:
        console.print(table(rows))
    return rows
