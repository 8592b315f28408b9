"""Carry scheduler events from the engine thread into the asyncio loop of one HTTP request."""

from __future__ import annotations

import asyncio

from engine.scheduler.types import Event


class EventBridge:
    """`put` is the scheduler sink (engine thread); `get` awaits the next event on the server loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, ev: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
        except RuntimeError:
            pass  # the loop is closed (server shutting down): nobody is listening any more

    async def get(self, timeout: float | None = None) -> Event | None:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
