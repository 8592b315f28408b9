"""Small shared objects for the demo-model recipe tests: a tiny vocabulary and a tiny model."""

from __future__ import annotations

import pytest
import torch

from recipes.demo_model import corpus, tokenizer_train
from recipes.demo_model.model import DemoDims, DemoModel

TINY = DemoDims(n_embd=64, n_ff=96, n_head=2, n_head_kv=1, head_dim=32, rope_dim=16, ssm_k_heads=1,
                ssm_v_heads=2, ssm_head_dim=32, n_vocab=512)


@pytest.fixture(scope="package")
def tiny_tokenizer():
    return tokenizer_train.build_tokenizer(corpus.corpus_texts("train", 300), n_bpe=400)


@pytest.fixture(scope="package")
def tiny_model():
    torch.manual_seed(0)
    m = DemoModel(TINY)
    m.init_weights(torch.Generator().manual_seed(3))
    with torch.no_grad():   # norms away from 1 so a missed +1 or a swapped norm shows
        for name, p in m.named_parameters():
            if p.dim() == 1 and "parametrizations" not in name:
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    m.eval()
    return m
