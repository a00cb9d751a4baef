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
import time
from types import ModuleType
from typing import Any

from kvagent_server.router.reuse.transfer import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, READ_BY_KEY
from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

logger = logging.getLogger("vllm.kvagent")

TARGET_MODULE = "vllm.v1.core.sched.scheduler"


def patch_module(module: ModuleType) -> bool:
    """Wrap `Scheduler.__init__` to set `recompute_kv_load_failures` when a connector exists."""
    cls = module.Scheduler
    original = cls.__init__
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "connector", None) is not None and not self.recompute_kv_load_failures:
            self.recompute_kv_load_failures = True
            logger.info("kvagent: kv_load_failure_policy set to 'recompute'")

    mark_wrapped(__init__)
    cls.__init__ = __init__
    return True


PULL_SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"


def already_pulled(params: dict[str, Any] | None) -> bool:
    """True for a P-side request whose one pull from D was already attempted."""
    return params is not None and bool(params.get(DO_REMOTE_DECODE)) and bool(
        params.get("_remote_blocks_processed"))


def read_too_late(params: dict[str, Any] | None, now: float) -> bool:
    """True for a D-side pull whose P lease has (nearly) run out.

    P keeps a finished prefill's blocks only for its lease (`kv_lease_duration`, renewed
    by D's heartbeats once D's engine knows the request). A decode node stalled before it
    saw the request (stopped, swapped out) would read blocks P already freed and reused:
    wrong KV, logged by P as "Potentially invalid KV blocks". Such a request computes its
    prompt locally instead.
    """
    if params is None or not params.get(DO_REMOTE_PREFILL):
        return False
    read_by = params.get(READ_BY_KEY)
    return isinstance(read_by, int | float) and not isinstance(read_by, bool) and now > read_by


def patch_pull_scheduler(module: ModuleType) -> bool:
    """Never offer D's blocks twice for one P request (the retry would wait forever).

    When a P leg's pull from D fails or is declined (an expired handle), the scheduler
    (policy "recompute") puts the request back to WAITING with nothing computed. On the
    retry, `NixlPullConnectorScheduler.get_num_new_matched_tokens` again reports D's
    tokens as loadable asynchronously, but `update_state_after_alloc` skips requests whose
    blocks were already processed, so no read is ever started and the request stays in
    WAITING_FOR_REMOTE_KVS forever (observed: P leg hung; vLLM 0.32.0). After the first
    attempt, report no remote tokens: the retry recomputes.
    """
    cls = module.NixlPullConnectorScheduler
    original = cls.get_num_new_matched_tokens
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        params = getattr(request, "kv_transfer_params", None)
        if already_pulled(params):
            return 0, False
        if params is not None and read_too_late(params, time.time()):
            logger.warning("kvagent: request %s reached the decode node after P's lease; "
                           "computing its prompt locally", request.request_id)
            params[DO_REMOTE_PREFILL] = False
        return original(self, request, num_computed_tokens)

    mark_wrapped(get_num_new_matched_tokens)
    cls.get_num_new_matched_tokens = get_num_new_matched_tokens
    return True
