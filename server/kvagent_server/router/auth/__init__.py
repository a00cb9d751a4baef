"""Who may claim what: signing keys, cache tokens, tenants."""
