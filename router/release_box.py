"""Where the router actor keeps what flow control released for each client until that client
takes it: the actor's one method thread puts, and each client's long poll (`RouterActor.released`,
on a thread of its own) waits and takes, so a held request costs its client one waiting call in
all, not a poll per request."""

from __future__ import annotations

import threading
from collections import defaultdict

from protocol.routing import Released


class ReleaseBox:
    def __init__(self):
        self._owner: dict[str, str] = {}  # held request id -> the client that sent it
        self._box: dict[str, list[Released]] = defaultdict(list)
        self._changed = threading.Condition()

    def hold(self, request_id: str, client: str) -> None:
        with self._changed:
            self._owner[request_id] = client

    def put(self, released: list[Released]) -> None:
        """Released requests to their clients; one held for no client known here (the actor
        restarted meanwhile) is dropped, as its client's stream to the old actor is."""
        if not released:
            return
        with self._changed:
            for item in released:
                client = self._owner.pop(item.request_id, None)
                if client is not None:
                    self._box[client].append(item)
            self._changed.notify_all()

    def take(self, client: str, timeout: float) -> list[Released]:
        """What was released for `client`, waiting up to `timeout` seconds for something."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._box.get(client)), timeout)
            return self._box.pop(client, [])

    @property
    def num_held(self) -> int:
        return len(self._owner)
