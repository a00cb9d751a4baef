"""The multi-turn benchmark's quick mode end to end, on real vLLM nodes and the real router.

Checks structure and correctness only (every configuration asked for ran, the JSON
validates, the plot exists, kvagent reused KV on later turns, the reuse-off configuration
did not, greedy answers with reuse equal those without); never timings. A bounded slice:
kvagent and its reference, two of the four configurations. The other two start nodes the
suite starts elsewhere: `pd_noreuse_pcache_on` is `pd_noreuse_pcache_off` with one P flag
flipped, and `aggregated` is one stock node with the bundle's step flags; their command
lines are checked without starting them (tests/benchmarks/test_mt_nodes.py). The nodes run
eager (`-O0`, as every engine the suite starts: tests/support.py); the compiled default is
what the demo's test runs.
"""

from __future__ import annotations

import importlib.util

import pytest
from support import TEST_ENGINE_ARGS

from benchmarks.api import (
    BUDGET_PLOT_NAME,
    CONFIGS,
    JSON_NAME,
    PLOT_NAME,
    SUMMARY_NAME,
    BenchmarkReport,
    timeline,
)
from benchmarks.api import multiturn_main as main


def _vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


pytestmark = [
    pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600),
    pytest.mark.skipif(not _vllm_available(),
                       reason="vLLM is not installed (./dev test installs the CPU engine)"),
]


#: The configurations the slice runs, in the benchmark's own order.
SLICE = [name for name in CONFIGS if name not in ("pd_noreuse_pcache_on", "aggregated")]


def test_quick_mode_runs_the_configurations_asked_for(tmp_path) -> None:
    out = tmp_path / "results"
    rc = main(["--quick", "--out", str(out), "--node-trace", "--configs", ",".join(SLICE),
               *(f"--engine-arg={a}" for a in TEST_ENGINE_ARGS)])

    rep = BenchmarkReport.model_validate_json((out / JSON_NAME).read_text())
    failed = {c.name: (c.error, c.logs) for c in rep.configs if c.status != "ok"}
    assert not failed, failed
    assert rc == 0
    assert [c.name for c in rep.configs] == SLICE
    assert (out / PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / BUDGET_PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| kvagent | ok |" in (out / SUMMARY_NAME).read_text()

    by = {c.name: c for c in rep.configs}
    for c in rep.configs:
        assert c.summary is not None and c.summary.errors == 0, (c.name, c.error)
        assert c.summary.requests == 2 * 4
        assert [t.turn for t in c.per_turn] == [0, 1, 2, 3]
        assert all(r.prompt_tokens and r.ttft_s is not None for r in c.records)

    # The router's per-stage budget reached every routed record (Server-Timing is on in the
    # benchmark's bundles), and a P leg shows up only where there was one.
    for name in ("kvagent", "pd_noreuse_pcache_off"):
        for r in by[name].records:
            assert {"receive", "plan", "decode", "total"} <= r.stages_s.keys(), (name, r)
            assert ("prefill" in r.stages_s) == (r.path not in ("d_direct", "d_fresh")), (
                name, r)
            assert r.headers_s is not None and r.headers_s <= r.ttft_s
    budget_paths = {(b.config, b.path) for b in rep.time_budget}
    assert any(c == "kvagent" and p in ("pd_reuse", "d_direct") for c, p in budget_paths)
    kva = by["kvagent"].summary
    assert kva.reuse_rate_later_turns is not None and kva.reuse_rate_later_turns > 0
    assert kva.tokens.reused > 0
    assert all(r.got_cache_token for r in by["kvagent"].records)
    assert by["pd_noreuse_pcache_off"].summary.tokens.reused == 0
    # Greedy decoding: reusing KV must not change a single answer.
    assert rep.reference_config == "pd_noreuse_pcache_off"
    assert kva.answers_compared == 8 and kva.answers_matching_reference == 8

    # The node trace's hooks ran in the real nodes: every P/D turn of the no-reuse
    # configuration shows both legs, D's pull of P's KV and both first tokens.
    trace = out / "work" / "pd_noreuse_pcache_off" / "node_trace"
    rows = timeline.turns(timeline.requests(timeline.read_events(trace)))
    pd = [r for r in rows if r["path"] in ("pd_fresh", "pd_reuse")]
    assert len(pd) >= 8, rows
    assert all(r["d_pull"] is not None and r["p_compute"] > 0 and r["total"] > 0
               and r["p_answer"] is not None and r["d_to_api"] is not None
               for r in pd), pd
    # D emits P's token in the step that reports P's KV arrived, before the next schedule
    # takes the request back: the trace sees that token, not D's second one.
    d_legs = [q for q in timeline.requests(timeline.read_events(trace))
              if q.decode and q.at("read_start") is not None]
    assert any(q.at("first_token") <= q.at("remote_kv_done") for q in d_legs), d_legs
