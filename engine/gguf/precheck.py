"""Bounded parse of a GGUF header with the ten loader checks (spec/reliability-matrix.md, "The loader checks").

The header is read with bounded `pread` calls on one descriptor whose size comes from `fstat`; every
declared count or length is compared with the bytes that remain *before* anything sized by it is
allocated. All arithmetic is on Python ints. Nothing here memory-maps the file. Every problem raises
`ModelFileError` naming the field, tensor or byte offset; no other exception type escapes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# Caps of checks 1-2 (ours; ggml is looser, see the matrix).
MAX_TENSORS = 16_384
MAX_KV = 4_096
MIN_KV_RECORD = 14          # key length 8 + 1-byte key + type 4 + 1-byte value
MIN_TENSOR_RECORD = 33      # name length 8 + 1-byte name + n_dims 4 + one ne 8 + type 4 + offset 8
MAX_KEY_BYTES = 256
MAX_TENSOR_NAME_BYTES = 63
MAX_STRING_BYTES = 16 * 1024 * 1024
MAX_ARRAY_ELEMENTS = 4_194_304
MAX_TOTAL_STRING_BYTES = 256 * 1024 * 1024
MAX_DIMS = 4
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**36
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 65_536

_READ_CHUNK = 1 << 20       # header bytes are pulled in chunks of at least this size (never past EOF)

# Value types (check 3): struct format and byte size of each scalar type.
_SCALAR = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2), GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<B", 1),
    GGUFValueType.UINT64: ("<Q", 8), GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_NUMPY_DTYPE = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "<u1",
}

# Type ids that exist only in ik_llama.cpp files, for a clearer refusal (fixtures/README.md).
_IK_ONLY_TYPES = {140: "IQ5_K"}


@dataclass(frozen=True)
class ValueType:
    """GGUF type of one metadata value; `element` is set for arrays."""
    type: GGUFValueType
    element: GGUFValueType | None = None

    def __str__(self) -> str:
        if self.type == GGUFValueType.ARRAY:
            return f"array of {self.element.name.lower()}"
        return self.type.name.lower()


@dataclass(frozen=True)
class RawTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]        # GGUF order, ne0 first (contiguous)
    rel_offset: int            # offset inside the data section
    n_bytes: int
    record_offset: int         # where the tensor-info record starts in the file


@dataclass(frozen=True)
class FileStamp:
    """What `fstat` said about the file when the header was read; compared again before every data read."""
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


@dataclass
class Header:
    path: Path
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, ValueType]
    tensors: list[RawTensorInfo]
    alignment: int
    header_end: int
    data_start: int
    stamp: FileStamp
    trace: list[tuple[int, int, str]] | None = field(default=None, repr=False)


class _Source:
    """The file's bytes, pulled into memory on demand with bounded reads; never past the file size."""

    def __init__(self, fd: int, size: int, path: Path):
        self.fd, self.size, self.path = fd, size, path
        self.buf = bytearray()

    def ensure(self, end: int, pos: int, what: str) -> None:
        if end > self.size:
            raise ModelFileError(self.path, f"unexpected end of file at offset {pos} reading {what} "
                                            f"({end - pos} bytes needed, {self.size - pos} left)")
        have = len(self.buf)
        if end <= have:
            return
        want = min(self.size, max(end, have + _READ_CHUNK, 2 * have))
        while len(self.buf) < want:
            try:
                chunk = os.pread(self.fd, want - len(self.buf), len(self.buf))
            except OSError as exc:
                raise ModelFileError(self.path, f"read error at offset {len(self.buf)}: {exc.strerror}") from None
            if not chunk:
                # The file shrank between fstat and read.
                raise ModelFileError(self.path, f"unexpected end of file at offset {len(self.buf)} reading {what} "
                                                "(the file changed while it was read)")
            self.buf += chunk


class _Parser:
    def __init__(self, src: _Source, trace: list | None):
        self.src = src
        self.path = src.path
        self.pos = 0
        self.trace = trace
        self.string_bytes = 0

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(self.path, what)

    @property
    def remaining(self) -> int:
        return self.src.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        self.src.ensure(end, self.pos, what)
        out = bytes(self.src.buf[self.pos:end])  # a copy: the buffer may grow (no exported views)
        self.pos = end
        return out

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        start = self.pos
        self.src.ensure(start + size, start, what)
        (v,) = struct.unpack_from(fmt, self.src.buf, start)
        self.pos = start + size
        if self.trace is not None and size >= 4 and fmt[1] in "IQiq":
            self.trace.append((start, size, what))
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, cap: int, ascii_name: bool = False) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        if n > self.remaining:
            raise self.fail(f"offset {start}: {what} length {n} exceeds the {self.remaining} bytes left in the file")
        if n > cap:
            raise self.fail(f"offset {start}: {what} length {n} exceeds the limit of {cap} bytes")
        self.string_bytes += n
        if self.string_bytes > MAX_TOTAL_STRING_BYTES:
            raise self.fail(f"offset {start}: metadata strings exceed {MAX_TOTAL_STRING_BYTES} bytes in total")
        raw = self.take(n, what)
        try:
            s = raw.decode("utf-8")  # strict: rejects overlong forms and encoded surrogates (check 10)
        except UnicodeDecodeError as exc:
            raise self.fail(f"offset {start + 8 + exc.start}: {what} is not valid UTF-8") from None
        if ascii_name and not (s.isascii() and s.isprintable()):
            raise self.fail(f"offset {start}: {what} {s!r} is not printable ASCII")
        return s

    def value_type(self, what: str, key: str) -> GGUFValueType:
        start = self.pos
        tid = self.u32(what)
        try:
            return GGUFValueType(tid)
        except ValueError:
            raise self.fail(f"offset {start}: metadata key {key!r}: unknown value type id {tid}") from None

    def value(self, vtype: GGUFValueType, key: str) -> tuple[Any, ValueType]:
        if vtype == GGUFValueType.STRING:
            return self.string(f"metadata key {key!r} string value", MAX_STRING_BYTES), ValueType(vtype)
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        fmt, size = _SCALAR[vtype]
        start = self.pos
        v = self.scalar(fmt, size, f"metadata key {key!r} value")
        if vtype == GGUFValueType.BOOL:
            if v not in (0, 1):
                raise self.fail(f"offset {start}: metadata key {key!r}: boolean byte {v} is neither 0 nor 1")
            v = bool(v)
        return v, ValueType(vtype)

    def array(self, key: str) -> tuple[list, ValueType]:
        start = self.pos
        etype = self.value_type(f"metadata key {key!r} array element type", key)
        if etype == GGUFValueType.ARRAY:
            raise self.fail(f"offset {start}: metadata key {key!r}: nested arrays are not allowed")
        count_at = self.pos
        count = self.u64(f"metadata key {key!r} array length")
        if count > MAX_ARRAY_ELEMENTS:
            raise self.fail(f"offset {count_at}: metadata key {key!r}: array length {count} exceeds the limit "
                            f"of {MAX_ARRAY_ELEMENTS}")
        esize = 8 if etype == GGUFValueType.STRING else _SCALAR[etype][1]
        if count * esize > self.remaining:
            raise self.fail(f"offset {count_at}: metadata key {key!r}: array of {count} {etype.name.lower()} elements "
                            f"needs at least {count * esize} bytes, {self.remaining} left in the file")
        vt = ValueType(GGUFValueType.ARRAY, etype)
        if etype == GGUFValueType.STRING:
            return self.string_array(key, count), vt
        raw = self.take(count * esize, f"metadata key {key!r} array data")
        import numpy as np  # local: only numeric arrays need it

        arr = np.frombuffer(raw, dtype=_NUMPY_DTYPE[etype], count=count)
        if etype == GGUFValueType.BOOL:
            if count and int(arr.max()) > 1:
                bad = int(np.argmax(arr > 1))
                raise self.fail(f"offset {self.pos - count + bad}: metadata key {key!r}: boolean element #{bad} "
                                "is neither 0 nor 1")
            return [bool(x) for x in arr.tolist()], vt
        return arr.tolist(), vt

    def string_array(self, key: str, count: int) -> list[str]:
        # Hot path (a real vocabulary has ~250k tokens and merges): the checks of `string`, inlined.
        src, buf_size = self.src, self.src.size
        out: list[str] = []
        append = out.append
        unpack = struct.unpack_from
        pos = self.pos
        total = self.string_bytes
        what = f"metadata key {key!r} string element"
        for i in range(count):
            if pos + 8 > len(src.buf):
                src.ensure(pos + 8, pos, f"{what} #{i} length")
            (n,) = unpack("<Q", src.buf, pos)
            if n > buf_size - pos - 8:
                raise self.fail(f"offset {pos}: {what} #{i} length {n} exceeds the {buf_size - pos - 8} bytes "
                                "left in the file")
            if n > MAX_STRING_BYTES:
                raise self.fail(f"offset {pos}: {what} #{i} length {n} exceeds the limit of {MAX_STRING_BYTES} bytes")
            total += n
            if total > MAX_TOTAL_STRING_BYTES:
                raise self.fail(f"offset {pos}: metadata strings exceed {MAX_TOTAL_STRING_BYTES} bytes in total")
            end = pos + 8 + n
            if end > len(src.buf):
                src.ensure(end, pos, f"{what} #{i}")
            try:
                append(src.buf[pos + 8:end].decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise self.fail(f"offset {pos + 8 + exc.start}: {what} #{i} is not valid UTF-8") from None
            pos = end
        self.pos = pos
        self.string_bytes = total
        return out


def _type_of(tid: int, name: str, at: int, path: Path) -> GGMLQuantizationType:
    try:
        t = GGMLQuantizationType(tid)
    except ValueError:
        t = None
    if t is None or t not in GGML_QUANT_SIZES:
        extra = f" ({_IK_ONLY_TYPES[tid]}, an ik_llama.cpp-only type)" if tid in _IK_ONLY_TYPES else ""
        raise ModelFileError(path, f"offset {at}: tensor {name!r}: type id {tid}{extra} is not supported")
    return t


def read_header(path: str | Path, *, trace: bool = False) -> Header:
    """Parse and check the header of the GGUF at `path` (checks 1-10). Reads no tensor data."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise ModelFileError(path, "no such file") from None
    except IsADirectoryError:
        raise ModelFileError(path, "is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ModelFileError(path, f"cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        import stat as _stat

        if not _stat.S_ISREG(st.st_mode):
            raise ModelFileError(path, "is not a regular file")
        header = _parse(_Source(fd, st.st_size, path), [] if trace else None, FileStamp.of(st))
        if FileStamp.of(os.fstat(fd)) != header.stamp:
            raise ModelFileError(path, "model file changed while its header was read")
        return header
    finally:
        os.close(fd)


def _parse(src: _Source, trace: list | None, stamp: FileStamp) -> Header:
    p = _Parser(src, trace)
    path = src.path
    fail = p.fail

    # Check 1: magic, version, counts.
    magic = bytes(p.take(4, "magic"))
    if magic != GGUF_MAGIC:
        raise fail(f"offset 0: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    version = p.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise fail(f"offset 4: GGUF version {version} is not supported (2 or 3; big-endian files are not supported)")
    n_tensors = p.u64("tensor count")
    n_kv = p.u64("metadata key count")
    if n_tensors > MAX_TENSORS:
        raise fail(f"offset 8: tensor count {n_tensors} exceeds the limit of {MAX_TENSORS}")
    if n_kv > MAX_KV:
        raise fail(f"offset 16: metadata key count {n_kv} exceeds the limit of {MAX_KV}")
    if n_kv * MIN_KV_RECORD + n_tensors * MIN_TENSOR_RECORD > p.remaining:
        raise fail(f"offset 8: {n_tensors} tensors and {n_kv} metadata keys need at least "
                   f"{n_kv * MIN_KV_RECORD + n_tensors * MIN_TENSOR_RECORD} bytes, {p.remaining} left in the file")

    metadata: dict[str, Any] = {}
    value_types: dict[str, ValueType] = {}
    for i in range(n_kv):
        at = p.pos
        key = p.string(f"metadata #{i} key", MAX_KEY_BYTES, ascii_name=True)
        if not key:
            raise fail(f"offset {at}: metadata #{i} has an empty key")
        if key in metadata:  # check 9
            raise fail(f"offset {at}: metadata key {key!r} appears twice")
        vtype = p.value_type(f"metadata key {key!r} value type", key)
        metadata[key], value_types[key] = p.value(vtype, key)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:  # checks 3 and 6
        if value_types["general.alignment"] != ValueType(GGUFValueType.UINT32):
            raise fail(f"general.alignment: expected type uint32, found {value_types['general.alignment']}")
        alignment = metadata["general.alignment"]
        if not (1 <= alignment <= MAX_ALIGNMENT) or alignment & (alignment - 1):
            raise fail(f"general.alignment: {alignment} is not a power of two in [1, {MAX_ALIGNMENT}]")

    tensors: list[RawTensorInfo] = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = p.pos
        name = p.string(f"tensor info #{i} name", MAX_TENSOR_NAME_BYTES, ascii_name=True)
        if not name:
            raise fail(f"offset {at}: tensor info #{i} has an empty name")
        if name in names:  # check 9
            raise fail(f"offset {at}: tensor {name!r} appears twice")
        names.add(name)
        dims_at = p.pos
        n_dims = p.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:  # check 4
            raise fail(f"offset {dims_at}: tensor {name!r}: n_dims {n_dims} is not in 1..{MAX_DIMS}")
        ne = []
        for d in range(n_dims):
            ne_at = p.pos
            v = p.u64(f"tensor {name!r} ne[{d}]")
            if not 1 <= v <= MAX_DIM:
                raise fail(f"offset {ne_at}: tensor {name!r}: ne[{d}] = {v} is not in 1..{MAX_DIM}")
            ne.append(v)
        type_at = p.pos
        gtype = _type_of(p.u32(f"tensor {name!r} type"), name, type_at, path)
        off_at = p.pos
        rel = p.u64(f"tensor {name!r} data offset")
        # Check 5: element count and byte size in Python ints.
        n = 1
        for v in ne:
            n *= v
        if n > MAX_ELEMENTS:
            raise fail(f"offset {dims_at}: tensor {name!r}: {n} elements exceed the limit of 2^36")
        block, type_size = GGML_QUANT_SIZES[gtype]
        if ne[0] % block:
            raise fail(f"offset {dims_at}: tensor {name!r}: row length ne[0] = {ne[0]} is not a multiple of the "
                       f"{gtype.name} block size {block}")
        if rel % alignment:  # check 6
            raise fail(f"offset {off_at}: tensor {name!r}: data offset {rel} is not a multiple of the "
                       f"alignment {alignment}")
        tensors.append(RawTensorInfo(name, gtype, tuple(ne), rel, n // block * type_size, at))

    header_end = p.pos
    data_start = -(-header_end // alignment) * alignment
    size = src.size
    if tensors:
        if data_start > size:
            raise fail(f"offset {header_end}: the data section would start at {data_start}, past the end of the "
                       f"file ({size} bytes)")
        # Check 7: every tensor inside the file, the padded end of the last one included (as ggml reads it).
        for t in tensors:
            end = data_start + t.rel_offset + t.n_bytes
            if end > size:
                raise fail(f"tensor {t.name!r}: data [{data_start + t.rel_offset}, {end}) is not within the file "
                           f"({size} bytes): truncated or corrupted")
        last = max(tensors, key=lambda t: t.rel_offset + t.n_bytes)
        padded_end = data_start + -(-(last.rel_offset + last.n_bytes) // alignment) * alignment
        if padded_end > size:
            raise fail(f"tensor {last.name!r}: the file ends at {size}, inside the padding that must follow the "
                       f"tensor data (up to {padded_end}): truncated")
        # Check 8: no overlaps.
        ordered = sorted(tensors, key=lambda t: (t.rel_offset, t.n_bytes))
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.rel_offset + a.n_bytes > b.rel_offset:
                raise fail(f"tensor {b.name!r}: data at offset {data_start + b.rel_offset} overlaps tensor "
                           f"{a.name!r} [{data_start + a.rel_offset}, {data_start + a.rel_offset + a.n_bytes})")

    return Header(path, version, metadata, value_types, tensors, alignment, header_end, data_start, stamp,
                  trace=p.trace)
