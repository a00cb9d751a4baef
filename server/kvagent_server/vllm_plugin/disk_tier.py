"""vLLM's `fs` secondary tier, kept, with the three things kvagent adds to a disk tier:

- **a namespace**: blocks live under `<root>/kvagent-v<N>-<digest>/`, the digest covering
  everything that makes stored bytes compatible (`tier_files.namespace_fields`:
  model and its files, dtype, KV and offload block sizes, chunk bytes, platform and KV
  layout, hash algorithm and seed, kvagent's format version). vLLM's own file naming
  covers the model *string*, dtype, block sizes and layer names, but not the platform or
  byte layout, nor the hash seed: a CPU node and a GPU node, or two seeds, sharing a
  directory would read each other's bytes as KV. A foreign file is never looked up here.
- **a size check at lookup**: a block file of the wrong size is a miss (and is removed),
  not a load; vLLM's reader already refuses a short file (EIO, file removed, the request
  recomputes) but would load the head of a longer one.
- **a size budget** (`size_bytes`): after stores complete, when the namespace directory
  holds more than the budget, the oldest files by mtime are deleted down to 90 % of it
  (vLLM's fs tier has no limit). Deletions are announced as removed STORAGE blocks when the
  tier publishes KV events.

Loaded by vLLM's `SecondaryTierFactory` from `{"type": "KvagentFsTier", "module_path":
"kvagent_server.vllm_plugin.disk_tier", ...}` in `secondary_tiers`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager, FsAsyncLookupManager

from kvagent_server.vllm_plugin.tier_files import (
    namespace_dir,
    namespace_fields,
    scan_block_files,
    to_evict,
)

logger = logging.getLogger("vllm.kvagent")

TIER_TYPE = "KvagentFsTier"
TIER_MODULE = __name__
NAMESPACE_FILE = "kvagent-namespace.json"


class _SizedLookup(FsAsyncLookupManager):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's batched lookup, where only a file of exactly one chunk's bytes is a hit."""

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        assert isinstance(tier, KvagentFsTier)
        return [tier.usable(tier.file_mapper.get_file_name(k)) for k in keys]


class KvagentFsTier(FileSystemTierManager):  # type: ignore[misc]  # vLLM is untyped here
    """`FileSystemTierManager` in a namespaced directory, with a size check and a budget."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 root_dir: str, hash_algo: str = "sha256", size_bytes: int | None = None,
                 n_read_threads: int = 2, n_write_threads: int = 2, **kwargs: Any) -> None:
        cfg = offloading_spec.config
        assert primary_kv_view.strides is not None
        fields = namespace_fields(
            model=cfg.model.name, dtype=cfg.model.dtype,
            kv_block_tokens=cfg.cache.tokens_per_hash,
            offload_block_tokens=cfg.cache.tokens_per_hash * cfg.cache.blocks_per_chunk,
            chunk_bytes=int(primary_kv_view.strides[0]),
            platform=str(current_platform.device_type),
            kv_cache_layout=cfg.kv_cache_layout, hash_algo=hash_algo,
            hash_seed=os.environ.get("PYTHONHASHSEED"))
        self.namespace_root = os.path.join(root_dir, namespace_dir(fields))
        os.makedirs(self.namespace_root, exist_ok=True)
        marker = Path(self.namespace_root) / NAMESPACE_FILE
        if not marker.exists():  # for people: what the directory's digest covers
            tmp = marker.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(fields, indent=2, sort_keys=True))
            os.replace(tmp, marker)
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         root_dir=self.namespace_root, n_read_threads=n_read_threads,
                         n_write_threads=n_write_threads, **kwargs)
        vllms_lookup: Any = getattr(self, "_lookup_manager")  # noqa: B009 (untyped)
        vllms_lookup.shutdown()  # replaced before its first lookup
        self._lookup_manager = _SizedLookup(tier=self, tier_type=self.tier_type)
        self._budget = size_bytes
        self._store_blocks: dict[int, int] = {}
        self._used = sum(f.size for f in scan_block_files(self.namespace_root)) \
            if size_bytes else 0
        logger.info("kvagent: disk tier %s (budget %s bytes, %d in use)", self.namespace_root,
                    size_bytes, self._used)

    def usable(self, path: str) -> bool:
        """True when `path` holds one whole chunk; a file of another size is removed."""
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        if size == self._block_size:
            return True
        logger.warning("kvagent: disk tier file %s has %d bytes, expected %d: removed, "
                       "treated as a miss", path, size, self._block_size)
        try:
            os.unlink(path)
        except OSError:
            pass
        return False

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._store_blocks[job_metadata.job_id] = len(job_metadata.keys)
        super().submit_store(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = list(super().get_finished_jobs())
        for r in results:
            blocks = self._store_blocks.pop(r.job_id, None)
            if blocks and r.success and self._budget:
                self._used += blocks * self._block_size
        if self._budget and self._used > self._budget:
            self._evict()
        return results

    def _evict(self) -> None:
        assert self._budget is not None
        victims, self._used = to_evict(scan_block_files(self.namespace_root),
                                       budget_bytes=self._budget)
        removed: list[OffloadKey] = []
        for f in victims:
            try:
                os.unlink(f.path)
            except OSError:
                continue
            key = _key_of(f.path)
            if key is not None:
                removed.append(key)
        if victims:
            logger.info("kvagent: disk tier over its budget: evicted %d file(s), %d bytes "
                        "left", len(victims), self._used)
        if removed and self.events is not None:
            self.events.append(OffloadingEvent(keys=removed, medium=Medium.STORAGE,
                                               removed=True, locality=self.locality))


def _key_of(path: str) -> OffloadKey | None:
    """The offload key a block file stores (`.../<hh>_g<group>/<hash hex>.bin`)."""
    p = Path(path)
    try:
        group = int(p.parent.name.rsplit("_g", 1)[1])
        return make_offload_key(bytes.fromhex(p.stem), group)
    except (IndexError, ValueError):
        return None
