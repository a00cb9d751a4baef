"""`python -m kvagent_server.router`: run the router with uvicorn.

    python -m kvagent_server.router --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --model demo --settings router.json

Without `--prefill`, one `--decode` node serves every turn (the `single` topology,
docs/router.md "Topologies"), or several serve the sessions between them, each session's
KV following it when it moves (the `replicas` topology):

    python -m kvagent_server.router --decode http://127.0.0.1:8200 --settings router.json
    python -m kvagent_server.router --decode http://127.0.0.1:8200 \
        --decode http://127.0.0.1:8201 --settings router.json

Binds 127.0.0.1 unless told otherwise; `--host`/`--port` override the settings file.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import sys
from pathlib import Path

from kvagent_server.router.settings import RouterSettings

log = logging.getLogger("kvagent.router")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvagent_server.router",
                                description="kvagent router: KV-reusing front for vLLM nodes "
                                            "(prefill/decode, one decode node alone, or "
                                            "several as replicas).")
    p.add_argument("--host", help="bind address (default: settings, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default: settings, else 8000)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill node's root URL (repeat for several; none: the decode "
                        "nodes serve every turn, the single or replicas topology)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode node's root URL (repeat for several)")
    p.add_argument("--model", help="served model name (default: asked from the nodes)")
    p.add_argument("--settings", type=Path, metavar="FILE.json",
                   help="RouterSettings as JSON")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def load_settings(path: Path | None) -> RouterSettings:
    if path is None:
        return RouterSettings()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read settings {path}: {exc}") from None
    return RouterSettings.model_validate(data.get("router", data))


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches; a name other than `localhost` is
    taken as reachable from elsewhere (it may resolve to any interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, settings: RouterSettings) -> bool:
    """Warn when the router listens beyond this machine with no API keys: anyone who
    reaches it is then the one anonymous tenant. True when it warned."""
    if settings.tenants or is_loopback(host):
        return False
    log.warning("the router listens on %s with no tenants configured: every client that "
                "reaches it is served, unauthenticated, as the anonymous tenant (set "
                "router.tenants with api_keys, or bind 127.0.0.1)", host)
    return True


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from pydantic import ValidationError

    from kvagent_server.router.http.app import create_app
    from kvagent_server.router.http.server import uvicorn_config

    args = parse_args(argv)
    try:
        settings = load_settings(args.settings)
    except ValidationError as exc:
        print(f"invalid settings: {exc}", file=sys.stderr)
        return 2
    host = args.host or settings.host
    port = args.port or settings.port
    # The router's own loggers at the level asked for (uvicorn configures only its own):
    # evictions, releases and fallbacks are INFO.
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("kvagent").setLevel(args.log_level.upper())
    warn_if_open(host, settings)
    try:
        app = create_app(settings, args.prefill, args.decode, model=args.model)
    except ValueError as exc:  # nodes that make no topology, a policy that needs P...
        print(f"cannot start the router: {exc}", file=sys.stderr)
        return 2
    # loop "auto": uvloop (the `server` extra installs it); httptools with the head and
    # connection limits (router/http/server.py).
    config = uvicorn_config(app, settings, host=host, port=port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 3  # as `uvicorn.run`: could not start (port taken...)


if __name__ == "__main__":
    sys.exit(main())
