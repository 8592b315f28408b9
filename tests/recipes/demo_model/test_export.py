"""The exporter writes the converter's layout, and the engine's loader reads back the same model."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from engine.config import ModelConfig
from engine.gguf import open_gguf
from engine.model import load_model, shift_hidden
from recipes.demo_model.export_gguf import write_gguf
from tests.conftest import fixture_path


def test_keys_and_tensors_match_the_converter_fixture(tmp_path, tiny_model, tiny_tokenizer):
    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "demo.gguf")
    ref = gguf.GGUFReader(fixture_path("models/tiny-qwen35-f32.gguf"))
    got = gguf.GGUFReader(path)
    keys = lambda r: [(k, [t.name for t in f.types]) for k, f in r.fields.items()]  # noqa: E731
    assert keys(got) == keys(ref)
    tensors = lambda r: [(t.name, t.tensor_type.name, len(t.shape)) for t in r.tensors]  # noqa: E731
    assert tensors(got) == tensors(ref)
    for k in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template",
              "qwen35.rope.dimension_sections", "qwen35.full_attention_interval", "qwen35.nextn_predict_layers",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        assert got.fields[k].contents() == ref.fields[k].contents(), k


def test_loader_reads_back_the_trained_values_and_the_same_logits(tmp_path, tiny_model, tiny_tokenizer):
    path = write_gguf(tiny_model, tiny_tokenizer, tmp_path / "demo.gguf")
    f = open_gguf(path)
    cfg = ModelConfig.from_gguf(f)
    assert cfg.layer_pattern() == "GDN GDN GDN ATTN | MTP"
    blk0 = tiny_model.net.blk[0].mixer
    a_log = blk0.parametrizations.ssm_a.original
    np.testing.assert_array_equal(f.tensor_bytes("blk.0.ssm_a").view(np.float32),
                                  (-torch.exp(a_log)).detach().numpy())
    assert (f.tensor_bytes("blk.0.ssm_a").view(np.float32) < 0).all()
    np.testing.assert_array_equal(f.tensor_bytes("output_norm.weight").view(np.float32),
                                  tiny_model.net.output_norm.weight.detach().numpy())   # stored as used, +1 included
    net = load_model(f)
    x = torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a, b = net(x), tiny_model.net(x)
        torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
        mine = tiny_model.net.head(tiny_model.mtp_passes(x, tiny_model.trunk(x), 1)[0])
        torch.testing.assert_close(net.mtp_forward(x, shift_hidden(a.hidden)).logits, mine, atol=1e-6, rtol=1e-6)
