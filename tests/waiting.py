"""The one way a test waits on real processes (Ray actors, a server, a subprocess): poll the
condition it needs, with a generous timeout, instead of sleeping a guessed time. Timing
itself is tested on the fake clock."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 60.0, what: str = "condition", every: float = 0.05):
    """Return the first truthy value of `predicate()`, polled every `every` seconds; raise
    TimeoutError naming `what` if none came within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
