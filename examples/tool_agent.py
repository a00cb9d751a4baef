"""A hand-written tool-using agent on ``kvagent.Session``.

The loop is spelled out (``Session.run`` does the same in one call): send, run the tools
the model asked for, add their results, send again, until the model answers in text. Every
request after the first carries the router's cache token, so the prompt prefix the decode
node already holds is not recomputed; each step prints how much was reused.

    kvagent-server up                  # in another shell
    python examples/tool_agent.py
"""

from __future__ import annotations

import os
from typing import Literal

from kvagent import Session, ToolResultMessage, TurnResult, tool

BASE_URL = os.environ.get("KVAGENT_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("KVAGENT_MODEL", "kvagent-demo")

SYSTEM = ("You are a travel assistant. Use the tools to check the weather and the train "
          "timetable before you answer. Answer in one sentence.")

WEATHER = {"Paris": "light rain, 14 °C", "Rome": "sunny, 22 °C", "Oslo": "snow, -3 °C"}


@tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
    """Current weather in a city."""
    return WEATHER[city]


@tool
def next_train(origin: Literal["Paris", "Rome", "Oslo"],
               destination: Literal["Paris", "Rome", "Oslo"]) -> str:
    """The next direct train between two cities."""
    return f"{origin} → {destination}: 09:12, 6 h 40 min"


TOOLS = {t.name: t for t in (get_weather, next_train)}


def run_tools(answer: TurnResult) -> list[ToolResultMessage]:
    """Run every call of one answer; a bad call becomes an error the model can read."""
    results = []
    for call in answer.tool_calls:
        found = TOOLS.get(call.name)
        try:
            if found is None:
                raise ValueError(f"unknown tool {call.name!r}")
            output = str(found.run_sync(found.validate_arguments(call.arguments)))
            is_error = False
        except ValueError as exc:
            output, is_error = f"Error: {exc}", True
        results.append(ToolResultMessage(tool_call_id=call.id, name=call.name,
                                         content=output, is_error=is_error))
    return results


def report(step: int, answer: TurnResult) -> None:
    usage = answer.usage
    what = ", ".join(f"{c.name}({c.arguments})" for c in answer.tool_calls) or repr(answer.text[:40])
    print(f"step {step}: prompt={usage.prompt_tokens if usage else '?'} "
          f"cached={usage.cached_tokens if usage else '?'} path={answer.path} "
          f"ttft={answer.time_to_first_token or 0:.3f}s -> {what}")


def main(base_url: str = BASE_URL, model: str = MODEL, max_steps: int = 6) -> list[TurnResult]:
    """Answer one travel question with tools; returns every model answer, in order."""
    answers: list[TurnResult] = []
    with Session(base_url, model, system=SYSTEM, tools=list(TOOLS.values()),
                 max_tokens=64, temperature=0.0) as session:
        # The demo model (random weights) only emits valid calls when forced to: the first
        # step says tool_choice="required". With a real model, leave the default ("auto").
        answer = session.send("Should I take the train from Paris to Rome tomorrow?",
                              tool_choice="required")
        for step in range(1, max_steps + 1):
            answers.append(answer)
            report(step, answer)
            if not answer.tool_calls:
                break
            session.add(*run_tools(answer))
            answer = session.send()  # continue the conversation: no new user message
        print(f"session {session.session_id}: {len(session.messages)} messages")
    return answers


if __name__ == "__main__":
    main()
