"""A small JSON Schema checker, independent of the grammar engine, for the bench's validity column
and the tests: the keywords bench/robot_schemas.jsonl uses (type, enum, const, properties, required,
additionalProperties, items, minItems, maxItems, minimum, maximum, minLength, maxLength). A schema
with any other keyword is refused, so a check never passes by ignoring one."""
from __future__ import annotations

import json

KNOWN = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
         "maxItems", "minimum", "maximum", "minLength", "maxLength", "description", "title"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def violations(value, schema: dict, at: str = "$") -> list[str]:
    """What in value breaks schema ([] = valid)."""
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"schema_check does not know {sorted(unknown)} (at {at}): extend it or check otherwise")
    kind = schema.get("type")
    if kind in ("number", "integer"):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (kind == "integer" and not isinstance(value, int)):
            return [f"{at}: expected {kind}, got {type(value).__name__}"]
    elif kind is not None and not isinstance(value, TYPES[kind]):
        return [f"{at}: expected {kind}, got {type(value).__name__}"]
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{at}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        out.append(f"{at}: {value!r} != {schema['const']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{at}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{at}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            out.append(f"{at}: length {len(value)} outside [{schema.get('minLength', 0)}, {schema.get('maxLength')}]")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{at}: {len(value)} items outside [{schema.get('minItems', 0)}, {schema.get('maxItems')}]")
        for i, item in enumerate(value):
            out += violations(item, schema.get("items", {}), f"{at}[{i}]")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        out += [f"{at}: missing '{key}'" for key in schema.get("required", ()) if key not in value]
        for key, item in value.items():
            if key in properties:
                out += violations(item, properties[key], f"{at}.{key}")
            elif schema.get("additionalProperties", True) is False:
                out.append(f"{at}: unexpected key '{key}'")
    return out


def valid_json(text: str, schema: dict) -> tuple[bool, str]:
    """(valid, why not) of a text against a schema: it must parse as JSON and break nothing."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return False, f"not JSON: {err.msg} at {err.pos}"
    problems = violations(value, schema)
    return not problems, "; ".join(problems)
