"""Text in and out: tokenizer, chat templates, streaming detokenizer, tool-call and reasoning parsing.

Public API (issue 3). Nothing here prints; user errors are InputError / TemplateError / ModelFileError.
"""

from engine.text.detokenizer import StopMatcher, StreamingDetokenizer, TextDelta, TextStream
from engine.text.output import OutputParser, ParsedOutput, parse_output
from engine.text.template import (
    TEMPLATE_KWARGS,
    ChatTemplate,
    RenderedPrompt,
    check_template_kwargs,
    normalize_messages,
)
from engine.text.tokenizer import SpecialIds, Tokenizer, clean_text

__all__ = [
    "TEMPLATE_KWARGS", "ChatTemplate", "OutputParser", "ParsedOutput", "RenderedPrompt", "SpecialIds",
    "StopMatcher", "StreamingDetokenizer", "TextDelta", "TextStream", "Tokenizer", "check_template_kwargs",
    "clean_text", "normalize_messages", "parse_output",
]
