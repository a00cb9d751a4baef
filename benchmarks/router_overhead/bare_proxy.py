"""The floor: a bare starlette + httpx pass-through to one node (no parsing, no P leg).

    python benchmarks/router_overhead/bare_proxy.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import sys

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

UPSTREAM = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8200"
client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, keepalive_expiry=4),
                           timeout=60)


async def proxy(request: Request) -> StreamingResponse:
    upstream = client.build_request("POST", f"{UPSTREAM}{request.url.path}",
                                    content=await request.body(),
                                    headers={"content-type": "application/json"})
    resp = await client.send(upstream, stream=True)
    return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                             media_type="text/event-stream", background=BackgroundTask(resp.aclose))


app = Starlette(routes=[Route("/v1/chat/completions", proxy, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                access_log=False)
