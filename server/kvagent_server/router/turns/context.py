"""`Router`: what every turn shares, built once by `http.app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.kv.room import DecodeRoom
from kvagent_server.router.nodes.admission import DecodeGate
from kvagent_server.router.nodes.legs import Legs
from kvagent_server.router.nodes.registry import NodeRegistry
from kvagent_server.router.nodes.retention import RetentionGuard
from kvagent_server.router.nodes.tier_placement import TierPlacement
from kvagent_server.router.reuse.paths import CostModel
from kvagent_server.router.reuse.pauses import ToolPauses
from kvagent_server.router.reuse.queue import CharsPerToken, WorkLedger
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.store.factory import KeySync
from kvagent_server.router.telemetry.metrics import RouterMetrics
from kvagent_server.router.turns.policy import PathPolicy


@dataclass
class Router:
    """The router's shared state: nodes, legs, store, codec, and what turns learn."""

    settings: RouterSettings
    registry: NodeRegistry
    legs: Legs
    store: SessionStore
    codec: TokenCodec
    metrics: RouterMetrics
    #: Decides each turn's path from its facts (`turns.policy`, by name in settings).
    policy: PathPolicy
    costs: CostModel = field(default_factory=CostModel)
    #: The legs in flight per node, in tokens of work (what a new leg queues behind).
    work: WorkLedger = field(default_factory=WorkLedger)
    #: Tokens per body character of P legs whose prompt the router did not tokenize.
    chars: CharsPerToken = field(default_factory=CharsPerToken)
    #: Prompt tokens (all of them, cached or not) per body character of untokenized turns:
    #: the blocks a decode node must hold for one (nodes/admission.py). Starts high (1 token per
    #: 3 bytes): too much room promised makes a turn wait, too little can stall D.
    prompt_chars: CharsPerToken = field(default_factory=lambda: CharsPerToken(prior=1 / 3))
    #: Prompt tokens per byte of a chat turn's messages (a turn that skips `/tokenize`
    #: estimates its delta from its new messages with it).
    message_chars: CharsPerToken = field(default_factory=CharsPerToken)
    #: How long each tenant's tools keep a session away (learned by settle; retention
    #: keeps a waiting session's KV by it: `reuse.retention_policy`).
    pauses: ToolPauses = field(default_factory=ToolPauses)
    #: The `/tokenize` round trip, seconds (running mean; None until one was made): what
    #: a turn that skips it saves.
    tokenize_s: float | None = None
    #: Tier-aware P placement from the nodes' KV events (None: by load only).
    tiers: TierPlacement | None = None
    #: Bounds what decode nodes retain (nodes/retention.py; None: TTL only).
    retention: RetentionGuard | None = None
    #: Each decode node's free KV blocks, less what legs on their way were promised.
    room: DecodeRoom = field(default_factory=DecodeRoom)
    #: Admits a leg to a decode node only when it has room (nodes/admission.py; None: the
    #: retention guard is off, so nothing reads the nodes' KV figures).
    gate: DecodeGate | None = None
    #: Shares signing keys with other replicas through Redis (None: configured keys).
    key_sync: KeySync | None = None
