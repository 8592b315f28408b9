"""A RYS file (a span of main blocks repeated, spec §5.2) loads by tensor presence and equals the
original model's blocks run in the repeated order, each copy with its own cache and state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine.config import ATTN, GDN
from engine.model import ModelCache, load_model, shift_hidden
from tests.conftest import fixture_path
from tests.engine.model.conftest import assert_close, get_model, get_ref

ORDER = [0, 1, 2, 3, 2, 3]      # original main block of each RYS block: GDN GDN GDN ATTN GDN ATTN


def write_rys(src: str, dst, order: list[int], drop: tuple[str, ...] = ()) -> None:
    """Copy the GGUF `src` with main blocks in `order` (the MTP block stays last), raw bytes as stored,
    leaving out the tensors named in `drop`."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    n_main = r.fields[f"{arch}.block_count"].contents() - r.fields[f"{arch}.nextn_predict_layers"].contents()
    w = GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val = field.contents()
        if key == f"{arch}.block_count":
            val = len(order) + (val - n_main)
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, val, field.types[0], sub)
    new_index = {}   # old block -> new blocks
    for new, old in enumerate(order):
        new_index.setdefault(old, []).append(new)
    for b in range(n_main, n_main + 1):
        new_index[b] = [len(order) + b - n_main]
    for t in r.tensors:
        if t.name in drop:
            continue
        names = [t.name]
        if t.name.startswith("blk."):
            old = int(t.name.split(".")[1])
            rest = t.name.split(".", 2)[2]
            names = [f"blk.{n}.{rest}" for n in new_index.get(old, [])]
        for name in names:
            w.add_tensor(name, np.array(t.data), raw_shape=[int(d) for d in reversed(list(t.shape))],
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reference(model, tokens: torch.Tensor, order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The original model's blocks in the RYS order, no cache: (logits, post-norm hidden)."""
    from engine.model.layers import rope_cos_sin

    h = model.embed(tokens)
    pos = torch.arange(tokens.shape[1])[None]
    cos, sin = rope_cos_sin(pos, model.cfg.rope_dim, model.cfg.rope_theta)
    for b in order:
        blk = model.blk[b]
        a = blk.attn_norm(h)
        h = h + (blk.mixer(a, cos, sin, None) if blk.kind == ATTN else blk.mixer(a, None, None)[0])
        h = blk.feed_forward(h)
    hf = model.output_norm(h)
    return model.head(hf), hf


@pytest.fixture(scope="module")
def rys(tmp_path_factory):
    src = fixture_path("models/tiny-qwen35-f32.gguf")
    dst = tmp_path_factory.mktemp("rys") / "tiny-qwen35-rys.gguf"
    write_rys(str(src), dst, ORDER)
    with torch.inference_mode():
        return load_model(dst)


def test_rys_layer_kinds_by_tensor_presence(rys):
    assert rys.cfg.layer_kinds == (GDN, GDN, GDN, ATTN, GDN, ATTN)
    assert rys.cfg.n_layer == 6 and rys.cfg.nextn_blocks == (6,)
    cache = ModelCache(rys.cfg, 1, 16)
    assert sorted(cache.k) == [3, 5] and sorted(cache.ssm) == [0, 1, 2, 4]


def test_rys_matches_original_layers_in_repeated_order(rys):
    orig = get_model("models/tiny-qwen35-f32.gguf")
    tokens = torch.tensor(get_ref("ref/tiny-qwen35.npz")["prompt_64"], dtype=torch.long)[None]
    ref_logits, ref_hidden = _reference(orig, tokens, ORDER)
    assert_close(rys(tokens).logits[0].numpy(), ref_logits[0].numpy(), "rys logits", atol=2e-5, rtol=2e-5)
    # cached: prefill then step decode; the repeated copies must not share state
    cache = ModelCache(rys.cfg, 1, 80)
    out = rys(tokens[:, :40], cache)
    steps = [out.logits] + [rys(tokens[:, t:t + 1], cache).logits for t in range(40, 64)]
    assert_close(torch.cat(steps, 1)[0].numpy(), ref_logits[0].numpy(), "rys cached", atol=2e-5, rtol=2e-5)
    # the MTP block is still the last one and runs
    mtp = rys.mtp_forward(tokens, shift_hidden(ref_hidden))
    assert mtp.logits.shape == (1, 64, rys.cfg.n_vocab)
    # and the result differs from the original model: the repetition is really used
    assert not np.allclose(ref_logits.numpy(), orig(tokens).logits.numpy(), atol=1e-2)


def test_tied_head_when_output_weight_is_absent(tmp_path):
    """No output.weight: the head is token_embd (spec §3.1)."""
    dst = tmp_path / "tied.gguf"
    write_rys(str(fixture_path("models/tiny-qwen35-f32.gguf")), dst, [0, 1, 2, 3], drop=("output.weight",))
    tied = load_model(dst)
    assert tied.cfg.tied_output and tied.output is None
    tokens = torch.tensor(get_ref("ref/tiny-qwen35.npz")["prompt_7"], dtype=torch.long)[None]
    out = tied(tokens)
    want = out.hidden @ tied.token_embd.weight.T
    assert torch.allclose(out.logits, want, atol=1e-5)
    mtp = tied.mtp_forward(tokens, shift_hidden(out.hidden))
    assert torch.allclose(mtp.logits, mtp.hidden @ tied.token_embd.weight.T, atol=1e-5)


def test_missing_tensor_is_a_model_file_error(tmp_path):
    from engine.errors import ModelFileError

    dst = tmp_path / "broken.gguf"
    write_rys(str(fixture_path("models/tiny-qwen35-f32.gguf")), dst, [0, 1, 2, 3], drop=("blk.1.ssm_a",))
    with pytest.raises(ModelFileError, match=r"blk\.1\.ssm_a: required tensor missing"):
        load_model(dst)
