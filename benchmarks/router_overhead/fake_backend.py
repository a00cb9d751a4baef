"""An instant fake P and D node pair (tests/fakes/nodes.py), served by uvicorn.

    python -m benchmarks.router_overhead.fake_backend P_PORT D_PORT    # from the repository root
"""

from __future__ import annotations

import asyncio
import sys

from benchmarks._fakes import FakeCluster, Reply, serve_pair


async def main(p_port: int, d_port: int) -> None:
    cluster = FakeCluster(reply=lambda prompt: Reply(content="ok " * 8), lease_s=3600,
                          prefix_cache=False)
    await serve_pair(cluster, p_port, d_port)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
