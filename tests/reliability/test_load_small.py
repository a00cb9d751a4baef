"""A small run of benchmarks/load: 20 concurrent sessions x 10 turns through the router.

Every answer must come back to its own session and turn (the fake decode node echoes the
marker of the prompt it served), no turn may be lost, every later turn must reuse the
session's cached prefix, and the router must hold exactly one live handle per session
afterwards (earlier ones were claimed: state does not grow with the number of turns).
"""

from __future__ import annotations

from fakes import router_stack

from benchmarks.api import make_cluster, run_load

SESSIONS, TURNS = 20, 10


async def test_concurrent_sessions_get_their_own_answers() -> None:
    async with router_stack(cluster=make_cluster(),
                            policy={"params": {"skip_prefill_max_tokens": 0}},
                            nodes={"request_timeout_s": 60}) as st:
        result = await run_load(st.url, sessions=SESSIONS, turns=TURNS, cap_s=240)
        s = result.summary()
        assert s["turns_sent"] == SESSIONS * TURNS, s
        assert s["lost"] == 0 and s["crossed"] == 0, s
        assert s["turns_completed"] == SESSIONS * TURNS
        assert s["reused_later_turns"] == s["later_turns"] == SESSIONS * (TURNS - 1), s
        assert not st.cluster.events_of("wrong_kv")
        assert len(st.router.store) == SESSIONS
        assert not st.cluster.open_leases()


async def test_crossed_answers_are_detected() -> None:
    """The checker is not vacuous: a backend that answers for the wrong turn is caught."""
    cluster = make_cluster()
    echo = cluster.reply

    def off_by_one(prompt_ids: list[int]):
        reply = echo(prompt_ids)
        reply.content = reply.content.replace(" t=1:", " t=7:")
        return reply

    cluster.reply = off_by_one
    async with router_stack(cluster=cluster,
                            policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        result = await run_load(st.url, sessions=2, turns=3, cap_s=60)
        s = result.summary()
        assert s["crossed"] == 2 and s["lost"] == 0, s
