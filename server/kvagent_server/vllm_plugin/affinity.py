"""Keep a CPU worker's main thread on the cores the node was given.

On CPU, vLLM's NIXL worker (`NixlBaseConnectorWorker.__init__`) calls
`os.sched_setaffinity(0, [last core of each NUMA node])` to "reserve a core for KV
transfer". `0` is the calling thread, which is the worker's main thread: the OpenMP master
thread that runs the model. So every P and D node's compute thread ends up on the *same*
last core, whatever `VLLM_CPU_OMP_THREADS_BIND` said (on 2 cores: P's forward pass runs on
D's core). The patch restores the main thread's affinity right after the connector is built.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Any

from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

logger = logging.getLogger("vllm.kvagent")

TARGET_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


def patch_module(module: ModuleType) -> bool:
    """Wrap `NixlBaseConnectorWorker.__init__` so it leaves the thread's affinity alone."""
    cls = module.NixlBaseConnectorWorker
    original = cls.__init__
    if is_wrapped(original) or not hasattr(os, "sched_getaffinity"):
        return False

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        before = os.sched_getaffinity(0)
        original(self, *args, **kwargs)
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            logger.info("kvagent: restored worker main-thread CPU affinity %s (NIXL set %s)",
                        sorted(before), sorted(after))

    mark_wrapped(__init__)
    cls.__init__ = __init__
    return True
