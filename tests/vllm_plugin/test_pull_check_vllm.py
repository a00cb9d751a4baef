"""On real vLLM: P pulls from D only the blocks whose tokens its own prompt repeats (the
plugin's pull check, `vllm_plugin.pull_check`), so an offer the router did not verify can
never become wrong KV.

Each case makes a real D handle (a `d_direct`-shaped request straight to D, which retains
its blocks), offers its blocks to P with their token digests for a prompt that does or
does not repeat them, then runs the D leg on P's blocks and compares the answer with a
recompute (the prompt sent straight to P under a fresh `cache_salt`, greedy).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import httpx
import pytest
from kvagent_server.router.reuse import transfer
from kvagent_server.router.store.handle import Handle

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = {"temperature": 0.0, "max_tokens": 12}
RUNBOOK = " ".join(f"step {i}: drain the node, snapshot its queue, compare error budgets "
                   f"and roll back if p99 doubled." for i in range(40))


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _block_size(url: str) -> int:
    m = re.search(r'[{,]block_size="(\d+)"', httpx.get(f"{url}/metrics", timeout=10).text)
    assert m is not None, "the node reports no block size"
    return int(m.group(1))


def _held(b: Any, messages: list[dict[str, Any]]
          ) -> tuple[dict[str, Any], list[int], str, int]:
    """A turn on D that D retains: its params, its tokens (prompt + answer), its text and
    its prompt's length."""
    out = _post(b.decode_urls[0], {"model": b.model, "messages": messages, **GREEDY,
                                   "return_token_ids": True, "cache_salt": uuid.uuid4().hex,
                                   "kv_transfer_params": transfer.d_direct()})
    choice = out["choices"][0]
    return (out["kv_transfer_params"], out["prompt_token_ids"] + choice["token_ids"],
            choice["message"]["content"] or "", len(out["prompt_token_ids"]))


def _offer(params: dict[str, Any], tokens: list[int], block: int) -> dict[str, Any]:
    """P leg params that pull every whole block D holds, with their digests: the router's
    own `transfer.reuse_transfer_params` on a handle of the held turn."""
    handle = Handle(handle_id="h", tenant="t", session="s", decode_node="d0",
                    decode_epoch="e", kv_transfer_params=params, token_ids=tokens,
                    block_size=block, created_at=0.0, expires_at=0.0)
    retained = transfer.retained_tokens(handle)
    assert retained is not None, params
    return transfer.reuse_transfer_params(handle, retained // block * block)


def _through_p(b: Any, messages: list[dict[str, Any]], offer: dict[str, Any]
               ) -> tuple[int, int, str]:
    """P leg with `offer`, then the D leg on P's blocks: (tokens P verified, tokens P did
    not compute, D's answer)."""
    p = _post(b.prefill_urls[0], {"model": b.model, "messages": messages, "temperature": 0.0,
                                  "max_tokens": 1, "cache_salt": uuid.uuid4().hex,
                                  "kv_transfer_params": offer})
    params = p["kv_transfer_params"]
    cached = (p["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    d = _post(b.decode_urls[0], {"model": b.model, "messages": messages, **GREEDY,
                                 "cache_salt": uuid.uuid4().hex,
                                 "kv_transfer_params": params})
    return params[transfer.VERIFIED_KEY], cached, d["choices"][0]["message"]["content"] or ""


def _recompute(b: Any, messages: list[dict[str, Any]]) -> str:
    out = _post(b.prefill_urls[0], {"model": b.model, "messages": messages, **GREEDY,
                                    "cache_salt": uuid.uuid4().hex})
    return out["choices"][0]["message"]["content"] or ""


def test_p_pulls_only_what_its_prompt_repeats(kvagent_bundle: Any) -> None:
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    b = kvagent_bundle
    block = _block_size(b.decode_urls[0])
    first = [{"role": "system", "content": "Runbook. " + RUNBOOK},
             {"role": "user", "content": "The checkout service is slow."}]

    # An offer for another prompt (the system text differs from its first words): P
    # verifies no block, pulls nothing, and the answer is the recompute's.
    params, tokens, _, _ = _held(b, first)
    other = [{"role": "system", "content": "Playbook. " + RUNBOOK}, first[1]]
    verified, cached, text = _through_p(b, other, _offer(params, tokens, block))
    assert verified == 0 and cached == 0, (verified, cached)
    assert text == _recompute(b, other)

    # The next turn of the held conversation: P verifies at least the first prompt's
    # whole blocks, pulls them (it has nothing cached under a fresh salt), and the answer
    # is the recompute's.
    params, tokens, answer, prompt_len = _held(b, first)
    nxt = [*first, {"role": "assistant", "content": answer},
           {"role": "user", "content": "And if the queue is empty?"}]
    prompt_blocks = prompt_len // block * block
    verified, cached, text = _through_p(b, nxt, _offer(params, tokens, block))
    assert prompt_blocks > 0 and verified >= prompt_blocks, (verified, prompt_blocks)
    assert cached >= verified, (cached, verified)
    assert text == _recompute(b, nxt)
