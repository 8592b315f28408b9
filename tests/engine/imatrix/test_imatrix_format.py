"""The GGUF imatrix file: what llama-quantize reads (spec/mtp-speculation.md §9.3), checked with the gguf package."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from engine.errors import ModelFileError
from engine.imatrix.gguf_format import read_imatrix, write_imatrix
from engine.imatrix.stats import MIN_DENSE_ROWS, ImatrixStats


def _field_str(reader, key):
    f = reader.fields[key]
    return bytes(f.parts[f.data[0]]).decode()


def _stats(seed=0):
    g = torch.Generator().manual_seed(seed)
    st = ImatrixStats()
    x = torch.randn(40, 24, generator=g)
    st.add_dense("blk.0.attn_q.weight", x)
    st.add_dense("blk.0.attn_q.weight", x[:20] * 2)
    st.add_dense("output.weight", torch.randn(3, 17, 24, generator=g))  # leading dims are rows
    ids = torch.randint(0, 6, (30, 2), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % 6  # two distinct experts per token; expert 5 may still be unused
    st.add_experts("blk.1.ffn_down_exps.weight", 6, torch.randn(30, 2, 8, generator=g), ids)
    return st, x, ids


def test_dense_sums_counts_and_small_batches():
    st, x, _ = _stats()
    e = st.entries()["blk.0.attn_q.weight"]
    xd = x.double()
    np.testing.assert_allclose(e.in_sum2[0], (xd ** 2).sum(0) + (4 * xd[:20] ** 2).sum(0), rtol=1e-12)
    np.testing.assert_allclose(e.in_sum[0], xd.sum(0) + 2 * xd[:20].sum(0), rtol=1e-12)
    assert e.counts.tolist() == [60]
    assert st.entries()["output.weight"].counts.tolist() == [51]
    st.add_dense("blk.0.attn_q.weight", x[: MIN_DENSE_ROWS - 1])  # llama.cpp skips < 16 rows
    assert st.entries()["blk.0.attn_q.weight"].counts.tolist() == [60]


def test_expert_rows_go_to_their_expert():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 2, 8, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 6, (30, 2), generator=g)
    st = ImatrixStats()
    st.add_experts("w", 6, x, ids)
    e = st.entries()["w"]
    for ex in range(6):
        mask = ids == ex
        np.testing.assert_allclose(e.in_sum2[ex], (x[mask] ** 2).sum(0).numpy(), rtol=1e-12, atol=0)
        assert e.counts[ex] == int(mask.sum())
    assert e.counts.sum() == 60
    # gate/up form: the same row goes to each of the token's experts
    st2 = ImatrixStats()
    st2.add_experts("w", 6, x[:, 0], ids)
    st3 = ImatrixStats()
    st3.add_experts("w", 6, x[:, :1].expand(-1, 2, -1), ids)
    np.testing.assert_array_equal(st2.entries()["w"].in_sum2, st3.entries()["w"].in_sum2)
    # one expert at a time gives the same sums
    st4 = ImatrixStats()
    for ex in range(6):
        st4.add_expert("w", 6, ex, x[ids == ex])
    np.testing.assert_allclose(st4.entries()["w"].in_sum2, e.in_sum2, rtol=1e-12)
    np.testing.assert_array_equal(st4.entries()["w"].counts, e.counts)


def test_shape_change_is_refused():
    st = ImatrixStats()
    st.add_dense("w", torch.zeros(16, 4))
    with pytest.raises(ValueError, match="w: activation shape"):
        st.add_dense("w", torch.zeros(16, 5))


def test_non_finite_is_reported():
    st = ImatrixStats()
    st.add_dense("a", torch.ones(16, 4))
    x = torch.ones(16, 4)
    x[3, 1] = float("inf")
    st.add_dense("b", x)
    assert st.check_finite() == "b"


def test_gguf_keys_shapes_types(tmp_path):
    st, _, ids = _stats()
    entries = st.entries()
    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, entries, ["fixture-text.txt"], chunk_count=7, chunk_size=128)

    r = GGUFReader(str(path))
    assert _field_str(r, "general.type") == "imatrix"
    assert "general.architecture" not in r.fields  # llama.cpp writes none
    ds = r.fields["imatrix.datasets"]
    assert ds.types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert [bytes(ds.parts[i]).decode() for i in ds.data] == ["fixture-text.txt"]
    for key, val in (("imatrix.chunk_count", 7), ("imatrix.chunk_size", 128)):
        assert r.fields[key].types == [GGUFValueType.UINT32]
        assert int(r.fields[key].parts[-1][0]) == val

    tensors = {t.name: t for t in r.tensors}
    names = [t.name for t in r.tensors]
    weights = sorted(entries)
    assert names == [f"{w}{s}" for w in weights for s in (".in_sum2", ".counts", ".in_sum")]
    for t in r.tensors:
        assert t.tensor_type == GGMLQuantizationType.F32
    # ne = [n_cols, n_mat] for sums, [1, n_mat] for counts
    assert [int(n) for n in tensors["blk.0.attn_q.weight.in_sum2"].shape] == [24, 1]
    assert [int(n) for n in tensors["blk.0.attn_q.weight.counts"].shape] == [1, 1]
    assert [int(n) for n in tensors["blk.1.ffn_down_exps.weight.in_sum2"].shape] == [8, 6]
    assert [int(n) for n in tensors["blk.1.ffn_down_exps.weight.counts"].shape] == [1, 6]
    counts = np.asarray(tensors["blk.1.ffn_down_exps.weight.counts"].data).reshape(-1)
    np.testing.assert_array_equal(counts, np.bincount(ids.reshape(-1).numpy(), minlength=6))
    sums = np.asarray(tensors["blk.1.ffn_down_exps.weight.in_sum2"].data).reshape(6, 8)
    np.testing.assert_array_equal(sums, entries["blk.1.ffn_down_exps.weight"].in_sum2.astype(np.float32))

    back = read_imatrix(path)
    assert (back.datasets, back.chunk_count, back.chunk_size) == (["fixture-text.txt"], 7, 128)
    assert sorted(back.entries) == weights
    for w in weights:
        np.testing.assert_array_equal(back.entries[w].in_sum2, entries[w].in_sum2.astype(np.float32))
        np.testing.assert_array_equal(back.entries[w].counts, entries[w].counts)


def test_reader_refuses_file_without_metadata(tmp_path):
    import gguf

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen35")
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones((1, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="imatrix.datasets: required key missing"):
        read_imatrix(path)


def _parse_dat(raw: bytes):
    """ik_llama.cpp quantize's `load_imatrix`, step by step: name -> (ncall, values); last chunk, dataset."""
    import struct

    pos, out = 4, {}
    (n,) = struct.unpack_from("<i", raw, 0)
    for _ in range(n):
        (ln,) = struct.unpack_from("<i", raw, pos)
        name = raw[pos + 4:pos + 4 + ln].decode()
        pos += 4 + ln
        ncall, nval = struct.unpack_from("<ii", raw, pos)
        pos += 8
        out[name] = (ncall, np.frombuffer(raw, "<f4", nval, pos))
        pos += 4 * nval
    last, ln = struct.unpack_from("<ii", raw, pos)
    assert pos + 8 + ln == len(raw)
    return out, last, raw[pos + 8:].decode()


def test_legacy_dat_layout(tmp_path):
    from engine.imatrix.gguf_format import read_imatrix_dat, write_imatrix_dat

    st, _, ids = _stats()
    st.add_expert("blk.2.ffn_up_exps.weight", 4, 1, torch.zeros(0, 8))  # an entry that saw no rows at all
    entries = st.entries()
    path = tmp_path / "imatrix.dat"
    assert write_imatrix_dat(path, entries, "calib.txt", chunk_count=3, chunk_size=16) == 3
    parsed, last, dataset = _parse_dat(path.read_bytes())
    assert (last, dataset) == (3, "calib.txt")
    assert list(parsed) == ["blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight", "output.weight"]
    for name, (ncall, values) in parsed.items():
        e = entries[name]
        assert ncall == -(-int(e.counts.max()) // 16)
        want = np.where(e.counts[:, None] > 0, e.in_sum2 / np.maximum(e.counts[:, None], 1), 1.0) * ncall
        np.testing.assert_allclose(values.reshape(e.n_mat, e.n_cols), want, rtol=1e-6)
    # ik's quantize divides by ncall: the mean of squares per column, 1 for an unused expert
    ncall, values = parsed["blk.1.ffn_down_exps.weight"]
    e = entries["blk.1.ffn_down_exps.weight"]
    used = e.counts > 0
    np.testing.assert_allclose((values.reshape(6, 8) / ncall)[used], e.in_sum2[used] / e.counts[used, None], rtol=1e-6)

    back = read_imatrix_dat(path)
    assert back.chunk_count == 3 and back.dataset == "calib.txt" and list(back.entries) == list(parsed)
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(ModelFileError, match="file ends at byte"):
        read_imatrix_dat(path)
