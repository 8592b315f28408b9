"""Strict JSON request bodies (reliability-matrix E5, E6).

UTF-8 only, no NaN/Infinity (Python's json accepts them unless told otherwise), nesting depth <= 64,
no lone surrogates in any string (json.loads accepts "\\ud800", which would fail later when encoding).
"""

from __future__ import annotations

import json

from app.server.errors import bad_request

MAX_DEPTH = 64


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json_object(raw: bytes) -> dict:
    """The body as a dict, or ApiError 400 saying why not."""
    if not raw.strip():
        raise bad_request("request body: empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body: not valid UTF-8 at byte {exc.start}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"request body: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise bad_request(f"request body: not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"request body: expected a JSON object, got {_json_type(obj)}")
    _check_tree(obj)
    return obj


def _check_tree(root: object) -> None:
    """Iterative walk: depth bound, finite numbers, strings encodable as UTF-8."""
    stack: list[tuple[object, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_DEPTH:
                raise bad_request(f"request body: JSON nested deeper than {MAX_DEPTH} levels")
            for k, v in node.items():
                _check_str(k)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_DEPTH:
                raise bad_request(f"request body: JSON nested deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, str):
            _check_str(node)
        elif isinstance(node, float) and (node != node or node in (float("inf"), float("-inf"))):
            raise bad_request("request body: number out of range (overflows to infinity)")


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body: string contains a lone UTF-16 surrogate escape") from None


def _json_type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"
