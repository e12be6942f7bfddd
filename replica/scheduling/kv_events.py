"""A paged replica's K/V events: which prompt blocks entered its prefix cache and which left it
since the last load report it sent, batched onto that report (`protocol.messages.KvEvents`) so a
router can keep a precise index of what each replica holds, after vLLM's KV events and llm-d's
precise prefix-cache scorer.

The buffer nets its changes (a block's last change wins: one evicted and stored again within a
batch is in `stored` only, one stored and evicted in `removed` only), so a batch can be applied in any order and its
size is bounded by the blocks that changed, not by the steps taken. Past `max_events` changes it
keeps none of them and sends a snapshot instead (`reset` with the whole cache), as it does on its
first batch (a replica that just started, or was restarted, holds nothing the router may still
believe), after `request_snapshot` (the router saw a gap in the batches' numbers), and every
`snapshot_every` batches unasked, so a router whose ask cannot reach the replica loses track of
it for a bounded time only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

from protocol.messages import KvEvents, LoadReport

MAX_EVENTS = 1024  # block changes per report; past it the report carries a snapshot instead
SNAPSHOT_EVERY = 256  # batches between snapshots sent unasked


class KvEventBuffer:
    """The changes since the last batch taken. `snapshot` lists every hash the cache holds now,
    least recently used first (the order the router's index should learn them in)."""

    def __init__(
        self,
        snapshot: Callable[[], Iterable[int]],
        max_events: int = MAX_EVENTS,
        snapshot_every: int = SNAPSHOT_EVERY,
    ):
        if max_events < 1 or snapshot_every < 1:
            raise ValueError(f"max_events and snapshot_every must be at least 1, got {max_events}, {snapshot_every}")
        self.max_events, self.snapshot_every = max_events, snapshot_every
        self._snapshot = snapshot
        self._seq = 0
        self._stored: dict[int, None] = {}  # ordered sets: insertion order is the order of the changes
        self._removed: dict[int, None] = {}
        self._reset = True  # nothing sent yet: the router's index of this replica starts empty
        self.snapshots = 0  # batches sent as snapshots

    def stored(self, block_hash: int) -> None:
        """A full block entered the prefix cache under `block_hash`."""
        if self._reset:
            return  # the snapshot taken at the next batch has it
        self._removed.pop(block_hash, None)
        self._stored.pop(block_hash, None)
        self._stored[block_hash] = None  # most recent last
        self._bound()

    def removed(self, block_hash: int) -> None:
        """The block filed under `block_hash` left the prefix cache (evicted or forgotten)."""
        if self._reset:
            return
        self._stored.pop(block_hash, None)
        self._removed[block_hash] = None  # even if stored since the last batch: the router may have held it before
        self._bound()

    def request_snapshot(self) -> None:
        """Send the whole cache in the next batch (the router lost track of this replica)."""
        self._reset = True
        self._stored.clear()
        self._removed.clear()

    @property
    def pending(self) -> bool:
        return self._reset or bool(self._stored) or bool(self._removed)

    def take(self) -> KvEvents | None:
        """The batch for the report being sent now (None: nothing changed), numbered one past the
        last; the buffer starts empty again."""
        if not self.pending:
            return None
        if self._reset or self._seq % self.snapshot_every == 0:
            batch = KvEvents(self._seq, stored=list(self._snapshot()), reset=True)
            self.snapshots += 1
        else:
            batch = KvEvents(self._seq, stored=list(self._stored), removed=list(self._removed))
        self._seq += 1
        self._reset = False
        self._stored.clear()
        self._removed.clear()
        return batch

    def _bound(self) -> None:
        if len(self._stored) + len(self._removed) > self.max_events:
            self.request_snapshot()


class KvEventSource(Protocol):
    """What holds a prefix cache's changes: an engine, or its slot table."""

    def take_kv_events(self) -> KvEvents | None: ...


def with_kv_events(load: LoadReport, source: KvEventSource) -> LoadReport:
    """`load` carrying the prefix cache's changes since the last report sent. Only for a report
    that is sent (the cluster's replica and the simulator throttle alike): taking the changes
    empties the buffer, so a report built and dropped would lose them."""
    return replace(load, kv_events=source.take_kv_events())
