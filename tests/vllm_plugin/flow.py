"""Client side of the P/D flow at the vLLM level (what a router does), for tests/benchmarks.

Uses /v1/completions with token-id prompts so that "turn 2 extends turn 1" is exact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx

MODEL = "kvagent-demo"
FRESH_P_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}


@dataclass
class DResult:
    token_ids: list[int]
    text: str
    final_chunk: dict[str, Any]
    kv_transfer_params: dict[str, Any] | None
    usage: dict[str, Any] | None


def p_leg(p_url: str, prompt: list[int], kv_params: dict[str, Any] | None = None,
          timeout: float = 600.0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prefill on P (max_tokens=1, non-streamed); returns P's response JSON.

    `extra` adds body fields, e.g. `{"cache_salt": "x"}` to bypass P's prefix cache.
    """
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "stream": False,
        "kv_transfer_params": dict(kv_params or FRESH_P_PARAMS),
        **(extra or {}),
    }
    r = httpx.post(p_url + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def p_leg_chat(p_url: str, messages: list[dict[str, Any]],
               kv_params: dict[str, Any] | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """The P leg of a chat turn (max_tokens=1, non-streamed)."""
    body = {
        "model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0,
        "stream": False, "kv_transfer_params": dict(kv_params or FRESH_P_PARAMS),
    }
    r = httpx.post(p_url + "/v1/chat/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def d_leg(d_url: str, prompt: list[int], p_params: dict[str, Any] | None, max_tokens: int,
          timeout: float = 600.0, extra: dict[str, Any] | None = None) -> DResult:
    """Decode on D, streamed; returns generated token ids and the final chunk's params."""
    body: dict[str, Any] = {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True, "ignore_eos": True, **(extra or {}),
    }
    if p_params is not None:
        body["kv_transfer_params"] = p_params
    return _stream(d_url + "/v1/completions", body, timeout)


def chat_stream(url: str, messages: list[dict[str, Any]], max_tokens: int,
                kv_params: dict[str, Any] | None = None, timeout: float = 600.0) -> DResult:
    """A streamed chat completion (the D leg of a chat turn)."""
    body: dict[str, Any] = {
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return _stream(url + "/v1/chat/completions", body, timeout)


def _stream(url: str, body: dict[str, Any], timeout: float) -> DResult:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
    ids: list[int] = []
    text = ""
    usage = None
    for c in chunks:
        for ch in c.get("choices", []):
            ids += ch.get("token_ids") or []
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
        usage = c.get("usage") or usage
    final = chunks[-1] if chunks else {}
    return DResult(ids, text, final, final.get("kv_transfer_params"), usage)


def plain(url: str, prompt: list[int], max_tokens: int, kv_params: dict[str, Any] | None = None,
          timeout: float = 600.0, extra: dict[str, Any] | None = None) -> DResult:
    """A streamed completion straight to one node (no P/D legs)."""
    body: dict[str, Any] = {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True, "ignore_eos": True, **(extra or {}),
    }
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return _stream(url + "/v1/completions", body, timeout)


def reuse_params(d_params: dict[str, Any], usable_tokens: int | None = None,
                 block_size: int | None = None) -> dict[str, Any]:
    """Turn D's returned params into a turn-2 P leg's params (optionally a shorter prefix).

    D returns `do_remote_decode: true` already; P treats it as "pull these blocks from D".
    To reuse only the first `usable_tokens` (block-aligned) tokens, cut
    `remote_block_ids` to that many blocks and set `remote_num_tokens`.
    """
    params = dict(d_params)
    if usable_tokens is not None:
        assert block_size
        n_blocks = usable_tokens // block_size
        params["remote_block_ids"] = [list(g)[:n_blocks] for g in params["remote_block_ids"]]
        params["remote_num_tokens"] = n_blocks * block_size
    return params


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|\+Inf)$")


def metric_sum(text: str, name: str) -> float:
    """Sum of all samples of metric `name` (any labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1) == name:
            total += float(m.group(3))
    return total
