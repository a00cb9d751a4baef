"""What the app is made of, shared by its lifespan and its handlers (`app.state.parts`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvagent_server.router.auth.tenancy import TenantResolver
from kvagent_server.router.http.limits import Admission
from kvagent_server.router.nodes.registry import NodeRegistry
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.telemetry.metrics import RouterMetrics
from kvagent_server.router.turns.context import Router


@dataclass
class AppParts:
    """What the app is made of, shared by its lifespan and its handlers (`app.state.parts`).

    Built once by `create_app`; `router` exists between the lifespan's start and stop.
    """

    settings: RouterSettings
    registry: NodeRegistry
    metrics: RouterMetrics
    store: SessionStore
    tenants: TenantResolver
    #: Requests in flight per tenant and per client address (their caps).
    admission: Admission
    #: The served model's name; None until a node answered `/v1/models`.
    model: str | None = None
    router: Router | None = None
