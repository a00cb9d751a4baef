"""Small shared helpers: fast JSON, a periodic task."""
