"""The event decoder and the block hashes against vLLM's own encoder and hash functions
(vLLM installed; no node)."""

from __future__ import annotations

import msgspec
import pytest
from kvagent_server.router.kv.events import decode_batch
from kvagent_server.router.kv.hashing import BlockHasher
from kvagent_server.router.kv.index import Cleared, Removed, Stored


@pytest.mark.vllm
def test_decode_batch_reads_what_vllm_itself_encodes() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    b = kv_events.KVEventBatch(ts=2.0, data_parallel_rank=0, events=[
        kv_events.BlockStored(block_hashes=[1 << 63 | 5, 6], parent_block_hash=None,
                              token_ids=list(range(32)), block_size=16, lora_id=None,
                              medium="GPU", lora_name=None, extra_keys=[("salt",), None],
                              group_idx=0),
        kv_events.BlockRemoved(block_hashes=[6], medium="GPU", group_idx=0),
        kv_events.AllBlocksCleared(),
    ])
    events = decode_batch(msgspec.msgpack.Encoder().encode(b))
    assert events == [Stored(hashes=(1 << 63 | 5, 6), medium="GPU", group=0, block_size=16),
                      Removed(hashes=(6,), medium="GPU", group=0), Cleared()]


@pytest.mark.vllm
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_block_hashes_match_vllm_functions(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same chain as vLLM's own scheduler code (a real node: tests/router/kv/test_kv_events_vllm.py)."""
    utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    hashing = pytest.importorskip("vllm.utils.hashing")
    if algo.startswith("xxhash"):
        pytest.importorskip("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    fn = hashing.get_hash_fn_by_name(algo)
    utils.init_none_hash(fn)
    ids = [(i * 7919) % 50000 for i in range(70)]
    parent, want = None, []
    for start in range(0, 64, 16):
        extra = (("cache_salt", "tenant"),) if start == 0 else None
        parent = utils.hash_block_tokens(fn, parent, ids[start:start + 16], extra)
        want.append(parent)
    assert BlockHasher(algo, "1234").hashes(ids, 16, cache_salt="tenant") == want
    assert BlockHasher(algo, "1234").keys(ids, 16, cache_salt="tenant") == [
        utils.maybe_convert_block_hash(w) for w in want]
