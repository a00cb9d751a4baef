"""Give NIXL's UCX progress thread a poll timeout, so an idle node sleeps.

NIXL's Python API builds its agent with `agent_config.pthrDelay = 0` (hard-coded in
`nixl_agent.__init__`, no parameter), so the UCX progress thread calls `poll()` with a zero
timeout in a loop: one full core per idle node. The thread is woken by UCX's event fd when
there is work (the worker is armed before each poll), so the timeout only bounds how long
it sleeps when nothing happens; transfers do not wait for it.

The patch wraps the bindings' `nixlAgent` constructor seen by `nixl_agent.__init__` and
sets `pthrDelay` on the config just before the agent is built.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.kvagent")

# The wheels a `nixl._api` import resolves to (`nixl` is a meta package on PyPI).
API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api", "nixl._api")


class _BindingsWithDelay:
    """Stands in for the `_bindings` module inside `nixl._api`; only `nixlAgent` differs."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._bindings, attr)


def patch_api_module(module: ModuleType, delay_us: int) -> bool:
    """Make every agent `module` (a `nixl*._api`) creates use `pthrDelay=delay_us`."""
    bindings = getattr(module, "nixlBind", None)
    if bindings is None:
        logger.error("kvagent: %s has no nixlBind; NIXL progress thread left spinning",
                     module.__name__)
        return False
    if isinstance(bindings, _BindingsWithDelay):
        return False
    module.nixlBind = _BindingsWithDelay(bindings, delay_us)  # type: ignore[attr-defined]  # ModuleType declares no nixlBind
    logger.info("kvagent: NIXL progress-thread delay set to %d us (%s)", delay_us,
                module.__name__)
    return True
