"""User-facing error types of the engine (STYLE.md §3).

Each is raised for a bad input with the path/field that is wrong; internal bugs stay ordinary exceptions.
"""

from __future__ import annotations


class MtpchatError(Exception):
    """Base of every error caused by the user's input rather than by a bug."""


class ModelFileError(MtpchatError):
    """A model file (GGUF) that cannot be used: truncated, malformed, unsupported or inconsistent."""

    def __init__(self, path: object, what: str):
        self.path = str(path)
        self.what = what
        super().__init__(f"{self.path}: {what}")


class InputError(MtpchatError):
    """A bad argument or request: names the argument and why it is refused."""


class TemplateError(MtpchatError):
    """A chat template that fails to render, or a render that exceeds its limits."""
