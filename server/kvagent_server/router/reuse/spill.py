"""Spilled, not gone: where a conversation lives once its decode copy is given up. Pure.

A decode node whose bundle gave it KV tiers (`router.engine.kv_tiers`) writes what it
computed or loaded through to its host tier (and from there to its disk tier): when the
router gives the retained copy up (the watermark, a waiting turn's room, the store's
bounds), the blocks are released from engine memory, not lost. The router then records
the conversation as **spilled** (`Spill`, beside the handle it was: the token ids the
tiers got) instead of forgetting it, for `router.retention.spill_ttl_s`; the session's
next turn that finds no handle verifies its prompt against it (`plan_spill`) and the path
policy prices a load from the tier (`paths.spill_path`): `d_direct` on the node whose
host tier holds it, P loading what its own KV cache and tiers hold of it (the turns it
computed before, a shared disk), or a recompute.

Nothing here is trusted for correctness: a node loads a block from a tier only under
its own block hash (the prompt's tokens, the salt, the chain before it), so a wrong or
stale record costs a recompute, never wrong KV. What the nodes' KV events say is still
in a tier (`kv.index`, medium CPU and STORAGE) caps the plan where the node publishes
them: a record whose blocks the events show gone is not offered.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.router.kv.tiers import NodeTierHits, NodeTiers, TierCosts
from kvagent_server.router.reuse.identity import IdentityCheck
from kvagent_server.router.reuse.planner import common_prefix_len
from kvagent_server.router.store.handle import Handle, pack_handle, unpack_handle

#: Where a spilled turn's prefix is loaded from: the holding node's host tier, or a disk
#: tier (the node's own, or the shared directory from any node). A span attribute
#: (`kvagent.reuse_source`), a metric label and the detail of a tier-served plan's reason.
Source = Literal["tier_host", "tier_disk"]

_LEN = struct.Struct("<I")


class Spill(BaseModel):
    """A given-up handle's conversation, as its node's tiers keep it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    #: The node's incarnation: a restarted node's host tier is a new, empty region.
    epoch: str
    host: bool
    disk: bool
    shared: bool
    chunk_tokens: int = Field(ge=1)
    #: Leading tokens of the handle's ids the tiers got (only the prompt's, when the
    #: tiers store prompts only; only whole chunks are stored).
    stored_tokens: int = Field(ge=0)
    at: float


def spill_of(handle: Handle, tiers: NodeTiers | None, now: float) -> Spill | None:
    """The spill a given-up handle leaves on a node with `tiers` (None: no tier, so its
    blocks are simply gone)."""
    if tiers is None or not tiers.holds:
        return None
    stored = len(handle.token_ids)
    if tiers.prompt_only:
        if handle.prompt_tokens is None:
            return None  # a handle that did not record its prompt: do not guess
        stored = min(stored, handle.prompt_tokens)
    stored -= stored % tiers.chunk_tokens
    if stored <= 0:
        return None
    return Spill(node=handle.decode_node, epoch=handle.decode_epoch, host=tiers.host,
                 disk=tiers.disk, shared=tiers.disk and tiers.shared,
                 chunk_tokens=tiers.chunk_tokens, stored_tokens=stored, at=now)


def pack_spill(spill: Spill, handle: Handle) -> bytes:
    """The store record of a spill: its JSON, then the packed handle."""
    meta = spill.model_dump_json().encode()
    return _LEN.pack(len(meta)) + meta + pack_handle(handle)


def unpack_spill(data: bytes) -> tuple[Spill, Handle]:
    (n,) = _LEN.unpack_from(data)
    spill = Spill.model_validate(json.loads(data[_LEN.size:_LEN.size + n]))
    return spill, unpack_handle(data[_LEN.size + n:])


@dataclass(frozen=True)
class Spilled:
    """The session's spill as gather found it, and what the nodes' KV events say is
    still in its tiers (tokens of the prompt's prefix; None: the node publishes none)."""

    spill: Spill
    handle: Handle
    host_reach: int | None = None
    disk_reach: int | None = None
    #: What a load from each tier costs (the router's `TierCosts`).
    costs: TierCosts = field(default_factory=TierCosts)
    #: What each P node's KV events show of the same prompt (by node name): its engine
    #: memory, host tier, and disk or the shared directory. A P node computed the
    #: conversation's earlier prompts, so its own tiers often hold most of it. A node
    #: missing here publishes nothing from its tiers (unknown, not empty).
    p_reach: Mapping[str, NodeTierHits] = field(default_factory=dict)


@dataclass(frozen=True)
class TierReuse:
    """What node `node` may load of a spilled turn's prompt (whole chunks of its verified
    prefix): from its host tier (`host_tokens`, on a P node counting what its engine
    memory holds before it), and from a disk tier (`shared`: any node reads it; else
    only that node). `node` is the holding node (`plan_spill`) or a P node
    (`plan_on_prefill`)."""

    node: str
    epoch: str
    host_tokens: int
    disk_tokens: int
    shared: bool
    common_prefix: int

    @property
    def tokens(self) -> int:
        """What the node can load (its host tier, then its disk tier)."""
        return max(self.host_tokens, self.disk_tokens)


def plan_spill(prompt_ids: Sequence[int], spilled: Spilled | None, *, threshold: int,
               identity: IdentityCheck | None) -> TierReuse | None:
    """The verified prefix a turn may load from its session's spill, or None.

    The spilled tokens the tiers got (`Spill.stored_tokens`) against the prompt's ids:
    the common prefix, capped by the identity check (model, salt, media before their
    placeholder), by the reach the nodes' KV events show, and by one token (vLLM computes
    the last), rounded down to whole chunks (only whole chunks are stored or looked up);
    below `threshold` (`kv_recompute_threshold`) nothing."""
    if spilled is None or not prompt_ids or identity is None:
        return None
    spill = spilled.spill
    held = spilled.handle.token_ids[:spill.stored_tokens]
    common = common_prefix_len(prompt_ids, held)
    usable = min(common, _loadable(prompt_ids, identity))

    def capped(present: bool, reach: int | None) -> int:
        return _whole_chunks(usable, reach, spill.chunk_tokens, threshold) if present else 0

    host = capped(spill.host, spilled.host_reach)
    disk = capped(spill.disk, spilled.disk_reach)
    if not host and not disk:
        return None
    return TierReuse(node=spill.node, epoch=spill.epoch, host_tokens=host, disk_tokens=disk,
                     shared=spill.shared, common_prefix=common)


def plan_on_prefill(prompt_ids: Sequence[int], spilled: Spilled | None, node: str,
                    epoch: str, *, tier: TierReuse | None, threshold: int,
                    identity: IdentityCheck | None) -> TierReuse | None:
    """What P node `node` may load of the prompt instead of computing it, or None.

    Where its KV events reach (`Spilled.p_reach`): the prompt's own block hashes found
    in its engine memory and host tier, then its disk tier or the shared directory,
    capped by the identity check and by one token, whole chunks, at least `threshold`.
    The hashes are the prompt's, so this is verified as P's connector will look it up.
    Where the node publishes nothing from its tiers: the holding node's verified spill
    (`tier`) when its disk is the shared directory P reads too, else nothing."""
    if spilled is None or not prompt_ids or identity is None:
        return None
    hits = spilled.p_reach.get(node)
    if hits is None:
        if tier is None or not tier.shared or not tier.disk_tokens:
            return None
        return TierReuse(node=node, epoch=epoch, host_tokens=0, disk_tokens=tier.disk_tokens,
                         shared=True, common_prefix=tier.common_prefix)
    usable, chunk = _loadable(prompt_ids, identity), spilled.spill.chunk_tokens
    host = _whole_chunks(usable, hits.cpu, chunk, threshold)
    disk = _whole_chunks(usable, hits.disk, chunk, threshold)
    if not host and not disk:
        return None
    return TierReuse(node=node, epoch=epoch, host_tokens=host, disk_tokens=disk,
                     shared=False, common_prefix=common_prefix_len(
                         prompt_ids, spilled.handle.token_ids[:spilled.spill.stored_tokens]))


def _loadable(prompt_ids: Sequence[int], identity: IdentityCheck) -> int:
    """The most of a prompt a node may load: all but its last token (vLLM computes the
    last), and nothing past the identity check's cap (model, salt, media)."""
    usable = len(prompt_ids) - 1
    return usable if identity.cap is None else min(usable, identity.cap)


def _whole_chunks(usable: int, reach: int | None, chunk: int, threshold: int) -> int:
    """`usable` tokens capped by a tier's `reach` (None: unknown, not capped), in whole
    chunks (only whole chunks are stored or looked up); 0 below `threshold`."""
    tokens = usable if reach is None else min(usable, reach)
    tokens -= tokens % chunk
    return tokens if tokens >= max(threshold, 1) else 0


def tiers_by_name(tiers: Mapping[str, NodeTiers], urls: Mapping[str, str]
                  ) -> dict[str, NodeTiers]:
    """`router.engine.kv_tiers` (by node URL) by node name (`urls`: name -> URL)."""
    by_url = {u.rstrip("/"): t for u, t in tiers.items()}
    return {name: by_url[url.rstrip("/")] for name, url in urls.items()
            if url.rstrip("/") in by_url}
