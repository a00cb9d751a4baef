"""Which KV blocks each node holds, per tier, as its KV events tell (no I/O here).

Nodes publish `BlockStored` / `BlockRemoved` / `AllBlocksCleared` in numbered batches
(vLLM's ZMQ publisher; `kv.events` decodes them). The index keeps, per node and per
tier, the hashes stored there, and answers "how long a prefix of this prompt does each
node hold, in each tier" for placement (`tiers.NodeTierHits`).

Being wrong in one direction is cheap and in the other costly: a missed hit costs a
recompute, a phantom hit sends a turn to a busier node for nothing. So whenever the
index may have missed a removal (a sequence gap, a node restart, a new node epoch) it
forgets that node and relearns from later events.

Tiers from the event's `medium`: `GPU` (or none: vLLM's own KV cache, host memory on a
CPU node) is `gpu`; `CPU` and `STORAGE` (OffloadingConnector tiers) are `cpu`, `disk`.
The GPU block pool re-announces blocks reused from its prefix cache without a matching
removal, so `gpu` is a set; the offloading tiers announce each chunk's hashes once per
store and once per eviction (overlapping chunks repeat a hash), so they are counted.

A disk tier that is one directory shared by every node (`kv_tiers.disk.shared`) is one
place, not one per node: the `STORAGE` events of the nodes named `shared` go to one
shared set that counts for each of them. Two nodes storing one block write one file, and
one removal deletes it, so the shared set is not counted: a block leaves it at the first
removal (a missed hit at worst), and it is emptied whenever one of those nodes is
forgotten (its removals may have been missed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.common.types import HashAlgo
from kvagent_server.router.kv.tiers import NodeTierHits, TierName

MEDIUM_TIERS: dict[str | None, TierName] = {None: "gpu", "GPU": "gpu", "CPU": "cpu",
                                            "STORAGE": "disk"}
_COUNTED: frozenset[TierName] = frozenset({"cpu", "disk"})

_V = TypeVar("_V")

ApplyResult = Literal["ok", "first", "gap", "restart"]


class KVEventSource(BaseModel):
    """Where one node publishes its KV events, and how it hashes blocks."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(min_length=1, description="ZMQ endpoint the router connects "
                          "its SUB socket to (`tcp://host:port` or `ipc:///path`).")
    topic: str = Field(default="", description="The node's `--kv-events-config` topic.")
    hash_algo: HashAlgo = Field(default="sha256",
                                description="The node's `--prefix-caching-hash-algo`.")
    hash_seed: str | None = Field(default=None, description="The node's PYTHONHASHSEED; "
                                  "null: unset (vLLM's fixed seed for sha256).")


@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]
    medium: str | None = None
    block_size: int | None = None
    group: int | None = None


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass
class NodeBlocks:
    """One node's blocks as far as the index knows."""

    seq: int | None = None
    epoch: str | None = None
    block_size: int | None = None
    tiers: dict[TierName, Counter[int]] = field(
        default_factory=lambda: {"gpu": Counter(), "cpu": Counter(), "disk": Counter()})
    resets: int = 0

    def clear(self) -> None:
        for blocks in self.tiers.values():
            blocks.clear()

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.tiers.values())


class KVIndex:
    """Per node and tier, the block hashes stored there."""

    def __init__(self, shared: Iterable[str] = ()) -> None:
        self.nodes: dict[str, NodeBlocks] = {}
        #: Nodes whose disk tier is the shared directory, and the blocks it holds.
        self.shared_nodes: frozenset[str] = frozenset(shared)
        self.shared: set[int] = set()

    def node(self, name: str) -> NodeBlocks:
        return self.nodes.setdefault(name, NodeBlocks())

    def forget(self, name: str) -> None:
        """Drop what is known of `name` (it may hold other blocks now)."""
        nb = self.node(name)
        nb.clear()
        nb.resets += 1
        if name in self.shared_nodes:
            self.shared.clear()

    def observe_epoch(self, name: str, epoch: str) -> bool:
        """Record the node's incarnation; True (and forgotten) when it changed."""
        nb = self.node(name)
        if nb.epoch == epoch:
            return False
        changed = nb.epoch is not None
        nb.epoch = epoch
        if changed:
            self.forget(name)
        return changed

    def apply(self, name: str, seq: int, events: Iterable[Event]) -> ApplyResult:
        """Apply one batch. Batches are numbered 0, 1, 2... per publisher process: a
        number that goes back means a new process (restart), one that skips means lost
        batches (the publisher's high-water mark, a reconnect). Either way the node is
        forgotten before this batch is applied."""
        if seq < 0:
            raise ValueError("sequence numbers are >= 0")
        nb = self.node(name)
        result: ApplyResult
        if nb.seq is None:
            result = "first"
        elif seq == nb.seq + 1:
            result = "ok"
        else:
            result = "restart" if seq <= nb.seq else "gap"
            self.forget(name)
        nb.seq = seq
        for event in events:
            self._apply_one(nb, event, shared=name in self.shared_nodes)
        return result

    def _apply_one(self, nb: NodeBlocks, event: Event, *, shared: bool) -> None:
        if isinstance(event, Cleared):
            nb.clear()  # the engine's caches; the shared directory is not the node's
            return
        if event.group not in (None, 0):
            return  # only the first KV cache group (all of it on full-attention models)
        tier = MEDIUM_TIERS.get(event.medium)
        if tier is None:
            return  # a medium this version does not know: ignore rather than guess
        if tier == "disk" and shared:
            if isinstance(event, Stored):
                self.shared.update(event.hashes)
            else:
                self.shared.difference_update(event.hashes)
            return
        blocks = nb.tiers[tier]
        if isinstance(event, Stored):
            if tier == "gpu" and event.block_size:
                nb.block_size = event.block_size
            for h in event.hashes:
                blocks[h] = blocks[h] + 1 if tier in _COUNTED else 1
        else:
            for h in event.hashes:
                left = blocks[h] - 1 if tier in _COUNTED else 0
                if left > 0:
                    blocks[h] = left
                else:
                    blocks.pop(h, None)

    def holds_any(self, names: Iterable[str]) -> bool:
        """Whether any of these nodes is known to hold a block (else matching is moot)."""
        return any((n in self.nodes and self.nodes[n].size)
                   or (n in self.shared_nodes and self.shared) for n in names)

    def block_size(self, name: str) -> int | None:
        nb = self.nodes.get(name)
        return nb.block_size if nb is not None else None

    def prefix_blocks(self, name: str, keys: Sequence[int]) -> dict[TierName, int]:
        """How far (in blocks) each tier of `name` reaches into a prompt's block keys.

        Modelled on how a node loads a prefix: its GPU prefix cache serves the first
        run; the CPU tier continues from there; the disk tier continues from the CPU
        tier's reach (the CPU tier may still serve blocks in that stretch).
        """
        nb = self.nodes.get(name)
        if nb is None and name not in self.shared_nodes:
            return {"gpu": 0, "cpu": 0, "disk": 0}
        nb = nb or NodeBlocks()
        gpu, cpu = nb.tiers["gpu"], nb.tiers["cpu"]
        disk = self.shared if name in self.shared_nodes else nb.tiers["disk"]
        i = 0
        while i < len(keys) and keys[i] in gpu:
            i += 1
        g = i
        while i < len(keys) and keys[i] in cpu:
            i += 1
        c = i
        while i < len(keys) and (keys[i] in disk or keys[i] in cpu):
            i += 1
        return {"gpu": g, "cpu": c, "disk": i}

    def tier_hits(self, name: str, keys: Sequence[int], block_size: int, *,
                  in_flight: int = 0) -> NodeTierHits:
        """`prefix_blocks` in tokens, as the placement core takes it."""
        reach = self.prefix_blocks(name, keys)
        return NodeTierHits(node=name, gpu=reach["gpu"] * block_size,
                            cpu=reach["cpu"] * block_size, disk=reach["disk"] * block_size,
                            in_flight=in_flight)


def sources_by_node(sources: Mapping[str, _V], urls: Mapping[str, str]) -> dict[str, _V]:
    """Settings name sources by node URL; the index names nodes like the registry.
    `urls` maps node name to URL. Sources for unknown URLs are dropped."""
    by_url = {u.rstrip("/"): s for u, s in sources.items()}
    return {name: by_url[url.rstrip("/")] for name, url in urls.items()
            if url.rstrip("/") in by_url}
