"""What every vLLM node of the bundle needs in its environment and command line.

Pure functions: the bundle's renderer (`kvagent_server.bundle.render`) merges these into each node
command it writes, and tests call them directly. Why each setting exists is in
docs/engine.md ("The idle spin and the hang").
"""

from __future__ import annotations

from kvagent_server.common.types import ROLES

#: Enables the plugin (`kvagent_server.vllm_plugin:register`); without it the plugin is inert.
PLUGIN_ENV = "KVAGENT_PLUGIN"
#: vLLM series with a known gap (`version.KNOWN_GAPS`) the operator accepts, e.g. "0.26".
ALLOW_VLLM_ENV = "KVAGENT_ALLOW_VLLM"
#: NIXL UCX progress-thread poll timeout in microseconds (NIXL's Python API hard-codes 0,
#: i.e. a busy loop). NIXL rounds it up to whole milliseconds.
NIXL_DELAY_ENV = "KVAGENT_NIXL_PTHR_DELAY_US"
DEFAULT_NIXL_DELAY_US = 10_000
#: How long (ms) an engine with no runnable request but with KV blocks held for a remote
#: reader waits for new input before polling the connector again (vLLM: 1 ms).
IDLE_POLL_ENV = "KVAGENT_IDLE_POLL_MS"
DEFAULT_IDLE_POLL_MS = 500
#: How long (ms) a worker busy-loops for the next message before sleeping (vLLM: 1000).
SPIN_ENV = "KVAGENT_SPIN_MS"
DEFAULT_SPIN_MS = 20
#: Microseconds such a reader sleeps between checks inside that window; 0: vLLM's
#: `sched_yield` (see idle_wait.py). Unset: `CPU_SPIN_NAP_US` on CPU engines, whose few
#: cores the readers would share with the threads that compute; 0 on GPUs.
SPIN_NAP_ENV = "KVAGENT_SPIN_NAP_US"
CPU_SPIN_NAP_US = 100
#: "1": undo the NIXL worker's move of the compute thread onto the last core (see affinity.py).
KEEP_AFFINITY_ENV = "KVAGENT_KEEP_AFFINITY"
#: "1": a failed/declined KV load (e.g. an expired D handle) recomputes instead of HTTP 500.
RECOMPUTE_ENV = "KVAGENT_RECOMPUTE_ON_LOAD_FAILURE"
#: "1": every sequence a decode node retains expires, and the router may release one early
#: (see retention.py; "0" only to reproduce vLLM's leak).
RETENTION_ENV = "KVAGENT_FIX_RETENTION"
#: "1": a decode node emits the token P sampled and computes from it (see first_token.py).
FIRST_TOKEN_ENV = "KVAGENT_FIRST_TOKEN"


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown node role {role!r}; expected one of {', '.join(ROLES)}")


def node_env(role: str) -> dict[str, str]:
    """Extra environment variables for a `role` ("prefill" or "decode") vLLM node."""
    _check_role(role)
    return {
        PLUGIN_ENV: "1",
        NIXL_DELAY_ENV: str(DEFAULT_NIXL_DELAY_US),
        IDLE_POLL_ENV: str(DEFAULT_IDLE_POLL_MS),
        SPIN_ENV: str(DEFAULT_SPIN_MS),
        KEEP_AFFINITY_ENV: "1",
        RECOMPUTE_ENV: "1",
        RETENTION_ENV: "1",
        FIRST_TOKEN_ENV: "1",
        # vLLM sets this itself only if NIXL is not imported yet; the plugin may import it
        # earlier, so set it explicitly (works around a rare UCX registration-cache leak).
        "UCX_RCACHE_MAX_UNRELEASED": "1024",
    }
    # UCX_TLS is platform-specific (CPU: "tcp,self,sm"), so the renderer sets it.


def node_args(role: str) -> list[str]:
    """Extra vLLM CLI arguments for a `role` node.

    `--enable-prompt-tokens-details` makes `usage.prompt_tokens_details.cached_tokens`
    appear (local prefix-cache hits plus KV pulled from the other node), which the router
    reports to clients and tests use as proof of reuse.
    """
    _check_role(role)
    return ["--enable-prompt-tokens-details"]
