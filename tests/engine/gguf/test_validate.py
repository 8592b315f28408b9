"""Row A4 of spec/reliability-matrix.md: structurally valid files that are the wrong model, plus what must load."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from engine.config import ATTN, GDN
from engine.errors import ModelFileError
from engine.gguf import load_model_file
from tests.engine.gguf.tiny_gguf import TinyDims, tiny_plan, write

D = TinyDims()
E = D.n_embd


def _f32(*shape):
    return np.ones(shape, np.float32)


def _drop(name):
    return lambda p: p.drop_tensor(name)


def _shape(name, *shape):
    return lambda p: p.set_tensor(name, _f32(*shape))


def _key(key, value, vtype, sub=None):
    return lambda p: p.set_key(key, value, vtype, sub)


def _nokey(key):
    return lambda p: p.drop_key(key)


def _add(name, *shape, t=T.F32, data=None):
    return lambda p: p.set_tensor(name, data if data is not None else _f32(*shape), t)


def _tokens(n):
    return lambda p: p.set_key("tokenizer.ggml.tokens", [f"t{i}" for i in range(n)], V.ARRAY, V.STRING)


def _block_count(n):
    return _key("qwen35.block_count", n, V.UINT32)


# (edit, name that must appear in the message, moe?)
EDITS = [
    # missing tensors, one per family
    (_drop("token_embd.weight"), "token_embd.weight", False),
    (_drop("output_norm.weight"), "output_norm.weight", False),
    (_drop("blk.0.attn_norm.weight"), "blk.0.attn_norm.weight", False),
    (_drop("blk.0.post_attention_norm.weight"), "blk.0.post_attention_norm.weight", False),
    (_drop("blk.0.attn_qkv.weight"), "blk.0.attn_qkv.weight", False),
    (_drop("blk.0.attn_gate.weight"), "blk.0.attn_gate.weight", False),
    (_drop("blk.1.ssm_conv1d.weight"), "blk.1.ssm_conv1d.weight", False),
    (_drop("blk.1.ssm_dt.bias"), "blk.1.ssm_dt.bias", False),
    (_drop("blk.1.ssm_a"), "blk.1.ssm_a", False),
    (_drop("blk.2.ssm_beta.weight"), "blk.2.ssm_beta.weight", False),
    (_drop("blk.2.ssm_alpha.weight"), "blk.2.ssm_alpha.weight", False),
    (_drop("blk.2.ssm_norm.weight"), "blk.2.ssm_norm.weight", False),
    (_drop("blk.2.ssm_out.weight"), "blk.2.ssm_out.weight", False),
    (_drop("blk.0.ffn_gate.weight"), "blk.0.ffn_gate.weight", False),
    (_drop("blk.3.ffn_up.weight"), "blk.3.ffn_up.weight", False),
    (_drop("blk.3.ffn_down.weight"), "blk.3.ffn_down.weight", False),
    (_drop("blk.3.attn_q.weight"), "blk.3.attn_q.weight", False),  # falls back to the interval rule: ATTN
    (_drop("blk.3.attn_k.weight"), "blk.3.attn_k.weight", False),
    (_drop("blk.3.attn_v.weight"), "blk.3.attn_v.weight", False),
    (_drop("blk.3.attn_output.weight"), "blk.3.attn_output.weight", False),
    (_drop("blk.3.attn_q_norm.weight"), "blk.3.attn_q_norm.weight", False),
    (_drop("blk.3.attn_k_norm.weight"), "blk.3.attn_k_norm.weight", False),
    # incomplete MTP block
    (_drop("blk.4.nextn.enorm.weight"), "blk.4.nextn.enorm.weight", False),
    (_drop("blk.4.nextn.hnorm.weight"), "blk.4.nextn.hnorm.weight", False),
    (_drop("blk.4.attn_k.weight"), "blk.4.attn_k.weight", False),
    (_drop("blk.4.ffn_up.weight"), "blk.4.ffn_up.weight", False),
    # MoE families
    (_drop("blk.0.ffn_gate_inp.weight"), "blk.0.ffn_gate_inp.weight", True),
    (_drop("blk.1.ffn_down_exps.weight"), "blk.1.ffn_down_exps.weight", True),
    (_drop("blk.3.ffn_up_shexp.weight"), "blk.3.ffn_up_shexp.weight", True),
    (_shape("blk.0.ffn_gate_exps.weight", D.n_expert + 1, D.n_ff_exp, E), "blk.0.ffn_gate_exps.weight", True),
    (_shape("blk.0.ffn_gate_inp_shexp.weight", 2, E), "blk.0.ffn_gate_inp_shexp.weight", True),
    (_key("qwen35moe.expert_used_count", 3, V.UINT32), "qwen35moe.expert_used_count", True),
    (_nokey("qwen35moe.expert_count"), "qwen35moe.expert_count", True),
    # wrong shapes
    (_shape("blk.0.attn_qkv.weight", 5, E), "blk.0.attn_qkv.weight", False),
    (_shape("blk.3.attn_q.weight", 2 * D.n_head * D.head_dim, E + 1), "blk.3.attn_q.weight", False),
    (_shape("blk.4.nextn.eh_proj.weight", E, E), "blk.4.nextn.eh_proj.weight", False),
    (_shape("output_norm.weight", E + 1), "output_norm.weight", False),
    (_shape("blk.0.ssm_conv1d.weight", 3, D.conv_kernel), "blk.0.ssm_conv1d.weight", False),
    (_shape("output.weight", D.n_vocab + 1, E), "output.weight", False),
    # vocabulary sizes disagree
    (_tokens(D.n_vocab + 1), "tokenizer.ggml.tokens", False),
    (_key("tokenizer.ggml.token_type", [1] * (D.n_vocab - 1), V.ARRAY, V.INT32), "tokenizer.ggml.token_type", False),
    (_key("qwen35.vocab_size", D.n_vocab + 5, V.UINT32), "qwen35.vocab_size", False),
    (_nokey("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens", False),
    # special ids out of range
    (_key("tokenizer.ggml.eos_token_id", D.n_vocab, V.UINT32), "tokenizer.ggml.eos_token_id", False),
    (_key("tokenizer.ggml.padding_token_id", 2**32 - 1, V.UINT32), "tokenizer.ggml.padding_token_id", False),
    (_key("tokenizer.ggml.bos_token_id", -1, V.INT32), "tokenizer.ggml.bos_token_id", False),
    # keys with the wrong type or value
    (_key("qwen35.block_count", "5", V.STRING), "qwen35.block_count", False),
    (_key("qwen35.embedding_length", 4.0, V.FLOAT32), "qwen35.embedding_length", False),
    (_key("qwen35.rope.freq_base", "1e7", V.STRING), "qwen35.rope.freq_base", False),
    (_key("qwen35.rope.freq_base", float("nan"), V.FLOAT32), "qwen35.rope.freq_base", False),
    (_key("qwen35.attention.layer_norm_rms_epsilon", -1.0, V.FLOAT32), "layer_norm_rms_epsilon", False),
    (_key("qwen35.rope.dimension_sections", ["a", "b"], V.ARRAY, V.STRING), "qwen35.rope.dimension_sections", False),
    (_key("qwen35.rope.dimension_sections", [1.5, 0.0], V.ARRAY, V.FLOAT32), "qwen35.rope.dimension_sections",
     False),
    (_key("tokenizer.ggml.tokens", list(range(D.n_vocab)), V.ARRAY, V.INT32), "tokenizer.ggml.tokens", False),
    (_key("tokenizer.ggml.eos_token_id", "x", V.STRING), "tokenizer.ggml.eos_token_id", False),
    (_key("tokenizer.ggml.add_bos_token", 1, V.UINT8), "tokenizer.ggml.add_bos_token", False),
    (_key("tokenizer.chat_template", 7, V.UINT32), "tokenizer.chat_template", False),
    (_key("qwen35.attention.value_length", D.head_dim * 2, V.UINT32), "qwen35.attention.value_length", False),
    (_key("qwen35.attention.head_count_kv", 3, V.UINT32), "qwen35.attention.head_count_kv", False),
    (_key("qwen35.ssm.inner_size", 6, V.UINT32), "qwen35.ssm.inner_size", False),
    (_key("qwen35.attention.key_length", 0, V.UINT32), "qwen35.attention.key_length", False),
    (_nokey("qwen35.attention.key_length"), "qwen35.attention.key_length", False),
    (_nokey("qwen35.ssm.state_size"), "qwen35.ssm.state_size", False),
    (_key("general.architecture", "llama", V.STRING), "general.architecture", False),
    (_key("general.architecture", 3, V.UINT32), "general.architecture", False),
    # block_count larger or smaller than the blocks present
    (_block_count(7), "block_count", False),
    (_block_count(6), "block_count", False),
    (_block_count(3), "block_count", False),
    # unsupported types, named
    (_add("token_embd.weight", data=np.zeros((D.n_vocab, 40), np.uint8), t=T.Q8_1), "type Q8_1 is not supported",
     False),
    (_add("blk.0.ssm_a", data=np.zeros(D.ssm_dt_rank, np.int32), t=T.I32), "blk.0.ssm_a: type I32", False),
    # 1-D tensors must stay float
    (_add("blk.0.attn_norm.weight", data=np.zeros((1, 34), np.uint8), t=T.Q8_0), "blk.0.attn_norm.weight", False),
    # fused Qwen3-Next tensors, a block with both kinds, unknown and out-of-range tensors
    (_add("blk.0.ssm_ba.weight", 4, E), "blk.0.ssm_ba.weight", False),
    (_add("blk.1.ssm_in.weight", 4, E), "blk.1.ssm_in.weight", False),
    (_add("blk.0.attn_q.weight", 2 * D.n_head * D.head_dim, E), "blk.0", False),
    (_add("blk.0.attn_bias", E), "blk.0.attn_bias", False),
    (_add("blk.9.attn_norm.weight", E), "blk.9.attn_norm.weight", False),
    (_add("blk.2.nextn.enorm.weight", E), "blk.2.nextn.enorm.weight: MTP tensor in main block", False),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("a4")
    for moe in (False, True):
        load_model_file(write(tiny_plan(moe=moe), d / f"base-{moe}.gguf"))  # both bases are valid
    return d


def test_a4_single_edits_are_rejected_naming_the_key_or_tensor(base):
    assert len(EDITS) >= 40
    named, generic, accepted = 0, [], []
    for i, (edit, expected, moe) in enumerate(EDITS):
        plan = tiny_plan(moe=moe)
        edit(plan)
        p = write(plan, base / f"edit-{i}.gguf")
        try:
            load_model_file(p)
            accepted.append(expected)
        except ModelFileError as exc:
            if expected in exc.what:
                named += 1
            else:
                generic.append((expected, exc.what))
    print(f"METRIC A4 edits={len(EDITS)} named={named} generic={len(generic)}")
    assert not accepted, accepted
    assert not generic, generic


def test_messages_say_expected_and_found(tmp_path):
    plan = tiny_plan()
    plan.set_tensor("blk.0.attn_qkv.weight", _f32(5, E))
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_qkv\.weight: expected shape \[\d+, 4\].*found \[5, 4\]"):
        load_model_file(write(plan, tmp_path / "a.gguf"))


def test_tokenizer_only_file_opens_but_is_not_a_model(tmp_path):
    plan = tiny_plan()
    plan.tensors = []
    p = write(plan, tmp_path / "vocab.gguf")
    from engine.gguf import open_gguf

    assert len(open_gguf(p).metadata["tokenizer.ggml.tokens"]) == D.n_vocab
    with pytest.raises(ModelFileError, match="has no model weights"):
        load_model_file(p)


def test_file_without_mtp_loads_without_mtp(tmp_path):
    m = load_model_file(write(tiny_plan(mtp=False), tmp_path / "nomtp.gguf"))
    assert not m.config.has_mtp and m.config.layer_pattern() == "GDN GDN GDN ATTN"


def test_declared_mtp_whose_tensors_were_dropped_loads_without_mtp(tmp_path):
    plan = tiny_plan(mtp=False)
    plan.set_key("qwen35.block_count", D.n_main + 1, V.UINT32)
    plan.set_key("qwen35.nextn_predict_layers", 1, V.UINT32)
    m = load_model_file(write(plan, tmp_path / "dropped.gguf"))
    assert not m.config.has_mtp and m.config.n_block == D.n_main


def test_tied_output_loads_tied(tmp_path):
    m = load_model_file(write(tiny_plan(tied=True), tmp_path / "tied.gguf"))
    assert m.config.tied_output


def test_reduced_mtp_forms_that_ik_loads_are_accepted_and_reported(tmp_path):
    plan = tiny_plan()
    for n in ("blk.4.nextn.eh_proj.weight", "blk.4.nextn.shared_head_norm.weight", "blk.4.ffn_gate.weight",
              "blk.4.ffn_up.weight", "blk.4.ffn_down.weight", "blk.4.post_attention_norm.weight"):
        plan.drop_tensor(n)
    m = load_model_file(write(plan, tmp_path / "reduced.gguf"))
    assert m.config.has_mtp
    assert m.mtp_form == ("blk.4: no eh_proj", "blk.4: no shared_head_norm", "blk.4: no FFN")


def test_rys_layer_kinds_come_from_tensors_not_the_interval(tmp_path):
    """A repeated GDN span breaks the period-4 pattern (spec §5.2): kinds follow tensor presence."""
    plan = tiny_plan(mtp=False)
    extra = [(n.replace("blk.2.", "blk.4.", 1), a, t) for n, a, t in plan.tensors if n.startswith("blk.2.")]
    renamed = []
    for n, a, t in plan.tensors:
        if n.startswith("blk.3."):
            n = n.replace("blk.3.", "blk.5.", 1)
        renamed.append((n, a, t))
    plan.tensors = renamed + extra
    for n, a, t in list(plan.tensors):
        if n.startswith("blk.2."):
            plan.tensors.append((n.replace("blk.2.", "blk.3.", 1), a, t))
    plan.set_key("qwen35.block_count", 6, V.UINT32)
    m = load_model_file(write(plan, tmp_path / "rys.gguf"))
    assert m.config.layer_kinds == (GDN, GDN, GDN, GDN, GDN, ATTN)


@pytest.mark.parametrize("name", ["tiny-qwen35-f32", "tiny-qwen35-q8_0", "tiny-qwen35-q6_k", "tiny-qwen35-q4_k_m",
                                  "tiny-qwen35-iq4_xs", "tiny-qwen35moe-q8_0"])
def test_every_fixture_model_passes_all_checks(name):
    from tests.conftest import fixture_path

    m = load_model_file(fixture_path(f"models/{name}.gguf"))
    c = m.config
    assert c.layer_pattern() == "GDN GDN GDN ATTN | MTP" and c.n_vocab == 4096 and not c.tied_output
    assert c.is_moe == ("moe" in name) and m.mtp_form == ()
