"""The fake P/D nodes of the tests (the package `tests/fakes/`), for benchmarks: the one
place benchmarks reach the test fakes from.

A benchmark imports them from here (`from benchmarks._fakes import FakeCluster, Reply,
serve_pair`) and runs as a module from the repository root (`python -m
benchmarks.load.backend P_PORT D_PORT`); neither it nor this module edits `sys.path`.
The package is loaded under the name the tests import it by, `fakes`, so a test that
imports both `fakes` and a benchmark gets one package (one `FakeCluster`), whichever came
first.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PATH = Path(__file__).resolve().parents[1] / "tests" / "fakes"


def _load() -> ModuleType:
    loaded = sys.modules.get("fakes")
    if loaded is not None:
        if Path(loaded.__file__ or "").resolve().parent != PATH:
            raise ImportError(f"another module named fakes is loaded: {loaded.__file__}")
        return loaded
    spec = importlib.util.spec_from_file_location(
        "fakes", PATH / "__init__.py", submodule_search_locations=[str(PATH)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {PATH}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fakes"] = module  # before running it: it imports its own `fakes.nodes`
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == "fakes" or n.startswith("fakes.")]:
            del sys.modules[name]
        raise
    return module


_fakes = _load()
FakeCluster = _fakes.FakeCluster
Reply = _fakes.Reply
decode_ids = _fakes.decode_ids
serve_pair = _fakes.serve_pair

__all__ = ["PATH", "FakeCluster", "Reply", "decode_ids", "serve_pair"]
