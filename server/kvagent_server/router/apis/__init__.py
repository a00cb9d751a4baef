"""Client APIs besides chat completions, as translations to the chat completions the legs speak.

Each module is pure (no I/O): a request in another API's shape becomes the chat body the
P and D legs already serve, and the chat answer (whole, or the relayed stream's chunks)
becomes that API's answer. vLLM serves these APIs the same way (its `/v1/messages` builds
a chat request; its `/v1/responses` renders input items as chat messages), which is what
lets the router keep the prompt, and so the KV and the greedy output, identical.

- `anthropic`: Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`)
- `responses`: OpenAI Responses (`/v1/responses`)
- `sse`: reading the relayed chat stream, writing named events
"""
