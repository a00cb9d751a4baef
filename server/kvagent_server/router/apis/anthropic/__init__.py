"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`) as chat completions.

A Messages request is checked as vLLM checks it (`validation`; its errors: `errors`) and
becomes the chat completions body vLLM's own `/v1/messages` builds from it (`request`),
so the prompt, the KV the router reuses and the greedy output are the ones vLLM would
serve; the chat answer becomes the message vLLM would return, whole (`output`) or as its
event stream (`stream`). Pure: no I/O.
"""

from kvagent_server.router.apis.anthropic.errors import ApiError, error_body, error_type
from kvagent_server.router.apis.anthropic.output import message_from_chat
from kvagent_server.router.apis.anthropic.request import count_tokens_chat, to_chat
from kvagent_server.router.apis.anthropic.stream import MessageStream

__all__ = ["ApiError", "MessageStream", "count_tokens_chat", "error_body", "error_type",
           "message_from_chat", "to_chat"]
