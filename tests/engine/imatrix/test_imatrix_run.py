"""imatrix over the fixture models: which weights get entries, their sums against an independent recording,
the MTP warm-up's row pairing, and perplexity against exp(mean NLL) and the transformers reference
(spec/mtp-speculation.md §9; fixtures/README.md "Perplexity reference")."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from engine.errors import InputError
from engine.gguf import open_gguf
from engine.imatrix.run import compute_imatrix
from engine.model import gguf_name, load_model
from tests.conftest import fixture_path

DENSE = "models/tiny-qwen35-f32.gguf"
MOE = "models/tiny-qwen35moe-q8_0.gguf"
N_CTX = 128


@functools.cache
def _model(rel):
    return load_model(fixture_path(rel))


@functools.cache
def _ref(rel):
    with np.load(fixture_path(rel)) as z:
        return {k: z[k] for k in ("ppl_tokens", "ppl_chunk_nll", "ppl_running", "ppl")}


def _ref_for(model_rel):
    return _ref("ref/tiny-qwen35moe.npz" if "moe" in model_rel else "ref/tiny-qwen35.npz")


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    yield
    torch.set_num_threads(n)


def _expected_names(model_rel: str, mtp: bool) -> set[str]:
    """From the file alone: every matrix except the embedding table and the conv kernel; nextn only with MTP."""
    f = open_gguf(fixture_path(model_rel))
    n_nextn = f.metadata.get(f"{f.architecture}.nextn_predict_layers", 0)
    n_main = f.metadata[f"{f.architecture}.block_count"] - n_nextn
    out = set()
    for name, info in f.tensors.items():
        if len(info.shape) < 2 or name == "token_embd.weight" or name.endswith(".ssm_conv1d.weight"):
            continue
        if name.startswith("blk.") and int(name.split(".")[1]) >= n_main and not mtp:
            continue
        out.add(name)
    return out


class _LinearRecorder(TorchFunctionMode):
    """Independent recording: every F.linear whose weight is a model parameter (or one expert's slice of a
    3-D one), identified by its storage address; sums of squares in float64, one count per row."""

    def __init__(self, model):
        super().__init__()
        self.by_ptr = {}
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                self.by_ptr[p.data_ptr()] = (gguf_name(pname), 0, 1)
            elif p.dim() == 3:
                for e in range(p.shape[0]):
                    self.by_ptr[p[e].data_ptr()] = (gguf_name(pname), e, p.shape[0])
        self.sum2: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            key = self.by_ptr.get(w.data_ptr())
            if key is not None and w.dim() == 2:
                name, e, n_mat = key
                rows = x.reshape(-1, x.shape[-1]).double().numpy()
                if name not in self.sum2:
                    self.sum2[name] = np.zeros((n_mat, rows.shape[1]))
                    self.counts[name] = np.zeros(n_mat, dtype=np.int64)
                self.sum2[name][e] += (rows * rows).sum(0)
                self.counts[name][e] += rows.shape[0]
        return func(*args, **kwargs)


def _independent(model, tokens, n_chunk, mtp):
    """A plain forward per chunk (+ the nextn block over (x_q, h(q-1)), h(-1) = 0) under the recorder; the
    chunks' second-half NLL from the logits; the post-norm hidden rows."""
    rec = _LinearRecorder(model)
    nll, hidden = [], []
    with torch.inference_mode(), rec:
        for c in range(n_chunk):
            chunk = tokens[c * N_CTX:(c + 1) * N_CTX][None].long()
            out = model(chunk, logits="all")
            hidden.append(out.hidden[0].clone())
            if mtp:
                paired = torch.cat([torch.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], dim=1)
                model.mtp_forward(chunk, paired, logits="none")
            lg = out.logits[0].double().numpy()
            rows = np.arange(N_CTX // 2, N_CTX - 1)
            m = lg[rows].max(-1)
            lse = m + np.log(np.exp(lg[rows] - m[:, None]).sum(-1))
            nll.append(float(np.mean(lse - lg[rows, chunk[0, rows + 1].numpy()])))
    return rec, nll, hidden


@pytest.mark.parametrize("model_rel", [DENSE, MOE])
def test_sums_match_an_independent_recording(model_rel):
    model, ref = _model(model_rel), _ref_for(model_rel)
    tokens = torch.from_numpy(ref["ppl_tokens"])
    n_chunk = 3
    res = compute_imatrix(model, tokens, N_CTX, max_chunks=n_chunk, mtp=True, chunks_per_batch=2)
    rec, nll, _ = _independent(model, tokens, n_chunk, mtp=True)

    assert set(res.entries) == _expected_names(model_rel, mtp=True) == set(rec.sum2)
    for name, e in res.entries.items():
        np.testing.assert_array_equal(e.counts, rec.counts[name], err_msg=name)
        # float32 sums of squares accumulated in another order (batched experts against per-token rows):
        # one CPU gave a relative difference of 2.8e-6 on one MoE element of 1024
        np.testing.assert_allclose(e.in_sum2, rec.sum2[name], rtol=1e-5, atol=1e-9, err_msg=name)

    # perplexity = exp(mean NLL) of the independent computation, and the transformers figures per chunk
    np.testing.assert_allclose(res.meter.chunk_nll, nll, rtol=1e-6)
    running = [math.exp(sum(nll[:i + 1]) / (i + 1)) for i in range(n_chunk)]
    np.testing.assert_allclose(res.meter.running, running, rtol=1e-6)
    np.testing.assert_allclose(res.meter.chunk_nll, ref["ppl_chunk_nll"][:n_chunk], rtol=1e-5)


def test_moe_experts_have_per_expert_entries():
    model, ref = _model(MOE), _ref_for(MOE)
    cfg = model.cfg
    res = compute_imatrix(model, torch.from_numpy(ref["ppl_tokens"]), N_CTX, max_chunks=2, mtp=True)
    rows = 2 * N_CTX
    for blk in range(cfg.n_block):
        for kind, n_cols in (("gate", cfg.n_embd), ("up", cfg.n_embd), ("down", cfg.n_ff_exp)):
            e = res.entries[f"blk.{blk}.ffn_{kind}_exps.weight"]
            assert e.in_sum2.shape == (cfg.n_expert, n_cols)
            assert int(e.counts.sum()) == rows * cfg.n_expert_used   # tokens × experts used
        assert res.entries[f"blk.{blk}.ffn_gate_inp.weight"].counts.tolist() == [rows]
    # an expert that saw no rows has zero sums (written as a partial entry, as llama.cpp does)
    for name, e in res.entries.items():
        assert np.all(e.in_sum2[e.counts == 0] == 0), name


def test_without_mtp_no_nextn_entries():
    model, ref = _model(DENSE), _ref_for(DENSE)
    tokens = torch.from_numpy(ref["ppl_tokens"])
    res = compute_imatrix(model, tokens, N_CTX, max_chunks=2, mtp=False)
    assert set(res.entries) == _expected_names(DENSE, mtp=False)
    assert not any(n.startswith("blk.4.") for n in res.entries)
    with_mtp = compute_imatrix(model, tokens, N_CTX, max_chunks=2, mtp=True)
    assert {n for n in with_mtp.entries if n.startswith("blk.4.")} == {
        "blk.4.nextn.eh_proj.weight", "blk.4.attn_q.weight", "blk.4.attn_k.weight", "blk.4.attn_v.weight",
        "blk.4.attn_output.weight", "blk.4.ffn_gate.weight", "blk.4.ffn_up.weight", "blk.4.ffn_down.weight"}
    # the main model's entries do not depend on the MTP pass
    for name, e in res.entries.items():
        np.testing.assert_array_equal(e.in_sum2, with_mtp.entries[name].in_sum2, err_msg=name)


def test_mtp_rows_pair_token_q_with_hidden_q_minus_1():
    """eh_proj's input is [enorm(emb(x_q)) | hnorm(h(q-1))] with h(-1) = 0 (spec §1, §9.2): its hidden half
    sums hnorm² over rows 0..n_ctx-2 of each chunk — not the seed's rows 0..n_ctx-1."""
    model, ref = _model(DENSE), _ref_for(DENSE)
    tokens = torch.from_numpy(ref["ppl_tokens"])
    res = compute_imatrix(model, tokens, N_CTX, max_chunks=2, mtp=True)
    _, _, hidden = _independent(model, tokens, 2, mtp=False)
    E, eps = model.cfg.n_embd, model.cfg.rms_eps
    w = model.blk[4].nextn.hnorm.weight.double()

    def hnorm(h):
        h = h.double()
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w

    got = res.entries["blk.4.nextn.eh_proj.weight"].in_sum2[0, E:]
    want = sum((hnorm(h[:-1]) ** 2).sum(0) for h in hidden).numpy()
    seed = sum((hnorm(h) ** 2).sum(0) for h in hidden).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.abs(got - seed).max() > 1e-3 * np.abs(seed).max()


def test_dense_fixture_perplexity_matches_reference():
    """All 95 chunks of the fixture text at n_ctx 128, MTP warm-up on: 8.24605 (transformers) to 1e-3."""
    model, ref = _model(DENSE), _ref_for(DENSE)
    t0 = time.perf_counter()
    res = compute_imatrix(model, torch.from_numpy(ref["ppl_tokens"]), N_CTX, mtp=True)
    seconds = time.perf_counter() - t0
    assert res.n_chunk == 95 and res.meter.count == 5985
    assert res.meter.ppl == pytest.approx(8.24605, rel=1e-3)
    assert res.meter.ppl == pytest.approx(float(ref["ppl"]), rel=1e-5)
    np.testing.assert_allclose(res.meter.running, ref["ppl_running"], rtol=1e-5)
    print(f"95 chunks, n_ctx 128, MTP on: {seconds:.1f} s, PPL {res.meter.ppl:.5f}")


def test_hooks_are_gone_after_a_run_and_mtp_needs_a_nextn_block():
    model, ref = _model(DENSE), _ref_for(DENSE)
    tokens = torch.from_numpy(ref["ppl_tokens"])
    compute_imatrix(model, tokens, N_CTX, max_chunks=2, mtp=True)
    assert "head" not in vars(model)
    assert not any(m._forward_pre_hooks for m in model.modules())

    no_nextn = copy.copy(model)  # shares the weights; only the config says "no MTP block"
    no_nextn.cfg = dataclasses.replace(model.cfg, n_block=model.cfg.n_layer, n_nextn=0)
    with pytest.raises(InputError, match="--mtp: this model file has no nextn"):
        compute_imatrix(no_nextn, tokens, N_CTX, max_chunks=2, mtp=True)
