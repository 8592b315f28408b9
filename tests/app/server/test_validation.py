"""Request validation without a model: pins (E8), strict JSON (E6), numeric bounds (E5)."""

from __future__ import annotations

import json

import pytest

from app.server.errors import ApiError
from app.server.jsonbody import parse_json_object
from app.server.pinning import resolve_pin
from app.server.requests import Limits, parse_chat, parse_completion

LIM = Limits(n_ctx_slot=1024, n_vocab=4096, n_parallel=4, aliases=("tiny",))
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("model,slot", [
    ("tiny", None), (None, None), ("tiny-slot0", 0), ("tiny-slot3", 3), ("tiny-s0", 0), ("tiny-s3", 3),
    ("other-slot2", 2), ("tiny-super", None), ("gpt-4o", None), ("tiny-s", None),
])
def test_model_name_pins(model, slot):
    assert resolve_pin({"model": model}, LIM.aliases, LIM.n_parallel) == slot


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny-slot4"}, "model"), ({"model": "tiny-s4"}, "model"), ({"model": "tiny-slot-1"}, "model"),
    ({"model": "tiny-slot01"}, "model"), ({"model": "tiny-s01"}, "model"), ({"model": "tiny-slot"}, "model"),
    ({"model": "tiny-slotA"}, "model"), ({"model": "tiny-slot99999999999999999999"}, "model"),
    ({"id_slot": 4}, "id_slot"), ({"id_slot": -2}, "id_slot"), ({"id_slot": "1"}, "id_slot"),
    ({"id_slot": True}, "id_slot"), ({"id_slot": 1.0}, "id_slot"),
    ({"id_slot": 1, "model": "tiny-slot2"}, "id_slot"),
])
def test_bad_pins_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as ei:
        resolve_pin(body, LIM.aliases, LIM.n_parallel)
    assert ei.value.status == 400 and ei.value.param == param
    assert set(ei.value.body()["error"]) == {"message", "type", "param", "code"}


def test_equal_pins_agree():
    assert resolve_pin({"id_slot": 2, "model": "tiny-s2"}, LIM.aliases, 4) == 2
    assert resolve_pin({"id_slot": -1}, LIM.aliases, 4) is None


@pytest.mark.parametrize("raw", [
    b"", b"   ", b"{", b"[1,2]", b'"x"', b"\xff\xfe{}", b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}',
    b'{"a": 1e400}', b'{"a": "\\ud800"}', b'{"\\udfff": 1}', b"{'a': 1}", b'{"a": 1,}',
    b"[" * 100000 + b"]" * 100000, b'{"a":' * 65 + b"1" + b"}" * 65,
])
def test_malformed_bodies_are_400(raw):
    with pytest.raises(ApiError) as ei:
        parse_json_object(raw)
    assert ei.value.status == 400


def test_depth_64_is_accepted():
    raw = b'{"a":' * 63 + b"[1]" + b"}" * 63
    assert isinstance(parse_json_object(raw), dict)


# field -> (min, max, lo_open, integer)
FIELDS = {
    "max_tokens": (1, 1024, False, True), "temperature": (0, 2, False, False), "top_p": (0, 1, True, False),
    "top_k": (0, 4096, False, True), "min_p": (0, 1, False, False), "presence_penalty": (-2, 2, False, False),
    "frequency_penalty": (-2, 2, False, False), "repeat_penalty": (0, 10, True, False),
    "seed": (0, 2**63 - 1, False, True), "speculative.n_max": (0, 16, False, True),
}


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_numeric_bounds(field):
    lo, hi, lo_open, integer = FIELDS[field]
    step = 1 if integer else 1e-9

    def outcome(value):
        body = {"messages": MSG, field: value}
        try:
            parse_chat(json.loads(json.dumps(body)) if value is not True else body, LIM)
            return "ok"
        except ApiError as e:
            assert e.status == 400 and e.param == field, (field, value, e.message)
            return "400"

    assert outcome(hi) == "ok"
    assert outcome(hi + step if integer else hi + 1e-6) == "400"
    assert outcome(lo) == ("400" if lo_open else "ok")
    assert outcome(lo - step if integer else lo - 1e-6) == "400"
    for bad in (True, "1", 1e308, 2**64, [1], {"a": 1}):
        assert outcome(bad) == "400", (field, bad)
    if integer:
        assert outcome(1.5) == "400"
    assert outcome(-0.0) == ("400" if lo_open or integer else "ok")


def test_stop_and_logit_bias_limits():
    ok = {"messages": MSG, "stop": ["x"] * 16, "logit_bias": {"5": 100, "4095": -100}}
    parse_chat(ok, LIM)
    for body in ({"stop": ["x"] * 17}, {"stop": ["x" * 257]}, {"stop": [""]}, {"stop": [1]},
                 {"logit_bias": {"4096": 1}}, {"logit_bias": {"-1": 1}}, {"logit_bias": {"1": 101}},
                 {"logit_bias": {str(i): 1 for i in range(1025)}}, {"n": 2},
                 {"speculative.n_max": 2, "speculative.n_min": 3}, {"speculative.p_min": 1.5}, {"mtp": "fast"}):
        with pytest.raises(ApiError):
            parse_chat({"messages": MSG, **body}, LIM)


@pytest.mark.parametrize("messages", [
    None, [], "hi", [1], [{"role": "wizard", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
    [{"role": "assistant", "content": None, "tool_calls": "x"}],
])
def test_bad_messages(messages):
    with pytest.raises(ApiError) as ei:
        parse_chat({"messages": messages}, LIM)
    assert ei.value.status == 400


def test_tools_shape_and_choice():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = parse_chat({"messages": MSG, "tools": tools, "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}}, LIM)
    assert req.tools[0]["function"]["name"] == "get_weather"
    for bad in ({"tools": [{"type": "function"}]}, {"tools": {"a": 1}},
                {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tools": tools, "tool_choice": "sometimes"}):
        with pytest.raises(ApiError):
            parse_chat({"messages": MSG, **bad}, LIM)


def test_completion_prompt():
    assert parse_completion({"prompt": "x"}, LIM).max_tokens == 16
    assert parse_completion({"prompt": [1, 2, 3]}, LIM).prompt == [1, 2, 3]
    for bad in ("", [], [4096], [True], None, 3):
        with pytest.raises(ApiError):
            parse_completion({"prompt": bad}, LIM)
