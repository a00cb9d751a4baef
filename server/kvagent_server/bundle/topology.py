"""What the host can run: its facts, the device, and the topology `auto` picks.

Pure functions of a `BundleConfig` and `HostFacts`, so the rule is tested directly and
`up`, `render` and the demo print the same choice with the same reason. The rule, in
order (docs/server.md, "Topology"):

1. `topology: pd`, `single` or `replicas` in the config wins (`auto` never picks
   `replicas`: whether sessions moving between nodes pays depends on the load, which the
   host's facts do not tell).
2. The config asks for more than one node of a role, or places prefill nodes
   (`prefill.hosts`, `cuda_devices`, `cpu_binds`): `pd`, which is what it describes.
3. cuda with a GPU for every node (prefill.count + decode.count): `pd`.
4. cuda with fewer GPUs (one): `single`: P/D needs a GPU per node, and two nodes sharing
   one GPU would split its memory and compute.
5. cpu: `single`: P and D would each get half the cores, and on CPU every engine's
   prefill and decode are bound by them (docs/benchmarks.md: P/D's later-turn TTFT
   1.37-2.0x the aggregated node's on a 2-core machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvagent_server.common.types import ROLES, Device, Topology
from kvagent_server.config import BundleConfig, ConfigError

#: The per-node fields of the prefill section that place a node somewhere.
_PLACEMENT_FIELDS = ("hosts", "cuda_devices", "cpu_binds")


@dataclass(frozen=True)
class HostFacts:
    """What the plan needs to know about the machine it runs on."""

    cpu_cores: tuple[int, ...]
    gpu_count: int


class TopologyChoice(NamedTuple):
    """The topology the bundle runs and the one-line reason (what `up` prints)."""

    topology: Topology
    reason: str

    def line(self) -> str:
        return f"topology: {self.topology} ({self.reason})"


def resolve_device(cfg: BundleConfig, host: HostFacts) -> Device:
    if cfg.device == "auto":
        return "cuda" if host.gpu_count > 0 else "cpu"
    if cfg.device == "cuda" and host.gpu_count == 0:
        raise ConfigError([("device: cuda requested but no GPU is visible on this machine "
                           "(use device: cpu or auto)")])
    return cfg.device


def resolve_topology(cfg: BundleConfig, host: HostFacts) -> TopologyChoice:
    """The topology `cfg` runs on `host`, and why (see the module docstring for the rule).
    Raises `ConfigError` only as `resolve_device` does."""
    if cfg.topology != "auto":
        return TopologyChoice(cfg.topology, "set in the config")
    counts = {role: cfg.role(role).count for role in ROLES}
    if max(counts.values()) > 1:
        return TopologyChoice("pd", f"auto: {counts['prefill']} prefill + "
                                    f"{counts['decode']} decode nodes configured; single "
                                    "runs one")
    placed = [f for f in _PLACEMENT_FIELDS if getattr(cfg.prefill, f) is not None]
    if placed:
        return TopologyChoice("pd", f"auto: prefill.{placed[0]} places a prefill node")
    nodes = sum(counts.values())
    if resolve_device(cfg, host) == "cuda":
        gpus = host.gpu_count
        if gpus >= nodes:
            return TopologyChoice("pd", f"auto: {gpus} GPUs visible, one per P/D node")
        return TopologyChoice("single", f"auto: {gpus} GPU{'s' if gpus > 1 else ''} visible; "
                                        f"P/D needs one per node ({nodes})")
    return TopologyChoice("single", "auto: on CPU P/D halves each engine's cores (1.37-2.0x "
                                    "slower than one node on 2 cores, docs/benchmarks.md)")


def ignored_settings(cfg: BundleConfig, topology: Topology) -> list[str]:
    """One note per setting the config gives that `topology` does not use (to print)."""
    if topology == "pd":
        return []
    nodes = ("runs one node, from decode" if topology == "single"
             else "runs decode.count nodes, from decode")
    notes = []
    if "prefill" in cfg.model_fields_set:
        notes.append(f"prefill: ignored (topology {topology} {nodes})")
    if cfg.kv_events.enabled and "kv_events" in cfg.model_fields_set:
        notes.append(f"kv_events: unused (topology {topology} has no prefill node to place)")
    return notes
