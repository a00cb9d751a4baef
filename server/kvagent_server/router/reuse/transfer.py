"""The `kv_transfer_params` vocabulary: one home for every key and shape the router sends.

vLLM's NIXL connector reads these keys on both legs. A P leg with `do_remote_decode=True`
keeps P's blocks for D; with D's `remote_*` fields as well, P first pulls
`remote_num_tokens` tokens of KV from D (bidirectional transfer). A D leg with
`do_remote_prefill=True` pulls P's blocks; with both flags False, D computes the prompt
itself from its own prefix cache (`d_direct`); with `prompt_token_ids` (vLLM's key, chat
only), D takes P's prompt ids instead of rendering the messages again; with
`kvagent_first_token` (the plugin's), D emits the token P sampled as its first and
continues from it. `kvagent_release`
is kvagent's own key, honoured by the vLLM plugin (`vllm_plugin.retention`): the decode
node frees the retained sequences it names. `kvagent_expect` (also the plugin's) names, per offered block, a
digest of its tokens: P pulls only the leading blocks its own prompt repeats.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
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

#: In a D leg's params (vLLM's own key, chat requests): the prompt token ids P computed.
#: D feeds them to its engine instead of rendering and tokenizing the messages again, so
#: it computes from exactly the tokens whose KV it reads, a few ms sooner. vLLM ignores
#: them, and renders, for messages with media and for `echo`.
PROMPT_IDS_KEY: Final = "prompt_token_ids"

#: In a D leg's params: the one token P sampled (kvagent's vLLM plugin,
#: `vllm_plugin.first_token`). D emits it as soon as P's KV has arrived and computes from
#: it, instead of recomputing the prompt's last token to sample a first token of its own:
#: one step less before the first token and per answer. D ignores it where its own
#: request could not have sampled that token the same way (logprobs, seeds, grammars...).
FIRST_TOKEN_KEY: Final = "kvagent_first_token"

#: Request ids of retained decode-side sequences to free now (kvagent's vLLM plugin).
RELEASE_KEY: Final = "kvagent_release"
#: The plugin honours at most this many ids per request: a bound on what one body can do.
MAX_RELEASES_PER_REQUEST: Final = 256


#: Under this key of a pull's P leg params: `{"block_size": B, "digests": [...]}`, one
#: digest per offered block (`block_digests`). The plugin (`vllm_plugin.pull_check`) pulls
#: only the leading blocks whose tokens P's own prompt repeats, so a plan the router made
#: without `/tokenize` can never put another prompt's KV under this one.
EXPECT_KEY: Final = "kvagent_expect"
#: In P's returned params: how many offered tokens P's prompt verified (and so pulled at
#: most). Its presence also tells the router that this P node checks what it pulls.
VERIFIED_KEY: Final = "kvagent_verified_tokens"
#: Bytes kept of each block's SHA-256 (128 bits: no accidental match in any KV cache).
DIGEST_BYTES: Final = 16


def block_digests(token_ids: Sequence[int], block_size: int) -> list[str]:
    """One hex digest per whole block of `token_ids`, each chained over the blocks before
    it (as vLLM's block hashes are), so block i's digest names the whole prefix up to it."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[str] = []
    prev = b""
    block = struct.Struct(f"<{block_size}q")
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hashlib.sha256(prev + block.pack(*token_ids[start:start + block_size])
                              ).digest()[:DIGEST_BYTES]
        out.append(prev.hex())
    return out


def expect(token_ids: Sequence[int], block_size: int) -> dict[str, Any]:
    """The `EXPECT_KEY` value for a pull of `token_ids` (whole blocks of `block_size`)."""
    return {"block_size": block_size, "digests": block_digests(token_ids, block_size)}


def verified_tokens(prompt_ids: Sequence[int], expected: object) -> int:
    """How many leading tokens of `prompt_ids` the offered blocks' digests verify (whole
    blocks only); 0 for a malformed `expected`."""
    if not isinstance(expected, dict):
        return 0
    size, digests = expected.get("block_size"), expected.get("digests")
    if (not isinstance(size, int) or isinstance(size, bool) or size < 1
            or not isinstance(digests, list)):
        return 0
    n_blocks = min(len(digests), len(prompt_ids) // size)
    mine = block_digests(prompt_ids[:n_blocks * size], size)
    matched = 0
    for got, want in zip(mine, digests, strict=False):
        if got != want:
            break
        matched += 1
    return matched * size


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


def with_prompt_ids(params: dict[str, Any], ids: Sequence[int]) -> dict[str, Any]:
    """D leg params (a copy) that give D P's prompt token ids (`PROMPT_IDS_KEY`)."""
    return {**params, PROMPT_IDS_KEY: list(ids)}


def with_first_token(params: dict[str, Any], token: int) -> dict[str, Any]:
    """D leg params (a copy) that give D the token P sampled (`FIRST_TOKEN_KEY`)."""
    return {**params, FIRST_TOKEN_KEY: token}


def offers_remote_blocks(params: dict[str, Any]) -> bool:
    """True when a P leg's params name blocks on a remote node (a pull or a release)."""
    return bool(params.get(REMOTE_BLOCK_IDS))


def with_release(params: dict[str, Any], ids: Iterable[str]) -> dict[str, Any]:
    """`params` plus the ids to release (a copy; bounded as the plugin bounds it)."""
    wanted = [i for i in ids if i][:MAX_RELEASES_PER_REQUEST]
    if not wanted:
        return params
    return {**params, RELEASE_KEY: wanted}
