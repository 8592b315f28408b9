"""Which OS threads run torch's parallel CPU work.

libgomp, the OpenMP runtime of torch's CPU builds and of inductor's compiled kernels, gives every thread
that runs a parallel region a team of threads of its own and keeps it until that thread ends. While two
such teams live (the main thread loaded the model, a scheduler thread decodes), more threads than CPUs are
managed: libgomp then stops letting idle team threads spin between parallel regions, and each region wakes
its threads from sleep. The demo model's compiled decode step took 2.6 ms in a scheduler's thread against
0.39 ms in the thread that had done everything (2-vCPU AMD EPYC, docs/benchmarks.md, thirty-first session).
So the work before decoding (loading, packing, allocating the caches) runs in a thread that then ends and
takes its team with it, and the background compiler's thread ends whenever its queue is empty
(engine.model.steps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T], name: str = "mtpchat-setup") -> T:
    """fn() run in a new thread that ends when it returns: its result, or its exception raised here."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:   # noqa: BLE001 - every failure is the caller's to handle
            box["error"] = exc

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
