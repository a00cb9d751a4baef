"""The neutral data model of a conversation: what was said, by whom, with which tool calls.

Messages are frozen so a history prefix cannot change under the session's feet: KV reuse
depends on every earlier message being sent byte-for-byte the same on the next turn. The
mapping to OpenAI's wire format lives in ``_wire.py``.
"""

from __future__ import annotations

import base64
import json
import mimetypes
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_serializer


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ----------------------------------------------------------------------- content parts


class _Part(BaseModel):
    """OpenAI content-part shapes. Unknown fields (a server's extensions, e.g. vLLM's
    ``uuid``) are kept, and only the fields that were given are dumped, so a part goes to
    the server exactly as it was written: the same bytes every turn."""

    model_config = ConfigDict(frozen=True, extra="allow")

    @model_serializer(mode="wrap")
    def _only_given(self, handler: Any) -> Any:
        data = handler(self)
        return {k: v for k, v in data.items() if k in self.model_fields_set or k == "type"
                or k in (self.model_extra or {})}


class TextPart(_Part):
    """A piece of text."""

    type: Literal["text"] = "text"
    text: str


class ImageURL(_Part):
    """Where the image is: a URL the server fetches, or the bytes inline."""

    #: ``https://...`` or a ``data:image/png;base64,...`` URL.
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Part):
    """An image (``image_url``)."""

    type: Literal["image_url"] = "image_url"
    image_url: ImageURL

    @classmethod
    def from_url(cls, url: str, detail: Literal["auto", "low", "high"] | None = None
                 ) -> ImagePart:
        image = ImageURL(url=url) if detail is None else ImageURL(url=url, detail=detail)
        return cls(image_url=image)

    @classmethod
    def from_bytes(cls, data: bytes, mime_type: str = "image/png") -> ImagePart:
        """Inline image bytes as a ``data:`` URL (the server never has to fetch anything)."""
        return cls.from_url(_data_url(data, mime_type))

    @classmethod
    def from_file(cls, path: str | Path) -> ImagePart:
        mime = mimetypes.guess_type(str(path))[0] or "application/octet-stream"
        return cls.from_bytes(Path(path).read_bytes(), mime)


class InputAudio(_Part):
    """Inline audio and its format (``wav``, ``mp3``, ...)."""

    #: Base64-encoded audio.
    data: str
    format: str


class AudioPart(_Part):
    """Audio (``input_audio``)."""

    type: Literal["input_audio"] = "input_audio"
    input_audio: InputAudio

    @classmethod
    def from_bytes(cls, data: bytes, format: str = "wav") -> AudioPart:
        return cls(input_audio=InputAudio(data=base64.b64encode(data).decode(), format=format))


class FileData(_Part):
    """A file: inline data, or an uploaded file's id."""

    #: Base64 data (often a ``data:`` URL), or the id of an uploaded file.
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Part):
    """A file (``file``), e.g. a PDF."""

    type: Literal["file"] = "file"
    file: FileData


ContentPart = Annotated[TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]


def _data_url(data: bytes, mime_type: str) -> str:
    return f"data:{mime_type};base64,{base64.b64encode(data).decode()}"


class SystemMessage(_Message):
    """Instructions that open the conversation."""

    role: Literal["system"] = "system"
    content: str


class UserMessage(_Message):
    """A user turn: text, or OpenAI content parts (text, images, audio, files)."""

    role: Literal["user"] = "user"
    content: str | tuple[ContentPart, ...]

    @property
    def text(self) -> str:
        """The text of the message (its text parts joined when it has parts)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class ToolCall(_Message):
    """One function call the model asked for; ``arguments`` is the JSON text it produced.

    The raw text is kept (not re-serialised) so the call goes back to the server exactly as
    the model wrote it.
    """

    id: str
    name: str
    arguments: str = "{}"

    def parsed_arguments(self) -> Any:
        """``arguments`` decoded as JSON (raises ``ValueError`` when the model wrote junk)."""
        return json.loads(self.arguments or "{}")


class AssistantMessage(_Message):
    """A model answer: text, tool calls, or both, plus the cache token it came with."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    #: The router's cache-location token for the KV of everything up to this message.
    cache_token: str | None = None
    #: Wall-clock time after which the router no longer honours ``cache_token``.
    cache_token_expires_at: datetime | None = None
    finish_reason: str | None = None
    #: The model's reasoning (``reasoning_content``/``reasoning`` deltas). Sent back to the
    #: server only under ``reasoning_history="send"``; see the SDK guide.
    reasoning: str | None = None


class ToolResultMessage(_Message):
    """What a tool returned (or the error it raised), answering one ``ToolCall``."""

    role: Literal["tool"] = "tool"
    tool_call_id: str
    content: str
    name: str | None = None
    is_error: bool = False


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolResultMessage,
    Field(discriminator="role"),
]

#: Validates/dumps a list of messages (used by persistence).
MessageList: TypeAdapter[list[Message]] = TypeAdapter(list[Message])

#: What ``send()`` accepts as a user turn besides a message: text or a list of parts.
UserContent = str | Sequence[ContentPart | dict[str, Any]]

__all__ = [
    "AssistantMessage",
    "AudioPart",
    "ContentPart",
    "FileData",
    "FilePart",
    "ImagePart",
    "ImageURL",
    "InputAudio",
    "Message",
    "MessageList",
    "SystemMessage",
    "TextPart",
    "ToolCall",
    "ToolResultMessage",
    "UserContent",
    "UserMessage",
]
