"""A leg that reads another node's KV is never sent twice with the same params.

The first read frees the blocks on the holder; a second read of freed (maybe reallocated)
blocks would be wrong KV. So after an ambiguous failure — the request may have reached the
node — a reuse P leg recomputes and a D leg fails before its first byte. Failures where
the request cannot have been sent (connection refused or not accepted) retry as before.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvagent_server.router.nodes.legs import LegError, Legs, pulls_kv
from kvagent_server.router.reuse import transfer

FRESH_PARAMS = transfer.fresh()
from kvagent_server.router.nodes.client import ConnectFailed, StaleConnection, UpstreamError
from kvagent_server.router.nodes.registry import Node

REUSE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[1, 2]],
         "remote_num_tokens": 32, "remote_request_id": "d-1", "remote_engine_id": "e"}
P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[7]], "remote_request_id": "p-1"}


class Reply:
    def __init__(self, status: int, data: dict[str, Any]) -> None:
        self.status_code = status
        self.content = json.dumps(data).encode()

    def json(self) -> Any:
        return json.loads(self.content)


class Script:
    """A node client answering from a script: an exception to raise or a status."""

    def __init__(self, outcomes: list[Any], sent: list[tuple[str, dict[str, Any]]],
                 name: str) -> None:
        self.outcomes, self.sent, self.name = outcomes, sent, name

    async def post(self, url: str, body: dict[str, Any], *,
                   stream: bool) -> Reply:
        self.sent.append((self.name, body))
        outcome = self.outcomes.pop(0) if self.outcomes else 200
        if isinstance(outcome, BaseException):
            raise outcome
        return Reply(outcome, {"kv_transfer_params": {"do_remote_prefill": True},
                               "usage": {"prompt_tokens": 40}})


def legs_with(scripts: dict[str, list[Any]]) -> tuple[Legs, list[Node], list]:
    legs = Legs(max_retries=2, timeout_s=5)
    sent: list[tuple[str, dict[str, Any]]] = []
    nodes = []
    for name, outcomes in scripts.items():
        node = Node(name=name, url=f"http://{name}", role="prefill", healthy=True)
        legs.clients[name] = Script(list(outcomes), sent, name)  # type: ignore[assignment]
        nodes.append(node)
    return legs, nodes, sent


def test_pulls_kv() -> None:
    assert pulls_kv({"kv_transfer_params": REUSE})
    assert pulls_kv({"kv_transfer_params": P_PARAMS})
    assert not pulls_kv({"kv_transfer_params": FRESH_PARAMS})
    assert not pulls_kv({"kv_transfer_params": {**REUSE, "remote_num_tokens": 0}})  # release
    assert not pulls_kv({"kv_transfer_params": {"do_remote_prefill": False,
                                                "kvagent_release": ["x"]}})  # d_direct
    assert not pulls_kv({})


@pytest.mark.parametrize("failure", [StaleConnection("ServerDisconnectedError"),
                                     UpstreamError("TimeoutError")])
async def test_reuse_prefill_after_an_ambiguous_failure_recomputes(failure: Exception) -> None:
    legs, nodes, sent = legs_with({"p0": [failure], "p1": [200]})
    result = await legs.prefill(nodes, "/v1/completions", {"prompt": "x"}, REUSE)
    assert result.node.name == "p1" and result.pull_failed
    # p0 got D's handle once, never again; p1 recomputed instead of reading it a second time
    assert [(n, b["kv_transfer_params"]) for n, b in sent] == [("p0", REUSE),
                                                                ("p1", FRESH_PARAMS)]


async def test_reuse_prefill_after_a_refused_connection_still_pulls_elsewhere() -> None:
    legs, nodes, sent = legs_with({"p0": [ConnectFailed("ClientConnectorError")],
                                   "p1": [200]})
    result = await legs.prefill(nodes, "/v1/completions", {"prompt": "x"}, REUSE)
    assert not result.pull_failed and sent[-1] == ("p1", sent[-1][1])
    assert sent[-1][1]["kv_transfer_params"] == REUSE
    assert not nodes[0].healthy  # refused: marked down


async def test_a_slow_accept_does_not_mark_the_node_down() -> None:
    legs, nodes, _ = legs_with({"p0": [ConnectFailed("ConnectionTimeoutError",
                                                     timed_out=True)], "p1": [200]})
    await legs.prefill(nodes, "/v1/completions", {"prompt": "x"}, FRESH_PARAMS)
    assert nodes[0].healthy  # an overloaded node is left to the health checks


async def test_a_stale_connection_is_resent_only_when_nothing_is_pulled() -> None:
    legs, nodes, sent = legs_with({"p0": [StaleConnection("x"), 200]})
    await legs.prefill(nodes[:1], "/v1/completions", {"prompt": "x"}, FRESH_PARAMS)
    assert [n for n, _ in sent] == ["p0", "p0"]  # fresh: the usual keep-alive resend
    legs, nodes, sent = legs_with({"d0": [StaleConnection("x"), 200], "d1": [200]})
    with pytest.raises(LegError):
        await legs.decode(nodes, "/v1/completions",
                          {"prompt": "x", "kv_transfer_params": P_PARAMS}, stream=False)
    assert [n for n, _ in sent] == ["d0"]  # neither resent nor tried on d1


async def test_decode_leg_moves_on_only_when_the_request_was_never_sent() -> None:
    legs, nodes, sent = legs_with({"d0": [ConnectFailed("refused")], "d1": [200]})
    start = await legs.decode(nodes, "/v1/completions",
                              {"prompt": "x", "kv_transfer_params": P_PARAMS},
                              stream=False)
    assert start.node.name == "d1"
    legs, nodes, sent = legs_with({"d0": [503], "d1": [200]})  # overloaded: not started
    assert (await legs.decode(nodes, "/v1/completions",
                              {"prompt": "x", "kv_transfer_params": P_PARAMS},
                              stream=False)).node.name == "d1"
    legs, nodes, sent = legs_with({"d0": [500], "d1": [200]})  # may have pulled
    with pytest.raises(LegError):
        await legs.decode(nodes, "/v1/completions",
                          {"prompt": "x", "kv_transfer_params": P_PARAMS}, stream=False)
    assert [n for n, _ in sent] == ["d0"]


async def test_the_drain_of_an_orphaned_prefill_uses_a_salt_of_its_own() -> None:
    from kvagent_server.router.nodes.legs import PrefillResult

    legs, nodes, sent = legs_with({"d0": [200]})
    p = PrefillResult(node=nodes[0], kv_params=P_PARAMS, cached_tokens=0, prompt_tokens=3,
                      pull_failed=False, elapsed_s=0.0)
    assert await legs.release_prefill(nodes, "/v1/completions",
                                      {"prompt": "x", "cache_salt": "tenant"}, p)
    salt = sent[0][1]["cache_salt"]
    assert salt.startswith("kvagent-drain-") and salt != "tenant"
