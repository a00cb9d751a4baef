"""The live CLI tests' own parts, without a CLI or an engine: the recording proxy, the
pins, and reading each CLI's output (tests/agents/clis.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import clis
import httpx
import pytest
from kvagent_server.common.ports import free_port

REPORT = {"path": "d_direct", "reused_tokens": 512, "cache_token": "kva1.e30.x"}


@pytest.fixture
def upstream() -> Iterator[str]:
    """A stand-in router: streams three SSE events slowly, the last carrying a report."""
    from aiohttp import web

    port = free_port()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            data = {"n": i, "kvagent": REPORT} if i == 2 else {"n": i}
            await out.write(f"data: {json.dumps(data)}\n\n".encode())
            await asyncio.sleep(0.2)
        return out

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no"}}, status=400)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/responses", stream)
        app.router.add_post("/v1/messages", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


def test_recorder_passes_streams_and_keeps_requests(upstream: str) -> None:
    with clis.Recorder(upstream) as rec:
        mark = rec.mark()
        r = httpx.post(f"{rec.url}/v1/responses?x=1", json={"model": "m"},
                       headers={"session-id": "s1"}, timeout=10)
        bad = httpx.post(f"{rec.url}/v1/messages", json={}, timeout=10)
    assert r.status_code == 200 and r.text.count("data:") == 3
    assert bad.status_code == 400
    first, second = rec.since(mark)
    assert (first.method, first.path, first.status) == ("POST", "/v1/responses?x=1", 200)
    assert first.headers["session-id"] == "s1" and first.json == {"model": "m"}
    assert first.kvagent == REPORT and first.reused_tokens == 512
    assert second.status == 400 and second.kvagent is None and "no" in second.answer


def test_recorder_keeps_the_answer_when_the_client_hangs_up(upstream: str) -> None:
    """Codex closes the connection once it has what it needs; the router's answer is still
    read to its end, with its real status and report."""
    with clis.Recorder(upstream) as rec:
        host, port = rec.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                         b"Content-Type: application/json\r\n\r\n{}")
            assert b"200" in sock.recv(4096)
        for _ in range(50):
            if rec.exchanges and rec.exchanges[0].kvagent:
                break
            threading.Event().wait(0.1)
    x = rec.exchanges[0]
    assert x.status == 200 and x.client_closed and x.kvagent == REPORT


def test_run_kills_the_whole_group_on_timeout(tmp_path: Path) -> None:
    """A CLI that outlives its limit is killed with the helpers it started."""
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
              f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid));"
              f" time.sleep(60)")
    run = clis.run([sys.executable, "-c", script], env=clis.base_env(tmp_path / "home"),
                   cwd=tmp_path, timeout=2)
    assert run.timed_out and run.returncode != 0
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    break
        except FileNotFoundError:
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail(f"the CLI's child {child} survived")


def test_pins_name_one_version_each() -> None:
    assert set(clis.PINS) == {"claude", "codex", "opencode"}
    for name, pin in clis.PINS.items():
        assert pin.version and pin.version[0].isdigit(), name
        assert clis.install_dir(name).name == f"{name}-{pin.version}"


def test_base_env_leaks_nothing_from_the_caller(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "real-key")
    monkeypatch.setenv("OPENAI_API_KEY", "real-key")
    env = clis.base_env(tmp_path)
    assert "real-key" not in env.values()
    assert all(env[k].startswith(str(tmp_path)) for k in ("HOME", "XDG_CONFIG_HOME", "TMPDIR"))


def _run(stdout: str, stderr: str = "", rc: int = 0) -> clis.Run:
    return clis.Run(argv=["x"], returncode=rc, stdout=stdout, stderr=stderr, seconds=0.0)


def test_reading_claude_code_output() -> None:
    ok = {"type": "result", "subtype": "success", "is_error": False,
          "usage": {"cache_read_input_tokens": 29000}}
    assert clis.surfaced_errors("claude", _run(json.dumps(ok))) == []
    assert clis.cached_tokens("claude", _run(json.dumps(ok))) == 29000
    capped = {**ok, "is_error": True, "api_error": "max_output_tokens",
              "result": "API Error: Claude's response exceeded the 32000 output token maximum."}
    assert clis.surfaced_errors("claude", _run(json.dumps(capped)))
    assert clis.surfaced_errors("claude", _run("not json")) == ["no result object"]


def test_reading_codex_output() -> None:
    lines = [{"type": "thread.started"},
             {"type": "item.completed", "item": {"type": "error", "message":
                                                 "Model metadata for `m` not found."}},
             {"type": "turn.completed", "usage": {"cached_input_tokens": 22272}}]
    out = "\n".join(json.dumps(e) for e in lines)
    assert clis.surfaced_errors("codex", _run(out)) == []
    assert clis.cached_tokens("codex", _run(out)) == 22272
    failed = out + "\n" + json.dumps({"type": "turn.failed", "error": {"message": "400"}})
    assert clis.surfaced_errors("codex", _run(failed))
    assert clis.surfaced_errors("codex", _run(lines[0].__repr__()))  # no turn.completed


def test_reading_opencode_output() -> None:
    step = {"type": "step_finish", "part": {"tokens": {"cache": {"read": 17920}}}}
    assert clis.surfaced_errors("opencode", _run(json.dumps(step))) == []
    assert clis.cached_tokens("opencode", _run(json.dumps(step))) == 17920
    assert clis.surfaced_errors("opencode", _run(json.dumps(step), "Error: Cannot connect"))
    assert clis.surfaced_errors("opencode", _run(json.dumps({"type": "error"})))
