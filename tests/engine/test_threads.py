"""engine.threads: work before decoding runs in a thread that ends (its OpenMP threads end with it)."""

from __future__ import annotations

import threading

import pytest

from engine.errors import InputError
from engine.threads import in_passing_thread


def test_the_result_comes_back_from_a_thread_that_has_ended():
    ran = []

    def work():
        ran.append(threading.current_thread())
        return 42

    assert in_passing_thread(work) == 42
    (t,) = ran
    assert t is not threading.current_thread() and t.name == "mtpchat-setup" and not t.is_alive()


def test_an_error_is_raised_in_the_caller():
    def bad():
        raise InputError("model: not a GGUF file")

    with pytest.raises(InputError, match="not a GGUF file"):
        in_passing_thread(bad)
