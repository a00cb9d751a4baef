"""Keep a CPU worker's main thread on the cores the node was given.

On CPU, vLLM's NIXL worker (`NixlBaseConnectorWorker.__init__`) calls
`os.sched_setaffinity(0, [last core of each NUMA node])` to "reserve a core for KV
transfer". `0` is the calling thread, which is the worker's main thread: the OpenMP master
thread that runs the model. So every P and D node's compute thread ends up on the *same*
last core, whatever `VLLM_CPU_OMP_THREADS_BIND` said (on 2 cores: P's forward pass runs on
D's core). The threads the connector starts meanwhile (NIXL's progress thread, UCX's,
the handshake listener) inherit that last core too: on P, they ran on D's core. The patch
restores the main thread's affinity right after the connector is built, and gives those
threads the same, so a node whose every thread the bundle pinned to its cores
(`pin_processes`) stays there.
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
        existing = _thread_ids()
        original(self, *args, **kwargs)
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            moved = 0
            for tid in _thread_ids() - existing:
                try:
                    if os.sched_getaffinity(tid) == after:
                        os.sched_setaffinity(tid, before)
                        moved += 1
                except OSError:  # the thread ended meanwhile
                    continue
            logger.info("kvagent: restored CPU affinity %s of the worker's main thread and of "
                        "%d thread(s) the connector started (NIXL set %s)", sorted(before),
                        moved, sorted(after))

    mark_wrapped(__init__)
    cls.__init__ = __init__
    return True


def _thread_ids() -> set[int]:
    """The ids of this process's threads (Linux: /proc/self/task); empty elsewhere."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()
