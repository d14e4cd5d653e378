"""What still references an object, in words a user can act on (for the warning of
``flatshard.destroy_process_group``; see [Note: ending cleanly] in ``teardown``).

[Note: finding holders] ``gc.get_referrers`` sees only containers the garbage collector
tracks. A process group is an untracked object, and so are dicts and tuples that hold only
untracked objects: a mesh's dict of groups, a function's default arguments, ``{"pg": group}``.
Running frames are not tracked either. So besides the referrers, the places where a group
is usually kept are looked at directly: the locals of every running frame, every module's
globals (one level into dicts, lists and tuples), every module function's default arguments,
and the device meshes over the group. This is best effort and never raises: a failure while
looking is reported as what it is.
"""

from __future__ import annotations

import gc
import os
import sys
import types
import warnings
from typing import Any, Dict, List

_OWN_FILES = {__file__}
# What is said when nothing that holds the object could be found.
UNSEEN = "something the garbage collector cannot see (a container of untracked objects, or C++ code)"


def describe_holders(target: Any, skip_files: List[str], limit: int = 3) -> List[str]:
    """Up to ``limit`` readable names of what references ``target``, leaving out the frames of
    this module and of ``skip_files`` (the caller's own references)."""
    skipped = _OWN_FILES | set(skip_files)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (reading torch's deprecated attributes warns)
            frames = [f for f in _running_frames() if f.f_code.co_filename not in skipped]
            found = _in_frames(target, frames) + _in_modules(target) + _in_meshes(target, skipped)
            # (reading ``f_locals`` makes a dict; this module's frames are never read, so no
            # dict of them holds ``target`` after they return)
            found += _referrers(target, {id(frame.f_locals) for frame in frames})
            del frames
    except Exception as exc:  # (best effort: the caller's warning must still be given)
        return [f"something flatshard could not name ({type(exc).__name__} while looking: {exc})"]
    unique = list(dict.fromkeys(found))
    return unique[:limit] or [UNSEEN]


def _running_frames() -> List[types.FrameType]:
    """Every thread's running frames but this function's own (a list holding it would make it
    a reference cycle: [Note: frames in locals] in ``_stale_optimizer``)."""
    frames = []
    for frame in list(sys._current_frames().values()):
        while frame is not None:
            if frame.f_code is not _running_frames.__code__:
                frames.append(frame)
            frame = frame.f_back
    return frames


def _in_frames(target: Any, frames: List[types.FrameType]) -> List[str]:
    found = []
    for frame in frames:
        code = frame.f_code
        for name, value in list(frame.f_locals.items()):
            if value is target:
                found.append(f"the local variable {name!r} of {code.co_name}() ({os.path.basename(code.co_filename)})")
    return found


def _in_modules(target: Any) -> List[str]:
    found = []
    seen = set()
    for module_name, module in list(sys.modules.items()):
        # (the instance dict itself: a lazy module's ``__getattr__`` would import, and run, code)
        namespace = _dict_of(module)
        if not isinstance(namespace, dict) or id(namespace) in seen:
            continue
        seen.add(id(namespace))
        defaults = []
        for name, value in list(dict.items(namespace)):
            if value is target:
                found.append(f"the global {name!r} of module {module_name}")
            elif isinstance(value, (list, tuple)) and _any_is(list(value) if type(value) in (list, tuple) else [], target):
                found.append(f"an item of the global {name!r} of module {module_name}")
            elif isinstance(value, dict) and _any_is(list(dict.values(value)), target):
                found.append(f"a value in the global {name!r} of module {module_name}")
            elif isinstance(value, types.FunctionType) and value.__module__ == module_name and _default_of(value, target):
                defaults.append(value.__name__)
        if defaults:
            listed = ", ".join(defaults[:3]) + (", ..." if len(defaults) > 3 else "")
            found.append(f"default arguments of {module_name} ({listed})")
    return found


def _any_is(items: List[Any], target: Any) -> bool:
    for item in items:
        if item is target:
            return True
    return False


def _default_of(function: types.FunctionType, target: Any) -> bool:
    keyword = (function.__kwdefaults__ or {}).values()
    return any(d is target for d in function.__defaults__ or ()) or any(d is target for d in keyword)


def _in_meshes(target: Any, skipped: set) -> List[str]:
    """The device meshes over ``target`` (a mesh keeps its groups in an untracked dict), by
    what holds them."""
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh_type is None:
        return []
    kinds_of_mesh = _with_subclasses(mesh_type)  # (a set lookup per object: the heap is large)
    meshes = [o for o in gc.get_objects() if type(o) in kinds_of_mesh and _mesh_holds(o, target)]
    if not meshes:
        return []
    kinds: Dict[str, None] = {}
    for referrer in gc.get_referrers(*meshes):
        if referrer is meshes or _is_skipped_frame(referrer, skipped):
            continue
        if type(referrer).__name__ == "DTensorSpec":
            kinds["DTensors (a sharded state dict, another DTensor, or a torch cache holding their specs)"] = None
        else:
            kinds[_name_of(referrer, meshes)] = None
    what = "a DeviceMesh" if len(meshes) == 1 else f"{len(meshes)} DeviceMeshes"
    return [f"{what} over it, held by {' and '.join(kinds) or UNSEEN}"]


def _with_subclasses(cls: type) -> set:
    found = {cls}
    for sub in cls.__subclasses__():
        found |= _with_subclasses(sub)
    return found


def _mesh_holds(mesh: Any, target: Any) -> bool:
    registry = getattr(mesh, "_pg_registry", None)
    return isinstance(registry, dict) and any(group is target for group in list(registry.values()))


def _referrers(target: Any, frame_locals: set) -> List[str]:
    """The referrers ``gc`` sees, except frames and their locals' dicts (``_in_frames``).
    (A loop, not a comprehension: on Python 3.11 a comprehension's closure over ``target``
    would be one of the referrers.)"""
    names = []
    for referrer in gc.get_referrers(target):
        if not isinstance(referrer, types.FrameType) and id(referrer) not in frame_locals:
            names.append(_name_of(referrer, [target]))
    return names


def _is_skipped_frame(obj: Any, skipped: set) -> bool:
    return isinstance(obj, types.FrameType) and obj.f_code.co_filename in skipped


def _name_of(referrer: Any, targets: List[Any]) -> str:
    """A name for ``referrer``, which holds one of ``targets``."""
    def holds(value: Any) -> bool:
        return any(value is t for t in targets)

    if isinstance(referrer, dict):
        keys = [k for k, v in list(referrer.items()) if holds(v)]
        key = f" {keys[0]!r}" if keys else ""
        for owner in gc.get_referrers(referrer):
            if isinstance(owner, types.ModuleType) and owner.__dict__ is referrer:
                return f"the global{key} of module {owner.__name__}"
            if isinstance(owner, types.FunctionType) and owner.__globals__ is referrer:  # (a module run by runpy)
                return f"the global{key} of module {owner.__module__}"
            if _dict_of(owner) is referrer:
                return f"attribute{key} of a {type(owner).__qualname__}"
        return f"a dict (key{key})" if keys else "a dict"
    if isinstance(referrer, tuple):
        for owner in gc.get_referrers(referrer):
            if isinstance(owner, types.FunctionType) and owner.__defaults__ is referrer:
                return f"a default argument of {owner.__module__}.{owner.__qualname__}"
    attributes = _dict_of(referrer)  # (Python 3.11+: an object's own attributes, not its dict, refer)
    if isinstance(attributes, dict) and not isinstance(referrer, type):
        keys = [k for k, v in list(dict.items(attributes)) if holds(v)]
        if keys:
            return f"attribute {keys[0]!r} of a {type(referrer).__qualname__}"
    if isinstance(referrer, types.CellType):
        for closure in gc.get_referrers(referrer):
            for owner in gc.get_referrers(closure) if isinstance(closure, tuple) else ():
                if isinstance(owner, types.FunctionType) and owner.__closure__ is closure:
                    return f"a variable captured by {owner.__module__}.{owner.__qualname__}"
    return f"a {type(referrer).__qualname__}"


def _dict_of(obj: Any) -> Any:
    try:
        return object.__getattribute__(obj, "__dict__")
    except Exception:  # (no __dict__, or one that raises: not the owner)
        return None
