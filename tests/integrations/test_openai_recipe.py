"""The openai-python recipe (docs/openai-python.md, examples/openai_python.py) against a
scripted router: the session id goes in every request, each turn sends the previous
turn's token (as a header, then in the body), and the recipe reads tokens and cached
tokens back from openai-python's objects."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import httpx
from adapter_streams import ScriptedRouter, Sent, text_chunks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_python.py"


def load_recipe():
    spec = importlib.util.spec_from_file_location("kvagent_example_openai_python", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_recipe_carries_session_and_tokens() -> None:
    tokens = iter(["kva1.dDE.bTE", "kva1.dDI.bTI", "kva1.dDM.bTM", "kva1.dDQ.bTQ"])
    bodies: list[Sent] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent = Sent(headers=request.headers, body=json.loads(request.content))
        bodies.append(sent)
        chunks = text_chunks(f"answer {len(bodies)}", token=next(tokens),
                             cached=0 if len(bodies) == 1 else 100 * len(bodies))
        if sent.body.get("stream"):
            return ScriptedRouter(streams=[chunks])(request)
        # Non-streamed: one response object with the same usage and kvagent object.
        last = chunks[-1]
        return httpx.Response(200, json={
            "id": "chatcmpl-x", "object": "chat.completion", "created": 1,
            "model": "kvagent-demo",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": f"answer {len(bodies)}"}}],
            "usage": last["usage"], "kvagent": last["kvagent"]})

    recipe = load_recipe()
    cached = recipe.main("http://router.test/v1", "kvagent-demo",
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))

    assert cached == [0, 200, 300, 400]
    session_ids = {s.headers["x-session-id"] for s in bodies}
    assert len(session_ids) == 1
    # Turns 1-2 stream with the token as a header; turns 3-4 put it in the body.
    assert [s.headers.get("x-kvagent-cache-token") for s in bodies[:2]] == [None, "kva1.dDE.bTE"]
    assert bodies[0].body["stream_options"] == {"include_usage": True}
    assert bodies[2].body["kvagent"] == {"session_id": session_ids.pop(),
                                         "cache_token": "kva1.dDI.bTI"}
    assert bodies[3].body["kvagent"]["cache_token"] == "kva1.dDM.bTM"
    # The history is resent whole, each answer exactly as received.
    assert bodies[3].body["messages"][-2] == {"role": "assistant", "content": "answer 3"}
