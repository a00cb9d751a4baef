"""vLLM's prefix-cache block hashes, computed by the router from a prompt's token ids.

A node's KV events name blocks by these hashes, so the router can only match a prompt
against what a node holds by hashing the prompt exactly as the node's scheduler does
(vLLM 0.32, `vllm/v1/core/kv_cache_utils.py` and `vllm/utils/hashing.py`):

- The chain starts from a root: the hash of the seed string, where the seed is the
  node's `PYTHONHASHSEED` when set, else the fixed `"vllm-none-hash"` for the sha256
  algorithms (xxhash ones draw a random seed per process: nothing to match then).
- Block i (full blocks only) hashes the triple `(parent, token ids of the block as a tuple,
  extra keys)` where parent is block i-1's hash (the root for block 0) and the extra keys
  are None or a tuple of tagged keys. The only one the router can know is the request's
  `cache_salt`, as `("cache_salt", salt)` on block 0 only. LoRA adapters, multimodal
  inputs and prompt embeddings add keys the router does not model: such prompts match
  nothing (placement falls back to load).
- `sha256`/`xxhash` hash the pickle (highest protocol) of that value; the `_cbor`
  variants hash its canonical CBOR. xxhash is the 128-bit XXH3 digest.
- Events carry a block hash as the low 64 bits of the digest read big-endian
  (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by default) or as the raw digest;
  `event_key` folds both to the same int.

tests/router/kv/test_kv_events_vllm.py checks the result against a real node's events.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from kvagent_server.common.types import HashAlgo

#: The seed vLLM uses for the sha256 algorithms when PYTHONHASHSEED is unset.
DEFAULT_SEED = "vllm-none-hash"
_LOW64 = (1 << 64) - 1


class HashUnavailable(ValueError):
    """The router cannot reproduce a node's block hashes (the message says why)."""


def _pickle_bytes(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_bytes(value: Any) -> bytes:
    try:
        import cbor2
    except ImportError as exc:  # pragma: no cover - cbor2 ships with vLLM
        raise HashUnavailable("the _cbor hash algorithms need the cbor2 package") from exc
    return cbor2.dumps(value, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as exc:
        raise HashUnavailable("the xxhash algorithms need the xxhash package") from exc
    return xxhash.xxh3_128_digest(data)


def _digest_fn(algo: HashAlgo) -> Callable[[Any], bytes]:
    serialize = _cbor_bytes if algo.endswith("_cbor") else _pickle_bytes
    digest = _xxh3_128 if algo.startswith("xxhash") else (
        lambda data: hashlib.sha256(data).digest())
    return lambda value: digest(serialize(value))


def event_key(block_hash: bytes | int) -> int:
    """A block hash as it appears in events (int or raw digest), as one comparable int."""
    if isinstance(block_hash, int):
        return block_hash & _LOW64
    return int.from_bytes(block_hash, "big") & _LOW64


class BlockHasher:
    """Chained block hashes of one hash configuration (algorithm and seed)."""

    def __init__(self, algo: HashAlgo = "sha256", seed: str | None = None) -> None:
        if algo not in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
            raise HashUnavailable(f"unknown prefix-caching hash algorithm {algo!r}")
        if seed is None and algo.startswith("xxhash"):
            raise HashUnavailable(
                f"{algo} without PYTHONHASHSEED: vLLM seeds the chain randomly per process, "
                "so no one else can compute the node's block hashes (set kv_tiers.hash_seed)")
        self.algo = algo
        self.seed = DEFAULT_SEED if seed is None else seed
        self._digest = _digest_fn(algo)
        if algo.startswith("xxhash"):
            _xxh3_128(b"")  # fail now, not at the first prompt
        self.root = self._digest(self.seed)

    def hashes(self, token_ids: Sequence[int], block_size: int, *,
               cache_salt: str | None = None) -> list[bytes]:
        """The digests of every full block of `token_ids`, in order."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        out: list[bytes] = []
        parent = self.root
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = self._digest((parent, tuple(token_ids[start:start + block_size]), extra))
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], block_size: int, *,
             cache_salt: str | None = None) -> list[int]:
        """`hashes` in the form the KV index stores (see `event_key`)."""
        return [event_key(h) for h in self.hashes(token_ids, block_size,
                                                  cache_salt=cache_salt)]
