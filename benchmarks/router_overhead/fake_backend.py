"""An instant fake P and D node pair (tests/router/fakes.py), served by uvicorn.

    python benchmarks/router_overhead/fake_backend.py P_PORT D_PORT
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "router"))

from fakes import FakeCluster, FakeNode, Reply


async def main(p_port: int, d_port: int) -> None:
    import uvicorn

    cluster = FakeCluster(reply=lambda prompt: Reply(content="ok " * 8), lease_s=3600,
                          prefix_cache=False)
    servers = []
    for role, port in (("prefill", p_port), ("decode", d_port)):
        node = FakeNode(cluster, role, 0)
        config = uvicorn.Config(node.app, host="127.0.0.1", port=port, log_level="warning",
                                access_log=False, backlog=4096)
        servers.append(uvicorn.Server(config))
    await asyncio.gather(*(s.serve() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
