"""A real local HTTP/1.1 server streaming chat-completion SSE, counting TCP connections.

Used by the connection-reuse test (tests/sdk) and the turn-to-first-byte benchmark: a
stream ends the way vLLM's does, ``[DONE]`` first and the end of the chunked body a moment
later, so a client that stops reading at ``[DONE]`` cannot return the connection to its pool.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "kvagent-demo"


def chunks(text: str = "Hello there.") -> list[bytes]:
    head = {"id": "chatcmpl-local", "object": "chat.completion.chunk", "created": 1,
            "model": MODEL}

    def event(choices: list[dict], **extra: object) -> bytes:
        return b"data: " + json.dumps({**head, "choices": choices, **extra}).encode() + b"\n\n"

    return [event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None}]),
            event([{"index": 0, "delta": {"content": text}, "finish_reason": None}]),
            event([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
            event([], usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
            b"data: [DONE]\n\n"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, tail_delay: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.tail_delay = tail_delay
        self.lock = threading.Lock()

    def process_request(self, request, client_address) -> None:  # type: ignore[override]
        with self.lock:
            self.connections += 1
        super().process_request(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn and vLLM set it: with Nagle on, the small writes of a reused
    # connection wait for the client's delayed ACK (~40 ms) and would swamp the figures.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("x-request-id", "local-1")
        self.end_headers()
        for piece in chunks():
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        time.sleep(self.server.tail_delay)  # the body's end comes after [DONE], as on vLLM
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@contextmanager
def serve(tail_delay: float = 0.005) -> Iterator[_Server]:
    """A running server on 127.0.0.1; ``.connections`` counts accepted TCP connections and
    ``.server_address`` gives the port."""
    server = _Server(tail_delay)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def base_url(server: _Server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"
