"""Router settings: one validated model, embedded in the bundle config under `router:`;
its sections by concern in `sections`, the model and the older flat keys' move in `model`."""

from kvagent_server.router.settings.model import (
    POLICY_PARAM_SETTINGS,
    FreshPolicy,
    PathPolicySettings,
    RouterSettings,
    TenantSettings,
    derive_cache_salt,
)
from kvagent_server.router.settings.sections import (
    FLAT_KEYS,
    SECTIONS,
    EngineSettings,
    IdentitySettings,
    LimitSettings,
    NodeSettings,
    RetentionPolicySettings,
    RetentionSettings,
)

__all__ = ["FLAT_KEYS", "POLICY_PARAM_SETTINGS", "SECTIONS", "EngineSettings", "FreshPolicy",
           "IdentitySettings", "LimitSettings", "NodeSettings", "PathPolicySettings",
           "RetentionPolicySettings", "RetentionSettings", "RouterSettings", "TenantSettings",
           "derive_cache_salt"]
