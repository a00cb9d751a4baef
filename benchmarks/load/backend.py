"""Instant fake P and D nodes whose answers echo the session marker of their prompt.

    python -m benchmarks.load.backend P_PORT D_PORT    # from the repository root

The nodes are `tests/fakes/nodes.py`'s (vLLM's HTTP surface and NIXL's bookkeeping, no
compute). Consumed transfer records are dropped as they are read so the backend's own
memory stays flat over thousands of turns.
"""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

from benchmarks._fakes import FakeCluster, Reply, decode_ids, serve_pair

_MARKER_RE = re.compile(r"\[\[s=([\w.-]+) t=(\d+)\]\]")


def echo_reply(prompt_ids: list[int]) -> Reply:
    """`echo s=<session> t=<turn>` for the prompt's last marker, plus a little text."""
    found = _MARKER_RE.findall(decode_ids(prompt_ids))
    session, turn = found[-1] if found else ("?", "?")
    return Reply(content=f"echo s={session} t={turn}: " + "lorem ipsum dolor " * 4)


class PruningCluster(FakeCluster):
    """A FakeCluster that forgets what it no longer needs (long runs)."""

    def pull(self, puller: str, params: dict[str, Any], prompt: list[int],
             *, locally_cached: int = 0) -> int:
        got = super().pull(puller, params, prompt, locally_cached=locally_cached)
        key = (params.get("remote_engine_id", ""), params.get("remote_request_id", ""))
        held = self.retained.get(key)
        if held is not None and held.consumed_by is not None:
            del self.retained[key]
        wrong = [e for e in self.events if e.kind == "wrong_kv"]
        self.events = wrong  # keep only what a run must report
        return got


def make_cluster() -> PruningCluster:
    return PruningCluster(reply=echo_reply, lease_s=3600, prefix_cache=False,
                          chunk_chars=16)


async def main(p_port: int, d_port: int) -> None:
    await serve_pair(make_cluster(), p_port, d_port, bounded_logs=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
