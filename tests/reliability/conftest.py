"""Reliability tests: the router against hostile input, hostile clients and load.

They drive the real router app over real sockets in front of the fake P/D nodes of
`fakes.nodes` (which record every request they receive), so properties are
checked on what the nodes were actually sent and on every byte a client got back.
Shared helpers are in `reliability_support.py` (a conftest is not imported by name).
"""

from __future__ import annotations
