"""Where the router actor keeps what flow control released for each client until that client
takes it: the actor's one method thread puts, and each client's long poll (`RouterActor.released`,
on a thread of its own) waits and takes, so a held request costs its client one waiting call in
all, not a poll per request."""

from __future__ import annotations

import threading
from collections import defaultdict

from protocol.routing import Released, RouteRequest


class ReleaseBox:
    def __init__(self):
        self._held: dict[str, tuple[str, RouteRequest]] = {}  # held request id -> its client, the request
        self._box: dict[str, list[Released]] = defaultdict(list)
        self._changed = threading.Condition()

    def hold(self, request: RouteRequest, client: str) -> None:
        with self._changed:
            self._held[request.request_id] = (client, request)

    def withdraw(self, request_id: str) -> None:
        """Its caller left: nothing will be released for it."""
        with self._changed:
            self._held.pop(request_id, None)

    def put(self, released: list[Released]) -> list[tuple[Released, RouteRequest]]:
        """Released requests to their clients, returned with the requests they were (one held
        for no client known here, the actor restarted meanwhile, is dropped, as its client's
        stream to the old actor is)."""
        known = []
        with self._changed:
            for item in released:
                client, request = self._held.pop(item.request_id, (None, None))
                if client is not None:
                    self._box[client].append(item)
                    known.append((item, request))
            self._changed.notify_all()
        return known

    def take(self, client: str, timeout: float) -> list[Released]:
        """What was released for `client`, waiting up to `timeout` seconds for something."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._box.get(client)), timeout)
            return self._box.pop(client, [])

    @property
    def num_held(self) -> int:
        return len(self._held)
