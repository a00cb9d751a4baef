"""The `kv_transfer_params` vocabulary: one home for every key and shape the router sends.

vLLM's NIXL connector reads these keys on both legs. A P leg with `do_remote_decode=True`
keeps P's blocks for D; with D's `remote_*` fields as well, P first pulls
`remote_num_tokens` tokens of KV from D (bidirectional transfer). A D leg with
`do_remote_prefill=True` pulls P's blocks; with both flags False, D computes the prompt
itself from its own prefix cache (`d_direct`). `kvagent_release` is kvagent's own key,
honoured by the vLLM plugin (`vllm_plugin.retention`): the decode node frees the retained
sequences it names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

DO_REMOTE_DECODE: Final = "do_remote_decode"
DO_REMOTE_PREFILL: Final = "do_remote_prefill"
REMOTE_BLOCK_IDS: Final = "remote_block_ids"
REMOTE_ENGINE_ID: Final = "remote_engine_id"
REMOTE_REQUEST_ID: Final = "remote_request_id"
REMOTE_HOST: Final = "remote_host"
REMOTE_PORT: Final = "remote_port"
REMOTE_NUM_TOKENS: Final = "remote_num_tokens"

#: Unix time by which D must start reading P's blocks; later, D computes the prompt
#: itself (kvagent's vLLM plugin, `load_failure.read_too_late`).
READ_BY_KEY: Final = "kvagent_read_by"

#: Request ids of retained decode-side sequences to free now (kvagent's vLLM plugin).
RELEASE_KEY: Final = "kvagent_release"
#: The plugin honours at most this many ids per request: a bound on what one body can do.
MAX_RELEASES_PER_REQUEST: Final = 256


def fresh() -> dict[str, Any]:
    """P leg params for a prompt computed from scratch (P keeps its blocks for D)."""
    return {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False}


def d_direct() -> dict[str, Any]:
    """D leg params when P is skipped: D computes from its own prefix cache, and (with
    the plugin) still retains the finished sequence for the next turn."""
    return {DO_REMOTE_PREFILL: False, DO_REMOTE_DECODE: False}


def with_read_by(params: dict[str, Any], read_by: float) -> dict[str, Any]:
    """D leg params (a copy) that D may act on only until `read_by` (P's lease)."""
    return {**params, READ_BY_KEY: read_by}


def offers_remote_blocks(params: dict[str, Any]) -> bool:
    """True when a P leg's params name blocks on a remote node (a pull or a release)."""
    return bool(params.get(REMOTE_BLOCK_IDS))


def with_release(params: dict[str, Any], ids: Iterable[str]) -> dict[str, Any]:
    """`params` plus the ids to release (a copy; bounded as the plugin bounds it)."""
    wanted = [i for i in ids if i][:MAX_RELEASES_PER_REQUEST]
    if not wanted:
        return params
    return {**params, RELEASE_KEY: wanted}
