"""`Router`: what every turn shares, built once by `http.app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.kv.tiers import TierCostLearner
from kvagent_server.router.nodes.admission import DecodeGate
from kvagent_server.router.nodes.ledger import LegLedger
from kvagent_server.router.nodes.legs import Legs
from kvagent_server.router.nodes.registry import NodeRegistry
from kvagent_server.router.nodes.retention import RetentionGuard
from kvagent_server.router.nodes.spills import Spills
from kvagent_server.router.nodes.tier_placement import TierPlacement
from kvagent_server.router.reuse.learned import Learned
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.store.factory import KeySync
from kvagent_server.router.telemetry.metrics import RouterMetrics
from kvagent_server.router.turns.policy_params import PathPolicy


@dataclass
class Router:
    """The router's shared state: nodes, legs, store, codec, and what turns learn."""

    settings: RouterSettings
    registry: NodeRegistry
    legs: Legs
    store: SessionStore
    codec: TokenCodec
    metrics: RouterMetrics
    #: Decides each turn's path from its facts (`turns.policy`, by `router.policy.name`).
    policy: PathPolicy
    #: What turns teach later turns: costs, token ratios, tool pauses, the `/tokenize`
    #: round trip, P nodes seen checking their pulls (written only by `turns.settle`).
    learned: Learned = field(default_factory=Learned)
    #: Tier-aware P placement from the nodes' KV events (None: by load only).
    tiers: TierPlacement | None = None
    #: Per-token tier load prices, learned from the decode nodes' `/metrics` as the
    #: retention guard reads them (placement and the spilled turns' path price them).
    tier_costs: TierCostLearner = field(default_factory=TierCostLearner)
    #: Where given-up conversations went: their decode nodes' KV tiers (nodes/spills.py;
    #: None: no tiered node, or `retention.spill_ttl_s` 0).
    spills: Spills | None = None
    #: Bounds what decode nodes retain (nodes/retention.py; None: TTL only).
    retention: RetentionGuard | None = None
    #: Admits a leg to a decode node only when it has room (nodes/admission.py; None: the
    #: retention guard is off, so nothing reads the nodes' KV figures).
    gate: DecodeGate | None = None
    #: Shares signing keys with other replicas through Redis (None: configured keys).
    key_sync: KeySync | None = None

    def __post_init__(self) -> None:
        if self.legs.ledger is not self.registry.ledger:
            raise ValueError("the legs must record into the registry's ledger "
                             "(Legs(ledger=registry.ledger))")

    @property
    def ledger(self) -> LegLedger:
        """The legs in flight on every node, with what they carry (`nodes.ledger`): the
        one count of them, read for placement, queue-aware prices and decode room."""
        return self.registry.ledger

    @property
    def counts_work(self) -> bool:
        """The policy reads each node's work in flight: gather counts it."""
        return self.policy.counts_work

    @property
    def skips_tokenize(self) -> bool:
        """The policy may skip `/tokenize` for an extension of the held turn: settle
        learns what that needs (tokens per message byte, the turn's rendering inputs)."""
        return self.policy.skips_tokenize
