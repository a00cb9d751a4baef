"""The main job: the demo agent against the real bundle reuses KV on later calls."""

from __future__ import annotations

import pytest
from kvagent_server.demo import agent as demo

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_tools_have_bounded_arguments() -> None:
    # Random demo weights only finish a tool call whose arguments are enums.
    from kvagent import Tool

    for fn in demo.TOOLS:
        properties = Tool(fn).parameters["properties"]
        assert properties and all("enum" in p for p in properties.values()), fn


def test_demo_agent_reuses_kv(kvagent_bundle) -> None:
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    rows = demo.run_agent(kvagent_bundle.router_url, kvagent_bundle.prefill_urls[0],
                          kvagent_bundle.model, turns=2, baseline=True)
    assert len(rows) == 4
    assert rows[0].kind.startswith("tool call")
    later = rows[1:]
    assert all(r.reused > 0 for r in later), [(r.kind, r.path, r.reused) for r in later]
    assert all(r.path in {"pd_reuse", "d_direct"} for r in later)
    assert all(r.ttft_recompute is not None for r in rows)
    # Each call's prompt extends the previous one (history only grows).
    assert [r.prompt_tokens for r in rows] == sorted(r.prompt_tokens for r in rows)


def test_openai_agents_demo_reuses_kv(kvagent_bundle) -> None:
    """`kvagent demo --agent openai-agents`: a stock Agents SDK agent, base URL only."""
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    from kvagent_server.demo import openai_agents as demo_openai_agents

    assert demo_openai_agents.missing_message() is None
    rows = demo_openai_agents.run_agent(kvagent_bundle.router_url, kvagent_bundle.model, 3)
    assert len(rows) == 3 and all(r.kind.startswith("tool call (") for r in rows)
    assert all(r.reused > 0 and r.path in {"pd_reuse", "d_direct"} for r in rows[1:]), [
        (r.kind, r.path, r.reused) for r in rows]
    assert [r.prompt_tokens for r in rows] == sorted(r.prompt_tokens for r in rows)
