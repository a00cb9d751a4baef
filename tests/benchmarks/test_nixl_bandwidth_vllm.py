"""NIXL moves bytes intact between two processes on this machine (a small, bounded run of
benchmarks/nixl_bandwidth; the figures are the benchmark's, not asserted here)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.vllm]


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                    reason="NIXL is not installed (kvagent-server install-engine installs it)")
def test_nixl_pull_between_processes_arrives_intact() -> None:
    from benchmarks.api import measure_nixl

    result = measure_nixl("tcp,self,sm", 4 << 20, 256 << 10, repeats=2, timeout_s=120)
    assert "error" not in result, result
    assert result["data_ok"] is True
    assert len(result["times_s"]) == 2 and all(t > 0 for t in result["times_s"])


def test_the_single_copy_ceiling_arrives_intact() -> None:
    from benchmarks.api import measure_single_copy

    result = measure_single_copy(4 << 20, 256 << 10, repeats=2, timeout_s=120)
    assert "error" not in result, result
    assert result["data_ok"] is True and len(result["times_s"]) == 2
