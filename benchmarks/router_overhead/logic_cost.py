"""The router's own per-turn work, without any HTTP: what the router adds beyond its hops.

One reuse turn's decisions and rewrites, in-process: parse the session and token, decode
the token, claim the handle, let the router's path policy decide on the turn's facts
(verify a 2,000-token prompt against the handle, choose the path and the P leg's
params), build both leg bodies, relay a 40-chunk stream through the scrubber, then mint
the next handle and token. Reported as microseconds per turn (median of several rounds).

    python benchmarks/router_overhead/logic_cost.py [--turns 2000] [--prompt 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator

from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.auth.tenancy import Tenant
from kvagent_server.router.http.request import session_and_token, validate
from kvagent_server.router.nodes.legs import decode_body, prefill_body
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.handle import Handle, new_handle_id
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.turns.policy import policy_for
from kvagent_server.router.turns.relay import Scrubber, SseRelay
from kvagent_server.router.turns.shapes import Capture, Final, TurnFacts, TurnPlan, TurnRequest

BLOCK = 128
TENANT = Tenant(name="t", cache_salt="salt", max_concurrent_streams=64)
#: The router's own policy: the cost model with P never skipped (every reuse pulls).
POLICY = policy_for(RouterSettings(policy={"name": "cost_model",
                                           "params": {"skip_prefill_max_tokens": 0}}))
P0 = Node(name="p0", url="http://p0", role="prefill", healthy=True)
D0 = Node(name="d0", url="http://d0", role="decode", healthy=True, epoch="1")


def d_params(n: int) -> dict:
    return {"do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "e",
            "remote_request_id": "r", "remote_host": "10.0.0.2", "remote_port": 5600,
            "remote_block_ids": [list(range(-(-n // BLOCK)))], "tp_size": 1, "dcp_size": 1,
            "pp_size": 1, "remote_num_tokens": n, "remote_blocks_expiry_time": 1.0,
            "transfer_mode": "pull"}


def stream_bytes(prompt: list[int]) -> bytes:
    out = []
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "prompt_token_ids": prompt,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    out.append(first)
    for i in range(38):
        out.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "tok "},
                                 "token_ids": [1000 + i], "finish_reason": None}]})
    out.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 38,
                                         "total_tokens": len(prompt) + 38},
                "kv_transfer_params": d_params(len(prompt) + 37)})
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in out) + (
        b"data: [DONE]\n\n")


async def one_turn(codec: TokenCodec, store: MemoryStore, token: str, prompt: list[int],
                   sse: bytes) -> str:
    headers = {"X-Session-ID": "s1", "X-KVAgent-Cache-Token": token}
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "x" * 200}] * 8}
    validate(body, chat=True)
    session, tok = session_and_token(headers, body)
    claims = codec.decode(tok, now=time.time())
    handle = await store.claim("t", claims.handle)
    req = TurnRequest.build(endpoint="/v1/chat/completions", body=body, tenant=TENANT,
                            session=session, token=tok)
    facts = TurnFacts(req=req, session=session, source="kvagent", handle=handle,
                      handle_node_healthy=True, handle_node_epoch="1", holder=D0,
                      p_first=P0, d_first=D0, d_holds=True, d_healthy=True,
                      prefill_block_size=BLOCK, prompt_ids=tuple(prompt), ids_gathered=True)
    plan = POLICY.decide(facts)
    assert isinstance(plan, TurnPlan) and plan.path == "pd_reuse"
    path, reused = plan.path, plan.reuse.reuse_tokens
    p_body = prefill_body(body, plan.prefill_params())
    d_body = decode_body(body, d_params(len(prompt)))
    assert p_body and d_body

    async def upstream() -> AsyncIterator[bytes]:
        for i in range(0, len(sse), 4096):
            yield sse[i:i + 4096]

    async def finalize(cap: Capture) -> Final:
        now = time.time()
        new = Handle(handle_id=new_handle_id(), tenant="t", session="s1", decode_node="d0",
                     decode_epoch="1", kv_transfer_params=cap.kv_params or {},
                     token_ids=cap.sequence or [], block_size=BLOCK, created_at=now,
                     expires_at=now + 400)
        await store.put(new)
        tok = codec.encode(tenant="t", session="s1", handle=new.handle_id, iat=int(now),
                           exp=int(now) + 400)
        return Final(kvagent={"cache_token": tok, "reused_tokens": reused,
                              "expires_in": 400, "path": path}, cached_tokens=reused)

    relay = SseRelay(Scrubber(keep_token_ids=False))
    out = [b async for b in relay.relay(upstream())]
    out.append(relay.tail(await finalize(relay.capture)))
    last = json.loads(out[-1].split(b"data: ")[-2])
    return last["kvagent"]["cache_token"]


async def main(turns: int, prompt_len: int) -> None:
    codec = TokenCodec(KeyRing.generate())
    store = MemoryStore()
    base = list(range(prompt_len - 100))
    prompt = base + list(range(100))
    sse = stream_bytes(prompt)
    now = time.time()
    h = Handle(handle_id=new_handle_id(), tenant="t", session="s1", decode_node="d0",
               decode_epoch="1", kv_transfer_params=d_params(len(base)), token_ids=base,
               block_size=BLOCK, created_at=now, expires_at=now + 400)
    await store.put(h)
    token = codec.encode(tenant="t", session="s1", handle=h.handle_id, iat=int(now),
                         exp=int(now) + 400)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(turns // 5):
            # each turn hands back a handle for the same prompt: replay it as the next one
            token = await one_turn(codec, store, token, prompt, sse)
            claims = codec.decode(token, now=time.time())
            handle = await store.claim("t", claims.handle)
            fresh = handle.model_copy(update={"handle_id": new_handle_id(),
                                              "token_ids": base,
                                              "kv_transfer_params": d_params(len(base))})
            await store.put(fresh)
            token = codec.encode(tenant="t", session="s1", handle=fresh.handle_id,
                                 iat=int(now), exp=int(now) + 400)
        rounds.append((time.perf_counter() - t0) / (turns // 5) * 1e6)
    print(f"router logic per reuse turn ({prompt_len}-token prompt, 40-chunk stream): "
          f"median {statistics.median(rounds):.0f} us, rounds {[round(r) for r in rounds]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--prompt", type=int, default=2000)
    a = ap.parse_args()
    asyncio.run(main(a.turns, a.prompt))
