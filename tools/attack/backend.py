"""The attack run's fake P/D pair (tests/fakes/nodes.py): short answers, except a prompt
holding LONG (a stream large enough to fill a non-reader's socket buffers) or HUGE (a
non-streamed answer over the router's read cap).

    python -m tools.attack.backend P_PORT D_PORT    # from the repository root
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from benchmarks._fakes import FakeCluster, Reply, decode_ids, serve_pair

#: The fake D's KV capacity in blocks: its kv_cache_usage_perc times this is what it pins.
KV_BLOCKS = 10_000_000


#: The non-streamed answer to a HUGE prompt: 2 MB, over the router's 1 MiB read cap. Sent
#: as prepared bytes: the fake's token bookkeeping for 2 M characters would stall its
#: event loop (both nodes) for about a second, which the well-behaved client would then
#: measure as if the router had stalled.
HUGE_ANSWER = json.dumps({
    "id": "chatcmpl-huge", "object": "chat.completion", "created": 0, "model": "fake-model",
    "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                 "message": {"role": "assistant", "content": "z" * 2_000_000}}],
}).encode()


def huge_answers(role: str, app: Any) -> Any:
    """D answers a non-streamed HUGE chat with `HUGE_ANSWER`; everything else is the
    fake node's."""
    if role != "decode":
        return app

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        if b"HUGE" in body and b'"stream": true' not in body and b'"stream":true' not in body:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(HUGE_ANSWER)).encode())]})
            await send({"type": "http.response.body", "body": HUGE_ANSWER})
            return None
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return dict(await receive())

        return await app(scope, replay, send)

    return asgi


def reply(prompt: list[int]) -> Reply:
    text = decode_ids(prompt[-64:])
    if "LONG" in text:
        return Reply(content="lorem ipsum " * 125_000)
    return Reply(content="ok " * 24)


async def main(p_port: int, d_port: int) -> None:
    # A (near-zero) pause per chunk yields to the fake's event loop: without it a stream
    # whose reader was cut keeps writing into a closed socket without ever yielding, and
    # the fake nodes (not the router) stall every other request.
    cluster = FakeCluster(reply=reply, lease_s=3600, prefix_cache=False, chunk_chars=64,
                          kv_blocks=KV_BLOCKS, token_delay_s=1e-6)
    await serve_pair(cluster, p_port, d_port, bounded_logs=True, wrap=huge_answers)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
