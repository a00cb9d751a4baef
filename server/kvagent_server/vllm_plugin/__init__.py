"""kvagent's vLLM plugin (entry point `vllm.general_plugins` -> `register`).

Inert unless `KVAGENT_PLUGIN=1` (the bundle sets it on the nodes it starts). When enabled it:

- adds `kv_transfer_params` to the final chunk of streamed chat and text completions
  (`stream_params`), as the non-streamed responses already carry them;
- gives NIXL's UCX progress thread a poll timeout so an idle node sleeps (`nixl_delay`);
- makes a failed or declined KV load recompute instead of failing the request
  (`load_failure`);
- pulls from D only the blocks whose tokens P's own prompt repeats (`pull_check`);
- keeps the worker's compute thread on the node's cores (`affinity`);
- makes every block a decode node retains expire, and lets the router release retained
  blocks early (`retention`);
- makes a decode node emit the token P sampled as its first, and compute from it,
  instead of recomputing the prompt's last token (`first_token`);
- lets an engine that only holds KV blocks for a remote reader wait for input instead of
  stepping every millisecond (`idle_wait`);
- makes `/tokenize` prepare a Mistral-tokenizer chat as the chat endpoint does, so the
  router's prompt ids exist for histories with tool calls (`tokenize_render`).

The package also holds the CPU nodes' KV tiers, which vLLM loads by name from
`kv_connector_extra_config` whether or not the plugin is enabled: an offloading spec and
worker (`host_tier`) and a disk tier (`disk_tier`), see docs/tiers.md.

vLLM calls `register()` in every process it starts; each patch is applied lazily when vLLM
imports the module it patches, and applying it twice is a no-op.
"""

from __future__ import annotations

import logging
import os

from kvagent_server.vllm_plugin import env

logger = logging.getLogger("vllm.kvagent")


def enabled() -> bool:
    """True when the bundle asked for the plugin on this node."""
    return os.environ.get(env.PLUGIN_ENV, "") == "1"


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def register() -> None:
    """vLLM general-plugin entry point."""
    if not enabled():
        return
    import vllm

    from kvagent_server.vllm_plugin import (
        affinity,
        first_token,
        idle_wait,
        load_failure,
        nixl_delay,
        pull_check,
        retention,
        stream_params,
        tokenize_render,
        version,
    )
    from kvagent_server.vllm_plugin.import_hooks import when_imported

    try:
        gap = version.check(vllm.__version__, os.environ.get(env.ALLOW_VLLM_ENV, ""))
    except version.UnsupportedVLLMVersion as exc:
        logger.error("%s", exc)
        raise
    if gap:
        logger.warning("kvagent: running on vLLM %s (allowed by %s): %s",
                       vllm.__version__, env.ALLOW_VLLM_ENV, gap)

    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    delay_us = _int_env(env.NIXL_DELAY_ENV, env.DEFAULT_NIXL_DELAY_US)
    idle_ms = _int_env(env.IDLE_POLL_ENV, env.DEFAULT_IDLE_POLL_MS)
    spin_ms = _int_env(env.SPIN_ENV, env.DEFAULT_SPIN_MS)
    nap_us = _int_env(env.SPIN_NAP_ENV, -1)  # -1: unset, the platform's default

    for name in stream_params.target_modules():
        when_imported(name, stream_params.patch_module)
    if delay_us > 0:
        for name in nixl_delay.API_MODULES:
            when_imported(name, lambda m: nixl_delay.patch_api_module(m, delay_us))
    if idle_ms > 0:
        when_imported(idle_wait.TARGET_MODULE, lambda m: idle_wait.patch_module(m, idle_ms))
    if os.environ.get(env.KEEP_AFFINITY_ENV, "1") == "1":
        when_imported(affinity.TARGET_MODULE, affinity.patch_module)
    if os.environ.get(env.RECOMPUTE_ENV, "1") == "1":
        when_imported(load_failure.TARGET_MODULE, load_failure.patch_module)
        when_imported(load_failure.PULL_SCHEDULER_MODULE, load_failure.patch_pull_scheduler)
    if os.environ.get(env.RETENTION_ENV, "1") == "1":
        when_imported(retention.TARGET_MODULE, retention.patch_module)
    if os.environ.get(env.FIRST_TOKEN_ENV, "1") == "1":
        when_imported(first_token.SCHEDULER_MODULE, first_token.patch_scheduler_module)
        when_imported(first_token.INPUT_BATCH_MODULE, first_token.patch_input_batch_module)
    when_imported(pull_check.TARGET_MODULE, pull_check.patch_module)
    when_imported(tokenize_render.TARGET_MODULE, tokenize_render.patch_module)
    if spin_ms > 0:
        when_imported(idle_wait.SPIN_MODULE, lambda m: idle_wait.patch_spin_module(
            m, spin_ms, nap_us if nap_us >= 0 else idle_wait.default_nap_us()))
