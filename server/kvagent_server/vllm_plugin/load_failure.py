"""Recompute, never fail, when a KV load from the other node fails or is declined.

vLLM's `kv_load_failure_policy` defaults to "fail": a P leg that presents a D handle whose
blocks expired (P declines the read near D's deadline) or whose transfer failed ends in
HTTP 500. kvagent promises that a stale cache location never fails a request, so the
plugin switches schedulers with a KV connector to "recompute" (the tokens that could not
be loaded are computed locally), whatever `--kv-transfer-config` said.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.kvagent")

TARGET_MODULE = "vllm.v1.core.sched.scheduler"


def patch_module(module: ModuleType) -> bool:
    """Wrap `Scheduler.__init__` to set `recompute_kv_load_failures` when a connector exists."""
    cls = module.Scheduler
    original = cls.__init__
    if getattr(original, "__kvagent_wrapped__", False):
        return False

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "connector", None) is not None and not self.recompute_kv_load_failures:
            self.recompute_kv_load_failures = True
            logger.info("kvagent: kv_load_failure_policy set to 'recompute'")

    __init__.__kvagent_wrapped__ = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True
