"""A checked GGUF file: metadata as plain Python values, tensor infos, owned tensor bytes.

The header comes from `precheck.read_header` (the ten loader checks, bounded reads, no memory map).
Tensor bytes are read with `pread` into arrays we own, on demand, after checking with `fstat` that
the file is still the one whose header was checked; so a file truncated or replaced later gives a
`ModelFileError`, never a SIGBUS (spec/reliability-matrix.md A6).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.errors import ModelFileError
from engine.gguf.precheck import FileStamp, Header, ValueType, read_header


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch order: GGUF ne reversed, e.g. a matrix is (rows=ne1, cols=ne0)
    n_bytes: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def ne(self) -> tuple[int, ...]:
        """GGUF order (ne0 first), as the spec's tables write shapes."""
        return tuple(reversed(self.shape))


class GGUFFile:
    """A parsed GGUF: `metadata` (key -> Python value), `tensors` (name -> TensorInfo), owned bytes.

    `value_types` gives the GGUF type of each metadata value (for semantic checks). Tensor bytes are
    read from the file on request (`tensor_bytes`, `read_tensors`), or served from `blobs` when the
    object was built in memory.
    """

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 blobs: dict[str, np.ndarray] | None = None, *, header: Header | None = None):
        self.path = Path(path)
        self.metadata = metadata
        self.tensors = tensors
        self._blobs = blobs
        self.header = header
        self.value_types: dict[str, ValueType] = header.value_types if header is not None else {}

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def file_size(self) -> int | None:
        return self.header.stamp.size if self.header is not None else None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as an owned uint8 array (packed GGUF blocks for quantized types)."""
        if name not in self.tensors:
            raise KeyError(name)
        return dict(self.read_tensors([name]))[name]

    def read_tensors(self, names: Iterable[str] | None = None) -> Iterable[tuple[str, np.ndarray]]:
        """Yield (name, owned uint8 array) for `names` (default: all), in file order, through one descriptor.

        The file's size, mtime, inode and device must still match what they were when the header was
        checked, before and after each read and, by name, once all are read (a replaced or deleted
        file); otherwise ModelFileError("model file changed ..."). Consume the iterator to the end.
        """
        wanted = list(self.tensors) if names is None else list(names)
        infos = sorted((self.tensors[n] for n in wanted), key=lambda t: t.offset)
        if self._blobs is not None:
            for t in infos:
                yield t.name, self._blobs[t.name]
            return
        if self.header is None:
            raise ModelFileError(self.path, "no tensor data: this GGUFFile was built without a file")
        yield from _read_owned(self.path, self.header.stamp, infos)


def _stamp_of(fd: int) -> FileStamp:
    return FileStamp.of(os.fstat(fd))


def _read_owned(path: Path, stamp: FileStamp, infos: list[TensorInfo]) -> Iterable[tuple[str, np.ndarray]]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise ModelFileError(path, f"cannot reopen the model file: {exc.strerror}") from None
    try:
        if _stamp_of(fd) != stamp:
            raise ModelFileError(path, "model file changed since it was opened (size, mtime or inode differ)")
        for t in infos:
            out = np.empty(t.n_bytes, dtype=np.uint8)
            view = memoryview(out)
            done = 0
            while done < t.n_bytes:
                try:
                    n = os.preadv(fd, [view[done:]], t.offset + done)
                except OSError as exc:
                    raise ModelFileError(path, f"tensor {t.name!r}: read error at offset {t.offset + done}: "
                                               f"{exc.strerror}") from None
                if n == 0:
                    raise ModelFileError(path, f"tensor {t.name!r}: unexpected end of file at offset "
                                               f"{t.offset + done}: model file changed while loading")
                done += n
            if _stamp_of(fd) != stamp:
                raise ModelFileError(path, f"model file changed while loading (at tensor {t.name!r})")
            yield t.name, out
        # The descriptor still shows the old file when the path was replaced or deleted: check the name too.
        try:
            by_name = FileStamp.of(os.stat(path))
        except OSError:
            by_name = None
        if _stamp_of(fd) != stamp or by_name != stamp:
            raise ModelFileError(path, "model file changed while loading (truncated, rewritten, replaced or deleted)")
    finally:
        os.close(fd)


def open_gguf(path: str | Path) -> GGUFFile:
    """Check and parse the header of any GGUF (a model or a tokenizer-only file). Reads no tensor data."""
    header = read_header(path)
    tensors = {}
    for t in header.tensors:
        tensors[t.name] = TensorInfo(t.name, t.ggml_type, tuple(reversed(t.ne)), t.n_bytes,
                                     header.data_start + t.rel_offset)
    return GGUFFile(header.path, header.metadata, tensors, header=header)
