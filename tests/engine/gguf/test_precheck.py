"""Rows A1-A3 of spec/reliability-matrix.md: truncation, hostile counts and lengths, structural attacks."""

from __future__ import annotations

import os
import re
import resource
import struct
import time
import tracemalloc

import pytest

from engine.errors import ModelFileError
from engine.gguf import load_model_file, open_gguf
from engine.gguf.precheck import read_header
from tests.engine.gguf import crafted as c
from tests.engine.gguf.tiny_gguf import tiny_plan, write


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _names_a_place(msg: str) -> bool:
    return bool(re.search(r"offset \d+|\[\d+, \d+\)|ends at \d+|the file \(\d+ bytes\)", msg))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return write(tiny_plan(), d / "tiny-qwen35.gguf")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-moe")
    return write(tiny_plan(moe=True), d / "tiny-qwen35moe.gguf")


def _best_ms(path, repeats: int = 3) -> float:
    """Load time of `path` in ms: the best of a few runs, so a busy shared CPU does not decide the bound."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            load_model_file(path)
        except ModelFileError:
            pass
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _cut_all(path, cuts, scratch):
    """Load every prefix of `path` of the given lengths (descending, by truncating one copy in place)."""
    data = path.read_bytes()
    scratch.write_bytes(data)
    rejected, other, accepted, slowest = 0, [], [], 0.0
    vague = []
    for n in sorted(cuts, reverse=True):
        os.truncate(scratch, n)
        t0 = time.perf_counter()
        try:
            load_model_file(scratch)
            accepted.append(n)
        except ModelFileError as exc:
            rejected += 1
            if not _names_a_place(exc.what):
                vague.append((n, exc.what))
        except Exception as exc:  # noqa: BLE001 - the point of the test
            other.append((n, repr(exc)))
        dt = time.perf_counter() - t0
        if dt > 0.01:  # re-measure the rare slow case: a scheduler hiccup is not the loader's time
            dt = _best_ms(scratch) / 1000
        slowest = max(slowest, dt)
    return rejected, other, accepted, vague, slowest


def test_a1_every_proper_prefix_is_rejected_naming_the_offset(tiny, tmp_path):
    size = tiny.stat().st_size
    load_model_file(tiny)  # the whole file is valid
    rss0 = _maxrss_mib()
    rejected, other, accepted, vague, slowest = _cut_all(tiny, range(size), tmp_path / "cut.gguf")
    growth = _maxrss_mib() - rss0
    print(f"METRIC A1 cuts={size} rejected={rejected} other_exc={len(other)} max_ms={slowest * 1000:.1f} "
          f"rss_mib=+{growth:.1f}")
    assert not other, other[:5]
    assert not accepted, accepted[:5]
    assert not vague, vague[:5]
    assert rejected == size
    assert slowest < 0.05
    assert growth < 16


def test_a1_moe_header_bytes_and_tensor_boundaries(tiny_moe, tmp_path):
    h = read_header(tiny_moe)
    cuts = set(range(h.data_start + 1))
    for t in h.tensors:
        for edge in (t.rel_offset, t.rel_offset + t.n_bytes):
            cuts.update(h.data_start + edge + d for d in (-1, 0, 1))
    size = tiny_moe.stat().st_size
    cuts = {n for n in cuts if 0 <= n < size}
    rejected, other, accepted, vague, slowest = _cut_all(tiny_moe, cuts, tmp_path / "cut.gguf")
    assert (not other) and (not accepted) and (not vague), (other[:3], accepted[:3], vague[:3])
    assert rejected == len(cuts) and slowest < 0.05


@pytest.mark.slow
def test_a1_real_fixture_prefixes(tmp_path):
    from tests.conftest import fixture_path

    src = fixture_path("models/tiny-qwen35-q4_k_m.gguf")
    h = read_header(src)
    size = src.stat().st_size
    cuts = set(range(min(size, 65536)))
    for t in h.tensors:
        cuts.update(h.data_start + t.rel_offset + t.n_bytes + d for d in (-1, 0, 1))
    import random

    rnd = random.Random(1)
    cuts.update(rnd.randrange(size) for _ in range(2000))
    rejected, other, accepted, vague, slowest = _cut_all(src, {n for n in cuts if n < size}, tmp_path / "c.gguf")
    assert not other and not accepted and not vague


# ---- A2: hostile counts and lengths -------------------------------------------------------------

def _base() -> tuple[bytes, dict[str, int]]:
    """A small valid GGUF and the offset of each count/length field in it."""
    meta = (c.kv_str("general.architecture", "qwen35")
            + c.kv_array("t.nums", 4, 3, struct.pack("<3I", 1, 2, 3))
            + c.kv_array("t.strs", 8, 2, c.gstr("x") + c.gstr("yz")))
    head = c.header(1, 3, meta + c.tensor_info("w", [4], 0, 0))
    data = c.padded(head) + struct.pack("<4f", 1, 2, 3, 4) + b"\0" * 16
    o = {"tensor count": 8, "kv count": 16, "key length": 24}
    o["string value length"] = 24 + 8 + len("general.architecture") + 4
    o["numeric array length"] = o["string value length"] + 8 + len("qwen35") + 8 + len("t.nums") + 4 + 4
    o["string array length"] = o["numeric array length"] + 8 + 12 + 8 + len("t.strs") + 4 + 4
    o["string element length"] = o["string array length"] + 8
    o["tensor name length"] = len(head) - len(c.tensor_info("w", [4], 0, 0))
    return data, o


_CAPS = {"tensor count": 16384, "kv count": 4096, "key length": 256, "string value length": 16 * 2**20,
         "numeric array length": 4194304, "string array length": 4194304, "string element length": 16 * 2**20,
         "tensor name length": 63}


def _a2_cases():
    data, offsets = _base()
    cases = []
    for field, off in offsets.items():
        remaining = len(data) - (off + 8)
        for label, v in (("cap+1", _CAPS[field] + 1), ("remaining+1", remaining + 1), ("2^31", 2**31),
                         ("2^32", 2**32), ("2^63-1", 2**63 - 1), ("2^64-1", 2**64 - 1)):
            cases.append((f"{field}={label}", c.patch(data, off, struct.pack("<Q", v))))
    # an array of strings whose count fits the cap but whose minimum size (8 bytes each) does not
    _, o = _base()
    cases.append(("string array min size", c.patch(data, o["string array length"], struct.pack("<Q", 1_000_000))))
    cases.append(("n_dims 2^32-1", c.patch(data, o["tensor name length"] + 9, struct.pack("<I", 2**32 - 1))))
    return cases


def test_a2_base_file_is_valid(tmp_path):
    data, _ = _base()
    p = tmp_path / "base.gguf"
    p.write_bytes(data)
    f = open_gguf(p)
    assert f.metadata["t.strs"] == ["x", "yz"] and f.metadata["t.nums"] == [1, 2, 3]
    assert f.tensor_bytes("w").view("<f4").tolist() == [1, 2, 3, 4]


def test_a2_hostile_counts_and_lengths_are_rejected_before_allocation(tmp_path):
    cases = _a2_cases()
    assert len(cases) >= 40
    p = tmp_path / "hostile.gguf"
    rss0 = _maxrss_mib()
    worst_ms, worst_kib, failures = 0.0, 0.0, []
    for name, data in cases:
        p.write_bytes(data)
        tracemalloc.start()
        try:
            open_gguf(p)
            failures.append((name, "accepted"))
        except ModelFileError:
            pass
        except Exception as exc:  # noqa: BLE001
            failures.append((name, repr(exc)))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        worst_ms, worst_kib = max(worst_ms, _best_ms(p)), max(worst_kib, peak / 1024)
    growth = _maxrss_mib() - rss0
    print(f"METRIC A2 cases={len(cases)} rejected={len(cases) - len(failures)} max_ms={worst_ms:.1f} "
          f"max_alloc_kib={worst_kib:.0f}")
    assert not failures, failures
    assert worst_ms < 20
    assert worst_kib < 1024
    assert growth < 8


# ---- A3: structural attacks ---------------------------------------------------------------------

def _structural_cases(tiny):
    data = tiny.read_bytes()
    f = c.fields(tiny)
    h = read_header(tiny)
    by_name = {t.name: t for t in h.tensors}

    def fld(part, nth=0):
        return c.field_at(tiny, part, nth)

    def setint(part, value, nth=0):
        return c.patch_int(data, fld(part, nth), value)

    def vtype_of(key):
        return fld(f"metadata key {key!r} value type")

    cases = []  # (name, check number, bytes, expected message part)
    add = cases.append
    # check 1
    add(("bad magic", 1, c.patch(data, 0, b"GGUG"), "not a GGUF file"))
    add(("version 1", 1, c.patch(data, 4, struct.pack("<I", 1)), "version 1"))
    add(("version 4", 1, c.patch(data, 4, struct.pack("<I", 4)), "version 4"))
    add(("big-endian version", 1, c.patch(data, 4, struct.pack(">I", 3)), "version"))
    # check 3: types
    add(("nested array", 3, setint("'qwen35.rope.dimension_sections' array element type", 9), "nested arrays"))
    add(("unknown array element type", 3, setint("'tokenizer.ggml.token_type' array element type", 13),
         "unknown value type"))
    add(("unknown value type 13", 3, c.patch_int(data, vtype_of("general.name"), 13), "unknown value type id 13"))
    add(("value type 2^32-1", 3, c.patch_int(data, vtype_of("general.type"), 2**32 - 1), "unknown value type"))
    bool_at = vtype_of("tokenizer.ggml.add_bos_token")[0] + 4
    add(("bool byte 2", 3, c.patch(data, bool_at, b"\x02"), "neither 0 nor 1"))
    add(("bool byte 0xFF", 3, c.patch(data, bool_at, b"\xff"), "neither 0 nor 1"))
    align_i32 = c.header(0, 1, c.kv("general.alignment", 5, struct.pack("<i", 32)))
    add(("alignment as int32", 3, align_i32, "general.alignment: expected type uint32"))
    # check 4: n_dims and ne
    add(("n_dims 0", 4, setint("'token_embd.weight' n_dims", 0), "n_dims 0"))
    add(("n_dims 5", 4, setint("'token_embd.weight' n_dims", 5), "n_dims 5"))
    add(("n_dims 0xFFFFFFFF", 4, setint("'token_embd.weight' n_dims", 2**32 - 1), "n_dims"))
    add(("ne 0", 4, setint("'blk.0.ssm_a' ne[0]", 0), "ne[0] = 0"))
    add(("ne 2^42+1", 4, setint("'blk.0.ssm_a' ne[0]", 2**42 + 1), "ne[0]"))
    add(("ne INT64_MAX", 4, setint("'token_embd.weight' ne[0]", 2**63 - 1), "ne[0]"))
    # check 5: element count, type, block size
    two = c.patch_int(setint("'token_embd.weight' ne[0]", 2**20), fld("'token_embd.weight' ne[1]"), 2**20)
    add(("2^40 elements", 5, c.patch_int(two, fld("'token_embd.weight' ne[1]"), 2**20), "exceed the limit of 2^36"))
    add(("ik type 140", 5, setint("'blk.0.ssm_out.weight' type", 140), "type id 140 (IQ5_K"))
    add(("removed type 4", 5, setint("'blk.0.ssm_out.weight' type", 4), "type id 4 "))
    add(("Q8_0 row of 4", 5, setint("'blk.0.ssm_out.weight' type", 8), "block size 32"))
    # check 6: alignment
    for v in (0, 3, 131072):
        add((f"alignment {v}", 6, c.header(0, 1, c.kv_u32("general.alignment", v)), "general.alignment"))
    t0 = by_name["blk.0.attn_norm.weight"]
    add(("misaligned offset", 6, setint("'blk.0.attn_norm.weight' data offset", t0.rel_offset + 4),
         "not a multiple of the alignment"))
    add(("offset 2^64-1", 6, setint("'blk.0.attn_norm.weight' data offset", 2**64 - 1), "alignment"))
    # check 7: inside the file
    add(("offset 2^64-32", 7, setint("'blk.0.attn_norm.weight' data offset", 2**64 - 32), "not within the file"))
    add(("ne past the end", 7, setint("'output_norm.weight' ne[0]", 4 * 2**20), "not within the file"))
    no_data = c.header(1, 0, c.tensor_info("w", [4], 0, 0))
    add(("data section past EOF", 7, no_data, "past the end of the file"))
    # check 8: overlaps
    t1 = by_name["blk.0.ssm_a"]
    add(("shared offset", 8, setint("'blk.0.ssm_a' data offset", t0.rel_offset), "overlaps"))
    big = by_name["token_embd.weight"]
    add(("partial overlap", 8, setint("'blk.0.ssm_a' data offset", big.rel_offset + 32), "overlaps"))
    assert t1.n_bytes <= 32 < big.n_bytes
    # check 9: unique, non-empty names and keys
    name1 = c.string_offset(tiny, "tensor info #", [i for i, t in enumerate(h.tensors) if t.name == "blk.1.ssm_a"][0])
    add(("duplicate tensor name", 9, c.patch(data, name1, b"blk.0.ssm_a"), "appears twice"))
    key_type = c.string_offset(tiny, "metadata #1 key length")
    assert data[key_type:key_type + 12] == b"general.type"
    add(("duplicate key", 9, c.patch(data, key_type, b"general.name"), "appears twice"))
    add(("empty key", 9, c.header(0, 1, c.kv_u32("", 1)), "empty key"))
    add(("empty tensor name", 9, c.padded(c.header(1, 0, c.tensor_info("", [4]))) + bytes(32), "empty name"))
    # check 10: strict UTF-8 and printable ASCII names
    name_at = c.string_offset(tiny, "metadata #2 key length")  # general.name
    add(("overlong UTF-8 in key", 10, c.patch(data, name_at, b"\xc0\xaf"), "not valid UTF-8"))
    add(("surrogate in tensor name", 10, c.patch(data, name1, b"\xed\xa0\x80"), "not valid UTF-8"))
    val_at = c.string_offset(tiny, "'general.name' string value length")
    add(("overlong in string value", 10, c.patch(data, val_at, b"\xe0\x80\xaf"), "not valid UTF-8"))
    tok_len = c.field_at(tiny, "'tokenizer.ggml.tokens' array length")
    add(("bad UTF-8 in a token", 10, c.patch(data, tok_len[0] + 16, b"\xff"), "not valid UTF-8"))
    add(("control char in key", 10, c.patch(data, name_at, b"\x01"), "not printable ASCII"))
    add(("NUL in tensor name", 10, c.patch(data, name1, b"\x00"), "not printable ASCII"))
    assert f  # the trace is not empty
    return cases


def test_a3_structural_attacks_are_rejected_by_the_named_check(tiny, tmp_path):
    cases = _structural_cases(tiny)
    assert len(cases) >= 30
    per_check: dict[int, int] = {}
    p = tmp_path / "attack.gguf"
    failures = []
    worst_ms = 0.0
    for name, check, data, expected in cases:
        p.write_bytes(data)
        tracemalloc.start()
        try:
            load_model_file(p)
            failures.append((name, "accepted"))
        except ModelFileError as exc:
            if expected not in exc.what:
                failures.append((name, f"message {exc.what!r} lacks {expected!r}"))
        except Exception as exc:  # noqa: BLE001
            failures.append((name, repr(exc)))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        worst_ms = max(worst_ms, _best_ms(p))
        assert peak < 1 << 20, (name, peak)
        per_check[check] = per_check.get(check, 0) + 1
    by = ",".join(f"{k}:{v}" for k, v in sorted(per_check.items()))
    print(f"METRIC A3 cases={len(cases)} rejected={len(cases) - len(failures)} by_check={by}")
    assert not failures, failures
    assert all(per_check.get(k, 0) >= 2 for k in range(3, 11)), per_check
    assert worst_ms < 20
