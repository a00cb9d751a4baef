"""The kvagent router: an OpenAI-compatible front that reuses KV across turns on vLLM P/D.

Run it with `python -m kvagent_server.router`; build it in code with
`kvagent_server.router.http.app.create_app`.
"""
