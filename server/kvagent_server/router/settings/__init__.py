"""Router settings: one validated model, embedded in the bundle config under `router:`;
its sections by concern (the path policy's among them) in `sections`, the model and the
older flat keys' move in `model`."""

from kvagent_server.router.settings.model import (
    RouterSettings,
    TenantSettings,
    derive_cache_salt,
)
from kvagent_server.router.settings.sections import (
    FLAT_KEYS,
    POLICY_FLAT_PARAMS,
    SECTIONS,
    EngineSettings,
    IdentitySettings,
    LimitSettings,
    NodeSettings,
    PathPolicySettings,
    RetentionPolicySettings,
    RetentionSettings,
)

__all__ = ["FLAT_KEYS", "POLICY_FLAT_PARAMS", "SECTIONS", "EngineSettings",
           "IdentitySettings", "LimitSettings", "NodeSettings", "PathPolicySettings",
           "RetentionPolicySettings", "RetentionSettings", "RouterSettings", "TenantSettings",
           "derive_cache_salt"]
