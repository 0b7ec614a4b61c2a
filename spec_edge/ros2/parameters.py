"""The node's ROS parameters: one per spec_edge.config key, each with its own descriptor.

A descriptor carries the key's ROS type (from the dataclass field; an empty-list default is typed by
its annotation, e.g. `tuple[int, ...]` -> integer array), its description (the comments written beside
the field in spec_edge/config.py: they are the documentation, kept in one place) and when it applies:
every parameter is read at configure, so a set is refused while the node holds an engine (inactive or
active) and accepted, checked, while it is unconfigured. No rclpy import at module level: the node
passes the rcl_interfaces types in.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from spec_edge import config as cfgmod

APPLIES = ("read at configure: refused while the node is configured (inactive or active); "
           "cleanup, set, then configure")


def field_comments() -> dict[str, str]:
    """'section.field' -> the comments written beside the field (above it, after it and on the
    continuation lines under a trailing comment) in spec_edge/config.py; "" where there are none."""
    out: dict[str, str] = {}
    for section in dataclasses.fields(cfgmod.Config):
        cls = type(section.default_factory())
        names = {f.name for f in dataclasses.fields(cls)}
        above: list[str] = []
        last = None           # the field a deeper-indented comment line continues
        for line in inspect.getsource(cls).splitlines()[2:]:  # after @dataclass and class ...:
            stripped = line.strip()
            indent = len(line) - len(line.lstrip())
            if stripped.startswith("#"):
                if indent > 4 and last is not None:
                    out[f"{section.name}.{last}"] += " " + stripped.lstrip("# ")
                else:
                    above.append(stripped.lstrip("# "))
                    last = None
                continue
            name = stripped.split(":", 1)[0]
            if name not in names:
                above, last = [], None
                continue
            trailing = line.split("#", 1)[1].strip() if "  #" in line else ""
            out[f"{section.name}.{name}"] = " ".join(above + ([trailing] if trailing else []))
            above, last = [], name
    return out


def array_element(section: str, name: str) -> type:
    """The element type of a tuple-typed config field (tuple[int, ...] -> int)."""
    cls = type(next(f for f in dataclasses.fields(cfgmod.Config) if f.name == section).default_factory())
    return typing.get_args(typing.get_type_hints(cls)[name])[0]


def ros_type(key: str, default: Any, types: Any) -> int:
    """The ParameterType constant (types: rcl_interfaces.msg.ParameterType) of a config key."""
    if isinstance(default, bool):
        return types.PARAMETER_BOOL
    if isinstance(default, int):
        return types.PARAMETER_INTEGER
    if isinstance(default, float):
        return types.PARAMETER_DOUBLE
    if isinstance(default, str):
        return types.PARAMETER_STRING
    element = array_element(*key.split(".", 1))
    return {int: types.PARAMETER_INTEGER_ARRAY, float: types.PARAMETER_DOUBLE_ARRAY,
            str: types.PARAMETER_STRING_ARRAY, bool: types.PARAMETER_BOOL_ARRAY}[element]


def descriptors(descriptor_cls: Any, types: Any) -> dict[str, tuple[Any, Any]]:
    """'section.field' -> (default, a fresh ParameterDescriptor of its own) for every config key."""
    comments = field_comments()
    out = {}
    for key, default in cfgmod.to_params(cfgmod.Config()).items():
        about = comments.get(key, "")
        out[key] = (default, descriptor_cls(
            name=key, type=ros_type(key, default, types), read_only=False, dynamic_typing=False,
            description=f"{key} (default {default!r}){': ' + about if about else ''}",
            additional_constraints=APPLIES))
    return out


def coerce(value: Any, type_id: int, types: Any) -> Any:
    """A value as set from the command line or a params file -> the declared type where that is
    lossless: an integer for a double (`request_timeout_s: 120`) or for a string (`speculative.k: 4`), an empty array of any element
    type for a typed array (ros2cli sends `[]` as a bool array; a params file's `[]` arrives unset,
    None). None: no lossless conversion."""
    if type_id == types.PARAMETER_DOUBLE and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type_id == types.PARAMETER_STRING and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # speculative.k: 4 (a string parameter: "auto" or a number)
    if type_id == types.PARAMETER_DOUBLE_ARRAY and isinstance(value, (list, tuple)) \
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    array_types = (types.PARAMETER_INTEGER_ARRAY, types.PARAMETER_DOUBLE_ARRAY,
                   types.PARAMETER_STRING_ARRAY, types.PARAMETER_BOOL_ARRAY)
    if type_id in array_types and (value is None or isinstance(value, (list, tuple)) and len(value) == 0):
        return []
    return None


TYPE_NAMES = {"PARAMETER_BOOL": "a boolean", "PARAMETER_INTEGER": "an integer", "PARAMETER_DOUBLE": "a number",
              "PARAMETER_STRING": "a string", "PARAMETER_INTEGER_ARRAY": "a list of integers",
              "PARAMETER_DOUBLE_ARRAY": "a list of numbers", "PARAMETER_STRING_ARRAY": "a list of strings",
              "PARAMETER_BOOL_ARRAY": "a list of booleans"}


def type_name(type_id: int, types: Any) -> str:
    return next(text for attr, text in TYPE_NAMES.items() if getattr(types, attr) == type_id)
