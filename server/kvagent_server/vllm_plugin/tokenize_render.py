"""Make `/tokenize` render a Mistral-tokenizer chat as `/v1/chat/completions` does.

The router learns a turn's prompt token ids from the prefill node's `/tokenize`. For a
model served with `--tokenizer-mode mistral`, vLLM 0.32's chat path first materialises each
assistant message's `tool_calls` (pydantic leaves a declared iterable as a lazy
`ValidatorIterator`) and cuts tool-call ids to Mistral's 9 characters; its `/tokenize`
path does neither, so any history with a tool call fails there ("tool_calls must be a
list") and every such turn recomputes. The patch runs the same two preparations before
`/tokenize` renders a chat, so both endpoints see the same prompt.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

logger = logging.getLogger("vllm.kvagent")

TARGET_MODULE = "vllm.entrypoints.serve.tokenize.serving"


def patch_module(module: ModuleType) -> bool:
    """Wrap `ServingTokenization.create_tokenize` (chat requests, Mistral tokenizer)."""
    cls = module.ServingTokenization
    original = cls.create_tokenize
    if is_wrapped(original):
        return False
    from vllm.utils.mistral import is_mistral_tokenizer
    from vllm.utils.mistral import mt as mistral

    @functools.wraps(original)
    async def create_tokenize(self: Any, request: Any, raw_request: Any) -> Any:
        if isinstance(request, module.TokenizeChatRequest) and is_mistral_tokenizer(
                self.renderer.tokenizer):
            mistral.maybe_serialize_tool_calls(request)
            mistral.truncate_tool_call_ids(request)
        return await original(self, request, raw_request)

    mark_wrapped(create_tokenize)
    cls.create_tokenize = create_tokenize
    return True
