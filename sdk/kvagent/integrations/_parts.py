"""Framework content blocks as kvagent content parts (pure functions over plain data).

LangChain messages carry OpenAI-style dicts (`image_url`, `input_audio`, `file`) or its own
standard blocks (`image`/`audio`/`file` with `url`, or `base64`/`data` and `mime_type`);
LlamaIndex messages carry typed blocks. Both become the SDK's parts, sent unchanged on the
wire, so images reach the router exactly as a plain OpenAI client would send them.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from ..messages import AudioPart, ContentPart, FileData, FilePart, ImagePart, TextPart


def _data_url(data: str, mime_type: str | None) -> str:
    return data if data.startswith("data:") else f"data:{mime_type or 'application/octet-stream'};base64,{data}"


def part_from_dict(block: Mapping[str, Any]) -> ContentPart | None:
    """A LangChain content block as a part; None for a block that is not content (e.g. a
    tool-call block, which the message's `tool_calls` already hold)."""
    kind = block.get("type")
    if kind == "text":
        return TextPart(text=str(block.get("text", "")))
    if kind == "image_url":
        image = block["image_url"]
        return ImagePart.model_validate(
            {"image_url": {"url": image} if isinstance(image, str) else image})
    if kind == "input_audio":
        return AudioPart.model_validate({"input_audio": block["input_audio"]})
    if kind == "file" and isinstance(block.get("file"), Mapping):
        return FilePart.model_validate({"file": block["file"]})
    inline = block.get("base64") or (block.get("data") if block.get("source_type") in (
        None, "base64") else None)
    url = block.get("url") if block.get("source_type") in (None, "url") else None
    mime = block.get("mime_type")
    if kind == "image":
        if url:
            return ImagePart.from_url(str(url))
        if inline:
            return ImagePart.from_url(_data_url(str(inline), mime or "image/png"))
    if kind == "audio" and inline:
        fmt = (mime or "audio/wav").rsplit("/", 1)[-1]
        return AudioPart.model_validate({"input_audio": {"data": str(inline), "format": fmt}})
    if kind == "file" and inline:
        return FilePart(file=FileData(file_data=_data_url(str(inline), mime),
                                      filename=block.get("filename")))
    if kind in ("tool_use", "tool_call", "tool_call_chunk", "reasoning", "thinking"):
        return None
    raise ValueError(f"unsupported content block type {kind!r}")


def text_or_parts(parts: list[ContentPart]) -> str | tuple[ContentPart, ...]:
    """Text-only content stays a string (what a text request has always sent, so prefixes
    and the KV they name do not change); anything else stays parts."""
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return tuple(parts)


def bytes_part(kind: str, data: bytes, mime_type: str | None, name: str | None = None
               ) -> ContentPart:
    """Raw bytes of an image, audio clip or document as an inline part."""
    if kind == "image":
        return ImagePart.from_bytes(data, mime_type or "image/png")
    if kind == "audio":
        return AudioPart.from_bytes(data, (mime_type or "audio/wav").rsplit("/", 1)[-1])
    encoded = base64.b64encode(data).decode()
    return FilePart(file=FileData(file_data=_data_url(encoded, mime_type), filename=name))
