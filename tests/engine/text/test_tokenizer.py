"""The Qwen3.5 tokenizer built from the vocab-only GGUF: golden ids, special-token modes, end-of-generation
ids, the lone-surrogate rule and the literal (no added token) path."""

from __future__ import annotations

import unicodedata

import pytest

from engine.errors import InputError, ModelFileError
from engine.text import Tokenizer, clean_text
from engine.text.tokenizer import QWEN35_SPLIT_REGEX


def test_golden_ids_plain_and_special(qwen_tok, tokenizer_goldens):
    assert len(tokenizer_goldens) >= 200
    categories = {c["category"] for c in tokenizer_goldens}
    assert {"prose", "code", "numbers", "whitespace", "cjk", "indic_thai_marks", "emoji", "mixed",
            "lone_surrogate"} <= categories
    wrong = [(c["text"], qwen_tok.encode(c["text"]), c["ids"]) for c in tokenizer_goldens
             if qwen_tok.encode(c["text"]) != c["ids"]]
    assert not wrong, wrong[:3]
    wrong = [c["text"] for c in tokenizer_goldens if qwen_tok.encode(c["text"], special=True) != c["ids_special"]]
    assert not wrong, wrong[:3]


def test_known_ids_from_fixture_readme(qwen_tok):
    assert qwen_tok.encode("Hello") == [9419]
    assert qwen_tok.encode("\n") == [198] and qwen_tok.encode("\n\n") == [271]
    # U+0301 followed by "!I": the qwen35 regex keeps combining marks in letter runs (README caveat)
    assert qwen_tok.encode("\u0301!I") == [52033, 87383]


def test_special_modes(qwen_tok):
    text = "<|im_start|>user\n<think>x</think><tool_call><|im_end|>"
    plain = qwen_tok.encode(text)
    special = qwen_tok.encode(text, special=True)
    literal = qwen_tok.encode_literal(text)
    # plain = llama.cpp parse_special=false: CONTROL literal, USER_DEFINED matched
    assert 248045 not in plain and 248046 not in plain
    assert plain.count(248068) == 1 and plain.count(248069) == 1 and plain.count(248058) == 1
    assert special[0] == 248045 and special[-1] == 248046 and 248068 in special
    assert not set(literal) & set(qwen_tok.added_tokens.values())
    assert qwen_tok.decode(literal) == text == qwen_tok.decode(special, special=True)


def test_literal_path_equals_library_path(qwen_tok, tokenizer_goldens):
    # the pre-tokenizer + model path used for text holding added-token strings equals the library pipeline
    for c in tokenizer_goldens:
        if c["category"] != "added_token_text":
            assert qwen_tok._encode_without_added(clean_text(c["text"])) == c["ids"], c["text"]
        else:
            ids = qwen_tok.encode_literal(c["text"])
            assert not set(ids) & set(qwen_tok.added_tokens.values())
            assert qwen_tok.decode(ids) == c["text"]


def test_special_ids_and_end_of_generation(qwen_tok):
    sp = qwen_tok.special
    assert (sp.bos, sp.eos, sp.eot, sp.pad) == (248044, 248046, 248046, 248044)
    assert sp.add_bos is False and sp.add_eos is False
    assert sp.eog == {248044, 248046, 248063, 248064, 248065}  # what llama.cpp derives (fixtures README)
    assert qwen_tok.n_vocab == 248320
    assert len(qwen_tok.added_tokens) == 33
    assert len(qwen_tok.control_ids) == 27 and len(qwen_tok.user_defined_ids) == 6
    assert qwen_tok.added_tokens["<think>"] == 248068 and qwen_tok.added_tokens["<|im_start|>"] == 248045


def test_lone_surrogates_become_replacement_char(qwen_tok):
    # A lone surrogate cannot be UTF-8: the engine replaces it with U+FFFD everywhere text enters.
    assert qwen_tok.encode("a\ud800b") == qwen_tok.encode("a\ufffdb")
    assert qwen_tok.encode("\ud83d\ude00") == qwen_tok.encode("\U0001F600")  # a written-out pair is joined
    assert qwen_tok.decode(qwen_tok.encode("x\udfff")) == "x\ufffd"


def test_decode_round_trip_is_nfc(qwen_tok, tokenizer_goldens):
    for c in tokenizer_goldens:
        if c["category"] in ("lone_surrogate", "added_token_text"):
            continue
        assert qwen_tok.decode(c["ids"]) == unicodedata.normalize("NFC", c["text"]), c["text"]


def test_token_bytes(qwen_tok):
    assert qwen_tok.token_bytes(9419) == b"Hello"
    assert qwen_tok.token_bytes(248046) == b""  # CONTROL hidden unless special
    assert qwen_tok.token_bytes(248046, special=True) == b"<|im_end|>"
    assert qwen_tok.token_bytes(248068) == b"<think>"  # USER_DEFINED always shown (the parsers need it)
    assert qwen_tok.token_bytes(248100) == b""  # UNUSED padding slot
    ids = qwen_tok.encode("中")
    assert b"".join(qwen_tok.token_bytes(i) for i in ids) == "中".encode()
    with pytest.raises(InputError):
        qwen_tok.token_bytes(248320)


def test_non_string_input_is_input_error(qwen_tok):
    with pytest.raises(InputError, match="text: expected a string"):
        qwen_tok.encode(b"bytes")


def _tiny_md(**over):
    # A toy byte-level vocab: the 256 byte symbols plus one merge and two added tokens.
    from engine.text.tokenizer import _bytes_to_unicode

    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + ["ab", "<|im_end|>", "<think>"]
    types = [1] * (len(symbols) + 1) + [3, 4]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["a b"],
          "tokenizer.ggml.eos_token_id": len(tokens) - 2}
    md.update(over)
    return md


def test_tiny_vocab_builds_and_merges():
    tok = Tokenizer.from_metadata(_tiny_md())
    ab = tok.encode("ab")
    assert ab == [256]
    assert tok.encode("<think>ab<|im_end|>", special=True) == [258, 256, 257]
    assert tok.special.eog == {257}


@pytest.mark.parametrize("over, msg", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "bloom"}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type"),
    ({"tokenizer.ggml.eos_token_id": 10**6}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.ggml.merges": ["x y"]}, "cannot build BPE"),
])
def test_bad_metadata_is_model_file_error(over, msg):
    with pytest.raises(ModelFileError, match=msg):
        Tokenizer.from_metadata(_tiny_md(**over), source="bad.gguf")


def test_split_regex_is_the_qwen35_one():
    assert r"[\p{L}\p{M}]+" in QWEN35_SPLIT_REGEX


def test_added_token_in_the_middle_keeps_its_gguf_id():
    from engine.text.tokenizer import _bytes_to_unicode

    symbols = list(_bytes_to_unicode().values())
    tokens = symbols[:100] + ["<|im_end|>"] + symbols[100:] + ["ab"]
    types = [1] * 100 + [3] + [1] * (len(symbols) - 100) + [1]
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
                                   "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                   "tokenizer.ggml.merges": ["a b"]})
    assert tok.encode("ab<|im_end|>", special=True) == [257, 100]
    assert tok.decode([257, 100], special=True) == "ab<|im_end|>"
