"""kvagent's multi-turn agent benchmark: a seeded tool-using workload run against the
kvagent router, P/D without reuse and an aggregated vLLM node (see docs/benchmarks.md)."""
