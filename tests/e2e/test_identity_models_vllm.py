"""KV identity on real vLLM with a LoRA adapter: switching adapter mid-session recomputes,
staying on one reuses; every greedy answer equals the recomputed one. (Images: the
vision-language model's tests in tests/models/test_vlm_vllm.py share its bundle.)

The bundle is built from the locally made adapter of `kvagent_server.models`; without it
(or without `lora_modules` in the bundle config) the test skips and says which is missing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import bundle_config, free_port, start_bundle, vllm_available

from .e2e_helpers import p2p_received

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

GREEDY: dict[str, Any] = {"temperature": 0.0}
SYSTEM = {"role": "system", "content": "You are a terse assistant for a payments platform. "
          "Answer in one sentence. " * 30}


class Served:
    def __init__(self, handle: Any, model: str) -> None:
        self.base_url = handle.base_url
        self.prefill_url = handle.prefill_urls[0]
        self.decode_url = handle.decode_urls[0]
        self.model = model


def _serve(run_dir: Path, **overrides: Any) -> Iterator[Served]:
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    router = {"port": free_port(), "skip_prefill_max_tokens": 0, **overrides.pop("router", {})}
    try:
        config = bundle_config(run_dir, max_model_len=4096, router=router, **overrides)
    except ValueError as exc:  # pydantic: a key this tree's bundle config does not know
        pytest.skip(f"bundle config cannot express {sorted(overrides)}: {exc}")
    handle, bundle = start_bundle(config)
    try:
        yield Served(handle, config.served_model_name or handle.model)
    finally:
        bundle.stop()


def _reference(s: Served, body: dict[str, Any]) -> str:
    """The request recomputed on D alone, fresh salt (asserted: nothing cached)."""
    r = httpx.post(f"{s.decode_url}/v1/chat/completions", timeout=600,
                   json={**body, "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return out["choices"][0]["message"]["content"] or ""


class Chat:
    def __init__(self, s: Served, messages: list[dict[str, Any]]) -> None:
        self.s, self.messages = s, messages
        self.session = uuid.uuid4().hex
        self.token: str | None = None

    def send(self, model: str) -> tuple[dict[str, Any], str, str]:
        body = {"model": model, "messages": list(self.messages), "max_tokens": 12, **GREEDY}
        headers = {"X-Session-ID": self.session}
        if self.token:
            headers["X-KVAgent-Cache-Token"] = self.token
        r = httpx.post(f"{self.s.base_url}/chat/completions", json=body, headers=headers,
                       timeout=600)
        assert r.status_code == 200, r.text
        out = r.json()
        self.token = out["kvagent"]["cache_token"]
        text = out["choices"][0]["message"]["content"] or ""
        self.messages.append({"role": "assistant", "content": text})
        return out["kvagent"], text, _reference(self.s, body)


# ------------------------------------------------------------------ LoRA adapter


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, str]]:
    mod = pytest.importorskip("kvagent_server.models.lora",
                              reason="no locally built LoRA adapter in this tree "
                                     "(kvagent_server.models.lora)")
    name = mod.DEMO_LORA_NAME
    # d_direct allowed for small deltas: a stale handle must not send the turn to D either
    for s in _serve(Path(tmp_path_factory.mktemp("identity-lora")),
                    lora_modules=[{"name": name}], router={"skip_prefill_max_tokens": 64}):
        yield s, name


def test_adapter_switch_recomputes_staying_reuses(lora: tuple[Served, str]) -> None:
    s, adapter = lora
    chat = Chat(s, [SYSTEM, {"role": "user", "content": "Why is checkout slow today?"}])
    kva, text, ref = chat.send(s.model)
    assert text == ref
    chat.messages.append({"role": "user", "content": "And then?"})
    received = p2p_received(s.prefill_url)
    kva, text, ref = chat.send(adapter)
    assert (kva["path"], kva["reason"], kva["reused_tokens"]) == (
        "recompute", "identity_changed:model", 0)
    assert text == ref
    assert p2p_received(s.prefill_url) == received, "P pulled base-model KV for the adapter"
    chat.messages.append({"role": "user", "content": "Shorter."})
    kva, text, ref = chat.send(adapter)
    assert kva["path"] in ("pd_reuse", "d_direct") and kva["reused_tokens"] > 0, kva
    assert text == ref
