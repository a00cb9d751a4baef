"""The CPU tiers' file rules without vLLM: namespaces, the disk budget, stale host regions."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvagent_server.vllm_plugin import tier_files as tf


def fields(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "/m", "dtype": "float32", "kv_block_tokens": 128,
                            "offload_block_tokens": 128, "chunk_bytes": 1 << 20,
                            "platform": "cpu", "kv_cache_layout": "LBHNC",
                            "hash_algo": "sha256", "hash_seed": None}
    base.update(kw)
    return tf.namespace_fields(**base)


@pytest.mark.parametrize("change", [
    {"model": "/other"}, {"dtype": "bfloat16"}, {"kv_block_tokens": 64},
    {"offload_block_tokens": 256}, {"chunk_bytes": 1 << 19}, {"platform": "cuda"},
    {"kv_cache_layout": "NHD"}, {"hash_algo": "xxhash"}, {"hash_seed": "7"},
])
def test_every_compatibility_field_changes_the_directory(change: dict[str, Any]) -> None:
    assert tf.namespace_dir(fields(**change)) != tf.namespace_dir(fields())


def test_namespace_is_stable_and_versioned() -> None:
    name = tf.namespace_dir(fields())
    assert name == tf.namespace_dir(fields())
    assert name.startswith(f"kvagent-v{tf.TIER_FORMAT_VERSION}-")


def test_model_identity_covers_a_local_models_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 256}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = tf.model_identity(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    second = tf.model_identity(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 512}')
    assert len({first, second, tf.model_identity(str(tmp_path))}) == 3
    assert tf.model_identity("org/name") != tf.model_identity("org/other")


def test_eviction_takes_the_oldest_down_to_the_low_water_mark() -> None:
    files = [tf.StoredFile(f"/f{i}", 100, mtime=float(i)) for i in range(10)]
    assert tf.to_evict(files, budget_bytes=1000) == ([], 1000)
    victims, left = tf.to_evict(list(reversed(files)), budget_bytes=500)
    assert [v.path for v in victims] == [f"/f{i}" for i in range(6)]  # to 90 % of 500
    assert left == 400


def test_scan_block_files(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.bin").write_bytes(b"1234")
    (tmp_path / "a" / "config.json").write_text("{}")
    (found,) = tf.scan_block_files(str(tmp_path))
    assert found.path.endswith("x.bin") and found.size == 4


def test_sweep_removes_only_regions_nobody_holds(tmp_path: Path) -> None:
    stale = tmp_path / "vllm_offload_dead.mmap"
    held = tmp_path / "vllm_offload_live.mmap"
    other = tmp_path / "unrelated.mmap"
    for p in (stale, held, other):
        p.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen([sys.executable, "-c",
                               f"f = open({str(held)!r}, 'rb'); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while str(held) not in tf.open_or_mapped_paths() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tf.sweep_stale_regions(tmp_path) == [str(stale)]
        assert held.exists() and other.exists() and not stale.exists()
    finally:
        holder.kill()
        holder.wait()


def test_sweep_of_a_missing_directory_is_a_no_op(tmp_path: Path) -> None:
    assert tf.sweep_stale_regions(tmp_path / "nope") == []
    assert tf.stale_regions(["/a", "/b"], {"/b"}) == ["/a"]
