"""``flatshard.optim_state``: optimizer state between the ``FlatParameter`` shards and the
original parameters, as a public module. It is defined in the checkpoint layer,
``flatshard/_checkpoint/_optim_state.py`` ([Note: optimizer state per original parameter]).
"""

from ._checkpoint._optim_state import (
    OptimStateIndex,
    flatten_optim_state,
    gather_optim_state,
    rekey,
    scatter_optim_state,
    template_state,
)

__all__ = ["OptimStateIndex", "gather_optim_state", "flatten_optim_state", "scatter_optim_state", "rekey", "template_state"]
