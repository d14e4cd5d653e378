"""One unit's parameters: the flat layout, ``FlatParameter`` and ``FlatParamHandle``, the original
parameters and module views on top of it, its gradients, saved tensors and the execution order."""
