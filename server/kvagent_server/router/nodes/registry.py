"""The vLLM nodes behind the router, their health, load and epochs.

A node's *epoch* names its incarnation: the node's process start time (from its
`/metrics`, the same for every router replica) or, failing that, a counter that grows
each time the node comes back after being unhealthy. KV blocks retained in an earlier
epoch may be gone, so a handle recorded under another epoch is recomputed, not pulled.

The nodes given make the router's *topology*: `pd` (prefill and decode nodes),
`single` (one decode node and no prefill node: it computes every prompt itself) or
`replicas` (several decode nodes and no prefill node: each computes the prompts of the
sessions it serves, and a session that moves takes its KV along).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvagent_server.common.types import Role, Topology
from kvagent_server.router.common.periodic import Periodic
from kvagent_server.router.nodes.client import ConnectFailed, NodeHttp, UpstreamError
from kvagent_server.router.nodes.ledger import LegLedger
from kvagent_server.router.reuse.placement import NodeState

log = logging.getLogger("kvagent.router.nodes")
_BLOCK_SIZE_RE = re.compile(r'[{,]block_size="(\d+)"')


def topology_of(prefill: Sequence[str], decode: Sequence[str]) -> Topology:
    """The topology the node URLs make, or a `ValueError` saying why they make none."""
    if not decode:
        raise ValueError("the router needs a decode node (--decode URL)")
    if prefill:
        return "pd"
    return "replicas" if len(decode) > 1 else "single"


@dataclass
class Node:
    """One vLLM HTTP endpoint. `name` is what logs, metrics and the state store use."""

    name: str
    url: str
    role: Role
    healthy: bool = False  # until its first successful probe
    epoch: str = "c1"
    #: Legs in flight at which the node is saturated (the count is the registry's ledger's).
    max_in_flight: int = 64
    #: KV block size reported by the node (None until known).
    block_size: int | None = None
    probed: bool = False
    probe_failures: int = 0
    _comebacks: int = field(default=1, repr=False)
    failures: int = 0
    last_checked: float = 0.0
    last_error: str | None = field(default=None, repr=False)
    #: The share of its KV cache in use (0..1) at the retention guard's last read (None:
    #: not read; decode nodes only).
    kv_usage: float | None = None

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            log.warning("node %s marked unhealthy: %s", self.name, reason)
        self.healthy = False
        self.failures += 1
        self.last_error = reason

    def mark_up(self, start_time: str | None = None) -> None:
        if start_time is not None:
            self.epoch = f"s{start_time}"
        elif not self.healthy:
            self._comebacks += 1  # its retained blocks may not have survived
            self.epoch = f"c{self._comebacks}"
        if not self.healthy:
            log.info("node %s healthy (epoch %s)", self.name, self.epoch)
        self.healthy = True
        self.failures = 0
        self.last_error = None

    def state(self, in_flight: int = 0) -> NodeState:
        """The node as the placement core sees it, with `in_flight` legs on it."""
        return NodeState(node_id=self.name, url=self.url, role=self.role, healthy=self.healthy,
                         in_flight=in_flight, epoch=self.epoch,
                         max_in_flight=self.max_in_flight)


class NodeRegistry:
    """All P and D nodes; a background task probes `/health` every `interval_s`.

    No prefill node is the `single` or `replicas` topology (`topology_of`). `ledger`
    holds the legs in flight on every node: the one count of them the router keeps."""

    def __init__(self, prefill: list[str], decode: list[str], *, interval_s: float = 2.0,
                 probe_timeout_s: float = 2.0, max_in_flight: int = 64,
                 failures_to_down: int = 2) -> None:
        self.topology: Topology = topology_of(prefill, decode)
        self.nodes: dict[str, Node] = {}
        roles: tuple[tuple[Role, Sequence[str], str], ...] = (
            ("prefill", prefill, "p"), ("decode", decode, "d"))
        for role, urls, prefix in roles:
            for i, url in enumerate(urls):
                name = f"{prefix}{i}"
                self.nodes[name] = Node(name=name, url=url.rstrip("/"), role=role,
                                        max_in_flight=max_in_flight)
        self.ledger = LegLedger()
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.failures_to_down = failures_to_down
        self._periodic: Periodic | None = None

    def role(self, role: Role) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role]

    def healthy(self, role: Role) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role and n.healthy]

    def get(self, name: str) -> Node | None:
        return self.nodes.get(name)

    @property
    def ready(self) -> bool:
        """At least one healthy D, and one healthy P unless the topology has none."""
        return bool(self.healthy("decode")) and (
            not self.has_prefill or bool(self.healthy("prefill")))

    @property
    def has_prefill(self) -> bool:
        """The topology has prefill nodes (`pd`); without (`single`, `replicas`) the
        decode nodes compute every prompt."""
        return self.topology == "pd"

    def in_flight(self, node: Node) -> int:
        """Legs in flight on `node`, from the ledger."""
        return self.ledger.in_flight(node.name, time.monotonic())

    def state(self, node: Node) -> NodeState:
        return node.state(self.in_flight(node))

    def states(self) -> list[NodeState]:
        return [self.state(n) for n in self.nodes.values()]

    def ranked(self, role: Role, first: Node | None = None) -> list[Node]:
        """Healthy nodes of `role`, least loaded first, `first` (if given) at the front.

        With none healthy, every node of the role: trying one beats refusing outright
        (the health check may just have been too slow on a loaded machine)."""
        pool = self.healthy(role) or self.role(role)
        rest = sorted((n for n in pool if n is not first),
                      key=lambda n: (self.in_flight(n) / n.max_in_flight, n.name))
        return [first, *rest] if first is not None else rest

    async def probe(self, client: NodeHttp, node: Node) -> bool:
        refused = False
        try:
            resp = await client.get(f"{node.url}/health", timeout_s=self.probe_timeout_s)
            ok = resp.status_code == 200
            reason = f"/health returned {resp.status_code}"
        except UpstreamError as exc:
            ok, reason = False, str(exc)
            refused = isinstance(exc, ConnectFailed) and not exc.timed_out
        node.last_checked = time.monotonic()
        if not ok:
            # One slow or failed probe is noise on a busy machine; a refused connection or
            # a second failure in a row is not.
            node.probe_failures += 1
            if refused or node.probe_failures >= self.failures_to_down:
                node.mark_down(reason)
            return False
        node.probe_failures = 0
        if not node.healthy or not node.probed:
            start_time, block_size = await self._node_info(client, node)
            node.block_size = block_size or node.block_size
            node.mark_up(start_time)
            node.probed = True
        return ok

    async def _node_info(self, client: NodeHttp,
                         node: Node) -> tuple[str | None, int | None]:
        """From the node's `/metrics`: `process_start_time_seconds` (its incarnation, the
        same for every router replica) and the KV block size (`vllm:cache_config_info`)."""
        try:
            resp = await client.get(f"{node.url}/metrics", timeout_s=self.probe_timeout_s)
        except UpstreamError:
            return None, None
        if resp.status_code != 200:
            return None, None
        start_time = block_size = None
        for line in resp.text.splitlines():
            if line.startswith("process_start_time_seconds "):
                start_time = line.split()[1]
            elif line.startswith("vllm:cache_config_info{"):
                found = _BLOCK_SIZE_RE.search(line)
                block_size = int(found.group(1)) if found else None
        return start_time, block_size

    async def probe_all(self, client: Callable[[Node], NodeHttp]) -> None:
        """Probe every node through its own client (`client(node)`)."""
        await asyncio.gather(*(self.probe(client(n), n) for n in self.nodes.values()))

    def start(self, client: Callable[[Node], NodeHttp]) -> None:
        if self._periodic is None:
            self._periodic = Periodic(lambda: self.probe_all(client),
                                      interval_s=self.interval_s, name="kvagent-health",
                                      log=log, what="health check round")
        self._periodic.start()

    async def stop(self) -> None:
        if self._periodic is not None:
            await self._periodic.stop()
