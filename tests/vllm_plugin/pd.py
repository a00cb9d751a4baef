"""A small launcher for one real vLLM prefill (P) + decode (D) pair with NixlConnector.

Used by the plugin tests and by tools/idle_and_stability. Each node runs in its own
process group (so stopping it takes its engine-core and worker children with it), binds to
127.0.0.1, and has its OMP threads pinned to one core (P: 0, D: 1 by default).

    with PDPair.start(ttl_s=30) as pd:
        pd.p.url, pd.d.url
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.bundle.supervisor import log_tail
from kvagent_server.common.ports import free_port
from kvagent_server.models.demo import demo_serve_args, demo_serve_env, ensure_demo_model
from kvagent_server.vllm_plugin.env import node_args, node_env
from support import TEST_ENGINE_ARGS

HOST = "127.0.0.1"


def kv_transfer_config(role: str, engine_id: str, *, ttl_s: int, threshold: int,
                       lease_s: int | None = None) -> dict[str, object]:
    extra: dict[str, object] = {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": threshold,
        "decoder_kv_blocks_ttl": ttl_s,
    }
    if lease_s is not None:
        extra["kv_lease_duration"] = lease_s
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }


@dataclass
class Node:
    """One running vLLM node."""

    role: str
    port: int
    side_port: int
    core: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    engine_id: str

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def pids(self) -> list[int]:
        """The node's process tree (API server, engine core, worker)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the node with its engine core and worker (its process group)."""
        stop_groups(self.proc, grace=timeout)

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)


def launch_node(role: str, *, core: int, log_dir: Path, ttl_s: int, threshold: int,
                plugin: bool, model: Path, lease_s: int | None = None,
                extra_env: dict[str, str] | None = None, kv_space_gib: int = 2,
                max_model_len: int = 16384, extra_args: list[str] | None = None) -> Node:
    port, side_port = free_port(), free_port()
    engine_id = f"{role}-{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVAGENT_")}
    env.update(demo_serve_env())
    env.update({
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        "UCX_TLS": "tcp,self,sm",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "PYTHONUNBUFFERED": "1",
    })
    args: list[str] = []
    if plugin:
        env.update(node_env(role))
        args += node_args(role)
    env.update(extra_env or {})
    cfg = kv_transfer_config(role, engine_id, ttl_s=ttl_s, threshold=threshold,
                             lease_s=lease_s)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", HOST, "--port", str(port),
        *demo_serve_args(max_model_len), *TEST_ENGINE_ARGS,
        "--kv-transfer-config", json.dumps(cfg),
        *args, *(extra_args or []),
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{role}.log"
    log = open(log_path, "wb")  # noqa: SIM115 (owned by the child)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    return Node(role, port, side_port, core, log_path, proc, engine_id)


@dataclass
class PDPair:
    """A started P and D node; a context manager that always stops both."""

    p: Node
    d: Node
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def start(cls, *, log_dir: Path, ttl_s: int = 120, threshold: int = 64,
              plugin: bool = True, lease_s: int | None = None,
              extra_env: dict[str, str] | None = None, p_core: int = 0, d_core: int = 1,
              timeout: float = 420.0) -> PDPair:
        model = ensure_demo_model()
        p = launch_node("prefill", core=p_core, log_dir=log_dir, ttl_s=ttl_s,
                        threshold=threshold, plugin=plugin, model=model, lease_s=lease_s,
                        extra_env=extra_env)
        d = launch_node("decode", core=d_core, log_dir=log_dir, ttl_s=ttl_s,
                        threshold=threshold, plugin=plugin, model=model, lease_s=lease_s,
                        extra_env=extra_env)
        pair = cls(p, d, [p, d])
        try:
            pair.wait_healthy(timeout)
        except BaseException:
            pair.stop()
            raise
        return pair

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.nodes)
        while pending:
            for n in list(pending):
                if n.proc.poll() is not None:
                    raise RuntimeError(f"{n.role} node exited ({n.proc.returncode}):\n"
                                       f"{n.log_tail()}")
                if n.healthy():
                    pending.remove(n)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"nodes not healthy after {timeout}s: "
                                   + "; ".join(f"{n.role}:\n{n.log_tail(10)}" for n in pending))
            time.sleep(1.0)

    def pids(self) -> list[int]:
        return [pid for n in self.nodes for pid in n.pids()]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
