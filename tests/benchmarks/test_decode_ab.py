"""The decode A/B's pure parts: the round order, the paired summary, the sign test, the
report and its run-log line (the run itself needs two vLLM arms: a recorded benchmark)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.api import decode_ab, index


def test_the_order_reverses_every_other_round() -> None:
    targets = ("a", "b", "c")
    assert decode_ab.round_order(targets, 0) == ["a", "b", "c"]
    assert decode_ab.round_order(targets, 1) == ["c", "b", "a"]
    assert decode_ab.round_order(targets, 2) == ["a", "b", "c"]


def test_the_sign_test() -> None:
    assert decode_ab.sign_test_p([]) is None
    assert decode_ab.sign_test_p([0.0, 0.0]) is None  # ties only
    assert decode_ab.sign_test_p([1.0, -1.0]) == 1.0
    # 10 of 10 the same way: 2 / 2**10
    assert decode_ab.sign_test_p([0.5] * 10) == pytest.approx(2 / 1024)
    assert decode_ab.sign_test_p([0.5] * 9 + [-0.5]) == pytest.approx(2 * 11 / 1024)


def _samples() -> list[dict[str, Any]]:
    """Two streams a round: the node 1 ms/token slower than the base in every round but
    one, the router 0.5 slower in half of them; a failed stream in round 0."""
    out = []
    for r in range(8):
        base = 10.0 + r  # drift: every round slower than the last
        for target, tpot in (("aggregated", base), ("kvagent-node", base + (1.0 if r else -1.0)),
                             ("kvagent-router", base + (0.5 if r % 2 else -0.5))):
            for stream in range(2):
                out.append({"round": r, "streams": 2, "target": target, "stream": stream,
                            "tpot_ms": tpot + stream * 0.2, "ttft_ms": 30.0, "error": None})
    out.append({"round": 0, "streams": 2, "target": "kvagent-router", "stream": 2,
                "tpot_ms": None, "ttft_ms": None, "error": "HTTP 500"})
    return out


def test_targets_are_paired_round_by_round_with_the_base() -> None:
    s = decode_ab.summarize(_samples())["2"]
    node, router = s["paired"]["kvagent-node"], s["paired"]["kvagent-router"]
    assert node["rounds"] == 8 and node["median_diff_ms"] == 1.0
    assert node["mean_diff_ms"] == pytest.approx(0.75) and node["se_ms"] > 0
    assert node["slower_share"] == 7 / 8
    assert node["sign_test_p"] == pytest.approx(2 * 9 / 256)
    assert router["median_diff_ms"] == 0.0 and router["slower_share"] == 0.5
    assert router["sign_test_p"] == 1.0
    assert s["targets"]["kvagent-router"]["errors"] == 1
    assert s["targets"]["aggregated"]["n"] == 16
    assert s["paired"]["kvagent-node"]["ratio_p50"] > 1.0
    assert "aggregated" not in s["paired"]


def test_the_report_and_its_run_log_line(tmp_path: Any) -> None:
    s = {"benchmark": "decode-ab", "command": ["python", "-m", "benchmarks", "decode-ab"],
         "commit": "abc", "machine": {"cpu": "AMD EPYC", "cores": 2, "gpu": "none"},
         "date": "2026-12-08T01:00:00+00:00", "targets": list(decode_ab.TARGETS),
         "base": "aggregated", "rounds": 8, "streams": [2], "tokens": 96, "kv_gib": 4,
         "foreign_vllm_max": 0, "steal_s": 0.0, "other_cpu_s": {},
         "results": decode_ab.summarize(_samples())}
    md = decode_ab.report_md(s)
    assert "| kvagent-node |" in md and "+1.00" in md and "88% of 8" in md
    folder = index.ROOT / "benchmarks" / "compare" / "results" / "x-test-decode-ab"
    run = index.entry_from_decode_ab(folder, s)
    assert run.kind == "decode-ab" and run.quiet is True
    assert run.figures["2x.kvagent-node.paired_diff_ms"] == 1.0
    assert index.Run.model_validate_json(run.line()) == run
