"""`python -m benchmarks compare`: kvagent against the baselines a user would pick, on one
workload, in one report."""
