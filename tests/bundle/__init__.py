"""Tests of `kvagent_server.bundle`: the plan, its rendering, the processes and their
supervisor. A package so that `bundle.bundle_helpers` is one module wherever it is imported."""
