"""One turn as a line of stages: gather -> decide -> execute -> relay -> settle.

`open_turn` runs the first three (the HTTP shell awaits it until D's response starts);
the shell then relays D's answer (`relay.SseRelay`, or the scrubbed whole body) and
calls `settle` with what the relay captured, before it writes the answer's tail. No
stage calls another: each reads the shape the previous one built (`turns.shapes`). When
decide needs the prompt's token ids it says so (`NEED_PROMPT_IDS`), and the line gathers
them and decides once more; it never goes back to a stage it has left.
"""

from __future__ import annotations

import time

from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.execute import execute
from kvagent_server.router.turns.gather import gather, with_prompt_ids
from kvagent_server.router.turns.settle import settle
from kvagent_server.router.turns.shapes import Turn, TurnPlan, TurnRequest

__all__ = ["open_turn", "settle"]


async def open_turn(r: Router, req: TurnRequest) -> Turn:
    """Gather the turn's facts, let the router's policy decide, run the legs."""
    started = time.perf_counter()
    budget = req.budget
    budget.add("receive", started - budget.arrived)
    facts = await gather(r, req)
    plan = r.policy.decide(facts)
    if not isinstance(plan, TurnPlan):  # it needs the prompt's token ids: once
        facts = await with_prompt_ids(r, facts)
        plan = r.policy.decide(facts)
        assert isinstance(plan, TurnPlan), "a policy asked twice for the prompt's ids"
    # planning is what gathering and deciding spent besides the node's /tokenize
    budget.add("plan", time.perf_counter() - started - budget.stages.get("tokenize", 0.0))
    return await execute(r, facts, plan, started)
