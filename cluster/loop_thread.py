"""The client's own event loop, on a daemon thread. The client's core is async; its sync API
(`Client.generate`, `Client.stream`) runs that core here, and the moves of requests off a lost or
draining replica run here too, whichever loop (or thread) their callers use."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # stopped: what still runs (moves of a closed client) is cancelled, not left pending
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start `coro` on this loop from any thread; it runs on its own."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on this loop and wait for its result (from any thread but this loop's:
        that would wait on itself)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync client call from the client's own event loop would wait on itself")
        future = self.spawn(coro)
        try:
            return future.result()
        except BaseException:  # e.g. KeyboardInterrupt in the caller: stop the coroutine too
            future.cancel()
            raise

    def iterate(self, stream: AsyncGenerator[T, None]) -> Iterator[T]:
        """`stream` as a sync iterator, each item taken on this loop. Closing the iterator early
        closes the stream on this loop (where its cleanup runs)."""
        try:
            while True:
                try:
                    yield self.run(_next(stream))
                except StopAsyncIteration:
                    return
        finally:
            if self.loop.is_running():
                self.run(_close(stream))

    def stop(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # stopped and closed already
            pass


async def _next(stream: AsyncGenerator[T, None]) -> T:
    return await anext(stream)


async def _close(stream: AsyncGenerator[T, None]) -> None:
    await stream.aclose()
