"""Run a function right after a module is imported, without importing it early.

vLLM loads general plugins in every process (API server, engine core, workers). Importing
the OpenAI serving code in a worker, or NIXL in the API server, would only cost memory and
start-up time — and importing NIXL before vLLM does stops vLLM from setting
`UCX_RCACHE_MAX_UNRELEASED`. So each patch waits for its module to be imported by vLLM.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], Any]

_lock = threading.Lock()
_pending: dict[str, list[Hook]] = {}
_finder: _PostImportFinder | None = None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def __getattr__(self, attr: str) -> Any:
        # get_source, get_filename, is_package...: inspect and tracebacks rely on them.
        return getattr(self._inner, attr)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            hooks = _pending.pop(self._name, [])
        for hook in hooks:
            hook(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        with _lock:
            if fullname not in _pending:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, fullname)
                return spec
        return None


def when_imported(name: str, hook: Hook) -> None:
    """Call `hook(module)` once `name` is imported (now, if it already is)."""
    global _finder
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    with _lock:
        _pending.setdefault(name, []).append(hook)
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
