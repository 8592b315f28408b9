"""The jinja2 sandbox that chat templates run in, with a clock and an output budget (rows B1, B2).

A chat template comes from the model file, i.e. from a stranger: it runs in `ImmutableSandboxedEnvironment`
(as transformers does) with only the globals HF/llama.cpp templates use, and every render is bounded in
wall time and output size. This module knows nothing about chat messages; template.py does.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from engine.errors import TemplateError

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_OUTPUT_LIMIT = 16 * 1024 * 1024  # characters of rendered text (B2: 16 MiB)
_GUARD_ITER = "mtpchat_guard_iter"
_GUARD_CONCAT = "mtpchat_guard_concat"
_CHECK_EVERY = 256  # loop iterations between two clock reads
_BIG_NUMBER = re.compile(r"\d{8,}")  # a width/precision in a format string long enough to matter


class _Budget:
    __slots__ = ("deadline", "time_limit", "output_limit")

    def __init__(self, time_limit: float, output_limit: int):
        self.time_limit = time_limit
        self.output_limit = output_limit
        self.deadline = time.monotonic() + time_limit

    def check_clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateError(f"template rejected: time limit of {self.time_limit:g} s exceeded")

    def check_size(self, n: int, what: str) -> None:
        if n > self.output_limit:
            raise TemplateError(
                f"template rejected: {what} of {n} characters exceeds the output limit of {self.output_limit}")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("mtpchat_template_budget", default=None)


def _check_clock() -> None:
    b = _budget.get()
    if b is not None:
        b.check_clock()


def _check_size(n: int, what: str) -> None:
    b = _budget.get()
    if b is not None:
        b.check_size(n, what)


def _check_args(args: tuple, kwargs: dict) -> None:
    """Refuse integer arguments that could only be used to allocate huge results (center(10**9) ...)."""
    b = _budget.get()
    if b is None:
        return
    for v in (*args, *kwargs.values()):
        if type(v) is int and abs(v) > b.output_limit:
            raise TemplateError(f"template rejected: argument {v} exceeds the output limit of {b.output_limit}")


def _len_or_zero(x: Any) -> int:
    return len(x) if isinstance(x, str | list | tuple) else 0


class TemplateRaised(Exception):
    """raise_exception() called by the template itself (e.g. 'No user query found in messages.')."""


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's override: no HTML escaping, no ASCII escaping; options exposed (chat_template_utils.py)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attribute names (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):  # noqa: N805 - same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check_name(name)
        if isinstance(value, str | list | tuple):
            _check_size(len(value), "a namespace value")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateError(f"template rejected: unsafe namespace attribute `{name}`")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (HF's assistant-mask tag): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _GuardLoops(NodeTransformer):
    """Every `for` iterates through a clock-checking generator; every `~` concatenation is size-checked
    before it is built. Without this, `{% for i in range(10**5) %}{% for j in range(10**5) %}` runs for
    minutes without calling anything the sandbox could intercept."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _GUARD_ITER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _GUARD_CONCAT, [], [], None, None,
                            lineno=node.lineno)


def _guard_iter(value: Any) -> Iterator[Any]:
    b = _budget.get()
    if b is None:
        yield from value
        return
    for n, item in enumerate(value):
        if n % _CHECK_EVERY == 0:
            b.check_clock()
        yield item


def _guard_concat(items: list) -> str:
    parts = [str(x) for x in items]
    _check_size(sum(map(len, parts)), "a concatenation")
    return "".join(parts)


def _guard_filter(name: str, f: Any) -> Any:
    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context / pass_eval_context / pass_environment)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_clock()
        _check_args(args, kwargs)
        if name == "replace" and len(args) >= 3:
            _check_replace(args[-3] if not isinstance(args[0], str) else args[0], args[-2], args[-1])
        if name == "join" and len(args) >= 2 and not isinstance(args[1], str | jinja2.Undefined):
            # [eval_ctx, value, sep?]: size the result before building it
            items = list(args[1])
            sep = args[2] if len(args) > 2 and isinstance(args[2], str) else kwargs.get("d", "")
            if kwargs.get("attribute") is None and len(args) <= 3:
                _check_size(sum(len(x) if isinstance(x, str) else len(str(x)) for x in items)
                            + len(sep) * max(len(items) - 1, 0), "the result of |join")
            args = (args[0], items, *args[2:])
        out = f(*args, **kwargs)
        if isinstance(out, str):
            _check_size(len(out), f"the result of |{name}")
        return out

    return guarded


def _check_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = len(s) + 1 if old == "" else s.count(old)
        _check_size(len(s) + count * (len(new) - len(old)), "a replace result")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment + the B2 limits; unsafe access raises TemplateError at once."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_clock()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    _check_size(len(seq) * max(n, 0), "a repetition")
        elif operator == "+":
            _check_size(_len_or_zero(left) + _len_or_zero(right), "a concatenation")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                bits = abs(left).bit_length() * right
                if bits > 1_000_000:
                    raise TemplateError(f"template rejected: power with a {bits}-bit result")
        elif operator == "%" and isinstance(left, str) and _BIG_NUMBER.search(left):
            raise TemplateError("template rejected: %-format with a huge width or precision")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_clock()
        _check_args(args, kwargs)
        fmt = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(fmt, str):
            if name in ("format", "format_map") and _BIG_NUMBER.search(fmt):
                raise TemplateError("template rejected: str.format with a huge width or precision")
            if name == "replace" and len(args) >= 2:
                _check_replace(fmt, args[0], args[1])
        out = super().call(__context, __obj, *args, **kwargs)
        if isinstance(out, str | list | tuple):
            _check_size(len(out), f"the result of {name or 'a call'}()")
        return out

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_clock()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_clock()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise TemplateError(f"template rejected: unsafe attribute `{attribute}` of {type(obj).__name__}")

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _GuardLoops().visit(super()._parse(source, name, filename))


def make_environment() -> LimitedSandbox:
    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    for unused in ("lipsum", "cycler", "joiner"):
        env.globals.pop(unused, None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.filters["tojson"] = _tojson
    env.filters = {n: _guard_filter(n, f) for n, f in env.filters.items()}
    env.filters[_GUARD_ITER] = _guard_iter
    env.filters[_GUARD_CONCAT] = _guard_concat
    return env


def compile_template(source: str) -> jinja2.Template:
    if not isinstance(source, str):
        raise TemplateError("chat template: not a string")
    try:
        return make_environment().from_string(source)
    except TemplateError:
        raise
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template: syntax error at line {exc.lineno}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template: {exc}") from None
    except (RecursionError, MemoryError) as exc:
        raise TemplateError(f"chat template: too complex to compile ({type(exc).__name__})") from None


def render_limited(template: jinja2.Template, context: dict[str, Any], *,
                   time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                   output_limit: int = DEFAULT_OUTPUT_LIMIT) -> str:
    """Render with `generate()`, counting output as it streams; every failure is a TemplateError."""
    budget = _Budget(time_limit_s, output_limit)
    token = _budget.set(budget)
    chunks: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            budget.check_size(size, "rendered text")
            budget.check_clock()
            chunks.append(chunk)
    except TemplateError:
        raise
    except TemplateRaised as exc:
        raise TemplateError(f"template raised: {exc}") from None
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(f"template rejected: {exc}") from None
    except RecursionError:
        raise TemplateError("template rejected: recursion too deep") from None
    except MemoryError:
        raise TemplateError("template rejected: out of memory") from None
    except jinja2.TemplateError as exc:
        raise TemplateError(f"template: {exc}") from None
    except Exception as exc:  # the template's own code failed on this input: a user-facing error
        raise TemplateError(f"template: {type(exc).__name__}: {exc}") from None
    finally:
        _budget.reset(token)
    return "".join(chunks)
