"""A handle: the router's record of KV blocks a decode node retains for a session's next turn.

A `Handle` records which decode node holds the KV, which token ids that KV covers, and the
decode node's `kv_transfer_params` needed to pull it. Clients only ever see a token naming
the handle. Handles are single use because the decode node frees the blocks as soon as a
prefill node has read (or declined) them.
"""

from __future__ import annotations

import json
import secrets
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenId = Annotated[int, Field(ge=0, lt=2**32)]

#: How a turn's answer ended: on tool calls (the agent runs them and comes back), on a
#: final answer (`stop` without tool calls: the session may be over), or otherwise (cut
#: by `max_tokens`, an abort, a completions prompt).
EndKind = Literal["tool_call", "final", "other"]
#: At most this many tool names are kept per turn end, each cut to `MAX_TOOL_NAME` chars:
#: they come from the model's output and ride on every handle.
MAX_END_TOOLS = 8
MAX_TOOL_NAME = 128


class MediaItem(BaseModel):
    """One multimodal part of a prompt (image, audio, file...), as the router saw it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Where it sits: `messages[i].content[j]`.
    where: str
    #: SHA-256 of the part's canonical JSON (bytes or data URL, URL string, options).
    digest: str
    #: Its bytes are in the request (data URL, inline audio/file), not behind a URL the
    #: router cannot read: only then does an equal digest prove equal content.
    inline: bool
    #: First prompt position of its placeholder tokens; None when unknown.
    placeholder: int | None = None


class KVIdentity(BaseModel):
    """Everything besides the token ids that shapes a prompt's KV (see reuse.identity)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The served model name; a LoRA adapter is selected by this name too.
    model: str | None
    cache_salt: str | None
    media: tuple[MediaItem, ...] = ()
    #: How many chat messages the prompt had (where a later turn's new messages begin).
    messages: int = Field(default=0, ge=0)
    #: Request fields present that may shape KV in ways the router cannot verify.
    unverifiable: tuple[str, ...] = ()
    #: SHA-256 of everything that rendered those messages (the messages themselves, tools,
    #: template and its arguments; reuse.identity.history_digest); None: not recorded.
    history: str | None = None


class TurnEnd(BaseModel):
    """How the turn whose KV a handle names ended, as the router relayed it: what
    retention weighs (a session waiting on a tool will be back; one that answered may
    not)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: EndKind
    #: The tools it called (choice 0's `tool_calls`, in order, without repeats).
    tools: tuple[str, ...] = Field(default=(), max_length=MAX_END_TOOLS)
    #: When the answer ended (router wall clock).
    at: float

    @classmethod
    def of(cls, finish_reason: str | None, tools: list[str], at: float) -> TurnEnd:
        """From what the relay saw: tool calls (whatever the finish reason says: a
        forced `tool_choice` ends on `stop`), else a `stop`, else something else."""
        names = tuple(dict.fromkeys(t[:MAX_TOOL_NAME] for t in tools if t))[:MAX_END_TOOLS]
        if names or finish_reason == "tool_calls":
            return cls(kind="tool_call", tools=names, at=at)
        return cls(kind="final" if finish_reason == "stop" else "other", at=at)


class Handle(BaseModel):
    """KV blocks a decode node retains for a session's next turn (internal, never sent out)."""

    model_config = ConfigDict(extra="forbid")

    handle_id: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    session: str = Field(min_length=1)
    #: Node id (or base URL) of the decode node that holds the blocks.
    decode_node: str
    #: The node's incarnation: a restarted node has a new epoch and none of the old blocks.
    decode_epoch: str
    #: The decode node's params from its final chunk; rewritten for the next P leg.
    kv_transfer_params: dict[str, Any]
    #: The token ids whose KV the decode node retains (what reuse is verified against).
    token_ids: list[TokenId]
    block_size: int = Field(ge=1)
    #: What else shaped that KV; None on handles from routers that did not record it
    #: (never reused).
    identity: KVIdentity | None = None
    #: How the turn ended; None on handles from routers that did not record it.
    end: TurnEnd | None = None
    #: How many of `token_ids` were the prompt (the rest D generated): what KV tiers that
    #: store prompts only hold of it once it is given up. None: not recorded.
    prompt_tokens: int | None = Field(default=None, ge=0)
    created_at: float  # router wall clock
    expires_at: float  # router wall clock, safety margin already subtracted

    @model_validator(mode="after")
    def _check_times(self) -> Handle:
        if self.expires_at < self.created_at:
            raise ValueError("expires_at precedes created_at")
        return self

    def expired(self, now: float) -> bool:
        return now >= self.expires_at


def new_handle_id() -> str:
    """An unguessable handle id (128 bits, URL-safe)."""
    return secrets.token_urlsafe(16)


# ------------------------------------------------------------------ compact serialisation
#
# token_ids dominate a handle's size (a long agent conversation holds tens of thousands),
# so both stores keep them as packed little-endian uint32 after the JSON of the rest:
# 4 bytes a token instead of ~6 as JSON text or ~36 as a Python list.

_LEN = struct.Struct("<I")


def pack_handle(handle: Handle) -> bytes:
    exclude: dict[str, Any] = {"token_ids": True}
    if handle.identity is not None and handle.identity.history is None:
        # Left out unless recorded, so routers that predate the field still read it.
        exclude["identity"] = {"history"}
    if handle.end is None:
        exclude["end"] = True  # the same for routers that predate the turn's end
    if handle.prompt_tokens is None:
        exclude["prompt_tokens"] = True
    meta = handle.model_dump_json(exclude=exclude).encode()
    ids = array("I", handle.token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return _LEN.pack(len(meta)) + meta + ids.tobytes()


def unpack_handle(data: bytes) -> Handle:
    (meta_len,) = _LEN.unpack_from(data)
    meta = json.loads(data[_LEN.size:_LEN.size + meta_len])
    ids = array("I")
    ids.frombytes(data[_LEN.size + meta_len:])
    if sys.byteorder == "big":
        ids.byteswap()
    # The bytes were produced by pack_handle from a validated Handle: skip re-validating
    # tens of thousands of ints, validate the rest.
    handle = Handle.model_validate({**meta, "token_ids": []})
    return handle.model_copy(update={"token_ids": ids.tolist()})


def handle_meta(data: bytes) -> dict[str, Any]:
    """The JSON part of a packed handle (node, epoch, ...) without unpacking the tokens."""
    (meta_len,) = _LEN.unpack_from(data)
    meta: dict[str, Any] = json.loads(data[_LEN.size:_LEN.size + meta_len])
    return meta


def handle_blocks(handle: Handle) -> int:
    """Blocks the handle pins on its decode node (first KV cache group; an upper bound,
    since blocks shared with other sequences are not freed by releasing one of them)."""
    # The key is `reuse.transfer.REMOTE_BLOCK_IDS`, spelled out because `store` sits below
    # `reuse` in the router's layers (tests/router/nodes/test_retention.py ties the two).
    return _blocks(handle.kv_transfer_params)


def _blocks(params: Any) -> int:
    groups = params.get("remote_block_ids") if isinstance(params, dict) else None
    if not isinstance(groups, list) or not groups:
        return 0
    first = groups[0]
    return len(first) if isinstance(first, list) else len(groups)


@dataclass(frozen=True)
class Retained:
    """One live handle on a decode node as retention weighs it: what it holds and how
    its turn ended, read from the packed handle's JSON part (no token ids)."""

    tenant: str
    handle_id: str
    session: str
    #: Blocks it pins on its node (`handle_blocks`).
    blocks: int
    created_at: float
    expires_at: float
    end: TurnEnd | None

    @property
    def key(self) -> tuple[str, str]:
        """(tenant, handle id): what `SessionStore.evict_handles` takes."""
        return self.tenant, self.handle_id

    @classmethod
    def of_meta(cls, meta: dict[str, Any]) -> Retained:
        """From `handle_meta` of a packed handle."""
        end = meta.get("end")
        return cls(tenant=meta["tenant"], handle_id=meta["handle_id"],
                   session=meta["session"], blocks=_blocks(meta.get("kv_transfer_params")),
                   created_at=float(meta["created_at"]),
                   expires_at=float(meta["expires_at"]),
                   end=TurnEnd.model_validate(end) if end is not None else None)
