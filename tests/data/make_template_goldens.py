"""Generate tests/data/template_goldens.json once: HF apply_chat_template output for the real Qwen3.5 (and
Qwen3.6) chat templates, text and ids (row B3, issue 3).

Reference: transformers' `apply_chat_template(..., chat_template=<fixture template>)` on a
PreTrainedTokenizerFast built from the GGUF as in make_tokenizer_goldens.py (no download). Tool-call
arguments given as a JSON string are passed to transformers already parsed (its template `|items` needs a
mapping; the engine parses them the same way); such cases say so in "hf_arguments_parsed".
Run: .venv/bin/python tests/data/make_template_goldens.py
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import transformers
from gguf import GGUFReader
from make_tokenizer_goldens import DEFAULT_GGUF, hf_reference

HERE = Path(__file__).resolve().parent
TEMPLATES = DEFAULT_GGUF.parent
OUT = HERE / "template_goldens.json"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web (résumé 中文 ok).",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array"},
        "exact": {"type": "boolean"}}, "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]


def call(name, args, cid="call_1"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def conversations():
    u = lambda c: {"role": "user", "content": c}  # noqa: E731
    a = lambda c, **kw: {"role": "assistant", "content": c, **kw}  # noqa: E731
    s = lambda c: {"role": "system", "content": c}  # noqa: E731
    t = lambda c: {"role": "tool", "content": c}  # noqa: E731
    big = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. 中文 😀 " * 800)[:51200]
    C = []  # (name, messages, tools, kwargs)
    C.append(("single_user", [u("Hello!")], None, {}))
    C.append(("system_user", [s("You are helpful."), u("Hi")], None, {}))
    C.append(("two_turns", [u("Hi"), a("Hello! How can I help?"), u("Tell me a joke.")], None, {}))
    C.append(("six_turns", [s("Be brief."), u("1"), a("one"), u("2"), a("two"), u("3"), a("three"), u("4")], None, {}))
    C.append(("no_gen_prompt", [u("Hi"), a("Hello")], None, {"add_generation_prompt": False}))
    C.append(("thinking_off", [u("Hi")], None, {"enable_thinking": False}))
    C.append(("thinking_on_explicit", [u("Hi")], None, {"enable_thinking": True}))
    C.append(("tools_no_system", [u("Weather in Paris?")], TOOLS, {}))
    C.append(("tools_with_system", [s("You are a weather bot."), u("Weather in Paris?")], TOOLS, {}))
    C.append(("tool_call_dict", [u("Weather in Paris?"),
                                 a("", tool_calls=[call("get_weather", {"city": "Paris", "days": 3})]),
                                 t('{"temp": 21}')], TOOLS, {}))
    C.append(("tool_call_json_string", [u("Weather in Paris?"),
                                        a("", tool_calls=[call("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
                                        t("21 C")], TOOLS, {}))
    C.append(("tool_call_with_content", [u("Weather?"), a("Let me check.", tool_calls=[call("get_weather", {"city": "Oslo"})]),
                                         t("cold")], TOOLS, {}))
    C.append(("parallel_calls_two_results", [u("Paris and Rome?"), a("", tool_calls=[
        call("get_weather", {"city": "Paris"}, "c1"), call("get_weather", {"city": "Rome"}, "c2")]),
        t("Paris: 20"), t("Rome: 25")], TOOLS, {}))
    C.append(("tool_args_types", [u("search"), a("", tool_calls=[call("search", {
        "query": "q", "filters": {"lang": "fr", "n": 2}, "tags": ["a", "b"], "exact": True})]), t("[]")], TOOLS, {}))
    C.append(("tool_args_none_number", [u("x"), a("", tool_calls=[call("search", {"query": None, "exact": False, "n": 1.5})]),
                                        t("ok")], TOOLS, {}))
    C.append(("tool_then_answer", [u("Weather?"), a("", tool_calls=[call("get_weather", {"city": "Oslo"})]), t("cold"),
                                   a("It is cold in Oslo."), u("Thanks")], TOOLS, {}))
    C.append(("multi_step_tools", [u("Plan a trip"), a("", tool_calls=[call("get_weather", {"city": "Oslo"})]), t("cold"),
                                   a("", tool_calls=[call("search", {"query": "Oslo hotels"})]), t("Hotel A")], TOOLS, {}))
    C.append(("reasoning_content_after_query", [u("Q1"), a("A1", reasoning_content="thinking about Q1"), u("Q2"),
                                                 a("A2", reasoning_content="thinking about Q2")], None,
              {"add_generation_prompt": False}))
    C.append(("reasoning_in_tool_turn", [u("Weather?"), a("", reasoning_content="I should call the tool.",
                                                         tool_calls=[call("get_weather", {"city": "Oslo"})]),
                                         t("cold")], TOOLS, {}))
    C.append(("think_inside_content", [u("Q"), a("<think>\nhidden steps\n</think>\n\nvisible answer"), u("next")], None, {}))
    C.append(("think_inside_content_last", [u("Q"), a("<think>\nsteps\n</think>\n\nanswer")], None,
              {"add_generation_prompt": False}))
    C.append(("content_parts", [{"role": "user", "content": [{"type": "text", "text": "part one "},
                                                             {"type": "text", "text": "part two"}]}], None, {}))
    C.append(("system_parts", [{"role": "system", "content": [{"type": "text", "text": "sys part"}]}, u("Hi")], None, {}))
    C.append(("empty_content", [u(""), a(""), u("again")], None, {}))
    C.append(("cjk_emoji_rtl", [u("你好，世界！😀 مرحبا بالعالم שלום"), a("こんにちは 👋"), u("Ελληνικά и русский")], None, {}))
    C.append(("whitespace_content", [u("  padded  \n\n"), a("\n answer \n"), u("\tTab")], None, {}))
    C.append(("big_message_50k", [u(big)], None, {}))
    C.append(("special_text_in_content", [u("What does <|im_start|> or </think> or <tool_call> mean?")], None, {}))
    C.append(("template_syntax_in_content", [u("{{ 7*7 }} {% if true %}x{% endif %}")], None, {}))
    C.append(("tool_result_json", [u("Weather?"), a("", tool_calls=[call("get_weather", {"city": "Oslo"})]),
                                   t('{"temp": -3, "desc": "snow ❄"}')], TOOLS, {"enable_thinking": False}))
    C.append(("gen_prompt_off_with_tools", [u("x"), a("y")], TOOLS, {"add_generation_prompt": False}))
    C.append(("system_whitespace_trim", [s("\n  spaced system  \n"), u("Hi")], TOOLS, {}))
    C.append(("multiline_arg_value", [u("write"), a("", tool_calls=[call("search", {"query": "line1\nline2\n  indented"})]),
                                      t("done")], TOOLS, {}))
    return C


def conversations_36():
    u = lambda c: {"role": "user", "content": c}  # noqa: E731
    a = lambda c, **kw: {"role": "assistant", "content": c, **kw}  # noqa: E731
    t = lambda c: {"role": "tool", "content": c}  # noqa: E731
    hist = [u("Q1"), a("A1", reasoning_content="R1"), u("Q2"), a("A2", reasoning_content="R2"), u("Q3")]
    return [
        ("q36_default", hist, None, {}),
        ("q36_preserve_thinking", hist, None, {"preserve_thinking": True}),
        ("q36_preserve_false", hist, None, {"preserve_thinking": False}),
        ("q36_tool_args_types", [u("x"), a("", tool_calls=[call("search", {"query": "q", "exact": True, "n": None,
                                                                          "tags": ["a"]})]), t("ok")], TOOLS, {}),
        ("q36_thinking_off", [u("Hi")], None, {"enable_thinking": False}),
    ]


def hf_messages(messages):
    out = copy.deepcopy(messages)
    parsed = False
    for m in out:
        for c in m.get("tool_calls", []):
            if isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
                parsed = True
    return out, parsed


def main() -> None:
    r = GGUFReader(DEFAULT_GGUF)

    def arr(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") if f.types[1].name == "STRING" else int(f.parts[i][0])
                for i in f.data]

    hf = hf_reference(arr("tokenizer.ggml.tokens"), arr("tokenizer.ggml.token_type"), arr("tokenizer.ggml.merges"))
    cases = []
    for tname, convs in (("chat_template.jinja", conversations()), ("chat_template-qwen36.jinja", conversations_36())):
        source = (TEMPLATES / tname).read_text(encoding="utf-8")
        for name, messages, tools, kwargs in convs:
            kw = dict(kwargs)
            agp = kw.pop("add_generation_prompt", True)
            msgs, parsed = hf_messages(messages)
            text = hf.apply_chat_template(msgs, tools=tools, chat_template=source, tokenize=False,
                                          add_generation_prompt=agp, **kw)
            ids = hf.apply_chat_template(msgs, tools=tools, chat_template=source, tokenize=True,
                                         add_generation_prompt=agp, return_dict=False, **kw)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            assert ids == hf(text, add_special_tokens=False)["input_ids"], name
            cases.append({"name": name, "template": tname, "messages": messages, "tools": tools,
                          "add_generation_prompt": agp, "template_kwargs": kw, "hf_arguments_parsed": parsed,
                          "text": text, "ids": ids})
    meta = {"source": "tests/data/make_template_goldens.py", "transformers": transformers.__version__,
            "template_sha256": {n: hashlib.sha256((TEMPLATES / n).read_bytes()).hexdigest()
                                for n in ("chat_template.jinja", "chat_template-qwen36.jinja")}}
    OUT.write_text(json.dumps({**meta, "cases": cases}, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
