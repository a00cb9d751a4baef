"""The attack run's fake P/D pair (tests/router/fakes.py): short answers, except a prompt
holding LONG (a stream large enough to fill a non-reader's socket buffers) or HUGE (a
non-streamed answer over the router's read cap).

    python benchmarks/attack/backend.py P_PORT D_PORT
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "router"))

from fakes import FakeCluster, Reply, decode_ids, serve_pair

#: The fake D's KV capacity in blocks: its kv_cache_usage_perc times this is what it pins.
KV_BLOCKS = 10_000_000


def reply(prompt: list[int]) -> Reply:
    text = decode_ids(prompt[-64:])
    if "HUGE" in text:
        return Reply(content="z" * 2_000_000)
    if "LONG" in text:
        return Reply(content="lorem ipsum " * 125_000)
    return Reply(content="ok " * 24)


async def main(p_port: int, d_port: int) -> None:
    # A (near-zero) pause per chunk yields to the fake's event loop: without it a stream
    # whose reader was cut keeps writing into a closed socket without ever yielding, and
    # the fake nodes (not the router) stall every other request.
    cluster = FakeCluster(reply=reply, lease_s=3600, prefix_cache=False, chunk_chars=64,
                          kv_blocks=KV_BLOCKS, token_delay_s=1e-6)
    await serve_pair(cluster, p_port, d_port, bounded_logs=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
