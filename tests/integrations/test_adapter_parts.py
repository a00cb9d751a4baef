"""Images, audio and files in user messages pass through both adapters as OpenAI parts."""

from __future__ import annotations

import base64

import pytest
from kvagent import messages as kv

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


def test_langchain_user_parts_become_openai_parts() -> None:
    pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")
    from kvagent.integrations.langchain import _to_kvagent
    from langchain_core.messages import HumanMessage

    b64 = base64.b64encode(PNG).decode()
    msg = _to_kvagent(HumanMessage(content=[
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
        {"type": "image", "base64": b64, "mime_type": "image/png"},
        {"type": "audio", "base64": "UklGRg==", "mime_type": "audio/wav"},
        {"type": "file", "base64": b64, "mime_type": "application/pdf", "filename": "a.pdf"},
    ]))
    assert isinstance(msg, kv.UserMessage) and isinstance(msg.content, tuple)
    text, url_img, inline_img, audio, doc = msg.content
    assert isinstance(text, kv.TextPart) and text.text == "what is this?"
    assert isinstance(url_img, kv.ImagePart)
    assert url_img.image_url.url == "https://example.invalid/a.png"
    assert isinstance(inline_img, kv.ImagePart)
    assert inline_img.image_url.url == f"data:image/png;base64,{b64}"
    assert isinstance(audio, kv.AudioPart) and audio.input_audio.format == "wav"
    assert isinstance(doc, kv.FilePart) and doc.file.filename == "a.pdf"
    assert doc.file.file_data == f"data:application/pdf;base64,{b64}"


def test_langchain_text_blocks_stay_a_string() -> None:
    pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")
    from kvagent.integrations.langchain import _to_kvagent
    from langchain_core.messages import HumanMessage

    msg = _to_kvagent(HumanMessage(content=["a", {"type": "text", "text": "b"}]))
    assert msg.content == "ab"  # the same prompt a text-only request always sent


def test_langchain_unknown_block_is_a_clear_error() -> None:
    pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")
    from kvagent.integrations.langchain import _to_kvagent
    from langchain_core.messages import HumanMessage

    with pytest.raises(ValueError, match="unsupported content block type 'video'"):
        _to_kvagent(HumanMessage(content=[{"type": "video", "url": "x"}]))


def test_llamaindex_blocks_become_openai_parts() -> None:
    pytest.importorskip("llama_index.core", reason="extra kvagent[llamaindex] not installed")
    from kvagent.integrations.llamaindex import _to_kvagent
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ImageBlock,
        MessageRole,
        TextBlock,
    )

    msg = _to_kvagent(ChatMessage(role=MessageRole.USER, blocks=[
        TextBlock(text="describe"), ImageBlock(image=PNG, image_mimetype="image/png"),
        ImageBlock(url="https://example.invalid/b.png")]))
    assert isinstance(msg, kv.UserMessage) and isinstance(msg.content, tuple)
    text, inline, by_url = msg.content
    assert isinstance(text, kv.TextPart) and text.text == "describe"
    assert isinstance(inline, kv.ImagePart)
    assert inline.image_url.url == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert isinstance(by_url, kv.ImagePart)
    assert by_url.image_url.url == "https://example.invalid/b.png"
    plain = _to_kvagent(ChatMessage(role=MessageRole.USER, content="just text"))
    assert plain.content == "just text"
