"""The rehearsal's hosts, addresses and bundle config, and checks on what they produce.

Pure: no process, no namespace. `rehearsal.py` acts on it; tests check it directly, also
against the Kubernetes manifests and compose file rendered from the same config.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Every namespace, veth and bridge of a run starts with this (the stale sweep keys on it).
PREFIX = "kvmh"
#: A private range used only inside the run's namespaces (nothing in the root namespace
#: is given an address from it, and no route leads out of the namespaces).
SUBNET = ipaddress.ip_network("10.213.0.0/24")
#: The same port the rendered Kubernetes Service and compose file give Redis.
REDIS_PORT = 6379
ROUTER_PORT = 8000

#: One "machine" each; the bridge lives in a namespace of its own.
HOSTS: dict[str, int] = {"p": 11, "d": 12, "ra": 21, "rb": 22, "redis": 31, "client": 41}
BRIDGE_NS = "br"


@dataclass(frozen=True)
class Topology:
    """Names and addresses for one run (`run_id` keeps concurrent runs apart)."""

    run_id: str

    def ns(self, host: str) -> str:
        return f"{PREFIX}-{self.run_id}-{host}"

    @property
    def bridge_ns(self) -> str:
        return self.ns(BRIDGE_NS)

    def addr(self, host: str) -> str:
        return str(SUBNET.network_address + HOSTS[host])

    def veth(self, host: str) -> tuple[str, str]:
        """(the host's end, the bridge's end): at most 15 characters each."""
        a, b = f"{PREFIX}{self.run_id}{host}", f"{PREFIX}{self.run_id}{host}b"
        assert len(b) <= 15, b
        return a, b

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(self.ns(h) for h in HOSTS)]

    @property
    def redis_url(self) -> str:
        return f"redis://{self.addr('redis')}:{REDIS_PORT}/0"


def rehearsal_config(topo: Topology, run_dir: str, engine_args: Sequence[str] = (),
                     kv_tiers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The bundle config of the rehearsal: each role on its own host, one Redis
    (`engine_args`: extra vLLM arguments of both nodes, e.g. the suite's eager mode).
    With `kv_tiers`, P and D get those tiers and P its prefix cache (the tier phase).

    KV events are off: their ipc socket would join the "hosts" through the shared
    filesystem, and tcp needs a wildcard bind (see docs/deployment.md).
    """
    config: dict[str, Any] = {
        "name": "mh", "topology": "pd", "device": "cpu", "run_dir": run_dir,
        "kv_cache_gib": 1, "max_model_len": 16384,
        # No prefix cache on P: every reused token is then pulled from D over NIXL (with
        # it, P serves the part of the prompt it computed itself last turn from its own
        # cache and pulls only the blocks D generated), so P's pull metrics account for
        # every reused token.
        "prefill": {"hosts": [topo.addr("p")], "prefix_caching": False,
                    "extra_args": list(engine_args)},
        "decode": {"hosts": [topo.addr("d")], "extra_args": list(engine_args)},
        "router": {"host": topo.addr("ra"), "port": ROUTER_PORT, "redis_url": topo.redis_url,
                   # Every reuse is a pull from D to P over NIXL, never D extending itself.
                   "policy": {"params": {"skip_prefill_max_tokens": 0}}},
        "kv_events": {"enabled": False},
        "startup_timeout_s": 600, "stop_grace_s": 10,
    }
    if kv_tiers is not None:
        config["kv_tiers"] = kv_tiers
        config["prefill"]["prefix_caching"] = True
    return config


# ------------------------------------------------------------------ rendered plans


def node_argv_differences(a: list[str], b: list[str]) -> list[tuple[str, str, str]]:
    """(flag, value in a, value in b) for every `--flag value` that differs."""
    def flags(argv: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for i, tok in enumerate(argv):
            if tok.startswith("--"):
                nxt = argv[i + 1] if i + 1 < len(argv) else ""
                out[tok] = "" if nxt.startswith("--") else nxt
        return out

    fa, fb = flags(a), flags(b)
    return [(k, fa.get(k, "<absent>"), fb.get(k, "<absent>"))
            for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def flag(argv: list[str], name: str) -> list[str]:
    """Every value of `--name VALUE` in argv (the router takes --prefill/--decode repeated)."""
    return [argv[i + 1] for i, tok in enumerate(argv[:-1]) if tok == name]


# ------------------------------------------------------------------ listening sockets


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    process: str


_SS_LINE = re.compile(r"^\S+\s+\d+\s+\d+\s+(?P<local>\S+)\s+\S+(?:\s+(?P<proc>.*))?$")


def parse_ss_listening(text: str) -> list[Listener]:
    """`ss -ltnpH` output to listeners (IPv6 brackets and `%iface` scopes stripped)."""
    out: list[Listener] = []
    for line in text.splitlines():
        m = _SS_LINE.match(line.strip())
        if not m:
            continue
        host, _, port = m.group("local").rpartition(":")
        host = host.strip("[]").split("%", 1)[0]
        proc = re.search(r'\(\("([^"]+)"', m.group("proc") or "")
        out.append(Listener(host, int(port), proc.group(1) if proc else ""))
    return out


def wildcard(address: str) -> bool:
    return address in ("0.0.0.0", "*", "::", "")
