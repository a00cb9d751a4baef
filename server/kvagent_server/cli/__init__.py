"""The `kvagent-server` and `kvagent` commands: the typer apps (`app`) and the console-script
entry points that guard them on an SDK-only install (`entry`).

Nothing is imported here: `entry` must load without the server extra's typer and rich.
"""
