"""A client's requests that the router's flow control holds (`protocol.flow`): each waits here
for its release, a replica to go to or the refusal that ends it, and one long poll per client
(`RouterActor.released`) brings every release there is, however many requests wait."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from cluster.connection import unwrap
from protocol.routing import Released

POLL_SECONDS = 5.0  # how long one long poll waits at the router for a release


class HeldRequests:
    def __init__(self, router_call: Callable[..., Awaitable[Any]], subscriber: str, router: Callable[[], Any]):
        self._router_call = router_call
        self._subscriber = subscriber
        self._router = router  # the router's current handle
        self._waiting: dict[str, asyncio.Future] = {}
        self._poll: asyncio.Task | None = None

    async def wait(self, request_id: str) -> str:
        """The replica the held request was released to; raises the refusal that ended it. A
        caller that leaves (cancelled) withdraws it: it is never dispatched."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        if self._poll is None or self._poll.done():
            self._poll = asyncio.get_running_loop().create_task(self._poll_releases())
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(request_id, None) is not None:
                self._router().withdraw.remote(request_id)
            raise

    async def _poll_releases(self) -> None:
        while self._waiting:
            try:
                released = await self._router_call(
                    lambda r: r.released.remote(self._subscriber, POLL_SECONDS), timeout=POLL_SECONDS + 30
                )
            except Exception as err:  # noqa: BLE001 - the router is gone for good: every held request hears why
                for future in self._waiting.values():
                    if not future.done():
                        future.set_exception(unwrap(err))
                self._waiting.clear()
                return
            for item in released:
                self._settle(item)

    def _settle(self, item: Released) -> None:
        future = self._waiting.pop(item.request_id, None)
        if future is None or future.done():  # its caller left as it was released: free its place
            if item.decision is not None:
                self._router().complete.remote(item.request_id, item.decision.replica_id)
            return
        if item.decision is not None:
            future.set_result(item.decision.replica_id)
        else:
            future.set_exception(item.refusal)
