"""Network namespaces for the rehearsal: create, run in, inspect, and remove every trace.

Everything is made inside namespaces the run creates: the bridge lives in a namespace of
its own and each host's veth is created there and moved straight into the host's
namespace, so the root namespace never gets an interface or an address. IPv6 is off in
every namespace (no link-local addresses, no neighbour discovery).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._procs import signal_until_gone
from tools.multihost.topology import HOSTS, PREFIX, SUBNET, Topology

_CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed (./dev test installs it)"
    if shutil.which("ss") is None:
        return "the `ss` command (iproute2) is not installed (./dev test installs it)"
    probe = f"{PREFIX}-probe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns add` failed: {res.stderr.strip() or res.returncode}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def ip(*args: str) -> str:
    res = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def in_ns(ns: str, *argv: str, check: bool = True) -> str:
    res = subprocess.run(["ip", "netns", "exec", ns, *argv], check=False, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"[{ns}] {' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def create(topo: Topology) -> None:
    """The bridge namespace with bridge `br0`, and one namespace per host joined to it."""
    br = topo.bridge_ns
    for ns in topo.namespaces:
        ip("netns", "add", ns)
        in_ns(ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1")
        ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", br, "link", "add", "br0", "type", "bridge")
    ip("-n", br, "link", "set", "br0", "up")
    for host in HOSTS:
        ns = topo.ns(host)
        inner, outer = topo.veth(host)
        ip("-n", br, "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
        ip("-n", br, "link", "set", outer, "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{topo.addr(host)}/{SUBNET.prefixlen}", "dev", inner)
        ip("-n", ns, "link", "set", inner, "up")


def pids_in(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def destroy(namespaces: list[str], grace: float = 5.0) -> list[str]:
    """Kill every process in the namespaces, then delete them; returns what is left."""
    signal_until_gone(lambda: [pid for ns in namespaces for pid in pids_in(ns)],
                      grace_s=grace)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
    return [ns for ns in namespaces if ns in existing()]


def existing(prefix: str = PREFIX + "-") -> list[str]:
    """Namespaces whose name starts with `prefix`."""
    res = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def sweep_stale() -> list[str]:
    """Remove namespaces (and their processes) an earlier run left; returns their names."""
    stale = existing()
    if stale:
        destroy(stale, grace=2.0)
    return stale


def listening(ns: str) -> str:
    return in_ns(ns, "ss", "-ltnpH")


def established(ns: str) -> str:
    return in_ns(ns, "ss", "-tnpH", "state", "established")


def veth_bytes(topo: Topology, host: str) -> tuple[int, int]:
    """(rx, tx) bytes of the host's interface, read inside its namespace."""
    inner, _ = topo.veth(host)
    rx = in_ns(topo.ns(host), "cat", f"/sys/class/net/{inner}/statistics/rx_bytes")
    tx = in_ns(topo.ns(host), "cat", f"/sys/class/net/{inner}/statistics/tx_bytes")
    return int(rx), int(tx)


# ------------------------------------------------------------ a thread in a namespace


def _enter(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NamespaceThreads(ThreadPoolExecutor):
    """Worker threads that live in `ns`: every socket they open belongs to it.

    setns(CLONE_NEWNET) changes only the calling thread, so the client's HTTP traffic
    leaves from the client namespace while this process stays in the root namespace.
    """

    def __init__(self, ns: str, workers: int = 4) -> None:
        self.ns = ns
        super().__init__(max_workers=workers, thread_name_prefix=f"ns-{ns}",
                         initializer=_enter, initargs=(ns,))
