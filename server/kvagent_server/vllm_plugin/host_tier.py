"""vLLM's tiered KV offloading on CPU nodes: an offloading spec whose worker copies blocks
with torch instead of GPU streams.

vLLM 0.32's native tiers (`OffloadingConnector` + `TieringOffloadingSpec`) are platform-free
except for the worker that moves blocks between the engine's KV cache and the host
region: `CPUOffloadingSpec.get_worker` refuses non-GPU platforms, and its
`CPUOffloadingWorker` uses CUDA streams, events and the `swap_blocks_batch` op the CPU
build lacks. `KvagentTieringSpec` (loaded by vLLM through `spec_name` /
`spec_module_path` in `kv_connector_extra_config`; no vLLM patch) keeps everything else,
the scheduler-side manager, eviction, metrics, the shared host region and the secondary
tiers, and on a CPU platform supplies `HostCopyWorker`. On a GPU it defers to vLLM's own
worker.

On CPU the engine's KV cache is host memory (layout LBHNC, per layer
`[num_blocks, num_kv_heads, block_size, 2*head_size]`, the K rows of a head before its V
rows), so a block is one contiguous page per layer, and the worker copies whole pages,
never single tokens. The copy is synchronous at submission: the connector submits stores
at the start of the next engine step (the step that wrote those blocks has finished on a
CPU) and loads before the model runs, and the engine thread does both, so nothing reads or
writes those pages meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvagent_server.vllm_plugin import version
from kvagent_server.vllm_plugin.tier_files import sweep_stale_regions

logger = logging.getLogger("vllm.kvagent")

#: The spec's class name and module, as the bundle renders them (`spec_name`,
#: `spec_module_path`).
SPEC_NAME = "KvagentTieringSpec"
SPEC_MODULE = __name__


def page_slots(host_chunks: np.ndarray, blocks_per_chunk: int, skip: int,
               count: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk row, page within the chunk) of `count` consecutive engine blocks stored in
    `host_chunks`, the first `skip` pages of the first chunk not being theirs: the same
    enumeration as vLLM's GPU worker (`compute_sub_block_ptrs`)."""
    flat = (host_chunks.astype(np.int64)[:, None] * blocks_per_chunk
            + np.arange(blocks_per_chunk, dtype=np.int64)[None, :]).ravel()
    flat = flat[skip:skip + count]
    if len(flat) != count:
        raise ValueError(f"{len(host_chunks)} host chunk(s) of {blocks_per_chunk} pages "
                         f"cannot hold {count} blocks after skipping {skip}")
    return flat // blocks_per_chunk, flat % blocks_per_chunk


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc]  # vLLM is untyped here
    """Copies whole KV block pages between a CPU engine's KV cache and vLLM's host region,
    with the GPU worker's semantics: both directions succeed at submission, results come
    back from `get_finished`, and `wait` has nothing to wait for."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion) -> None:
        if not kv_caches.tensors:
            raise ValueError("no KV cache tensors to offload")
        self._region: SharedOffloadRegion | None = region
        self._bpc = blocks_per_chunk
        self._engine: list[torch.Tensor] = []  # per tensor: [num_blocks, page] int8
        self._host: list[torch.Tensor] = []  # per tensor: [num_chunks, bpc, page] int8
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            eng = t.tensor
            if eng.dtype != torch.int8 or eng.ndim != 2:
                eng = eng.view(torch.int8).view((-1, page))
            if eng.device.type != "cpu":
                raise ValueError(f"HostCopyWorker needs CPU KV tensors, got {eng.device}")
            rows = region.create_next_worker_view(page * blocks_per_chunk)
            host = rows.as_strided((rows.shape[0], blocks_per_chunk, page),
                                   (rows.stride(0), page, 1))
            self._engine.append(eng)
            self._host.append(host)
        # per group: (tensor index, bytes per page to copy), each tensor once (layers that
        # alias one tensor share its pages)
        self._refs: list[list[tuple[int, int]]] = []
        for refs in kv_caches.group_data_refs:
            sizes: dict[int, int] = {}
            for ref in refs:
                sizes[ref.tensor_idx] = max(sizes.get(ref.tensor_idx, 0), ref.page_size_bytes)
            self._refs.append(sorted(sizes.items()))
        self._done: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def _transfer(self, job_id: int, engine_spec: LoadStoreSpec, host_spec: LoadStoreSpec,
                  *, store: bool) -> bool:
        assert isinstance(engine_spec, GPULoadStoreSpec)
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        engine_ids = engine_spec.block_ids
        host_ids = host_spec.block_ids
        group_sizes: Sequence[int] = engine_spec.group_sizes
        if len(group_sizes) != len(self._refs):
            raise ValueError(f"{len(group_sizes)} groups in the transfer, "
                             f"{len(self._refs)} offloaded")
        e_off = h_off = 0
        nbytes = 0
        for g, (size, block_idx) in enumerate(zip(group_sizes, engine_spec.block_indices)):
            if size == 0:
                continue
            skip = block_idx % self._bpc
            n_chunks = -(-(size + skip) // self._bpc)
            e_ids = torch.from_numpy(engine_ids[e_off:e_off + size].astype(np.int64))
            rows, pages = page_slots(host_ids[h_off:h_off + n_chunks], self._bpc, skip, size)
            r, p = torch.from_numpy(rows), torch.from_numpy(pages)
            for t_idx, n in self._refs[g]:
                eng, host = self._engine[t_idx], self._host[t_idx]
                if store:
                    host[r, p, :n] = eng.index_select(0, e_ids)[:, :n]
                else:
                    eng[e_ids, :n] = host[r, p, :n]
                nbytes += size * n
            e_off += size
            h_off += n_chunks
        if e_off != len(engine_ids) or h_off != len(host_ids):
            raise ValueError(f"transfer {job_id}: {len(engine_ids)} engine and "
                             f"{len(host_ids)} host blocks, groups cover {e_off} and {h_off}")
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Every transfer finished when it was submitted."""

    def shutdown(self) -> None:
        self._engine.clear()
        self._host.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class KvagentTieringSpec(TieringOffloadingSpec):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's tiering spec (host region + secondary tiers) with a CPU worker; on GPUs,
    vLLM's own worker."""

    def __init__(self, config: OffloadingConfig) -> None:
        import vllm

        version.check(vllm.__version__)  # the worker contract is pinned to these releases
        super().__init__(config)

    def get_manager(self) -> Any:
        if self._manager is None:
            for path in sweep_stale_regions():
                logger.warning("kvagent: removed the host KV region %s of a node that is "
                               "gone", path)
        return super().get_manager()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not current_platform.is_cpu():
            return super().get_worker(kv_caches)
        worker: Any = getattr(self, "_worker")  # noqa: B009 (untyped): cached as vLLM does
        if worker is None:
            worker = self._worker = self.create_worker(kv_caches)
        return worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        if not current_platform.is_cpu():
            return super().create_worker(kv_caches)
        if self.config.canonical_layout:
            raise ValueError("canonical_layout is not supported by kvagent's CPU offloading "
                             "worker; remove it from kv_connector_extra_config")
        for path in sweep_stale_regions():
            logger.warning("kvagent: removed the host KV region %s of a node that is gone",
                           path)
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker)
        try:
            worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
        logger.info("kvagent: CPU offloading worker over %d KV tensor(s), %d host chunk(s) "
                    "of %d block(s)", len(kv_caches.tensors), self.num_chunks,
                    self.blocks_per_chunk)
        return worker
