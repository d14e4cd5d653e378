"""Checkpoints and whole-model operations: state dicts (full, sharded, local), optimizer state,
full parameters (``summon_full_params``), the model as built, and gradient clipping."""
