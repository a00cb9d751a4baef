"""The router's HTTP face: the Starlette app, the turn's HTTP shell, small endpoints,
request parsing, limits."""
