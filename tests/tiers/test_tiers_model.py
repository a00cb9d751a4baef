"""KVTiers validation and render_tiers output, without vLLM (pure functions)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from kvagent_server.engine.tiers import KVTiers, TierConfigError, render_tiers
from pydantic import ValidationError

NIXL_P: dict[str, Any] = {
    "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda",
    "engine_id": "b-prefill-0",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 64},
}


def tiers(tmp_path: Path, **kw: Any) -> KVTiers:
    data: dict[str, Any] = {"cpu": {"size_gib": 4}, "disk": {"path": str(tmp_path / "kv")}}
    data.update(kw)
    return KVTiers.model_validate(data)


def errors(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        KVTiers.model_validate(data)
    return str(info.value)


def test_default_is_off_and_leaves_the_node_alone() -> None:
    out = render_tiers(KVTiers(), role="prefill", device="cpu",
                       base_kv_transfer_config=NIXL_P, block_size=16)
    assert out.args == [] and out.env == {}
    assert out.kv_transfer_config == NIXL_P
    assert out.kv_transfer_config is not NIXL_P  # a copy: callers may mutate it


def test_unknown_keys_are_rejected() -> None:
    assert "extra" in errors({"cpu": {"size_gib": 1, "sise": 2}}).lower()
    assert "extra" in errors({"tier": {}}).lower()


@pytest.mark.parametrize("size", [0, -1])
def test_sizes_must_be_positive(size: float) -> None:
    assert "greater than 0" in errors({"cpu": {"size_gib": size}})


def test_disk_path_must_be_absolute() -> None:
    msg = errors({"cpu": {"size_gib": 1}, "disk": {"path": "kv/cache"}})
    assert "absolute path" in msg and "kv/cache" in msg


def test_disk_path_is_created(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    tiers(tmp_path, disk={"path": str(target)})
    assert target.is_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_disk_path_not_writable(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    msg = errors({"cpu": {"size_gib": 1}, "disk": {"path": str(ro / "kv")}})
    assert "cannot create" in msg


def test_disk_path_that_cannot_be_created_even_by_root() -> None:
    msg = errors({"cpu": {"size_gib": 1}, "disk": {"path": "/proc/self/kvagent-kv"}})
    assert "cannot create /proc/self/kvagent-kv" in msg


def test_disk_path_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a directory" in errors({"cpu": {"size_gib": 1}, "disk": {"path": str(f)}})
    under = f / "kv"  # a path below a regular file cannot be created
    assert "cannot create" in errors({"cpu": {"size_gib": 1}, "disk": {"path": str(under)}})


def test_check_writable_off_renders_for_other_machines() -> None:
    t = KVTiers.model_validate({"cpu": {"size_gib": 1},
                                "disk": {"path": "/nonexistent/kv", "check_writable": False}})
    assert t.disk is not None and not Path("/nonexistent/kv").exists()


def test_native_disk_needs_cpu_tier(tmp_path: Path) -> None:
    msg = errors({"disk": {"path": str(tmp_path)}})
    assert "kv_tiers.disk" in msg and "add cpu" in msg


def test_native_disk_budget_is_cpu_only(tmp_path: Path) -> None:
    t = tiers(tmp_path, disk={"path": str(tmp_path), "size_gib": 10})
    with pytest.raises(TierConfigError, match="no size limit"):  # vLLM's fs tier (GPU)
        render_tiers(t, role="prefill", device="cuda", base_kv_transfer_config=None,
                     block_size=16)
    out = render_tiers(t, role="prefill", device="cpu", base_kv_transfer_config=None,
                       block_size=128)
    assert out.kv_transfer_config is not None
    (tier,) = out.kv_transfer_config["kv_connector_extra_config"]["secondary_tiers"]
    assert tier["size_bytes"] == 10 * 2**30


def test_store_threshold_not_with_tiering(tmp_path: Path) -> None:
    msg = errors({"cpu": {"size_gib": 1}, "disk": {"path": str(tmp_path)},
                  "store_after_hits": 2})
    assert "tiering/spec.py" in msg


def test_lmcache_local_disk_needs_size(tmp_path: Path) -> None:
    msg = errors({"backend": "lmcache", "disk": {"path": str(tmp_path)}})
    assert "disk.size_gib" in msg


def test_xxhash_shared_disk_needs_seed(tmp_path: Path) -> None:
    msg = errors({"cpu": {"size_gib": 1}, "hash_algo": "xxhash",
                  "disk": {"path": str(tmp_path), "shared": True}})
    assert "hash_seed" in msg and "PYTHONHASHSEED" in msg
    ok = tiers(tmp_path, hash_algo="xxhash", hash_seed=7,
               disk={"path": str(tmp_path), "shared": True})
    out = render_tiers(ok, role="decode", device="cuda", base_kv_transfer_config=None,
                       block_size=16)
    assert out.env["PYTHONHASHSEED"] == "7"
    assert out.args == ["--prefix-caching-hash-algo", "xxhash"]


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_hash_seed_range_is_pythons(seed: int) -> None:
    errors({"cpu": {"size_gib": 1}, "hash_seed": seed})


def test_cpu_nodes_get_kvagents_spec_and_disk_tier(tmp_path: Path) -> None:
    """NIXL first; kvagent's tiering spec (CPU worker) and namespaced disk tier; 2+2
    I/O threads; the hash algorithm goes to the tier for its namespace."""
    nixl_cpu = {**NIXL_P, "kv_buffer_device": "cpu"}
    out = render_tiers(tiers(tmp_path, hash_algo="sha256_cbor"), role="prefill",
                       device="cpu", base_kv_transfer_config=nixl_cpu, block_size=128)
    kv = out.kv_transfer_config
    assert kv is not None and kv["kv_connector"] == "MultiConnector"
    nixl, off = kv["kv_connector_extra_config"]["connectors"]
    assert nixl["kv_connector"] == "NixlConnector"
    extra = off["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "KvagentTieringSpec", "kvagent_server.vllm_plugin.host_tier")
    assert extra["secondary_tiers"] == [{
        "type": "KvagentFsTier", "module_path": "kvagent_server.vllm_plugin.disk_tier",
        "root_dir": str(tmp_path / "kv"), "n_read_threads": 2, "n_write_threads": 2,
        "locality": "LOCAL", "hash_algo": "sha256_cbor"}]
    assert off["kv_buffer_device"] == "cpu"
    cpu_only = render_tiers(KVTiers(cpu={"size_gib": 1}), role="decode", device="cpu",
                            base_kv_transfer_config=None, block_size=128).kv_transfer_config
    assert cpu_only is not None
    assert cpu_only["kv_connector_extra_config"]["spec_name"] == "KvagentTieringSpec"
    assert "secondary_tiers" not in cpu_only["kv_connector_extra_config"]


def test_cpu_device_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match="lmcache needs device=cuda"):
        render_tiers(KVTiers(backend="lmcache", cpu={"size_gib": 1}), role="prefill",
                     device="cpu", base_kv_transfer_config=None, block_size=128)
    with pytest.raises(TierConfigError, match="store_after_hits"):
        render_tiers(KVTiers(cpu={"size_gib": 1}, store_after_hits=2), role="prefill",
                     device="cpu", base_kv_transfer_config=None, block_size=128)


def test_io_threads_can_be_set(tmp_path: Path) -> None:
    t = tiers(tmp_path, disk={"path": str(tmp_path), "read_threads": 3, "write_threads": 1})
    kv = render_tiers(t, role="prefill", device="cpu", base_kv_transfer_config=None,
                      block_size=128).kv_transfer_config
    assert kv is not None
    (tier,) = kv["kv_connector_extra_config"]["secondary_tiers"]
    assert (tier["n_read_threads"], tier["n_write_threads"]) == (3, 1)


def test_role_without_tiers_is_untouched_even_on_cpu(tmp_path: Path) -> None:
    t = tiers(tmp_path, roles=["decode"])
    out = render_tiers(t, role="prefill", device="cpu", base_kv_transfer_config=NIXL_P,
                       block_size=128)
    assert out.kv_transfer_config == NIXL_P and out.args == []


def test_multiconnector_shape(tmp_path: Path) -> None:
    out = render_tiers(tiers(tmp_path, min_prefix_tokens=64), role="prefill", device="cuda",
                       base_kv_transfer_config=NIXL_P, block_size=16)
    kv = out.kv_transfer_config
    assert kv is not None
    assert kv["kv_connector"] == "MultiConnector"
    assert kv["kv_role"] == "kv_producer" and kv["engine_id"] == "b-prefill-0"
    nixl, off = kv["kv_connector_extra_config"]["connectors"]
    assert nixl == {k: v for k, v in NIXL_P.items() if k != "engine_id"}
    assert off["kv_connector"] == "OffloadingConnector" and off["kv_role"] == "kv_both"
    assert "engine_id" not in off
    extra = off["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 4 * 2**30
    assert extra["block_size"] == 64 and extra["eviction_policy"] == "lru"
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["secondary_tiers"] == [{
        "type": "fs", "root_dir": str(tmp_path / "kv"), "n_read_threads": 16,
        "n_write_threads": 16, "locality": "LOCAL"}]
    json.dumps(kv)  # goes on a command line


def test_cpu_only_has_no_tiering_spec() -> None:
    out = render_tiers(KVTiers(cpu={"size_gib": 0.5, "eviction": "arc"}, store_after_hits=3),
                       role="decode", device="cuda", base_kv_transfer_config=None,
                       block_size=16)
    kv = out.kv_transfer_config
    assert kv is not None and kv["kv_connector"] == "OffloadingConnector"
    extra = kv["kv_connector_extra_config"]
    assert "spec_name" not in extra and "secondary_tiers" not in extra
    assert extra == {"cpu_bytes_to_use": 2**29, "eviction_policy": "arc",
                     "offload_prompt_only": True, "store_threshold": 3}


def test_min_prefix_must_align_to_blocks() -> None:
    with pytest.raises(TierConfigError, match="use 32"):
        render_tiers(KVTiers(cpu={"size_gib": 1}, min_prefix_tokens=20), role="prefill",
                     device="cuda", base_kv_transfer_config=None, block_size=16)


def test_lmcache_env_shared_fs(tmp_path: Path) -> None:
    t = KVTiers.model_validate({"backend": "lmcache", "cpu": {"size_gib": 8},
                                "disk": {"path": str(tmp_path), "shared": True},
                                "min_prefix_tokens": 512})
    out = render_tiers(t, role="decode", device="cuda", base_kv_transfer_config=NIXL_P,
                       block_size=16)
    assert out.env == {
        "LMCACHE_CHUNK_SIZE": "512", "LMCACHE_SAVE_UNFULL_CHUNK": "False",
        "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "8",
        "LMCACHE_CACHE_POLICY": "LRU",
        "LMCACHE_REMOTE_URL": f"fs://localhost:0{tmp_path}",
        "LMCACHE_REMOTE_SERDE": "naive",
    }
    kv = out.kv_transfer_config
    assert kv is not None
    assert [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]] == [
        "NixlConnector", "LMCacheConnectorV1"]


def test_lmcache_local_disk(tmp_path: Path) -> None:
    t = KVTiers.model_validate({"backend": "lmcache",
                                "disk": {"path": str(tmp_path), "size_gib": 2.5}})
    env = render_tiers(t, role="prefill", device="cuda", base_kv_transfer_config=None,
                       block_size=16).env
    assert env["LMCACHE_LOCAL_DISK"] == f"file://{tmp_path}/"
    assert env["LMCACHE_MAX_LOCAL_DISK_SIZE"] == "2.5" and env["LMCACHE_LOCAL_CPU"] == "False"


def test_existing_multiconnector_is_not_nested() -> None:
    base = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": []}}
    with pytest.raises(TierConfigError, match="already uses a MultiConnector"):
        render_tiers(KVTiers(cpu={"size_gib": 1}), role="prefill", device="cuda",
                     base_kv_transfer_config=base, block_size=16)
