"""One turn as a line of stages over the turn's shapes: gather, decide, execute, relay, settle."""
