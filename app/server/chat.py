"""Chat text for the server: messages -> prompt ids (with message-boundary positions for checkpoints),
raw prompts -> ids, and generated text -> OpenAI `content` / `reasoning_content` / `tool_calls`, all on
engine.text (template, tokenizer, output parser).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.server.requests import ApiRequest
from engine.text.output import OutputParser as _Incremental
from engine.text.template import ChatTemplate
from engine.text.tokenizer import Tokenizer


@dataclass
class ParsedMessage:
    content: str
    reasoning: str
    tool_calls: list[dict]


class ChatText:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate):
        self.tokenizer = tokenizer
        self.template = template
        self.im_end = tokenizer.added_tokens.get("<|im_end|>")
        nl = tokenizer.encode("\n")
        self.newline = nl[0] if len(nl) == 1 else None

    def render(self, req: ApiRequest) -> tuple[list[int], tuple[int, ...], bool]:
        """Prompt ids, message-boundary positions, and whether the prompt ends inside `<think>` (the
        generation then starts as reasoning, spec §8.3)."""
        tools = req.tools
        if req.tool_choice == "none":
            tools = None
        elif isinstance(req.tool_choice, dict):
            name = req.tool_choice["function"]["name"]
            tools = [t for t in tools or [] if t["function"]["name"] == name]
        kwargs = {}
        if req.enable_thinking is not None:
            kwargs["enable_thinking"] = req.enable_thinking
        rendered = self.template.render(req.messages, tools, add_generation_prompt=True,
                                        template_kwargs=kwargs or None)
        ids = self.tokenizer.encode_chat(rendered.pieces)
        thinking_open = rendered.text.rstrip().endswith("<think>")
        return ids, self.boundaries(ids), thinking_open

    def boundaries(self, ids: list[int]) -> tuple[int, ...]:
        """Prompt lengths at the end of each message (after `<|im_end|>` and its newline): where a
        follow-up conversation shares the prefix, so where GDN checkpoints pay off (spec §6.5)."""
        out = []
        for i, t in enumerate(ids):
            if t == self.im_end:
                j = i + 1
                if j < len(ids) and ids[j] == self.newline:
                    j += 1
                out.append(j)
        return tuple(out)

    def encode_prompt(self, text: str) -> list[int]:
        """Raw /v1/completions prompt: special-token text is parsed, as llama.cpp's server does."""
        return self.tokenizer.encode(text, special=True)

    def output_parser(self, req: ApiRequest, thinking_open: bool) -> OutputParser:
        return OutputParser(req.tools if req.tool_choice != "none" else None, req.parallel_tool_calls,
                            thinking_open)


class OutputParser:
    """Generated text -> OpenAI deltas (streaming) or one message (non-streaming), on engine.text's
    incremental parser (dedupe of identical calls included, spec §8.4). With parallel_tool_calls false
    only the first call is kept."""

    def __init__(self, tools: list[dict] | None, parallel_tool_calls: bool, thinking_open: bool):
        self._inc = _Incremental(tools, thinking_open=thinking_open)
        self._parallel = parallel_tool_calls

    def _keep(self, deltas: list[dict]) -> list[dict]:
        if self._parallel:
            return deltas
        return [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]

    def feed(self, text: str) -> list[dict]:
        return self._keep(self._inc.feed(text))

    def finish(self) -> list[dict]:
        return self._keep(self._inc.finish())

    def parse_full(self, text: str) -> ParsedMessage:
        self.feed(text)
        self.finish()
        r = self._inc.result()
        calls = r.tool_calls if self._parallel else r.tool_calls[:1]
        return ParsedMessage(content=r.content, reasoning=r.reasoning_content,
                             tool_calls=[_message_call(c) for c in calls])


def _message_call(call: dict) -> dict:
    """A parsed call in the non-streaming message shape (no stream index)."""
    fn = call["function"]
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}
