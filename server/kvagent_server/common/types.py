"""The literal types the config, the plan, the engine helpers and the router all use.

Defined once so that a new role or device is added in one place and checked everywhere.
"""

from __future__ import annotations

from typing import Literal

#: A vLLM node's part in P/D disaggregation.
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")

#: How the bundle lays out its engines: `pd`, prefill and decode nodes with NIXL between them;
#: `single`, one node (rendered from the decode role) that serves every turn itself;
#: `replicas`, several such nodes, each session on one of them, its KV following it over
#: NIXL when it moves.
Topology = Literal["pd", "single", "replicas"]
TOPOLOGIES: tuple[Topology, ...] = ("pd", "single", "replicas")

#: Where a node runs: vLLM's CPU backend or a CUDA GPU.
Device = Literal["cpu", "cuda"]

#: vLLM's `--prefix-caching-hash-algo`: how block hashes are computed.
HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
