"""Decode-side retention: every retained sequence expires, and the router can free one early.

**The leak (vLLM 0.32.0, found by the soak run).** With `bidirectional_kv_xfer`, a decode
node keeps the blocks of every finished request that carries `kv_transfer_params` for
`decoder_kv_blocks_ttl` seconds. The scheduler stamps the deadline, but the worker only
honours deadlines of requests that went through `_reqs_in_batch`, which
`update_state_after_alloc` fills for P/D requests only (`do_remote_decode`, or
`do_remote_prefill`). A request sent to D with `{"do_remote_prefill": false}` — kvagent's
`d_direct` path, which lets D compute a small delta itself — is retained and *never*
expires: its blocks stay pinned until the engine restarts, D's KV cache fills, and new
decode legs wait for memory forever. A later pull of such a handle logs `Potentially
invalid KV blocks for unrecognized request` (the blocks were still pinned, so the data was
right) and does not free them either. Fix: a retained decode-side request joins
`_reqs_in_batch` when it finishes, so its deadline reaches the worker like any other.

**Early release.** A handle the router will never offer again (superseded by a `d_direct`
turn, or evicted to keep D's retention under budget) should not pin memory until its TTL.
The router names such requests under `kv_transfer_params["kvagent_release"]` of a later
request to the same decode node; when that request finishes, the scheduler moves their
deadline to now, and the worker frees them on its next step. Only requests this scheduler
itself retained (and whose deadline has not passed) are released: a running request or
an unknown id is ignored, so a wrong id can never free blocks that are in use. A request
whose `kv_transfer_params` hold nothing but `kvagent_release` is a pure release and is not
retained itself.

**A pure release acts as soon as the scheduler sees it.** When retained blocks fill D's
KV cache, no new request can be allocated, so a release carried by a request that must
first run would wait for the TTL to free the very blocks it names (seen with a bounded KV
cache: a turn waited 480 s). So a pure release (what the router's retention guard sends)
frees its ids as the scheduler adds the request (the connector's `on_new_request`, before
any queue or allocation: a waiting request ahead of it could otherwise hold it back), and
the worker frees them on the next step, scheduled tokens or not. A release riding on a real request (a `d_direct` turn
naming the handle it supersedes) still waits for that request to finish: the request
reuses those very blocks through D's prefix cache.

**A node that pulls as P and decodes as D (`kvagent_retain`).** On symmetric nodes
(`kv_both`, the `replicas` topology) a session that moves to another node takes its KV
along: the new node's request carries a P leg's pull params (`do_remote_decode` with the
holder's `remote_*`), which vLLM's pull scheduler honours whatever the node's role, then
decodes the whole answer. vLLM would finish it as a P request: its blocks leased for
`kv_lease_duration` to a decode node that never comes, then freed while the router's
handle still names them (a later pull would read reused blocks). With `kvagent_retain`
in its params, the request is finished as a decode node's instead (`do_remote_decode`
cleared once its pull is scheduled): retained for `decoder_kv_blocks_ttl`, releasable,
with the params a later pull or release names.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from types import ModuleType
from typing import Any

# The router's transfer vocabulary: one definition of each key and of the release bound.
from kvagent_server.router.reuse.transfer import (
    DO_REMOTE_DECODE,
    MAX_RELEASES_PER_REQUEST,
    RELEASE_KEY,
    RETAIN_KEY,
)
from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

logger = logging.getLogger("vllm.kvagent")

TARGET_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"



def release_ids(params: dict[str, Any] | None) -> list[str]:
    """The request ids named under `RELEASE_KEY` (strings only, de-duplicated, bounded)."""
    if not params:
        return []
    raw = params.get(RELEASE_KEY)
    if not isinstance(raw, list):
        return []
    seen: dict[str, None] = {}
    for rid in raw[:MAX_RELEASES_PER_REQUEST]:
        if isinstance(rid, str) and rid:
            seen[rid] = None
    return list(seen)


def release_only(params: dict[str, Any] | None) -> bool:
    """A request that exists only to carry releases: its own blocks are not retained."""
    return params is not None and set(params) == {RELEASE_KEY}


def retain_as_decode(params: dict[str, Any] | None) -> None:
    """A request that pulled as P and decoded (`RETAIN_KEY`) finishes as a decode node's:
    clear `do_remote_decode` (in place) once its pull is behind it."""
    if params and params.get(RETAIN_KEY) and params.get(DO_REMOTE_DECODE):
        params[DO_REMOTE_DECODE] = False


def is_decode_retention(delay_free: bool, out: dict[str, Any] | None) -> bool:
    """True when `request_finished` kept a decode-side request's blocks for a later reader."""
    return bool(delay_free and out and out.get(DO_REMOTE_DECODE))


class Retained:
    """Request ids this decode scheduler retained, with their deadlines (perf_counter)."""

    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}

    def add(self, request_id: str, deadline: float) -> None:
        self._deadlines[request_id] = deadline

    def take(self, ids: Iterable[str], now: float) -> list[str]:
        """Forget and return those of `ids` still retained (deadline not passed)."""
        self.prune(now)
        return [rid for rid in ids if self._deadlines.pop(rid, None) is not None]

    def prune(self, now: float) -> None:
        expired = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
        for rid in expired:
            del self._deadlines[rid]

    def __len__(self) -> int:
        return len(self._deadlines)


#: The tag of the wrapper that applies a pure release on sight (`wrapped`).
EARLY_TAG = "retention-early-release"


def release_now(scheduler: Any, ids: Iterable[str], now: float) -> list[str]:
    """Move the deadline of those of `ids` this scheduler retained to `now` (the worker
    frees them on its next step); the ids released."""
    retained: Retained = scheduler.__dict__.setdefault("_kvagent_retained", Retained())
    released = retained.take(ids, now)
    for rid in released:
        scheduler._reqs_need_send[rid] = now
        logger.debug("kvagent: releasing retained blocks of %s early", rid)
    return released


def patch_module(module: ModuleType) -> bool:
    """Wrap `NixlPullConnectorScheduler.request_finished`, and `on_new_request` for pure
    releases (see the module docstring)."""
    cls = module.NixlPullConnectorScheduler
    added = cls.on_new_request
    if not is_wrapped(added, EARLY_TAG):
        @functools.wraps(added)
        def on_new_request(self: Any, request: Any) -> Any:
            params = getattr(request, "kv_transfer_params", None)
            if release_only(params) and getattr(self, "is_bidirectional_kv_xfer_enabled",
                                                False):
                release_now(self, release_ids(params), time.perf_counter())
            return added(self, request)

        cls.on_new_request = mark_wrapped(on_new_request, EARLY_TAG)
    original = cls.request_finished
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        params = getattr(request, "kv_transfer_params", None)
        releases = release_ids(params)
        retain_as_decode(params)
        delay_free, out = original(self, request, block_ids)
        if not getattr(self, "is_bidirectional_kv_xfer_enabled", False):
            return delay_free, out
        retained: Retained = self.__dict__.setdefault("_kvagent_retained", Retained())
        now = time.perf_counter()
        if is_decode_retention(delay_free, out) and release_only(
                getattr(request, "kv_transfer_params", None)):
            self._reqs_need_send.pop(request.request_id, None)
            delay_free, out = False, None  # freed now, like a request without params
        if is_decode_retention(delay_free, out):
            # The deadline original() stamped, so the worker sees it (the leak fix).
            self._reqs_in_batch.add(request.request_id)
            deadline = self._reqs_need_send.get(request.request_id, now)
            retained.add(request.request_id, deadline)
        release_now(self, (r for r in releases if r != request.request_id), now)
        return delay_free, out

    mark_wrapped(request_finished)
    cls.request_finished = request_finished
    return True
