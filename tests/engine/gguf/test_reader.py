"""The reader agrees with gguf-py on every fixture; tensor bytes are owned copies (row A6)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGUFReader

from engine.errors import ModelFileError
from engine.gguf import load_model_file, open_gguf
from engine.weights import load_weights
from tests.conftest import fixture_path
from tests.engine.gguf.tiny_gguf import tiny_plan, write

MODELS = ["tiny-qwen35-f32", "tiny-qwen35-q8_0", "tiny-qwen35-q6_k", "tiny-qwen35-q4_k_m", "tiny-qwen35-iq4_xs",
          "tiny-qwen35moe-q8_0"]


@pytest.mark.parametrize("name", MODELS)
def test_metadata_tensors_and_bytes_equal_gguf_py(name):
    path = fixture_path(f"models/{name}.gguf")
    f = open_gguf(path)
    ref = GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(f.metadata) == keys
    for k in keys:
        assert f.metadata[k] == ref.fields[k].contents(), k
    assert list(f.tensors) == [t.name for t in ref.tensors]
    got = dict(f.read_tensors())
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert (info.ggml_type, info.offset, info.n_bytes) == (t.tensor_type, t.data_offset, t.n_bytes), t.name
        assert info.ne == tuple(int(d) for d in t.shape), t.name
        assert np.array_equal(got[t.name], np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
        assert got[t.name].flags.owndata or got[t.name].base is not None and not isinstance(got[t.name].base, np.memmap)


def test_tokenizer_only_fixture_opens_for_its_metadata_and_is_refused_as_a_model():
    path = fixture_path("tokenizer/qwen35-vocab.gguf")
    f = open_gguf(path)
    assert f.tensors == {}
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 248320
    assert len(f.metadata["tokenizer.ggml.merges"]) == 247587
    assert f.metadata["tokenizer.ggml.eos_token_id"] == 248046
    assert f.metadata["tokenizer.chat_template"] == fixture_path("tokenizer/chat_template.jinja").read_text()
    with pytest.raises(ModelFileError, match="has no model weights"):
        load_model_file(path)


# ---- A6: the file changes after its header was read --------------------------------------------

@pytest.fixture
def tiny(tmp_path):
    return write(tiny_plan(), tmp_path / "tiny.gguf")


@pytest.mark.parametrize("change", ["truncate0", "truncate_half", "zeros", "replace", "delete"])
def test_a6_change_after_open_gives_a_clean_error(tiny, tmp_path, change):
    f = open_gguf(tiny)
    size = tiny.stat().st_size
    if change == "truncate0":
        os.truncate(tiny, 0)
    elif change == "truncate_half":
        os.truncate(tiny, size // 2)
    elif change == "zeros":
        tiny.write_bytes(bytes(size))
        os.utime(tiny, ns=(1, 1))
    elif change == "replace":
        other = write(tiny_plan(seed=5), tmp_path / "other.gguf")
        os.replace(other, tiny)
    else:
        tiny.unlink()
    with pytest.raises(ModelFileError, match="changed|cannot reopen"):
        load_weights(f)


def test_a6_change_during_load_gives_a_clean_error(tiny):
    f = open_gguf(tiny)
    it = f.read_tensors()
    next(it)
    os.truncate(tiny, tiny.stat().st_size // 2)
    with pytest.raises(ModelFileError, match="changed"):
        list(it)


def test_a6_weights_stay_valid_after_the_file_is_truncated_or_deleted(tiny):
    m = load_model_file(tiny)
    w = m.load_weights()
    before = {n: q.dense().clone() for n, q in w.items()}
    os.truncate(tiny, 0)
    tiny.unlink()
    for n, q in w.items():
        assert np.array_equal(q.dense().numpy(), before[n].numpy()), n


def test_a6_open_does_not_map_the_file(tiny):
    """No memory map exists: the process's maps never mention the file while it is open and loaded."""
    maps = "/proc/self/maps"
    if not os.path.exists(maps):
        pytest.skip("no /proc/self/maps on this system")
    m = load_model_file(tiny)
    w = m.load_weights()
    assert str(tiny) not in open(maps).read()
    assert w


def test_a6_in_a_child_process_no_signal_clean_errors_identical_tokens(tmp_path):
    """The matrix's A6 shape: 10 changes during load, 10 after load with an 8-token greedy decode."""
    import subprocess
    import sys

    from tests.conftest import REPO

    r = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "tests.engine.gguf.a6_child", str(tmp_path), "7"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])  # negative = killed by a signal
    assert "METRIC A6 during=10 clean_errors=10 after=10 identical=10 signals=0" in r.stdout
