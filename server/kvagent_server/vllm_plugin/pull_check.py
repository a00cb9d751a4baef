"""P pulls only the blocks its own prompt repeats: the last check before D's KV is used.

The router offers D's blocks for the first N tokens of a prompt (`remote_num_tokens`,
`remote_block_ids`) with a digest of each block's tokens (`transfer.EXPECT_KEY`). P has
the prompt's real token ids only after its own render, which is exactly where this check
runs: `get_num_new_matched_tokens` of the NIXL pull scheduler, before any block is read.
The offer is cut to the leading whole blocks whose digests match (and to P's block size,
and to leave one prompt token to compute); with none left, P takes no remote tokens but
still tells D it is done with them, so D frees them. P's returned params say how many
tokens it verified (`transfer.VERIFIED_KEY`), which also tells the router that this node
checks what it pulls: only then may the router offer blocks it did not verify itself.

This makes a pull correct whatever the router believed about the prompt, as a `d_direct`
turn already is (D's prefix cache matches the real tokens).
"""

from __future__ import annotations

import functools
import logging
import math
from types import ModuleType
from typing import Any

from kvagent_server.router.reuse.transfer import (
    EXPECT_KEY,
    REMOTE_BLOCK_IDS,
    REMOTE_NUM_TOKENS,
    VERIFIED_KEY,
    verified_tokens,
)
from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

logger = logging.getLogger("vllm.kvagent")

TARGET_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
TAG = "pull_check"
#: Set once a request's offer was checked: the scheduler may ask again (no memory yet).
_CHECKED = "_kvagent_checked"


def _cut_groups(block_ids: Any, n_blocks: int) -> Any:
    """`remote_block_ids` (flat, or one list per KV cache group) cut to `n_blocks`."""
    if isinstance(block_ids, list) and block_ids and all(
            isinstance(g, list | tuple) for g in block_ids):
        return [list(g)[:n_blocks] for g in block_ids]
    if isinstance(block_ids, list):
        return block_ids[:n_blocks]
    return block_ids


def check_offer(params: dict[str, Any], prompt_ids: list[int] | None,
                local_block_size: int) -> int | None:
    """Cut `params`' offer (in place) to what `prompt_ids` verify; the verified token
    count, or None when the params carry no digests (an offer the router verified with
    `/tokenize` under an older router) or were already checked."""
    if EXPECT_KEY not in params or params.get(_CHECKED):
        return None
    params[_CHECKED] = True
    expected = params.pop(EXPECT_KEY)
    offered = params.get(REMOTE_NUM_TOKENS)
    offered = offered if isinstance(offered, int) and not isinstance(offered, bool) else 0
    ids = prompt_ids or []
    ok = min(verified_tokens(ids, expected), offered, max(0, len(ids) - 1))
    remote_size = expected.get("block_size") if isinstance(expected, dict) else None
    if isinstance(remote_size, int) and remote_size > 0:
        align = math.lcm(remote_size, max(1, local_block_size))
        ok = ok // align * align
        if ok < offered:
            if ok > 0:  # D still frees every block of the request once P is done
                params[REMOTE_BLOCK_IDS] = _cut_groups(params.get(REMOTE_BLOCK_IDS),
                                                       ok // remote_size)
            params[REMOTE_NUM_TOKENS] = ok
    else:
        ok = 0
        params[REMOTE_NUM_TOKENS] = 0
    params[VERIFIED_KEY] = ok
    return ok


def patch_module(module: ModuleType) -> bool:
    """Wrap `NixlPullConnectorScheduler.get_num_new_matched_tokens` (check the offer first)
    and `request_finished` (echo the verified count in P's params)."""
    cls = module.NixlPullConnectorScheduler
    matched, finished = cls.get_num_new_matched_tokens, cls.request_finished
    if is_wrapped(matched, TAG):
        return False

    @functools.wraps(matched)
    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict):
            offered = params.get(REMOTE_NUM_TOKENS)
            ok = check_offer(params, getattr(request, "prompt_token_ids", None),
                             int(getattr(self, "block_size", 1) or 1))
            if ok is not None and offered != ok:
                logger.info("kvagent: request %s: the prompt repeats %d of the %s offered "
                            "tokens; pulling only those", request.request_id, ok, offered)
        return matched(self, request, num_computed_tokens)

    @functools.wraps(finished)
    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        delay, out = finished(self, request, block_ids)
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(out, dict) and isinstance(params, dict) and VERIFIED_KEY in params:
            out[VERIFIED_KEY] = params[VERIFIED_KEY]
        return delay, out

    cls.get_num_new_matched_tokens = mark_wrapped(get_num_new_matched_tokens, TAG)
    cls.request_finished = mark_wrapped(request_finished, TAG)
    return True
