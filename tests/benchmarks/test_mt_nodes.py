"""Configuration table and the foreign-vLLM guard of the multi-turn benchmark (no vLLM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from benchmarks.multiturn.nodes import (
    CONFIGS,
    REFERENCE_CONFIG,
    VLLM_MODULE,
    ContentionWatch,
    aggregated_args,
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
