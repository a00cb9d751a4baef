"""A turn that does not continue its session's latest held turn branches: it neither claims
nor replaces the owner's handle, so the owner's next turn still reuses (fake nodes)."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from fakes import router_stack
from router_client import FIRST, no_wrong_kv, second, turn


async def test_an_intruder_under_the_owner_s_session_id_branches(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two conversations share one session id and send no cache token: each keeps its own
    handle (the intruder's is found by its content), and both reuse on their next turns.
    The router logs each branched turn with the branch it went to (a branch's turn gets
    no cache token, so the log is where an operator sees which conversation it joined)."""
    caplog.set_level(logging.INFO, logger="kvagent.router.turn")
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 64}}) as st:
        _, answer1, _ = await turn(st, FIRST, session="shared")
        owner2 = second(answer1, "Now shorter, please.")
        kva2, answer2, _ = await turn(st, owner2, session="shared")
        assert kva2["reused_tokens"] > 0
        # Chained onto the owner's first answer, with a question of its own: the owner's
        # latest handle (turn 2) is not what it continues.
        intruder = second(answer1, "Something else entirely, in German.")
        kva_i, answer_i, _ = await turn(st, intruder, session="shared")
        assert kva_i["reused_tokens"] == 0 and kva_i["reason"] == "no_handle"
        owner3 = [*owner2, {"role": "assistant", "content": answer2},
                  {"role": "user", "content": "And once more."}]
        kva3, _, _ = await turn(st, owner3, session="shared")
        assert kva3["reused_tokens"] > 0 and kva3["path"] == "d_direct", kva3
        # The intruder's own branch is found again by its content.
        intruder2 = [*intruder, {"role": "assistant", "content": answer_i},
                     {"role": "user", "content": "Go on."}]
        kva_i2, _, _ = await turn(st, intruder2, session="shared")
        assert kva_i2["reused_tokens"] > 0, kva_i2
        no_wrong_kv(st)
    branched = re.findall(r"session (\S+): the turn does not continue .* branch (\S+)",
                          caplog.text)
    assert len(branched) == 2 and {s for s, _ in branched} == {"shared"}, caplog.text
    assert branched[0][1] == branched[1][1] and branched[0][1].startswith("shared~")


async def test_a_turn_that_continues_the_latest_still_claims_it() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 64}}) as st:
        _, answer1, _ = await turn(st, FIRST, session="own")
        kva2, _, _ = await turn(st, second(answer1, "ok"), session="own")
        assert kva2["path"] == "d_direct" and kva2["reused_tokens"] > 0
        assert kva2["cache_token"]  # its own session's turn: a token names its handle
        no_wrong_kv(st)


async def test_a_response_chained_onto_an_earlier_response_branches() -> None:
    """The issue's case on the Responses door: a caller that names no conversation (its
    first turn is found by content), an intruder chained onto the owner's first response
    after the owner moved on, and the owner's next turn, which must still reuse."""
    from kvagent_server.router.settings import RouterSettings, TenantSettings

    settings = RouterSettings(tenants=[TenantSettings(name="t", api_keys=["key-a"])],
                              policy={"params": {"skip_prefill_max_tokens": 64}},
                              nodes={"health_interval_s": 5.0,
                                                                 "kv_recompute_threshold": 64})
    base = {"model": "fake-model", "instructions": "You are a coding agent. " * 40,
            "temperature": 0.0, "max_output_tokens": 8}
    async with router_stack(settings=settings) as st:
        async def post(body: dict[str, Any]) -> dict[str, Any]:
            r = await st.client.post("/v1/responses", json={**base, **body},
                                     headers={"Authorization": "Bearer key-a"})
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        one = await post({"input": "Describe the repository layout."})
        two = await post({"input": "Now list its tests, one by one. " * 10,
                          "previous_response_id": one["id"]})
        assert two["kvagent"]["reused_tokens"] > 0
        intruder = await post({"input": "Something else.", "previous_response_id": one["id"]})
        assert intruder["kvagent"]["reused_tokens"] == 0
        three = await post({"input": "And the README?", "previous_response_id": two["id"]})
        assert three["kvagent"]["reused_tokens"] > two["usage"]["input_tokens"] - 64, three
        # The intruder's branch is its own: chained onto, it continues.
        again = await post({"input": "Go on.", "previous_response_id": intruder["id"]})
        assert again["kvagent"]["reused_tokens"] > 0, again["kvagent"]
        no_wrong_kv(st)
