"""Loopback port helpers: the one place the bundle, the demo, tests and benchmarks pick ports.

Ports are drawn at random from *outside* the kernel's ephemeral range
(`net.ipv4.ip_local_port_range`). A port the kernel hands out for `bind(0)` lies inside that
range, and so does the local port of every outgoing connection: a port picked that way and
bound a few minutes later (a node starts, then the router) can meanwhile be taken by some
client's connection, and the late bind fails with "address already in use". Outside the
range only another process's explicit bind can take it, and a random draw from ~20,000
ports makes that unlikely.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Below this no port is drawn (well-known and registered services cluster there).
_LOWEST = 10000
_rng = random.Random()  # own state: a test seeding `random` must not make picks collide


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range, or None where it cannot be read (not Linux)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return lo, hi


def draw_ranges(ephemeral: tuple[int, int] | None) -> list[range]:
    """Where ports are drawn from: the ports >= 10000 outside the ephemeral range."""
    if ephemeral is None:
        return []
    lo, hi = ephemeral
    ranges = [range(_LOWEST, lo), range(hi + 1, 65536)]
    return [r for r in ranges if len(r) >= 1000]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports on `host` free right now, outside the ephemeral range where it
    is known (else ports the kernel picks). Another process may still take one before it
    is used."""
    ranges = draw_ranges(ephemeral_range())
    if not ranges:
        return _kernel_ports(n, host)
    picked: list[int] = []
    weights = [len(r) for r in ranges]
    for _ in range(200 * n):
        if len(picked) == n:
            break
        port = _rng.choice(_rng.choices(ranges, weights)[0])
        if port not in picked and port_free(port, host):
            picked.append(port)
    if len(picked) < n:
        return picked + _kernel_ports(n - len(picked), host, exclude=set(picked))
    return picked


def _kernel_ports(n: int, host: str, exclude: set[int] | None = None) -> list[int]:
    """Ports from `bind(0)`, held open together while picking so no two are the same."""
    socks: list[socket.socket] = []
    skipped: list[socket.socket] = []  # held open too, so the kernel moves on
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind((host, 0))
            (skipped if exclude and s.getsockname()[1] in exclude else socks).append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks + skipped:
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
