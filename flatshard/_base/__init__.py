"""Vocabulary: state enums and their guarded transitions, names, errors, construction options,
and small helpers that import nothing else of flatshard's but ``flatshard.api``."""
