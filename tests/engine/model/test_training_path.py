"""The full-sequence path (no cache) is differentiable end to end, MTP head included, and a model
built from a config round-trips its parameters by GGUF tensor name."""

from __future__ import annotations

import torch

from engine.model import Qwen35Model, shift_hidden
from tests.engine.model.conftest import F32_MODELS, get_model, get_ref


def test_backward_through_model_and_mtp():
    src = get_model(F32_MODELS["moe"][0])
    ids = get_ref(F32_MODELS["moe"][1])["prompt_33"]
    with torch.inference_mode(False), torch.enable_grad():
        tokens = torch.tensor(ids, dtype=torch.long)[None]
        model = Qwen35Model(src.cfg)
        assert set(model.gguf_tensors()) == set(src.gguf_tensors())
        with torch.no_grad():
            for name, p in model.gguf_tensors().items():
                p.copy_(src.gguf_tensors()[name].reshape(p.shape))
        out = model(tokens)
        mtp = model.mtp_forward(tokens[:, 1:], shift_hidden(out.hidden)[:, 1:])
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], tokens[0, 1:]) \
            + torch.nn.functional.cross_entropy(mtp.logits[0, :-1], tokens[0, 2:])
        loss.backward()
        grads = {n: p.grad for n, p in model.gguf_tensors().items()}
    with torch.inference_mode():
        ref = src(tokens).logits
    assert torch.allclose(out.logits.detach(), ref, atol=1e-5)
    missing = [n for n, g in grads.items() if g is None or not torch.isfinite(g).all()]
    # experts that no token routed to get no gradient; everything else must
    assert all("_exps" in n for n in missing), missing
    assert grads["blk.0.ssm_a"].abs().sum() > 0 and grads["blk.4.nextn.eh_proj.weight"].abs().sum() > 0


def test_init_weights_follows_file_conventions():
    cfg = get_model(F32_MODELS["dense"][0]).cfg
    with torch.inference_mode(False):
        t = Qwen35Model(cfg).init_weights(seed=3).gguf_tensors()
    assert torch.equal(t["output_norm.weight"], torch.ones(cfg.n_embd))
    assert torch.equal(t["blk.3.attn_q_norm.weight"], torch.ones(cfg.head_dim))
    assert torch.equal(t["blk.0.ssm_norm.weight"], torch.ones(cfg.ssm_head_v_dim))
    assert (t["blk.0.ssm_a"] < 0).all() and torch.equal(t["blk.0.ssm_dt.bias"], torch.ones(cfg.ssm_dt_rank))
    assert 0.015 < float(t["blk.0.attn_qkv.weight"].std()) < 0.025
    with torch.inference_mode(False):
        again = Qwen35Model(cfg).init_weights(seed=3).gguf_tensors()
    assert all(torch.equal(again[n], t[n]) for n in t)
