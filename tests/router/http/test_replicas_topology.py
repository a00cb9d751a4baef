"""The router with several decode nodes and no prefill node (the `replicas` topology),
against fake vLLM nodes over real HTTP: sessions spread over the nodes, each stays on the
node holding its KV, and one whose node is saturated moves, its KV pulled along (or, with
`pull_on_move` off, recomputed there and released on the old node)."""

from __future__ import annotations

import time
from typing import Any

from fakes import router_stack
from kvagent_server.router.reuse.transfer import RELEASE_KEY, RETAIN_KEY
from router_client import FIRST, no_wrong_kv, second, turn


def _third(answer: str, answer2: str) -> list[dict[str, Any]]:
    return [*second(answer), {"role": "assistant", "content": answer2},
            {"role": "user", "content": "And once more, in German."}]


def _busy(st: Any, node: str) -> int:
    """A leg in flight on `node` (with max_in_flight 1: saturated)."""
    return int(st.router.ledger.open(node, role="decode", stream=True, now=time.monotonic()))


def _params(node: Any) -> dict[str, Any]:
    return dict(node.requests[-1]["kv_transfer_params"])


async def test_a_session_moves_with_its_kv_when_its_node_is_saturated() -> None:
    async with router_stack(n_prefill=0, n_decode=2, nodes={"max_in_flight": 1}) as st:
        d0, d1 = st.decode
        kva, answer, _ = await turn(st, FIRST)
        assert (kva["path"], len(d0.requests), len(d1.requests)) == ("d_fresh", 1, 0)
        kva2, answer2, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert kva2["path"] == "d_direct" and kva2["reused_tokens"] > 0
        assert len(d0.requests) == 2 and not d1.requests
        held = [r.request_id for r in st.cluster.retained.values()
                if r.engine_id == d0.engine_id and r.consumed_by is None]
        assert len(held) == 1

        leg = _busy(st, "d0")
        kva3, answer3, evs = await turn(st, _third(answer, answer2), token=kva2["cache_token"])
        assert (kva3["path"], kva3["reason"]) == ("d_pull", "hit")
        assert kva3["reused_tokens"] > 0 and kva3["reused_tokens"] % st.cluster.block_size == 0
        assert evs[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == kva3[
            "reused_tokens"]
        assert len(d0.requests) == 2  # the saturated node computed nothing
        sent = _params(d1)
        assert sent[RETAIN_KEY] is True and sent["do_remote_decode"] is True
        assert (sent["remote_engine_id"], sent["remote_request_id"]) == (d0.engine_id, held[0])
        assert RELEASE_KEY not in sent  # the pull frees the old node's blocks
        (pull,) = st.cluster.events_of("pull")
        assert (pull.node, pull.detail["from"]) == (d1.engine_id, d0.engine_id)
        assert pull.detail["tokens"] == kva3["reused_tokens"]
        st.router.ledger.close(leg, time.monotonic())

        # The session's node is now the one it moved to: it extends the KV it keeps.
        fourth = [*_third(answer, answer2), {"role": "assistant", "content": answer3},
                  {"role": "user", "content": "Thanks."}]
        kva4, _, _ = await turn(st, fourth, token=kva3["cache_token"])
        assert kva4["path"] == "d_direct" and kva4["reused_tokens"] > kva3["reused_tokens"]
        assert len(d0.requests) == 2 and len(d1.requests) == 2
        no_wrong_kv(st)


async def test_without_pull_on_move_the_new_node_recomputes_and_the_old_one_releases() -> None:
    async with router_stack(n_prefill=0, n_decode=2, nodes={"max_in_flight": 1},
                            policy={"name": "replicas",
                                    "params": {"pull_on_move": False}}) as st:
        d0, d1 = st.decode
        kva, answer, _ = await turn(st, FIRST)
        held = [r.request_id for r in st.cluster.retained.values()
                if r.engine_id == d0.engine_id]
        _busy(st, "d0")
        kva2, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert (kva2["path"], kva2["reason"], kva2["reused_tokens"]) == (
            "d_fresh", "moved:affinity_overloaded", 0)
        assert len(d1.requests) == 1 and not st.cluster.events_of("pull")
        retention = st.router.retention
        assert retention is not None and retention.queue.pending("d0") == 1
        await retention.flush("d0", st.router.registry.nodes["d0"].url)  # its next round
        assert [e.detail["id"] for e in st.cluster.events_of("release")] == held
        no_wrong_kv(st)


async def test_sessions_spread_over_the_nodes_by_load() -> None:
    async with router_stack(n_prefill=0, n_decode=2) as st:
        d0, d1 = st.decode
        leg = _busy(st, "d0")
        kva, _, _ = await turn(st, FIRST, session="a")
        assert kva["path"] == "d_fresh" and len(d1.requests) == 1 and not d0.requests
        st.router.ledger.close(leg, time.monotonic())
        _busy(st, "d1")
        kvb, _, _ = await turn(st, FIRST, session="b")
        assert kvb["path"] == "d_fresh" and len(d0.requests) == 1
        assert (await st.client.get("/ready")).status_code == 200


async def test_a_failed_pull_is_recomputed_on_another_node_and_the_handle_released() -> None:
    async with router_stack(n_prefill=0, n_decode=2, nodes={"max_in_flight": 1}) as st:
        d0, d1 = st.decode
        kva, answer, _ = await turn(st, FIRST)
        held = [r.request_id for r in st.cluster.retained.values()
                if r.engine_id == d0.engine_id]
        leg = _busy(st, "d0")
        d1.fail_next = [500]  # the node the session moves to fails the pull's leg
        kva2, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert (kva2["path"], kva2["reason"], kva2["reused_tokens"]) == (
            "d_fresh", "decode_failed", 0)
        # Not retried with the pull's params (the first read frees the holder's blocks):
        # recomputed on the other node, which is the holder here, so it frees them itself.
        assert RETAIN_KEY in d1.requests[-1]["kv_transfer_params"]
        assert _params(d0)[RELEASE_KEY] == held
        assert [e.detail["id"] for e in st.cluster.events_of("release")] == held
        st.router.ledger.close(leg, time.monotonic())
        no_wrong_kv(st)
