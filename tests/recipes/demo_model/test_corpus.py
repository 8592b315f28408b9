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


def test_a_later_stages_topic_mix_changes_only_the_topic_draws():
    default = [corpus.make_conversation("train", i) for i in range(300)]
    assert [c.messages for c in default] == [corpus.make_conversation("train", i, topic_weights=None).messages
                                             for i in range(300)]
    boosted = [corpus.make_conversation("train", i, topic_weights={"file": 0.4}) for i in range(300)]
    n_file = [sum(e.kind == "file" for c in cs for e in c.exchanges) for cs in (default, boosted)]
    assert n_file[1] > 2 * n_file[0]
    assert [c.tools is None for c in boosted] == [c.tools is None for c in default]


def test_follow_up_prompts_end_after_a_tool_result_and_name_what_to_quote():
    from recipes.demo_model.evaluate import followup_prompts, result_strings

    assert result_strings('{"result": 391}') == ["391"]
    assert result_strings('{"value": 5, "from_unit": "km", "to_unit": "mi", "result": 3.107}') == ["3.107"]
    assert result_strings('{"timezone": "Asia/Tokyo", "datetime": "2025-03-04T21:07:00+09:00"}') == ["21:07"]
    assert result_strings('{"error": "file not found: notes.txt"}') == ["notes.txt"]
    assert result_strings("- milk\n- eggs") == ["- milk", "- eggs"]
    for conv, msgs, quote in followup_prompts(12):
        assert msgs[-1]["role"] == "tool" and msgs[-2].get("tool_calls") and quote
        answer = conv.messages[len(msgs)]["content"]
        assert all(q in answer for q in quote), (answer, quote)    # the corpus's own answers quote it
