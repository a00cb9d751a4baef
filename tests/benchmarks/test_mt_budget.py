"""The multi-turn benchmark's time budget: segments add up to TTFT, grouped per path."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.api import (
    SEGMENTS,
    RequestRecord,
    budgets,
    markdown_table,
    plot_time_budget,
    segments,
)


def _rec(turn: int, path: str | None, ttft: float, headers: float,
         stages: dict[str, float], config: str = "kvagent", error: str | None = None
         ) -> RequestRecord:
    return RequestRecord(config=config, conversation="c0", turn=turn, start_s=0.0,
                         ttft_s=ttft, headers_s=headers, stages_s=stages, path=path,
                         error=error)


ROUTED = {"receive": 0.001, "tokenize": 0.012, "plan": 0.002, "prefill": 0.050,
          "decode": 0.004, "total": 0.071}


def test_segments_add_up_to_ttft() -> None:
    seg = segments(_rec(1, "pd_reuse", ttft=0.200, headers=0.075, stages=ROUTED))
    assert seg is not None
    assert sum(seg.values()) == pytest.approx(0.200)
    assert seg["router_other"] == pytest.approx(0.071 - 0.069)
    assert seg["outside"] == pytest.approx(0.004)
    assert seg["first_token"] == pytest.approx(0.125)
    direct = segments(_rec(1, None, ttft=0.150, headers=0.010, stages={}))
    assert direct is not None and direct["outside"] == 0.010
    assert direct["first_token"] == pytest.approx(0.140) and direct["prefill"] == 0.0
    assert segments(_rec(1, None, 0.1, 0.01, {}, error="boom")) is None


def test_budgets_per_config_and_path_later_turns(tmp_path: Path) -> None:
    recs = [_rec(0, "pd_fresh", 1.0, 0.5, ROUTED),  # first turn: left out
            _rec(1, "pd_reuse", 0.200, 0.075, ROUTED),
            _rec(2, "pd_reuse", 0.300, 0.075, ROUTED),
            _rec(1, "d_direct", 0.100, 0.030, {**ROUTED, "prefill": 0.0, "total": 0.021}),
            _rec(1, None, 0.150, 0.010, {}, config="aggregated")]
    rows = {(b.config, b.path): b for b in budgets(recs)}
    assert set(rows) == {("kvagent", "pd_reuse"), ("kvagent", "d_direct"),
                         ("aggregated", "direct")}
    reuse = rows[("kvagent", "pd_reuse")]
    assert reuse.n == 2 and reuse.ttft_mean_s == pytest.approx(0.25)
    assert sum(reuse.segments_s[s] for s in SEGMENTS) == pytest.approx(reuse.ttft_mean_s)
    assert len(budgets(recs, later_turns=False)) == 4
    table = markdown_table(list(rows.values()))
    assert table[0].startswith("| config | path |") and len(table) == 5
    out = tmp_path / "b.png"
    plot_time_budget(list(rows.values()), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
