"""`kvagent demo`: the bundle and a tool-using agent on one machine, reuse measured per turn.

`agent` drives the scenario with the kvagent SDK; `openai_agents` runs the same scenario as
a stock OpenAI Agents SDK agent.
"""
