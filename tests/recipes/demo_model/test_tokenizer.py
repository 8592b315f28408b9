"""The demo vocabulary: the fixtures' layout, and the engine's GGUF tokenizer gives the training ids."""

from __future__ import annotations

from engine.text.template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from recipes.demo_model import corpus, tokenizer_train


def _metadata(vocab):
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
            "tokenizer.ggml.tokens": vocab["tokens"], "tokenizer.ggml.token_type": vocab["token_type"],
            "tokenizer.ggml.merges": vocab["merges"], "tokenizer.ggml.eos_token_id": vocab["eos_token_id"],
            "tokenizer.ggml.padding_token_id": vocab["padding_token_id"],
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": corpus.chat_template_text()}


def test_layout_bpe_then_control_then_user_defined_then_padding(tiny_tokenizer):
    v = tokenizer_train.gguf_vocab(tiny_tokenizer, 512)
    types, tokens = v["token_type"], v["tokens"]
    n = tiny_tokenizer.get_vocab_size(with_added_tokens=True)
    n_bpe = n - len(tokenizer_train.ADDED_TOKENS)
    assert types[:n_bpe] == [1] * n_bpe
    assert tokens[n_bpe:n] == tokenizer_train.ADDED_TOKENS
    assert types[n_bpe:n] == [3, 3, 3, 4, 4, 4, 4, 4, 4]
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, 512)] and set(types[n:]) == {5}
    assert tokens[v["eos_token_id"]] == "<|im_end|>" and tokens[v["padding_token_id"]] == "<|endoftext|>"
    assert len(v["merges"]) == n_bpe - 256 and all(m.count(" ") == 1 for m in v["merges"])


def test_engine_tokenizer_from_the_gguf_keys_gives_the_training_ids(tiny_tokenizer):
    v = tokenizer_train.gguf_vocab(tiny_tokenizer, 512)
    md = _metadata(v)
    engine_tok = Tokenizer.from_metadata(md)
    tmpl = ChatTemplate.from_tokenizer_metadata(md, engine_tok)
    for i in range(60):
        conv = corpus.make_conversation("test", i)
        rp = tmpl.render(conv.messages, conv.tools, add_generation_prompt=False)
        want = tiny_tokenizer.encode(rp.text).ids
        assert engine_tok.encode_chat(rp.pieces) == want, f"conversation {i}"
        assert engine_tok.decode(want, special=True) == rp.text


def test_training_ids_continue_the_generation_prompt_as_chat_inference_does(tiny_tokenizer):
    """Every point where the model must start a reply (after the last user turn, after each tool
    result that follows it) is, in the training ids, exactly the engine's prompt ids for that cut
    (ending [<think>, \\n]), so the training data teach the choice the model makes at inference."""
    from recipes.demo_model.train import encode_corpus

    v = tokenizer_train.gguf_vocab(tiny_tokenizer, 512)
    md = _metadata(v)
    engine_tok = Tokenizer.from_metadata(md)
    tmpl = ChatTemplate.from_tokenizer_metadata(md, engine_tok)
    n_cuts = n_old_mismatch = 0
    for i in range(40):
        conv = corpus.make_conversation("test", i)
        text = corpus.render_conversation(conv)
        (ids, w), = encode_corpus(tiny_tokenizer, [text], gen_prompt_split=True)
        (old_ids, _), = encode_corpus(tiny_tokenizer, [text])
        assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text
        last_user = max(j for j, m in enumerate(conv.messages) if m["role"] == "user")
        cuts = [last_user] + [j for j, m in enumerate(conv.messages) if m["role"] == "tool" and j > last_user]
        for j in cuts:
            rp = tmpl.render(conv.messages[: j + 1], conv.tools, add_generation_prompt=True)
            prompt = engine_tok.encode_chat(rp.pieces)
            assert engine_tok.piece(prompt[-2]) == "<think>"
            assert ids[: len(prompt)] == prompt, f"conversation {i}, cut after message {j}"
            assert w[len(prompt) - 1] > 0           # the reply's first generated token is trained
            n_cuts += 1
            n_old_mismatch += old_ids[: len(prompt)] != prompt
    # the plain encoding of the rendered text (stages 1-3) misses the prompt at every empty reasoning block
    assert n_cuts >= 40 and n_old_mismatch > 0
