"""Configuration table and the foreign-vLLM guard of the multi-turn benchmark (no vLLM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from benchmarks.api import (
    CONFIGS,
    REFERENCE_CONFIG,
    VLLM_MODULE,
    ContentionWatch,
    aggregated_args,
    cpu_outside,
    foreign_vllm,
)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)", VLLM_MODULE]


def _pids(lines: list[str]) -> set[int]:
    return {int(line.split()[0]) for line in lines}


def test_configurations_cover_the_comparison() -> None:
    assert list(CONFIGS) == ["kvagent", "pd_noreuse_pcache_off", "pd_noreuse_pcache_on",
                             "aggregated"]
    assert CONFIGS["kvagent"].reuse and CONFIGS["kvagent"].kind == "bundle"
    off, on = CONFIGS["pd_noreuse_pcache_off"], CONFIGS["pd_noreuse_pcache_on"]
    assert not off.reuse and not off.prefill_prefix_caching
    assert not on.reuse and on.prefill_prefix_caching
    assert REFERENCE_CONFIG in CONFIGS


def test_aggregated_node_has_prefix_cache_and_cached_token_counts() -> None:
    args = aggregated_args("/m", 1234)
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    assert args[args.index("--port") + 1] == "1234"
    assert args[args.index("--host") + 1] == "127.0.0.1"


def test_foreign_vllm_ignores_own_children_and_sees_orphans() -> None:
    child = subprocess.Popen(SLEEPER)
    # An orphan (its parent shell exits at once) is not ours: like another user's node.
    out = subprocess.run(["sh", "-c", " ".join(f"'{a}'" for a in SLEEPER) + " >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    orphan = int(out.stdout.strip())
    try:
        deadline = time.monotonic() + 10
        while orphan not in _pids(foreign_vllm()) and time.monotonic() < deadline:
            time.sleep(0.1)
        seen = _pids(foreign_vllm())
        assert orphan in seen and child.pid not in seen
        with ContentionWatch(every_s=0.05) as watch:
            time.sleep(0.2)
        assert watch.max >= 1
        assert watch.load_max > 0  # sampled: this test itself keeps a core busy
    finally:
        child.kill()
        child.wait()
        os.kill(orphan, signal.SIGKILL)


def test_cpu_outside_counts_other_processes_since_the_first_snapshot() -> None:
    before = {1: (100.0, "redis-server", 4.0), 2: (100.0, "bash", 9.0), 7: (100.0, "me", 1.0)}
    after = {1: (100.0, "redis-server", 4.5),
             2: (250.0, "make", 0.75),  # pid 2 reused by a program started meanwhile
             3: (260.0, "cc1", 2.0),  # started meanwhile
             7: (100.0, "me", 30.0), 8: (270.0, "vllm", 40.0)}  # ours
    assert cpu_outside(before, after, own={7, 8}) == {"cc1": 2.0, "make": 0.75,
                                                       "redis-server": 0.5}


def test_contention_watch_counts_cpu_an_orphan_uses_and_not_its_own_children() -> None:
    spin = "while :; do :; done"
    child = subprocess.Popen(["sh", "-c", spin])
    out = subprocess.run(["sh", "-c", f"sh -c '{spin}' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    orphan = int(out.stdout.strip())
    try:
        with ContentionWatch(every_s=0.5) as watch:
            time.sleep(1.5)
        # Two busy shells, one ours: "sh" counts the orphan's share of the cores only.
        assert 0.1 < watch.other_cpu.get("sh", 0.0) < 1.6
        assert watch.steal_s is None or watch.steal_s >= 0
    finally:
        child.kill()
        child.wait()
        os.kill(orphan, signal.SIGKILL)
