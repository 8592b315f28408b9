"""The synthetic chat corpus: deterministic, rendered like the engine's template, tool calls valid."""

from __future__ import annotations

import json
import re

from engine.text.template import ChatTemplate
from recipes.demo_model import corpus
from recipes.demo_model.evaluate import schema_valid
from recipes.demo_model.train import assistant_spans
from tests.conftest import fixture_path


def test_same_index_gives_the_same_conversation_and_splits_differ():
    a = corpus.corpus_texts("train", 30)
    assert a == corpus.corpus_texts("train", 30)
    assert set(a).isdisjoint(corpus.corpus_texts("test", 30))


def test_bundled_template_is_the_real_qwen35_template():
    assert corpus.chat_template_text() == fixture_path("tokenizer/chat_template.jinja").read_text(encoding="utf-8")


def test_render_equals_the_engine_chat_template():
    tmpl = ChatTemplate(corpus.chat_template_text(), corpus_added_tokens())
    for i in range(40):
        conv = corpus.make_conversation("train", i)
        assert tmpl.render(conv.messages, conv.tools, add_generation_prompt=False).text == \
            corpus.render_conversation(conv), f"conversation {i}"


def corpus_added_tokens():
    from recipes.demo_model.tokenizer_train import ADDED_TOKENS
    return ADDED_TOKENS


def test_every_tool_call_in_the_corpus_is_schema_valid_and_answered():
    n_calls = 0
    for i in range(300):
        conv = corpus.make_conversation("train", i)
        for j, m in enumerate(conv.messages):
            for c in m.get("tool_calls", []):
                call = {"function": {"name": c["function"]["name"],
                                     "arguments": json.dumps(c["function"]["arguments"])}}
                assert schema_valid(call, conv.tools), (i, c)
                assert conv.messages[j + 1]["role"] == "tool" and conv.messages[j + 2]["role"] == "assistant"
                n_calls += 1
        if conv.tools is None:
            assert not any(m.get("tool_calls") for m in conv.messages), i
    assert n_calls > 50


def test_mix_of_topics_reasoning_and_tools():
    convs = [corpus.make_conversation("train", i) for i in range(400)]
    kinds = {e.kind for c in convs for e in c.exchanges}
    assert kinds >= {"small_talk", "arithmetic", "units", "dates", "code", "lists", "tables", "time", "file"}
    texts = [corpus.render_conversation(c) for c in convs]
    with_reasoning = sum(re.search(r"<think>\n[^\n]", t) is not None for t in texts)
    assert 0.2 < with_reasoning / len(texts) < 0.95
    assert 0.4 < sum(c.tools is not None for c in convs) / len(convs) < 0.7


def test_eval_prompt_ends_with_the_generation_prompt_and_cuts_the_answer():
    for i in range(20):
        ep = corpus.eval_prompt(corpus.make_conversation("test", i))
        assert ep.text.endswith("<|im_start|>assistant\n<think>\n")
        assert ep.text.count("<|im_start|>user\n" + ep.user + "<|im_end|>") == 1
        assert ep.expects_tool == (ep.expected_call is not None)


def test_assistant_spans_cover_the_replies_and_their_end_token():
    text = corpus.render_conversation(corpus.make_conversation("train", 1))
    spans = assistant_spans(text)
    assert spans and all(text[e - len("<|im_end|>"):e] == "<|im_end|>" for _, e in spans)
    assert all(text[s - len("<|im_start|>assistant\n"):s] == "<|im_start|>assistant\n" for s, _ in spans)
