"""OpenAI Responses (`/v1/responses`) as the chat completions the P and D legs serve.

vLLM 0.32 serves Responses by rendering `instructions` and the input items as chat messages
through the chat template, then parsing the output with the same reasoning and tool parsers
as chat. Building exactly those messages here keeps the prompt (and so the KV and the greedy
output) identical to vLLM's own `/v1/responses`, and the answer is rebuilt in its shape:
the same output items, usage, echoed request fields and stream events.

Where vLLM's behaviour is surprising it is kept on purpose, because the prompt must match:
a chained turn drops every `system` message of the history (instructions do not carry
over); a reasoning input item with `encrypted_content` is rejected. One difference is
deliberate: a turn chained by `previous_response_id` replays the previous output as a
client that keeps its own history resends it, function calls included (vLLM 0.32 replays
only its text), so both styles get one prompt and reuse each other's KV (`history`).
"""

from kvagent_server.router.apis.responses.errors import ApiError, responses_words
from kvagent_server.router.apis.responses.output import response_from_chat
from kvagent_server.router.apis.responses.request import history, to_chat
from kvagent_server.router.apis.responses.stream import ResponseStream

__all__ = ["ApiError", "ResponseStream", "history", "response_from_chat", "responses_words",
           "to_chat"]
