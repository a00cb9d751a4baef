"""Tier-aware P placement for one turn: hash the prompt, look its prefix up per node.

The wiring between the KV index (fed by `kv.events`) and vLLM's block hashes
(`kv.hashing`). `turns.gather` asks for the `hits` only for a turn with no usable D
handle, and only when `wants` says matching can pay; decide makes the choice
(`placement.pick_prefill_by_tiers`, in `turns.policy.place`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvagent_server.router.kv.hashing import BlockHasher, HashUnavailable
from kvagent_server.router.kv.index import KVEventSource, KVIndex, sources_by_node
from kvagent_server.router.kv.tiers import NodeTierHits, TierCosts
from kvagent_server.router.nodes.registry import NodeRegistry
from kvagent_server.router.reuse import placement
from kvagent_server.router.reuse.placement import NodeState
from kvagent_server.router.settings import RouterSettings

if TYPE_CHECKING:
    from kvagent_server.router.kv.events import KVEventSubscriber

log = logging.getLogger("kvagent.router.kv_placement")

#: One prompt's block keys by (hash algorithm, seed, block size): nodes hashing alike
#: share them, so a prompt is hashed once per kind of node, not once per node.
KeyMemo = dict[tuple[str, str, int], list[int]]


def _keys(hasher: BlockHasher, prompt_ids: Sequence[int], block_size: int,
          cache_salt: str | None, memo: KeyMemo) -> list[int]:
    key = (hasher.algo, hasher.seed, block_size)
    if key not in memo:
        memo[key] = hasher.keys(prompt_ids, block_size, cache_salt=cache_salt)
    return memo[key]


class TierPlacement:
    """The index and how to hash prompts for each node it covers."""

    def __init__(self, index: KVIndex, sources: Mapping[str, KVEventSource], *,
                 costs: TierCosts | None = None, block_size: int | None = None) -> None:
        self.index = index
        self.costs = costs or TierCosts()
        self.block_size = block_size  # the router's setting; the nodes' events win
        self.hashers: dict[str, BlockHasher] = {}
        for name, source in sources.items():
            try:
                self.hashers[name] = BlockHasher(source.hash_algo, source.hash_seed)
            except HashUnavailable as exc:
                log.warning("no tier-aware placement for %s: %s", name, exc)

    def wants(self, states: Sequence[NodeState]) -> bool:
        for s in states:  # a node that came back under a new epoch holds other blocks
            if s.node_id in self.hashers:
                self.index.observe_epoch(s.node_id, s.epoch)
        covered = [s.node_id for s in states if s.role == "prefill" and s.node_id in self.hashers]
        return placement.consult_tiers(states, indexed=self.index.holds_any(covered))

    def hits(self, states: Sequence[NodeState], prompt_ids: Sequence[int], *,
             cache_salt: str | None, default_block_size: int | None
             ) -> tuple[dict[str, NodeTierHits], int]:
        """Per-tier prefix hits of each covered P node, and the block size used."""
        out: dict[str, NodeTierHits] = {}
        memo: KeyMemo = {}
        used = 1
        for s in states:
            hasher = self.hashers.get(s.node_id)
            if s.role != "prefill" or hasher is None:
                continue
            bs = self.index.block_size(s.node_id) or self.block_size or default_block_size
            if not bs:
                continue
            used = bs
            out[s.node_id] = self.index.tier_hits(
                s.node_id, _keys(hasher, prompt_ids, bs, cache_salt, memo), bs,
                in_flight=s.in_flight)
        return out, used

    def reach(self, name: str, prompt_ids: Sequence[int], *, block_size: int,
              cache_salt: str | None, memo: KeyMemo | None = None) -> NodeTierHits | None:
        """How far (tokens) node `name`'s engine memory, then its host tier, then its disk
        tier (the shared directory for a node that shares one) reach into the prompt, each
        counting the ones before it; None when the index has heard nothing from those
        tiers of the node (it may publish none: unknown, not empty). `memo`: the prompt's
        keys, shared between the calls for one prompt."""
        hasher = self.hashers.get(name)
        nb = self.index.nodes.get(name)
        shared = name in self.index.shared_nodes and bool(self.index.shared)
        if hasher is None or nb is None or not (nb.tiers["cpu"] or nb.tiers["disk"] or shared):
            return None
        bs = self.index.block_size(name) or block_size
        keys = _keys(hasher, prompt_ids, bs, cache_salt, {} if memo is None else memo)
        return self.index.tier_hits(name, keys, bs)


def from_settings(settings: RouterSettings, registry: NodeRegistry
                  ) -> tuple[TierPlacement | None, KVEventSubscriber | None]:
    """The placement and its (not yet started) subscriber for the settings' KV event
    sources; (None, None) when there are none."""
    urls = {n.name: n.url for n in registry.nodes.values()}
    sources = sources_by_node(settings.engine.kv_events, urls)
    unknown = {u.rstrip("/") for u in settings.engine.kv_events} - set(urls.values())
    if unknown:
        log.warning("kv_events for unknown node URL(s) ignored: %s", ", ".join(sorted(unknown)))
    if not sources:
        return None, None
    from kvagent_server.router.kv.events import (
        KVEventSubscriber,  # pyzmq only when there is something to hear
    )

    tiers_by_node = sources_by_node(settings.engine.kv_tiers, urls)
    index = KVIndex(shared=[n for n, t in tiers_by_node.items() if t.disk and t.shared])
    tiers = TierPlacement(index, sources, block_size=settings.nodes.block_size)
    usable = {name: s for name, s in sources.items() if name in tiers.hashers}
    return tiers, KVEventSubscriber(index, usable) if usable else None
