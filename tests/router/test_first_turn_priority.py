"""A session's first turn runs ahead of queued later turns on P (router setting
`first_turn_priority`, vLLM's request `priority` under `--scheduling-policy priority`).

Against fake nodes that record each leg's body. On real vLLM: the load benchmark's
`kvagent_first_priority` configuration (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from fakes import router_stack
from kvagent_server.router.turns.legs import prefill_body
from router_client import FIRST, no_wrong_kv, turn


async def _conversation(st: Any, turns: int, **extra: Any) -> list[dict[str, Any]]:
    messages, token, out = list(FIRST), None, []
    for i in range(turns):
        kva, answer, _ = await turn(st, messages, token=token, **extra)
        out.append(kva)
        token = kva["cache_token"]
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"step {i} done, what next?"}]
    return out


async def test_only_the_first_turn_carries_the_priority_to_p() -> None:
    async with router_stack(skip_prefill_max_tokens=0, first_turn_priority=-1) as st:
        kvas = await _conversation(st, 3)
        assert [k["path"] for k in kvas] == ["pd_fresh", "pd_reuse", "pd_reuse"]
        p_bodies = st.prefill[0].requests
        assert [b.get("priority") for b in p_bodies] == [-1, None, None]
        assert not any("priority" in b for b in st.decode[0].requests)
        no_wrong_kv(st)


async def test_off_by_default_and_a_clients_own_priority_passes_through() -> None:
    async with router_stack(skip_prefill_max_tokens=0) as st:
        await _conversation(st, 2)
        assert not any("priority" in b for b in st.prefill[0].requests)
    async with router_stack(skip_prefill_max_tokens=0, first_turn_priority=-1) as st:
        await _conversation(st, 2, priority=5)
        # The first turn's P leg takes the router's; the later one keeps the client's.
        assert [b.get("priority") for b in st.prefill[0].requests] == [-1, 5]
        assert all(b.get("priority") == 5 for b in st.decode[0].requests)


@pytest.mark.parametrize(("priority", "expected"), [(0, None), (-1, -1), (3, 3)])
def test_prefill_body_sets_the_priority_only_when_nonzero(priority: int,
                                                          expected: int | None) -> None:
    body = prefill_body({"model": "m", "messages": [], "stream": True}, {"x": 1},
                        priority=priority)
    assert body.get("priority") == expected
    assert body["max_tokens"] == 1 and body["stream"] is False
