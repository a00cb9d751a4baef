"""`python -m benchmarks.multiturn.compare_runs` reads draws whose per-request records are out
of the tree: it stops with the command that restores them, not a traceback."""

from __future__ import annotations

import pytest

from benchmarks.api import RAW_RECORDS_COMMIT, compare_runs


@pytest.mark.parametrize("which", sorted(compare_runs.COMPARISONS))
def test_without_the_records_it_names_the_commit_that_has_them(
        which: str, capsys: pytest.CaptureFixture[str]) -> None:
    folders = {f for pair in compare_runs.COMPARISONS[which].values() for f in pair}
    if all((compare_runs.RESULTS / f / "results.json.gz").exists() for f in folders):
        pytest.skip("the records were restored here")
    assert compare_runs.cli([which]) == 2
    err = capsys.readouterr().err
    assert f"git show {RAW_RECORDS_COMMIT[:12]}:benchmarks/multiturn/results/" in err
