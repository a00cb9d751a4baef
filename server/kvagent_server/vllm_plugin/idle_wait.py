"""Let an engine that merely holds KV blocks for a remote reader sleep between polls.

A finished request whose blocks wait for a remote reader (P's blocks until D has read them,
D's retained blocks until P reads them or the TTL ends) stays in the scheduler, so
`Scheduler.has_requests()` is true and vLLM's engine loop steps every millisecond with an
empty batch, only so the connector can notice the remote read or the expiry. Each step is a
round trip to the worker, whose reader in `shm_broadcast.SpinCondition` busy-loops
(`sched_yield`) for one second after every message: one core per such node, for up to the
TTL after every turn.

Two patches, both bounded and with no effect on a busy engine:

- `EngineCoreProc._process_engine_step`: after a step that executed nothing, if the scheduler
  has no running or waiting request (only finished ones awaiting the connector), wait up to
  `idle_poll_ms` for new input instead of 1 ms. New requests end the wait at once; block
  frees and lease expiries are noticed up to `idle_poll_ms` later.
- `SpinCondition.__init__`: readers busy-loop for at most `spin_ms` after a message (vLLM:
  1 s) before sleeping in zmq poll, so the spacing above actually lets workers sleep.

With `nap_us` > 0 (CPU engines' default), a reader inside that window sleeps `nap_us`
between its checks (`SpinCondition.wait`) instead of calling `sched_yield`: it still sees
a message within about `nap_us`, woken by its own timer rather than by zmq, but leaves its
core to the threads that share it (the worker that computes, the API server, NIXL's).
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from types import ModuleType
from typing import Any

from kvagent_server.vllm_plugin.env import CPU_SPIN_NAP_US
from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

logger = logging.getLogger("vllm.kvagent")

TARGET_MODULE = "vllm.v1.engine.core"
SPIN_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def only_connector_work(scheduler: Any) -> bool:
    """True if the scheduler's only work is finished requests awaiting KV-connector cleanup."""
    return bool(scheduler.has_requests()) and not scheduler.has_unfinished_requests()


def wait_for_input(q: queue.Queue[Any], timeout_s: float) -> None:
    """Block until `q` has an item or `timeout_s` passed, without taking the item."""
    with q.not_empty:
        if not q._qsize():
            q.not_empty.wait(timeout_s)


def patch_module(module: ModuleType, idle_poll_ms: int) -> bool:
    """Patch `EngineCoreProc._process_engine_step` in `vllm.v1.engine.core`."""
    cls = module.EngineCoreProc
    original = cls._process_engine_step
    if is_wrapped(original):
        return False
    timeout_s = idle_poll_ms / 1000.0

    @functools.wraps(original)
    def _process_engine_step(self: Any) -> bool:
        executed = original(self)
        if (
            not executed
            and not getattr(self, "batch_queue", None)
            and isinstance(getattr(self, "input_queue", None), queue.Queue)
            and only_connector_work(self.scheduler)
        ):
            wait_for_input(self.input_queue, timeout_s)
        return bool(executed)

    mark_wrapped(_process_engine_step)
    cls._process_engine_step = _process_engine_step
    logger.info("kvagent: engine idle poll set to %d ms while only KV leases are held",
                idle_poll_ms)
    return True


def patch_spin_module(module: ModuleType, spin_ms: int, nap_us: int = 0) -> bool:
    """Cap `SpinCondition`'s reader busy-loop window at `spin_ms`; nap `nap_us` inside it."""
    cls = module.SpinCondition
    original = cls.__init__
    if is_wrapped(original):
        return False
    cap_s = spin_ms / 1000.0
    if nap_us > 0:
        cls.wait = napping_wait(cls.wait, nap_us / 1_000_000)
        logger.info("kvagent: shared-memory readers nap %d us between checks for %d ms "
                    "after a message", nap_us, spin_ms)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and self.busy_loop_s > cap_s:
            self.busy_loop_s = cap_s

    mark_wrapped(__init__)
    cls.__init__ = __init__
    return True


def default_nap_us() -> int:
    """`CPU_SPIN_NAP_US` on a CPU engine, else 0 (vLLM's `sched_yield`): measured on CPU
    only, where the readers share a core or two with everything else."""
    from vllm.platforms import current_platform

    return CPU_SPIN_NAP_US if current_platform.is_cpu() else 0


def napping_wait(original: Any, nap_s: float) -> Any:
    """`SpinCondition.wait` that sleeps `nap_s` instead of yielding inside the busy window."""

    @functools.wraps(original)
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(nap_s)
        else:
            original(self, timeout_ms)

    mark_wrapped(wait)
    return wait
