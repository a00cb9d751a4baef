"""`python -m kvagent_server.config`: print the reference table for docs/server.md."""

from kvagent_server.config.reference import config_reference_markdown

print(config_reference_markdown(), end="")
