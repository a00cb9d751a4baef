"""Tools that are not performance benchmarks: fuzzing, hostile clients, soak, multi-host
rehearsal, GPU bundle checks and stability probes. Run from the repository root as modules
(`python -m tools.fuzz.run`)."""
