"""Tool-call values and identity: typing `<parameter=…>` text by the tool's JSON schema, reading the JSON
(hermes) variant, and the dedupe key (spec/mtp-speculation.md §8.2, §8.4). Pure functions, no state;
the streaming scanner that finds calls in model output is output.py.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

MAX_LITERAL_CHARS = 100_000  # ast.literal_eval fallback only below this size (it is not linear-safe)


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> parameters schema for OpenAI-style tools ({"type": "function", "function": {...}})."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out.setdefault(fn["name"], dict(params) if isinstance(params, Mapping) else {})
    return out


def _resolve(schema: Any, root: Mapping[str, Any], depth: int = 0) -> Any:
    """Follow local `$ref`s ("#/$defs/X", "#/definitions/X", any "#/a/b" path) within the parameters schema."""
    while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and depth < 16:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        node: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, Mapping) else None
        schema, depth = node, depth + 1
    return schema


def is_string_schema(schema: Any, root: Mapping[str, Any] | None = None) -> bool:
    """True when the schema admits only strings (type "string", ["string"], a string enum/const, or
    anyOf/oneOf whose branches are all strings); `null` alongside does not change that."""
    schema = _resolve(schema, root or {})
    if not isinstance(schema, Mapping):
        return False
    t = schema.get("type")
    if isinstance(t, str):
        return t == "string"
    if isinstance(t, list):
        kinds = [k for k in t if k != "null"]
        return bool(kinds) and all(k == "string" for k in kinds)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            real = [b for b in branches if not (isinstance(b, Mapping) and b.get("type") == "null")]
            return bool(real) and all(is_string_schema(b, root) for b in real)
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return all(isinstance(v, str) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], str)
    return False


def parameter_value_text(raw: str) -> str:
    """§8.2: the text between the tags minus ONE leading and ONE trailing newline/space, nothing else."""
    if raw[:2] == "\r\n":
        raw = raw[2:]
    elif raw[:1] in ("\n", " "):
        raw = raw[1:]
    if raw[-2:] == "\r\n":
        raw = raw[:-2]
    elif raw[-1:] in ("\n", " "):
        raw = raw[:-1]
    return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """json.loads without NaN/Infinity (they cannot be written back as JSON)."""
    return json.loads(text, parse_constant=_reject_constant)


def coerce_parameter(text: str, schema: Any, root: Mapping[str, Any] | None = None) -> Any:
    """Typed value of one `<parameter=…>` (§8.2): a string schema keeps the raw text ("007" stays "007");
    anything else is parsed as JSON (Python-style single-quoted containers normalised first); text that
    does not parse stays a string."""
    if schema is not None and is_string_schema(schema, root):
        return text
    stripped = text.strip()
    if not stripped:
        return text
    try:
        return loads_strict(stripped)
    except (ValueError, RecursionError):
        pass
    if stripped[0] in "[{(" and len(stripped) <= MAX_LITERAL_CHARS:
        try:
            value = ast.literal_eval(stripped)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return text
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, dict | list) and _json_safe(value):
            return value
    return text


def _json_safe(value: Any, depth: int = 0) -> bool:
    if depth > 200:
        return False
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_json_safe(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_safe(v, depth + 1) for k, v in value.items())
    return False


def json_variant_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """`{"name": N, "arguments": {...} | "<json object text>"}` -> (N, arguments), or None if malformed."""
    try:
        obj = loads_strict(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_strict(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"].strip(), args


def argument_fragments(arguments: Mapping[str, Any]) -> list[str]:
    """The arguments JSON object as OpenAI-style fragments, one per parameter; "".join() is the text."""
    items = [json.dumps(k, ensure_ascii=False) + ": " + json.dumps(v, ensure_ascii=False)
             for k, v in arguments.items()]
    if not items:
        return ["{}"]
    return ["{" + items[0]] + [", " + it for it in items[1:]] + ["}"]


def canonical_arguments(arguments: str, final: bool = True) -> str:
    """§8.4 canonical form: trimmed text; for a final parse also re-dumped compactly with sorted keys
    (nlohmann's sorted objects), UTF-8 kept, 1 and 1.0 distinct; unparsable text stays trimmed text."""
    text = arguments.strip()
    if not final:
        return text
    try:
        return json.dumps(loads_strict(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        return text


def dedupe_key(name: str, arguments: str, final: bool = True) -> str:
    return name + "\x1f" + canonical_arguments(arguments, final)
