"""`python -m kvagent_server.cli`: `kvagent-server` without the console script."""

from kvagent_server.cli.app import app

app()
