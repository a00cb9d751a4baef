"""Reuse decisions: how much of a decode node's retained KV a new prompt may use.

The one rule that matters (vLLM #43094): KV is reused only for the longest *verified*
token-level common prefix between the new prompt and the tokens the decode node holds,
rounded down to whole blocks. Whatever the client did to its history (stripped
reasoning, re-rendered tool calls, edits), the worst outcome is a recompute, never KV of
other tokens. Everything here is pure. The params that carry a plan to the nodes are
built in `transfer`; which path serves it is `paths`' choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.router.reuse.identity import IdentityCheck
from kvagent_server.router.reuse.transfer import retained_tokens
from kvagent_server.router.store.handle import Handle


class Reason(StrEnum):
    """Why a plan reuses what it reuses. The value is the metric label and the wire name."""

    #: The prompt extends every cached token; the reuse is that, block-aligned.
    HIT = "hit"
    #: The prompt diverged from the cache after some whole blocks.
    PREFIX_PARTIAL = "prefix_partial"
    #: Reuse is switched off in the router's settings.
    REUSE_DISABLED = "reuse_disabled"
    #: The presented cache token was refused; the detail says why.
    TOKEN_REJECTED = "token_rejected"
    #: Nothing to reuse: no token and no handle for the session (a first turn).
    NO_HANDLE = "no_handle"
    OTHER_TENANT = "other_tenant"
    OTHER_SESSION = "other_session"
    EXPIRED = "expired"
    #: The decode node restarted since the handle was made: its blocks are gone.
    STALE_EPOCH = "stale_epoch"
    NODE_UNHEALTHY = "node_unhealthy"
    UNSUPPORTED_KV_LAYOUT = "unsupported_kv_layout"
    DIVERGED_AT_0 = "diverged_at_0"
    BELOW_THRESHOLD = "below_threshold"
    #: The router could not get the prompt's token ids from a node.
    TOKENIZE_FAILED = "tokenize_failed"
    #: The decode node failed before its first byte on a reuse path.
    DECODE_FAILED = "decode_failed"
    #: P could not pull the prefix from D and recomputed.
    PULL_FAILED = "pull_failed"
    #: The decode node had no KV room while turns waited, and the handle was released
    #: to make some (`nodes.admission`): the prompt is recomputed.
    NO_ROOM = "no_kv_room"
    #: The session moved off the busy node holding its KV (the `replicas` topology) and the
    #: new node computes the prompt (detail: why it moved).
    MOVED = "moved"
    #: A request P/D cannot split (see `decode_only`).
    UNSUPPORTED_SHAPE = "unsupported_shape"
    #: The KV was made for another model/adapter or salt (detail `model`, `salt`), or its
    #: handle recorded no identity (`unrecorded`).
    IDENTITY_CHANGED = "identity_changed"
    #: A multimodal item differs (detail `item_<k>`): reuse stops at its placeholder.
    MULTIMODAL_CHANGED = "multimodal_changed"
    #: A request field, or media behind a URL, whose effect on KV the router cannot
    #: verify (detail: the field, or `media_url`).
    UNVERIFIABLE_INPUT = "unverifiable_input"


#: Plans that reuse nothing because the client had nothing to reuse (first turn, or reuse
#: switched off): served as `pd_fresh`. Every other zero-reuse plan is a `recompute`.
FRESH_REASONS = frozenset({Reason.NO_HANDLE, Reason.REUSE_DISABLED})


class ReusePlan(BaseModel):
    """How many prompt tokens to take from the decode node's KV, and why."""

    model_config = ConfigDict(frozen=True)

    reuse_tokens: int = Field(ge=0)
    reason: Reason
    #: More precise cause within `reason` (e.g. why a token was rejected), or None.
    detail: str | None = None
    #: Tokens the prompt shares with the cache before the first difference (for metrics).
    common_prefix: int = Field(default=0, ge=0)
    #: Tokens whose KV the decode node could hand over.
    cached_tokens: int = Field(default=0, ge=0)
    #: False: planned from the messages alone (`extension_plan`), so only `d_direct`
    #: may serve it and `reuse_tokens` is what D holds, not a verified prefix.
    tokenized: bool = True

    @property
    def reuses(self) -> bool:
        return self.reuse_tokens > 0

    @property
    def label(self) -> str:
        """`reason`, or `reason:detail`: what clients and logs see."""
        return f"{self.reason.value}:{self.detail}" if self.detail else self.reason.value


_CHUNK = 512


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Compares chunk by chunk (C-speed slice equality) and scans only the chunk that
    differs: long agent histories are compared at list-comparison speed, not per token
    in Python.
    """
    n = min(len(a), len(b))
    a_list = a if isinstance(a, list) else list(a)
    b_list = b if isinstance(b, list) else list(b)
    i = 0
    while i < n:
        j = min(i + _CHUNK, n)
        if a_list[i:j] != b_list[i:j]:
            while a_list[i] == b_list[i]:
                i += 1
            return i
        i = j
    return n


def plan_reuse(
    prompt_ids: Sequence[int],
    handle: Handle | None,
    *,
    threshold: int,
    now: float,
    tenant: str | None = None,
    session: str | None = None,
    node_healthy: bool = True,
    node_epoch: str | None = None,
    enabled: bool = True,
    rejected: str | None = None,
    prefill_block_size: int | None = None,
    identity: IdentityCheck | None = None,
) -> ReusePlan:
    """The longest verified, block-aligned prefix of `prompt_ids` to reuse from `handle`.

    - `threshold`: below this many reusable tokens, recompute (pulling costs more); use
      the nodes' `kv_recompute_threshold` so the router and P agree.
    - `tenant`/`session`: when given, a handle of another tenant or session is refused.
    - `node_healthy`/`node_epoch`: the holding decode node's health and current epoch; a
      handle from an earlier incarnation names blocks that no longer exist.
    - `rejected`: why the presented token was refused (`TOKEN_REJECTED`, detail `rejected`).
    - `prefill_block_size`: when P's block size differs, align to both.
    - `identity`: the handle's KV identity checked against the prompt's (reuse.identity);
      a cap of 0 refuses reuse, a positive cap ends it before the first differing media
      item. None: not checked (pure token-level planning).
    At least one prompt token is always left to compute: vLLM needs one to sample from.
    """
    if not enabled:
        return ReusePlan(reuse_tokens=0, reason=Reason.REUSE_DISABLED)
    if rejected is not None:
        return ReusePlan(reuse_tokens=0, reason=Reason.TOKEN_REJECTED, detail=rejected)
    if handle is None:
        return ReusePlan(reuse_tokens=0, reason=Reason.NO_HANDLE)
    if tenant is not None and handle.tenant != tenant:
        return ReusePlan(reuse_tokens=0, reason=Reason.OTHER_TENANT)
    if session is not None and handle.session != session:
        return ReusePlan(reuse_tokens=0, reason=Reason.OTHER_SESSION)
    if identity is not None and identity.cap == 0:
        return _identity_plan(identity, 0)
    if handle.expired(now):
        return ReusePlan(reuse_tokens=0, reason=Reason.EXPIRED)
    if node_epoch is not None and node_epoch != handle.decode_epoch:
        return ReusePlan(reuse_tokens=0, reason=Reason.STALE_EPOCH)
    if not node_healthy:
        return ReusePlan(reuse_tokens=0, reason=Reason.NODE_UNHEALTHY)
    retained = retained_tokens(handle)
    if retained is None:
        return ReusePlan(reuse_tokens=0, reason=Reason.UNSUPPORTED_KV_LAYOUT)
    cached = handle.token_ids[:retained]
    common = common_prefix_len(prompt_ids, cached)
    cut = identity if (identity is not None and identity.cap is not None
                       and identity.cap < common) else None
    if cut is not None:
        common = min(common, cut.cap or 0)
    if common == 0:
        return ReusePlan(reuse_tokens=0, reason=Reason.DIVERGED_AT_0, cached_tokens=retained)
    reuse = _aligned(min(common, len(prompt_ids) - 1), handle.block_size,
                     prefill_block_size, threshold)
    if cut is not None:  # the media check, not the tokens, ended the prefix
        return _identity_plan(cut, reuse, common_prefix=common, cached_tokens=retained)
    if reuse == 0:
        return ReusePlan(reuse_tokens=0, reason=Reason.BELOW_THRESHOLD, common_prefix=common,
                         cached_tokens=retained)
    reason = Reason.HIT if common == retained else Reason.PREFIX_PARTIAL
    return ReusePlan(reuse_tokens=reuse, reason=reason, common_prefix=common,
                     cached_tokens=retained)


def _aligned(tokens: int, block_size: int, prefill_block_size: int | None,
             threshold: int) -> int:
    """`tokens` rounded down to whole blocks of D (and of P, when its size differs);
    0 below `threshold`."""
    align = block_size
    if prefill_block_size is not None:
        if prefill_block_size < 1:
            raise ValueError("prefill_block_size must be positive")
        align = math.lcm(align, prefill_block_size)
    reuse = tokens // align * align
    return reuse if reuse >= threshold else 0


def extension_plan(handle: Handle, *, threshold: int) -> ReusePlan:
    """The plan for a prompt known, from its messages, to extend everything `handle`
    holds (reuse.identity.extension_chars), without its token ids: every whole block D
    retains. A `d_direct` leg may act on it, since D's prefix cache then matches the
    real tokens itself; a pull only on a P node that checks what it pulls
    (`untokenized_path`), since the router has not verified the tokens.
    The caller has made `plan_reuse`'s other checks (tenant, expiry, epoch, identity)."""
    retained = retained_tokens(handle)
    if retained is None:
        return ReusePlan(reuse_tokens=0, reason=Reason.UNSUPPORTED_KV_LAYOUT)
    reuse = _aligned(retained, handle.block_size, None, threshold)  # D's blocks only
    if reuse == 0:
        return ReusePlan(reuse_tokens=0, reason=Reason.BELOW_THRESHOLD,
                         common_prefix=retained, cached_tokens=retained)
    return ReusePlan(reuse_tokens=reuse, reason=Reason.HIT, common_prefix=retained,
                     cached_tokens=retained, tokenized=False)


def _identity_plan(check: IdentityCheck, reuse: int, *, common_prefix: int = 0,
                   cached_tokens: int = 0) -> ReusePlan:
    assert check.reason is not None  # a cap always comes with its reason
    return ReusePlan(reuse_tokens=reuse, reason=Reason(check.reason), detail=check.detail,
                     common_prefix=common_prefix, cached_tokens=cached_tokens)
