"""The fakes tests run kvagent against when no real engine is needed (a unit-test seam).

- `fakes.nodes`: fake vLLM prefill (P) and decode (D) nodes speaking vLLM's HTTP surface,
  with NIXL's bookkeeping played by a `FakeCluster`, and `router_stack` (the real router
  in front of them). Its names are re-exported here: `from fakes import router_stack`.
- `fakes.threaded`: the same stack served from a background thread, for synchronous code.
- `fakes.process`: a stand-in process for a vLLM node or the router (`support.FAKE_NODE`),
  run by path by the bundle launcher's and the deployments' tests.

`tests/` is on sys.path (pytest puts the folder of `tests/conftest.py` there), so this is
the package `fakes`, never `tests.fakes`. Benchmarks reach it through `benchmarks/_fakes.py`.
"""

from fakes.nodes import (
    EOS,
    MEDIA,
    MEDIA_TOKENS,
    SPECIALS,
    FakeCluster,
    FakeNode,
    Reply,
    Stack,
    decode_ids,
    default_reply,
    encode_text,
    free_port,
    render_prompt,
    router_stack,
    serve,
    serve_pair,
)

__all__ = ["EOS", "MEDIA", "MEDIA_TOKENS", "SPECIALS", "FakeCluster", "FakeNode", "Reply",
           "Stack", "decode_ids", "default_reply", "encode_text", "free_port",
           "render_prompt", "router_stack", "serve", "serve_pair"]
