"""Slot pinning from `id_slot` or a `-slot<N>` / `-s<N>` model-name suffix (spec/mtp-speculation.md §6.2).

Out-of-range or malformed pins are HTTP 400 before any work; a pin is never wrapped onto another slot
and never silently dropped (reliability-matrix E8).
"""

from __future__ import annotations

import re

from app.server.errors import bad_request

_SLOT_SUFFIX = re.compile(r"(?s)(.*)-slot(.*)")
_S_SUFFIX = re.compile(r"(?s)(.*)-s([0-9]+)")
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def pin_from_model_name(model: str | None, aliases: tuple[str, ...], n_parallel: int) -> int | None:
    """Slot index pinned by the model name, or None when the name is not a pin."""
    if model is None or model in aliases:
        return None
    m = _SLOT_SUFFIX.fullmatch(model)
    if m is not None:
        digits = m.group(2)
    else:
        m = _S_SUFFIX.fullmatch(model)
        if m is None:
            return None  # e.g. "...-super": ends in -s + letters, not a pin
        digits = m.group(2)
    if not _DECIMAL.fullmatch(digits):
        raise bad_request(f"model: malformed slot suffix in {model!r}: expected -slot<N> or -s<N> with "
                          f"N a decimal integer without leading zeros", param="model")
    if len(digits) > 9 or int(digits) >= n_parallel:
        raise bad_request(f"model: slot {digits} in {model!r} is out of range: this server has "
                          f"{n_parallel} slot(s), 0..{n_parallel - 1}", param="model")
    return int(digits)


def pin_from_id_slot(value: object, n_parallel: int) -> int | None:
    """Slot index from the body's `id_slot`: absent or -1 = not pinned."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"id_slot: must be an integer, got {type(value).__name__}", param="id_slot")
    if value == -1:
        return None
    if not 0 <= value < n_parallel:
        raise bad_request(f"id_slot: {value} is out of range: -1 (any slot) or 0..{n_parallel - 1}",
                          param="id_slot")
    return value


def resolve_pin(body: dict, aliases: tuple[str, ...], n_parallel: int) -> int | None:
    """The slot a request is pinned to (None = any); 400 on a bad or contradictory pin."""
    by_id = pin_from_id_slot(body.get("id_slot"), n_parallel)
    model = body.get("model")
    by_name = pin_from_model_name(model if isinstance(model, str) else None, aliases, n_parallel)
    if by_id is not None and by_name is not None and by_id != by_name:
        raise bad_request(f"id_slot: {by_id} contradicts the slot {by_name} pinned by model {model!r}",
                          param="id_slot")
    return by_id if by_id is not None else by_name
