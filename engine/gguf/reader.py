"""Reading a GGUF file into owned Python/numpy objects.

The file is read once; metadata values become plain Python values (str, int, float, bool, list) and
tensor bytes are copied out of the map, so a file truncated or replaced later cannot SIGBUS us.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from engine.errors import ModelFileError


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


class GGUFFile:
    """A parsed GGUF: `metadata` (key -> Python value), `tensors` (name -> TensorInfo), owned bytes."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 blobs: dict[str, np.ndarray]):
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._blobs = blobs

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as an owned uint8 array (packed GGUF blocks for quantized types)."""
        return self._blobs[name]

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


def _field_value(field: Any) -> Any:
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    v = field.parts[field.data[0]].tolist()[0]
    if types[0] == GGUFValueType.BOOL:
        return bool(v)
    return v


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(path, "no such file")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, f"not a readable GGUF file ({exc})") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = _field_value(field)
        except UnicodeDecodeError:
            raise ModelFileError(path, f"metadata key {key!r}: string is not valid UTF-8") from None
    tensors: dict[str, TensorInfo] = {}
    blobs: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        tensors[t.name] = TensorInfo(t.name, GGMLQuantizationType(int(t.tensor_type)), shape,
                                     int(t.n_bytes), int(t.data_offset))
        blobs[t.name] = np.array(t.data, copy=True).view(np.uint8).reshape(-1)
    del reader
    return GGUFFile(path, metadata, tensors, blobs)
