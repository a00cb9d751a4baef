"""Node trace: where a turn's time goes inside the vLLM nodes, which the router cannot see.

`run --node-trace` starts every node with `hooks/` on `PYTHONPATH`; its `sitecustomize`
appends one JSON line per request stage (render, queue, NIXL pull, first token) to the
configuration's `node_trace/` folder. `timeline` (pure) pairs the events into requests and
P/D turns; `python -m benchmarks.multiturn.node_trace DIR` prints the table. Pairing a P
leg with its D leg by time assumes one turn at a time (`--concurrency 1`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

HOOKS_DIR = Path(__file__).resolve().parent / "hooks"
DIR_ENV = "KVAGENT_NODE_TRACE_DIR"


def node_env(out_dir: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that make nodes started from this process trace into
    `out_dir` (`PYTHONPATH` gains the hooks folder in front)."""
    env = os.environ if environ is None else environ
    path = [str(HOOKS_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path), DIR_ENV: str(out_dir)}


@contextlib.contextmanager
def tracing(out_dir: Path | None) -> Iterator[None]:
    """Nodes started inside trace into `out_dir` (created); None: a no-op."""
    if out_dir is None:
        yield
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = node_env(out_dir)
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
