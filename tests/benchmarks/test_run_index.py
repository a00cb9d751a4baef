"""`benchmarks/index.jsonl`, the run log as data: every line validates against the schema
and says truly where its data is, the appendix in the docs is generated from it, and the
benchmark data git tracks stays small."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.api import index, pool


def test_every_line_validates_and_its_data_is_where_it_says() -> None:
    runs = index.read()
    assert runs
    assert {r.schema_ for r in runs} == {index.SCHEMA}
    assert index.problems(runs) == []
    # Every line with files outside the tree names the commit that has them.
    assert all(r.data.commit == index.RAW_RECORDS_COMMIT
               for r in runs if r.data.kept or not r.data.in_tree)


def test_the_run_log_is_the_generators_output() -> None:
    assert index.LOG_MD.read_text() == index.markdown(index.read()), (
        "regenerate it: python -m benchmarks.index --markdown > docs/benchmarks-log.md")


def test_a_results_line_round_trips(tmp_path) -> None:
    run = index.read()[0]
    out = tmp_path / "index.jsonl"
    index.write([run], out)
    assert index.read(out) == [run]


def test_a_folder_without_records_names_the_commit_that_has_them() -> None:
    kept = next(r for r in index.read()
                if r.kind == "multiturn-load" and r.data.in_tree)
    folder = index.ROOT / kept.data.path
    assert not (folder / "results.json.gz").exists()
    with pytest.raises(FileNotFoundError, match=f"git show {index.RAW_RECORDS_COMMIT[:12]}:"):
        pool.read_report(folder)


def test_tracked_benchmark_data_is_under_5_mb() -> None:
    git = shutil.which("git")
    if git is None or not (index.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run([git, "ls-files", "-z", "benchmarks"], cwd=index.ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    size = sum((index.ROOT / f).stat().st_size for f in files if f and (index.ROOT / f).exists())
    assert size < 5_000_000, f"benchmarks/ tracks {size / 1e6:.1f} MB"


def test_a_comparison_folder_is_indexed_from_its_summary(tmp_path) -> None:
    folder = index.ROOT / "benchmarks" / "compare" / "results" / "x-test"
    summary = {
        "schema": 1, "command": ["python", "-m", "benchmarks", "compare"], "commit": "abc",
        "machine": {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "gpu": "none"},
        "date": "2026-12-06T07:00:00+00:00", "workload": {"name": "agent"},
        "foreign_vllm_max": 0,
        "arms": {"kvagent": {"figures": {
            "requests": 8, "ttft_later_ms": {"p50": 100.4, "p90": 180.6}, "itl_p99_ms": 41.2,
            "goodput": {"both": {"fraction": 0.5}}}},
                 "affine-2": {"figures": {"requests": 0}}}}
    run = index.entry_from_compare(folder, summary)
    assert run.kind == "compare" and run.quiet is True and run.machine.gpu is None
    assert run.figures == {"workload": "agent", "kvagent.later_ttft_p50_ms": 100,
                           "kvagent.later_ttft_p90_ms": 181, "kvagent.itl_p99_ms": 41,
                           "kvagent.goodput_both": 0.5}
    assert run.data.path == "benchmarks/compare/results/x-test"
    assert index.Run.model_validate_json(run.line()) == run
