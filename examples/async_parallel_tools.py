"""The tool agent on ``kvagent.AsyncSession``: parallel tool calls run concurrently.

When one answer asks for several tools, ``AsyncSession.run`` awaits them together
(``asyncio.gather``), so three one-second lookups take about one second. Several
conversations can run at once too, each a session of its own. Every request after a
conversation's first carries its cache token.

    kvagent-server up                  # in another shell
    python examples/async_parallel_tools.py
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Literal

from kvagent import AsyncSession, RunResult, TurnResult, tool

BASE_URL = os.environ.get("KVAGENT_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("KVAGENT_MODEL", "kvagent-demo")

SYSTEM = ("You compare cities for a traveller. Call get_weather for every city in the "
          "question, all at once, then answer in one sentence.")
City = Literal["Paris", "Rome", "Oslo", "Lisbon"]
LOOKUP_SECONDS = 0.5


@tool
async def get_weather(city: City) -> str:
    """Current weather in a city (a slow remote lookup)."""
    await asyncio.sleep(LOOKUP_SECONDS)
    return {"Paris": "rain", "Rome": "sun", "Oslo": "snow", "Lisbon": "sun"}[city]


async def conversation(base_url: str, model: str, question: str) -> list[TurnResult]:
    async with AsyncSession(base_url, model, system=SYSTEM, tools=[get_weather],
                            max_tokens=64, temperature=0.0) as session:
        # The demo model (random weights) only emits valid calls when forced: one forced
        # step (its calls still run, concurrently), then free turns. With a real model,
        # just `await session.run(question)`.
        started = time.perf_counter()
        forced: RunResult = await session.run(question, max_steps=1, tool_choice="required")
        tools_done = time.perf_counter() - started
        final = await session.run(max_steps=3)
        answers = [*forced.steps, *final.steps]
        calls = len(forced.final.tool_calls)
        print(f"[{session.session_id[:12]}] {calls} parallel call(s), step 1 incl. tools "
              f"{tools_done:.2f}s")
        for n, answer in enumerate(answers, 1):
            usage = answer.usage
            print(f"[{session.session_id[:12]}] step {n}: cached="
                  f"{usage.cached_tokens if usage else '?'} path={answer.path}")
        return answers


async def amain(base_url: str = BASE_URL, model: str = MODEL) -> list[list[TurnResult]]:
    """Two conversations side by side; returns each one's model answers."""
    return list(await asyncio.gather(
        conversation(base_url, model, "Paris, Rome or Lisbon for a long weekend?"),
        conversation(base_url, model, "Is Oslo or Paris warmer today?"),
    ))


def main(base_url: str = BASE_URL, model: str = MODEL) -> list[list[TurnResult]]:
    return asyncio.run(amain(base_url, model))


if __name__ == "__main__":
    main()
