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
`kvagent_retain` (the plugin's) makes a node that pulled a prefix as P does also decode
the answer and keep the finished sequence as a decode node does (`d_pull`: a session
moving between replicas takes its KV along). `kv_load_tiers` (vLLM's offloading
connector's) is `[]` on every leg that pulls over NIXL: no tier reads for a prompt NIXL loads.

How the P leg consumes the rewritten params of a reuse (vLLM 0.32 NixlConnector, pull
mode): `do_remote_decode=True` with `remote_block_ids`/`remote_engine_id`/
`remote_request_id`/`remote_host`/`remote_port` makes P treat
`min(remote_num_tokens, prompt) - cached_locally` tokens as external; P then END-trims the
remote block list to the blocks it still needs. So the list must hold exactly the reused
prefix's blocks: an untruncated list would pair P's blocks with D's *last* blocks.
`do_remote_prefill` must stay False: on P it means "pull the whole prompt", which would
mark uncomputed tokens as computed.
"""

from __future__ import annotations

import copy
import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

#: The request and response fields that carry transfers between nodes: only the router
#: sets them on a request (a client's are refused), and it strips them from every answer.
INTERNAL_FIELDS: Final = ("kv_transfer_params", "ec_transfer_params")

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

#: In a leg's params that pull a prefix as a P leg does (`do_remote_decode` with a
#: holder's `remote_*`): the node decodes the answer itself and, when it finishes, keeps
#: the sequence for the next turn as a decode node does (decode TTL, releasable, params
#: a later pull can use) instead of leasing it to a decode node that never comes
#: (kvagent's vLLM plugin, `vllm_plugin.retention`).
RETAIN_KEY: Final = "kvagent_retain"

#: vLLM's offloading connector (a node with KV tiers) looks a request's prompt up in the
#: secondary tiers this list names (disk, shared) and copies what it finds into its host
#: tier; an empty list names none. A leg that pulls its prompt over NIXL gets `[]`: NIXL
#: is the connector that loads it (the multi-connector takes the first with a hit), so a
#: disk read there is wasted, and the leg waits while it runs. The host tier is still
#: looked up (in memory, no read). Nodes without tiers ignore the key.
LOAD_TIERS_KEY: Final = "kv_load_tiers"

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


def answered_verified(params: Mapping[str, Any]) -> int | None:
    """The tokens a P node's answer says it verified (None: it did not check its pull)."""
    value = params.get(VERIFIED_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def pulled_over_nixl(params: dict[str, Any]) -> dict[str, Any]:
    """Params (a copy) of a leg that pulls its prompt over NIXL: no tier reads for it
    (`LOAD_TIERS_KEY`)."""
    return {**params, LOAD_TIERS_KEY: []}


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


# ------------------------------------------------------------------ a handle's blocks


class Handle(Protocol):
    """The blocks a decode node retained, as a `store.handle.Handle` records them (a
    protocol: this module imports nothing of ours, the vLLM plugin loads it)."""

    @property
    def kv_transfer_params(self) -> dict[str, Any]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def block_size(self) -> int: ...


def _block_groups(params: dict[str, Any]) -> tuple[list[list[int]], bool] | None:
    """D's `remote_block_ids` as per-group lists (and whether it came flat), or None."""
    groups = params.get(REMOTE_BLOCK_IDS)
    if not isinstance(groups, list) or not groups:
        return None
    if all(isinstance(b, int) and not isinstance(b, bool) for b in groups):
        return [list(groups)], True  # older vLLM: one flat list for one group
    if all(isinstance(g, list | tuple) for g in groups) and all(
            isinstance(b, int) and not isinstance(b, bool) for g in groups for b in g):
        return [list(g) for g in groups], False
    return None


def retained_tokens(handle: Handle) -> int | None:
    """How many leading tokens of `handle.token_ids` D can hand over; None if unusable.

    Bounded by D's own `remote_num_tokens` (the last sampled token has no KV yet) and by
    the blocks it exported. A group with fewer blocks than the sequence needs (sliding
    window tail, Mamba state) does not map token positions to blocks from position 0,
    so the handle is not reused at all rather than reused wrongly.
    """
    params = handle.kv_transfer_params
    n = params.get(REMOTE_NUM_TOKENS)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    if params.get(DO_REMOTE_PREFILL):
        return None  # blocks leased to a decode node (a P answer), not retained for turns
    parsed = _block_groups(params)
    if parsed is None:
        return None
    needed = math.ceil(n / handle.block_size)
    if any(len(group) < needed for group in parsed[0]):
        return None
    return min(n, len(handle.token_ids))


def reuse_transfer_params(handle: Handle, reuse_tokens: int) -> dict[str, Any]:
    """D's params rewritten so P pulls exactly the first `reuse_tokens` tokens' blocks.

    Every group's block list is cut to `reuse_tokens // block_size` blocks (P end-trims
    it to what it lacks locally), `remote_num_tokens` becomes `reuse_tokens`, and the
    flags say "P node, pull from D": do_remote_decode=True, do_remote_prefill=False.
    The blocks' token digests go along (`transfer.EXPECT_KEY`): P pulls only the leading
    blocks its own prompt repeats, whether or not the router tokenized the prompt.
    """
    retained = retained_tokens(handle)
    if retained is None:
        raise ValueError("the handle's KV layout cannot be reused")
    if reuse_tokens <= 0 or reuse_tokens % handle.block_size:
        raise ValueError(f"reuse_tokens={reuse_tokens} is not a positive multiple of "
                         f"block_size={handle.block_size}")
    if reuse_tokens > retained:
        raise ValueError(f"reuse_tokens={reuse_tokens} exceeds the {retained} retained tokens")
    params = copy.deepcopy(handle.kv_transfer_params)
    parsed = _block_groups(params)
    assert parsed is not None  # retained_tokens checked the layout
    groups, flat = parsed
    n_blocks = reuse_tokens // handle.block_size
    cut = [group[:n_blocks] for group in groups]
    params[REMOTE_BLOCK_IDS] = cut[0] if flat else cut
    params[REMOTE_NUM_TOKENS] = reuse_tokens
    params[DO_REMOTE_DECODE] = True
    params[DO_REMOTE_PREFILL] = False
    params[EXPECT_KEY] = expect(handle.token_ids[:reuse_tokens], handle.block_size)
    return pulled_over_nixl(params)


def shifted_blocks(params: dict[str, Any]) -> dict[str, Any]:
    """Test-only negative control: shift the block slots by half their number, so slot i
    gets block i-k (k = n//2; the first block fills the slots before it, the last k blocks
    are dropped). P then reads real KV of this prompt at the wrong places: wrong KV that
    no identity check can see.

    Keys carry their positions (RoPE is applied before caching) and every reused token
    lies before the new ones, so what P attends to is the *multiset* of blocks: a rotation
    changes nothing, and a shift by one slot changes one block in n, which a random model's
    greedy answer missed in about one turn in four. Half of the blocks wrong is not missed.
    """
    out = copy.deepcopy(params)
    parsed = _block_groups(out)
    if parsed is None:
        return out
    groups, flat = parsed
    shifted = []
    for g in groups:
        k = max(1, len(g) // 2)
        shifted.append([g[max(0, i - k)] for i in range(len(g))])
    out[REMOTE_BLOCK_IDS] = shifted[0] if flat else shifted
    return out


def pull_and_retain_params(handle: Handle, reuse_tokens: int) -> dict[str, Any]:
    """A decode leg's params that pull the first `reuse_tokens` tokens' blocks from the
    node holding `handle` (as `reuse_transfer_params`, digests included), then decode and
    retain the finished sequence on the pulling node (`RETAIN_KEY`). The holder frees its
    blocks once read, as it does for a P pull."""
    return {**reuse_transfer_params(handle, reuse_tokens), RETAIN_KEY: True}


def release_transfer_params(handle: Handle) -> dict[str, Any]:
    """P leg params that compute the whole prompt AND tell D to free the handle's blocks.

    With `remote_num_tokens=0` P takes no external tokens but still sends D the
    "done" notification for its blocks, so a claimed handle that is not reused does
    not pin D's memory until the TTL. Use only while D is healthy and of the handle's
    epoch (P must reach D's side channel).
    """
    params = copy.deepcopy(handle.kv_transfer_params)
    params[REMOTE_NUM_TOKENS] = 0
    params[DO_REMOTE_DECODE] = True
    params[DO_REMOTE_PREFILL] = False
    return params
