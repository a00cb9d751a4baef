"""The arms of `compare` measured by an outside harness (aiperf): `python -m benchmarks outside`."""
