"""The library logger: silent unless the application (or ``KVAGENT_LOG``) asks.

A library must not print on its own, so the ``kvagent`` logger gets a ``NullHandler``.
``KVAGENT_LOG=debug`` (or ``info``), like openai-python's ``OPENAI_LOG``, attaches a
stderr handler at that level: every request, response status and retry is then logged,
with the ``Authorization`` header redacted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

__all__ = ["LOG_ENV", "logger", "redact_headers", "setup_from_env"]

LOG_ENV = "KVAGENT_LOG"
logger = logging.getLogger("kvagent")
logger.addHandler(logging.NullHandler())

_SECRET_HEADERS = frozenset({"authorization", "api-key", "x-api-key", "proxy-authorization"})


def setup_from_env(environ: Mapping[str, str] = os.environ) -> logging.Handler | None:
    """Honour ``KVAGENT_LOG`` (debug, info, warning, error); returns the handler it added."""
    level_name = environ.get(LOG_ENV, "").strip().upper()
    if not level_name:
        return None
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        logger.warning("ignoring %s=%r: use debug, info, warning or error", LOG_ENV, level_name)
        return None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s %(levelname)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers fit for a log line: secrets replaced by ``<redacted>``."""
    return {k: "<redacted>" if k.lower() in _SECRET_HEADERS else v for k, v in headers.items()}
