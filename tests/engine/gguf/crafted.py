"""Byte-level builders for hand-crafted (usually malformed) GGUF headers, and helpers to patch a valid file."""

from __future__ import annotations

import struct
from pathlib import Path

from engine.gguf.precheck import read_header


def gstr(b: bytes | str) -> bytes:
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, 4, struct.pack("<I", v))


def kv_str(key: str, v: bytes | str) -> bytes:
    return kv(key, 8, gstr(v))


def kv_array(key: str, etype: int, count: int, payload: bytes) -> bytes:
    return kv(key, 9, struct.pack("<IQ", etype, count) + payload)


def tensor_info(name: bytes | str, ne: list[int], type_id: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n_dims = len(ne) if n_dims is None else n_dims
    return gstr(name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", d) for d in ne) + \
        struct.pack("<IQ", type_id, offset)


def header(n_tensors: int, n_kv: int, body: bytes = b"", version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def padded(b: bytes, alignment: int = 32) -> bytes:
    return b + b"\0" * (-len(b) % alignment)


def fields(path: Path) -> list[tuple[int, int, str]]:
    """The (offset, width, label) of every integer field the parser read from a valid file."""
    return read_header(path, trace=True).trace


def field_at(path: Path, label_part: str, nth: int = 0) -> tuple[int, int, str]:
    hits = [f for f in fields(path) if label_part in f[2]]
    assert len(hits) > nth, (label_part, [f[2] for f in fields(path)][:20])
    return hits[nth]


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def patch_int(data: bytes, field: tuple[int, int, str], value: int) -> bytes:
    off, width, _ = field
    return patch(data, off, value.to_bytes(width, "little", signed=False))


def string_offset(path: Path, length_label: str, nth: int = 0) -> int:
    """Offset of the bytes of the string whose length field's label contains `length_label`."""
    off, width, _ = field_at(path, length_label, nth)
    return off + width
