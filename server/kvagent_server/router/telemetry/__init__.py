"""Prometheus metrics and OpenTelemetry spans."""
