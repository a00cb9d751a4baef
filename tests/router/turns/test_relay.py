"""The SSE relay and the final-chunk rewrite, without any network."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from kvagent_server.router.turns.relay import Scrubber, SseRelay, rewrite_response
from kvagent_server.router.turns.shapes import Capture, Final

KV = {"do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "eng-d",
      "remote_request_id": "r1", "remote_host": "10.0.0.9", "remote_port": 5601,
      "remote_block_ids": [[7, 8]], "tp_size": 1, "dcp_size": 1, "pp_size": 1,
      "remote_num_tokens": 20, "remote_blocks_expiry_time": 123.4, "transfer_mode": "pull"}


def sse(*objs: object) -> bytes:
    out = b""
    for obj in objs:
        out += b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return out


def chunk(content: str | None = None, *, ids: list[int] | None = None, finish: str | None = None,
          **extra: object) -> dict:
    choice: dict = {"index": 0, "delta": {"content": content} if content else {},
                    "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [choice], **extra}


def usage_chunk(**extra: object) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [], "usage": {"prompt_tokens": 18, "completion_tokens": 3,
                                     "total_tokens": 21,
                                     "prompt_tokens_details": {"cached_tokens": 99}}, **extra}


STREAM = sse(chunk("", ids=[], prompt_token_ids=list(range(18))), chunk("He", ids=[40, 41]),
             chunk("y", ids=[42]), chunk(None, ids=[5], finish="stop"),
             usage_chunk(kv_transfer_params=KV), b"[DONE]")


def ids_hidden(evs: list[dict | str]) -> bool:
    """No token ids reach a client that did not ask: the fields vLLM writes stay `null`."""
    for e in evs:
        if isinstance(e, dict):
            holders = [e, *e.get("choices", [])]
            if any(h.get(k) is not None for h in holders
                   for k in ("token_ids", "prompt_token_ids")):
                return False
    return True


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def events(raw: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


async def run(data: bytes | AsyncIterator[bytes], size: int, *, keep_ids: bool = False,
              keep_usage: bool = True) -> tuple[bytes, list[Capture]]:
    seen: list[Capture] = []

    async def finalize(cap: Capture) -> Final:
        seen.append(cap)
        return Final(kvagent={"cache_token": "tok", "reused_tokens": 16, "expires_in": 9,
                              "path": "pd_reuse"}, cached_tokens=16)

    relay = SseRelay(Scrubber(keep_token_ids=keep_ids, keep_usage=keep_usage))
    source = pieces(data, size) if isinstance(data, bytes) else data
    out = b"".join([b async for b in relay.relay(source)])
    assert b"kvagent" not in out  # the relay settles nothing: the tail waits for it
    return out + relay.tail(await finalize(relay.capture)), seen


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
async def test_final_chunk_rewritten_whatever_the_split(size: int) -> None:
    out, seen = await run(STREAM, size)
    evs = events(out)
    assert evs[-1] == "[DONE]"
    last = evs[-2]
    assert isinstance(last, dict)
    assert last["kvagent"]["cache_token"] == "tok"
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert b"kv_transfer_params" not in out and ids_hidden(evs)
    assert "prompt_token_ids" in evs[0] and "token_ids" in evs[1]["choices"][0]  # as vLLM
    assert b"10.0.0.9" not in out and b"eng-d" not in out
    assert [e["choices"][0]["delta"].get("content") for e in evs[1:3]] == ["He", "y"]
    assert len(seen) == 1
    cap = seen[0]
    assert cap.kv_params == KV
    assert cap.sequence == [*range(18), 40, 41, 42, 5]
    assert cap.finish_reason == "stop"


async def test_token_ids_kept_when_client_asked() -> None:
    out, _ = await run(STREAM, 50, keep_ids=True)
    evs = events(out)
    assert evs[0]["prompt_token_ids"] == list(range(18))
    assert evs[1]["choices"][0]["token_ids"] == [40, 41]
    assert b"kv_transfer_params" not in out


@pytest.mark.parametrize("size", [1, 50, 100_000])
async def test_kvagent_on_finish_chunk_when_usage_not_asked(size: int) -> None:
    """No usage chunk, and no chunk without choices: clients index `choices[0]`."""
    out, seen = await run(STREAM, size, keep_usage=False)
    evs = events(out)
    assert evs[-1] == "[DONE]" and len(evs) == 5
    assert all(e["choices"] and "usage" not in e for e in evs[:-1])
    last = evs[-2]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["kvagent"]["path"] == "pd_reuse"
    assert all("kvagent" not in e for e in evs[:-2])
    assert len(seen) == 1 and seen[0].sequence == [*range(18), 40, 41, 42, 5]


async def test_fingerprint_moves_to_finish_chunk_when_usage_not_asked() -> None:
    """vLLM stamps `system_fingerprint` on the finish chunk when no usage chunk follows."""
    data = sse(chunk("a", ids=[1]), chunk(None, ids=[5], finish="length"),
               usage_chunk(kv_transfer_params=KV, system_fingerprint="fp-1"), b"[DONE]")
    evs = events((await run(data, 9, keep_usage=False))[0])
    assert evs[-2]["system_fingerprint"] == "fp-1" and "system_fingerprint" not in evs[0]


async def test_several_choices_kvagent_on_the_last_finish_chunk() -> None:
    """n > 1: only the last finish chunk is held, and the order of chunks is kept."""
    def of(index: int, content: str | None, finish: str | None = None) -> dict:
        c = chunk(content, ids=[index], finish=finish)
        c["choices"][0]["index"] = index
        return c

    data = sse(of(0, "a"), of(1, "b"), of(0, None, "stop"), of(1, "c"), of(1, None, "length"),
               usage_chunk(kv_transfer_params=KV), b"[DONE]")
    out, seen = await run(data, 11, keep_usage=False)
    evs = events(out)
    assert [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in evs[:-1]] == [
        (0, None), (1, None), (0, "stop"), (1, None), (1, "length")]
    assert [("kvagent" in e) for e in evs[:-1]] == [False] * 4 + [True]
    assert len(seen) == 1 and seen[0].choices == {0, 1}


async def test_held_finish_chunk_released_when_stream_ends_without_done() -> None:
    async def source() -> AsyncIterator[bytes]:
        yield sse(chunk("a", ids=[1]), chunk(None, ids=[5], finish="stop"))

    evs = events((await run(source(), 0, keep_usage=False))[0])
    assert [e["choices"][0]["finish_reason"] for e in evs] == [None, "stop"]


async def test_params_on_finish_chunk_and_no_usage_chunk() -> None:
    data = sse(chunk("a", ids=[1]), chunk(None, ids=[5], finish="stop", kv_transfer_params=KV),
               b"[DONE]")
    out, seen = await run(data, 3)
    evs = events(out)
    assert evs[-1] == "[DONE]"
    # Usage was asked for but none came: a usage-shaped chunk carries `kvagent`.
    assert evs[-2]["choices"] == [] and evs[-2]["kvagent"]["cache_token"] == "tok"
    assert evs[-2]["id"] == "c1" and evs[-2]["model"] == "m"
    assert seen[0].kv_params == KV and b"remote_host" not in out
    # Not asked for: the finish chunk carries it, and no choice-less chunk is added.
    out, seen = await run(data, 3, keep_usage=False)
    evs = events(out)
    assert len(evs) == 3 and evs[1]["choices"][0]["finish_reason"] == "stop"
    assert evs[1]["kvagent"]["cache_token"] == "tok" and seen[0].kv_params == KV


async def test_upstream_cut_propagates() -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield sse(chunk("a", ids=[1]))
        raise ConnectionResetError("cut")

    got: list[bytes] = []
    relay = SseRelay(Scrubber(keep_token_ids=False))
    with pytest.raises(ConnectionResetError):
        async for b in relay.relay(broken()):
            got.append(b)
    assert len(got) == 1 and b"[DONE]" not in got[0]


async def test_comments_and_keepalives_dropped() -> None:
    data = b": ping\n\n" + sse(chunk("a")) + b"event: x\n\n" + sse(usage_chunk(), b"[DONE]")
    out, _ = await run(data, 5)
    assert b"ping" not in out
    assert [e if isinstance(e, str) else "obj" for e in events(out)] == ["obj", "obj", "[DONE]"]


def test_non_streamed_rewrite() -> None:
    body = {"id": "c", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call1", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]},
         "finish_reason": "tool_calls", "token_ids": [1, 2], "logprobs": {"content": []}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        "prompt_token_ids": [9, 9, 9, 9], "kv_transfer_params": KV}
    s = Scrubber(keep_token_ids=False, stream=False)
    s.scrub(body)
    out = rewrite_response(body, s, Final(kvagent={"path": "pd_fresh"}, cached_tokens=0))
    assert s.capture.sequence == [9, 9, 9, 9, 1, 2]
    assert s.capture.tool_names == ["f"] and s.capture.finish_reason == "tool_calls"
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
    assert out["choices"][0]["logprobs"] == {"content": []}
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # The keys stay, `null`, as vLLM writes them when nothing was asked or transferred.
    assert out["choices"][0]["token_ids"] is None and out["prompt_token_ids"] is None
    assert out["kv_transfer_params"] is None
    assert out["kvagent"] == {"path": "pd_fresh"}


@pytest.mark.parametrize("compact", [True, False])
async def test_fast_path_matches_json_path(compact: bool) -> None:
    """Pattern-scrubbed chunks equal the JSON-path result, whatever vLLM's spacing."""
    seps = (",", ":") if compact else (", ", ": ")
    chunks = [chunk("", ids=[], prompt_token_ids=[7, 8]), chunk('a "quoted", "token_ids":[1]',
                                                                 ids=[40, 41]),
              chunk("b", ids=[]), chunk(None, ids=[5], finish="length"),
              usage_chunk(kv_transfer_params=KV)]
    data = b"".join(b"data: " + json.dumps(c, separators=seps).encode() + b"\n\n"
                    for c in chunks) + b"data: [DONE]\n\n"
    out, seen = await run(data, 10_000)
    evs = events(out)
    assert evs[1]["choices"][0]["delta"]["content"] == 'a "quoted", "token_ids":[1]'
    assert all(e["choices"][0]["token_ids"] is None for e in evs[:4]) and ids_hidden(evs)
    assert seen[0].sequence == [7, 8, 40, 41, 5] and seen[0].finish_reason == "length"


async def test_second_choice_tokens_not_mixed_into_choice_zero() -> None:
    other = chunk("z", ids=[99])
    other["choices"][0]["index"] = 1
    data = sse(chunk("", ids=[], prompt_token_ids=[1]), chunk("a", ids=[2]), other,
               usage_chunk(kv_transfer_params=KV), b"[DONE]")
    _, seen = await run(data, 10_000)
    assert seen[0].output_token_ids == [2] and seen[0].sequence is None  # n > 1: no handle


@pytest.mark.parametrize("size", [5, 100_000])
async def test_chunks_carrying_only_token_ids_dropped_unless_asked(size: int) -> None:
    """With `return_token_ids` vLLM also sends a chunk for tokens a tool-call parser holds
    back (empty delta); a client that did not ask for ids would never see those."""
    empty = chunk(None, ids=[7])
    empty["choices"][0]["logprobs"] = None
    data = sse(chunk("", ids=[], prompt_token_ids=[1, 2]), empty, chunk("a", ids=[8]),
               empty, chunk(None, ids=[5], finish="tool_calls"),
               usage_chunk(kv_transfer_params=KV), b"[DONE]")
    out, seen = await run(data, size)
    evs = events(out)
    assert len(evs) == 5 and [e["choices"][0]["delta"] for e in evs[1:3]] == [
        {"content": "a"}, {}]  # the finish chunk keeps its empty delta
    assert evs[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert seen[0].sequence == [1, 2, 7, 8, 7, 5]  # their ids still count
    out, _ = await run(data, size, keep_ids=True)
    assert len(events(out)) == 7


@pytest.mark.parametrize("compact", [True, False])
async def test_the_tools_a_streamed_answer_calls_are_captured(compact: bool) -> None:
    """How the turn ended (retention weighs it): each call names its function in its first
    delta; later deltas carry only arguments. Another choice's calls are not choice 0's."""
    seps = (",", ":") if compact else (", ", ": ")

    def call(k: int, name: str | None, args: str, index: int = 0) -> dict:
        fn = {"arguments": args} if name is None else {"name": name, "arguments": args}
        c = chunk(None, ids=[k])
        c["choices"][0]["index"] = index
        c["choices"][0]["delta"] = {"tool_calls": [
            {"index": k, **({"id": f"call{k}", "type": "function"} if name else {}),
             "function": fn}]}
        return c

    chunks = [chunk("", ids=[], prompt_token_ids=[1]), call(0, "search", ""),
              call(0, None, '{"q":'), call(0, None, '"x"}'), call(1, "fetch", "{}"),
              call(0, "elsewhere", "{}", index=1), chunk(None, ids=[5], finish="tool_calls"),
              usage_chunk(kv_transfer_params=KV)]
    data = b"".join(b"data: " + json.dumps(c, separators=seps).encode() + b"\n\n"
                    for c in chunks) + b"data: [DONE]\n\n"
    out, seen = await run(data, 10_000)
    assert seen[0].tool_names == ["search", "fetch"]
    assert seen[0].finish_reason == "tool_calls"
    names = [tc["function"].get("name") for e in events(out) if isinstance(e, dict)
             for c in e["choices"] for tc in (c.get("delta") or {}).get("tool_calls") or ()]
    assert names == ["search", None, None, "fetch", "elsewhere"]  # relayed as they came
    _, seen = await run(STREAM, 7)
    assert seen[0].tool_names == [] and seen[0].finish_reason == "stop"
