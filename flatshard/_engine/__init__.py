"""The runtime: a unit's run-time state, the root's forward and backward hooks, the ranks'
agreement checks, and what acts on a running model (the optimizer-step hook, deep copies,
``generate``)."""
