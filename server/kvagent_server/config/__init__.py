"""The bundle configuration: the model (`model`), loading it from YAML and flags with
precise errors (`loading`), and its generated reference (`reference`).

Everything `kvagent-server` does is a function of a `BundleConfig` plus a few facts about
the host (cores, GPUs, see `bundle.render.HostFacts`). Checks that need only the config live in
the model; checks that need the host (no GPU, too few cores) live in `bundle.render.plan`. Both
raise `ConfigError`, whose `problems` are one line each, prefixed with the YAML path.
"""

from kvagent_server.config.loading import (
    dump_config,
    format_validation_error,
    load_config,
    reveal_secrets,
    set_dotted,
    validate_config,
)
from kvagent_server.config.model import (
    DEFAULT_RUN_ROOT,
    BundleConfig,
    ConfigError,
    KVEventsConfig,
    RoleConfig,
)
from kvagent_server.config.reference import config_reference_markdown

__all__ = ["DEFAULT_RUN_ROOT", "BundleConfig", "ConfigError", "KVEventsConfig", "RoleConfig",
           "config_reference_markdown", "dump_config", "format_validation_error",
           "load_config", "reveal_secrets", "set_dotted", "validate_config"]
