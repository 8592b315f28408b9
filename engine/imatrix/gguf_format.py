"""llama.cpp's GGUF importance-matrix file: write and read (spec/mtp-speculation.md §9.3).

The file `llama-quantize --imatrix` reads: `general.type` = "imatrix", `imatrix.datasets` (strings),
`imatrix.chunk_count` and `imatrix.chunk_size` (u32), and per weight `<name>.in_sum2` (F32, ne [n_cols, n_mat]),
`<name>.counts` (F32, ne [1, n_mat]) and the optional `<name>.in_sum`, sorted by weight name. No architecture key.
Also the legacy `.dat` layout, for ik_llama.cpp's quantize, which reads nothing else.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

from engine.errors import ModelFileError
from engine.imatrix.stats import ImatrixEntry

IMATRIX_TYPE = "imatrix"
SUFFIX_IN_SUM2 = ".in_sum2"
SUFFIX_IN_SUM = ".in_sum"
SUFFIX_COUNTS = ".counts"


class _ImatrixWriter(GGUFWriter):
    """GGUFWriter without `general.architecture`: an imatrix file belongs to no architecture."""

    def add_architecture(self) -> None:
        pass


@dataclass
class ImatrixFile:
    datasets: list[str]
    chunk_count: int
    chunk_size: int
    entries: dict[str, ImatrixEntry]  # weight name -> sums; in_sum is zeros when the file has none


def write_imatrix(path: str | Path, entries: dict[str, ImatrixEntry], datasets: Sequence[str],
                  chunk_count: int, chunk_size: int, with_in_sum: bool = True) -> None:
    """Write `entries` in llama.cpp's GGUF imatrix format (values rounded to float32, as llama.cpp stores them)."""
    writer = _ImatrixWriter(str(path), arch=IMATRIX_TYPE)
    writer.add_type(IMATRIX_TYPE)
    # add_key_value, not add_array: llama.cpp writes the key even for an empty list
    writer.add_key_value(Keys.IMatrix.DATASETS, [str(d) for d in datasets], GGUFValueType.ARRAY, GGUFValueType.STRING)
    writer.add_uint32(Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
    writer.add_uint32(Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
    for name in sorted(entries):
        e = entries[name]
        # numpy shape is ggml's ne reversed: [n_mat, n_cols] -> ne [n_cols, n_mat]
        writer.add_tensor(name + SUFFIX_IN_SUM2, np.ascontiguousarray(e.in_sum2, dtype=np.float32))
        writer.add_tensor(name + SUFFIX_COUNTS, np.ascontiguousarray(e.counts.reshape(-1, 1), dtype=np.float32))
        if with_in_sum:
            writer.add_tensor(name + SUFFIX_IN_SUM, np.ascontiguousarray(e.in_sum, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_imatrix(path: str | Path) -> ImatrixFile:
    """Read a GGUF imatrix written by us or by llama.cpp. Raises ModelFileError naming what is wrong."""
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelFileError(path, f"not a GGUF imatrix: {exc}") from None
    fields = reader.fields

    def scalar(key: str) -> int:
        f = fields.get(key)
        if f is None:
            raise ModelFileError(path, f"{key}: required key missing")
        return int(f.parts[f.data[0]][0])

    ds_field = fields.get(Keys.IMatrix.DATASETS)
    if ds_field is None:
        raise ModelFileError(path, f"{Keys.IMatrix.DATASETS}: required key missing")
    if ds_field.types[:2] != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        raise ModelFileError(path, f"{Keys.IMatrix.DATASETS}: expected an array of strings")
    datasets = [bytes(ds_field.parts[i]).decode("utf-8") for i in ds_field.data]
    chunk_count, chunk_size = scalar(Keys.IMatrix.CHUNK_COUNT), scalar(Keys.IMatrix.CHUNK_SIZE)

    parts: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        for suffix in (SUFFIX_IN_SUM2, SUFFIX_COUNTS, SUFFIX_IN_SUM):
            if t.name.endswith(suffix):
                ne = [int(n) for n in t.shape]
                arr = np.asarray(t.data, dtype=np.float32).reshape(ne[1] if len(ne) > 1 else 1, ne[0])
                parts.setdefault(t.name[: -len(suffix)], {})[suffix] = arr
                break
    entries = {}
    for name in sorted(parts):
        p = parts[name]
        if SUFFIX_IN_SUM2 not in p or SUFFIX_COUNTS not in p:
            raise ModelFileError(path, f"{name}: in_sum2 and counts must both be present")
        in_sum2 = p[SUFFIX_IN_SUM2].astype(np.float64)
        counts = p[SUFFIX_COUNTS].reshape(-1)
        if counts.shape[0] != in_sum2.shape[0]:
            raise ModelFileError(path, f"{name}.counts: {counts.shape[0]} matrices, in_sum2 has {in_sum2.shape[0]}")
        in_sum = p.get(SUFFIX_IN_SUM)
        if in_sum is not None and in_sum.shape != in_sum2.shape:
            raise ModelFileError(path, f"{name}.in_sum: shape differs from in_sum2")
        entries[name] = ImatrixEntry(in_sum2, np.zeros_like(in_sum2) if in_sum is None else in_sum.astype(np.float64),
                                     np.rint(counts).astype(np.int64))
    return ImatrixFile(datasets, chunk_count, chunk_size, entries)


# -- legacy .dat (llama.cpp `--output-format dat`; the only format ik_llama.cpp's quantize reads) -------------

def write_imatrix_dat(path: str | Path, entries: dict[str, ImatrixEntry], dataset: str, chunk_count: int,
                      chunk_size: int) -> int:
    """Write the legacy binary imatrix (spec §9.3): int32 n_entries; per entry int32 name_len, name, int32 ncall,
    int32 nval, float32[nval] = (in_sum2 / count) · ncall (1 · ncall for a matrix with count 0); then int32
    chunk_count, int32 len, dataset. Entries whose every count is 0 are left out, as llama.cpp does.
    Returns the number of entries written."""
    kept = [n for n in sorted(entries) if int(entries[n].counts.max(initial=0)) > 0]
    with open(path, "wb") as fh:
        fh.write(struct.pack("<i", len(kept)))
        for name in kept:
            e = entries[name]
            raw = name.encode("utf-8")
            ncall = -(-int(e.counts.max()) // chunk_size)  # ceiling, so no entry gets 0 calls
            counts = e.counts.astype(np.float64)[:, None]
            values = np.where(counts > 0, e.in_sum2 / np.maximum(counts, 1), 1.0) * ncall
            fh.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size))
            fh.write(np.ascontiguousarray(values, dtype="<f4").tobytes())
        ds = dataset.encode("utf-8")
        fh.write(struct.pack("<ii", int(chunk_count), len(ds)) + ds)
    return len(kept)


@dataclass
class ImatrixDat:
    entries: dict[str, tuple[int, np.ndarray]]  # name -> (ncall, float32 values [nval])
    chunk_count: int
    dataset: str


def read_imatrix_dat(path: str | Path) -> ImatrixDat:
    """Read a legacy .dat imatrix (as ik_llama.cpp's quantize does). Raises ModelFileError when truncated."""
    data = Path(path).read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise ModelFileError(path, f"{what}: file ends at byte {len(data)}, needs {pos + n}")
        pos += n
        return data[pos - n:pos]

    (n_entries,) = struct.unpack("<i", take(4, "n_entries"))
    entries = {}
    for i in range(n_entries):
        (n,) = struct.unpack("<i", take(4, f"entry {i} name length"))
        name = take(n, f"entry {i} name").decode("utf-8")
        ncall, nval = struct.unpack("<ii", take(8, f"{name}: ncall/nval"))
        entries[name] = (ncall, np.frombuffer(take(4 * nval, f"{name}: values"), dtype="<f4").copy())
    (chunk_count,) = struct.unpack("<i", take(4, "chunk count"))
    (n,) = struct.unpack("<i", take(4, "dataset length"))
    return ImatrixDat(entries, chunk_count, take(n, "dataset").decode("utf-8"))
