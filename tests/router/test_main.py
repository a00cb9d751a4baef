"""`python -m kvagent_server.router`: what it says when it starts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from kvagent_server.router import __main__ as router_main
from kvagent_server.router.settings import RouterSettings


class _NoServer:
    """Stands in for uvicorn.Server: main() runs up to serving, nothing is bound."""

    started = False

    def __init__(self, config: Any) -> None:
        self.config = config

    def run(self) -> None:
        pass


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    import uvicorn

    monkeypatch.setattr(uvicorn, "Server", _NoServer)
    return router_main.main(["--prefill", "http://127.0.0.1:9", "--decode",
                             "http://127.0.0.1:9", "--model", "m", *args])


def test_binding_beyond_loopback_without_tenants_warns(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture,
                                                        tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING, logger="kvagent.router"):
        assert _main(monkeypatch, "--host", "0.0.0.0") == 3
    warned = [r for r in caplog.records if "no tenants configured" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "0.0.0.0" in warned[0].getMessage()

    caplog.clear()  # loopback, or keys configured: nothing to say
    with caplog.at_level(logging.WARNING, logger="kvagent.router"):
        _main(monkeypatch, "--host", "127.0.0.1")
        settings = tmp_path / "router.json"
        settings.write_text('{"router": {"tenants": [{"name": "t", "api_keys": ["k"]}]}}')
        _main(monkeypatch, "--host", "0.0.0.0", "--settings", str(settings))
    assert not [r for r in caplog.records if "no tenants configured" in r.getMessage()]


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
    ("router.example", False), ("", False)])
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert router_main.is_loopback(host) is loopback
    assert router_main.warn_if_open(host, RouterSettings()) is not loopback
