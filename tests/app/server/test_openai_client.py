"""The server driven by the official `openai` client: streaming chat, a tool-call round trip, slot pins."""

from __future__ import annotations

import json

import openai
import pytest

from tests.app.server.inproc import InProcessServer
from tests.conftest import fixture_path

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALL_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
             "</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def server():
    s = InProcessServer("--model", str(fixture_path("models/tiny-qwen35-f32.gguf")), "--parallel", "2",
                        "--alias", "tiny", "--threads", "1")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_streaming_chat(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is a class?"}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join((getattr(c.choices[0].delta, "reasoning_content", None) or "") +
                   (c.choices[0].delta.content or "") for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 24 and text.strip()
    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is a class?"}],
                                          max_tokens=24, temperature=0)
    msg = full.choices[0].message
    assert (getattr(msg, "reasoning_content", None) or "") + (msg.content or "") == text
    assert full.usage.completion_tokens == 24


def test_tool_call_round_trip(client, server):
    """The tiny fixture never chooses to call a tool, so the test forces the model's output tokens for the
    first turn (backend test hook); parsing, streaming shape, dedupe and the follow-up turn are real."""
    tok = server.state.chat.tokenizer
    # the prompt ends inside <think> (the template's default): reasoning, then two identical calls
    forced = tok.encode("Let me check the weather.\n</think>\n\n" + CALL_TEXT + "\n" + CALL_TEXT)
    forced.append(tok.added_tokens["<|im_end|>"])
    forced_task = {}

    def hook(task, i, token):
        if task in forced_task.values() and i < len(forced):
            return forced[i]
        return token

    server.backend.output_hook = hook
    sched = server.state.scheduler
    orig_submit = sched.submit

    def submit(req, sink=None):
        h = orig_submit(req, sink)
        if forced_task.get("armed"):
            forced_task["task"] = h.task
            forced_task["armed"] = False
        return h

    sched.submit = submit
    try:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        for stream in (False, True):
            forced_task["armed"] = True
            if stream:
                calls: dict[int, dict] = {}
                finish = None
                reasoning = ""
                for c in client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                                        max_tokens=len(forced) + 4, stream=True,
                                                        extra_body={"mtp": "off"}):
                    if not c.choices:
                        continue
                    reasoning += getattr(c.choices[0].delta, "reasoning_content", None) or ""
                    for d in c.choices[0].delta.tool_calls or []:
                        entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                        entry["id"] = d.id or entry["id"]
                        if d.function and d.function.name:
                            entry["name"] += d.function.name
                        if d.function and d.function.arguments:
                            entry["arguments"] += d.function.arguments
                    finish = c.choices[0].finish_reason or finish
                assert finish == "tool_calls" and reasoning == "Let me check the weather."
                got = [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())]
                ids = [v["id"] for _, v in sorted(calls.items())]
            else:
                r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                                   max_tokens=len(forced) + 4, extra_body={"mtp": "off"})
                assert r.choices[0].finish_reason == "tool_calls"
                assert r.choices[0].message.reasoning_content == "Let me check the weather."
                tcs = r.choices[0].message.tool_calls
                got = [(t.function.name, json.loads(t.function.arguments)) for t in tcs]
                ids = [t.id for t in tcs]
            assert got == [("get_weather", {"city": "Paris", "days": 2})]  # the duplicate call is dropped
        # second turn: the tool result goes back, the model (not forced) answers
        follow = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": ids[0], "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
            {"role": "tool", "tool_call_id": ids[0], "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
        final = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, temperature=0,
                                               max_tokens=16)
        assert final.choices[0].finish_reason in ("stop", "length")
        assert final.choices[0].message.tool_calls is None
        assert final.usage.prompt_tokens > 40
    finally:
        sched.submit = orig_submit
        server.backend.output_hook = None


def test_slot_pins_land_on_their_slots(client, server):
    import httpx
    for i in (0, 1):
        r = client.chat.completions.with_raw_response.create(
            model=f"tiny-slot{i}", messages=[{"role": "user", "content": f"pin {i}"}], max_tokens=3 + i,
            temperature=0)
        assert r.headers["x-mtpchat-slot"] == str(i)
        assert r.parse().model == f"tiny-slot{i}"
        slots = httpx.get(server.url + "/slots").json()
        assert slots[i]["params"]["n_predict"] == 3 + i and slots[i]["next_token"]["n_decoded"] == 3 + i
    models = [m.id for m in client.models.list()]
    assert models == ["tiny", "tiny-slot0", "tiny-slot1"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny-slot2", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"id_slot": 7})


def test_metrics_exposition(client, server):
    import re

    import httpx
    r = client.completions.create(model="tiny-slot1", prompt="The object", max_tokens=24, temperature=0,
                                  extra_body={"mtp": "on"})
    timings = r.model_extra["timings"]
    assert timings["draft_n"] > 0
    text = httpx.get(server.url + "/metrics").text
    samples = dict(re.findall(r"^(\S+) (\S+)$", text, flags=re.M))
    lab = '{model_name="tiny",slot="1"}'
    assert float(samples["mtpchat:spec_decode_num_drafts_total" + lab]) >= 1
    assert float(samples["mtpchat:spec_decode_num_draft_tokens_total" + lab]) >= timings["draft_n"]
    assert float(samples["mtpchat:spec_decode_num_accepted_tokens_total" + lab]) >= timings["draft_n_accepted"]
    assert 'mtpchat:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0",slot="1"}' in samples
    assert 'mtpchat:spec_decode_num_drafts_per_pos_total{model_name="tiny",position="0",slot="1"}' in samples
    assert samples['mtpchat:mtp_gate_state{slot="1"}'] in ("0.0", "1.0", "2.0")
    for name in ("prompt_tokens_total", "tokens_predicted_total", "requests_processing", "requests_deferred",
                 "n_decode_total", "request_latency_seconds_count", "time_to_first_token_seconds_count"):
        assert "mtpchat:" + name in samples, name
    assert not any(k.endswith("_created") for k in samples)
    assert "# TYPE mtpchat:spec_decode_num_drafts_total counter" in text
