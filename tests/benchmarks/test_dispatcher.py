"""`python -m benchmarks` names every benchmark, and runs each as its own module would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.api import BENCHMARKS, benchmarks_main

ROOT = Path(__file__).resolve().parents[2]
#: Processes a benchmark starts for itself, and the package's own entry point.
PARTS = {"benchmarks.__main__", "benchmarks.load.backend", "benchmarks.router_overhead.bare_proxy",
         "benchmarks.router_overhead.fake_backend", "benchmarks.multiturn.__main__"}
_MAIN_GUARD = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)


def _runnable_modules() -> set[str]:
    found = set()
    for path in (ROOT / "benchmarks").rglob("*.py"):
        if _MAIN_GUARD.search(path.read_text()) or path.name == "__main__.py":
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found.add(mod.removesuffix(".__main__") if path.name == "__main__.py"
                      and mod not in PARTS else mod)
    return found - PARTS


def test_every_runnable_benchmark_module_has_a_name() -> None:
    listed = {b.module for b in BENCHMARKS.values()}
    assert _runnable_modules() - listed == set(), "add them to benchmarks/__main__.py"
    assert listed - _runnable_modules() == set(), "listed but not runnable"


def test_help_lists_every_name_and_an_unknown_one_fails(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert benchmarks_main(["--help"]) == 0
    err = capsys.readouterr().err
    assert all(f"  {name} " in err for name in BENCHMARKS)
    assert benchmarks_main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_a_subcommand_runs_its_module_with_the_rest_of_the_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmarks_main(["node-trace", "--help"]) == 0
    assert "--json" in capsys.readouterr().out
    assert benchmarks_main(["node-trace", "--bogus"]) == 2
