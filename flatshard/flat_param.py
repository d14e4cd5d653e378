"""``flatshard.flat_param``: the public names of one unit's flat parameter, where FSDP1 users
look for them (``torch.distributed.fsdp._flat_param``'s classes). They are defined in the unit
layer, ``flatshard/_flat/_flat_param.py``.
"""

from ._flat._flat_param import (
    FlatParameter,
    FlatParamHandle,
    OrigParam,
    ParamInfo,
    Precision,
    SharedParamInfo,
    ShardParamInfo,
    storage_key_of,
)

__all__ = ["FlatParameter", "FlatParamHandle", "storage_key_of", "ParamInfo", "SharedParamInfo", "ShardParamInfo", "OrigParam", "Precision"]
