"""Pure rules of the CPU tiers' files: the namespace a tier directory is keyed by, which
block files a disk budget evicts, and which host regions a dead node left in /dev/shm.

No vLLM import: the plugin's tier classes (`vllm_plugin.host_tier`, `vllm_plugin.disk_tier`)
call these with what they read from vLLM, and the unit tests call them with plain values.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Bumped whenever kvagent changes what a stored block file holds or how it is named: files
#: of another format version live in another directory and are never read.
TIER_FORMAT_VERSION = 1
#: Prefix of the namespace directories under a disk tier's root.
NAMESPACE_PREFIX = "kvagent-v"
#: Where vLLM's tiering spec maps its host region (`SharedOffloadRegion.mmap_path`).
HOST_REGION_DIR = Path("/dev/shm")
HOST_REGION_RE = re.compile(r"^vllm_offload_.+\.mmap$")
#: Files a model directory is identified by (their bytes, hashed), besides its name.
MODEL_IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")


def model_identity(model: str) -> str:
    """What makes a model's KV bytes what they are, as a short digest: for a local directory
    its config files and the names and sizes of its weight files (a fine-tune saved over
    the same path changes at least one of them); for a hub name, the name itself."""
    path = Path(model)
    h = hashlib.sha256(model.encode())
    if path.is_dir():
        for name in MODEL_IDENTITY_FILES:
            f = path / name
            if f.is_file():
                h.update(name.encode() + b"\0" + f.read_bytes())
        for f in sorted(path.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".pt", ".gguf") and f.is_file():
                h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def namespace_fields(*, model: str, dtype: str, kv_block_tokens: int, offload_block_tokens: int,
                     chunk_bytes: int, platform: str, kv_cache_layout: str | None,
                     hash_algo: str, hash_seed: str | None) -> dict[str, Any]:
    """Everything that makes two nodes' stored blocks byte-compatible. `hash_seed` is the
    node's PYTHONHASHSEED (None: vLLM's default for `hash_algo`)."""
    return {
        "format": TIER_FORMAT_VERSION,
        "model": model,
        "model_identity": model_identity(model),
        "dtype": dtype,
        "kv_block_tokens": kv_block_tokens,
        "offload_block_tokens": offload_block_tokens,
        "chunk_bytes": chunk_bytes,
        "platform": platform,
        "kv_cache_layout": kv_cache_layout,
        "hash_algo": hash_algo,
        "hash_seed": hash_seed,
    }


def namespace_dir(fields: Mapping[str, Any]) -> str:
    """The directory name under a tier root for `fields` (a digest of all of them)."""
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
    return f"{NAMESPACE_PREFIX}{TIER_FORMAT_VERSION}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


# ---------------------------------------------------------------------- disk budget


@dataclass(frozen=True)
class StoredFile:
    path: str
    size: int
    mtime: float


def to_evict(files: Iterable[StoredFile], *, budget_bytes: int,
             low_water: float = 0.9) -> tuple[list[StoredFile], int]:
    """The files to delete, oldest first by mtime, so what stays is at most
    `low_water * budget_bytes` (nothing when the total is within the budget), and the
    bytes that stay."""
    ordered = sorted(files, key=lambda f: (f.mtime, f.path))
    total = sum(f.size for f in ordered)
    if total <= budget_bytes:
        return [], total
    target = int(budget_bytes * low_water)
    out: list[StoredFile] = []
    for f in ordered:
        if total <= target:
            break
        out.append(f)
        total -= f.size
    return out, total


def scan_block_files(root: str) -> list[StoredFile]:
    """Every stored block file (`*.bin`) under `root`, with its size and mtime; files that
    vanish meanwhile (another node evicting) are skipped."""
    found: list[StoredFile] = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if not name.endswith(".bin"):
                continue
            p = os.path.join(dirpath, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            found.append(StoredFile(p, st.st_size, st.st_mtime))
    return found


# ---------------------------------------------------------------------- host regions


def stale_regions(candidates: Iterable[str], in_use: set[str]) -> list[str]:
    """The host-region files no live process has open or mapped."""
    return sorted(p for p in candidates if p not in in_use)


def open_or_mapped_paths(proc: Path = Path("/proc")) -> set[str]:
    """Paths any process we can see holds open or mapped (Linux /proc). A process of
    another user or PID namespace is invisible here, so run nodes that share /dev/shm as
    one user in one namespace (as the bundle does)."""
    seen: set[str] = set()
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return seen
    for pid in pids:
        fd_dir = proc / pid / "fd"
        try:
            for fd in os.listdir(fd_dir):
                try:
                    seen.add(os.readlink(fd_dir / fd))
                except OSError:
                    continue
        except OSError:
            pass
        try:
            with open(proc / pid / "maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        seen.add(parts[5].strip())
        except OSError:
            pass
    return seen


def sweep_stale_regions(region_dir: Path = HOST_REGION_DIR) -> list[str]:
    """Delete the host regions (`vllm_offload_*.mmap`) whose owner is gone: a node killed
    before its clean shutdown leaves one behind, and a restarted node with the same engine
    id would join it (and wait, then fail, when its size changed). Returns the removed paths."""
    try:
        candidates = [str(region_dir / n) for n in os.listdir(region_dir)
                      if HOST_REGION_RE.match(n)]
    except OSError:
        return []
    if not candidates:
        return []
    removed = []
    for path in stale_regions(candidates, open_or_mapped_paths()):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed
