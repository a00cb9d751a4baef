"""Adapters that put kvagent under other agent frameworks.

Each adapter lives in its own module and is imported only on demand, so ``import kvagent``
never needs a framework installed:

- ``kvagent.integrations.langchain``: ``ChatKVAgent``, a LangChain chat model
  (extra ``kvagent[langchain]``).
- ``kvagent.integrations.llamaindex``: ``KVAgentLLM``, a LlamaIndex function-calling LLM
  (extra ``kvagent[llamaindex]``).

Frameworks resend the whole conversation on every call and keep it in their own message
objects, so the adapters carry the cache token (and the session id it is bound to) on the
assistant message's metadata and send it again when that message is the last answer in
the next call's input.
"""
