"""Session handles (what a decode node retains), their stores (memory, Redis) and retention."""
