"""A stand-in for a vLLM node (or the router) in supervisor tests: tiny, fast, controllable.

It accepts any vLLM-style arguments, listens on `--host`/`--port`, serves `GET /health`,
and obeys a few environment variables (set through the bundle config's `extra_env`):

- FAKE_RECORD_DIR: write `<KVAGENT_PROCESS>.json` there with argv, env, pid and child pid
- FAKE_SPAWN_CHILD=1: start a child process in the same group (like vLLM's engine core)
- FAKE_CHILD_IGNORES_TERM=1: that child ignores SIGTERM (so only SIGKILL stops it)
- FAKE_HEALTH_DELAY_S: /health answers 503 for this long after start
- FAKE_EXIT_AT_START: exit with this code right away (a node that cannot start)
- FAKE_DIE_AFTER_S: exit with code 3 this many seconds after start (every start)
- FAKE_DIE_ONCE_FILE: like FAKE_DIE_AFTER_S, but only when this file does not exist yet
  (it is created first), so the restarted node stays up

`POST /die` makes it exit with code 7 at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

START = time.monotonic()
CHILD_CODE = (
    "import signal, sys, time\n"
    "if sys.argv[1] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "while True: time.sleep(1)\n"
)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            delay = float(os.environ.get("FAKE_HEALTH_DELAY_S", "0"))
            code = 200 if time.monotonic() - START >= delay else 503
            self._reply(code, b"")
        else:
            self._reply(404, b"not found")

    def do_POST(self) -> None:
        if self.path == "/die":
            self._reply(200, b"bye")
            threading.Timer(0.05, lambda: os._exit(7)).start()
        else:
            self._reply(404, b"not found")

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        sys.stdout.write("fake-node: " + fmt % args + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _rest = parser.parse_known_args()
    print(f"fake-node: pid {os.getpid()} argv {sys.argv[1:]}", flush=True)

    if os.environ.get("FAKE_EXIT_AT_START"):
        sys.exit(int(os.environ["FAKE_EXIT_AT_START"]))

    child_pid = None
    if os.environ.get("FAKE_SPAWN_CHILD") == "1":
        ignore = os.environ.get("FAKE_CHILD_IGNORES_TERM", "0")
        child = subprocess.Popen([sys.executable, "-c", CHILD_CODE, ignore])
        child_pid = child.pid

    record_dir = os.environ.get("FAKE_RECORD_DIR")
    if record_dir:
        name = os.environ.get("KVAGENT_PROCESS", f"port-{args.port}")
        record = {"argv": sys.argv[1:], "env": dict(os.environ), "pid": os.getpid(),
                  "child_pid": child_pid}
        path = Path(record_dir) / f"{name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)

    die_after = os.environ.get("FAKE_DIE_AFTER_S")
    once = os.environ.get("FAKE_DIE_ONCE_FILE")
    if once and not Path(once).exists():
        Path(once).write_text("died once\n")
        die_after = die_after or "0.5"
    elif once:
        die_after = None
    if die_after:
        threading.Timer(float(die_after), lambda: os._exit(3)).start()

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
