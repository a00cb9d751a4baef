"""Console-script entry points that survive an SDK-only install.

`pip install kvagent` installs the `kvagent` and `kvagent-server` scripts too (a wheel
cannot make scripts depend on an extra), but the commands need the server extra (typer,
rich, ...). Without it they say so in one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

_INSTALL_HINT = "pip install 'kvagent[server]'"


def _cli_attr(script: str, name: str) -> Any:
    try:
        from kvagent_server.cli import app
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing.startswith("kvagent"):
            raise  # our own module is missing: a broken install or a bug, not the extra
        sys.stderr.write(f"{script}: needs the server extra (module {missing!r} is not "
                         f"installed); install it with: {_INSTALL_HINT}\n")
        raise SystemExit(2) from None
    return getattr(app, name)


def server_main() -> None:
    """`kvagent-server`."""
    _cli_attr("kvagent-server", "app")()


def demo_main() -> None:
    """`kvagent`."""
    _cli_attr("kvagent", "demo_app")()
