"""The HTTP clients an adapter owns: one per model object, so calls reuse connections.

Frameworks call a model object over and over (every agent step); a new ``httpx`` client per
call would open a new TCP connection per turn. The async client is kept per event loop,
since an ``httpx.AsyncClient``'s pooled connections belong to the loop that opened them
(``asyncio.run`` per call makes a new loop each time).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

import httpx

from .._core import DEFAULT_TIMEOUT


class OwnedClients:
    """Lazily made ``httpx`` clients of one model object, closed when it is collected."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sync: httpx.Client | None = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] \
            = weakref.WeakKeyDictionary()

    def sync(self, timeout: float | httpx.Timeout | None) -> httpx.Client:
        with self._lock:
            if self._sync is None:
                self._sync = httpx.Client(timeout=_timeout(timeout))
                weakref.finalize(self, self._sync.close)
            return self._sync

    def for_running_loop(self, timeout: float | httpx.Timeout | None) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._async.get(loop)
            if client is None:
                client = self._async[loop] = httpx.AsyncClient(timeout=_timeout(timeout))
            return client

    def __deepcopy__(self, memo: dict[int, Any]) -> OwnedClients:
        return OwnedClients()  # a copied model opens its own connections

    def __reduce__(self) -> tuple[type[OwnedClients], tuple[()]]:
        return (OwnedClients, ())  # a pickled model too (clients hold sockets and locks)


def _timeout(timeout: float | httpx.Timeout | None) -> float | httpx.Timeout | None:
    return DEFAULT_TIMEOUT if timeout is None else timeout
