"""kvagent's CPU offloading worker and disk tier against vLLM's own classes, no engine.

The worker is checked against a per-block reference copy (chunks of two blocks, a group
that starts mid-chunk, two groups), through vLLM's real shared host region. The contract
tests fail when upstream changes what the plugin's tier classes rely on: the worker's
abstract methods, `TransferResult`, the host region's constructor and path, the spec
factory reading `spec_module_path`, the fs tier's constructor and lookup hook.
"""

from __future__ import annotations

import inspect
import mmap
import time
import types
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvagent_server.engine import tiers as tiers_mod

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm", reason="vLLM is not importable here (CI installs it)")
torch = pytest.importorskip("torch")

from kvagent_server.vllm_plugin import disk_tier, host_tier
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

SITE = Path(vllm.__file__).parent.parent
PAGE = 4096  # bytes of one block in one layer tensor (page aligned, as vLLM requires)
BPC = 2  # blocks per host chunk


def caches(num_blocks: int, layers: int) -> CanonicalKVCaches:
    tensors = [CanonicalKVCacheTensor(
        torch.randint(-128, 127, (num_blocks, PAGE), dtype=torch.int8), PAGE)
        for _ in range(layers)]
    # two groups, each over every tensor (as a hybrid model's groups would be)
    refs = [[CanonicalKVCacheRef(i, PAGE) for i in range(layers)] for _ in range(2)]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def region(num_chunks: int, layers: int) -> SharedOffloadRegion:
    page = PAGE * BPC * layers
    return SharedOffloadRegion(engine_id=f"kvagent-test-{uuid.uuid4().hex}",
                               num_chunks=num_chunks, rank=0, kv_bytes_per_chunk=page,
                               cpu_page_size=page)


def test_worker_round_trip_matches_per_block_copies() -> None:
    layers, chunks = 3, 8
    kv = caches(num_blocks=16, layers=layers)
    reg = region(chunks, layers)
    worker = host_tier.HostCopyWorker(kv, BPC, reg)
    try:
        # group 0: engine blocks 3,4,5 are a request's blocks 1..3 (block index 1: the
        # first chunk's first page is not theirs); group 1: blocks 7,8 from index 0
        engine = GPULoadStoreSpec([3, 4, 5, 7, 8], group_sizes=[3, 2], block_indices=[1, 0])
        host = CPULoadStoreSpec([6, 2, 5])  # group 0 spans chunks 6, 2; group 1 chunk 5
        assert worker.submit_store(11, engine, host) is True
        (res,) = worker.get_finished()
        assert (res.job_id, res.success, res.transfer_size) == (11, True, 5 * PAGE * layers)
        base = reg.base_tensor.view(chunks, -1)
        slots = [(3, 6, 1), (4, 2, 0), (5, 2, 1), (7, 5, 0), (8, 5, 1)]  # block, chunk, page
        for t_idx, t in enumerate(kv.tensors):
            for block, chunk, page in slots:
                off = t_idx * PAGE * BPC + page * PAGE
                assert torch.equal(base[chunk, off:off + PAGE], t.tensor[block])
        before = [t.tensor.clone() for t in kv.tensors]
        back = GPULoadStoreSpec([10, 11, 12, 13, 14], group_sizes=[3, 2], block_indices=[1, 0])
        assert worker.submit_load(12, host, back) is True
        worker.wait({12})
        assert [r.job_id for r in worker.get_finished()] == [12]
        for t, old in zip(kv.tensors, before, strict=True):
            assert torch.equal(t.tensor[10:15], old[[3, 4, 5, 7, 8]])
            assert torch.equal(t.tensor[:10], old[:10])  # nothing else written
    finally:
        worker.shutdown()


def test_page_slots_refuses_too_few_chunks() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        host_tier.page_slots(np.array([0]), 2, 1, 2)


# ---------------------------------------------------------------------- contract


def test_worker_contract_is_the_one_the_plugin_implements() -> None:
    assert OffloadingWorker.__abstractmethods__ == {
        "submit_store", "submit_load", "get_finished", "wait"}
    for name in ("submit_store", "submit_load"):
        assert list(inspect.signature(getattr(OffloadingWorker, name)).parameters) == [
            "self", "job_id", "src_spec", "dst_spec"]
    assert [f for f in TransferResult.__dataclass_fields__] == [
        "job_id", "success", "transfer_size", "transfer_time"]
    params = inspect.signature(SharedOffloadRegion.__init__).parameters
    assert {"engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size"} <= set(
        params)
    assert "/dev/shm/vllm_offload_{engine_id}.mmap" in inspect.getsource(SharedOffloadRegion)
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    for name in ("get_worker", "create_worker", "get_manager"):
        assert hasattr(TieringOffloadingSpec, name)
    assert TieringOffloadingSpec._uses_shared_region(None) is True  # type: ignore[arg-type]


def test_spec_and_tier_load_by_the_rendered_names(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    assert (host_tier.SPEC_NAME, host_tier.SPEC_MODULE) == (
        tiers_mod.CPU_SPEC_NAME, tiers_mod.CPU_SPEC_MODULE)
    assert (disk_tier.TIER_TYPE, disk_tier.TIER_MODULE) == (
        tiers_mod.CPU_DISK_TIER_TYPE, tiers_mod.CPU_DISK_TIER_MODULE)
    kv = tiers_mod.render_tiers(
        tiers_mod.KVTiers.model_validate({"cpu": {"size_gib": 1},
                                          "disk": {"path": str(tmp_path)}}),
        role="prefill", device="cpu", base_kv_transfer_config=None,
        block_size=128).kv_transfer_config
    assert kv is not None
    extra = kv["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra) is host_tier.KvagentTieringSpec
    (tier,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(tier) is disk_tier.KvagentFsTier
    path, line = tiers_mod.SPEC_MODULE_PATH_READ.rsplit(":", 1)
    text = (SITE / path).read_text().splitlines()[int(line) - 1]
    assert 'extra_config.get("spec_module_path")' in text, text


def test_spec_is_pinned_to_the_plugins_vllm_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvagent_server.vllm_plugin.version import UnsupportedVLLMVersion

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(UnsupportedVLLMVersion):
        host_tier.KvagentTieringSpec(offload_config(1))


# ---------------------------------------------------------------------- disk tier


def offload_config(blocks_per_chunk: int) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(128, ("l0",), 0),), worker_kv_bytes_per_block=PAGE,
        enable_kv_cache_events=True, extra_config={"cpu_bytes_to_use": 1 << 20},
        engine_id="e", model=OffloadingModelConfig("m", "float32"),
        cache=OffloadingCacheConfig(128, blocks_per_chunk),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout="LBHNC")


def fs_tier(root: Path, **kw: Any) -> Any:
    spec = types.SimpleNamespace(
        config=offload_config(1), blocks_per_chunk=1,
        kv_events_config=types.SimpleNamespace(enable_kv_cache_events=True))
    buf = np.frombuffer(mmap.mmap(-1, 4 * PAGE), dtype=np.uint8)  # page aligned: O_DIRECT
    buf[:] = np.arange(4 * PAGE) % 251
    view = memoryview(buf.reshape(4, PAGE))
    return disk_tier.KvagentFsTier(spec, view, "KvagentFsTier", root_dir=str(root),
                                   enable_kv_events=True, **kw)


def finished(tier: Any, n: int) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + 10
    while len(out) < n and time.monotonic() < deadline:
        out += list(tier.get_finished_jobs())
        time.sleep(0.01)
    return out


def test_disk_tier_namespaces_checks_sizes_and_keeps_its_budget(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.tiering.base import TransferJob

    tier = fs_tier(tmp_path, size_bytes=int(2.5 * PAGE))
    try:
        assert Path(tier.namespace_root).parent == tmp_path
        assert (Path(tier.namespace_root) / disk_tier.NAMESPACE_FILE).is_file()
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
        for i, key in enumerate(keys):  # one store per block: mtimes in store order
            tier.submit_store(TransferJob(i, [key], np.array([i]), False, None))
            assert [r.success for r in finished(tier, 1)] == [True]
            time.sleep(0.02)
        left = [tier.file_mapper.get_file_name(k) for k in keys]
        assert [Path(p).exists() for p in left] == [False, False, True, True]
        removed = [e for e in tier.take_events() if e.removed]
        assert [k for e in removed for k in e.keys] == keys[:2]
        assert tier.usable(left[2])
        with open(left[2], "ab") as f:  # a longer file: its head is not the block
            f.write(b"x")
        assert not tier.usable(left[2]) and not Path(left[2]).exists()
    finally:
        tier.shutdown()
    other = fs_tier(tmp_path, hash_algo="xxhash")
    try:
        assert other.namespace_root != tier.namespace_root
    finally:
        other.shutdown()
