"""The router's HTTP face: the Starlette app, request parsing, limits."""
