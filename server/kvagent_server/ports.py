"""Loopback port helpers: the one place the bundle, the demo, tests and benchmarks pick ports."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports on `host` free right now (held open together while picking, so
    no two are the same). Another process may still take one before it is used."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port on `host` free right now."""
    return free_ports(1, host)[0]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when `port` can be bound on `host` right now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
