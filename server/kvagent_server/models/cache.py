"""Build-once model directories under the kvagent cache (`$KVAGENT_CACHE_DIR`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "KVAGENT_CACHE_DIR"
#: The file whose presence marks a finished build.
DONE_MARKER = "config.json"


def default_cache_dir() -> Path:
    """The parent directory of cached models: `$KVAGENT_CACHE_DIR` or `~/.cache/kvagent`."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kvagent"


def ensure_built(version: str, build: Callable[[Path], None], cache_dir: Path | None = None,
                 *, marker: str = DONE_MARKER) -> Path:
    """`cache_dir/version`, running `build(tmp)` first when it is not there yet.

    The build goes into a temporary sibling directory that is renamed into place, so a
    crashed or concurrent build never leaves a half-written model behind.
    """
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = parent / version
    if (target / marker).is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        for f in tmp.rglob("*"):
            f.chmod(0o755 if f.is_dir() else 0o644)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / marker).is_file():
                raise
            # Another process won the race; its build is identical.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
