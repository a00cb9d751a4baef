"""The node trace's pure parts: events to requests, requests to turns, the summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.api import node_trace, timeline


def _ev(t: float, node: str, ev: str, req: str, **extra: object) -> dict[str, object]:
    return {"t": t, "node": node, "pid": 1, "ev": ev, "req": req, **extra}


def _pd_turn(t0: float, p: str, d: str, *, pull: bool, computed: int = 800
             ) -> list[dict[str, object]]:
    """A P leg (optionally pulling from D) then the D leg that reads P's blocks."""
    out = [_ev(t0 + 0.008, "prefill-0", "rendered", p, arrived=t0),
           _ev(t0 + 0.010, "prefill-0", "sched_add", f"{p}-0a1b2c3d", prompt=900)]
    if pull:
        out += [_ev(t0 + 0.011, "prefill-0", "read_start", f"{p}-0a1b2c3d"),
                _ev(t0 + 0.014, "prefill-0", "remote_kv_done", f"{p}-0a1b2c3d")]
    out += [_ev(t0 + 0.015, "prefill-0", "sched_new", f"{p}-0a1b2c3d", tokens=100,
                computed=computed),
            _ev(t0 + 0.060, "prefill-0", "first_token", f"{p}-0a1b2c3d"),
            _ev(t0 + 0.061, "prefill-0", "api_output", f"{p}-0a1b2c3d"),
            _ev(t0 + 0.062, "prefill-0", "responded", p),
            _ev(t0 + 0.080, "decode-0", "rendered", d, arrived=t0 + 0.067),
            _ev(t0 + 0.082, "decode-0", "sched_add", f"{d}-ffff0000", prompt=900),
            _ev(t0 + 0.083, "decode-0", "read_start", f"{d}-ffff0000"),
            _ev(t0 + 0.086, "decode-0", "remote_kv_done", f"{d}-ffff0000"),
            _ev(t0 + 0.087, "decode-0", "sched_new", f"{d}-ffff0000", tokens=1, computed=899),
            _ev(t0 + 0.094, "decode-0", "first_token", f"{d}-ffff0000"),
            _ev(t0 + 0.0955, "decode-0", "api_output", f"{d}-ffff0000")]
    return out


def test_api_id_strips_only_the_engine_suffix() -> None:
    assert timeline.api_id("chatcmpl-abc-0a1b2c3d") == "chatcmpl-abc"
    assert timeline.api_id("chatcmpl-abc") == "chatcmpl-abc"
    assert timeline.api_id("chatcmpl-abc-notahex") == "chatcmpl-abc-notahex"


def test_a_pd_turn_and_a_d_direct_turn() -> None:
    events = _pd_turn(100.0, "chatcmpl-p1", "chatcmpl-d1", pull=True) + [
        _ev(200.010, "decode-0", "rendered", "chatcmpl-d2", arrived=200.0),
        _ev(200.012, "decode-0", "sched_add", "chatcmpl-d2-12345678", prompt=950),
        _ev(200.013, "decode-0", "sched_new", "chatcmpl-d2-12345678", tokens=50,
            computed=900),
        _ev(200.050, "decode-0", "first_token", "chatcmpl-d2-12345678"),
        # a first turn D computed whole: nothing cached, nothing read
        _ev(300.010, "decode-0", "rendered", "chatcmpl-d3", arrived=300.0),
        _ev(300.012, "decode-0", "sched_add", "chatcmpl-d3-87654321", prompt=950),
        _ev(300.013, "decode-0", "sched_new", "chatcmpl-d3-87654321", tokens=128,
            computed=0),
        _ev(300.400, "decode-0", "first_token", "chatcmpl-d3-87654321")]
    rows = timeline.turns(timeline.requests(sorted(events, key=lambda e: e["t"])))
    assert [r["path"] for r in rows] == ["pd_reuse", "d_direct", "d_fresh"]
    pd, dd, df = rows
    assert df["d_compute"] == pytest.approx(387) and df["total"] == pytest.approx(400)
    assert pd["p_render"] == pytest.approx(8) and pd["p_pull"] == pytest.approx(4)
    assert pd["p_compute"] == pytest.approx(46) and pd["p_to_api"] == pytest.approx(1)
    assert pd["p_answer"] == pytest.approx(1)
    assert pd["hop"] == pytest.approx(5)
    assert pd["d_render"] == pytest.approx(13) and pd["d_pull"] == pytest.approx(4)
    assert pd["d_first_token"] == pytest.approx(8) and pd["total"] == pytest.approx(94)
    assert pd["d_to_api"] == pytest.approx(1.5) and dd["d_to_api"] is None
    assert (pd["p_tokens"], pd["p_computed"]) == (100, 800)
    assert dd["d_render"] == pytest.approx(10) and dd["d_compute"] == pytest.approx(37)
    summ = timeline.summary(rows)
    assert summ["pd_reuse"]["n"] == 1 and summ["d_direct"]["total"]["p50"] == pytest.approx(50)
    assert summ["d_fresh"]["n"] == 1
    table = timeline.markdown(summ)
    assert "| pd_reuse (n=1) | hop |" in table and "| d_direct (n=1) | d_compute |" in table
    assert "| d_fresh (n=1) | d_compute |" in table


def test_a_p_leg_without_a_pull_and_the_latest_p_leg_pairs() -> None:
    events = (_pd_turn(100.0, "chatcmpl-p1", "chatcmpl-d1", pull=False, computed=0)
              + _pd_turn(101.0, "chatcmpl-p2", "chatcmpl-d2", pull=True))
    rows = timeline.turns(timeline.requests(sorted(events, key=lambda e: e["t"])))
    assert [r["path"] for r in rows] == ["pd_fresh", "pd_reuse"]
    assert [r["p_pull"] for r in rows] == [0.0, pytest.approx(4)]
    assert rows[0]["p_compute"] == pytest.approx(45)  # from its scheduling, no pull
    assert all(r["total"] == pytest.approx(94) for r in rows)


def test_a_d_leg_that_emits_ps_token_counts_from_the_step_that_received_the_kv() -> None:
    # D emits P's token in the step that reports the load done, before the next schedule
    # takes the request back (`remote_kv_done`).
    events = [e for e in _pd_turn(100.0, "chatcmpl-p1", "chatcmpl-d1", pull=False)
              if e["ev"] not in ("responded", "api_output")  # traces before those events
              and not (e["node"] == "decode-0" and e["ev"] == "first_token")]
    events += [_ev(100.0855, "decode-0", "kv_received", "chatcmpl-d1-ffff0000"),
               _ev(100.0856, "decode-0", "first_token", "chatcmpl-d1-ffff0000")]
    rows = timeline.turns(timeline.requests(sorted(events, key=lambda e: e["t"])))
    assert len(rows) == 1
    assert rows[0]["d_pull"] == pytest.approx(3.5)
    assert rows[0]["d_first_token"] == pytest.approx(0.1)
    assert rows[0]["p_answer"] is None and rows[0]["hop"] == pytest.approx(7)


def test_events_are_read_from_every_file_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    evs = _pd_turn(100.0, "chatcmpl-p1", "chatcmpl-d1", pull=True)
    (tmp_path / "prefill-0-1.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in evs if e["node"] == "prefill-0"))
    (tmp_path / "decode-0-2.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in evs if e["node"] == "decode-0") + '{"t": 1')
    got = timeline.read_events(tmp_path)
    assert len(got) == len(evs) and [e["t"] for e in got] == sorted(e["t"] for e in evs)


def test_tracing_sets_and_restores_the_node_env(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/x")
    monkeypatch.delenv(node_trace.DIR_ENV, raising=False)
    with node_trace.tracing(tmp_path / "t"):
        assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(node_trace.HOOKS_DIR), "/x"]
        assert os.environ[node_trace.DIR_ENV] == str(tmp_path / "t")
        assert (tmp_path / "t").is_dir()
    assert os.environ["PYTHONPATH"] == "/x" and node_trace.DIR_ENV not in os.environ
    hooks = (node_trace.HOOKS_DIR / "sitecustomize.py").read_text()
    assert f'os.environ.get("{node_trace.DIR_ENV}"' in hooks  # the same variable
