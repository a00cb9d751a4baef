"""`python -m benchmarks.multiturn.compare_runs` reproduces its recorded outputs from the
recorded results (the script reads the run folders' per-request records)."""

from __future__ import annotations

import pytest

from benchmarks.multiturn import compare_runs

RECORDED = {
    "run21": "20261204T235834Z-load-l2-p-legs-reported-seed16/compare_runs.txt",
    "late-p-idle-d": "20261205T004227Z-load-l2-late-p-idle-d-seed13/compare_runs.txt",
    "run22": "20261204T235834Z-load-l2-p-legs-reported-seed16/compare_runs-run22.txt",
}


@pytest.mark.parametrize("which", sorted(RECORDED))
def test_output_is_the_recorded_one(which: str, capsys: pytest.CaptureFixture[str]) -> None:
    compare_runs.main(which)
    assert capsys.readouterr().out == (compare_runs.RESULTS / RECORDED[which]).read_text()
